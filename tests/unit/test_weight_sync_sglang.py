"""Trainer weight sync as SGLang's clients do it, in one process (the real router and
workers of tests/unit/inproc.py; a gloo trainer on a thread, tests/unit/trainer_side.py):
the group keyed as SGLang's init_custom_process_group by default, master_port as a
string, a join that cannot complete, and update_weights_from_tensor with SGLang's
payload. The HTTP routes' own checks run over the fake router (tests/unit/http_fake.py)."""
from __future__ import annotations

import base64
import socket
import threading
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401  (registers torch's reductions)

from engines.loader import load_model
from engines.models.tiny import tiny_state_dict
from tests.unit.http_fake import call, front
from tests.unit.inproc import InprocCluster
from tests.unit.test_handoff import PROMPT, reference_tiny
from tests.unit.test_tensor_payload import flattened, serialize, verl_payload
from tests.unit.test_weight_sync import admin, push, versions, weights_equal
from tests.unit.trainer_side import Trainer
from zpd.wire.admin import JoinWeightsGroup
from zpd.wire.loop import Loop
from zpd.worker.weights.port import SyncPort
from zpd.worker.weights.sync import WeightSync

W2 = tiny_state_dict(7)


@pytest.fixture
def cluster():
    c = InprocCluster(kv_cache_mb=2.0)
    yield c
    c.close()


@pytest.fixture
def file_system():
    """SGLang's trainers share CPU tensors this way for another process to map."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


def idle(c: InprocCluster) -> bool:
    return all(core.parts["weight_sync"].job is None and not core.parts["weight_sync"].groups
               for core in (c.prefill, c.decode))


# --- the group -----------------------------------------------------------------------


def test_sglang_keyed_group_is_the_default_and_master_port_may_be_a_string(cluster):
    """No trainer_init sent: the worker keys the group as SGLang's helper does."""
    t = Trainer(world_size=3, trainer_init="init_custom_process_group", group_name="wg")
    try:
        t.join()
        got = admin(cluster, "init_weights_update_group", master_address="127.0.0.1",
                    master_port=str(t.port), rank_offset=1, world_size=3, group_name="wg")
        assert got["ok"], got
        assert t.wait() is None
        assert push(cluster, t, W2, version="v2")["ok"]
        assert versions(cluster) == ["v2", "v2"] and weights_equal(cluster, "tiny:7")
    finally:
        t.close()


def test_one_rank_for_two_workers_relays_inside_the_cluster(cluster):
    """AReaL's `sglang:d1`: world_size 2, rank_offset 1, one rank for a 1P1D cluster
    (before: 400 "rank_offset 1 + 2 workers exceeds world_size 2"). The first worker
    joins the trainer's group and relays each broadcast to the other; both move, per
    tensor and as one bucket, and generate as the pushed weights do."""
    t = Trainer(world_size=2, group_name="areal")
    try:
        t.join()
        got = admin(cluster, "init_weights_update_group", master_address="127.0.0.1",
                    master_port=str(t.port), rank_offset=1, world_size=2, group_name="areal",
                    backend="gloo")
        assert got["ok"] and t.wait() is None, got
        first, second = (w.endpoint for w in cluster.router.workers)
        assert got["ranks"] == {first: 1} and got["relay"] == {"from": first, "to": [second]}
        q = "model.layers.0.self_attn.q_proj.weight"       # refused: drained through the relay
        bad = push(cluster, t, W2 | {q: torch.zeros(W2[q].shape[0] + 1, W2[q].shape[1])})
        assert not bad["ok"] and {w["status"] for w in bad["workers"]} == {400}, bad
        assert versions(cluster) == ["tiny", "tiny"] and t.error is None
        assert push(cluster, t, W2, version="r1")["ok"]
        assert versions(cluster) == ["r1", "r1"] and weights_equal(cluster, "tiny:7")
        rid = cluster.submit(PROMPT, 8)
        assert cluster.run(rid).token_ids == reference_tiny("tiny:7", PROMPT, 8)
        w3 = tiny_state_dict(3)
        assert push(cluster, t, w3, version="r2", bucket=True)["ok"]
        assert versions(cluster) == ["r2", "r2"] and weights_equal(cluster, "tiny:3")
        assert admin(cluster, "destroy_weights_update_group", group_name="areal")["ok"]
        assert idle(cluster)
    finally:
        t.close()


@pytest.mark.parametrize("port", ["abc", "0", "65536", "-1", " 80", 1.5])
def test_a_bad_master_port_is_400_naming_it(cluster, port):
    reply = cluster.admin("init_weights_update_group", master_address="127.0.0.1",
                          master_port=port, rank_offset=1, world_size=3, group_name="g")
    assert not reply["ok"] and reply["status"] == 400 and "master_port" in reply["error"], reply
    assert idle(cluster)


def test_a_join_that_never_completes_fails_in_time_and_a_retry_works(cluster):
    """The trainer's port accepts and never speaks: torch's TCPStore waits past its
    own timeout there, so the worker kills the helper process joining for it at the
    timeout and is free at once."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        started = time.monotonic()
        req = cluster.admin("init_weights_update_group", wait=False, master_address="127.0.0.1",
                            master_port=silent.getsockname()[1], rank_offset=1, world_size=3,
                            group_name="g", timeout=4.0)
        end = time.monotonic() + 15
        while req not in cluster.replies:
            assert time.monotonic() < end, "the join was not bounded"
            cluster.pump(1)
            time.sleep(0.001)
        took, reply = time.monotonic() - started, cluster.replies[req]
        assert 3.6 <= took < 4.0 + 10.0, took         # the workers' 3.6 s, not before
        assert not reply["ok"], reply
        errors = [w["error"] for w in reply["workers"]]
        assert len(errors) == 2 and all("'g'" in e and "timed out" in e for e in errors), reply
        assert idle(cluster)
        t = Trainer(world_size=3, group_name="g")    # the same group, now reachable
        try:
            t.join()
            got = admin(cluster, "init_weights_update_group", master_address="127.0.0.1",
                        master_port=t.port, rank_offset=1, world_size=3, group_name="g")
            assert got["ok"] and t.wait() is None, got
            assert push(cluster, t, W2)["ok"] and weights_equal(cluster, "tiny:7")
        finally:
            t.close()
    finally:
        silent.close()
    cluster.serves_again()
    for thread in [t for t in threading.enumerate() if t.name == "zpd-weights-g"]:
        thread.join(5)                               # it answered: it ends at once
        assert not thread.is_alive()


def test_a_stuck_join_is_answered_in_real_time():
    """The same on a real clock: a worker's WeightSync over a real Loop answers a join
    to a silent port within its timeout plus the helper's start (torch alone would
    not answer)."""
    loop = Loop()
    port = SyncPort(model=SimpleNamespace(device=torch.device("cpu")), ranks=None,
                    timeout_s=300.0, call_soon_threadsafe=loop.call_soon_threadsafe,
                    long_call=nullcontext, running_unpaused=lambda: False,
                    require_weights=lambda what: None, set_weights=lambda version: "v")
    sync, answers = WeightSync(port), []
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        started = time.monotonic()
        sync.join(JoinWeightsGroup("stuck", "127.0.0.1", silent.getsockname()[1], 2, 1, 1.0),
                  lambda ok, result: answers.append((ok, result)))
        while not answers and time.monotonic() - started < 10:
            loop.run_once(max_wait=0.05)
        took = time.monotonic() - started
        assert answers and not answers[0][0] and "'stuck'" in answers[0][1].error, answers
        assert answers[0][1].status == 504
        # the timeout, plus (the first time in a process) starting the helpers' forkserver,
        # which imports torch: seconds on a loaded machine (torch alone: never)
        assert took < 1.0 + 10.0, took
        assert sync.job is None and not sync.groups
    finally:
        silent.close()
    for thread in [t for t in threading.enumerate() if t.name == "zpd-weights-stuck"]:
        thread.join(5)                               # it answered: it ends at once
        assert not thread.is_alive()
    loop.close()


# --- update_weights_from_tensor --------------------------------------------------------


def test_tensors_from_a_payload_move_every_worker(cluster, file_system):
    reply = admin(cluster, "update_weights_from_tensor",
                  serialized_named_tensors=[serialize(list(W2.items()))], weight_version="t1")
    assert reply["ok"] and reply["weight_version"] == "t1", reply
    assert versions(cluster) == ["t1", "t1"] and weights_equal(cluster, "tiny:7")
    rid = cluster.submit(PROMPT, 8)
    assert cluster.run(rid).token_ids == reference_tiny("tiny:7", PROMPT, 8)
    assert cluster.answers[rid].weight_versions == ["t1"] * 8
    assert all(core.parts["weight_sync"].shadow is None for core in (cluster.prefill, cluster.decode))
    # without a version, the weights change and the version stays
    reply = admin(cluster, "update_weights_from_tensor",
                  serialized_named_tensors=[serialize(list(tiny_state_dict(3).items()))])
    assert reply["ok"] and reply["weight_version"] == "t1", reply
    assert versions(cluster) == ["t1", "t1"] and weights_equal(cluster, "tiny:3")
    cluster.check_pages()


def test_a_flattened_bucket_moves_every_worker(cluster, file_system):
    """SGLang's load_format "flattened_bucket": one flat tensor and its metadata."""
    reply = admin(cluster, "update_weights_from_tensor", load_format="flattened_bucket",
                  serialized_named_tensors=[serialize(flattened(W2))], weight_version="b7")
    assert reply["ok"], reply
    assert versions(cluster) == ["b7", "b7"] and weights_equal(cluster, "tiny:7")
    reply = cluster.admin("update_weights_from_tensor", load_format="zip",
                          serialized_named_tensors=["QUJD"])
    assert not reply["ok"] and reply["status"] == 400 and "load_format" in reply["error"]


