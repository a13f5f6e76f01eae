"""Interference: long prompts arriving during a steady decode load, colocated `zpd run`
engine vs 1P1D (`zpd launch`) on the same cores. Inter-token latency of the steady
streams, time to first token, and goodput at a pair of SLOs; a plot of ITL over time.

    python bench/bench_interference.py [--model mid|tiny|smollm2|DIR] [--streams 16]
                                       [--steady-len 64] [--steady-tokens 128]
                                       [--long-len 2048] [--long-tokens 16] [--long-every 1]
                                       [--duration 30] [--plot bench_interference.png] [--smoke]

Load, the same on both sides (same prompts, greedy, ignore_eos): --streams steady
streams, each a closed loop of requests with --steady-len-token prompts and
--steady-tokens new tokens (a stream sends its next request as soon as one ends; the
first request of stream k makes (k+1)/streams of that, so the streams end at different
times rather than in waves), plus long prompts of --long-len tokens (--long-tokens new
tokens) arriving every --long-every s from --long-every/2 s on. The load runs
--duration s; requests still running then are cut (1P1D: aborted).

Sides and cores: the machine's cores, unpinned. Colocated: this process runs the
`zpd run` engine (OfflineEngine: Compute + DecodeBatch) with --threads torch threads
(default 2); each loop turn admits what has arrived and prefills it whole, then runs
one decode step, so a long prompt stalls every stream for its prefill: that is the
interference. 1P1D: `zpd launch` with one torch thread for the prefill worker and one
for the decode worker, plus the router and this process's client (one thread, one
zpd.Client, every request streamed).

Figures. ITL: every gap between consecutive tokens of a steady request, pooled over
the streams (colocated: the first token's time, then the end of each engine step that
gave a token; 1P1D: the arrival of each streamed chunk at the client). TTFT: arrival
to first token, per kind of request, where a long prompt's arrival is its scheduled
time (the colocated loop may only see it after the step it is in). Output tok/s: all
tokens made during the run / --duration.
Goodput: the share of the requests that finished within the run (both kinds) that met
both SLOs: TTFT <= SLO_ttft, and every inter-token gap of the request <= SLO_itl
(--slo-itl-pct 100, the request's worst gap: a stall is what a reader of the stream
sees; a lower percentile forgives that many stalls). Unless given (--slo-itl-ms,
--slo-ttft-ms), the SLOs come from 1P1D runs before the load: SLO_itl = 3x the
steady streams' ITL p50 without long prompts (--calib-s s of steady load alone),
SLO_ttft = 2x the median TTFT of an isolated long prompt (--calib-long of them).
Targets (full mode): 1P1D ITL p99 <= 2x its p50, colocated ITL p99 > 5x its p50,
1P1D goodput >= 1.5x colocated.

--plot: a PNG of every steady gap against its time in the run, one panel per side,
red lines where long prompts arrived, the dashed line at SLO_itl.
--smoke: the tiny model, 2 streams, one 128-token long prompt, 3 s of load, no
targets (CI keeps the script running with it).

Colocated runs first, then 1P1D; before each (and before the calibration) the script
waits up to --quiet-wait s for the machine to go idle, and the table gives the cores
other processes took during each load ("others' cores"): with two torch threads, the
colocated side slows down far more than 1P1D when another process holds a core.

The default model is bench_e2e.py's "mid" random Llama (~34M parameters, float32):
on one thread a 2048-token prefill takes ~1.1 s and a decode step of 16 short
streams ~50 ms. A long prompt's own decode steps (--long-tokens) add its 2048-token
attention to the steps it is in (the decode groups contexts by length, so it no
longer pads the short ones to it); --long-tokens 1 isolates the prefill's
interference.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import MID, Others, make_mid_model  # noqa: E402
from common import Launch, log_step, med, pct, random_prompts, verdict, wait_quiet  # noqa: E402
from interference_load import Plan, Record, Run, run_colocated, run_disagg  # noqa: E402

from engines.loader import LoadedModel, load_model  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402
from zpd.client import Client  # noqa: E402

SMOKE = dict(model="tiny", streams=2, steady_len=16, steady_tokens=16, long_len=128,
             long_tokens=4, long_every=2.0, duration=3.0, calib_s=1.0, calib_long=1, quiet_wait=0.0)
ROW_FORMAT = {"ITL p99/p50": ".2f", "requests finished": ".0f", "goodput": ".3f", "others' cores": ".2f"}


# --- 1P1D side: the cluster and its calibration ------------------------------------

def launch(tmp: Path, model: str, args: argparse.Namespace) -> Launch:
    return Launch(tmp, model, ["--dtype", args.dtype, "--prefill-threads", "1", "--decode-threads", "1",
                               "--kv-cache-mb", str(args.kv_cache_mb), "--max-batch", str(args.max_batch),
                               "--log-level", "WARNING"])


def isolated_long_ttft(router: str, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Median TTFT of long prompts sent one at a time (after one warm-up), s."""
    sampling = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    times = []
    with Client(router, timeout=args.timeout) as client:
        for p in prompts:
            t0 = time.monotonic()
            chunks = client.stream(input_ids=p, sampling_params=sampling)
            next(chunks)
            times.append(time.monotonic() - t0)
            list(chunks)
    return med(times[1:])


