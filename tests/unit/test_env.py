"""zpd/env.py: every ZPD_* variable the Python code reads, parsed once, with errors
that name the variable."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import transport
from zpd.env import DROP_ENV, FAULT_ENV, SLOW_ENV, Knobs
from zpd.wire.protocol import KvDone

ROOT = Path(__file__).resolve().parents[2]


def test_unset_or_empty_changes_nothing() -> None:
    for environ in ({}, {SLOW_ENV: "", DROP_ENV: "", FAULT_ENV: "  "}):
        knobs = Knobs.from_environ(environ)
        assert (knobs.slow_s, knobs.fault_plan) == (0.0, None)
        assert not knobs.drops.drops(KvDone(1, 0, 5, "v"))


def test_values_are_parsed() -> None:
    knobs = Knobs.from_environ({SLOW_ENV: " 1.5", DROP_ENV: "kv_done:1",
                                FAULT_ENV: "delay:seconds=2,count=1;hang:ids=3|4"})
    assert knobs.slow_s == 1.5
    assert [(r.mode, r.count, r.seconds, r.ids) for r in knobs.fault_plan.rules] == [
        ("delay", 1, 2.0, None), ("hang", None, 0.0, frozenset({3, 4}))]
    assert knobs.drops.drops(KvDone(1, 0, 5, "v")) and not knobs.drops.drops(KvDone(1, 0, 5, "v"))


def test_the_process_environment_is_the_default(monkeypatch) -> None:
    monkeypatch.setenv(SLOW_ENV, "0.25")
    assert Knobs.from_environ().slow_s == 0.25


def test_each_worker_counts_its_own_drops() -> None:
    environ = {DROP_ENV: "kv_done:1"}
    first, second = Knobs.from_environ(environ), Knobs.from_environ(environ)
    assert first.drops.drops(KvDone(1, 0, 5, "v")) and second.drops.drops(KvDone(1, 0, 5, "v"))


@pytest.mark.parametrize("raw", ["x", "-1", "3600", "nan", "inf", "1s"])
def test_bad_slow_calls_name_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"\${SLOW_ENV}={re.escape(repr(raw))}: want seconds"):
        Knobs.from_environ({SLOW_ENV: raw})


@pytest.mark.parametrize("text", [
    "explode", "fail:count", "fail:count=-1", "fail:colour=red", "delay", "hang:seconds=1",
    "drop:ids=a|b", "[1, 2]", "{not json",
])
def test_bad_fault_plans_name_the_variable(text: str) -> None:
    with pytest.raises(transport.FaultPlanError) as err:
        Knobs.from_environ({FAULT_ENV: text})
    assert f"${FAULT_ENV}" in str(err.value) and repr(text.strip()) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_bad_drop_plans_name_the_variable() -> None:
    with pytest.raises(ValueError, match=rf"\${DROP_ENV}: unknown message types \['kv_don'\]"):
        Knobs.from_environ({DROP_ENV: "kv_don:1"})


def sources(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))
            if p != ROOT / "zpd" / "env.py"]


def test_no_other_module_names_or_reads_a_zpd_variable() -> None:
    """Declared once: a quoted ZPD_* name anywhere, or an environment read in zpd/,
    belongs in zpd/env.py."""
    named = [p for p in sources("zpd", "transport", "engines")
             if re.search(r"""["']ZPD_\w+["']""", p.read_text())]
    reads = [p for p in sources("zpd") if re.search(r"os\.environ|getenv", p.read_text())]
    assert (named, reads) == ([], [])


def test_engine_switches_reach_the_engine(tmp_path) -> None:
    from engines.cpu import kernels as cpu_kernels
    from engines.runner import backend_for
    from zpd.env import CPU_KERNELS_ENV, KERNEL_CACHE_ENV, PACKED_WEIGHTS_ENV, configure_engine
    float32, cpu = cpu_kernels.torch.float32, cpu_kernels.torch.device("cpu")
    try:
        configure_engine({CPU_KERNELS_ENV: "0", PACKED_WEIGHTS_ENV: " 0", KERNEL_CACHE_ENV: str(tmp_path)})
        assert cpu_kernels.SETTINGS == cpu_kernels.Settings(False, tmp_path, False)
        assert cpu_kernels.kernel_for(float32, "cpu") is None
        backend = backend_for(float32, cpu)                     # what a runner made now runs
        assert backend.ops is backend.paged_decode is None
        assert not backend.weights.enabled and backend.weights.usable(float32) is None
        configure_engine({})                                    # unset: both on, default cache
        assert cpu_kernels.SETTINGS == cpu_kernels.Settings() and backend_for(float32, cpu).weights.enabled
    finally:
        configure_engine({})


@pytest.mark.parametrize("name", ["ZPD_CPU_KERNELS", "ZPD_PACKED_WEIGHTS"])
def test_a_malformed_engine_switch_changes_nothing(name) -> None:
    from engines.cpu import kernels as cpu_kernels
    from zpd.env import configure_engine
    with pytest.raises(ValueError, match=rf"\${name}='off': want 1 \(on, the default\) or 0"):
        configure_engine({"ZPD_CPU_KERNELS": "0", name: "off"})
    assert cpu_kernels.SETTINGS.enabled and cpu_kernels.SETTINGS.packed_weights


def test_zpd_run_refuses_a_malformed_switch(capsys, monkeypatch) -> None:
    from zpd.ops.cli import main
    monkeypatch.setenv("ZPD_CPU_KERNELS", "yes")
    assert main(["run", "--model", "tiny", "--input-ids", "1,2"]) == 2
    assert "$ZPD_CPU_KERNELS='yes'" in capsys.readouterr().err
