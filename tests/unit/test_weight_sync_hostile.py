"""Trainer weight sync against a hostile or careless trainer (issue 43): malformed
sizes, dtypes and names in a push's body, and steps sent on top of each other. Each
refusal is a 400 that names the problem, comes at once (before any memory is taken
for the push) or after draining what the trainer broadcast, changes nothing, and
leaves the group in step with the trainer, so its next good push lands.

The real router and workers run in this process (tests/unit/inproc.py), the trainer
on a thread (tests/unit/trainer_side.py)."""
from __future__ import annotations

import resource
import time

import pytest

from engines.models.tiny import tiny_state_dict
from tests.unit.inproc import InprocCluster
from tests.unit.test_weight_sync import admin, answer, join, push, versions, weights_equal
from tests.unit.trainer_side import Trainer, announce

W2 = tiny_state_dict(7)
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def joined():
    """One cluster and trainer group for the whole file: every test must leave both
    idle, in step and on the old weights."""
    c = InprocCluster(kv_cache_mb=2.0)
    t = Trainer(world_size=3, timeout_s=30.0)
    assert join(c, t)["ok"]
    yield c, t
    t.close()
    c.close()


def untouched(c: InprocCluster) -> None:
    assert versions(c) == ["tiny", "tiny"] and weights_equal(c, "tiny")
    for core in (c.prefill, c.decode):
        assert core.parts["weight_sync"].status() == {"weight_groups": ["g"], "weights_staged": False,
                                             "weight_sync_job": None}
    assert c.router.admin.sync.step is None


def body(**change) -> dict:
    """W2's announcement with one field changed by `change[field](value)`."""
    out = announce(W2) | {"group_name": "g", "weight_version": "bad"}
    for field, edit in change.items():
        out[field] = edit(out[field])
    return out


def at(i: int, value):
    """Replace item i of a list field."""
    return lambda items: items[:i] + [value] + items[i + 1:]


# Refused before a byte is received: the trainer's broadcasts (if it sent any) cannot be
# sized, so none is taken. The trainer here sends none, so the group stays in step.
AT_ONCE = [
    ("lengths differ", body(dtypes=lambda d: d[:-1]), "same length"),
    ("names not a list", body(names=lambda n: "model.norm.weight"), "names"),
    ("dtypes not a list", body(dtypes=lambda d: {"a": "float32"}), "dtypes"),
    ("shapes not a list", body(shapes=lambda s: 7), "shapes"),
    ("no names", {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}, "names"),
    ("unknown dtype", body(dtypes=at(0, "float8_e4m3")), "float8_e4m3"),
    ("dtype not a string", body(dtypes=at(0, 4)), "dtype 4"),
    ("integer dtype", body(dtypes=at(0, "int64")), "int64"),
    ("negative dim", body(shapes=at(0, [-1, 64])), "shape [-1, 64]"),
    ("a 2^40 dim", body(shapes=at(0, [2**40])), "shape"),
    ("dims past int64", body(shapes=at(0, [2**39] * 8)), "more than this model could take"),
    ("2^40 elements", body(shapes=at(1, [2**20, 2**20])), "more than this model could take"),
    ("float dim", body(shapes=at(0, [2.0, 64])), "shape"),
    ("bool dim", body(shapes=at(0, [True, 64])), "shape"),
    ("string dim", body(shapes=at(0, ["258", "64"])), "shape"),
    ("nested dim", body(shapes=at(0, [[258], 64])), "shape"),
    ("nine dims", body(shapes=at(0, [1] * 9)), "at most 8"),
    ("shape a number", body(shapes=at(0, 16512)), "shape"),
]


@pytest.mark.parametrize("spec, why", [case[1:] for case in AT_ONCE],
                         ids=[case[0] for case in AT_ONCE])
def test_a_push_that_cannot_be_sized_is_400_at_once(joined, spec, why):
    c, _ = joined
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    reply = admin(c, "update_weights_from_distributed", **spec)
    took = time.monotonic() - started
    errors = [reply.get("error", "")] + [w["error"] for w in reply.get("workers", [])]
    assert not reply["ok"] and took < 2, (took, reply)
    assert {w["status"] for w in reply.get("workers") or [reply]} == {400}, reply
    assert any(why in e for e in errors), reply
    # nothing was allocated for it (ru_maxrss: KiB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 << 10
    untouched(c)