# --- figures ----------------------------------------------------------------------------

@dataclass
class Slo:
    ttft: float                        # s
    itl: float                         # s
    itl_pct: float
    basis: str


def steady_gaps(run: Run) -> list[tuple[float, float]]:
    """(seconds into the run, gap s) of every steady stream's gap."""
    return [(b - run.start, b - a) for r in run.records if r.kind == "steady"
            for a, b in zip(r.stamps, r.stamps[1:])]


def meets(rec: Record, slo: Slo) -> bool:
    return rec.stamps[0] - rec.submitted <= slo.ttft and \
        (len(rec.stamps) < 2 or pct(rec.gaps, slo.itl_pct) <= slo.itl)


def figures(run: Run, slo: Slo) -> dict[str, float]:
    gaps = [g for _, g in steady_gaps(run)]
    out = {"ITL p50 ms": pct(gaps, 50) * 1e3, "ITL p99 ms": pct(gaps, 99) * 1e3,
           "ITL max ms": max(gaps, default=float("nan")) * 1e3}
    out["ITL p99/p50"] = out["ITL p99 ms"] / out["ITL p50 ms"]
    for kind in ("steady", "long"):
        ttft = [r.stamps[0] - r.submitted for r in run.records if r.kind == kind and r.stamps]
        out[f"TTFT {kind} p50 ms"], out[f"TTFT {kind} p99 ms"] = pct(ttft, 50) * 1e3, pct(ttft, 99) * 1e3
    done = [r for r in run.records if r.done]
    out["requests finished"] = len(done)
    out["goodput"] = sum(meets(r, slo) for r in done) / len(done) if done else float("nan")
    out["output tok/s"] = sum(len(r.stamps) for r in run.records) / run.duration
    out["others' cores"] = run.others_cores
    return out


