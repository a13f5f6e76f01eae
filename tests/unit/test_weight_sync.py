"""Trainer weight sync, in one process: the real router and workers (tests/unit/inproc.py)
and a real trainer, rank 0 of a gloo group on loopback, on a thread
(tests/unit/trainer_side.py). The weights pushed are tiny:7's; the cluster runs tiny."""
from __future__ import annotations

import time

import pytest
import torch

from engines.loader import load_model
from engines.models.tiny import tiny_state_dict
from tests.unit.inproc import InprocCluster, reference
from tests.unit.test_handoff import PROMPT, continuation, reference_tiny, reference_tiny_model
from tests.unit.trainer_side import Trainer, announce
from zpd.worker.weights.trainer_group import TrainerGroup

W2 = tiny_state_dict(7)


@pytest.fixture
def cluster():
    c = InprocCluster(kv_cache_mb=2.0)
    yield c
    c.close()


@pytest.fixture
def trainer():
    t = Trainer(world_size=3)
    yield t
    t.close()


def admin(c: InprocCluster, command: str, seconds: float = 60.0, **args) -> dict:
    """An admin command, pumping the cluster in real time (the trainer runs meanwhile)."""
    return answer(c, c.admin(command, wait=False, **args), command, seconds)


def answer(c: InprocCluster, req_id: str, what: str, seconds: float = 60.0) -> dict:
    """The reply to admin command `req_id` (sent with wait=False), pumping in real time."""
    end = time.monotonic() + seconds
    while req_id not in c.replies:
        assert time.monotonic() < end, f"no answer to {what}"
        c.pump(1)
        time.sleep(0.001)
    return c.replies[req_id]


def join(c: InprocCluster, t: Trainer, **extra) -> dict:
    t.join()
    got = admin(c, "init_weights_update_group", master_address="127.0.0.1", master_port=t.port,
                rank_offset=1, world_size=t.world_size, group_name=t.group_name,
                backend="gloo", **extra)
    assert t.wait() is None
    return got


def push(c: InprocCluster, t: Trainer, tensors: dict, version: str | None = "v2",
         bucket: bool = False, stop_after: int | None = None, **body) -> dict:
    t.push(list(tensors.values()), bucket=bucket, stop_after=stop_after)
    args = announce(tensors) | {"group_name": t.group_name} | body
    if version:
        args["weight_version"] = version
    if bucket:
        args["load_format"] = "flattened_bucket"
    got = admin(c, "update_weights_from_distributed", **args)
    t.wait()
    return got


def versions(c: InprocCluster) -> list[str]:
    return [core.model.version for core in (c.prefill, c.decode)]


def weights_equal(c: InprocCluster, spec: str) -> bool:
    want = dict(load_model(spec, dtype="float64").net.named_parameters())
    return all(torch.equal(p, want[n]) for core in (c.prefill, c.decode)
               for n, p in core.model.net.named_parameters())


# --- the group itself ------------------------------------------------------------------


@pytest.mark.parametrize("trainer_init", ["init_process_group", "init_custom_process_group"])
def test_worker_joins_either_kind_of_trainer_group(trainer_init):
    """The worker's keys match the trainer's, however the trainer made its group."""
    t = Trainer(world_size=2, trainer_init=trainer_init, group_name="weights")
    t.join()
    group = TrainerGroup.join("weights", "gloo", "127.0.0.1", t.port, 1, 2, trainer_init, 30.0)
    assert t.wait() is None
    try:
        sent = torch.randn(3, 5, dtype=torch.float32)
        t.push([sent])
        got = torch.empty(3, 5)
        group.receive(got, time.monotonic() + 30)
        assert t.wait() is None and torch.equal(got, sent)
    finally:
        group.close()
        t.close()


# --- a push --------------------------------------------------------------------------


@pytest.mark.parametrize("bucket", [False, True])
def test_push_while_idle_moves_every_worker(cluster, trainer, bucket):
    got = join(cluster, trainer)
    assert got["ok"] and got["ranks"] == {cluster.prefill.endpoint: 1, cluster.decode.endpoint: 2}
    reply = push(cluster, trainer, W2, bucket=bucket)
    assert reply["ok"] and reply["weight_version"] == "v2", reply
    assert versions(cluster) == ["v2", "v2"] and weights_equal(cluster, "tiny:7")
    rid = cluster.submit(PROMPT, 8)
    assert cluster.run(rid).token_ids == reference_tiny("tiny:7", PROMPT, 8)
    assert cluster.answers[rid].weight_versions == ["v2"] * 8
    cluster.check_pages()


