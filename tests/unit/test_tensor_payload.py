"""engines/formats/tensor_payload.py, the restricted unpickler of SGLang's
serialized_named_tensors: real ForkingPickler payloads (torch's public API, the
"file_system" sharing strategy) decode to equal tensors; a pickle that names any
other callable is refused, naming it, before anything is called."""
from __future__ import annotations

import base64
import pickle
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401  (registers torch's reductions)

from engines.formats.tensor_payload import (MAX_PAYLOAD_CHARS, NamedTensorUnpickler, PayloadError,
                                    _Marker, decode_named_tensors)
from tests.unit.sglang_standin import (OLD_RUNNER_MODULE, RUNNER_MODULE, FlattenedTensorMetadata,
                                      cuda_payload, dumps, local_serialized, serialize)

__all__ = ["flattened", "serialize", "verl_payload"]     # what the sync tests take

MB = 1 << 20


@pytest.fixture
def strategy():
    """Set torch's sharing strategy for one test, then put back what it was."""
    before = mp.get_sharing_strategy()
    yield mp.set_sharing_strategy
    mp.set_sharing_strategy(before)


def flattened(tensors: dict[str, torch.Tensor]) -> dict:
    """SGLang 0.5's flattened bucket (FlattenedTensorBucket with supports_multi_dtypes):
    every tensor's bytes back to back in one uint8 tensor; start_idx, end_idx and
    numel count bytes."""
    parts, metadata, at = [], [], 0
    for name, t in tensors.items():
        raw = t.flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + raw.numel(),
                                                raw.numel()))
        parts.append(raw)
        at += raw.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def flattened_by_element(tensors: dict[str, torch.Tensor]) -> dict:
    """The older layout: one dtype, start_idx, end_idx and numel count elements."""
    parts, metadata, at = [], [], 0
    for name, t in tensors.items():
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + t.numel(),
                                                t.numel()))
        parts.append(t.flatten())
        at += t.numel()
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
    ("torch", "load"), ("torch.serialization", "load"), ("torch.storage", "_load_from_bytes"),
    ("torch._utils", "_rebuild_tensor_v2"), ("sglang.srt.utils", "MultiprocessingSerializer"),
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
    ({"end_idx": 40}, "does not fit"),
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
                                                    0, 48, 48)
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


# --- what SGLang's clients send ----------------------------------------------------------

def test_sglang_05_byte_bucket_as_its_serializer_writes_it(strategy):
    """sglang 0.5.23's FlattenedTensorBucket: (576,) float32 is 2304 bytes (the 400
    "shape (576,) does not hold 2304" before)."""
    strategy("file_system")
    tensors = {"model.layers.0.input_layernorm.weight": torch.randn(576),
               "b": torch.randn(3, dtype=torch.bfloat16), "c": torch.arange(6).view(2, 3)}
    bucket = flattened(tensors)
    assert bucket["flattened_tensor"].dtype == torch.uint8
    assert bucket["metadata"][0].numel == 2304
    got = decode_named_tensors(serialize(bucket), MB, 10, bucket=True)
    assert [n for n, _ in got] == list(tensors)
    for (_, t), want in zip(got, tensors.values()):        # "b" ends unaligned for "c"
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)


def test_the_older_element_bucket_still_decodes(strategy):
    strategy("file_system")
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    got = decode_named_tensors(serialize(flattened_by_element(tensors)), MB, 10, bucket=True)
    assert all(torch.equal(t, want) for (_, t), want in zip(got, tensors.values()))


def test_bucket_metadata_is_admitted_only_as_sglangs_class(strategy):
    strategy("file_system")
    bucket = flattened({"a": torch.randn(2)})
    raw = base64.b64decode(serialize(bucket)).replace(b"sglang.srt.weight_sync.tensor_bucket",
                                                      b"sglang.srt.weight_sync.tensor_buckeX")
    with pytest.raises(PayloadError, match="tensor_buckeX.FlattenedTensorMetadata"):
        decode_named_tensors(base64.b64encode(raw).decode(), MB, 10, bucket=True)


def verl_payload(per_rank: list[list[tuple[str, torch.Tensor]]], module: str = RUNNER_MODULE
                 ) -> str:
    """sglang's weight_sync.utils.update_weights (verl): per tensor a
    LocalSerializedTensor of one MultiprocessingSerializer dump per TP rank."""
    return serialize([(group[0][0], local_serialized([dumps(t) for _, t in group], module))
                      for group in zip(*per_rank)])


