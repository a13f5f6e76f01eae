"""Stand-ins for SGLang's weight-payload records (sglang is not installed here), each
pickling under SGLang's own module path and name, with SGLang's fields: what its
MultiprocessingSerializer writes. The modules exist in sys.modules only while
`dumps` pickles (pickle checks that a class can be found where it says it lives)."""
from __future__ import annotations

import base64
import contextlib
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator

import torch

BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner_components.weight_updater"   # >= 0.5.16
OLD_RUNNER_MODULE = "sglang.srt.model_executor.model_runner"


@dataclass
class FlattenedTensorMetadata:
    """sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata's fields."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """SGLang's: one MultiprocessingSerializer dump of the tensor per rank."""
    values: list


@dataclass
class OldLocalSerializedTensor:
    """The same class where SGLang kept it before 0.5.16."""
    values: list


FlattenedTensorMetadata.__module__ = BUCKET_MODULE
LocalSerializedTensor.__module__ = RUNNER_MODULE
OldLocalSerializedTensor.__module__ = OLD_RUNNER_MODULE
OldLocalSerializedTensor.__qualname__ = OldLocalSerializedTensor.__name__ = "LocalSerializedTensor"


def local_serialized(values: list, module: str = RUNNER_MODULE) -> LocalSerializedTensor:
    """A LocalSerializedTensor pickling as SGLang's class in `module` (its old home, or
    its new one)."""
    return (LocalSerializedTensor if module == RUNNER_MODULE else OldLocalSerializedTensor)(values)


@contextlib.contextmanager
def registered(*classes: type) -> Iterator[None]:
    """`classes` findable at their module paths (and those modules' parents) for now."""
    added = []
    for cls in classes:
        parts = cls.__module__.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules:
                sys.modules[name] = types.ModuleType(name)
                added.append(name)
        setattr(sys.modules[cls.__module__], cls.__qualname__, cls)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def dumps(obj: Any) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize(obj): a ForkingPickler dump."""
    classes = {type(o) for o in _walk(obj) if type(o).__module__.startswith("sglang.")}
    with registered(*classes):
        return bytes(ForkingPickler.dumps(obj))


def serialize(obj: Any) -> str:
    """... with output_str=True: base64 text, one entry of serialized_named_tensors."""
    return base64.b64encode(dumps(obj)).decode()


def _walk(obj: Any) -> Iterator[Any]:
    yield obj
    if isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _walk(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _walk(o)


def _rebuild_cuda_tensor_modified(*args: Any) -> None:
    """sglang.srt.utils.patch_torch's name for its CUDA rebuild; never to be run."""
    raise AssertionError("a payload's own function must never run")


_rebuild_cuda_tensor_modified.__module__ = "sglang.srt.utils.patch_torch"


class SglangCudaTensor:
    """What SGLang's patched reduce_tensor writes for a CUDA tensor: torch's 15
    rebuild_cuda_tensor arguments, the device as its GPU's UUID (fake handles)."""

    def __reduce__(self) -> tuple:
        return _rebuild_cuda_tensor_modified, (
            torch.Tensor, (2,), (1,), 0, torch.UntypedStorage, torch.float32,
            "GPU-12345678-1234-1234-1234-123456789abc", b"h" * 64, 8, 0, False, b"r" * 8, 0,
            b"e" * 64, True)


def cuda_payload() -> str:
    with registered(_rebuild_cuda_tensor_modified):
        return base64.b64encode(bytes(ForkingPickler.dumps([("w", SglangCudaTensor())]))).decode()
