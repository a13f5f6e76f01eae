"""A prefill's last layer computes only the tokens whose output is read (each prompt's
last, engines/kv/meta.py `LastTokens`): the logits and every layer's keys and values
in the pool must be those of the whole computation."""
from __future__ import annotations

import pytest
import torch

import engines.models.llama as llama
from engines.kv.meta import PrefillMeta
from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams

LENGTHS = [1, 37, 5, 64, 20]


def whole_forward(monkeypatch):
    """The model as it was: every token through every layer, the last rows picked after."""
    forward = llama.LlamaForCausalLM.forward

    def every_token(self, ids, positions, kv, meta, backend):
        if not isinstance(meta, PrefillMeta):
            return forward(self, ids, positions, kv, meta, backend)
        last, meta.last = meta.last, None
        hidden = forward(self, ids, positions, kv, meta, backend)
        assert hidden.shape[0] == ids.shape[0]
        meta.last = last
        return hidden[last.rows]

    monkeypatch.setattr(llama.LlamaForCausalLM, "forward", every_token)


def pool_contents(runner, pool, table: list[int], n: int) -> list[torch.Tensor]:
    rows = runner.pages.rows(torch.tensor(table), torch.arange(n))
    return [pool.kv.read(layer, which, rows) for layer in range(pool.kv.num_layers) for which in (0, 1)]


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-10), ("float32", 2e-5)])
@pytest.mark.parametrize("prefix", [0, 16], ids=["whole prompts", "after cached prefixes"])
def test_last_tokens_only_equal_every_token(monkeypatch, dtype, tolerance, prefix):
    engine = OfflineEngine(load_model("tiny", dtype=dtype), max_batch=len(LENGTHS))
    runner, pool = engine.compute.runner, engine.compute.pool
    assert (runner.backend.paged_decode is not None) == (dtype == "float32")   # both attention paths
    prompts = [[(11 * n + 3 * i) % 250 + 1 for i in range(n + prefix)] for n in LENGTHS]

    def prefill(tables):
        if prefix:       # the prefixes first, then the rest from them (mixed: one from 0)
            runner.prefill([p[:prefix] for p in prompts], tables)
            return runner.prefill(prompts, tables, [prefix] * (len(prompts) - 1) + [0])
        return runner.prefill(prompts, tables)

    tables = [[pool.allocator.alloc(pool.pages_for(len(p))) for p in prompts] for _ in range(2)]
    got = prefill(tables[0])
    with monkeypatch.context() as m:
        whole_forward(m)
        want = prefill(tables[1])
    assert got.shape == want.shape == (len(prompts), runner.model.cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    for p, mine, theirs in zip(prompts, *tables):
        for a, b in zip(pool_contents(runner, pool, mine, len(p)), pool_contents(runner, pool, theirs, len(p))):
            assert torch.equal(a, b)             # the same products: the same keys and values


def test_generation_after_it_reads_the_last_layers_keys(monkeypatch):
    """Decode steps attend to the last layer's keys of every prompt token, written by
    the shortened layer: tokens equal the whole computation's."""
    model = load_model("tiny", dtype="float64")
    prompts = [[(5 * n + i) % 200 + 1 for i in range(n)] for n in LENGTHS]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)

    def run():
        return [o["output_ids"] for o in OfflineEngine(model).run(
            [Request(f"r{i}", p, params) for i, p in enumerate(prompts)])]

    got = run()
    with monkeypatch.context() as m:
        whole_forward(m)
        assert run() == got


def test_a_prompt_with_nothing_left_to_compute_is_refused():
    """Its last token would be the previous prompt's row of the batch: refused, not guessed."""
    engine = OfflineEngine(load_model("tiny", dtype="float32"))
    runner, pool = engine.compute.runner, engine.compute.pool
    prompts = [[3, 4, 5], [6, 7]]
    tables = [pool.allocator.alloc(pool.pages_for(len(p))) for p in prompts]
    with pytest.raises(ValueError, match="at least one token"):
        runner.prefill(prompts, tables, [0, 2])
