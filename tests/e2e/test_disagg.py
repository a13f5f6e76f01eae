"""Disaggregated serving end to end: real processes, ZeroMQ and Mooncake on loopback.

Greedy (and seeded) outputs must equal `zpd run`'s in float64, where near-ties
cannot flip a token."""
from __future__ import annotations

import random
import subprocess
import time

import orjson
import pytest
import zmq

from engines.loader import load_model
from engines.sampler import SamplingParams
from tests.e2e.cluster import Cluster, alive, assert_all_pages_free, zpd_cmd
from engines.offline import OfflineEngine
from zpd.wire.protocol import Admin, Ping, decode, encode
from engines.request import Request

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")


def _workload(n: int = 32, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 33, 64, 100] + [rng.randint(1, 120) for _ in range(n - 8)]
    out = []
    for i, length in enumerate(lengths):
        sampling = {"temperature": 0, "max_new_tokens": rng.randint(1, 24), "ignore_eos": i % 3 != 0}
        out.append({"input_ids": [rng.randrange(258) for _ in range(length)], "sampling_params": sampling})
    return out


def _reference(work: list[dict]) -> list[list[int]]:
    engine = OfflineEngine(load_model("tiny", dtype="float64"))
    reqs = [Request(f"ref{i}", w["input_ids"], SamplingParams.from_dict(w["sampling_params"]))
            for i, w in enumerate(work)]
    return [o["output_ids"] for o in engine.run(reqs)]


@pytest.fixture(scope="module")
def one_one(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("c11")) as c:
        yield c


@pytest.fixture(scope="module")
def two_two(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("c22"), prefill=2, decode=2) as c:
        yield c


@pytest.mark.parametrize("name", ["one_one", "two_two"])
def test_greedy_equals_zpd_run(name, request):
    cluster = request.getfixturevalue(name)
    work = _workload()
    expected = _reference(work)
    with cluster.client() as client:
        outs = client.generate_many(work)
        assert [o["output_ids"] for o in outs] == expected
        for o, w in zip(outs, work):
            assert o["finish_reason"]["type"] in ("stop", "length")
            assert o["meta"]["prompt_tokens"] == len(w["input_ids"])
            assert o["weight_versions"] == ["tiny"] * len(o["output_ids"])
            timings = o["meta"]["timings"]        # where the prefill's time went, in ms
            assert set(timings) == {"prefill_queue", "prefill_forward", "kv_dest_wait", "kv_transfer"}
            assert all(0 <= v < 60_000 for v in timings.values()) and timings["prefill_forward"] > 0
        status = assert_all_pages_free(client)
    if name == "two_two":
        # both prefills and both decodes were used
        assert len(status["workers"]) == 4


def test_streamed_equals_zpd_run(one_one):
    work = _workload(8, seed=1)
    expected = _reference(work)
    with one_one.client() as client:
        for w, exp in zip(work, expected):
            chunks = list(client.stream(**w))
            assert [t for c in chunks for t in c["token_ids"]] == exp
            assert chunks[-1]["finished"] and not any(c["finished"] for c in chunks[:-1])
            assert len(chunks) == len(exp)          # one chunk per token
        assert_all_pages_free(client)


@pytest.mark.parametrize("name", ["one_one", "two_two"])
def test_concurrent_streams_equal_zpd_run(name, request):
    """32 streaming requests in flight at once on one connection."""
    from zpd.client import assemble
    cluster = request.getfixturevalue(name)
    work = _workload(32, seed=4)
    expected = _reference(work)
    with cluster.client() as client:
        rids = [client.submit(stream=True, **w) for w in work]
        chunks: dict[str, list[dict]] = {rid: [] for rid in rids}
        finished = 0
        while finished < len(rids):
            chunk = client.receive(timeout=60)
            chunks[chunk["rid"]].append(chunk)
            finished += chunk["finished"]
        for rid, exp in zip(rids, expected):
            assert assemble(chunks[rid])["output_ids"] == exp
            assert len(chunks[rid]) == len(exp)          # one chunk per token
        assert_all_pages_free(client)


