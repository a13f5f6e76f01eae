"""Hostile input, found by a fuzzer: random and mutated messages of every type, and
random sampling parameters, sent to every socket of a live 1P1D cluster (router,
prefill, decode; real processes, real Mooncake on loopback) for a bounded time. Then:
every process is alive, a greedy request still equals `zpd run`, every pool's pages are
free, and no loop ran a timer more than 1 s late during the run."""
from __future__ import annotations

import dataclasses
import random
import time
import typing

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.kv.layout import KVLayout
from engines.sampling_params import SamplingParams
from tests.e2e.fault_checks import reference
from tests.e2e.fault_cluster import FaultCluster
from zpd.wire import protocol as p
from zpd.wire.net import Dealer
from zpd.wire.payloads import AdoptedRequest, KvTimings
from zpd.wire.router_proof import load_router_secret, router_identity

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

BUDGET_S = 25.0          # wall-clock time the fuzzer may send for
EXAMPLES = 600           # hypothesis examples (each a few messages)
ADMIN = ["status", "pause", "continue", "abort", "flush_cache", "release_memory",
         "resume_memory", "bogus"]      # not update_weights: new weights would change the check

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
weird_number = st.one_of(st.floats(), st.integers(-2**70, 2**70),
                         st.sampled_from([0, -1, 1, 1e-300, 1e-320, 2**63, 2**31, float("nan")]))
sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-5, 40), weird_number), "temperature": weird_number,
    "top_p": weird_number, "top_k": weird_number, "min_p": weird_number, "seed": weird_number,
    "repetition_penalty": weird_number, "frequency_penalty": weird_number,
    "presence_penalty": weird_number, "ignore_eos": json_value,
    "stop": st.lists(st.text(max_size=6), max_size=5) | json_value,
    "stop_token_ids": st.lists(st.integers(-3, 300), max_size=5) | json_value,
    "bogus": json_value})
int32s = st.lists(st.integers(-2**31, 2**31 - 1), max_size=40)
small_ids = st.lists(st.integers(-2, 300), min_size=0, max_size=40)
text = st.one_of(st.text(max_size=40), st.sampled_from(["127.0.0.1:1", "not-an-endpoint", "", "tiny"]))
KIND = {int: st.integers(-2**63, 2**63 - 1) | st.sampled_from([0, 1, -1, 7]), float: st.floats(
    allow_nan=False, allow_infinity=False), str: text, bool: st.booleans(),
        dict: st.dictionaries(st.text(max_size=8), json_value, max_size=4),
        list[int]: int32s, list[bytes]: st.lists(st.binary(max_size=12), min_size=1, max_size=3),
        list[str]: st.lists(st.text(max_size=8), max_size=6),
        list[float]: st.lists(st.floats(width=32), max_size=12),   # logprobs: NaN and inf too
        list[list[int]]: st.lists(st.lists(st.integers(-2**63, 2**63 - 1), max_size=4), max_size=4),
        dict[str, str]: st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4),
        # the records messages carry, well-typed (the decode checks their values)
        KVLayout: st.builds(KVLayout, num_layers=st.integers(1, 4), page_size=st.sampled_from(
            [1, 4, 16]), num_kv_heads=st.integers(1, 4), head_dim=st.sampled_from([8, 64]),
                            dtype=st.just("float32"), element_bytes=st.just(4)),
        KvTimings: st.builds(KvTimings, *[st.floats(0, 1e6)] * 4),
        dict[str, AdoptedRequest]: st.dictionaries(text, st.builds(
            AdoptedRequest, st.text(alphabet="0123456789abcdef", max_size=16), text,
            st.booleans(), st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1), st.booleans()),
            max_size=3)}