def report(args: argparse.Namespace, cluster: Launch, co: Run, pd: Run, slo: Slo) -> None:
    a, b = figures(co, slo), figures(pd, slo)
    print("\n=== bench_interference: colocated vs 1P1D ===")
    print("command:   " + shlex.join([sys.executable] + sys.argv))
    print("1P1D:      " + cluster.shown)
    print(f"model:     {args.model_desc}, {args.dtype}")
    print(f"load:      {args.streams} steady streams ({args.steady_len}-token prompts, "
          f"{args.steady_tokens} new tokens, closed loop) + a {args.long_len}-token prompt "
          f"({args.long_tokens} new tokens) every {args.long_every:g} s, {len(co.long_at)} in "
          f"{args.duration:g} s; greedy, ignore_eos")
    print(f"cores:     {os.cpu_count()} CPUs, unpinned. colocated: this process, torch threads "
          f"{args.threads}. 1P1D: prefill 1 + decode 1 torch thread, router, client (this process)")
    print(f"SLOs:      TTFT <= {slo.ttft * 1e3:.0f} ms and the request's p{slo.itl_pct:g} "
          f"inter-token gap <= {slo.itl * 1e3:.1f} ms ({slo.basis})\n")
    print(f"{'':24}{'colocated':>12}{'1P1D':>12}")
    for key in a:
        f = ROW_FORMAT.get(key, ".1f")
        print(f"{key:24}{a[key]:12{f}}{b[key]:12{f}}")
    ratio = b["goodput"] / a["goodput"] if a["goodput"] else math.inf if b["goodput"] else math.nan
    print(f"ratio goodput 1P1D/colocated: {ratio:.2f}")
    if not args.smoke:
        print(f"target 1P1D ITL p99 <= 2x p50 ({b['ITL p99/p50']:.2f}x): {verdict(b['ITL p99/p50'] <= 2)}")
        print(f"target colocated ITL p99 > 5x p50 ({a['ITL p99/p50']:.2f}x): "
              f"{verdict(a['ITL p99/p50'] > 5)}")
        print(f"target 1P1D goodput >= 1.5x colocated ({b['goodput']:.3f} vs {a['goodput']:.3f}): "
              f"{verdict(b['goodput'] >= 1.5 * a['goodput'])}")


