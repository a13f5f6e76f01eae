"""Prompt logprobs from a prefill (engines/prompt_logprobs.py, ModelRunner.prefill_with_logprobs):
transformers' log-softmax over the same model at every position asked, after a cached
prefix, in chunks, beside plain prompts whose logits keep their bits; on the CPU
kernels and on the torch reference backend."""
from __future__ import annotations

import pytest
import torch

import engines.prompt_logprobs as pl
from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.prompt_logprobs import PromptLogprobAsk
from engines.runner import ModelRunner
from engines.torch_backend import TorchBackend
from tests.unit.hf_models import hf_model, make_checkpoint

LENGTHS = [40, 17, 1, 5]        # several 16-token pages, one token, a few
# against transformers in float64, which normalises in float32 even there (as in
# test_model_vs_hf.py): float32 rounding either way
TOLERANCE = {"float32": 2e-4, "float64": 1e-6}
SETUPS = [("float32", "cpu"), ("float32", "torch"), ("float64", "cpu"), ("float64", "torch")]


@pytest.fixture(scope="module", params=["llama", "glm4_moe"])
def hf_checkpoint(request, tmp_path_factory):
    """A random transformers checkpoint, dense and a mixture of experts (seconds:
    tests/conftest.py marks its tests slow)."""
    pytest.importorskip("transformers", reason="transformers is the test-time reference; pip install '.[test]'")
    return make_checkpoint(request.param, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(hf_checkpoint, prompts):
    """Each prompt's log-softmax at every position by transformers in float64: [len, vocab]."""
    ref = hf_model(hf_checkpoint, torch.float64)
    with torch.inference_mode():
        return [torch.log_softmax(ref(torch.tensor([p])).logits[0], -1) for p in prompts]


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    return {dtype: load_model(str(hf_checkpoint), dtype=dtype) for dtype in TOLERANCE}


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny model, for what needs no reference: quick."""
    return {dtype: load_model("tiny", dtype=dtype) for dtype in TOLERANCE}


def _runner(models, dtype: str, backend: str):
    model = models[dtype]
    pool = KVPool(KVLayout.for_model(model.cfg, 16, model.dtype), 64, model.dtype, model.device)
    runner = ModelRunner(model, pool)
    if backend == "torch":
        runner.backend = TorchBackend()
    assert (backend == "cpu" and dtype == "float32") == (getattr(runner.backend, "paged_decode", None) is not None)
    return runner, pool


def _tables(pool, prompts):
    return [pool.allocator.alloc(pool.pages_for(len(p))) for p in prompts]


def _expected(reference, prompt, first: int) -> torch.Tensor:
    """prompt[p]'s logprob given prompt[:p], p = first..len-1."""
    logp = reference[:len(prompt)]
    return torch.tensor([logp[p - 1, prompt[p]].item() for p in range(first, len(prompt))], dtype=torch.float64)


def _close(got: list[float], want: torch.Tensor, dtype: str) -> None:
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                               rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype, backend", SETUPS)
def test_every_position_equals_transformers(models, prompts, reference, dtype, backend):
    runner, pool = _runner(models, dtype, backend)
    _, out = runner.prefill_with_logprobs(prompts, _tables(pool, prompts), None, [0] * len(prompts))
    for p, ref, got in zip(prompts, reference, out):
        assert got.first == 1
        _close(got.token_logprobs, _expected(ref, p, 1), dtype)
    assert out[2].token_logprobs == []              # a one-token prompt: position 0 has none


@pytest.mark.parametrize("dtype, backend", SETUPS)
def test_from_position_k(models, prompts, reference, dtype, backend):
    runner, pool = _runner(models, dtype, backend)
    asks = [30, 16, None, 4]                         # 16: the last token of its prompt
    _, out = runner.prefill_with_logprobs(prompts, _tables(pool, prompts), None, asks)
    assert out[2] is None
    for i in (0, 1, 3):
        assert out[i].first == asks[i]
        _close(out[i].token_logprobs, _expected(reference[i], prompts[i], asks[i]), dtype)


@pytest.mark.parametrize("dtype, backend", SETUPS)
def test_after_a_cached_prefix(models, prompts, reference, dtype, backend):
    """The prefix's KV from an earlier prefill; the logprobs from the logits of the
    first computed position on. Asking for one whose logit is inside the prefix is refused."""
    runner, pool = _runner(models, dtype, backend)
    long, short = prompts[0], prompts[3]
    tables = _tables(pool, [long, short])
    runner.prefill([long[:20], short[:2]], tables)
    logits, out = runner.prefill_with_logprobs([long, short], tables, [20, 2], [21, 3])
    _close(out[0].token_logprobs, _expected(reference[0], long, 21), dtype)
    _close(out[1].token_logprobs, _expected(reference[3], short, 3), dtype)
    for start, ask in [(20, 20), (20, 0), (20, 5), (1, 1)]:
        with pytest.raises(ValueError, match="cached prefix"):
            runner.prefill_with_logprobs([long], tables[:1], [start], [ask])


@pytest.mark.parametrize("dtype, backend", SETUPS)
def test_a_mixed_batch_keeps_every_last_logit_and_key(tiny, prompts, dtype, backend):
    """Prompts that ask beside prompts that do not: every prompt's last logits are the
    bits of a prefill where none asks, and the pool holds the same keys and values."""
    runner, pool = _runner(tiny, dtype, backend)
    tables = [_tables(pool, prompts) for _ in range(2)]
    plain = runner.prefill(prompts, tables[0])
    logits, out = runner.prefill_with_logprobs(prompts, tables[1], None, [0, None, None, 2])
    assert torch.equal(logits, plain)
    assert [o is None for o in out] == [False, True, True, False]
    rows = [runner.pages.rows(torch.tensor(t), torch.arange(len(p))) for ts in tables for t, p in zip(ts, prompts)]
    n = len(prompts)
    for layer in range(pool.kv.num_layers):
        for which in (0, 1):
            for mine, theirs in zip(rows[:n], rows[n:]):
                assert torch.equal(pool.kv.read(layer, which, mine), pool.kv.read(layer, which, theirs))


@pytest.mark.parametrize("dtype, backend", SETUPS)
def test_chunks_of_rows_give_the_same_answer(monkeypatch, tiny, prompts, dtype, backend):
    runner, pool = _runner(tiny, dtype, backend)
    asks = [PromptLogprobAsk(0, top_k=3, token_ids=(5, 7)), None, None, PromptLogprobAsk(1, top_k=2)]
    whole = runner.prefill_with_logprobs(prompts, _tables(pool, prompts), None, asks)[1]
    net, seen = runner.model.net, []

    def logits(hidden, backend):
        seen.append(hidden.shape[0])
        return type(net).logits(net, hidden, backend)
    monkeypatch.setattr(net, "logits", logits)
    itemsize = 4 if dtype == "float32" else 8
    monkeypatch.setattr(pl, "LOGITS_CHUNK_BYTES", 3 * net.cfg.vocab_size * itemsize)
    chunked = runner.prefill_with_logprobs(prompts, _tables(pool, prompts), None, asks)[1]
    assert seen[0] == len(prompts) and max(seen[1:]) == 3 and sum(seen[1:]) == 39 + 4
    for a, b in zip(whole, chunked):
        if a is None:
            assert b is None
            continue
        assert a.first == b.first and [x for x, _ in sum(a.top, [])] == [x for x, _ in sum(b.top, [])]
        torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs),
                                   rtol=0, atol=2e-5 if dtype == "float32" else 1e-12)  # products by 3 rows
    assert chunked[0].token_ids is not None and len(chunked[0].token_ids) == 39