def test_verls_local_serialized_tensors_give_each_worker_its_rank(cluster, file_system):
    """verl through sglang's weight_sync.utils.update_weights: every entry of
    serialized_named_tensors the same, each tensor a LocalSerializedTensor of one dump
    per TP rank; worker i (status order) takes values[i]. Before: 400 "names
    ...LocalSerializedTensor, which is not one of torch's ... rebuild functions"."""
    mlp = lambda seed: [(n, t) for n, t in tiny_state_dict(seed).items() if ".mlp." in n]  # noqa: E731
    payload = verl_payload([mlp(7), mlp(3)])
    reply = admin(cluster, "update_weights_from_tensor", serialized_named_tensors=[payload] * 2,
                  weight_version="verl1")
    assert reply["ok"], reply
    order = [w.endpoint for w in cluster.router.workers]
    cores = {core.endpoint: core for core in (cluster.prefill, cluster.decode)}
    for endpoint, seed in zip(order, (7, 3)):
        want = dict(load_model(f"tiny:{seed}", dtype="float64").net.named_parameters())
        got = dict(cores[endpoint].model.net.named_parameters())
        assert all(torch.equal(got[n], want[n]) for n in want if ".mlp." in n)
    # verl at infer_tp 1: one value, every worker takes it; then generation follows it
    reply = admin(cluster, "update_weights_from_tensor",
                  serialized_named_tensors=[verl_payload([list(W2.items())])])
    assert reply["ok"] and weights_equal(cluster, "tiny:7"), reply
    rid = cluster.submit(PROMPT, 8)
    assert cluster.run(rid).token_ids == reference_tiny("tiny:7", PROMPT, 8)
    # and SGLang's get_weights_by_name reads them back (q_proj: rows of the packed qkv)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        reply = cluster.admin("get_weights", name=name, truncate_size=3)
        assert reply["ok"], reply
        want = W2[name][:3].to(torch.float32).tolist()
        assert all(w["values"] == want for w in reply["workers"]), name
    reply = cluster.admin("get_weights", name="model.nope.weight")
    assert not reply["ok"] and "no weight named" in reply["workers"][0]["error"]