def plot(path: Path, runs: dict[str, Run], slo: Slo) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 6), sharex=True, sharey=True)
    for ax, (name, run) in zip(axes, runs.items()):
        points = steady_gaps(run)
        ax.scatter([t for t, _ in points], [g * 1e3 for _, g in points], s=3, label="steady gap")
        for i, t in enumerate(run.long_at):
            ax.axvline(t, color="tab:red", alpha=0.6, label="long prompt arrives" if i == 0 else None)
        ax.axhline(slo.itl * 1e3, color="grey", linestyle="--", label="SLO_itl")
        ax.set_yscale("log")
        ax.set_ylabel("inter-token gap, ms")
        ax.set_title(name)
    axes[0].legend(loc="upper right", fontsize="small")
    axes[-1].set_xlabel("seconds into the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- phases ----------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mid", help="mid (bench_e2e's random Llama), tiny, smollm2 or a dir")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=16, help="steady streams (default 16)")
    ap.add_argument("--steady-len", type=int, default=64, help="steady prompt tokens (default 64)")
    ap.add_argument("--steady-tokens", type=int, default=128, help="steady new tokens (default 128)")
    ap.add_argument("--long-len", type=int, default=2048, help="long prompt tokens (default 2048)")
    ap.add_argument("--long-tokens", type=int, default=16, help="long prompt new tokens (default 16)")
    ap.add_argument("--long-every", type=float, default=1.0, help="s between long prompts (default 1: about 1 in 50 colocated "
                         "steps then stalls, enough for its ITL p99 to show it)")
    ap.add_argument("--duration", type=float, default=30.0, help="s of load per side (default 30)")
    ap.add_argument("--threads", type=int, default=2, help="colocated torch threads (default 2)")
    ap.add_argument("--slo-ttft-ms", type=float, default=0.0, help="0: 2x an isolated long prompt's TTFT")
    ap.add_argument("--slo-itl-ms", type=float, default=0.0, help="0: 3x the steady ITL p50 alone")
    ap.add_argument("--slo-itl-pct", type=float, default=100.0,
                    help="percentile of a request's gaps held to SLO_itl (default 100: the worst)")
    ap.add_argument("--calib-s", type=float, default=8.0, help="s of steady load alone for SLO_itl")
    ap.add_argument("--calib-long", type=int, default=3, help="isolated long prompts for SLO_ttft")
    ap.add_argument("--kv-cache-mb", type=float, default=256)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=120.0, help="s to wait for any answer (1P1D)")
    ap.add_argument("--quiet-wait", type=float, default=20.0,
                    help="before each phase wait up to this many s for the machine to go idle")
    ap.add_argument("--plot", type=Path, default=Path("bench_interference.png"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny settings, no targets: " + str(SMOKE))
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    return args


def model_path(args: argparse.Namespace, tmp: Path) -> str:
    args.model_desc = args.model
    if args.model != "mid":
        return args.model
    args.model_desc = ("mid: random Llama, {num_hidden_layers} layers, hidden {hidden_size}, "
                       "{num_attention_heads}/{num_key_value_heads} heads, MLP {intermediate_size}, "
                       "vocab {vocab_size}").format(**MID)
    return str(make_mid_model(tmp / "model", args.seed))


def warm_up(model: LoadedModel, router: str, plan: Plan, args: argparse.Namespace) -> None:
    """One long prompt and one request per stream on each side (2 new tokens), so
    first-use costs stay out of the figures."""
    log_step("warm-up, both sides")
    prompts = [plan.steady(k, 0)[0] for k in range(args.streams)] + \
        random_prompts(1, args.long_len, plan.vocab, args.seed + 2)
    params = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    with torch.inference_mode():
        OfflineEngine(model, kv_cache_mb=args.kv_cache_mb, max_batch=args.max_batch).run(
            [Request(f"w{i}", p, SamplingParams.from_dict(params)) for i, p in enumerate(prompts)])
    with Client(router, timeout=args.timeout) as c:
        c.generate_many([{"input_ids": p, "sampling_params": params} for p in prompts])


def calibrate(router: str, vocab: int, args: argparse.Namespace) -> Slo:
    """The SLO pair: given, or from 1P1D runs without interference."""
    wait_quiet(args.quiet_wait, 0.15, 1.0)
    log_step(f"1P1D: {args.calib_s:g} s of steady load alone, {args.calib_long} isolated long prompts")
    alone = run_disagg(router, Plan.make(args, vocab, args.calib_s, with_long=False), args, "cal")
    p50 = pct([g for _, g in steady_gaps(alone)], 50)
    long_ttft = isolated_long_ttft(router, random_prompts(args.calib_long + 1, args.long_len, vocab,
                                                          args.seed + 3), args)
    itl = args.slo_itl_ms / 1e3 or 3 * p50
    ttft = args.slo_ttft_ms / 1e3 or 2 * long_ttft
    basis = (f"1P1D without interference: steady ITL p50 {p50 * 1e3:.1f} ms, isolated long-prompt "
             f"TTFT {long_ttft * 1e3:.0f} ms; SLO_itl = {'--slo-itl-ms' if args.slo_itl_ms else '3x that p50'}"
             f", SLO_ttft = {'--slo-ttft-ms' if args.slo_ttft_ms else '2x that TTFT'}")
    return Slo(ttft, itl, args.slo_itl_pct, basis)


def measure(model: LoadedModel, cluster: Launch, plan: Plan, args: argparse.Namespace) -> tuple[Run, Run]:
    log_step(f"colocated load, {args.duration:g} s (torch threads {args.threads})")
    torch.set_num_threads(args.threads)
    wait_quiet(args.quiet_wait, 0.15, 1.0)
    others = Others([os.getpid()])
    with torch.inference_mode():
        co = run_colocated(model, plan, args)
    co.others_cores = others.cores()
    log_step(f"1P1D load, {args.duration:g} s")
    wait_quiet(args.quiet_wait, 0.15, 1.0)
    others = Others(list(cluster.pids.values()) + [cluster.proc.pid, os.getpid()])
    pd = run_disagg(cluster.router, plan, args)
    pd.others_cores = others.cores()
    return co, pd


def main() -> None:
    args = parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    with tempfile.TemporaryDirectory(prefix="bench-interference-") as tmp_name:
        tmp = Path(tmp_name)
        path = model_path(args, tmp)
        model = load_model(path, dtype=args.dtype)
        plan = Plan.make(args, model.cfg.vocab_size, args.duration)
        log_step("1P1D: zpd launch")
        cluster = launch(tmp, path, args)
        try:
            warm_up(model, cluster.router, plan, args)
            slo = calibrate(cluster.router, model.cfg.vocab_size, args)
            co, pd = measure(model, cluster, plan, args)
        finally:
            cluster.stop()
    report(args, cluster, co, pd, slo)
    plot(args.plot, {"colocated (zpd run engine)": co, "1P1D (zpd launch)": pd}, slo)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