@pytest.mark.parametrize("bucket", [False, True])
@pytest.mark.parametrize("dtype,kernel", [("float32", True), ("float32", False), ("bfloat16", True)],
                         ids=["float32", "float32-column-major", "bfloat16"])
def test_a_push_into_a_float32_or_bfloat16_model(trainer, dtype, kernel, bucket, monkeypatch):
    """Without the float32 product kernel, float32 projections are held column-major
    (LlamaForCausalLM.column_major_float32), so a push cannot land in them as raw
    row-major bytes and goes through scratch; both dtypes' projections carry packed
    copies (engines/linear.py), rebuilt after the push swaps their storage. Either way
    the values, the layout and the answers after the push are those of a fresh load
    of the new weights."""
    import functools
    from engines.cpu import products as cpu_products
    if not kernel:        # the workers' configure_engine clears it, as it does the real one
        monkeypatch.setattr(cpu_products, "small_linear", functools.lru_cache(lambda dtype: None))
    c = InprocCluster(kv_cache_mb=2.0, dtype=dtype)
    try:
        first = [c.submit(PROMPT, 4), c.submit(PROMPT[1:], 4)]   # packed copies of the old weights
        for rid in first:
            c.run(rid)
        assert join(c, trainer)["ok"]
        assert push(c, trainer, W2, bucket=bucket)["ok"]
        fresh = load_model("tiny:7", dtype=dtype)
        want = dict(fresh.net.named_parameters())
        for core in (c.prefill, c.decode):
            net = core.model.net
            assert all(torch.equal(p, want[n]) for n, p in net.named_parameters())
            row_major = dtype == "bfloat16" or cpu_products.small_linear(torch.float32) is not None
            assert all(w.is_contiguous() == row_major for w in net.linears())
        rids = [c.submit(PROMPT, 8), c.submit(PROMPT[1:], 8)]   # decode batches of 2: packed
        assert c.run(rids[0]).token_ids == reference_tiny_model(fresh, PROMPT, 8)
        assert c.run(rids[1]).token_ids == reference_tiny_model(fresh, PROMPT[1:], 8)
    finally:
        c.close()


def test_retract_push_continue_is_old_then_new_weights(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    rid = cluster.submit(PROMPT, 24)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 4)
    assert cluster.admin("pause", mode="retract")["ok"]
    before = list(cluster.answers[rid].token_ids)
    assert push(cluster, trainer, W2)["ok"]
    assert cluster.admin("continue")["ok"]
    got = cluster.run(rid)
    assert before == reference_tiny("tiny", PROMPT, len(before))
    assert got.token_ids == continuation(load_model("tiny:7", dtype="float64"), PROMPT, before, 24)
    assert got.weight_versions == ["tiny"] * len(before) + ["v2"] * (24 - len(before))
    cluster.check_pages()


