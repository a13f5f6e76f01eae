"""Tensor-parallel workers (`zpd prefill/decode --tp N`): a prefill of p ranks and a
decode of d ranks, for (p, d) in (2, 1), (1, 2), (2, 2), answer `zpd run`'s greedy
tokens at one rank in float64, with every page back on every rank; a retraction
cycle; weights updated from disk, released and resumed, and pushed by a trainer
(whole or partial), on every rank; a rank that dies stops its worker. The other ranks are real
processes joined by gloo; the KV moves through the fake transport between the
leaders' views of every rank's pool."""
from __future__ import annotations

import pytest
import torch

from tests.unit.inproc import InprocCluster, reference

PROMPTS = [torch.randint(1, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 23, 40)]


@pytest.fixture(params=[(2, 1), (1, 2), (2, 2)], ids=lambda tp: f"p{tp[0]}d{tp[1]}")
def tp_cluster(request):
    c = InprocCluster(tp=request.param)
    yield c
    c.close()


def test_greedy_tokens_equal_zpd_run_at_one_rank(tp_cluster):
    c = tp_cluster
    rids = [c.submit(p, 12) for p in PROMPTS]
    for rid, prompt in zip(rids, PROMPTS):
        assert c.run(rid).token_ids == reference(c, prompt, 12), rid
    c.pump()
    c.check_pages()
    # the decode's ranks hold what its own forwards wrote: none of them is still zero
    for buf in c.decode.rank_buffers:
        assert buf.abs().sum() > 0


def test_a_retraction_cycle(tmp_path):
    c = InprocCluster(tp=(2, 1))
    try:
        rid = c.submit(PROMPTS[2], 16)
        c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= 4)
        assert c.admin("pause", mode="retract")["ok"]
        assert c.admin("continue")["ok"]
        got = c.run(rid)
        assert got.meta["retractions"] == 1
        assert got.token_ids == reference(c, PROMPTS[2], 16)
        c.check_pages()
    finally:
        c.close()


def test_weights_from_disk_on_every_rank(tmp_path):
    from engines.loader import load_model
    from engines.models.tiny import save_tiny
    from engines.offline import OfflineEngine
    from engines.request import Request
    from engines.sampler import SamplingParams
    new = save_tiny(tmp_path / "tiny1", seed=1)
    c = InprocCluster(tp=(2, 2))
    try:
        assert c.admin("pause", mode="retract")["ok"]
        got = c.admin("update_weights", path=str(new), weight_version="v1")
        assert got["ok"], got
        assert c.admin("continue")["ok"]
        answer = c.run(c.submit(PROMPTS[1], 10))
        model = load_model(str(new), dtype="float64")
        ref = OfflineEngine(model, kv_cache_mb=1).run([Request("r", PROMPTS[1], SamplingParams(
            temperature=0, max_new_tokens=10, ignore_eos=True))])[0]["output_ids"]
        assert answer.token_ids == ref and set(answer.weight_versions) == {"v1"}
    finally:
        c.close()


def test_memory_released_and_resumed_on_every_rank():
    """KV pools and weights of every rank go and come back (the other ranks' pools in
    new shared memory that rank 0 opens and registers again); then the same answers."""
    c = InprocCluster(tp=(2, 2))
    try:
        got = c.admin("release_memory")
        assert got["ok"], got
        assert c.decode.rank_buffers == [] and c.decode.memory.weights_held is not None
        got = c.admin("resume_memory")
        assert got["ok"], got
        assert len(c.decode.rank_buffers) == 2 and c.decode.memory.weights_held is None
        c.serves_again(PROMPTS[1])
    finally:
        c.close()


def _pushed(tensors: dict):
    """tiny with `tensors` (Hugging Face names) written over it: what a push makes."""
    from engines.formats.weights import apply_checkpoint, lazy, read_checkpoint
    from engines.loader import load_model
    from engines.models.tiny import tiny_state_dict
    model = load_model("tiny", dtype="float64")
    mixed = tiny_state_dict(0) | tensors
    apply_checkpoint(model.net, read_checkpoint(model.net, [lazy(n, t) for n, t in mixed.items()],
                                                "push"))
    return model


def _part_of(core, model) -> bool:
    """Rank 0's weights are exactly its slice of `model`'s."""
    from engines.tp.shard import weight_slice
    want, shard = dict(model.net.named_parameters()), core.model.shard
    return all(torch.equal(p, weight_slice(n, want[n], shard.whole, shard.plan))
               for n, p in core.model.net.named_parameters())


@pytest.mark.parametrize("part", ["all", "mlp", "q_proj"])
def test_a_trainers_push_reaches_every_rank(part):
    """A trainer pushes whole tensors (Hugging Face names; a partial push too, q_proj
    being some rows of the fused qkv_proj): rank 0 stages them and every rank takes the
    rows of its part; then the tokens of the model the push made, on every rank."""
    from engines.models.tiny import tiny_state_dict
    from tests.unit.test_handoff import reference_tiny_model
    from tests.unit.test_weight_sync import join, push
    from tests.unit.trainer_side import Trainer
    w2 = tiny_state_dict(7)
    tensors = w2 if part == "all" else {n: t for n, t in w2.items() if f".{part}." in n}
    want = _pushed(tensors)
    c, t = InprocCluster(kv_cache_mb=2.0, tp=(2, 2)), Trainer(world_size=3)
    try:
        assert join(c, t)["ok"]
        reply = push(c, t, tensors, version="v2")
        assert reply["ok"], reply
        assert _part_of(c.prefill, want) and _part_of(c.decode, want)
        assert not _part_of(c.decode, _pushed({}))            # it did change
        got = c.run(c.submit(PROMPTS[1], 8))
        assert got.token_ids == reference_tiny_model(want, PROMPTS[1], 8)
        assert set(got.weight_versions) == {"v2"}
    finally:
        t.close()
        c.close()


def test_a_dead_rank_stops_its_worker():
    c = InprocCluster(tp=(1, 2))
    try:
        assert c.decode.failure() is None
        (proc,) = c.decode.tp_procs
        proc.kill()
        proc.join()
        c.advance(1.0)                       # the heartbeat's check of the rank processes
        assert "exited" in c.decode.failure()
    finally:
        c.close()


def test_pages_freed_after_a_rank_died_are_zeroed_here_and_break_the_group():
    """With --clear-freed-pages every rank zeroes a freed page; a rank that is gone
    cannot, which marks the group broken (the worker stops) instead of raising into
    whatever loop handler freed the pages, and our own part is still zeroed."""
    c = InprocCluster(tp=(1, 2), clear_freed_pages=True)
    try:
        pool = c.decode.pool
        pages = pool.allocator.alloc(2)
        pool.buffer[pages] = 1.0
        (proc,) = c.decode.tp_procs
        proc.kill()
        proc.join()
        pool.allocator.free_pages(pages)
        assert pool.buffer[pages].abs().sum() == 0
        assert c.decode.failure() is not None
    finally:
        c.close()
