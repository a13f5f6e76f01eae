"""Tensor parallelism in the engine (engines/tp/): which heads and MLP rows each rank
holds, that the ranks' slices make up the whole weights, and `zpd run --tp N` (real
processes joined by gloo) giving `--tp 1`'s greedy tokens in float64: at 2 and 4 ranks,
with replicated key/value heads (4 ranks over 2 kv heads), q/k/v bias (Qwen2) and
per-head q/k norms (Qwen3)."""
from __future__ import annotations

from dataclasses import replace

import orjson
import pytest
import torch

from engines.loader import load_model
from engines.config import ModelConfig
from engines.models.tiny import TINY_CONFIG
from engines.tp.plan import TpPlan
from engines.tp.shard import shard_model, weight_slice
from engines.tp.spawn import rank_device
from tests.unit.hf_models import make_checkpoint
from zpd.ops.cli import main

TINY = ModelConfig.from_dict(TINY_CONFIG)          # 4 query heads over 2 kv heads, MLP 128


@pytest.mark.parametrize("size, q, kv, mlp", [
    (1, [range(0, 4)], [range(0, 2)], [range(0, 128)]),
    (2, [range(0, 2), range(2, 4)], [range(0, 1), range(1, 2)], [range(0, 64), range(64, 128)]),
    # more ranks than kv heads: each kv head on the two ranks whose query heads read it
    (4, [range(i, i + 1) for i in range(4)], [range(0, 1), range(0, 1), range(1, 2), range(1, 2)],
     [range(i * 32, i * 32 + 32) for i in range(4)]),
])
def test_each_rank_holds_its_heads_and_mlp_rows(size, q, kv, mlp):
    plans = [TpPlan.for_rank(TINY, r, size) for r in range(size)]
    assert [p.q_heads(TINY) for p in plans] == q
    assert [p.kv_heads(TINY) for p in plans] == kv
    assert [p.intermediate(TINY) for p in plans] == mlp
    local = plans[-1].config(TINY)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == \
        (len(q[0]), len(kv[0]), len(mlp[0]))
    assert local.hidden_size == TINY.hidden_size and local.head_dim == TINY.head_dim


@pytest.mark.parametrize("cfg, size, named", [
    (TINY, 3, "does not divide the model's 4 attention heads"),
    (TINY, 0, "--tp must be at least 1"),
    (replace(TINY, intermediate_size=130), 4, "does not divide the MLP's 130"),
    (replace(TINY, num_heads=12, num_kv_heads=3), 2, "neither divides the model's 3 key/value heads"),
])
def test_a_model_that_cannot_be_split_is_refused(cfg, size, named):
    assert named in TpPlan.problem(cfg, size)
    with pytest.raises(ValueError, match=named.replace("'", ".")):
        TpPlan.for_rank(cfg, 0, size)


@pytest.mark.parametrize("size", [2, 4])
def test_the_slices_make_up_the_whole_weights(size):
    whole = load_model("tiny", dtype="float64")
    parts = [shard_model(whole, TpPlan.for_rank(whole.cfg, r, size)) for r in range(size)]
    d, hq, hkv = TINY.head_dim, TINY.num_heads, TINY.num_kv_heads
    for name, w in whole.net.named_parameters():
        got = [dict(p.net.named_parameters())[name] for p in parts]
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            assert torch.equal(torch.cat(got, dim=1), w), name           # row parallel
        elif name.endswith("gate_up_proj.weight"):
            half = [g.split(g.shape[0] // 2) for g in got]
            assert torch.equal(torch.cat([h[0] for h in half] + [h[1] for h in half]), w), name
        elif name.endswith("qkv_proj.weight"):
            q = torch.cat([g[:hq // size * d] for g in got])
            assert torch.equal(q, w[:hq * d]), name
            for r, g in enumerate(got):               # its kv heads' keys and values, whole
                kv, n = TpPlan(r, size).kv_heads(TINY), hq // size * d
                keys, values = g[n:].split(len(kv) * d)
                assert torch.equal(keys, w[hq * d + kv.start * d:hq * d + kv.stop * d]), name
                v0 = (hq + hkv) * d
                assert torch.equal(values, w[v0 + kv.start * d:v0 + kv.stop * d]), name
        else:
            assert all(torch.equal(g, w) for g in got), name             # whole on every rank
    assert weight_slice("model.norm.weight", whole.net.model.norm.weight, TINY,
                        TpPlan(1, size)) is whole.net.model.norm.weight


def test_rank_devices():
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:2", 1) == "cuda:3" and rank_device("cpu", 3) == "cpu"


def _run(capsys, model: str, tp: int) -> list[list[int]]:
    assert main(["run", "--model", model, "--dtype", "float64", "--temperature", "0",
                 "--ignore-eos", "--max-new-tokens", "24", "--kv-cache-mb", "2", "--json",
                 "--input-ids", "1,2,3,4,5", "--input-ids", "9,8,7,6,5,4,3,2,1,200,100,50,25",
                 "--tp", str(tp)]) == 0
    return [orjson.loads(line)["output_ids"] for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("kind, tp", [("tiny", 2), ("tiny", 4), ("qwen2", 2), ("qwen3", 4)])
def test_zpd_run_over_ranks_equals_one_rank(capsys, tmp_path, kind, tp):
    model = "tiny" if kind == "tiny" else str(make_checkpoint(kind, tmp_path))
    one = _run(capsys, model, 1)
    assert _run(capsys, model, tp) == one and len(one[1]) == 24
