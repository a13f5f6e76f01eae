"""--deterministic on the CPU backend (docs/deterministic.md): a request's tokens and
logprobs are the same bits alone or in batches of 2-64 at any position, in a prefill
after a cached prefix or in one piece, on 1 or 2 threads, after a retraction's
recompute, and a generation's output logprobs equal a scoring pass's prompt logprobs.
Each equality is `torch.equal` (or == on the floats) and is also run without the flag,
where the default breaks it: the test shows that it can fail."""
from __future__ import annotations

import os
import random

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.runner import ModelRunner
from engines.sampler import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, return_logprob=True, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, return_logprob=True, ignore_eos=True)
RNG = random.Random(48)
TARGET = [RNG.randrange(1, 250) for _ in range(37)]
OTHERS = [[RNG.randrange(1, 250) for _ in range(RNG.randrange(3, 100))] for _ in range(63)]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32")


def generate(model, prompts: list[list[int]], deterministic: bool,
             params: SamplingParams = GREEDY) -> list[Request]:
    reqs = [Request(f"r{i}", list(p), params, seed=1000 + i) for i, p in enumerate(prompts)]
    OfflineEngine(model, kv_cache_mb=16, deterministic=deterministic).run(reqs)
    return reqs


def same(a: Request, b: Request) -> bool:
    return a.output == b.output and torch.equal(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs))


