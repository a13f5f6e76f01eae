"""Trainer weight sync end to end: `zpd launch --http-port` clusters (1P1D and 2P2D,
float64) and real trainer processes, rank 0 of a gloo group on loopback built as
SGLang's init_custom_process_group builds it (no zpd-only field sent):
examples/push_weights.py (the calls a trainer makes: pause, GET /flush_cache, push,
continue), tests/e2e/trainer_proc.py (a trainer the test can stall, feed a bad
tensor or kill), and examples/push_tensors.py (update_weights_from_tensor with
SGLang's payload from another process on the host)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engines.loader import load_model
from engines.models.tiny import tiny_state_dict
from tests.e2e.cluster import ROOT, Cluster, assert_all_pages_free
from tests.e2e.test_retract import Collector, _greedy, _pause_midway, _workload, check_exact
from tests.e2e.push_calls import (GROUP, InThread, TrainerProc, _counters, announce, generates,
                                  get_json, helpers, no_helpers_left, post, versions)

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")



def _cluster(tmp_path_factory, prefill: int, decode: int):
    # KV writes take 0.4 s longer, so a pause reliably lands mid-output (as in test_retract)
    return Cluster(tmp_path_factory.mktemp(f"sync{prefill}{decode}"), prefill=prefill,
                   decode=decode, extra=("--max-batch", "64", "--http-port", "0"),
                   env={"ZPD_TRANSPORT_FAULT": "delay:seconds=0.4"})


@pytest.fixture(scope="module")
def one_one(tmp_path_factory):
    with _cluster(tmp_path_factory, 1, 1) as c:
        yield c


@pytest.fixture(scope="module")
def two_two(tmp_path_factory):
    with _cluster(tmp_path_factory, 2, 2) as c:
        yield c


@pytest.fixture(scope="module")
def models():
    return {"tiny": load_model("tiny", dtype="float64"), "v2": load_model("tiny:7", dtype="float64")}


# --- the RL cycle --------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["one_one", "two_two"])
def test_retract_push_continue_is_exact(request, shape, models):
    """Requests running; pause(retract); a trainer process joins and pushes tiny:7;
    continue: tokens before the pause are W1's greedy, after it W2's continuation of
    the whole prefix; a fresh request is W2's greedy output."""
    cluster = request.getfixturevalue(shape)
    work = _workload(12, seed=3)
    with cluster.client() as client, Collector(client) as col:
        for i, (ids, n) in enumerate(work):
            col.submit(ids, n, f"s{i}")
        col.start()
        _pause_midway(cluster, col, "retract")
        done = subprocess.run([sys.executable, "examples/push_weights.py", "--url",
                               f"http://{cluster.info['http']}", "--weights", "tiny:7",
                               "--version", "v2", "--pause", "retract"],
                              cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "GET /flush_cache: 200" in done.stdout
        assert "/continue_generation: continued" in done.stdout
        outs = col.wait()
        switched = 0
        for i, (ids, _) in enumerate(work):
            check_exact(ids, outs[f"s{i}"], models)
            switched += {"tiny", "v2"} <= set(outs[f"s{i}"]["weight_versions"])
        assert switched >= 1, "no request was paused in the middle of its output"
        fresh = client.generate(input_ids=[9, 8, 7, 6], sampling_params={
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        assert fresh["output_ids"] == _greedy(models["v2"], [9, 8, 7, 6], 12)
        assert fresh["weight_versions"] == ["v2"] * 12
        assert_all_pages_free(client)
    assert versions(cluster) == {"v2"}


@pytest.mark.parametrize("shape, world, seed, version", [
    ("one_one", 2, 4, "relayed"),
    ("two_two", 3, 7, "v2"),        # the version test_samples_share_a_prompt... allows
])
def test_fewer_ranks_than_workers_relay_to_every_worker(request, shape, world, seed, version):
    """AReaL's `sglang:d1` against 1P1D: world_size 2, rank_offset 1 (before: 400
    "rank_offset 1 + 2 workers exceeds world_size 2"); and two ranks for 2P2D. That
    many workers join the trainer process's group, the first relays each broadcast
    to the rest: every worker takes the new weights, and greedy output is `zpd
    run`'s with them."""
    cluster = request.getfixturevalue(shape)
    trainer = TrainerProc(cluster, world=world, seed=seed)
    workers = len(cluster.info["workers"])
    try:
        assert len(trainer.joined["ranks"]) == world - 1
        assert len(trainer.joined["relay"]["to"]) == workers - (world - 1)
        answer = InThread(post, cluster, "/update_weights_from_distributed",
                          announce(tiny_state_dict(seed)) | {"weight_version": version})
        trainer.push()
        status, got = answer.result()
        assert status == 200 and got["success"], got
        trainer.wait_for("done")
    finally:
        trainer.close()
    weights = get_json(cluster, "/get_weight_version")["weight_versions"]
    assert len(weights) == workers and set(weights.values()) == {version}, weights
    prompt = [9, 8, 7, 6, 5]
    with cluster.client() as client:
        for _ in range(workers // 2):          # as many calls as pairs (the router picks)
            got = client.generate(input_ids=prompt, sampling_params={
                "temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
            assert got["output_ids"] == _greedy(load_model(f"tiny:{seed}", dtype="float64"),
                                                prompt, 8)
        assert_all_pages_free(client)
    assert post(cluster, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200


# --- failures: every worker keeps what it had -----------------------------------------


@pytest.mark.parametrize("bad", ["shape", "name"])
def test_a_bad_push_is_400_and_changes_nothing(one_one, bad):
    before = versions(one_one)
    tensors = tiny_state_dict(7)
    name = "model.layers.0.self_attn.q_proj.weight"
    flags = ("--bad-shape", name) if bad == "shape" else ()
    body = announce(tensors) | {"weight_version": "never"}
    if bad == "shape":
        body["shapes"][list(tensors).index(name)][0] += 1
    else:
        body["names"][list(tensors).index(name)] = "model.layers.0.self_attn.nope.weight"
    trainer = TrainerProc(one_one, *flags)
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed", body)
        trainer.push()
        status, got = answer.result()
        assert status == 400 and not got["success"], got
        assert ("has shape" if bad == "shape" else "does not belong") in got["message"]
        trainer.wait_for("done")              # every broadcast was taken
        assert versions(one_one) == before
    finally:
        trainer.close()
    assert post(one_one, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200


def test_a_trainer_killed_mid_push_leaves_the_old_weights(one_one):
    before = versions(one_one)
    trainer = TrainerProc(one_one, "--sleep-after", "3", "--sleep", "600")
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "never"})
        trainer.push()
        trainer.wait_for("sent 3")
        killed = time.monotonic()
        os.kill(trainer.proc.pid, signal.SIGKILL)
        status, got = answer.result(timeout=60)
        assert not got["success"] and status in (500, 504), got
        assert time.monotonic() - killed < 30
        assert versions(one_one) == before and no_helpers_left(one_one)
    finally:
        trainer.close()
    # the group is gone everywhere: a new trainer joins and pushes
    again = TrainerProc(one_one)
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "after-kill"})
        again.push()
        status, got = answer.result()
        assert status == 200 and got["success"], got
        assert versions(one_one) == {"after-kill"}
    finally:
        again.close()
    assert post(one_one, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200
    with one_one.client() as client:
        assert_all_pages_free(client)


@pytest.mark.parametrize("world", [None, 2], ids=["direct", "relay"])
def test_a_killed_sync_helper_ends_the_push_at_once(one_one, world):
    """SIGKILL of the decode's weight-sync helper while its trainer, alive, is silent
    mid-push: the push answers 500 naming the signal within seconds (the prefill's
    receive is ended, not left to its 300 s limit), no helper is left, the old weights
    serve, and a new group's push lands. The same when the decode is the relay's
    target (one rank for the cluster)."""
    before = versions(one_one)
    trainer = TrainerProc(one_one, "--sleep-after", "2", "--sleep", "600", world=world)
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "never"})
        trainer.push()
        trainer.wait_for("sent 2")
        decode = next(w["pid"] for w in one_one.info["workers"] if w["role"] == "decode")
        (helper,) = helpers(one_one)[decode]
        os.kill(helper, signal.SIGKILL)
        killed = time.monotonic()
        status, got = answer.result(timeout=60)
        assert status == 500 and "SIGKILL" in got["message"], got
        took = time.monotonic() - killed
        assert "ended early" in got["message"] and took < 10, got
        print(f"killed helper: push answered in {took:.2f} s")
    finally:
        trainer.close()
    assert no_helpers_left(one_one) and versions(one_one) == before and generates(one_one)
    again = TrainerProc(one_one)
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "after-helper"})
        again.push()
        assert answer.result()[0] == 200 and versions(one_one) == {"after-helper"}
    finally:
        again.close()
    assert post(one_one, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200
    assert no_helpers_left(one_one)


def test_an_oversized_broadcast_leaves_the_workers_serving(one_one):
    """Issue 30: a trainer that broadcasts more bytes than it announced made gloo abort
    both workers. Now their helper processes die instead: the push answers 500 with
    the tensor and the signal, every worker process lives, serves, and takes a new
    group's push."""
    pids = one_one.pids()
    before = versions(one_one)
    name = "model.layers.0.self_attn.q_proj.weight"
    trainer = TrainerProc(one_one, "--bad-shape", name)      # announced with its true shape
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "never"})
        trainer.push()
        pushed = time.monotonic()
        status, got = answer.result(timeout=60)
        assert status == 500 and not got["success"], got
        assert name in got["message"] and "SIGABRT" in got["message"], got
        print(f"oversized push answered in {time.monotonic() - pushed:.2f} s")
    finally:
        trainer.close()
    assert all(os.kill(pid, 0) is None for pid in pids) and pids   # alive (else: raises)
    assert versions(one_one) == before and generates(one_one)
    again = TrainerProc(one_one)
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "after-abort"})
        again.push()
        status, got = answer.result()
        assert status == 200 and got["success"], got
        assert versions(one_one) == {"after-abort"}
    finally:
        again.close()
    assert post(one_one, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200


def test_zpd_admin_cancels_a_stalled_push(one_one):
    before = versions(one_one)
    trainer = TrainerProc(one_one, "--sleep-after", "2", "--sleep", "600")
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "never"})
        trainer.push()
        trainer.wait_for("sent 2")
        cancel = subprocess.run([sys.executable, "-m", "zpd.ops.cli", "admin", "--endpoint",
                                 one_one.router, "cancel-weight-update"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert cancel.returncode == 0, cancel.stderr
        status, got = answer.result(timeout=30)
        assert status == 409 and "cancelled by admin" in got["message"], got
    finally:
        trainer.close()
    assert versions(one_one) == before and generates(one_one)
    # every worker left the group: destroying it again finds none
    assert post(one_one, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 400


def test_heartbeats_flow_during_a_long_broadcast(one_one):
    """The trainer stalls for longer than the router's peer timeout mid-push: no
    worker is declared dead, and the push lands."""
    trainer = TrainerProc(one_one, "--sleep-after", "2", "--sleep", "5")
    try:
        answer = InThread(post, one_one, "/update_weights_from_distributed",
                          announce(tiny_state_dict(7)) | {"weight_version": "slow"})
        trainer.push()
        status, got = answer.result()
        assert status == 200 and got["success"], got
    finally:
        trainer.close()
    assert versions(one_one) == {"slow"}
    assert "marked dead" not in one_one.log.read_text()
    assert post(one_one, "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200


@pytest.mark.parametrize("per_rank", [False, True, "verl"],
                         ids=["one-entry", "per-rank-bucket", "verl-per-rank"])
def test_update_weights_from_tensor_from_another_process(one_one, per_rank):
    """examples/push_tensors.py, another process on the host, sends SGLang's payload
    (ForkingPickler handles of shared memory; one entry, one per rank as flattened
    buckets, or verl's LocalSerializedTensor per tensor): greedy output is the new
    weights', /get_weight_version reports it."""
    seed, version = {False: (5, "t5"), True: (6, "t6"), "verl": (3, "t3")}[per_rank]
    # Output to a file, not a pipe: the trainer's torch_shm_manager inherits it and
    # lives on while a worker stays connected to it (torch's libshm keeps that socket).
    out = one_one.log.parent / f"push_tensors_{seed}.out"
    with open(out, "w") as sink:
        done = subprocess.run([sys.executable, "examples/push_tensors.py", "--url",
                               f"http://{one_one.info['http']}", "--weights", f"tiny:{seed}",
                               "--version", version] + ["--per-rank", "--bucket"] * (per_rank is True)
                              + ["--per-rank", "--verl"] * (per_rank == "verl"),
                              cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0, out.read_text()
    assert "/update_weights_from_tensor: weights updated" in out.read_text()
    assert get_json(one_one, "/get_weight_version")["weight_version"] == version
    assert versions(one_one) == {version}
    prompt = [9, 8, 7, 6, 5]
    with one_one.client() as client:
        got = client.generate(input_ids=prompt, sampling_params={
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        assert got["output_ids"] == _greedy(load_model(f"tiny:{seed}", dtype="float64"), prompt, 8)
        assert got["output_ids"] != _greedy(load_model("tiny:7", dtype="float64"), prompt, 8)
        assert_all_pages_free(client)


# --- the prefix cache, across a push ---------------------------------------------------


def test_samples_share_a_prompt_and_a_push_never_meets_old_kv(two_two, models):
    """Eight greedy samples of one prompt on 2P2D: one prefill computes it (the router
    sends all eight there), every sample equals `zpd run`; after a push of other
    weights, the same prompt is computed again under them."""
    prompt = [(5 * i + 1) % 250 for i in range(60)]
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with two_two.client() as client:
        before = _counters(client, "prefill")
        with Collector(client) as col:
            for i in range(8):
                col.submit(prompt, 8, f"g{i}")
            col.start()
            outs = col.wait()
        (version,) = versions(two_two)            # tiny, or v2 after the test above
        want = _greedy(models[version], prompt, 8)
        assert all(outs[f"g{i}"]["output_ids"] == want for i in range(8)), (want, outs)
        after = _counters(client, "prefill")
        asked = {ep: after[ep]["prefix_cache_query_tokens"] - before[ep]["prefix_cache_query_tokens"]
                 for ep in after}
        hits = sum(after[ep]["prefix_cache_hit_tokens"] - before[ep]["prefix_cache_hit_tokens"]
                   for ep in after)
        assert sorted(asked.values()) == [0, 8 * 60]         # one prefill took them all
        assert hits >= 7 * 48                                 # computed once, reused 7 times
        done = subprocess.run([sys.executable, "examples/push_weights.py", "--url",
                               f"http://{two_two.info['http']}", "--weights", "tiny:3",
                               "--version", "v3"], cwd=ROOT, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        again = client.generate(input_ids=prompt, sampling_params=greedy)
        assert again["output_ids"] == _greedy(load_model("tiny:3", dtype="float64"), prompt, 8)
        assert again["weight_versions"] == ["v3"] * 8
        assert_all_pages_free(client)