# Refused after draining: sizes are known, so every broadcast is taken (and dropped).
DRAINED = [
    ("unknown name", at(3, "model.layers.0.mlp.nope.weight"), "does not belong"),
    ("name twice", at(3, list(W2)[2]), "named twice"),
    ("name not a string", at(3, 12), "not a non-empty string"),
    ("empty name", at(3, ""), "not a non-empty string"),
]


@pytest.mark.parametrize("names, why", [case[1:] for case in DRAINED],
                         ids=[case[0] for case in DRAINED])
def test_a_push_the_model_refuses_is_drained_then_400(joined, names, why):
    c, t = joined
    spec = body(names=names)        # the shapes stay W2's: those are what is broadcast
    t.push(list(W2.values()))
    reply = admin(c, "update_weights_from_distributed", **spec)
    assert t.wait() is None                            # every broadcast was taken
    assert not reply["ok"] and {w["status"] for w in reply["workers"]} == {400}, reply
    assert all(why in w["error"] and "nothing applied" in w["error"]
               for w in reply["workers"]), reply
    untouched(c)


def test_steps_on_top_of_a_push_are_409_and_the_push_lands(joined):
    """While a push waits for its broadcasts: a second group's init, a second push,
    destroying the group, update_weights and continue are all 409 naming the push;
    the push then lands whole; and a second init sent with the first is 409 too."""
    c, t = joined
    req_id = c.admin("update_weights_from_distributed", wait=False,
                     **body(weight_version=lambda _: "v2"))
    c.until(lambda: all(core.parts["weight_sync"].job for core in (c.prefill, c.decode)))
    for command, args in [
            ("init_weights_update_group", {"master_address": "127.0.0.1", "master_port": t.port,
                                           "rank_offset": 1, "world_size": 3, "group_name": "g2"}),
            ("update_weights_from_distributed", body()),
            ("destroy_weights_update_group", {"group_name": "g"}),
            ("update_weights", {"path": "tiny:3"}),
            ("continue", {})]:
        reply = c.admin(command, **args)
        assert not reply["ok"] and reply["status"] == 409, (command, reply)
        assert "pushing weights from group 'g'" in reply["error"], reply
    t.push(list(W2.values()))
    assert answer(c, req_id, "the push", 30)["ok"] and t.wait() is None
    assert versions(c) == ["v2", "v2"] and weights_equal(c, "tiny:7")
    # back to the old weights for the other tests, through the same group
    assert push(c, t, tiny_state_dict(0), version="tiny")["ok"] and weights_equal(c, "tiny")
    untouched(c)


def test_two_inits_at_once_one_joins_the_other_is_409():
    c = InprocCluster(kv_cache_mb=2.0)
    # named apart from the module's group: torch keeps one registry per process
    first = Trainer(world_size=3, group_name="first")
    second = Trainer(world_size=3, group_name="second")
    try:
        first.join()
        req_id = c.admin("init_weights_update_group", wait=False, master_address="127.0.0.1",
                         master_port=first.port, rank_offset=1, world_size=3,
                         group_name="first", backend="gloo")
        c.pump(2)
        reply = c.admin("init_weights_update_group", master_address="127.0.0.1",
                        master_port=second.port, rank_offset=1, world_size=3,
                        group_name="second", backend="gloo")
        assert reply["status"] == 409 and "joining weight group 'first'" in reply["error"], reply
        assert answer(c, req_id, "the first init", 30)["ok"] and first.wait() is None
        assert all(core.parts["weight_sync"].status()["weight_groups"] == ["first"]
                   for core in (c.prefill, c.decode))
        assert push(c, first, W2)["ok"] and weights_equal(c, "tiny:7")
    finally:
        first.close()
        second.close()
        c.close()


def test_discards_naming_other_pushes_are_not_kept(joined):
    """discard_weights passes through the router to the workers; sent 300 times during a
    push with ids of no push, it neither ends the push nor leaves a record per call."""
    c, t = joined
    req_id = c.admin("update_weights_from_distributed", wait=False,
                     **body(weight_version=lambda _: "v2"))
    c.until(lambda: all(core.parts["weight_sync"].job for core in (c.prefill, c.decode)))
    for i in range(300):
        assert c.admin("discard_weights", update_id=f"forged-{i}")["ok"]
    assert all(not core.parts["weight_sync"].abandoned for core in (c.prefill, c.decode))
    t.push(list(W2.values()))
    assert answer(c, req_id, "the push", 30)["ok"] and t.wait() is None and versions(c) == ["v2", "v2"]
    assert push(c, t, tiny_state_dict(0), version="tiny")["ok"]
    untouched(c)
