"""Releasing and resuming memory by SGLang's tags on in-process workers: the weights'
memory really goes (measured as this process's resident set), comes back bit for bit,
nothing runs the model meanwhile, and a refusal releases nothing. Also the version
commands: update_weight_version, and update_weights without a version."""
from __future__ import annotations

import ctypes
import gc
import os
import stat

import pytest
import torch

from engines import weight_release
from engines.loader import load_model
from tests.unit.hf_models import make_checkpoint
from tests.unit.inproc import InprocCluster, reference

PROMPT = [5, 17, 99, 3, 42, 7]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(core) -> int:
    return sum(s.nbytes() for s in weight_release._storages(core.model.net))


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def big(request, tmp_path_factory):
    """A random Llama, or mixture of experts, of ~90 MB in float32: large enough to see
    in the resident set (the mixture's experts hold per-expert views and packed copies
    of their own, which must go too)."""
    sizes = dict(moe_intermediate_size=384) if request.param == "qwen3_moe" else {}
    return make_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"), hidden_size=512,
                           intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=8000, **sizes)


@pytest.fixture
def cluster():
    c = InprocCluster()
    yield c
    c.close()


def states(cluster) -> list[tuple[str, str]]:
    return [(c.status_fields().to_wire()["memory"], c.status_fields().to_wire()["weights_memory"])
            for c in (cluster.prefill, cluster.decode)]


def test_released_weights_free_their_memory_and_come_back_bit_for_bit(big):
    c = InprocCluster(model=str(big), dtype="float32", kv_cache_mb=4)
    try:
        before = c.run(c.submit(PROMPT, 12)).token_ids
        params = {n: p.detach().clone() for n, p in c.decode.model.net.named_parameters()}
        size = weight_bytes(c.prefill) + weight_bytes(c.decode)
        assert size > 150e6
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)      # earlier tests' freed heap goes now, not
        at_start = rss()                             # with the release (seen: 2.1 GB in a full run)
        assert c.admin("release_memory", tags=["weights"])["ok"]
        dropped = at_start - rss()
        assert weight_bytes(c.prefill) == weight_bytes(c.decode) == 0
        assert dropped > 0.9 * size, (dropped, size)     # more may go: other frees
        assert states(c) == [("resident", "released")] * 2
        rid = c.submit(PROMPT, 12)                   # held: nothing may run the model now
        c.pump(60)
        assert rid not in c.answers or not c.answers[rid].token_ids
        assert c.admin("resume_memory", tags=["weights"])["ok"]
        assert rss() - at_start > -0.1 * size                    # all of it back
        assert c.run(rid).token_ids == before
        assert all(torch.equal(p, params[n]) for n, p in c.decode.model.net.named_parameters())
        assert states(c) == [("resident", "resident")] * 2
        c.check_pages()
    finally:
        c.close()


def test_no_tags_release_all_and_weights_cannot_be_updated_meanwhile(cluster):
    assert cluster.admin("release_memory")["ok"]
    assert states(cluster) == [("released", "released")] * 2
    reply = cluster.admin("update_weights", path="tiny:7", version="v2")
    assert not reply["ok"] and {w["status"] for w in reply["workers"]} == {409}
    assert cluster.admin("release_memory", tags=["cuda_graph"])["ok"]     # nothing to do
    assert cluster.admin("resume_memory", tags=["kv_cache"])["ok"]
    assert states(cluster) == [("resident", "released")] * 2
    assert cluster.admin("resume_memory")["ok"]
    assert states(cluster) == [("resident", "resident")] * 2
    cluster.serves_again()


