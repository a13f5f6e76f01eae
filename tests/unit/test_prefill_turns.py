"""A prefill's queue takes callers in turn (zpd/worker/fair.py), and a cancelled
deadline lets go of its request (a scoring job's prompt logprobs, ~5 MB a prompt,
were held for the deadline's whole length: the prefill grew 334 MB over one call)."""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

from zpd.wire.loop import Loop
from zpd.worker.fair import FairTurns, StepBudget


@dataclass(eq=False)
class Job:
    caller: str
    name: str


def names(jobs) -> list[str]:
    return [j.name for j in jobs]


def test_a_newcomer_goes_first_in_the_next_step_and_callers_alternate():
    turns = FairTurns()
    queue = [Job("a", f"a{i}") for i in range(5)]
    assert names(turns.order(queue)) == ["a0", "a1", "a2", "a3", "a4"]
    turns.served(queue[:2], queue[2:])                  # a step took a0 and a1
    queue = queue[2:] + [Job("b", "b0"), Job("b", "b1"), Job("c", "c0")]
    # b and c were never served: first (in arrival order), then round-robin with a
    assert names(turns.order(queue)) == ["b0", "c0", "a2", "b1", "a3", "a4"]
    assert turns.first(queue).name == "b0"


def test_the_book_forgets_callers_with_nothing_queued():
    turns = FairTurns()
    done = [Job(f"c{i}", "x") for i in range(100)]
    turns.served(done, [])
    assert turns.last == {}


def test_a_step_takes_what_the_worker_computes_in_its_seconds():
    budget = StepBudget(cap=8192, seconds=1.0, floor=16)
    assert budget.tokens() == 8192                      # nothing measured yet
    budget.took(8000, 32.0)                             # SmolLM2 on one CPU thread
    assert budget.tokens() == 250
    budget.took(1, 100.0)
    assert budget.tokens() >= 16
    fast = StepBudget(cap=8192, seconds=1.0, floor=16)
    fast.took(8192, 0.05)                               # a GPU: the cap stands
    assert fast.tokens() == 8192
    off = StepBudget(cap=8192, seconds=0.0, floor=16)
    off.took(8000, 32.0)
    assert off.tokens() == 8192


def test_a_cancelled_timer_lets_go_of_what_its_call_would_reach():
    loop = Loop()
    try:
        class Held:
            pass
        held = Held()
        timer = loop.call_later(3600.0, lambda what: what, held)
        gone = weakref.ref(held)
        del held
        timer.cancel()
        gc.collect()
        assert gone() is None
        loop.run_once(max_wait=0)                       # the lazy heap entry is harmless
    finally:
        loop.close()


def test_a_prefill_step_holds_at_most_one_requests_prompt_logprobs(monkeypatch):
    """Scoring requests whose prompt logprobs pass the bound together are computed in
    steps of their own (each step's are held whole until its answers go out)."""
    from tests.unit.inproc import InprocCluster
    monkeypatch.setattr("zpd.worker.prefill.MAX_PROMPT_LOGPROB_ENTRIES", 1000)
    c = InprocCluster(kv_cache_mb=4)
    try:
        steps: list[int] = []
        compute = c.prefill.scheduler.core.compute
        real = compute.prefill
        monkeypatch.setattr(compute, "prefill", lambda reqs, starts: (steps.append(len(reqs)),
                                                                       real(reqs, starts))[1])
        ask = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20}
        rids = [c.submit(list(range(3, 43)), max_new=0, sampling=ask) for _ in range(3)]   # 39 x 21 each
        for rid in rids:
            assert c.run(rid).status is None
        assert steps == [1, 1, 1], steps
        plain = [c.submit(list(range(3, 43)), max_new=0) for _ in range(3)]     # no logprobs
        for rid in plain:
            c.run(rid)
        assert len(steps) < 6, steps                    # those share steps
    finally:
        c.close()


def test_first_is_always_the_head_of_order():
    """`first` (asked every loop turn, stopping early) agrees with `order` step by step."""
    import random
    rng, turns = random.Random(7), FairTurns()
    queue = [Job(rng.choice("abcde"), str(i)) for i in range(40)]
    for step in range(60):
        assert turns.first(queue) is (turns.order(queue) or [None])[0], step
        taken = turns.order(queue)[:rng.randint(0, 3)]
        queue = [j for j in queue if j not in taken] + \
            [Job(rng.choice("abcdefg"), f"n{step}.{k}") for k in range(rng.randint(0, 2))]
        turns.served(taken, queue)
