"""Mixture-of-experts models split over ranks (engines/tp/): under --tp each expert's
intermediate dimension is split, under --ep each rank holds E/N experts and the rows
travel by all-to-all (engines/tp/experts.py). The ranks here are threads of this
process, each with its own part of the model, KV pool and runner, joined by real gloo
groups; rank 0's logits at every prefill and decode step must equal transformers' in
float64 for Qwen3-MoE, Mixtral and GLM-4.5 (shared experts, grouped sigmoid router)."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from engines.config import ModelConfig
from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.runner import ModelRunner
from engines.tp.group import Rendezvous, join
from engines.tp.plan import TpPlan
from engines.tp.shard import apply_rows, shard_model, weight_slice
from tests.unit.hf_models import MOE_VARIANTS, hf_model, make_checkpoint

pytest.importorskip("transformers", reason="transformers is the test-time reference")


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp("moe"))


def _cfg(checkpoint) -> ModelConfig:
    return load_model(str(checkpoint), dtype="float64").cfg


def test_plans_refuse_what_does_not_divide(checkpoint):
    cfg = _cfg(checkpoint)
    e, inter = cfg.moe.num_experts, cfg.moe.intermediate_size
    assert f"does not divide the model's {e} experts" in TpPlan.problem(cfg, 1, 3)
    assert "--ep must be 1 or equal to --tp" in TpPlan.problem(cfg, 2, 4)
    odd = replace(cfg, moe=replace(cfg.moe, intermediate_size=inter + 1))
    assert f"does not divide the experts' {inter + 1} intermediate size" in TpPlan.problem(odd, 2)
    assert TpPlan.problem(odd, 2, 2) is None           # whole experts under --ep
    dense = replace(cfg, moe=None)
    assert "needs a mixture-of-experts model" in TpPlan.problem(dense, 1, 2)
    with pytest.raises(ValueError, match="experts"):
        TpPlan.for_rank(cfg, 0, 1, 3)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2)])
def test_the_parts_hold_the_experts_they_should(checkpoint, tp, ep):
    whole = load_model(str(checkpoint), dtype="float64")
    cfg, m = whole.cfg, whole.cfg.moe
    plans = [TpPlan.for_rank(cfg, r, tp, ep) for r in range(2)]
    i, h = m.intermediate_size, cfg.hidden_size
    for name, w in whole.net.named_parameters():
        got = [weight_slice(name, w, cfg, p) for p in plans]
        if name.endswith("experts.gate_up_proj"):
            per = w.view(m.num_experts, 2, i, h)
            parts = [g.view(-1, 2, g.shape[0] // (2 * (m.num_experts // ep)) if ep > 1 else i // 2, h)
                     for g in got]
            joined = torch.cat(parts, dim=0 if ep > 1 else 2)
            assert torch.equal(joined, per), name
        elif name.endswith("experts.down_proj"):
            assert torch.equal(torch.cat(got, dim=0 if ep > 1 else 1), w), name
        elif ".mlp.gate." in name or ep > 1 and "shared_experts" in name:
            assert all(torch.equal(g, w) for g in got), name       # router, bias: whole
        elif "shared_experts.down_proj" in name:
            assert torch.equal(torch.cat(got, dim=1), w), name
        elif tp == 1:                                           # --ep alone: attention whole
            assert all(torch.equal(g, w) for g in got), name


def _ranks(checkpoint, tp: int, ep: int, work):
    """Run work(runner, pool, group) on every rank of a (tp, ep) group, each in a thread
    with its own part of the model; rank 0's result."""
    whole = load_model(str(checkpoint), dtype="float64")
    size, meeting = max(tp, ep), Rendezvous()
    results, errors = {}, []

    def rank_main(r: int) -> None:
        try:
            group = join(r, size, meeting.path, timeout_s=60)
            part = shard_model(whole, TpPlan.for_rank(whole.cfg, r, tp, ep), group)
            pool = KVPool(KVLayout.for_model(part.cfg, 16, part.dtype), 32, part.dtype, part.device)
            results[r] = work(ModelRunner(part, pool, group), pool, group)
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        meeting.close()
    assert not errors, errors
    return results[0]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 7, 19)]


@torch.inference_mode()
@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2)])
def test_logits_equal_transformers_float64(checkpoint, tp, ep):
    prompts = _prompts(300)

    def work(runner, pool, group):
        alone = runner.prefill(prompts[:1], [pool.allocator.alloc(1)])   # one token: rank 1 has none
        tables = [pool.allocator.alloc(pool.pages_for(len(p) + 4)) for p in prompts]
        seqs, logits = [list(p) for p in prompts], [runner.prefill(prompts, tables)]
        for _ in range(4):         # rank 0's greedy tokens, told to the others
            nxt = torch.argmax(logits[-1], -1) if runner.leads else torch.zeros(len(seqs), dtype=torch.int64)
            nxt = group.broadcast(nxt).tolist()
            for s, t in zip(seqs, nxt):
                s.append(t)
            logits.append(runner.decode(nxt, [len(s) - 1 for s in seqs], tables))
        return seqs, [alone] + logits

    seqs, (alone, *logits) = _ranks(checkpoint, tp, ep, work)
    ref = hf_model(checkpoint, torch.float64)
    assert torch.allclose(alone[0], ref(torch.tensor(prompts[:1])).logits[0, -1], atol=1e-6, rtol=0)
    for step, ours in enumerate(logits):
        for i, seq in enumerate(seqs):
            theirs = ref(torch.tensor([seq[:len(prompts[i]) + step]])).logits[0, -1]
            assert torch.allclose(ours[i], theirs, atol=1e-6, rtol=0), \
                f"step {step} prompt {i}: {(ours[i] - theirs).abs().max():.3g}"


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2)])
def test_a_push_of_some_experts_rows_reaches_each_part(checkpoint, tp, ep):
    """A trainer's push that wrote expert 1's gate rows and expert 6's down rows: each
    rank's part takes exactly its share (engines/tp/shard.py apply_rows)."""
    whole = load_model(str(checkpoint), dtype="float64")
    cfg, experts = whole.cfg, whole.net.model.layers[2].mlp.experts
    last = cfg.moe.num_experts - 1
    for name, (part, first, n) in {"gate_up_proj": experts.rows(1, "gate"),
                                   "down_proj": experts.rows(last, "down")}.items():
        full = f"model.layers.2.mlp.experts.{name}"
        old = getattr(experts, part).detach().clone()
        new = old.clone()
        new[first:first + n] = torch.randn(n, old.shape[1], dtype=old.dtype)
        for r in range(2):
            plan = TpPlan.for_rank(cfg, r, tp, ep)
            mine = weight_slice(full, old, cfg, plan).clone()
            apply_rows(mine, full, new, [(first, first + n)], cfg, plan)
            assert torch.equal(mine, weight_slice(full, new, cfg, plan)), (name, r)
            assert torch.equal(mine, weight_slice(full, old, cfg, plan)) == (
                ep > 1 and (r == 0) != (name == "gate_up_proj")), (name, r)


@pytest.mark.parametrize("argv, named", [
    (["--ep", "2"], "--ep 2 needs a mixture-of-experts model; this one is dense"),
    (["--tp", "2", "--ep", "4"], "--ep 4 with --tp 2: --ep must be 1 or equal to --tp"),
    (["--ep", "0"], "--ep must be at least 1"),
])
def test_zpd_run_refuses_sizes_by_name(capsys, argv, named):
    from zpd.ops.cli import main
    assert main(["run", "--model", "tiny", "--input-ids", "1,2", *argv]) == 2
    assert named in capsys.readouterr().err
