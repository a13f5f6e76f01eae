"""The admin records (zpd/wire/admin.py): each command round-trips through the Admin
envelope and the codec, its fields are checked when it is made, hostile arguments
raise BadArgs (400) and nothing else, and the module stays torch-free."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpd.wire import admin as a
from zpd.wire import admin_fields as af
from zpd.wire.protocol import decode, encode

SAMPLES: list[a.AdminCommand] = [
    a.Pause(af.PauseMode.IN_PLACE), a.Continue(["p:1"], {"r": [3, "v"]}), a.Status(),
    a.FlushCache(), a.AbortRequest("r1"), a.AbortAll(), a.UpdateWeights("/ckpt", "v2"),
    a.UpdateWeightVersion("v3"), a.ReleaseMemory(["weights"]), a.ResumeMemory(None),
    a.InitWeightsGroup("10.0.0.1", 29500, 1, 3, "g", "gloo"),
    a.JoinWeightsGroup("g", "10.0.0.1", 29500, 3, 2, 9.0, None, "init_process_group"),
    a.JoinWeightsGroup("g", "10.0.0.1", 29500, 2, 1, 9.0, None, None, 1, 2, "k1"),
    a.UpdateFromDistributed(["w"], ["float32"], [[2]], "g", None, "flattened_bucket"),
    a.StageWeights("g", "u1", ["w"], ["float32"], [[2]]),
    a.UpdateFromTensor(["QUJD"], "v4"), a.StageTensors("u2", "QUJD"),
    a.StageTensors("u3", "QUJD", None, 1, 2), a.GetWeights("model.norm.weight", 3),
    a.CommitWeights("u1", "v5"), a.DiscardWeights("u1", "g"), a.DestroyWeightsGroup("g"),
    a.CancelWeightUpdate()]


def test_every_command_has_a_sample_and_one_wire_name():
    assert sorted({type(s).COMMAND for s in SAMPLES}) == sorted(a.COMMANDS)
    assert all(a.COMMANDS[cls.COMMAND] is cls for cls in map(type, SAMPLES))


@pytest.mark.parametrize("cmd", SAMPLES, ids=lambda c: c.COMMAND)
def test_a_record_round_trips_through_the_envelope_and_the_codec(cmd):
    msg = decode(encode(cmd.envelope("k1")))
    assert msg.req_id == "k1" and msg.command == cmd.COMMAND
    assert a.parse(msg.command, msg.args) == cmd
    assert None not in msg.args.values()          # a null field is not sent


def test_the_python_clients_version_is_taken_as_weight_version_but_not_both():
    assert a.parse("update_weights", {"path": "x", "version": "v"}).weight_version == "v"
    assert a.parse("update_weight_version", {"version": "v"}) == a.UpdateWeightVersion("v")
    assert a.parse("commit_weights", {"update_id": "u", "version": "v"}).weight_version == "v"
    with pytest.raises(af.BadArgs, match="not both"):
        a.parse("update_weights", {"path": "x", "version": "v", "weight_version": "w"})
    assert "version" not in a.UpdateWeights("x", "v").args()      # one name on the wire


def test_fields_only_the_router_sets_are_refused_from_a_client():
    with pytest.raises(af.BadArgs, match="takes no argument 'prefills'"):
        a.parse("continue", {"prefills": ["p:1"]}, client=True)
    assert a.parse("continue", {"prefills": ["p:1"]}).prefills == ["p:1"]


@pytest.mark.parametrize("command, args, field", [
    ("pause", {"mode": "sideways"}, "mode"), ("pause", {"mode": None}, "mode"),
    ("pause", {"mode": ["retract"]}, "mode"), ("abort", {"rid": ""}, "rid"),
    ("abort", {}, "rid"), ("update_weights", {"path": "x", "weight_version": 7}, "weight_version"),
    ("update_weight_version", {"weight_version": ""}, "weight_version"),
    ("release_memory", {"tags": ["gpu"]}, "tags"), ("resume_memory", {"tags": "weights"}, "tags"),
    ("init_weights_update_group", {"master_address": "h", "master_port": "0", "rank_offset": 1,
                                   "world_size": 2, "group_name": "g"}, "master_port"),
    ("init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 0,
                                   "world_size": 2, "group_name": "g"}, "rank_offset"),
    ("join_weights_group", {"group_name": "g", "master_address": "h", "master_port": 1,
                            "world_size": 2, "rank": 2}, "rank"),
    ("join_weights_group", {"group_name": "g", "master_address": "h", "master_port": 1,
                            "world_size": 2, "rank": 1, "timeout_s": None}, "timeout_s"),
    ("stage_weights", {"group_name": "g\n", "update_id": "u", "names": ["a"], "dtypes": ["f"],
                       "shapes": [[1]]}, "group_name"),
    ("update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["f"], "shapes": [[1]],
                                         "group_name": "g"}, "same length"),
    ("update_weights_from_tensor", {"serialized_named_tensors": [""]}, "serialized_named_tensors"),
    ("update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": "direct"},
     "load_format"),
    ("status", {"mode": "abort"}, "mode"), ("nope", {}, "unknown command"),
])
def test_a_bad_argument_is_400_naming_it(command, args, field):
    with pytest.raises(af.BadArgs, match=field) as got:
        a.parse(command, args)
    assert got.value.status == 400


def test_a_decimal_string_port_becomes_a_number_and_tags_a_sorted_set():
    init = a.parse("init_weights_update_group", {"master_address": "h", "master_port": "29500",
                                                 "rank_offset": 1, "world_size": 2,
                                                 "group_name": "g"})
    assert init.master_port == 29500 and init.join(1, 5.0).master_port == 29500
    assert a.ReleaseMemory(["weights", "kv_cache", "weights"]).tags == ["kv_cache", "weights"]
    assert a.ResumeMemory(None).tag_set == set(af.MEMORY_TAGS)


def test_pause_modes_say_whether_they_drop_work():
    assert [m.drops for m in af.PauseMode] == [True, False, True]       # abort, in_place, retract
    assert not af.drops(None) and af.drops(af.PauseMode.RETRACT)
    assert f"{af.PauseMode.RETRACT}" == "retract" == af.PauseMode.RETRACT
    assert a.parse("pause", {}).mode is af.PauseMode.RETRACT


@pytest.mark.parametrize("raw", [float("nan"), math.inf, -1, 0, "30", True, [1]])
def test_a_bad_timeout_is_400_and_a_huge_one_capped(raw):
    with pytest.raises(af.BadArgs, match="timeout"):
        a.split_timeout({"timeout": raw}, 10.0)
    assert a.split_timeout({"timeout": 1e300, "x": 1}, 10.0) == ({"x": 1}, af.MAX_TIMEOUT_S)
    assert a.split_timeout({}, 10.0) == ({}, 10.0)


def test_the_wires_limits_are_the_engines():
    from engines.formats.tensor_payload import MAX_PAYLOAD_CHARS
    from engines.weights.push import MAX_TENSORS
    from zpd.worker.weights.trainer_group import BACKENDS, DEFAULT_TRAINER_INIT
    assert (af.MAX_TENSORS, af.MAX_PAYLOAD_CHARS) == (MAX_TENSORS, MAX_PAYLOAD_CHARS)
    assert DEFAULT_TRAINER_INIT in af.TRAINER_INITS and set(af.GROUP_BACKENDS) == set(BACKENDS)


def test_the_admin_wire_imports_no_torch():
    code = "import sys, zpd.wire.admin; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(a.COMMANDS)), st.data())
def test_fuzz_hostile_arguments_only_ever_raise_bad_args(command, data):
    names = [f.name for f in dataclasses.fields(a.COMMANDS[command])] + ["version", "other"]
    args = data.draw(st.dictionaries(st.sampled_from(names), JSON, max_size=len(names)))
    try:
        cmd = a.parse(command, args)
    except af.BadArgs:
        return
    assert a.parse(command, cmd.args()) == cmd       # what was taken travels as it was


@pytest.mark.parametrize("args, why", [
    ({"relay_rank": 0}, "go together"), ({"relay_rank": 2, "relay_size": 2, "relay_key": "k"},
                                         "below the size"),
    ({"relay_rank": 0, "relay_size": 1, "relay_key": "k"}, "go together"),
])
def test_a_relay_is_all_three_fields_consistent(args, why):
    base = {"group_name": "g", "master_address": "h", "master_port": 1, "world_size": 2,
            "rank": 1, "timeout_s": 5.0}
    with pytest.raises(af.BadArgs, match=why):
        a.parse("join_weights_group", base | args)
    with pytest.raises(af.BadArgs, match="'rank' 2 must be below 'ranks' 2"):
        a.StageTensors("u", "QUJD", None, 2, 2)
