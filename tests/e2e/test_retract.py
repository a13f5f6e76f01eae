"""True retraction: pause, update weights, continue — exact under the new weights.

float64 throughout, so greedy tokens are exact. Expected output of a request paused
after k tokens: the first k tokens are W1's greedy continuation; the rest are W2's
greedy continuation of prompt + those k tokens."""
from __future__ import annotations

import random
import threading
import time

import pytest

from engines.loader import load_model
from engines.sampler import SamplingParams
from engines.models.tiny import save_tiny
from tests.e2e.cluster import Cluster, assert_all_pages_free
from tests.e2e.fault_cluster import ClientReader
from zpd.client import assemble
from engines.offline import OfflineEngine
from engines.request import Request

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")


class Collector(ClientReader):
    """Streaming requests on one client, whose chunks a thread gathers. While the thread
    runs the client is its own (a zmq socket is not thread-safe): requests submitted
    after `start` are handed to it to send, admin commands go through another client,
    and the client is used again, or closed, only after `wait` or `stop` ended the
    thread. `with cluster.client() as client, Collector(client) as col:` stops the
    reader before the client closes, however the test ends: a socket closed under a
    thread still reading it is undefined behaviour, and such a leftover once hung the
    whole test run (see fault_cluster.Requests)."""

    POLL = 0.02     # seconds the reader waits for a chunk before it sends what was handed
                    # to it and looks at `stopping`; also the most a late `submit` waits

    def __init__(self, client) -> None:
        super().__init__()
        self.client, self.chunks, self.done = client, {}, {}
        self.lock = threading.Lock()
        self.error: BaseException | None = None     # what ended the reader, if not the work
        self._outbox: list[tuple[dict, threading.Event]] = []   # submitted after `start`
        self._ended = False             # the reader is past its last look at the outbox

    def submit(self, ids: list[int], max_new: int, rid: str) -> None:
        request = {"input_ids": ids, "rid": rid, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
        if self.thread is None:
            self.chunks[rid] = []
            self.client.submit(**request)
            return
        sent = threading.Event()
        with self.lock:
            assert not self._ended, f"the reader ended before {rid} was submitted"
            self.chunks[rid] = []
            self._outbox.append((request, sent))
        deadline = time.monotonic() + 10
        while not sent.wait(self.POLL):     # sent on the reader's thread, as if here
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"the reader did not send {rid}") from self.error

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                with self.lock:
                    outbox, self._outbox = self._outbox, []
                    if not outbox and len(self.done) >= len(self.chunks):
                        self._ended = True      # under the lock: no submit slips in now
                        return
                for request, sent in outbox:
                    self.client.submit(**request)
                    sent.set()
                try:
                    chunk = self.client.receive(timeout=self.POLL)
                except TimeoutError:
                    continue
                with self.lock:
                    self.chunks[chunk["rid"]].append(chunk)
                    if chunk["finished"]:
                        self.done[chunk["rid"]] = assemble(self.chunks[chunk["rid"]])
        except BaseException as e:          # handed to the test by `wait`
            self.error = e
        finally:
            with self.lock:
                self._ended = True

    def tokens_so_far(self) -> dict[str, int]:
        with self.lock:
            return {rid: sum(len(c["token_ids"]) for c in cs) for rid, cs in self.chunks.items()}

    def wait(self, timeout: float = 120) -> dict[str, dict]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"only {len(self.done)}/{len(self.chunks)} finished"
        if self.error is not None:
            raise AssertionError("the reader failed") from self.error
        return self.done


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    if n <= 0:
        return []
    engine = OfflineEngine(model)
    (out,) = engine.run([Request("x", prompt, SamplingParams(temperature=0, max_new_tokens=n,
                                                             ignore_eos=True))])
    return out["output_ids"]


