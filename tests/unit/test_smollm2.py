"""SmolLM2-135M-Instruct from its GGUF file (`--model smollm2`) against transformers'
own GGUF loading of the same file: the same dequantized weights, the same float64
logits and greedy tokens, and the known answer below. The models are the
fixtures of tests/unit/conftest.py."""
from __future__ import annotations

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.runner import ModelRunner

transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The chat prompt's ids and the greedy answer (float32), identical in transformers,
# vLLM-CPU and zpd (measured 2026-12-01)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
          411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2,
          198, 1, 520, 9531, 198]
ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]    # "The capital of France is Paris."
NEW_TOKENS = 32
# Greedy tokens may differ only where the reference's top two are this close.
NEAR_TIE = 1e-4


@torch.inference_mode()
def greedy_with_logits(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Our greedy tokens (EOS ignored) and the logits each was chosen from, [steps, vocab]."""
    pool = KVPool(KVLayout.for_model(model.cfg, 16, model.dtype), 16, model.dtype, model.device)
    runner = ModelRunner(model, pool)
    table = pool.allocator.alloc(pool.pages_for(len(prompt) + steps))
    logits, out = [runner.prefill([prompt], [table])[0]], []
    for _ in range(steps - 1):
        out.append(int(logits[-1].argmax()))
        logits.append(runner.decode([out[-1]], [len(prompt) + len(out) - 1], [table])[0])
    out.append(int(logits[-1].argmax()))
    return out, torch.stack(logits)


@torch.inference_mode()
def teacher_forced(ref, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The reference's logits for each of our tokens given the prefix before it."""
    full = torch.tensor([prompt + out[:-1]])
    return ref(full).logits[0, len(prompt) - 1:].to(torch.float64)


def check_tokens(out: list[int], theirs: torch.Tensor) -> None:
    for step, token in enumerate(out):
        best = theirs[step].max()
        assert best - theirs[step, token] <= NEAR_TIE, \
            f"step {step}: we chose {token}, the reference {int(theirs[step].argmax())} " \
            f"by {float(best - theirs[step, token]):.3g}"


def test_the_chat_prompt_and_answer_are_the_known_ones(ours64):
    prompt = ours64.encode_chat(QUESTION)
    assert prompt == PROMPT
    out, _ = greedy_with_logits(ours64, prompt, len(ANSWER))
    assert out == ANSWER
    assert ours64.tokenizer.decode(out) == "The capital of France is Paris."
    assert ANSWER[-1] in ours64.cfg.eos_token_ids      # <|im_end|> ends the answer


@torch.inference_mode()
def test_weights_equal_transformers_dequantization(hf_gguf):
    ours = load_model("smollm2", dtype="float32")
    theirs = hf_gguf.state_dict()
    mine = dict(ours.net.named_parameters())
    for i in (0, 17, 29):
        p = f"model.layers.{i}."
        qkv = mine[p + "self_attn.qkv_proj.weight"].split([576, 192, 192])
        gate_up = mine[p + "mlp.gate_up_proj.weight"].split([1536, 1536])
        for ours_t, name in [(qkv[0], "self_attn.q_proj"), (qkv[1], "self_attn.k_proj"),
                             (qkv[2], "self_attn.v_proj"), (gate_up[0], "mlp.gate_proj"),
                             (gate_up[1], "mlp.up_proj")]:
            assert torch.equal(ours_t, theirs[p + name + ".weight"]), p + name
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(mine[p + name], theirs[p + name]), p + name
    assert torch.equal(mine["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    assert torch.equal(mine["model.norm.weight"], theirs["model.norm.weight"])


def test_float64_greedy_and_logits_equal_transformers(ours64, hf64):
    out, logits = greedy_with_logits(ours64, PROMPT, NEW_TOKENS)
    theirs = teacher_forced(hf64, PROMPT, out)
    check_tokens(out, theirs)
    # The reference's RMSNorm computes in float32 even for float64 inputs: over 30 layers
    # that leaves ~1e-5 on logits of magnitude ~30 (a relative 1e-6, not a float32 1e-3).
    diff = (logits - theirs).abs().max()
    assert diff <= 5e-5, f"max logit difference {float(diff):.3g}"


def test_logits_within_float32_of_transformers_gguf_model(ours64, hf_gguf):
    out, logits = greedy_with_logits(ours64, PROMPT, NEW_TOKENS)
    theirs = teacher_forced(hf_gguf, PROMPT, out)
    diff = (logits - theirs).abs().max()
    assert diff <= 2e-3, f"max logit difference {float(diff):.3g} (logits span ~±30)"
    assert out[:len(ANSWER)] == ANSWER