def batch_differences(model, deterministic: bool, params: SamplingParams = GREEDY) -> list[tuple[int, int]]:
    """(batch size, position) of every batch where the target's answer is not the bits
    it has alone; the target keeps its seed at every position."""
    alone = generate(model, [TARGET], deterministic, params)[0]
    differ = []
    for size in (2, 9, 33, 64):
        for at in sorted({0, size // 2, size - 1}):
            prompts = OTHERS[:at] + [TARGET] + OTHERS[at:size - 1]
            reqs = [Request(f"r{i}", list(p), params, seed=1000 + i) for i, p in enumerate(prompts)]
            reqs[at].seed = 1000                          # the target's seed, as alone
            OfflineEngine(model, kv_cache_mb=16, max_batch=64, deterministic=deterministic).run(reqs)
            if not same(reqs[at], alone):
                differ.append((size, at))
    return differ


def test_a_request_alone_equals_it_in_any_batch_at_any_position(tiny):
    assert batch_differences(tiny, True) == []
    assert batch_differences(tiny, False), "the default was batch-invariant: the test cannot fail"


def test_seeded_sampling_is_the_same_in_any_batch(tiny):
    assert batch_differences(tiny, True, SAMPLED) == []


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_rollout_equals_scoring(tiny, deterministic):
    """output_token_logprobs of a generation == input_token_logprobs of the prompt +
    generated tokens scored with max_new_tokens 0 (the decode and prefill paths)."""
    for params in (GREEDY, SAMPLED):
        rollout = generate(tiny, [TARGET], deterministic, params)[0]
        score = SamplingParams(max_new_tokens=0, return_logprob=True, logprob_start_len=len(TARGET))
        scored = generate(tiny, [TARGET + rollout.output], deterministic, score)[0]
        equal = torch.equal(torch.tensor(scored.prompt_logprobs.token_logprobs),
                            torch.tensor(rollout.output_logprobs))
        assert equal is deterministic, (params, scored.prompt_logprobs.token_logprobs, rollout.output_logprobs)
        if not deterministic:
            return


def runner(model, deterministic: bool) -> tuple[ModelRunner, KVPool]:
    pool = KVPool.with_budget(KVLayout.for_model(model.cfg, 16, model.dtype), 16, model.dtype, model.device)
    return ModelRunner(model, pool, deterministic=deterministic), pool


def chunked_vs_whole(model, deterministic: bool, cut: int) -> bool:
    """A prompt's last logits and prompt logprobs prefilled in one piece vs after a cached
    prefix of `cut` tokens (a prefix-cache hit), then a decode step on each."""
    run, pool = runner(model, deterministic)
    prompt = OTHERS[0] + TARGET
    got = []
    with torch.inference_mode():
        for start in (0, cut):
            pages = pool.allocator.alloc(pool.pages_for(len(prompt) + 1))
            if start:
                run.prefill([prompt[:start]], [pages])
            logits, (lp,) = run.prefill_with_logprobs([prompt], [pages], [start], [start + 1])
            step = run.decode([7], [len(prompt)], [pages])
            got.append((logits.clone(), torch.tensor(lp.token_logprobs[-5:]), step.clone()))
            pool.allocator.free_pages(pages)
    (a, la, da), (b, lb, db) = got
    return torch.equal(a, b) and torch.equal(la, lb) and torch.equal(da, db)


def test_a_cached_prefix_gives_the_bits_of_one_piece(tiny):
    for cut in (1, 16, 29, len(OTHERS[0]) + 30):
        assert chunked_vs_whole(tiny, True, cut), cut
    assert not all(chunked_vs_whole(tiny, False, cut) for cut in (16, 29, len(OTHERS[0]) + 30))


def test_one_thread_gives_the_bits_of_two(tiny):
    threads = torch.get_num_threads()
    prompts = [TARGET] + OTHERS[:15]
    try:
        for params in (GREEDY, SAMPLED):
            torch.set_num_threads(2)
            two = generate(tiny, prompts, True, params)
            torch.set_num_threads(1)
            one = generate(tiny, prompts, True, params)
            assert all(same(a, b) for a, b in zip(one, two)), params
    finally:
        torch.set_num_threads(threads)
    # (the default happens to give these bits on both too, on the tiny model: SmolLM2's
    # test below is where it does not)


def recomputed_equal(model, deterministic: bool) -> list[bool]:
    """What a retraction does with the same weights: the KV of prompt + output[:-1]
    recomputed by a prefill, then decode from the forced last token; whether each
    continuation has the bits of never pausing."""
    whole = generate(model, [TARGET] + OTHERS[:3], deterministic)[0]
    engine = OfflineEngine(model, kv_cache_mb=16, deterministic=deterministic)
    equal = []
    for kept in (1, 4, 7):
        req = Request("again", list(TARGET), GREEDY, seed=1000)
        req.output, req.output_logprobs = whole.output[:kept], whole.output_logprobs[:kept]
        req.weight_versions = whole.weight_versions[:kept]
        req.pages = engine.pool.allocator.alloc(engine.pool.pages_for(req.max_context))
        engine.compute.prefill([req])
        engine.batch.add(req)
        while not req.finished:
            engine.batch.step()
        engine.pool.allocator.free_pages(req.pages)
        equal.append(same(req, whole))
    return equal


def test_a_recompute_continues_with_the_bits_of_never_pausing(tiny):
    assert all(recomputed_equal(tiny, True))
    assert not all(recomputed_equal(tiny, False))


def test_the_runner_refuses_a_tensor_parallel_group(tiny):
    from engines.compute import runner_for
    from engines.config import ModelError
    pool = runner(tiny, False)[1]
    with pytest.raises(ModelError, match="--deterministic"):
        runner_for(tiny, pool, tp=object(), deterministic=True)


def test_zpd_run_takes_the_flag_and_sglangs_alias(capsys):
    from zpd.ops.cli import main
    outs = []
    for flag in ("--deterministic", "--enable-deterministic-inference"):
        assert main(["run", "--model", "tiny", "--input-ids", ",".join(map(str, TARGET)),
                     "--max-new-tokens", "4", "--temperature", "0", "--json", flag]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and '"output_ids"' in outs[0]
    assert main(["run", "--model", "tiny", "--input-ids", "1,2", "--deterministic", "--tp", "2"]) == 2
    assert "--deterministic runs at --tp 1" in capsys.readouterr().err
    assert main(["run", "--model", "tiny", "--dtype", "float64", "--input-ids", "1,2", "--deterministic"]) == 2
    assert "--deterministic on cpu needs the compiled CPU kernels for float64" in capsys.readouterr().err


def test_the_gpu_backend_turns_on_torchs_deterministic_algorithms(monkeypatch):
    """What CUDA gets (no GPU here: the backend is made for a cuda device, nothing runs)."""
    from engines.runner import backend_for
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    try:
        assert not backend_for(torch.float32, torch.device("cuda"), False).deterministic
        assert not torch.are_deterministic_algorithms_enabled()
        assert backend_for(torch.float32, torch.device("cuda"), True).deterministic
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