def test_a_refused_release_releases_nothing(cluster):
    rid = cluster.submit(PROMPT, 200)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 2)
    reply = cluster.admin("release_memory")                 # the router refuses it
    assert not reply["ok"] and reply["status"] == 409 and "pause first" in reply["error"]
    assert states(cluster) == [("resident", "resident")] * 2
    # paused in place, the decode's batch still holds the request: that worker refuses
    assert cluster.admin("pause", mode="in_place")["ok"]
    reply = cluster.admin("release_memory", tags=["weights"])
    refused = {w["role"]: w.get("status") for w in reply["workers"] if not w["ok"]}
    assert not reply["ok"] and refused == {"decode": 409}, reply
    assert cluster.decode.status_fields().to_wire()["weights_memory"] == "resident"
    assert cluster.admin("resume_memory")["ok"]             # the prefill's, if it went
    assert cluster.admin("continue")["ok"]
    assert cluster.run(rid, rounds=2000).token_ids == reference(cluster, PROMPT, 200)
    # retracted requests hold no batch: the weights may go, and the request resumes exactly
    rid = cluster.submit(PROMPT, 40)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 2)
    assert cluster.admin("pause", mode="retract")["ok"]
    assert cluster.admin("release_memory", tags=["weights"])["ok"]
    reply = cluster.admin("continue")         # nothing could run: refused, still paused
    assert not reply["ok"] and {w.get("status") for w in reply["workers"]} == {409}, reply
    cluster.pump(40)
    assert cluster.admin("resume_memory", tags=["weights"])["ok"]
    assert cluster.admin("continue")["ok"]
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, 40)
    cluster.check_pages()


@pytest.mark.parametrize("tags", ["weights", ["weights", 3], ["gpu"], ["x"] * 9])
def test_bad_tags_are_refused(cluster, tags):
    """By the router, before any worker sees them (the record's check, zpd/wire/admin.py)."""
    reply = cluster.admin("release_memory", tags=tags)
    assert not reply["ok"] and reply["status"] == 400 and "tags" in reply["error"]
    assert "workers" not in reply
    assert states(cluster) == [("resident", "resident")] * 2


def test_update_weight_version_changes_the_version_not_the_weights(cluster):
    first = cluster.run(cluster.submit(PROMPT, 6))
    assert set(first.weight_versions) == {"tiny"}
    reply = cluster.admin("update_weight_version", version="step-9")
    assert reply["ok"] and {w["weight_version"] for w in reply["workers"]} == {"step-9"}
    again = cluster.run(cluster.submit(PROMPT, 6))
    assert again.token_ids == first.token_ids and set(again.weight_versions) == {"step-9"}
    assert not cluster.admin("update_weight_version")["ok"]                  # required
    assert not cluster.admin("update_weight_version", version="")["ok"]
    # a weight update without a version keeps it (SGLang's update_weights_from_disk)
    assert cluster.admin("update_weights", path="tiny:3")["ok"]
    assert cluster.prefill.model.version == cluster.decode.model.version == "step-9"


def test_the_spill_file_is_private_and_goes_on_resume():
    model = load_model("tiny", dtype="float32")
    want = {n: p.detach().clone() for n, p in model.net.named_parameters()}
    held = weight_release.release(model.net, model.device)
    assert stat.S_IMODE(os.stat(held.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(held.path)).st_mode) == 0o700
    assert os.path.getsize(held.path) == held.nbytes
    assert all(p.untyped_storage().nbytes() == 0 for p in model.net.parameters())
    folder = os.path.dirname(held.path)
    weight_release.resume(held)
    assert not os.path.exists(folder)
    assert all(torch.equal(p, want[n]) for n, p in model.net.named_parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_device_memory_goes_and_comes_back(big):
    model = load_model(str(big), device="cuda", dtype="float32")
    want = {n: p.detach().cpu() for n, p in model.net.named_parameters()}
    size = sum(s.nbytes() for s in weight_release._storages(model.net))
    torch.cuda.synchronize()
    at_start = torch.cuda.memory_allocated()
    held = weight_release.release(model.net, model.device)
    assert at_start - torch.cuda.memory_allocated() >= 0.99 * size
    assert held.path is None and sum(h.nbytes for h in held.host) == size
    weight_release.resume(held)
    assert torch.cuda.memory_allocated() - at_start < 0.01 * size
    assert all(torch.equal(p.cpu(), want[n]) for n, p in model.net.named_parameters())