def test_one_entry_per_worker_in_status_order(cluster, file_system):
    mlp = lambda seed: [(n, t) for n, t in tiny_state_dict(seed).items() if ".mlp." in n]  # noqa: E731
    reply = admin(cluster, "update_weights_from_tensor",
                  serialized_named_tensors=[serialize(mlp(7)), serialize(mlp(3))])
    assert reply["ok"], reply
    order = [w.endpoint for w in cluster.router.workers]
    cores = {core.endpoint: core for core in (cluster.prefill, cluster.decode)}
    for endpoint, seed in zip(order, (7, 3)):
        want = dict(load_model(f"tiny:{seed}", dtype="float64").net.named_parameters())
        got = dict(cores[endpoint].model.net.named_parameters())
        assert all(torch.equal(got[n], want[n]) for n in want if ".mlp." in n)


def test_a_wrong_number_of_entries_is_400(cluster, file_system):
    entry = serialize(list(W2.items()))
    reply = cluster.admin("update_weights_from_tensor", serialized_named_tensors=[entry] * 3)
    assert not reply["ok"] and reply["status"] == 400 and "one per worker (2)" in reply["error"]
    for bad in ([], [""], [1], "x"):
        reply = cluster.admin("update_weights_from_tensor", serialized_named_tensors=bad)
        assert not reply["ok"] and reply["status"] == 400 and "serialized_named_tensors" in reply["error"]
    assert versions(cluster) == ["tiny", "tiny"]