def check_exact(prompt: list[int], out: dict, models: dict) -> None:
    """Split the output by weight version and check each span against `zpd run`."""
    ids, versions = out["output_ids"], out["weight_versions"]
    assert len(ids) == len(versions)
    pos, context = 0, list(prompt)
    while pos < len(ids):
        version = versions[pos]
        end = pos
        while end < len(ids) and versions[end] == version:
            end += 1
        assert ids[pos:end] == _greedy(models[version], context, end - pos)[:end - pos], \
            f"{out['rid']}: tokens {pos}:{end} are not {version}'s greedy continuation"
        context += ids[pos:end]
        pos = end


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {"w2": save_tiny(root / "w2", seed=2), "w3": save_tiny(root / "w3", seed=3)}
    models = {"tiny": load_model("tiny", dtype="float64")}
    models |= {v: load_model(str(d), dtype="float64") for v, d in dirs.items()}
    return dirs, models


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Every KV write takes 0.4 s longer, so a request submitted shortly before a pause
    # is reliably still in transfer when the pause lands, whatever the machine's load.
    with Cluster(tmp_path_factory.mktemp("retract"), extra=("--max-batch", "64"),
                 env={"ZPD_TRANSPORT_FAULT": "delay:seconds=0.4"}) as c:
        yield c


def _workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 16, 17, 40, 90, 150, 200] + [rng.randint(1, 200) for _ in range(n - 8)]
    return [([rng.randrange(256) for _ in range(k)], rng.choice([1, 2, 5, 40, 80, 120]))
            for k in lengths]