def test_seeded_sampling_equals_zpd_run(two_two):
    work = _workload(16, seed=2)
    for i, w in enumerate(work):
        w["sampling_params"] = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1000 + i,
                                "max_new_tokens": 12, "ignore_eos": True}
    expected = _reference(work)
    with two_two.client() as client:
        assert [o["output_ids"] for o in client.generate_many(work)] == expected
        assert_all_pages_free(client)


def test_logprobs_equal_zpd_run(two_two):
    """Logprobs (the first token's from a prefill) are `zpd run`'s, for greedy and seeded
    requests, streamed or not; requests that did not ask have none, in the same batches."""
    from zpd.client import assemble
    work = _workload(16, seed=5)
    for i, w in enumerate(work):
        w["sampling_params"] |= [{}, {"return_logprob": True}, {"top_logprobs_num": 5},
                                 {"temperature": 0.8, "seed": i, "repetition_penalty": 1.2,
                                  "top_logprobs_num": 3}][i % 4]
    engine = OfflineEngine(load_model("tiny", dtype="float64"))
    expected = engine.run([Request(f"ref{i}", w["input_ids"], SamplingParams.from_dict(w["sampling_params"]))
                           for i, w in enumerate(work)])
    keys = ("output_ids", "output_token_logprobs", "output_top_logprobs")
    with two_two.client() as client:
        whole = client.generate_many(work[:8])
        rids = [client.submit(stream=True, **w) for w in work[8:]]
        chunks: dict[str, list[dict]] = {rid: [] for rid in rids}
        while sum(c[-1]["finished"] for c in chunks.values() if c) < len(rids):
            chunk = client.receive(timeout=60)
            chunks[chunk["rid"]].append(chunk)
        got = whole + [assemble(chunks[rid]) for rid in rids]
        for g, e in zip(got, expected):
            assert {k: g.get(k) for k in keys} == {k: e.get(k) for k in keys}
        assert "output_token_logprobs" not in got[0] and len(got[1]["output_token_logprobs"]) > 0
        assert_all_pages_free(client)


def test_text_prompt_and_bad_requests(one_one):
    ref = OfflineEngine(load_model("tiny", dtype="float64"))
    (expected,) = ref.run([Request("t", ref.compute.model.tokenizer.encode("hello"),
                                   SamplingParams(temperature=0, max_new_tokens=8))])
    with one_one.client() as client:
        out = client.generate(prompt="hello", sampling_params={"temperature": 0, "max_new_tokens": 8})
        assert out["output_ids"] == expected["output_ids"] and out["text"] == expected["text"]
        for bad, why in [({"input_ids": [999]}, "out of range"), ({"input_ids": []}, "empty prompt"),
                         ({"input_ids": [1], "sampling_params": {"top_p": 7}}, "top_p"),
                         ({"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 500}},
                          "context length")]:
            out = client.generate(**bad)
            assert out["finish_reason"]["type"] == "abort", out
            assert out["finish_reason"]["status_code"] == 400 and why in out["finish_reason"]["message"]
        assert client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 3})["meta"][
            "completion_tokens"] == 3
        assert_all_pages_free(client)


def test_garbage_on_every_socket_is_dropped(one_one):
    ctx = zmq.Context()
    endpoints = [one_one.router] + [w["endpoint"] for w in one_one.info["workers"]]
    junk = [[b"\x00\xff garbage"], [b"{}"], [orjson.dumps({"v": 99, "type": "generate"})],
            [orjson.dumps({"v": 1, "type": "no_such_type"})],
            [orjson.dumps({"v": 1, "type": "generate", "rid": 5})],
            [orjson.dumps({"v": 1, "type": "kv_dest", "room": 1, "epoch": 0, "rid": "x",
                           "page_ids": 3})],
            [orjson.dumps({"v": 1, "type": "kv_done", "room": 12345, "epoch": 0, "first_token": 1,
                           "weight_version": "x"})],
            [b"a", b"b", b"c"]]
    try:
        for ep in endpoints:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{ep}")
            for frames in junk:
                s.send_multipart(frames)
            # a good message after the junk: its answer proves the junk was read and survived
            probe = Admin("status", {}, "probe") if ep == one_one.router else Ping(1, 0.0, "test")
            s.send_multipart(encode(probe))
            assert s.poll(20000), f"{ep} stopped answering after garbage"
            assert decode(s.recv_multipart()).TYPE in ("admin_reply", "pong")
            s.close()
    finally:
        ctx.destroy(linger=0)       # a failed assert leaves a socket open: term() would hang
    work = _workload(8, seed=3)
    with one_one.client() as client:
        assert [o["output_ids"] for o in client.generate_many(work)] == _reference(work)
        assert_all_pages_free(client)
    log = one_one.log.read_text()
    assert log.count("dropped malformed message") >= 3 * 5, "garbage was not logged"