def _evil() -> str:
    return base64.b64encode(b"cos\nsystem\n(Vtrue\ntR.").decode()


def _bad_shape() -> str:
    name = "model.layers.0.self_attn.q_proj.weight"
    return serialize([(n, t if n != name else torch.zeros(t.shape[0] + 1, t.shape[1]))
                      for n, t in W2.items()])


@pytest.mark.parametrize("payload, why", [
    (_evil, "os.system"), (_bad_shape, "has shape"),
    (lambda: serialize([("model.nope.weight", torch.zeros(2))]), "does not belong"),
    (lambda: serialize([("model.norm.weight", torch.zeros(64, dtype=torch.int64))]), "int64"),
])
def test_a_refused_payload_is_400_and_changes_nothing(cluster, file_system, payload, why):
    reply = admin(cluster, "update_weights_from_tensor", serialized_named_tensors=[payload()],
                  weight_version="never")
    assert not reply["ok"], reply
    assert {w["status"] for w in reply["workers"]} == {400}
    assert all(why in w["error"] for w in reply["workers"]), reply
    assert versions(cluster) == ["tiny", "tiny"] and weights_equal(cluster, "tiny")
    assert cluster.router.admin.sync.step is None
    cluster.serves_again()


def test_tensors_pushed_while_requests_run_unpaused_are_409_paused_they_land(cluster, file_system):
    rid = cluster.submit(PROMPT, 24)
    cluster.until(lambda: rid in cluster.answers and cluster.answers[rid].token_ids)
    entry = serialize(list(W2.items()))
    reply = cluster.admin("update_weights_from_tensor", serialized_named_tensors=[entry])
    assert not reply["ok"] and reply["status"] == 409
    assert cluster.admin("pause", mode="retract")["ok"]
    assert cluster.admin("flush_cache")["ok"]        # slime and verl flush before a push
    assert admin(cluster, "update_weights_from_tensor", serialized_named_tensors=[entry],
                 weight_version="v2")["ok"]
    assert cluster.admin("continue")["ok"]
    got = cluster.run(rid)
    assert set(got.weight_versions) == {"tiny", "v2"}
    cluster.check_pages()


def test_released_weights_take_no_push_until_resumed(cluster, file_system):
    """A push into weights whose memory is released would write into nothing: 409, and
    nothing changes; resumed, the same push lands."""
    entry = serialize(list(W2.items()))
    assert cluster.admin("release_memory", tags=["weights"])["ok"]
    reply = cluster.admin("update_weights_from_tensor", serialized_named_tensors=[entry],
                          weight_version="v2")
    assert not reply["ok"] and {w["status"] for w in reply["workers"] if not w["ok"]} == {409}
    reply = cluster.admin("init_weights_update_group", master_address="127.0.0.1",
                          master_port=1, rank_offset=1, world_size=3, group_name="g",
                          timeout=2.0)
    assert not reply["ok"] and {w["status"] for w in reply["workers"] if not w["ok"]} == {409}, reply
    assert cluster.admin("resume_memory", tags=["weights"])["ok"]
    assert versions(cluster) == ["tiny", "tiny"] and weights_equal(cluster, "tiny")
    assert admin(cluster, "update_weights_from_tensor", serialized_named_tensors=[entry],
                 weight_version="v2")["ok"]
    assert versions(cluster) == ["v2", "v2"] and weights_equal(cluster, "tiny:7")
    assert idle(cluster)
    cluster.check_pages()