@pytest.mark.parametrize("dtype, backend", SETUPS)
def test_top_k_and_chosen_token_ids(models, prompts, reference, dtype, backend):
    runner, pool = _runner(models, dtype, backend)
    ids = (0, 299, 17)
    asks = [PromptLogprobAsk(10, top_k=4, token_ids=ids), PromptLogprobAsk(0, top_k=1), None,
            PromptLogprobAsk(2, token_ids=ids)]
    _, out = runner.prefill_with_logprobs(prompts, _tables(pool, prompts), None, asks)
    tol = TOLERANCE[dtype]
    for i in (0, 1, 3):
        logp, first, got = reference[i], out[i].first, out[i]
        rows = logp[first - 1:len(prompts[i]) - 1]                # the logits before each position
        if asks[i].top_k:
            want = rows.topk(asks[i].top_k, -1)
            assert [[t for t, _ in top] for top in got.top] == want.indices.tolist()
            torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in got.top], dtype=torch.float64),
                                       want.values, rtol=0, atol=tol)
        else:
            assert got.top is None
        if asks[i].token_ids:
            torch.testing.assert_close(torch.tensor(got.token_ids, dtype=torch.float64), rows[:, list(ids)],
                                       rtol=0, atol=tol)
        else:
            assert got.token_ids is None


def test_asks_outside_the_prompt_are_refused(tiny, prompts):
    runner, pool = _runner(tiny, "float64", "torch")
    for ask in (5, -1, PromptLogprobAsk(0, top_k=-1)):
        with pytest.raises(ValueError):
            runner.prefill_with_logprobs([prompts[3]], _tables(pool, prompts[3:]), None, [ask])
