"""engines/formats/tensor_payload.py, the restricted unpickler of SGLang's
serialized_named_tensors: real ForkingPickler payloads (torch's public API, the
"file_system" sharing strategy) decode to equal tensors; a pickle that names any
other callable is refused, naming it, before anything is called."""
from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401  (registers torch's reductions)

from engines.formats.tensor_payload import (MAX_PAYLOAD_CHARS, NamedTensorUnpickler, PayloadError,
                                    _Marker, decode_named_tensors)

MB = 1 << 20


@pytest.fixture
def strategy():
    """Set torch's sharing strategy for one test, then put back what it was."""
    before = mp.get_sharing_strategy()
    yield mp.set_sharing_strategy
    mp.set_sharing_strategy(before)


def serialize(named) -> str:
    """What SGLang's trainers send for one rank: base64 of a ForkingPickler dump."""
    return base64.b64encode(bytes(ForkingPickler.dumps(named))).decode()


@dataclass
class FlattenedTensorMetadata:
    """The fields of SGLang's bucket metadata (its name is what the unpickler maps)."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flattened(tensors: dict[str, torch.Tensor]) -> dict:
    """SGLang's flattened bucket: every tensor's bytes back to back in one uint8 tensor,
    byte offsets in the metadata."""
    parts, metadata, at = [], [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + raw.numel(),
                                                t.numel()))
        parts.append(raw)
        at += raw.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def calls(module: str, name: str, arg: str = "") -> str:
    """A pickle (protocol 0 opcodes) that calls module.name(arg), as a payload."""
    raw = f"c{module}\n{name}\n(V{arg}\ntR.".encode()
    return base64.b64encode(raw).decode()


def test_a_forking_pickler_payload_decodes_to_equal_tensors(strategy):
    strategy("file_system")
    named = [("a", torch.randn(3, 4)),
             ("b", torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))),
             ("c", torch.randn(4, 3).t()),                 # not contiguous
             ("d", torch.arange(10.0, dtype=torch.float64)[2:7]),   # an offset view
             ("e", torch.zeros(0))]
    got = decode_named_tensors(serialize(named), MB, 10)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, t) in zip(named, got):
        assert t.dtype == want.dtype and t.shape == want.shape and t.stride() == want.stride()
        assert torch.equal(t.detach(), want.detach())
    assert isinstance(got[1][1], torch.nn.Parameter)
    as_dict = decode_named_tensors(serialize(dict(named[:2])), MB, 10)
    assert [n for n, _ in as_dict] == ["a", "b"]


@pytest.mark.parametrize("module, name", [
    ("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
    ("subprocess", "Popen"), ("builtins", "getattr"), ("importlib", "import_module"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "load"), ("torch.serialization", "load"), ("torch.storage", "_load_from_bytes"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_event"), ("torch", "zeros"),
    ("torch.nn", "Module"), ("collections", "OrderedDict"), ("torch", "_dynamo"),
    ("torch", "Generator"), ("torch", "device"),
])
def test_a_pickle_naming_another_callable_is_refused_naming_it(tmp_path, module, name):
    marker = tmp_path / "called"
    with pytest.raises(PayloadError) as e:
        decode_named_tensors(calls(module, name, f"touch {marker}"), MB, 10)
    assert f"{module}.{name}" in str(e.value)
    assert not marker.exists()


def test_os_system_via_reduce_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os
            return os.system, (f"touch {marker}",)

    payload = base64.b64encode(pickle.dumps([("w", Evil())])).decode()
    with pytest.raises(PayloadError, match="system"):
        decode_named_tensors(payload, MB, 10)
    assert not marker.exists()


def test_a_plain_pickle_of_a_tensor_uses_torch_load_and_is_refused():
    payload = base64.b64encode(pickle.dumps([("w", torch.zeros(2))])).decode()
    with pytest.raises(PayloadError, match="torch._utils._rebuild_tensor_v2"):
        decode_named_tensors(payload, MB, 10)


def test_file_descriptor_sharing_is_refused_with_the_fix(strategy):
    strategy("file_descriptor")
    with pytest.raises(PayloadError, match='set_sharing_strategy\\("file_system"\\)'):
        decode_named_tensors(serialize([("w", torch.ones(4))]), MB, 10)


def test_the_classes_admitted_as_arguments_cannot_be_called():
    """torch.Tensor(n) or UntypedStorage(n) would allocate what the pickle asks."""
    for module, name in (("torch", "Tensor"), ("torch.storage", "UntypedStorage"),
                         ("torch.nn.parameter", "Parameter")):
        raw = f"c{module}\n{name}\n(I1000000000\ntR.".encode()
        with pytest.raises(PayloadError, match="not callable"):
            decode_named_tensors(base64.b64encode(raw).decode(), MB, 10)


def test_a_storage_outside_torchs_shared_memory_is_refused(strategy):
    strategy("file_system")
    raw = base64.b64decode(serialize([("w", torch.ones(4))]))
    assert b"/torch-shm-dir-" in raw
    with pytest.raises(PayloadError, match="manager"):       # same length: the pickle stays valid
        decode_named_tensors(base64.b64encode(raw.replace(b"/torch-shm-dir-", b"/other-shm-dir-"))
                             .decode(), MB, 10)
    segment = raw.index(b"/torch_")
    bad = raw[:segment] + b"/tmp/_" + raw[segment + 6:]
    with pytest.raises(PayloadError, match="segment"):
        decode_named_tensors(base64.b64encode(bad).decode(), MB, 10)


def test_a_view_past_its_storage_is_refused():
    unpickler = NamedTensorUnpickler(b"", MB)
    storage = torch.zeros(4)._typed_storage()
    with pytest.raises(PayloadError, match="does not fit"):
        unpickler._tensor(_Marker(torch.Tensor), storage, (0, (1000,), (1,), False))
    with pytest.raises(PayloadError):
        unpickler._tensor(_Marker(torch.Tensor), storage, (0, (2,), (-1,), False))


def test_bounds_on_bytes_count_and_size(strategy):
    strategy("file_system")
    payload = serialize([("a", torch.ones(1024)), ("b", torch.ones(1024))])
    with pytest.raises(PayloadError, match="more bytes"):
        decode_named_tensors(payload, 4096, 10)              # 8 KiB mapped
    with pytest.raises(PayloadError, match="1 to 1"):
        decode_named_tensors(payload, MB, 1)
    assert len(decode_named_tensors(payload, 8192, 2)) == 2
    for bad in ("", "not base64!", "A" * (MAX_PAYLOAD_CHARS + 4), 7):
        with pytest.raises(PayloadError):
            decode_named_tensors(bad, MB, 10)


def test_a_flattened_bucket_decodes_to_views_of_its_tensor(strategy):
    strategy("file_system")
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5, dtype=torch.bfloat16),
               "c": torch.randn(2, 2, dtype=torch.float64)}
    got = decode_named_tensors(serialize(flattened(tensors)), MB, 10, bucket=True)
    assert [n for n, _ in got] == list(tensors)
    for (_, t), want in zip(got, tensors.values()):
        assert t.dtype == want.dtype and torch.equal(t, want)
    with pytest.raises(PayloadError):                  # a bucket is not a list of pairs
        decode_named_tensors(serialize(flattened(tensors)), MB, 10)


@pytest.mark.parametrize("change, why", [
    ({"end_idx": 10**6}, "end_idx"), ({"numel": 13}, "does not hold"),
    ({"shape": torch.Size([4, 4])}, "does not hold"), ({"start_idx": 3}, "does not fit"),
    ({"dtype": "float32"}, "dtype"), ({"name": None}, "lacks"),
])
def test_a_bucket_whose_metadata_lies_is_refused(strategy, change, why):
    strategy("file_system")
    bucket = flattened({"a": torch.randn(3, 4)})
    for k, v in change.items():
        setattr(bucket["metadata"][0], k, v)
    with pytest.raises(PayloadError, match=why):
        decode_named_tensors(serialize(bucket), MB, 10, bucket=True)


def test_bucket_entries_cannot_reuse_the_flat_tensor(strategy):
    """Overlapping entries could make each misaligned one a copy of all of it."""
    strategy("file_system")
    bucket = flattened({"a": torch.randn(3, 4)})
    bucket["metadata"] *= 2
    bucket["metadata"][1] = FlattenedTensorMetadata("b", torch.Size([3, 4]), torch.float32,
                                                    0, 48, 12)
    with pytest.raises(PayloadError, match="cover more"):
        decode_named_tensors(serialize(bucket), MB, 10, bucket=True)


def test_bucket_metadata_with_other_fields_is_refused(strategy):
    strategy("file_system")
    bucket = flattened({"a": torch.randn(3, 4)})
    bucket["metadata"][0].extra = "x"
    with pytest.raises(PayloadError, match="other fields"):
        decode_named_tensors(serialize(bucket), MB, 10, bucket=True)


@pytest.mark.parametrize("obj", [[], [("a",)], [(1, torch.ones(1))], [("a", [1.0])], "x",
                                 [("a", torch.Size([2]))]])
def test_what_is_not_a_list_of_named_tensors_is_refused(obj):
    payload = base64.b64encode(pickle.dumps(obj)).decode()
    with pytest.raises(PayloadError):
        decode_named_tensors(payload, MB, 10)