def message(cls: type) -> st.SearchStrategy:
    """Any well-typed instance of message class `cls` (its codec accepts it)."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Union:
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        fields[f.name] = st.just(SamplingParams()) if hint is SamplingParams else KIND[hint]
    if cls is p.Generate:
        fields |= {"input_ids": small_ids}
    if cls is p.Rows:                    # routed experts: mostly a dtype that exists
        fields |= {"dtype": st.sampled_from(["uint8", "uint8", "int16", "int32", "x"])}
    if cls is p.Admin:
        fields |= {"command": st.sampled_from(ADMIN) | st.text(max_size=12),
                   "args": st.fixed_dictionaries({}, optional={
                       "mode": st.sampled_from(["abort", "in_place", "retract", "x"]) | json_value,
                       "timeout": weird_number | json_value, "rid": json_value | text,
                       "path": json_value})}
    return st.builds(_make, st.just(cls), st.fixed_dictionaries(fields))


def _make(cls: type, fields: dict) -> p.Message | None:
    try:
        return cls(**fields)
    except p.ProtocolError:          # a record that checks itself (Tokens) refused them
        return None


def frames_of(msg: p.Message | None) -> list[bytes]:
    try:
        return p.encode(msg) if msg is not None else [b"{}"]
    except p.ProtocolError:
        return [b"{}"]


mutation = st.sampled_from(["none", "none", "flip", "drop_blob", "extra_frame", "garbage",
                            "header_json"])


@st.composite
def mutated(draw) -> list[bytes]:
    cls = draw(st.sampled_from(list(p.MESSAGE_TYPES.values())))
    frames = frames_of(draw(message(cls)))
    if cls in (p.Generate, p.Recompute) and frames != [b"{}"]:   # sampling as a peer sends it
        try:
            frames[0] = orjson.dumps(orjson.loads(frames[0]) | {"sampling": draw(sampling)})
        except TypeError:                # past 64 bits: JSON cannot carry it, nor could encode
            frames = [b"{}"]
    how = draw(mutation)
    if how == "flip" and frames[0]:
        i = draw(st.integers(0, len(frames[0]) - 1))
        frames[0] = frames[0][:i] + bytes([frames[0][i] ^ draw(st.integers(1, 255))]) + frames[0][i + 1:]
    elif how == "drop_blob" and len(frames) > 1:
        frames = frames[:-1]
    elif how == "extra_frame":
        frames = frames + [draw(st.binary(max_size=64))]
    elif how == "garbage":
        frames = draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
    elif how == "header_json":
        header = {"v": draw(st.sampled_from([1, 1, 2, "1", None])), "type": cls.TYPE} | \
            draw(st.dictionaries(st.sampled_from(["rid", "room", "epoch", "page_ids", "input_ids",
                                                  "command", "args", "token_ids", "counts"]),
                                 json_value, max_size=4))
        try:
            frames = [orjson.dumps(header)] + frames[1:]
        except TypeError:
            pass
    return frames


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with FaultCluster(tmp_path_factory.mktemp("fuzz")) as c:
        yield c


def test_fuzzed_messages_leave_the_cluster_serving(cluster):
    ctx = zmq.Context()
    targets = [cluster.router.endpoint] + [w.endpoint for w in cluster.workers]
    # one of each pair a router of the cluster (its secret: what it sends reaches the
    # handlers), the other a stranger (refused by the socket's guard where it must be)
    secret = load_router_secret(cluster.security_flags[1])
    names = [lambda i: router_identity(f"127.0.0.1:{i + 1}", "1.fuzz", secret),
             lambda i: f"fuzz{i}".encode()]
    dealers = [Dealer(ctx, ep, identity=name(i)) for i, ep in enumerate(targets) for name in names]
    sent, started = [0], time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(st.tuples(st.integers(0, len(dealers) - 1), mutated()), min_size=1,
                          max_size=6))
    def send(batch):
        if time.monotonic() - started > BUDGET_S:
            return
        for i, frames in batch:
            dealers[i].socket.send_multipart(frames, flags=zmq.NOBLOCK)
            sent[0] += 1
        for d in dealers:                  # read answers so nothing backs up
            while d.socket.poll(0):
                d.socket.recv_multipart()

    try:
        send()
        took = time.monotonic() - started
        print(f"fuzz: {sent[0]} messages in {took:.1f} s")
        assert sent[0] > 200
        for proc in cluster.procs():
            assert proc.alive, f"{proc.name} died:\n{cluster.logs()}"
        with cluster.client() as c:         # undo what the fuzzer may have asked of the admin
            c.admin("continue")
            c.admin("resume_memory")
            paused = c.admin("pause", mode="abort")      # end whatever it left running
            assert paused["ok"], paused["workers"]
            assert c.admin("continue")["ok"]
            prompt, n = [random.Random(3).randrange(256) for _ in range(20)], 12
            out = c.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n,
                                                                "ignore_eos": True})
            assert out["output_ids"] == reference([(prompt, n)])[0], out
        cluster.wait_all_free(timeout=40)
        for w in cluster.workers:
            late = cluster.worker_status(w)["loop_max_late_ms"]
            assert late < 1000, (w.name, late)
    finally:
        for d in dealers:
            d.close()
        ctx.destroy(linger=0)
