"""Two routers and two HTTP fronts against one of each (issue #34, item 3), over the
simulated pool of bench/sim_workers.py.

    python bench/bench_scale_out.py [--decodes 8] [--streams 32] [--rounds 2]
                                    [--duration 4] [--quick] [--json FILE]

Each round runs both topologies, one after the other, over the same pool:

- 1+1: `zpd router` and `zpd http --router R` with --streams streamed POST /generate;
- 2+2: `zpd router` (coordinating) and `zpd router --coordinator` over the same pool,
  `zpd http --workers 2 --router R1,R2` (two fronts on one port, SO_REUSEPORT), with
  twice the streams: each router and each front carries what the one of 1+1 did.

The two cores here are shared by the pool, the clients and every router and front,
so wall-clock rates cannot show what more processes buy. What can: each process's
CPU time (utime + stime, /proc). With a core for each process, a topology carries
at most the tokens/s at which its busiest process fills its core, so its `capacity`
is tokens / max(CPU seconds of each router and front). The ratio of that capacity,
2+2 / 1+1, is the figure (the issue asks for >= 1.8); each process's CPU (how evenly
the routers and fronts share the load) and the CPU per token are printed with it.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_seconds  # noqa: E402
from cp_load import HttpLoad, Spec  # noqa: E402
from cp_procs import Proc, SimPool, router_argv, stop_all, zpd  # noqa: E402
from zpd.wire.router_proof import write_router_secret  # noqa: E402

TARGET = 1.8


def topology(n: int, pool: SimPool, tmp: Path) -> tuple[list[Proc], Proc, list[int]]:
    """n routers (the first coordinates) and `zpd http --workers n` over all of them:
    the processes, the front's parent, and the pids of the fronts that serve."""
    routers: list[Proc] = []
    # the followers prove themselves to the coordinator with it (zpd/wire/router_proof.py)
    secret = ["--router-secret-file", str(write_router_secret(tmp / f"router{n}.secret"))]
    for i in range(n):
        follow = secret + (["--coordinator", routers[0].info["endpoint"]] if routers else [])
        routers.append(Proc(router_argv(pool.info["prefill"], pool.info["decode"], follow),
                            tmp, f"router{i}"))
    eps = ",".join(r.info["endpoint"] for r in routers)
    front = Proc(zpd("http", "--router", eps, "--model", "null", "--port", "0",
                     "--incremental-streaming-output", "--workers", str(n)), tmp, "front")
    return routers, front, front.info.get("workers") or [front.pid]


def run(n: int, pool: SimPool, tmp: Path, args: argparse.Namespace, problems: list[str]) -> dict:
    routers, front, fronts = topology(n, pool, tmp)
    try:
        endpoint = front.info["endpoint"]
        HttpLoad(endpoint, Spec("warm", 4 * n, 4)).run(0.5)        # connections up, code warm
        pids = [r.pid for r in routers] + fronts
        before = [cpu_seconds(p) for p in pids]
        result = HttpLoad(endpoint, Spec("s", args.streams * n, args.new_tokens)).run(args.duration)
        time.sleep(0.1)                                            # the last sends' work
        cpu = [cpu_seconds(p) - b for p, b in zip(pids, before)]
    finally:
        for p in (front, *routers):
            p.stop()
    bad = [r for r in result.reqs if not r.ok]          # unanswered, or not the predicted tokens
    if bad:
        problems.append(f"{n}+{n}: {len(bad)}/{len(result.reqs)} requests unanswered or wrong, "
                        f"e.g. {bad[0].rid}: {bad[0].finish}")
    tokens = result.tokens()
    wall = result.end - result.start
    routers_cpu, fronts_cpu = cpu[:n], cpu[n:]
    return {"routers": n, "fronts": len(fronts), "streams": args.streams * n, "tokens": tokens,
            "tok_per_s": tokens / wall, "router_cpu_s": routers_cpu, "front_cpu_s": fronts_cpu,
            "router_us_per_token": sum(routers_cpu) / max(1, tokens) * 1e6,
            "front_us_per_token": sum(fronts_cpu) / max(1, tokens) * 1e6,
            "capacity_tok_per_cpu_s": tokens / max(cpu)}


def report(rows: list[dict], problems: list[str]) -> dict:
    print(f"{'topology':>8} | {'streams':>7} | {'tok/s wall':>10} | {'router CPU s':>14} | "
          f"{'front CPU s':>14} | {'router us/tok':>13} | {'front us/tok':>12} | capacity tok/CPU-s")
    for r in rows:
        print(f"{r['routers']}+{r['fronts']:<6} | {r['streams']:>7} | {r['tok_per_s']:>10,.0f} | "
              f"{' '.join(f'{c:.2f}' for c in r['router_cpu_s']):>14} | "
              f"{' '.join(f'{c:.2f}' for c in r['front_cpu_s']):>14} | "
              f"{r['router_us_per_token']:>13.1f} | {r['front_us_per_token']:>12.1f} | "
              f"{r['capacity_tok_per_cpu_s']:,.0f}")
    ratios = [b["capacity_tok_per_cpu_s"] / a["capacity_tok_per_cpu_s"]
              for a, b in zip(rows[::2], rows[1::2])]
    mean = sum(ratios) / len(ratios)
    print(f"capacity 2+2 / 1+1 per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"mean {mean:.2f} (the issue asks >= {TARGET})")
    for p in problems:
        print("PROBLEM:", p)
    return {"rows": rows, "ratios": ratios, "mean_ratio": mean, "problems": problems}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--streams", type=int, default=32, help="streams per router (and front)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--prefill-us", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one short round (CI's smoke test)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.duration, args.streams, args.decodes = 1, 1.0, 8, 2
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="zpd-scale-") as d:
        tmp = Path(d)
        pool = SimPool(tmp, args.decodes, args.prefills, args)
        try:
            rows = [run(n, pool, tmp, args, problems) for _ in range(args.rounds) for n in (1, 2)]
        finally:
            stop_all([pool], problems)
    out = report(rows, problems)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(out))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
