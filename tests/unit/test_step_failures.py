"""A request that cannot be served costs only itself (issue #11, finding 4), on the
in-process cluster (tests/unit/inproc.py): sampling parameters out of bounds are
refused at admission with 400 naming the parameter, and a model step that raises
ends exactly its batch with 500 while the worker goes on serving. Every scenario
ends with every KV page back and a request served correctly."""
from __future__ import annotations

import pytest

from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.unit.inproc import reference, send_raw
from zpd.wire.protocol import Generate
from zpd.worker.decode import DecodePhase
from zpd.worker.prefill import JobPhase

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
INJECTED = "RuntimeError: injected model failure"


def fail_once(monkeypatch, compute, name: str) -> list[int]:
    """Make `compute.<name>` raise on its first call; the batch sizes it was called with."""
    real, calls = getattr(compute, name), []

    def broken(reqs, *rest):
        calls.append(len(reqs))
        if len(calls) == 1:
            raise RuntimeError("injected model failure")
        return real(reqs, *rest)
    monkeypatch.setattr(compute, name, broken)
    return calls


# --- admission -------------------------------------------------------------------------


# Each of these once raised inside the prefill's sampler and killed the process.
@pytest.mark.parametrize("name,value", [("top_k", 2**63), ("temperature", 1e-300),
                                        ("top_p", 1e-320), ("repetition_penalty", 1e-300)])
def test_out_of_bounds_parameter_is_a_400_naming_it(cluster, name, value):
    send_raw(cluster.client, Generate("bad", PROMPT, stream=True), {name: value, "max_new_tokens": 4})
    got = cluster.run("bad")
    assert got.status == 400 and name in got.finish["message"], got.finish
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


def test_penalties_are_served(cluster):
    """On a float64 (or float32) model the sampler used to write the penalties into
    the runner's inference tensor, which raised and killed the prefill."""
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True,
              "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2}
    cluster.client.send(Generate("pen", PROMPT, SamplingParams.from_dict(params), True))
    got = cluster.run("pen")
    engine = OfflineEngine(cluster.prefill.model, kv_cache_mb=1)
    want = engine.run([Request("ref", PROMPT, SamplingParams.from_dict(params))])[0]["output_ids"]
    assert got.finish["type"] == "length" and got.token_ids == want
    cluster.check_pages()


# --- a failing step --------------------------------------------------------------------


@pytest.mark.parametrize("kv_dest_first", [False, True])
def test_failed_prefill_forward_ends_only_its_batch(cluster, monkeypatch, kv_dest_first):
    """The decode learns the 500 whether its kv_dest came before the failure (told at
    once) or comes after it (told when it arrives)."""
    if kv_dest_first:
        cluster.serves_again()                        # linked: kv_dest goes out at once
        cluster.silent.add("prefill")
    calls = fail_once(monkeypatch, cluster.prefill.compute, "prefill")
    rids = [cluster.submit(PROMPT, 6), cluster.submit(PROMPT[:9], 6)]
    if kv_dest_first:
        cluster.until(lambda: [j.asked for j in cluster.decode.scheduler.jobs.values()] == [0, 0])
        cluster.silent.clear()
    cluster.until(lambda: calls)
    assert calls == [2]                              # one batch of both
    if not kv_dest_first:
        assert [j.phase for j in cluster.prefill.scheduler.jobs.values()] == [JobPhase.REJECTED] * 2
    for rid in rids:
        got = cluster.run(rid)
        assert got.status == 500 and INJECTED in got.finish["message"], got.finish
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


def test_failed_decode_step_ends_only_its_batch(cluster, monkeypatch):
    cluster.serves_again()
    rids = [cluster.submit(PROMPT, 6), cluster.submit(PROMPT[:9], 6)]
    decode_jobs = cluster.decode.scheduler.jobs
    cluster.until(lambda: [j.asked for j in decode_jobs.values()] == [0, 0])
    cluster.silent.add("decode")                     # both kv_dones wait: one batch of both
    cluster.until(lambda: not cluster.prefill.scheduler.jobs)
    calls = fail_once(monkeypatch, cluster.decode.compute, "decode")
    cluster.silent.clear()
    for rid in rids:
        got = cluster.run(rid)
        assert got.status == 500 and INJECTED in got.finish["message"], got.finish
    assert calls[0] == 2
    assert not decode_jobs and len(cluster.decode.scheduler.batch) == 0
    cluster.check_pages()
    cluster.serves_again()


def test_failed_decode_step_spares_requests_outside_the_batch(cluster, monkeypatch):
    cluster.serves_again()
    first = cluster.submit(PROMPT, 6)
    cluster.until(lambda: DecodePhase.RUNNING in
                  [j.phase for j in cluster.decode.scheduler.jobs.values()])
    cluster.silent.add("prefill")                    # the second waits for its KV meanwhile
    second = cluster.submit(PROMPT[:9], 6)
    fail_once(monkeypatch, cluster.decode.compute, "decode")
    cluster.until(lambda: cluster.finished(first))
    assert cluster.answers[first].status == 500
    cluster.silent.clear()
    assert cluster.run(second).token_ids == reference(cluster, PROMPT[:9], 6)
    cluster.pump()
    cluster.check_pages()