def _pause_midway(cluster, col: Collector, mode: str) -> dict:
    """Wait until some requests have tokens and others have none yet, then pause
    (through a client of its own: `col`'s belongs to its reader)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        counts = col.tokens_so_far()
        # mid-output: has tokens and is not done (short requests may finish at once)
        if sum(1 for rid, c in counts.items() if c > 0 and rid not in col.done) >= 3:
            break
        time.sleep(0.002)
    with cluster.client() as admin:
        reply = admin.admin("pause", mode=mode, timeout=30)
        assert reply["ok"], reply
        return reply


def test_retract_update_continue_is_exact(cluster, ckpts):
    dirs, models = ckpts
    work = _workload(20, seed=5)
    with cluster.client() as client, Collector(client) as col:
        for i, (ids, n) in enumerate(work[:12]):
            col.submit(ids, n, f"a{i}")
        col.start()
        time.sleep(0.15)
        for i, (ids, n) in enumerate(work[12:]):      # still in transfer when the pause lands
            col.submit(ids, n, f"b{i}")
        paused = _pause_midway(cluster, col, "retract")
        with cluster.client() as admin:
            for w in paused["workers"]:           # pause(retract) returned: no KV anywhere
                assert w["kv_pages"]["free"] + w["kv_pages"]["cached"] == w["kv_pages"]["total"], w
            finished_before = set(col.done)
            status = admin.admin("status")
            held = {rid for w in status["workers"] if w["role"] == "decode" for rid in w["held"]}
            assert held and held.isdisjoint(finished_before)
            upd = admin.admin("update_weights", path=str(dirs["w2"]), version="w2")
            assert upd["ok"] and {w["weight_version"] for w in upd["workers"]} == {"w2"}, upd
            assert admin.admin("continue")["ok"]
        outs = col.wait()
        prompts = {f"a{i}": ids for i, (ids, _) in enumerate(work[:12])} | \
                  {f"b{i}": ids for i, (ids, _) in enumerate(work[12:])}
        switched = 0
        for rid, out in outs.items():
            check_exact(prompts[rid], out, models)
            assert out["meta"]["retractions"] == (1 if rid in held else 0), (rid, out["meta"])
            switched += "w2" in out["weight_versions"] and "tiny" in out["weight_versions"]
        assert switched >= 2, "no request was paused in the middle of its output"
        assert any(rid in held and "tiny" not in outs[rid]["weight_versions"] for rid in outs), \
            "no request was retracted before its first token"
        assert_all_pages_free(client)
    with cluster.client() as admin:          # back to W1 for the other tests
        assert admin.admin("update_weights", path="tiny", version="tiny")["ok"]


def test_retract_after_the_first_token_went_ahead_is_exact(cluster, ckpts):
    """A streamed request's first token goes from its prefill to the client before the
    KV write ends. Pausing then (write still under way, so the decode has no output
    yet) must resume after that token: it is W1's, everything after is W2's greedy
    continuation of prompt + that token, and no token is repeated or lost."""
    dirs, models = ckpts
    work = [([11 + i, 7, 3, 90 + i], 6) for i in range(6)]
    with cluster.client() as client, Collector(client) as col:
        for i, (ids, n) in enumerate(work):
            col.submit(ids, n, f"e{i}")
        col.start()
        deadline = time.monotonic() + 30
        while any(c < 1 for c in col.tokens_so_far().values()) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert all(c == 1 for c in col.tokens_so_far().values()), col.tokens_so_far()
        with cluster.client() as admin:             # within the 0.4 s the writes take
            assert admin.admin("pause", mode="retract", timeout=30)["ok"]
            assert admin.admin("update_weights", path=str(dirs["w2"]), version="w2")["ok"]
            assert admin.admin("continue")["ok"]
        outs = col.wait()
        for i, (ids, n) in enumerate(work):
            out = outs[f"e{i}"]
            check_exact(ids, out, models)
            assert out["weight_versions"] == ["tiny"] + ["w2"] * (n - 1), out
            assert out["meta"]["retractions"] == 1
        assert_all_pages_free(client)
    assert "which its prefill sent ahead" in cluster.log.read_text()
    with cluster.client() as admin:
        assert admin.admin("update_weights", path="tiny", version="tiny")["ok"]


def test_two_cycles_three_checkpoints(cluster, ckpts):
    dirs, models = ckpts
    work = _workload(16, seed=9)
    with cluster.client() as client, Collector(client) as col:
        for i, (ids, n) in enumerate(work):
            col.submit(ids, max(n, 60), f"c{i}")
        col.start()
        with cluster.client() as admin:
            for version in ("w2", "w3"):
                _pause_midway(cluster, col, "retract")
                assert admin.admin("pause", mode="retract")["ok"]      # a second pause is harmless
                assert admin.admin("update_weights", path=str(dirs[version]), version=version)["ok"]
                assert admin.admin("continue")["ok"]
                time.sleep(0.3)
        outs = col.wait()
        for i, (ids, _) in enumerate(work):
            check_exact(ids, outs[f"c{i}"], models)
        assert any(out["meta"]["retractions"] == 2 for out in outs.values())
        assert_all_pages_free(client)
    with cluster.client() as admin:
        assert admin.admin("continue")["ok"]                 # continue while running: no-op
        assert admin.admin("update_weights", path="tiny", version="tiny")["ok"]


def test_abort_held_request_while_paused(cluster):
    with cluster.client() as client, Collector(client) as col:
        col.submit(list(range(1, 30)), 200, "held1")
        col.submit(list(range(5, 9)), 200, "held2")
        col.start()
        _pause_midway_one(col)
        with cluster.client() as admin:
            assert admin.admin("pause", mode="retract")["ok"]
            t = time.monotonic()
            assert admin.admin("abort", rid="held1")["ok"]
            while "held1" not in col.done:
                assert time.monotonic() - t < 1.0, "abort of a held request took over a second"
                time.sleep(0.01)
            out = col.done["held1"]
            assert out["finish_reason"]["status_code"] == 499
            status = admin.admin("status")
            assert all("held1" not in w.get("held", []) for w in status["workers"])
            assert "held2" in {r for w in status["workers"] for r in w.get("held", [])}
            missing = admin.admin("abort", rid="no-such-rid")
            assert not missing["ok"] and missing["status"] == 404
            assert admin.admin("continue")["ok"]
        outs = col.wait()
        assert outs["held2"]["finish_reason"]["type"] == "length"
        assert_all_pages_free(client)


def _pause_midway_one(col) -> None:
    deadline = time.monotonic() + 30
    while min(col.tokens_so_far().values()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_in_place_keeps_kv_and_resumes(cluster, ckpts):
    _, models = ckpts
    work = _workload(10, seed=11)
    with cluster.client() as client, Collector(client) as col:
        for i, (ids, n) in enumerate(work):
            col.submit(ids, n, f"p{i}")
        col.start()
        reply = _pause_midway(cluster, col, "in_place")
        decode = next(w for w in reply["workers"] if w["role"] == "decode")
        if len(col.done) < len(work):
            assert decode["kv_pages"]["held"] > 0          # KV kept while paused
        with cluster.client() as admin:
            bad = admin.admin("pause", mode="retract")
            assert not bad["ok"]                           # 409: paused in another mode
            assert admin.admin("continue")["ok"]
        outs = col.wait()
        for i, (ids, _) in enumerate(work):
            out = outs[f"p{i}"]
            check_exact(ids, out, models)                  # no weight change: all W1
            assert out["meta"]["retractions"] == 0
        assert_all_pages_free(client)


def test_abort_mode_ends_everything(cluster):
    work = _workload(12, seed=13)
    with cluster.client() as client, Collector(client) as col:
        for i, (ids, n) in enumerate(work):
            col.submit(ids, 150, f"x{i}")
        col.start()
        _pause_midway(cluster, col, "abort")
        outs = col.wait(30)
        assert all(o["finish_reason"]["type"] in ("abort", "length") for o in outs.values())
        assert sum(o["finish_reason"].get("status_code") == 499 for o in outs.values()) >= 6
        with cluster.client() as admin:
            queued = admin.submit(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3})
            for _ in range(200):                           # waits at the router while paused
                if admin.admin("status")["queued"] == 1:
                    break
                time.sleep(0.05)
            assert admin.admin("status")["queued"] == 1
            assert admin.admin("continue")["ok"]
            out = admin.receive(timeout=30)
            while not out["finished"]:
                out = admin.receive(timeout=30)
            assert out["rid"] == queued and out["finish_reason"]["type"] == "length"
        assert_all_pages_free(client)


def test_update_weights_refused_while_running_and_for_bad_paths(cluster):
    with cluster.client() as client:
        # Running for sure (its decode has sent a token), and far from its end: a sleep
        # instead raced a fixed length against the clock.
        rid = client.submit(input_ids=[1, 2, 3], stream=True,
                            sampling_params={"max_new_tokens": 3000, "ignore_eos": True})
        tokens = 0
        while tokens < 2:
            chunk = client.receive(timeout=30)
            assert not chunk["finished"], chunk
            tokens += len(chunk["token_ids"])
        busy = client.admin("update_weights", path="tiny:5", version="x")
        assert not busy["ok"] and busy["status"] == 409 and "pause first" in busy["error"]
        client.abort(rid)
        assert client.admin("pause", mode="retract")["ok"]
        missing = client.admin("update_weights", path="/no/such/dir")
        assert not missing["ok"] and all("no/such/dir" in w["error"] for w in missing["workers"])
        assert {w["weight_version"] for w in client.admin("status")["workers"]} == {"tiny"}
        assert client.admin("continue")["ok"]


def test_recompute_moves_to_another_prefill_when_its_own_is_gone(tmp_path, ckpts):
    """2P1D: kill a prefill while paused; after continue its requests are recomputed
    on the other prefill, still exactly."""
    import os
    import signal
    dirs, models = ckpts
    work = _workload(16, seed=17)
    with Cluster(tmp_path, prefill=2, decode=1) as cluster, cluster.client() as client, \
            Collector(client) as col:
        for i, (ids, n) in enumerate(work):
            col.submit(ids, max(n, 40), f"k{i}")
        col.start()
        _pause_midway(cluster, col, "retract")
        victim = next(w for w in cluster.info["workers"] if w["role"] == "prefill")
        os.kill(victim["pid"], signal.SIGKILL)
        with cluster.client() as admin:
            upd = admin.admin("update_weights", path=str(dirs["w2"]), version="w2", timeout=3)
            answered = [w for w in upd["workers"] if w["ok"]]
            assert len(answered) == 2 and {w["weight_version"] for w in answered} == {"w2"}
            resumed = admin.admin("continue", timeout=3)
            assert resumed["ok"], resumed
            dead = [w for w in resumed["workers"] if w["endpoint"] == victim["endpoint"]]
            assert dead and not dead[0]["ok"]
        outs = col.wait()
        for i, (ids, _) in enumerate(work):
            out = outs[f"k{i}"]
            assert out["finish_reason"]["type"] == "length", out["finish_reason"]
            check_exact(ids, out, models)
        status = client.admin("status", timeout=3)
        for w in status["workers"]:
            if w["ok"]:
                assert w["kv_pages"]["free"] + w["kv_pages"]["cached"] == w["kv_pages"]["total"], w