# --- the HTTP routes' own checks ---------------------------------------------------------


INIT = {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1,
        "world_size": 3}


def test_init_route_takes_a_string_port_and_pp_rank_zero_and_sends_no_trainer_init():
    f = front()
    status, body = call(f, "POST", "/init_weights_update_group", INIT | {"pp_rank": 0})
    assert status == 200 and body["success"], body
    command, args = f.backend.admins[-1]
    assert command == "init_weights_update_group" and args["master_port"] == 29500
    assert "trainer_init" not in args and args["group_name"] == "weight_update_group"
    for bad, field in (({"master_port": "abc"}, "master_port"), ({"master_port": "70000"}, "master_port"),
                       ({"pp_rank": 1}, "pp_rank"), ({"trainer_init": "x"}, "trainer_init")):
        status, body = call(f, "POST", "/init_weights_update_group", INIT | bad)
        assert status == 400 and field in body["error"]["message"], (bad, body)
    assert len(f.backend.admins) == 1


def test_tensor_route_passes_sglangs_payload_and_refuses_what_it_cannot_do():
    f = front()
    body = {"serialized_named_tensors": ["QUJD", "REVG"], "load_format": None, "flush_cache": True,
            "abort_all_requests": False, "weight_version": "w9", "disable_draft_model": None}
    status, answer = call(f, "POST", "/update_weights_from_tensor", body)
    assert status == 200 and answer["success"], answer
    assert f.backend.admins[-1] == ("update_weights_from_tensor", {
        "serialized_named_tensors": ["QUJD", "REVG"], "weight_version": "w9"})
    for bad, field in (({"serialized_named_tensors": []}, "serialized_named_tensors"),
                       ({"serialized_named_tensors": [1]}, "serialized_named_tensors"),
                       ({"serialized_named_tensors": ["A" * 70000]}, ""),     # over the body limit
                       ({"load_format": "direct"}, "load_format"),
                       ({"flush_cache": "yes"}, "flush_cache")):
        status, answer = call(f, "POST", "/update_weights_from_tensor", body | bad)
        assert status in (400, 413) and field in str(answer), (bad, answer)
    assert len(f.backend.admins) == 1
    status, _ = call(f, "POST", "/update_weights_from_tensor", body | {"load_format":
                                                                       "flattened_bucket"})
    assert status == 200 and f.backend.admins[-1][1]["load_format"] == "flattened_bucket"


def test_tensor_route_is_admin_guarded():
    f = front(admin_api_key="adm", api_key="usr")
    body = {"serialized_named_tensors": ["QUJD"]}
    for headers in ({}, {"Authorization": "Bearer usr"}):
        status, _ = call(f, "POST", "/update_weights_from_tensor", body, headers=headers)
        assert status == 401
    status, _ = call(f, "POST", "/update_weights_from_tensor", body,
                     headers={"Authorization": "Bearer adm"})
    assert status == 200 and f.backend.admins


def test_cancel_route_is_admin_guarded_and_sends_the_command():
    f = front(admin_api_key="adm", api_key="usr")
    for headers in ({}, {"Authorization": "Bearer usr"}):
        status, _ = call(f, "POST", "/cancel_weight_update", {}, headers=headers)
        assert status == 401
    assert not f.backend.admins
    assert not f.backend.admins
    status, body = call(f, "POST", "/cancel_weight_update", {"x": 1},   # unknown: dropped
                        headers={"Authorization": "Bearer adm"})
    assert status == 200 and f.backend.admins == [("cancel_weight_update", {})], body
    status, body = call(f, "POST", "/cancel_weight_update", None,
                        headers={"Authorization": "Bearer adm"})
    assert status == 200 and body["success"], body
    assert f.backend.admins[-1] == ("cancel_weight_update", {})
