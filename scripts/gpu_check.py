#!/usr/bin/env python3
"""GPU readiness checks (issue #16): every check zpd needs a GPU for, in one call,
ending with one summary table.

    python scripts/gpu_check.py [--device cuda|cpu] [--time-limit S] [--quick] [--out FILE]

Normally run through scripts/gpu_check.sh, which installs what the checks need first.

Checks, each in a process of its own with its own timeout, so one that fails, hangs
or breaks its CUDA context leaves the others to run:

  env      torch sees the device; which Mooncake build is installed, and it imports
  parity   a random Llama against transformers on the same device: float32 logits
           of a prefill and of every decode step after it (max abs diff), and
           bfloat16 greedy tokens (equal, or the first divergence and whether it is
           a near-tie of the float32 reference)
  cluster  `zpd launch` 1P1D on the device (float32): greedy outputs against
           OfflineEngine on the same device in this process, every KV page back,
           the bytes Mooncake wrote, and on CUDA the device memory the two workers
           took, and the device each worker's `status` names for its KV pool. Mooncake over TCP (MC_FORCE_TCP=1 unless set): one host,
           loopback, and RDMA into GPU memory would need GPUDirect besides
  speed    OfflineEngine, bfloat16: decode tok/s at batch 1 and 16 (128-token
           prompts, 64 decode steps timed after the step that prefills them),
           prefill tok/s of one 1,024-token prompt; on SmolLM2-135M-Instruct and on
           a ~1.1B random Llama (TinyLlama's shape with 8 KV heads)

`--device cpu` is a dry run of the script: every model and length is shrunk so it
ends in about a minute; its figures say nothing about speed. Each check gives one
row or more: PASS, FAIL or SKIP, a figure, and the detail or reason. The table is
printed and, with --out (or $OUT set), written to that file (the rows also as
JSON beside it). Exit status 0 iff every check that ran passed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from gpu_common import ROOT, Emit, Row, sizes

CHECKS = ("env", "parity", "cluster", "tp", "speed-smollm2", "speed-llama1b")
# seconds each check may take on CUDA (the CPU dry run takes far less); the whole run's
# --time-limit caps them all
TIMEOUTS = {"env": 90, "parity": 240, "cluster": 300, "tp": 180, "speed-smollm2": 240, "speed-llama1b": 300}


# --- the table ---------------------------------------------------------------------------

def table(rows: list[Row], header: str) -> str:
    cols = [("check", 22), ("result", 6), ("figure", 24)]
    lines = [header, "  ".join(f"{n:<{w}}" for n, w in cols) + "  detail"]
    for r in rows:
        lines.append(f"{r.check:<22}  {r.result:<6}  {r.figure:<24}  {r.detail}")
    failed = [r.check for r in rows if r.result == "FAIL"]
    ran = [r for r in rows if r.result != "SKIP"]
    lines.append(f"overall: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}: "
                 f"{len(ran) - len(failed)}/{len(ran)} passed, "
                 f"{len(rows) - len(ran)} skipped")
    return "\n".join(lines)


# --- the parent: each check in a child process, with a timeout -----------------------------------

def run_child(args) -> int:
    """One check, in this process; its rows go to --rows. Its models live in a temporary
    directory (not under $OUT: ~2 GB for the large one); what else it wrote there, the
    cluster's logs, is kept beside --rows as CHECK-files/ when the check failed."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # unwind: finally blocks stop clusters
    emit = Emit(Path(args.rows))
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{args.child}-"))
    if not args.device.startswith("cuda"):
        import torch
        torch.set_num_threads(1)     # a dry run: on a busy machine, spinning threads cost 10x
    finished = False
    try:
        from gpu_checks import RUN
        RUN[args.child](args, sizes(args.device, args.quick), work, emit)
        finished = True
    except Exception as e:          # noqa: BLE001  (the row says what went wrong)
        traceback.print_exc()
        reason = f"{type(e).__name__}: {str(e).strip()[-300:]}".replace("\n", " | ")
        emit(args.child, False, "error", f"{reason} (log: {args.child}.log)")
        return 1
    finally:
        rows = Path(args.rows)
        if not finished or (rows.exists() and '"FAIL"' in rows.read_text()):
            shutil.copytree(work, Path(args.rows).parent / f"{args.child}-files", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.safetensors"))
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_check(name: str, args, timeout: float, logs: Path) -> list[Row]:
    rows_file = logs / f"{name}.rows.jsonl"
    rows_file.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--device", args.device,
            "--rows", str(rows_file)] + (["--quick"] if args.quick else [])
    started = time.monotonic()
    with open(logs / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            stop_group(proc)
    rows = [Row(**json.loads(line)) for line in rows_file.read_text().splitlines()] \
        if rows_file.exists() else []
    took = time.monotonic() - started
    if code is None:
        rows.append(Row(name, "FAIL", "timeout", f"still running after {timeout:.0f} s, its limit "
                                                  f"(rows above it finished); log {name}.log"))
    elif code != 0 and not any(r.result == "FAIL" for r in rows):
        tail = (logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
        rows.append(Row(name, "FAIL", f"exit {code}", f"{tail[0][-300:]} (after {took:.0f} s)"))
    elif not rows:
        rows.append(Row(name, "FAIL", "no result", f"exited {code} without a row"))
    return rows


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the check's process group (a cluster it started stops its workers), then
    SIGKILL whatever is left after 40 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda[:N] or cpu (a dry run; default cuda)")
    ap.add_argument("--time-limit", type=float, default=540.0,
                    help="seconds for all checks together (default 540); checks that no longer "
                         "fit are skipped")
    ap.add_argument("--check-timeout", type=float, default=None,
                    help="seconds each check may take at most (default: its own, 90 to 300)")
    ap.add_argument("--quick", action="store_true", help="smaller still on cpu, no SmolLM2 (CI)")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--out", default=None, help="write the table here (default $OUT/gpu_check.txt "
                                                "when OUT is set)")
    ap.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args)
    deadline = time.monotonic() + args.time_limit
    out = Path(args.out) if args.out else Path(os.environ["OUT"]) / "gpu_check.txt" \
        if os.environ.get("OUT") else None
    logs = out.parent / "gpu_check_logs" if out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    header = (f"zpd GPU check, device {args.device}{' (quick)' if args.quick else ''}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}, logs in {logs}")
    wanted = [c for c in args.only.split(",") if c]
    unknown = set(wanted) - set(CHECKS)
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    rows: list[Row] = []
    for name in (c for c in CHECKS if c in wanted):
        left = deadline - time.monotonic() - 45      # room to stop a check that overruns
        if left < 20:
            rows.append(Row(name, "SKIP", "-", f"no time left under --time-limit {args.time_limit:.0f}"))
            continue
        limit = min(args.check_timeout or TIMEOUTS[name], left)
        print(f"--- {name} (limit {limit:.0f} s)", flush=True)
        done = run_check(name, args, limit, logs)
        for r in done:
            print(f"    {r.result} {r.check}: {r.figure}", flush=True)
        rows += done
        if out:                      # keep what is done, should the whole run be killed
            out.write_text(table(rows, header + " (partial)") + "\n")
    text = table(rows, header)
    print("\n" + text, flush=True)
    if out:
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0 if all(r.result != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
