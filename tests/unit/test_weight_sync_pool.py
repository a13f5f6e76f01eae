"""Pushes received in place (engines/weights/pool.py, issue 47): a tensor of its
parameter's dtype, and a bucket in the model's own order, land straight in the
staging copy, which a helper process maps; a commit swaps the pool's two slots, so
the weights live there after it; release_memory_occupation still frees them.

The real router and workers run in this process (tests/unit/inproc.py), the trainer
on a thread (tests/unit/trainer_side.py)."""
from __future__ import annotations

import mmap
import re

import pytest
import torch
from torch import nn

from engines import weight_release
from engines.loader import load_model
from engines.models.tiny import tiny_state_dict
from engines.weights.pool import SharedPool
from tests.unit.inproc import InprocCluster
from tests.unit.test_handoff import PROMPT, reference_tiny_model
from tests.unit.test_weight_sync import join, push, versions
from tests.unit.trainer_side import Trainer
from zpd.worker.weights.helper_link import HelperLink

PARTS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "input_layernorm", "post_attention_layernorm"]


def model_order(name: str) -> tuple:
    """Where `name` comes in transformers' LlamaForCausalLM.named_parameters()."""
    layer = re.match(r"model\.layers\.(\d+)\.(?:\w+\.)?(\w+)\.weight", name)
    if layer:
        return (1, int(layer[1]), PARTS.index(layer[2]))
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3),)


def weights(seed: int, order: str = "model") -> dict[str, torch.Tensor]:
    sd = tiny_state_dict(seed)
    return {n: sd[n] for n in sorted(sd, key=model_order if order == "model" else None)}


def equal_to(c: InprocCluster, seed: int) -> bool:
    """Each worker's weights are those of tiny model `seed`, loaded fresh."""
    want = dict(load_model(f"tiny:{seed}", dtype="float32").net.named_parameters())
    return all(torch.equal(p, want[n]) for core in (c.prefill, c.decode)
               for n, p in core.model.net.named_parameters())


@pytest.fixture
def counted(monkeypatch):
    """How many pushes needed memory of their own (a tensor that did not land in place)."""
    calls = []
    share = HelperLink._share

    def counting(self, size):
        calls.append(size)
        return share(self, size)
    monkeypatch.setattr(HelperLink, "_share", counting)
    return calls


def in_pool(c: InprocCluster) -> bool:
    """Every weight lives in its worker's pool, the staging copy in the other half."""
    for core in (c.prefill, c.decode):
        ws = core.parts["weight_sync"]
        for name, p in core.model.net.named_parameters():
            half = ws.pool.half_of(p)
            if half is None or ws.pool.half_of(ws.shadow.copy[name]) != 1 - half:
                return False
    return True


@pytest.mark.parametrize("bucket", [False, True])
def test_a_push_in_the_models_order_and_dtype_lands_in_place(counted, bucket):
    c = InprocCluster(kv_cache_mb=2.0, dtype="float32")
    trainer = Trainer(world_size=3)
    try:
        assert join(c, trainer)["ok"]
        for seed, version in ((7, "v2"), (3, "v3")):       # the second: the other half
            sent = weights(seed)
            reply = push(c, trainer, sent, version=version, bucket=bucket)
            assert reply["ok"], reply
            assert versions(c) == [version] * 2 and equal_to(c, seed)
            assert counted == [] and in_pool(c)
        sent = weights(7, order="sorted")                   # by name: not back to back
        assert push(c, trainer, sent, version="v4", bucket=bucket)["ok"]
        assert equal_to(c, 7) and bool(counted) == bucket
        c.serves_again()
    finally:
        trainer.close()
        c.close()


def test_weights_pushed_in_place_are_released_and_resumed():
    """release_memory_occupation moves the weights out of the pool and frees them;
    resumed, they are the pushed ones, and the next push lands in place again."""
    c = InprocCluster(kv_cache_mb=2.0, dtype="float32")
    trainer = Trainer(world_size=3)
    try:
        assert join(c, trainer)["ok"]
        assert push(c, trainer, weights(7))["ok"] and in_pool(c)
        assert c.admin("release_memory", tags=["weights"])["ok"]
        for core in (c.prefill, c.decode):
            assert sum(s.nbytes() for s in weight_release._storages(core.model.net)) == 0
        assert c.admin("resume_memory", tags=["weights"])["ok"]
        assert equal_to(c, 7)
        assert push(c, trainer, weights(3), version="v3")["ok"]
        assert equal_to(c, 3) and in_pool(c)
        c.serves_again()
    finally:
        trainer.close()
        c.close()


def test_pool_slots_keep_each_weights_layout_and_give_pages_back():
    net = nn.Module()
    net.a = nn.Parameter(torch.randn(3, 5))
    net.b = nn.Parameter(torch.randn(4 * mmap.PAGESIZE, 3).t().contiguous().t())  # column-major
    pool = SharedPool(net)
    for half in (0, 1):
        assert pool.slots[half]["b"].stride() == net.b.stride()
        assert pool.half_of(pool.slots[half]["a"]) == half
    assert pool.offset_of(pool.slots[1]["a"]) == pool.half and pool.offset_of(net.a) is None
    b = pool.slots[0]["b"]
    b.fill_(1.0)
    pool.punch(b)
    assert 0 < int((b == 0).sum()) < b.numel()      # its whole pages: zeros now
    with torch.no_grad():
        net.b.data = pool.slots[1]["b"]
    weight_release._unshare(net)                      # out of the pool, layout kept
    assert pool.half_of(net.b) is None and net.b.untyped_storage().resizable()
    assert net.b.stride() == pool.slots[1]["b"].stride()


def test_packed_copies_never_outlive_the_weights_they_were_made_from():
    """A weight's packed copy (engines/cpu/linear.py) is keyed by its address and
    version; a commit moves a weight between the pool's two slots, so the third push
    puts it back where the first did, with bytes the worker never wrote itself (the
    helper did). The commit bumps its version, so the copy packed after the first push
    is not taken for the third's: answers match a fresh load of each."""
    c = InprocCluster(kv_cache_mb=2.0, dtype="bfloat16")
    trainer = Trainer(world_size=3)
    try:
        def answers() -> list[list[int]]:
            rids = [c.submit(PROMPT, 6), c.submit(PROMPT[1:], 6)]   # batches of 2: packed
            return [c.run(rid).token_ids for rid in rids]

        assert join(c, trainer)["ok"]
        for seed, then_run in ((7, True), (3, False), (5, True)):
            sent = {n: t.to(torch.bfloat16) for n, t in weights(seed).items()}
            assert push(c, trainer, sent, version=f"s{seed}")["ok"] and in_pool(c)
            if then_run:
                fresh = load_model(f"tiny:{seed}", dtype="bfloat16")
                assert answers() == [reference_tiny_model(fresh, PROMPT, 6),
                                     reference_tiny_model(fresh, PROMPT[1:], 6)]
    finally:
        trainer.close()
        c.close()
