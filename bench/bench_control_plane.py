"""Control-plane ceilings (issue #34): what the router and the HTTP front cost per
request and per token, and how that grows with the number of workers, over a
simulated pool of 1..64 decodes (bench/sim_workers.py: one process, one real ZeroMQ
endpoint per worker, the real wire protocol).

    python bench/bench_control_plane.py [--workers 1,8,32,64] [--duration 3]
                                        [--validate] [--fairness] [--quick]
                                        [--profile-router FILE] [--json FILE]

For each worker count W (and max(1, W/4) prefills) it starts the pool, the real
`zpd router` and the real `zpd http` processes, then runs closed-loop loads:

- tokens: W x --per-decode streamed requests of --new-tokens straight to the router;
- requests: as many non-streamed requests of one token each;
- front: streamed POST /generate through `zpd http` (incremental SSE events);
- paced: --light-rate non-streamed requests/s of one token, the router's CPU per
  request when each wakes it alone (what polling every worker's socket costs);
- light: a few streamed requests to the router, then to the front, for the latency
  each hop adds: a token's arrival at the client minus its send by the pool
  (CLOCK_MONOTONIC is system-wide), so router alone vs front + router.

CPU is each process's utime + stime from /proc (it holds on a loaded machine; the
wall-clock rates do not: the clients and the pool share the cores). The router's
CPU per request is the requests load's CPU / requests; per token, the tokens load's
CPU less its requests' share, / tokens. "ceiling" is 1e6 / (us per token): the
tokens/s one core of router could forward.

--validate runs the tokens and requests loads at 1 and 8 decodes on a real
null-engine cluster (`zpd launch --model null:...`) as well, to show the simulation
costs the router what real workers do. --fairness: two clients to one router with
--max-concurrent-requests small, one flooding; the light one's latency alone and
with the flood (admission.py's fair queueing keeps the ratio under 2).
--profile-router FILE: the router runs under cProfile (its stats in FILE.W).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Launch, pct  # noqa: E402
from cp_load import HttpLoad, Result, Spec, ZmqLoad  # noqa: E402
from cp_procs import (Proc, RouterPid, SimPool, front_argv, launch_router_pid,  # noqa: E402
                      router_argv, stop_all)

TARGET_TOKEN_US, TARGET_REQ_US, TARGET_FRONT_US = 2.0, 100.0, 10.0
PROJECT_GPUS = (8, 64, 512)


# --- one measurement ------------------------------------------------------------------

def cpu_during(procs: list[Proc], run) -> tuple[list[float], object]:
    """CPU seconds each of `procs` spent while `run()` ran, and what it returned."""
    before = [p.cpu() for p in procs]
    out = run()
    time.sleep(0.05)                  # the last sends' work
    return [p.cpu() - b for p, b in zip(procs, before)], out


def zmq_run(router: str, specs: list[Spec], duration: float, seed: int) -> list[Result]:
    load = ZmqLoad(router, specs, seed)
    try:
        return load.run(duration)
    finally:
        load.close()


def clients(name: str, total: int, n: int, max_new: int, stream: bool) -> list[Spec]:
    """`total` requests in flight over `n` client identities (as many fronts or trainers)."""
    n = max(1, min(n, total))
    return [Spec(f"{name}{i}", total // n + (i < total % n), max_new, stream) for i in range(n)]


def hops(results: list[Result], stamps: dict[str, list[float]], first: bool = False) -> list[float]:
    """Milliseconds from each token's send by the pool to its arrival at the client (the
    front prefixes the rids it passes on with its caller's name)."""
    stamps = {rid.rsplit(":", 1)[-1]: times for rid, times in stamps.items()}
    out = []
    for res in results:
        for r in res.reqs:
            sent = stamps.get(r.rid, [])
            out += [(got - at) * 1e3 for got, at in zip(r.times[:1] if first else r.times, sent)]
    return out


def check(results: list[Result], problems: list[str], what: str) -> None:
    """Every request answered, with the null model's tokens."""
    for res in results:
        bad = [r.rid for r in res.reqs if not r.ok]
        if bad:
            problems.append(f"{what}: {len(bad)}/{len(res.reqs)} requests unanswered or wrong "
                            f"(e.g. {bad[0]}: {next(r.finish for r in res.reqs if r.rid == bad[0])})")