@pytest.mark.parametrize("module", [RUNNER_MODULE, OLD_RUNNER_MODULE])
def test_local_serialized_tensor_gives_each_rank_its_value(strategy, module):
    strategy("file_system")
    ranks = [[("w", torch.full((2, 3), float(r))), ("v", torch.arange(4.0) + r)] for r in range(2)]
    payload = verl_payload(ranks, module)
    for rank in range(2):
        got = decode_named_tensors(payload, MB, 10, rank=rank, ranks=2)
        assert [n for n, _ in got] == ["w", "v"]
        assert all(torch.equal(t, want) for (_, t), (_, want) in zip(got, ranks[rank]))
    shared = verl_payload(ranks[:1])                  # one value: every worker takes it
    assert torch.equal(decode_named_tensors(shared, MB, 10, rank=1, ranks=2)[0][1], ranks[0][0][1])
    with pytest.raises(PayloadError, match="has 2 values: give one"):
        decode_named_tensors(payload, MB, 10, rank=0, ranks=3)


def test_a_local_serialized_value_is_unpickled_as_strictly(tmp_path, strategy):
    strategy("file_system")
    marker = tmp_path / "pwned"
    evil = base64.b64decode(calls("os", "system", f"touch {marker}"))
    with pytest.raises(PayloadError, match="os.system"):
        decode_named_tensors(serialize([("w", local_serialized([evil]))]), MB, 10)
    assert not marker.exists()
    with pytest.raises(PayloadError, match="not a tensor"):
        decode_named_tensors(serialize([("w", local_serialized([dumps([1])]))]), MB, 10)
    big = serialize([("w", local_serialized([dumps(torch.ones(1024))]))])
    with pytest.raises(PayloadError, match="more bytes"):          # the budget is shared
        decode_named_tensors(big, 1024, 10)


def test_file_descriptor_sharing_is_received_from_the_senders_own_process_tree(strategy):
    """A DupFd's descriptor is handed to a process holding the sender's multiprocessing
    authkey: this one, for a payload it made itself (as a trainer's child would)."""
    strategy("file_descriptor")
    want = torch.randn(4, 5)
    raw = base64.b64decode(serialize([("w", want)]))
    assert b"rebuild_storage_fd" in raw and b"DupFd" in raw
    got = decode_named_tensors(base64.b64encode(raw).decode(), MB, 10)
    assert torch.equal(got[0][1], want)


SENDER = r"""
import base64, sys, torch, torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler
mp.set_sharing_strategy("file_descriptor")
t = torch.ones(8)
print(base64.b64encode(bytes(ForkingPickler.dumps([("w", t)]))).decode(), flush=True)
sys.stdin.readline()
"""


def test_file_descriptor_sharing_from_an_unrelated_sender_is_refused_with_the_fix():
    """A trainer that is not this process's multiprocessing parent: its listener refuses
    our authkey; the 400 names set_sharing_strategy("file_system")."""
    sender = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        payload = sender.stdout.readline().strip()
        with pytest.raises(PayloadError, match='not a multiprocessing child.*set_sharing_strategy'
                                               '\\("file_system"\\)'):
            decode_named_tensors(payload, MB, 10)
    finally:
        sender.stdin.close()
        sender.wait(30)
    with pytest.raises(PayloadError, match='listener is gone.*file_system'):   # sender gone
        decode_named_tensors(payload, MB, 10)


def test_a_dupfd_naming_another_socket_is_refused():
    state = {"_id": ("/run/docker.sock", 1)}
    with pytest.raises(PayloadError, match="not a multiprocessing listener"):
        NamedTensorUnpickler(b"", MB)._storage_fd(_Marker(torch.UntypedStorage),
                                                  _shared_fd(state), 4)


def _shared_fd(state: dict):
    from engines.formats.shared_fd import SharedFd
    fd = SharedFd.__new__(SharedFd)
    fd.__setstate__(state)
    return fd


def test_sglangs_cuda_rebuild_is_admitted_and_refused_clearly_without_cuda():
    """SGLang's patched reduction names its own function and the GPU by UUID: admitted
    and checked as torch's; here, without CUDA (or without that GPU), refused saying so,
    and the payload's own function never runs."""
    why = "CUDA IPC handles.*no CUDA" if not torch.cuda.is_available() else "this host lacks"
    with pytest.raises(PayloadError, match=why):
        decode_named_tensors(cuda_payload(), MB, 10)
