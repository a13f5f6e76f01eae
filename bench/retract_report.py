"""bench_retract.py's report: the tables it prints, and the timeline it reads from the
workers' INFO logs (millisecond timestamps) to say where a recompute's time went."""
from __future__ import annotations

import os
import re
import shlex
import sys
from datetime import datetime

from common import Launch, med, pct, verdict


# --- log breakdown ------------------------------------------------------------------------

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ \S+: rid=(\S+) room=\d+ epoch=(\d+) (.*)$")


def parse_log(text: str) -> list[tuple[float, str, int, str]]:
    """(wall time, rid, epoch, event text) for every per-request INFO line."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((t, m.group(2), int(m.group(3)), m.group(4)))
    return out


def breakdown(events: dict[str, list], rids: set[str], epoch_min: int, t0_wall: float,
              t_all_wall: float) -> dict[str, float]:
    """Milestones (seconds after t0) of one phase from the prefill and decode logs."""
    def pick(role: str, word: str) -> list[tuple[float, str]]:
        return [(t, ev) for t, rid, ep, ev in events[role]
                if rid in rids and ep >= epoch_min and t >= t0_wall - 0.002 and ev.startswith(word)]
    queued, written, received = pick("prefill", "queued"), pick("prefill", "kv written"), \
        pick("decode", "kv received")
    if not (queued and written and received):
        return {}
    kv_ms = [float(m.group(1)) for _, ev in written if (m := re.search(r"([\d.]+) ms\)", ev))]
    kv_bytes = sum(int(m.group(1)) for _, ev in written if (m := re.search(r"\((\d+) bytes", ev)))
    write_start = [t - ms / 1e3 for (t, _), ms in zip(written, kv_ms)]
    return {"first queued": min(t for t, _ in queued) - t0_wall,
            "last queued": max(t for t, _ in queued) - t0_wall,
            "first write start": min(write_start) - t0_wall,
            "last kv written": max(t for t, _ in written) - t0_wall,
            "last kv received": max(t for t, _ in received) - t0_wall,
            "all next tokens": t_all_wall - t0_wall,
            "kv write ms p50": pct(kv_ms, 50), "kv write ms p99": pct(kv_ms, 99),
            "kv write ms sum": sum(kv_ms), "kv MiB": kv_bytes / 2**20,
            "writes": len(written), "requests": len(rids)}


# --- report ----------------------------------------------------------------------------

MS = 1e3
KINDS = (("re", "recompute"), ("fresh", "fresh"), ("long", "fresh-long"))
PINNED = (("re_pin", "re pinned"), ("fresh_pin", "fr pinned"))


def report(args, cluster: Launch, pc: dict, reps: list[dict], logs: dict, comp: dict) -> None:
    kinds = KINDS + (PINNED if "re_pin" in reps[0] else ())
    report_setup(args, cluster)
    report_pause(args, pc)
    report_recompute(args, reps, comp)
    report_cpu(reps, kinds)
    report_logs(reps, kinds, logs)


def report_setup(args, cluster: Launch) -> None:
    print("\n=== bench_retract: pause(retract) / continue, recompute vs fresh prefill ===")
    print("command:   " + shlex.join([sys.executable] + sys.argv))
    print("cluster:   " + cluster.shown)
    print(f"model:     {args.model_desc}, {args.dtype}, page size 16")
    print(f"threads:   {os.cpu_count()} CPUs, unpinned, shared by everything. prefill: torch threads 1; "
          f"decode: torch threads 1; router: 1 process; this process: 1 receiving thread per load "
          "+ main thread (admin)")
    lo, hi = args.prompt_lens
    print(f"load:      {args.requests} streaming requests, prompts {lo}-{hi} random tokens, greedy, "
          f"ignore_eos, max_new_tokens {args.max_new}")


def report_pause(args, pc: dict) -> None:
    ms, n = MS, args.requests
    print(f"\n1. pause(retract) / continue with {n} running requests "
          f"(medians of {len(pc['pause'])} cycles; held = requests the decode held)")
    rows = [("pause(retract) round trip", pc["pause"]), ("continue round trip", pc["continue_rtt"]),
            ("continue -> new token p50", pc["p50"]), ("continue -> new token p99", pc["p99"]),
            ("continue -> new token max", pc["max"]),
            (f"continue -> all {n} have one", pc["max"])]
    for name, xs in rows:
        print(f"  {name:<32}{med(xs) * ms:9.1f} ms   (cycles: "
              + ", ".join(f"{x * ms:.1f}" for x in xs) + ")")
    print(f"  held per cycle: {pc['held']}; decode running at pause: {pc['running_at_pause']}; "
          f"mean tokens per request at pause: " + ", ".join(f"{x:.0f}" for x in pc["tokens_at_pause"]))


def report_recompute(args, reps: list[dict], comp: dict) -> None:
    ms, n = MS, args.requests
    ratios = [r["re"].t / r["fresh"].t for r in reps]
    long_ratios = [r["re"].t / r["long"].t for r in reps]
    print(f"\n2. recompute of N={n} held requests vs N fresh requests of the same prefixes "
          f"({len(reps)} interleaved repeats, same cluster)")
    print("  recompute: continue -> every held request has its next token (resumed requests keep "
          "decoding and streaming)\n  fresh:     first submit -> every request of the same prefixes "
          "has its 2nd token (max_new_tokens 2)\n  fresh-long: the same, but with the long max_new_tokens, "
          "so they keep decoding and streaming like the resumed requests (diagnostic)")
    print(f"  {'rep':<5}{'prefix tok':>11}{'recompute ms':>13}{'fresh ms':>10}{'re/fresh':>9}"
          f"{'re tok/s':>10}{'fresh tok/s':>12}{'fr-long ms':>14}{'others (cores) re/fr/long':>27}")
    for i, r in enumerate(reps):
        print(f"  {i + 1:<5}{r['re'].tokens:>11}{r['re'].t * ms:>13.0f}{r['fresh'].t * ms:>10.0f}"
              f"{ratios[i]:>9.2f}{r['re'].tok_s:>10.0f}{r['fresh'].tok_s:>12.0f}{r['long'].t * ms:>14.0f}"
              f"{'':>9}" + " / ".join(f"{r[k].cpu['others (cores)']:.2f}" for k, _ in KINDS))
    ratio = med(ratios)

    def both(kind: str) -> str:
        return (f"{med([r[kind].t for r in reps]) * ms:.0f} ms "
                f"({med([r[kind].tok_s for r in reps]):.0f} tok/s)")
    print(f"  median: recompute {both('re')}, fresh {both('fresh')}, fresh-long {both('long')}")
    print("  (tokens: prompt + output so far per request, summed; the recompute prefills one token "
          "fewer each and feeds it as the decode input, fresh prefills all and decodes once)")
    print(f"  ratio recompute/fresh time, median of per-repeat ratios: {ratio:.2f}   "
          f"TARGET <= 1.1: {verdict(ratio <= 1.1)}")
    print(f"  diagnostic: recompute/fresh-long time, median {med(long_ratios):.2f} (per repeat: "
          + ", ".join(f"{x:.2f}" for x in long_ratios) + ")")
    if "re_pin" in reps[0]:
        pin_ratios = [r["re_pin"].t / r["fresh_pin"].t for r in reps]
        print(f"  diagnostic, pinned (prefill alone on CPU 0; decode, router, client on CPU 1): "
              f"recompute {both('re_pin')}, fresh {both('fresh_pin')}, ratio median "
              f"{med(pin_ratios):.2f} (per repeat: " + ", ".join(f"{x:.2f}" for x in pin_ratios)
              + f"); within 1.1: {verdict(med(pin_ratios) <= 1.1)}")

    tok0 = reps[0]["re"].tokens
    print(f"  model work alone (this process, torch threads 1, cluster stopped; repeat 1's "
          f"{tok0} prefix tokens): prefill in batches of 32 {comp['prefill'] * ms:.0f} ms "
          f"({tok0 / comp['prefill']:.0f} tok/s); one decode step at context {comp['ctx']:.0f}: "
          f"{n} requests {comp['step_n'] * ms:.1f} ms, 8 requests {comp['step_8'] * ms:.1f} ms")
    print(f"  (repeat 1 in the cluster: recompute {reps[0]['re'].t * ms:.0f} ms, fresh "
          f"{reps[0]['fresh'].t * ms:.0f} ms)")



def report_cpu(reps: list[dict], kinds: tuple) -> None:
    ms = MS
    print("\n  CPU seconds of each process in the windows (medians; wall = window length, s):")
    print(f"  {'':<24}" + "".join(f"{label:>11}" for _, label in kinds))
    for k in reps[0]["re"].cpu:
        print(f"  {k:<24}" + "".join(f"{med([r[kind].cpu[k] for r in reps]):>11.2f}"
                                     for kind, _ in kinds))
    print(f"  {'prefill busy (cpu/wall)':<24}" + "".join(
        f"{med([r[kind].cpu['prefill'] / r[kind].cpu['wall'] for r in reps]):>11.0%}"
        for kind, _ in kinds))
    print(f"  {'tokens beyond the next':<24}" + "".join(
        f"{med([r[kind].extra_tokens for r in reps]):>11.0f}" for kind, _ in kinds)
          + "   (streamed inside the window after each request's next / 2nd token)")
    print(f"  {'token gap ms (p50)':<24}" + "".join(
        f"{med([r[kind].gap for r in reps]) * ms:>11.1f}" for kind, _ in kinds)
          + "   (consecutive tokens of one request inside the window: the decode step period)")



def report_logs(reps: list[dict], kinds: tuple, logs: dict) -> None:
    ms = MS
    print("\n  breakdown from the worker logs (ms after continue / first submit; medians):")
    br = {kind: [breakdown(logs, r[kind].rids, 1 if kind.startswith("re") else 0, r[kind].t0_wall,
                           r[kind].all_wall) for r in reps] for kind, _ in kinds}
    if all(all(v) for v in br.values()):
        print(f"  {'milestone':<24}" + "".join(f"{label:>11}" for _, label in kinds))
        for k in br["re"][0]:
            scale = 1 if k.startswith("kv ") or k in ("writes", "requests") else ms
            print(f"  {k:<24}" + "".join(f"{med([d[k] for d in br[kind]]) * scale:>11.1f}"
                                         for kind, _ in kinds))
        print("  (queued: the prefill took the request in; write start: kv written minus its "
              "duration; kv received: the decode got kv_done)")
        for a, b, label in (("re", "fresh", "unpinned"), ("re_pin", "fresh_pin", "pinned")):
            if a not in br:
                continue
            m = {k: med([d[k] for d in br[a]]) - med([d[k] for d in br[b]])
                 for k in ("last kv written", "last kv received", "all next tokens")}
            print(f"  recompute - fresh, {label}: {m['all next tokens'] * ms:+.0f} ms = prefill and "
                  f"writes (last kv written) {m['last kv written'] * ms:+.0f} ms, kv_done to the decode "
                  f"{(m['last kv received'] - m['last kv written']) * ms:+.0f} ms, last decode step and "
                  f"streaming {(m['all next tokens'] - m['last kv received']) * ms:+.0f} ms")
    else:
        print("  (log lines missing: no breakdown)")