def router_costs(router: str, procs: list[Proc], decodes: int, args, problems: list[str],
                 what: str) -> dict:
    """The tokens and requests loads straight to the router: its CPU per request and
    per token, and the rates (procs[0] is the router)."""
    conc = decodes * args.per_decode
    toks_specs = clients("tok", conc, args.clients, args.new_tokens, True)
    reqs_specs = clients("req", conc, args.clients, 1, False)
    for spec in reqs_specs if args.rate else ():
        spec.rate = args.rate / len(reqs_specs)
    (cpu_t, *_), tok = cpu_during(procs, lambda: zmq_run(router, toks_specs, args.duration, 1))
    (cpu_r, *_), req = cpu_during(procs, lambda: zmq_run(router, reqs_specs, args.duration, 2))
    check(tok + req, problems, what)
    n_tok, n_req = sum(len(r.reqs) for r in tok), sum(len(r.reqs) for r in req)
    tokens = sum(r.tokens() for r in tok)
    per_req = cpu_r / max(1, n_req)
    per_tok = (cpu_t - per_req * n_tok) / max(1, tokens)
    wall_t, wall_r = tok[0].end - tok[0].start, req[0].end - req[0].start
    return {"router_us_per_req": per_req * 1e6, "router_us_per_token": per_tok * 1e6,
            "req_per_s": n_req / wall_r, "tok_per_s": tokens / wall_t,
            "router_cores_tokens": cpu_t / wall_t, "router_cores_reqs": cpu_r / wall_r,
            "router_us_per_token_gross": cpu_t / max(1, tokens) * 1e6,
            "requests": n_tok + n_req, "tokens": tokens}


