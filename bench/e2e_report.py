"""bench_e2e.py's report: the comparison table, the thread-split bound, the control
plane's overhead per request and the component times."""
from __future__ import annotations

import os
import shlex
import statistics
import sys

from common import Launch, pct, verdict

# messages for one streamed request up to its first token, by design: on the first
# token's critical path are 1, 2, [prefill forward], 3, 4: four one-way hops; the KV
# write and kv_dest/kv_done run beside it (the decode's copy of the first token is
# not passed on twice)
FIRST_TOKEN_MESSAGES = ["client->router generate", "router->prefill generate",
                        "prefill->router first token", "router->client token",
                        "router->decode generate", "decode->prefill kv_dest",
                        "prefill->decode kv_done"]
CRITICAL_HOPS = 4


def split_bound(args, comp: dict, co) -> None:
    """What the 1+1 thread split allows at best, from the in-process component times:
    colocated does all prefill and decode work on two threads, one after the other;
    1P1D at best overlaps them perfectly, each on one thread, so it is bound by the
    larger of the two. Closed-loop waves (equal lengths, ramp 0) overlap them hardly
    at all, which gives the other figure."""
    steps = args.requests * args.new_tokens / args.concurrency
    work = {t: (args.requests * comp["prefill"][t], steps * comp["decode_step"][t]) for t in (1, 2)}
    colocated = sum(work[2])
    best, waves = max(work[1]), sum(work[1])
    tokens = args.requests * args.new_tokens
    print(f"thread split: prefill work {work[1][0]:.1f} s and decode work {work[1][1]:.1f} s on one "
          f"thread each (colocated, two threads: {work[2][0]:.1f} + {work[2][1]:.1f} s); 1P1D tok/s "
          f"can reach at most {tokens / best:.0f} with perfect overlap ({colocated / best:.2f}x the "
          f"colocated estimate of {tokens / colocated:.0f}), {tokens / waves:.0f} with none "
          f"({colocated / waves:.2f}x); measured colocated: {co.tokens / co.wall:.0f} (its prefill "
          "forwards batch whole waves, faster than one prompt at a time)")


