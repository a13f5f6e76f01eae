"""Prefill and every decode step against Hugging Face transformers on random checkpoints."""
from __future__ import annotations

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.runner import ModelRunner
from tests.unit.hf_models import VARIANTS, hf_model, make_checkpoint

pytest.importorskip("transformers", reason="transformers is the test-time reference; pip install '.[test]'")

PROMPT_LENS = [1, 5, 16, 17, 40]        # one token to several 16-token pages


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _ours(path, dtype: str):
    model = load_model(str(path), dtype=dtype)
    pool = KVPool(KVLayout.for_model(model.cfg, 16, model.dtype), 64, model.dtype, model.device)
    return model, pool, ModelRunner(model, pool)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp("hf"), shard=request.param == "llama")


def _greedy(runner, pool, prompts, steps):
    tables = [pool.allocator.alloc(pool.pages_for(len(p) + steps)) for p in prompts]
    logits = [runner.prefill(prompts, tables)]
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits.append(runner.decode(nxt, [len(s) - 1 for s in seqs], tables))
    return seqs, logits


@torch.inference_mode()
# float64: the reference normalises in float32 even for float64 inputs, hence 1e-6, not 1e-12
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-4), ("float64", 1e-6)])
def test_logits_match_every_step(checkpoint, dtype, tol):
    model, pool, runner = _ours(checkpoint, dtype)
    ref = hf_model(checkpoint, model.dtype)
    prompts = _prompts(model.cfg.vocab_size)
    seqs, logits = _greedy(runner, pool, prompts, steps=6)
    for step, ours in enumerate(logits):
        for i, seq in enumerate(seqs):
            prefix = seq[:len(prompts[i]) + step]
            theirs = ref(torch.tensor([prefix])).logits[0, -1]
            assert torch.allclose(ours[i], theirs, atol=tol, rtol=0), \
                f"step {step} prompt {i}: max diff {(ours[i] - theirs).abs().max():.3g}"


@torch.inference_mode()
def test_greedy_tokens_exact_float64(checkpoint):
    model, pool, runner = _ours(checkpoint, "float64")
    ref = hf_model(checkpoint, torch.float64)
    prompts = _prompts(model.cfg.vocab_size)
    seqs, _ = _greedy(runner, pool, prompts, steps=12)
    for p, seq in zip(prompts, seqs):
        out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert seq == out[0].tolist()


def test_batch_equals_alone(checkpoint):
    model, pool, runner = _ours(checkpoint, "float64")
    prompts = _prompts(model.cfg.vocab_size)
    together, _ = _greedy(runner, pool, prompts, steps=8)
    for p, seq in zip(prompts, together):
        alone, _ = _greedy(runner, pool, [p], steps=8)
        assert alone[0] == seq


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_kernels_give_torchs_steps(checkpoint, dtype, monkeypatch):
    """The compiled element-wise steps (engines/cpu/layer_ops.py, LayerOps: norms with
    the residual addition, SiLU * up, rotary embedding written into the pool) against
    torch's ops in the same engine, every variant (biases, q/k norms, tied heads):
    greedy tokens are the same and every step's logits agree to the dtype's rounding."""
    import os
    import shutil

    from engines.cpu.layer_ops import layer_ops
    if layer_ops(getattr(torch, dtype), "cpu") is None:
        assert shutil.which(os.environ.get("CXX") or "g++") is None and not os.environ.get("CI")
        return
    model, pool, runner = _ours(checkpoint, dtype)
    prompts = _prompts(model.cfg.vocab_size)
    seqs, logits = _greedy(runner, pool, prompts, steps=6)
    monkeypatch.setattr(runner.backend, "ops", None)            # torch's steps, the same products
    seqs_torch, logits_torch = _greedy(runner, pool, prompts, steps=6)
    assert seqs == seqs_torch
    tol = 1e-4 if dtype == "float32" else 0.05
    for ours, theirs in zip(logits, logits_torch):
        scale = theirs.float().abs().max().item()
        assert (ours.float() - theirs.float()).abs().max().item() <= tol * scale


def _kernel_model(tmp_path, head_dim: int, dtype: str, monkeypatch):
    """A Llama with two query heads of `head_dim` over one KV head, in `dtype`, and the
    list its prefill attention calls append to (True: the causal kernel took it); None
    where the layer kernels did not build (allowed only off CI, without a compiler)."""
    import os
    import shutil

    from engines.cpu.layer_ops import LayerOps, layer_ops
    if layer_ops(getattr(torch, dtype), "cpu") is None:
        assert shutil.which(os.environ.get("CXX") or "g++") is None and not os.environ.get("CI")
        return None
    taken = []
    real = LayerOps.causal_attention
    monkeypatch.setattr(LayerOps, "causal_attention",
                        lambda self, q, *a: taken.append(real(self, q, *a) is not None) or real(self, q, *a))
    path = make_checkpoint("llama", tmp_path, hidden_size=2 * head_dim, num_attention_heads=2,
                           num_key_value_heads=1)
    return (path, *_ours(path, dtype), taken)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_causal_kernel_matches_the_reference(tmp_path, head_dim, monkeypatch):
    """Heads of 64 and 128, which the float32 causal prefill kernel takes (the other
    variants' heads of 16 stay with torch's attention): every step's logits against
    transformers, prompts of one position to past one query block (64)."""
    made = _kernel_model(tmp_path, head_dim, "float32", monkeypatch)
    if made is None:
        return
    path, model, pool, runner, taken = made
    ref = hf_model(path, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 63, 64, 65, 150)]
    seqs, logits = _greedy(runner, pool, prompts, steps=2)
    assert taken and all(taken)                  # every prompt of every layer took the kernel
    for step, ours in enumerate(logits):
        for i, seq in enumerate(seqs):
            theirs = ref(torch.tensor([seq[:len(prompts[i]) + step]])).logits[0, -1]
            assert torch.allclose(ours[i], theirs, atol=2e-4, rtol=0), f"step {step} prompt {i}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_causal_kernel_gives_torchs_logits(tmp_path, head_dim, monkeypatch):
    """The bfloat16 causal prefill kernel (AMX, or dot products) in a model
    with heads of 64 and 128, against the same engine on torch's flash attention:
    prompt logits to bfloat16's rounding, the same greedy token wherever torch's top
    two are more than that apart (a random bfloat16 model has near-ties), and every
    prompt of every layer took the kernel where the CPU has AVX-512."""
    from engines.cpu.layer_ops import LayerOps
    from tests.unit.cpu_support import cpu_has
    made = _kernel_model(tmp_path, head_dim, "bfloat16", monkeypatch)
    if made is None:
        return
    _, model, pool, runner, taken = made
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 16, 63, 64, 65, 150)]
    ours = _greedy(runner, pool, prompts, steps=0)[1][0].float()
    assert taken and all(taken) == cpu_has("avx512f")
    monkeypatch.setattr(LayerOps, "causal_attention", lambda self, *a: None)
    theirs = _greedy(runner, pool, prompts, steps=0)[1][0].float()
    tol = 0.03 * theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= tol
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