def test_incompatible_prefill_fails_with_clear_error(tmp_path):
    """A decode in float64 paired with a prefill in float32: the KV layouts differ."""
    from zpd.client import Client
    procs, ready = [], {}
    try:
        for role, dtype in (("prefill", "float32"), ("decode", "float64")):
            ready[role] = tmp_path / f"{role}.json"
            procs.append(subprocess.Popen(zpd_cmd(role, "--model", "tiny", "--dtype", dtype,
                                                  "--kv-cache-mb", "8", "--ready-file", str(ready[role])),
                                          stderr=subprocess.DEVNULL))
        ready["router"] = tmp_path / "router.json"
        deadline = time.monotonic() + 60
        while not (ready["prefill"].exists() and ready["decode"].exists()):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        eps = {r: orjson.loads(ready[r].read_bytes())["endpoint"] for r in ("prefill", "decode")}
        procs.append(subprocess.Popen(zpd_cmd("router", "--prefill", eps["prefill"], "--decode",
                                              eps["decode"], "--port", "0", "--ready-file",
                                              str(ready["router"])), stderr=subprocess.DEVNULL))
        while not ready["router"].exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with Client(orjson.loads(ready["router"].read_bytes())["endpoint"], timeout=60) as client:
            for _ in range(2):                    # before and after the link is known refused
                out = client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
                reason = out["finish_reason"]
                assert reason["type"] == "abort" and reason["status_code"] == 500
                assert "incompatible" in reason["message"] and "float32" in reason["message"]
            assert_all_pages_free(client)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)


def test_launch_then_generate_from_another_shell(tmp_path):
    with Cluster(tmp_path, dtype="float32") as cluster:
        out = subprocess.run(zpd_cmd("generate", "--router", cluster.router, "--prompt", "hello",
                                     "--temperature", "0", "--max-new-tokens", "6", "--json"),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got = orjson.loads(out.stdout)
        ref = subprocess.run(zpd_cmd("run", "--model", "tiny", "--prompt", "hello", "--temperature",
                                     "0", "--max-new-tokens", "6", "--json"),
                             capture_output=True, text=True, timeout=120)
        assert got["output_ids"] == orjson.loads(ref.stdout)["output_ids"]
        pids = cluster.pids()
    assert not any(alive(p) for p in pids), "launch left workers behind"


def test_launch_gives_prefill_and_decode_their_own_thread_counts(tmp_path):
    """--prefill-threads/--decode-threads override --threads per role (a prefill and a
    decode rarely want the same number); bad values are refused before anything starts."""
    from pathlib import Path
    with Cluster(tmp_path, extra=("--prefill-threads", "1", "--decode-threads", "2")) as cluster:
        for w in cluster.info["workers"]:
            argv = Path(f"/proc/{w['pid']}/cmdline").read_bytes().split(b"\0")
            last = argv[len(argv) - 1 - argv[::-1].index(b"--threads") + 1]
            assert last == (b"1" if w["role"] == "prefill" else b"2"), (w["role"], argv)
        with cluster.client() as client:
            work = _workload(4, seed=5)
            assert [o["output_ids"] for o in client.generate_many(work)] == _reference(work)
    bad = subprocess.run(zpd_cmd("launch", "--model", "tiny", "--decode-threads", "0"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--decode-threads must be at least 1" in bad.stderr
