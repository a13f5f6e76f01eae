"""ZPD_DROP_MESSAGES: lose the first N outgoing messages of a type, nothing else."""
from __future__ import annotations

import pytest

from zpd.env import DROP_ENV, Knobs
from zpd.wire.drops import DropPlan
from zpd.wire.protocol import KvDest, KvDone, Ping


def test_drops_exactly_the_first_n_of_each_named_type():
    plan = Knobs.from_environ({DROP_ENV: "kv_done:2, kv_dest:1"}).drops
    done, dest, ping = KvDone(1, 0, 5, "v"), KvDest(1, 0, "r", [1]), Ping(1, 0.0)
    assert [plan.drops(done) for _ in range(4)] == [True, True, False, False]
    assert [plan.drops(dest) for _ in range(2)] == [True, False]
    assert not plan.drops(ping)


def test_unset_or_empty_drops_nothing():
    for env in ({}, {DROP_ENV: ""}, {DROP_ENV: " , "}):
        assert not Knobs.from_environ(env).drops.drops(KvDone(1, 0, 5, "v"))


def test_a_count_defaults_to_one():
    plan = DropPlan.parse("kv_done")
    assert plan.drops(KvDone(1, 0, 5, "v")) and not plan.drops(KvDone(1, 0, 5, "v"))


@pytest.mark.parametrize("text", ["kv_don:1", "kv_done:x", "nope"])
def test_bad_plans_say_what_is_wrong(text):
    with pytest.raises(ValueError, match=DROP_ENV):
        Knobs.from_environ({DROP_ENV: text})
    with pytest.raises(ValueError, match="drop plan"):
        DropPlan.parse(text)