def measure(decodes: int, args: argparse.Namespace, tmp: Path, problems: list[str]) -> dict:
    prefills = max(1, decodes // 4)
    pool = SimPool(tmp, decodes, prefills, args)
    procs: list[Proc] = [pool]
    try:
        profile = f"{args.profile_router}.{decodes}" if args.profile_router else ""
        router = Proc(router_argv(pool.info["prefill"], pool.info["decode"], [], profile),
                      tmp, "router")
        procs.append(router)
        front = Proc(front_argv(router.info["endpoint"]), tmp, "front")
        procs.append(front)
        ep = router.info["endpoint"]
        zmq_run(ep, [Spec("warm", decodes, 4)], 0.3, 0)          # connections up, code warm
        row = {"workers": decodes, "prefills": prefills} | router_costs(
            ep, [router], decodes, args, problems, f"sim {decodes}")
        (cpu_l,), paced = cpu_during([router], lambda: zmq_run(
            ep, [Spec("paced", 64, 1, stream=False, rate=args.light_rate)], args.light_s * 2, 6))
        row["router_us_per_req_light"] = cpu_l / max(1, len(paced[0].reqs)) * 1e6
        check(paced, problems, f"paced {decodes}")
        pool.stamps()
        http_spec = Spec("http", min(decodes * args.per_decode, args.max_streams), args.new_tokens)
        (cpu_rt, cpu_f), http = cpu_during([router, front],
                                           lambda: HttpLoad(front.info["endpoint"], http_spec, 3)
                                           .run(args.duration))
        check([http], problems, f"front {decodes}")
        pool.stamps()
        light = Spec("light", args.light, args.new_tokens)
        direct = zmq_run(ep, [light], args.light_s, 4)
        sent = pool.stamps()
        hop_router, first_router = hops(direct, sent), hops(direct, sent, first=True)
        via = HttpLoad(front.info["endpoint"], light, 5).run(args.light_s)
        sent = pool.stamps()
        hop_front, first_front = hops([via], sent), hops([via], sent, first=True)
        check(direct + [via], problems, f"light {decodes}")
        wall = http.end - http.start
        return row | {
            "front_us_per_token": cpu_f / max(1, http.tokens()) * 1e6,
            "front_tok_per_s": http.tokens() / wall, "front_cores": cpu_f / wall,
            "router_us_per_token_via_front": cpu_rt / max(1, http.tokens()) * 1e6,
            "hop_router_ms": [pct(hop_router, 50), pct(hop_router, 99)],
            "hop_front_router_ms": [pct(hop_front, 50), pct(hop_front, 99)],
            "first_token_hop_router_ms": [pct(first_router, 50), pct(first_router, 99)],
            "first_token_hop_front_router_ms": [pct(first_front, 50), pct(first_front, 99)]}
    except BaseException:
        for p in procs:
            print(f"--- {p.log.name}:\n{p.log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
        raise
    finally:
        stop_all(procs, problems)


def validate(decodes: int, args: argparse.Namespace, tmp: Path, problems: list[str]) -> dict:
    """The router's costs over the simulated pool and over a real null-engine cluster
    (`zpd launch`) of `decodes` decodes, under the same load: light enough
    (--validate-per-decode) that the real workers keep up on a small machine."""
    prefills = max(1, decodes // 4)
    tmp.mkdir(parents=True, exist_ok=True)
    load = argparse.Namespace(**vars(args) | {"per_decode": args.validate_per_decode,
                                              "rate": args.validate_rate,
                                              "step_ms": args.validate_step_ms})
    pool = SimPool(tmp, decodes, prefills, load)
    try:
        router = Proc(router_argv(pool.info["prefill"], pool.info["decode"], []), tmp, "router")
        try:
            zmq_run(router.info["endpoint"], [Spec("warm", decodes, 4)], 0.3, 0)
            sim = router_costs(router.info["endpoint"], [router], decodes, load, problems,
                               f"validate sim {decodes}")
        finally:
            router.stop()
    finally:
        pool.stop()
    model = f"null:step_ms={load.step_ms},prefill_us={load.prefill_us},experts={load.experts}"
    (tmp / "launch").mkdir()
    launch = Launch(tmp / "launch", model, ["--prefill", str(prefills), "--decode", str(decodes),
                                 "--kv-cache-mb", "64", "--threads", "1", "--dtype", "float32"])
    try:
        zmq_run(launch.router, [Spec("warm", decodes, 4)], 0.5, 0)
        real = router_costs(launch.router, [RouterPid(launch_router_pid(launch))], decodes,
                            load, problems, f"validate real {decodes}")
    finally:
        launch.stop()
    return {"workers": decodes, "sim": sim, "real": real,
            "ratio_token": sim["router_us_per_token_gross"] / real["router_us_per_token_gross"],
            "ratio_req": sim["router_us_per_req"] / real["router_us_per_req"]}


# --- fairness -----------------------------------------------------------------------------

def fairness(args: argparse.Namespace, tmp: Path, problems: list[str]) -> dict:
    """One light client alone, then with a client that floods the router's queue."""
    decodes = 8
    pool = SimPool(tmp, decodes, 2, args)
    procs: list[Proc] = [pool]
    try:
        router = Proc(router_argv(pool.info["prefill"], pool.info["decode"],
                                  ["--max-concurrent-requests", str(args.fair_slots)]), tmp, "router")
        procs.append(router)
        ep = router.info["endpoint"]
        light = Spec("light", 1, args.new_tokens, stream=False)
        # lengths vary, as real ones do: a flood of equal lengths finishes in lock-step
        # waves, and a light request that just missed one waits a whole request longer
        flood = Spec("flood", args.fair_slots * 10, args.new_tokens, stream=False, spread=0.5)
        zmq_run(ep, [Spec("warm", decodes, 4)], 0.3, 0)
        (alone,) = zmq_run(ep, [light], args.fair_s, 6)
        load = ZmqLoad(ep, [light, flood], 7)
        try:
            both, flooded = load.run(args.fair_s)
        finally:
            load.close()
        check([alone, both, flooded], problems, "fairness")
        warm = args.fair_s / 4           # the flood's first burst fills the queue
        a, b = alone.latencies(warm), both.latencies(warm)
        out = {"alone_ms": [pct(a, 50) * 1e3, pct(a, 99) * 1e3],
               "flooded_ms": [pct(b, 50) * 1e3, pct(b, 99) * 1e3],
               "flood_requests": len(flooded.reqs), "light_requests": len(both.reqs),
               "slots": args.fair_slots, "flood_concurrency": flood.concurrency}
        out["ratio"] = [out["flooded_ms"][i] / out["alone_ms"][i] for i in (0, 1)]
        return out
    finally:
        stop_all(procs, problems)


# --- output -----------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    head = (f"{'workers':>7} {'P':>3} | {'router us/req':>13} {'us/tok':>7} {'req/s':>7} "
            f"{'tok/s':>7} {'ceiling':>8} | {'front us/tok':>12} {'tok/s':>6} | "
            f"{'hop router p50/p99 ms':>21} {'front+router p50/p99':>21}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workers']:>7} {r['prefills']:>3} | {r['router_us_per_req']:>13.1f} "
            f"{r['router_us_per_token']:>7.2f} {r['req_per_s']:>7.0f} {r['tok_per_s']:>7.0f} "
            f"{1e6 / max(r['router_us_per_token'], 1e-3):>8.0f} | {r['front_us_per_token']:>12.1f} "
            f"{r['front_tok_per_s']:>6.0f} | {r['hop_router_ms'][0]:>10.2f}/{r['hop_router_ms'][1]:<10.2f} "
            f"{r['hop_front_router_ms'][0]:>10.2f}/{r['hop_front_router_ms'][1]:<10.2f}")
    return "\n".join(lines)


def fmt(p50_p99: list[float]) -> str:
    return f"{p50_p99[0]:.2f}/{p50_p99[1]:.2f}"


def report_rows(rows: list[dict]) -> None:
    print(table(rows))
    for r in rows:
        print(f"workers {r['workers']}: router cores busy {r['router_cores_tokens']:.2f} (tokens), "
              f"{r['router_cores_reqs']:.2f} (requests); front cores {r['front_cores']:.2f}; "
              f"router us/token via the front {r['router_us_per_token_via_front']:.2f}; first "
              f"token's hop p50/p99 ms router {fmt(r['first_token_hop_router_ms'])}, front+router "
              f"{fmt(r['first_token_hop_front_router_ms'])}")
    tok, req = [r["router_us_per_token"] for r in rows], [r["router_us_per_req"] for r in rows]
    print(f"targets: router <= {TARGET_TOKEN_US} us/token: max {max(tok):.2f}; "
          f"<= {TARGET_REQ_US} us/req: max {max(req):.1f}; front <= {TARGET_FRONT_US} us/token: "
          f"max {max(r['front_us_per_token'] for r in rows):.1f}")
    light = [r["router_us_per_req_light"] for r in rows]
    print("router us/req under the paced load (each request wakes the router alone): "
          + ", ".join(f"{r['workers']} workers {r['router_us_per_req_light']:.0f}" for r in rows))
    print(f"growth {rows[0]['workers']} -> {rows[-1]['workers']} workers: us/token x"
          f"{tok[-1] / tok[0]:.2f}, us/req x{req[-1] / req[0]:.2f}, light us/req "
          f"x{light[-1] / light[0]:.2f}")


def projection(rows: list[dict], tok_s: float, req_tokens: int) -> list[dict]:
    """Cores of router and of front that PROJECT_GPUS decode GPUs at `tok_s` each would
    keep busy, at the worst measured cost per token and per request (requests of
    `req_tokens` new tokens; every token streamed through a front)."""
    tok = max(r["router_us_per_token"] for r in rows)
    req = max(r["router_us_per_req"] for r in rows)
    front = max(r["front_us_per_token"] for r in rows)
    out = []
    for gpus in PROJECT_GPUS:
        rate = gpus * tok_s
        out.append({"gpus": gpus, "tok_per_s": rate,
                    "router_cores": rate * (tok + req / req_tokens) / 1e6,
                    "front_cores": rate * front / 1e6})
    return out


def report_projection(rows: list[dict], tok_s: float, req_tokens: int) -> None:
    print(f"projection ({tok_s:.0f} tok/s per decode GPU, {req_tokens}-token requests, the "
          "worst row's costs): decode GPUs | tok/s | router cores | front cores")
    for p in projection(rows, tok_s, req_tokens):
        print(f"  {p['gpus']:>5} | {p['tok_per_s']:>9.0f} | {p['router_cores']:>8.2f} | "
              f"{p['front_cores']:>8.2f}")


def report(out: dict) -> None:
    if out["rows"]:
        report_rows(out["rows"])
        args = out["args"]
        report_projection(out["rows"], args["project_tok_s"], args["project_tokens"])
    for v in out.get("validation", []):
        sim, real = v["sim"], v["real"]
        print(f"validation {v['workers']} decodes: router us/token (streams, all costs) sim "
              f"{sim['router_us_per_token_gross']:.2f} real {real['router_us_per_token_gross']:.2f} "
              f"(ratio sim/real {v['ratio_token']:.2f}); "
              f"us/req sim {sim['router_us_per_req']:.1f} real {real['router_us_per_req']:.1f} "
              f"(ratio {v['ratio_req']:.2f}); tok/s sim {sim['tok_per_s']:.0f} real "
              f"{real['tok_per_s']:.0f}")
    f = out.get("fairness")
    if f:
        print(f"fairness ({f['slots']} slots, flood of {f['flood_concurrency']}): light client "
              f"p50/p99 ms alone {f['alone_ms'][0]:.1f}/{f['alone_ms'][1]:.1f}, with flood "
              f"{f['flooded_ms'][0]:.1f}/{f['flooded_ms'][1]:.1f}, ratio "
              f"{f['ratio'][0]:.2f}/{f['ratio'][1]:.2f} (target <= 2): "
              f"{'PASS' if max(f['ratio']) <= 2 else 'FAIL'}")
    print(f"requests check: {'FAIL: ' + '; '.join(out['problems']) if out['problems'] else 'PASS'}"
          " (every request answered, tokens equal predict)")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,8,32,64", help="decode counts, comma-separated")
    p.add_argument("--per-decode", type=int, default=32, help="requests in flight per decode")
    p.add_argument("--clients", type=int, default=4, help="client identities of a load")
    p.add_argument("--max-streams", type=int, default=64, help="most HTTP streams at once")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--prefill-us", type=float, default=20.0)
    p.add_argument("--experts", default="0/0",
                   help="TOTAL/ACTIVE: model a mixture of experts' decode step, whose time "
                        "grows with the experts its batch reads (--step-ms: every weight read)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per load")
    p.add_argument("--light", type=int, default=4, help="streams of the latency load")
    p.add_argument("--light-s", type=float, default=1.5)
    p.add_argument("--light-rate", type=float, default=200,
                   help="requests/s of the paced load (router CPU per request when light)")
    p.add_argument("--validate", action="store_true", help="also real null clusters of 1, 8")
    p.add_argument("--validate-per-decode", type=int, default=4,
                   help="streams per decode in the validation's tokens load")
    p.add_argument("--validate-rate", type=float, default=200,
                   help="requests/s of the validation's requests load (a rate both sustain: "
                        "a router's CPU per request depends on how many arrive together)")
    p.add_argument("--validate-step-ms", type=float, default=20.0,
                   help="the decode step of the validation (real workers must keep up)")
    p.add_argument("--rate", type=float, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fairness", action="store_true")
    p.add_argument("--fair-slots", type=int, default=16, help="--max-concurrent-requests")
    p.add_argument("--fair-s", type=float, default=4.0)
    p.add_argument("--quick", action="store_true", help="1 and 8 workers, short loads (CI)")
    p.add_argument("--profile-router", default="", help="cProfile the router into FILE.W")
    p.add_argument("--json", default="", help="write the figures here too")
    p.add_argument("--project-tok-s", type=float, default=10_000,
                   help="the projection's tokens/s per decode GPU")
    p.add_argument("--project-tokens", type=int, default=500,
                   help="the projection's new tokens per request")
    args = p.parse_args()
    if args.quick:
        args.workers, args.duration, args.light_s, args.fair_s = "1,8", 1.0, 0.5, 2.0
        args.new_tokens, args.fairness = 16, True
    return args


def interrupted(*_: object) -> None:
    raise KeyboardInterrupt        # so a SIGTERM (a timeout's) still stops our processes


def main() -> None:
    signal.signal(signal.SIGTERM, interrupted)
    args = parse()
    out: dict = {"args": vars(args), "machine": f"{os.cpu_count()} cpus, {os.uname().release}",
                 "rows": [], "problems": []}
    with tempfile.TemporaryDirectory() as tmp:
        for w in [int(w) for w in args.workers.split(",") if w]:
            (Path(tmp) / str(w)).mkdir()
            out["rows"].append(measure(w, args, Path(tmp) / str(w), out["problems"]))
            print(f"measured {w} workers", file=sys.stderr, flush=True)
        if args.validate:
            out["validation"] = [validate(w, args, Path(tmp) / f"real{w}", out["problems"])
                                 for w in (1, 8)]
        if args.fairness:
            out["fairness"] = fairness(args, Path(tmp), out["problems"])
    report(out)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    sys.exit(1 if out["problems"] else 0)


if __name__ == "__main__":
    main()