def report(args, cmd: Launch, co, dg, comp: dict, xfer: dict,
           rtt: dict, iso: dict, cpu: dict, logs: dict, noise: dict) -> None:
    ms = 1e3
    t_x = xfer["long"]
    print("\n=== bench_e2e: 1P1D vs colocated ===")
    print("command:   " + shlex.join([sys.executable] + sys.argv))
    print("1P1D:      " + cmd.shown)
    print(f"model:     {args.model_desc}, {args.dtype}; load: {args.requests} requests, "
          f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens (greedy, ignore_eos), "
          f"closed loop, concurrency {args.concurrency}, ramp {args.ramp_s:g} s")
    print(f"cores:     {os.cpu_count()} CPUs, unpinned, shared by both sides. colocated: one process, "
          f"torch threads 2 (OfflineEngine = `zpd run`). 1P1D: prefill torch threads "
          f"{args.prefill_threads}, decode torch threads {args.decode_threads}"
          + (f" ({' '.join(args.cluster_env)})" if args.cluster_env else "")
          + f", plus router and {args.concurrency} client threads in this process")
    same = sum(co.outputs[i] == dg.outputs.get(i) for i in co.outputs)
    print(f"outputs:   {same}/{len(co.outputs)} requests identical token for token "
          f"({co.tokens} vs {dg.tokens} output tokens in {args.rounds} round(s); "
          f"{co.mismatched_rounds + dg.mismatched_rounds} request(s) differed between rounds)"
          + ("; in float32 a near-tie can flip with the batch shape, --dtype float64 rules that out"
             if same < len(co.outputs) else ""))
    ttft_bound = {q: 1.1 * pct(co.ttft, q) + t_x for q in (50, 99)}
    rows = [("TTFT p50 (ms)", pct(co.ttft, 50) * ms, pct(dg.ttft, 50) * ms,
             f"<= 1.1x coloc + transfer = {ttft_bound[50] * ms:.1f}", pct(dg.ttft, 50) <= ttft_bound[50]),
            ("TTFT p99 (ms)", pct(co.ttft, 99) * ms, pct(dg.ttft, 99) * ms,
             f"<= 1.1x coloc + transfer = {ttft_bound[99] * ms:.1f}", pct(dg.ttft, 99) <= ttft_bound[99]),
            ("ITL p50 (ms)", pct(co.gaps, 50) * ms, pct(dg.gaps, 50) * ms, "(no target)", None),
            ("ITL p99 (ms)", pct(co.gaps, 99) * ms, pct(dg.gaps, 99) * ms, "(no target)", None),
            ("ITL mean (ms)", statistics.mean(co.gaps) * ms, statistics.mean(dg.gaps) * ms, "(no target)", None),
            ("output tok/s", co.tokens / co.wall, dg.tokens / dg.wall, ">= 0.9x colocated",
             dg.tokens / dg.wall >= 0.9 * co.tokens / co.wall),
            ("wall (s)", co.wall, dg.wall, "", None)]
    print(f"\n{'measure':<16}{'colocated':>12}{'1P1D':>12}{'1P1D/coloc':>12}  {'target':<36}verdict")
    for name, a, b, target, ok in rows:
        print(f"{name:<16}{a:>12.1f}{b:>12.1f}{b / a:>11.2f}x  {target:<36}{'' if ok is None else verdict(ok)}")

    if (args.prefill_threads, args.decode_threads) == (1, 1):
        split_bound(args, comp, co)
    print("per round:  output tok/s colocated " + " / ".join(f"{t:.1f}" for t, _ in co.rounds)
          + ", 1P1D " + " / ".join(f"{t:.1f}" for t, _ in dg.rounds) + "; others' load (cores) colocated "
          + " / ".join(f"{x:.2f}" for x in noise["colocated load"]) + ", 1P1D "
          + " / ".join(f"{x:.2f}" for x in noise["1P1D load"]))
    unit = rtt["hot"]
    print("\ncontrol plane, per request (isolated requests, concurrency 1, back to back; medians):")
    print(f"  messages by design: {len(FIRST_TOKEN_MESSAGES)} to the first token ("
          + ", ".join(FIRST_TOKEN_MESSAGES) + f"); {CRITICAL_HOPS} one-way hops on its critical path "
          f"(the KV write and kv_dest/kv_done run beside them); then 2 per streamed token (decode->router, "
          f"router->client): {len(FIRST_TOKEN_MESSAGES) + 2 * (args.new_tokens - 1)} for a "
          f"{args.new_tokens}-token streamed request")
    print(f"  ZeroMQ DEALER/ROUTER round trip, 200 B, two processes: {unit * 1e6:.0f} us back to back "
          f"(the unit below); {rtt['idle'] * 1e6:.0f} us when each follows 20 ms of idleness")
    idle = rtt["idle"]
    print(f"  {'prompt':>8} {'TTFT':>9} {'- forward':>10} {'= overhead':>11} {'round trips':>12} "
          f"{'idle RTTs':>10}  target <= 3 round trips   (KV write beside it)")
    for n, got in ((args.prompt_len, iso["long"]), (args.short_len, iso["short"])):
        over = got["overhead"]
        print(f"  {n:>8} {got['ttft'] * ms:>9.2f} {got['forward'] * ms:>10.2f} {over * ms:>11.2f} "
              f"{over / unit:>12.1f} {over / idle:>10.1f}  {verdict(over <= 3 * unit):<25}"
              f"({got['transfer'] * ms:.2f} ms)")
    print("  (ms, medians over requests. TTFT: client submit to first streamed token, one request at a "
          "time. forward: what the prefill worker reports in the response's meta.timings (its forward "
          "with first-token sampling). overhead = TTFT - forward: the 4 one-way hops (client->router, "
          "router->prefill, prefill->router, router->client, each a process waking from poll), codecs "
          "and handling. The KV write (meta.timings kv_transfer, in brackets) runs beside the first "
          "token's way to the client, not on it. round trips: in "
          "units of the back-to-back round trip; idle RTTs: of the round trip after 20 ms idle, which is "
          "what each hop here follows (the processes idle through the forward).)")

    print("\ncomponents (in-process, medians):")
    for name, label in (("prefill", f"prefill {args.prompt_len} tokens"),
                        ("prefill_short", f"prefill {args.short_len} tokens"),
                        ("decode_step", f"decode step, batch {args.concurrency}, "
                                        f"context {args.prompt_len + args.new_tokens // 2}")):
        one, two = comp[name][1], comp[name][2]
        print(f"  {label:<42} 1 thread {one * ms:8.2f} ms   2 threads {two * ms:8.2f} ms   "
              f"speedup {one / two:4.2f}x")
    print(f"  KV transfer of a {args.prompt_len}-token prompt ({xfer['bytes'] / 2**20:.2f} MiB): "
          f"{t_x * ms:.2f} ms ({xfer['bytes'] / t_x / 1e9:.2f} GB/s); of {args.short_len} tokens: "
          f"{xfer['short'] * ms:.2f} ms")
    if logs["kv_ms"]:
        print(f"  in the cluster under load (prefill log, {len(logs['kv_ms'])} writes): kv written "
              f"p50 {pct(logs['kv_ms'], 50):.2f} ms, p99 {pct(logs['kv_ms'], 99):.2f} ms")
    worst = max(max(v) for v in noise.values())
    print("\nother processes on this machine (not ours) used, in cores on average: " + ", ".join(
        f"{k} " + "/".join(f"{x:.2f}" for x in v) for k, v in noise.items())
        + (" -- NOISY: the figures are skewed, 2-thread torch most" if worst > 0.1 else " (quiet)"))
    print(f"1P1D CPU use during the load runs ({dg.wall:.1f} s wall): " + ", ".join(
        f"{k} {v:.1f} s ({v / dg.wall:.0%} of a core)" for k, v in cpu.items()))


# --- main ---------------------------------------------------------------------------