def test_a_partial_push_changes_only_its_tensors(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    part = {n: t for n, t in W2.items() if ".mlp." in n}
    assert push(cluster, trainer, part, version="mlp-only")["ok"]
    old, new = load_model("tiny", dtype="float64").net, load_model("tiny:7", dtype="float64").net
    want = {n: (new if ".mlp." in n else old).get_parameter(n) for n, _ in old.named_parameters()}
    for core in (cluster.prefill, cluster.decode):
        assert all(torch.equal(p, want[n]) for n, p in core.model.net.named_parameters())
    assert versions(cluster) == ["mlp-only"] * 2


def test_the_version_stays_when_the_trainer_names_none(cluster, trainer):
    """SGLang's way, as update_weights_from_disk and _from_tensor: new weights, same name."""
    assert join(cluster, trainer)["ok"]
    reply = push(cluster, trainer, W2, version=None)
    assert reply["ok"] and reply["weight_version"] == "tiny", reply
    assert versions(cluster) == ["tiny", "tiny"] and weights_equal(cluster, "tiny:7")


# --- refusals and failures: every worker keeps the old weights ---------------------------


def _bad_shape() -> dict:
    bad = dict(W2)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
    return bad


@pytest.mark.parametrize("tensors, why", [
    (_bad_shape(), "has shape"),
    ({**W2, "model.layers.0.mlp.nope.weight": torch.zeros(2)}, "does not belong"),
])
def test_a_push_the_model_refuses_is_400_and_changes_nothing(cluster, trainer, tensors, why):
    assert join(cluster, trainer)["ok"]
    reply = push(cluster, trainer, tensors)
    assert not reply["ok"]
    bad = [w for w in reply["workers"] if not w["ok"]]
    assert {w["status"] for w in bad} == {400} and all(why in w["error"] for w in bad)
    assert trainer.error is None             # every broadcast was taken (and dropped)
    assert versions(cluster) == ["tiny", "tiny"] and weights_equal(cluster, "tiny")
    assert push(cluster, trainer, W2)["ok"]  # the group still works
    assert weights_equal(cluster, "tiny:7")


def test_a_trainer_that_dies_mid_push_leaves_the_old_weights(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    reply = push(cluster, trainer, W2, stop_after=3)
    # the first to see it answers why; the router may end the other's step before it does
    assert not reply["ok"] and reply["workers"][0]["status"] in (500, 504), reply
    assert all(w["status"] in (500, 504) or "ended early" in w["error"]
               for w in reply["workers"]), reply
    assert versions(cluster) == ["tiny", "tiny"] and weights_equal(cluster, "tiny")
    cluster.pump(5)
    assert all(not core.parts["weight_sync"].groups for core in (cluster.prefill, cluster.decode))
    # a new group works afterwards
    again = Trainer(world_size=3)
    try:
        assert join(cluster, again)["ok"]
        assert push(cluster, again, W2)["ok"] and weights_equal(cluster, "tiny:7")
    finally:
        again.close()
    rid = cluster.submit(PROMPT, 4)
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, 4)


def test_a_push_while_requests_run_unpaused_is_409(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    rid = cluster.submit(PROMPT, 24)
    cluster.until(lambda: rid in cluster.answers and cluster.answers[rid].token_ids)
    reply = cluster.admin("update_weights_from_distributed", group_name="g", **announce(W2))
    assert not reply["ok"] and reply["status"] == 409
    assert cluster.run(rid).token_ids == reference_tiny("tiny", PROMPT, 24)


def test_requests_sent_during_a_push_wait_for_it(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    trainer_ready = list(W2.values())
    req_id = cluster.admin("update_weights_from_distributed", wait=False, group_name="g",
                           weight_version="v2", **announce(W2))
    cluster.pump(3)                          # the push is staging: nothing sent yet
    rid = cluster.submit(PROMPT, 6)
    cluster.pump(20)
    assert rid not in cluster.answers or not cluster.answers[rid].token_ids
    trainer.push(trainer_ready)
    end = time.monotonic() + 60
    while req_id not in cluster.replies:
        assert time.monotonic() < end
        cluster.pump(1)
        time.sleep(0.001)
    assert cluster.replies[req_id]["ok"] and trainer.wait() is None
    assert cluster.run(rid).token_ids == reference_tiny("tiny:7", PROMPT, 6)
    assert cluster.answers[rid].weight_versions == ["v2"] * 6


def test_destroy_then_init_again(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    assert admin(cluster, "destroy_weights_update_group", group_name="g")["ok"]
    trainer.close()
    assert all(not core.parts["weight_sync"].groups for core in (cluster.prefill, cluster.decode))
    again = Trainer(world_size=3)
    try:
        assert join(cluster, again)["ok"]
        assert push(cluster, again, W2)["ok"]
    finally:
        again.close()


@pytest.mark.parametrize("command, args, why", [
    ("init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                   "rank_offset": 3, "world_size": 3, "group_name": "g"},
     "leaves this server no rank"),
    ("init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000,
                                   "rank_offset": 1, "world_size": 3, "group_name": "g"}, "port"),
    ("init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                   "rank_offset": 0, "world_size": 3, "group_name": "g"}, "rank 0"),
    ("update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": [],
                                         "group_name": "g"}, "same length"),
    ("update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                         "group_name": "g"}, "1 to"),
    ("update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                         "group_name": "g", "load_format": "zip"}, "load_format"),
])
def test_bad_arguments_are_400(cluster, command, args, why):
    reply = cluster.admin(command, **args)
    assert not reply["ok"] and reply["status"] == 400 and why in reply["error"], reply
    assert all(not core.parts["weight_sync"].groups for core in (cluster.prefill, cluster.decode))


def test_a_push_to_no_group_is_400_everywhere(cluster):
    reply = cluster.admin("update_weights_from_distributed", group_name="nope", **announce(W2))
    assert not reply["ok"] and {w["status"] for w in reply["workers"]} == {400}
    assert cluster.router.admin.sync.step is None
    cluster.serves_again()


def test_a_dtype_that_is_not_floating_is_refused_before_any_broadcast(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    body = announce(W2)
    body["dtypes"][0] = "int64"
    reply = cluster.admin("update_weights_from_distributed", group_name="g", **body)
    assert {w["status"] for w in reply["workers"]} == {400}
    assert all("int64" in w["error"] for w in reply["workers"])


@pytest.mark.parametrize("command, args, status", [
    ("join_weights_group", {"group_name": "g", "master_address": "127.0.0.1", "master_port": 1,
                            "world_size": 3, "rank": 0}, 400),             # rank 0 is the trainer's
    ("join_weights_group", {"group_name": "g", "master_address": "127.0.0.1", "master_port": 0,
                            "world_size": 3, "rank": 1}, 400),
    ("join_weights_group", {"group_name": "g\n", "master_address": "127.0.0.1",
                            "master_port": 1, "world_size": 3, "rank": 1}, 400),
    ("join_weights_group", {"group_name": "g", "master_address": "127.0.0.1", "master_port": 1,
                            "world_size": 3, "rank": 1, "backend": "mpi"}, 400),
    ("join_weights_group", {"group_name": "g", "master_address": "127.0.0.1", "master_port": 1,
                            "world_size": 3, "rank": 1, "timeout_s": float("inf")}, 400),
    ("stage_weights", {"group_name": "g", "update_id": "u", "names": ["a"], "dtypes": ["float32"],
                       "shapes": [[1]]}, 400),                             # no such group
    ("commit_weights", {"update_id": "u", "version": "v"}, 409),          # nothing staged
    ("destroy_weights_update_group", {"group_name": "g"}, 400),
    ("destroy_weights_update_group", {"group_name": ["g"]}, 400),
])
def test_hostile_worker_commands_change_nothing(cluster, command, args, status):
    """Sent straight to the workers (the router passes commands it does not know on)."""
    reply = cluster.admin(command, **args)     # refused by the router, or by both workers
    assert not reply["ok"] and {w["status"] for w in reply.get("workers") or [reply]} == {status}
    for core in (cluster.prefill, cluster.decode):
        assert core.parts["weight_sync"].status() == {"weight_groups": [], "weights_staged": False,
                                             "weight_sync_job": None}
    assert versions(cluster) == ["tiny", "tiny"]
    cluster.serves_again()


def test_stage_with_garbage_tensors_is_400_before_any_broadcast(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    for spec in ({"names": "x", "dtypes": [], "shapes": []},
                 {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]},
                 {"names": ["a"], "dtypes": ["float32"], "shapes": [[2**39] * 8]},
                 {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]}):
        reply = cluster.admin("stage_weights", group_name="g", update_id="u", **spec)
        # refused by the router (the record's checks) or by both workers (the model's)
        assert {w["status"] for w in reply.get("workers") or [reply]} == {400}, (spec, reply)
    for core in (cluster.prefill, cluster.decode):
        assert core.parts["weight_sync"].job is None and core.parts["weight_sync"].groups.keys() == {"g"}
    assert push(cluster, trainer, W2)["ok"]     # the group is still in step with the trainer


def test_packed_copies_never_outlive_the_weights_they_were_made_from():
    """A weight's packed copy (engines/cpu/linear.py) is keyed by its address and
    version; a commit swaps a weight with its staging copy, so the third push puts it
    back where the first did, with bytes the worker never wrote itself (the helper
    did). The commit bumps its version, so the copy packed after the first push is not
    taken for the third's (no request ran between the second and the third)."""
    c = InprocCluster(kv_cache_mb=2.0, dtype="bfloat16")
    trainer = Trainer(world_size=3)
    try:
        def answers() -> list[list[int]]:
            rids = [c.submit(PROMPT, 6), c.submit(PROMPT[1:], 6)]   # batches of 2: packed
            return [c.run(rid).token_ids for rid in rids]

        assert join(c, trainer)["ok"]
        for seed, then_run in ((7, True), (3, False), (5, True)):
            sent = {n: t.to(torch.bfloat16) for n, t in tiny_state_dict(seed).items()}
            assert push(c, trainer, sent, version=f"s{seed}")["ok"]
            if then_run:
                fresh = load_model(f"tiny:{seed}", dtype="bfloat16")
                assert answers() == [reference_tiny_model(fresh, PROMPT, 6),
                                     reference_tiny_model(fresh, PROMPT[1:], 6)]
    finally:
        trainer.close()
        c.close()
