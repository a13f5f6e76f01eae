"""bench_tp.py's transfer half: the KV of one prompt from a prefill of TP p into a decode
of TP d, matched (p == d) and mismatched, through `zpd launch --prefill-tp P
--decode-tp D` clusters on loopback Mooncake; and the planner's writes per page and
staging copy for the same pairs, computed in this process (engines/tp/transfer.py)."""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from common import Launch, log_step, med, random_prompts, wait_quiet
from engines.config import ModelConfig
from engines.tp.plan import TpPlan
from engines.tp.transfer import LocalPool, RankPool, TransferPlanner
from zpd.client import Client
from zpd.worker.writes import transfer_runs

PAGE_SIZE = 16
SAMPLING = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


# --- the planner in this process ----------------------------------------------------------

def rank_heads(cfg: ModelConfig, size: int) -> list[range]:
    return [TpPlan.for_rank(cfg, r, size).kv_heads(cfg) for r in range(size)]


def local_pools(cfg: ModelConfig, size: int, pages: int) -> list[LocalPool]:
    """A prefill's ranks' pools as the workers make them (engines/kv/pool.py's shape)."""
    out = []
    for heads in rank_heads(cfg, size):
        buf = torch.randn(pages, cfg.num_layers, 2, PAGE_SIZE, len(heads), cfg.head_dim)
        out.append(LocalPool(heads, buf.data_ptr(), buf))
    return out


def page_lists(n: int, pages: int, scattered: bool, seed: int) -> tuple[list[int], list[int]]:
    """Our pages and the decode's for one prompt of n pages: runs of consecutive ids (a
    fresh pool), or no two adjacent on either side."""
    if not scattered:
        return list(range(1, n + 1)), list(range(1, n + 1))
    rng = random.Random(seed)
    return [2 * p for p in rng.sample(range(pages // 2), n)], [2 * p for p in rng.sample(range(pages // 2), n)]


def planner_figures(cfg: ModelConfig, p: int, d: int, n_pages: int, repeats: int) -> dict[str, float]:
    """Writes per page (consecutive and scattered pages), bytes a write, and the ms of
    one `plan` (the staging copy where heads differ; no write)."""
    pages = 4 * n_pages + 2
    sources = local_pools(cfg, p, pages)
    dests = [RankPool(h, (r + 1) << 40) for r, h in enumerate(rank_heads(cfg, d))]
    planner = TransferPlanner(lambda addr, nbytes: None)
    figs: dict[str, float] = {}
    for name, scattered in (("writes/page", False), ("writes/page scattered", True)):
        ours, theirs = page_lists(n_pages, pages, scattered, seed=n_pages)
        runs = transfer_runs(planner.plan(sources, dests, ours, theirs), ours, theirs)
        figs[name] = len(runs) / n_pages
        figs["bytes/write" if not scattered else "bytes/write scattered"] = \
            sum(r[2] for r in runs) / len(runs)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        planner.plan(sources, dests, ours, theirs)
        times.append(time.perf_counter() - t)
    figs["plan ms"] = med(times) * 1e3
    return figs


# --- the clusters ---------------------------------------------------------------------------

def transfer_seconds(client: Client) -> tuple[int, float]:
    """The prefill's kv_bytes_written and kv_transfer_seconds counters."""
    [c] = [w.get("counters", {}) for w in client.admin("status")["workers"] if w["role"] == "prefill"]
    return c["kv_bytes_written"], c["kv_transfer_seconds"]


def one_by_one(client: Client, prompts: list[list[int]], tag: str, timeout: float) -> list[dict]:
    """Each prompt alone (its write shares the link with nothing): the answers' timings."""
    out = []
    for i, p in enumerate(prompts):
        client.submit(input_ids=p, rid=f"{tag}-{i}", sampling_params=SAMPLING)
        while not (chunk := client.receive(timeout))["finished"]:
            pass
        finish = chunk["finish_reason"] or {}
        if finish.get("type") != "length":
            raise RuntimeError(f"request {chunk['rid']} ended with {finish}")
        out.append(chunk["meta"]["timings"])
    return out


def pair_round(client: Client, prompts: list[list[int]], tag: str, args: argparse.Namespace
               ) -> dict[str, float]:
    wait_quiet(args.quiet_wait)
    b0, s0 = transfer_seconds(client)
    timings = one_by_one(client, prompts, tag, args.timeout)
    b1, s1 = transfer_seconds(client)
    return {"kv_transfer ms": med([t["kv_transfer"] for t in timings]),
            "kB/request": (b1 - b0) / len(prompts) / 1e3,
            "MB/s": (b1 - b0) / (s1 - s0) / 1e6,
            "prefill_forward ms": med([t["prefill_forward"] for t in timings])}


def launch(pair: tuple[int, int], tmp: Path) -> Launch:
    p, d = pair
    return Launch(tmp, "tiny", ["--prefill-tp", str(p), "--decode-tp", str(d), "--threads", "1",
                                "--no-prefix-cache", "--kv-cache-mb", "64", "--log-level", "WARNING"],
                  wait=False)


def cluster_rounds(pairs: list[tuple[int, int]], args: argparse.Namespace) -> tuple[dict, str]:
    """Per pair, per figure: one value per round; one cluster's command line."""
    figs: dict = {}
    with tempfile.TemporaryDirectory() as root:
        dirs = [Path(root) / f"p{p}d{d}" for p, d in pairs]
        clusters = []
        try:
            for pair, tmp in zip(pairs, dirs):
                tmp.mkdir()
                clusters.append(launch(pair, tmp))
            for c in clusters:
                c.wait_ready()
            clients = [Client(c.router, timeout=args.timeout) for c in clusters]
            for client, pair in zip(clients, pairs):                   # warm-up
                one_by_one(client, random_prompts(2, args.prompt_tokens, 256, 7), f"warm{pair}", args.timeout)
            for r in range(args.rounds):
                prompts = random_prompts(args.prompts, args.prompt_tokens, 256, seed=1000 + r)
                order = list(range(len(pairs)))
                for i in order[r % len(order):] + order[:r % len(order)]:
                    for k, v in pair_round(clients[i], prompts, f"r{r}-{i}", args).items():
                        figs.setdefault((pairs[i], k), []).append(v)
                log_step(f"transfer round {r + 1}: " + ", ".join(
                    f"{p}->{d} {figs[((p, d), 'kv_transfer ms')][-1]:.3f} ms" for p, d in pairs))
            for client in clients:
                client.close()
        finally:
            for c in clusters:
                c.stop()
        return figs, clusters[0].shown.replace(str(dirs[0]), "$TMP")


def print_transfer(pairs: list[tuple[int, int]], cfg: ModelConfig, args: argparse.Namespace,
                   figs: dict | None, shown: str) -> None:
    n_pages = -(-args.prompt_tokens // PAGE_SIZE)
    plans = {pair: planner_figures(cfg, *pair, n_pages, args.micro_iters) for pair in pairs}
    cols = f"{'':<50}" + "".join(f"{f'{p} -> {d}':>12}" for p, d in pairs)
    print(f"\nKV transfer of one {args.prompt_tokens}-token prompt ({n_pages} pages of 16), "
          f"tiny model, float32, prefill TP -> decode TP")
    if figs is not None:
        print(f"cluster: loopback Mooncake, {args.prompts} prompts one at a time, medians of "
              f"{args.rounds} rounds\n{cols}")
        for k in ("kv_transfer ms", "MB/s", "kB/request", "prefill_forward ms"):
            print(f"  {k:<48}" + "".join(f"{med(figs[(pair, k)]):>12.3f}" for pair in pairs))
        print(f"  cluster: {shown}")
    else:
        print("cluster: not run (--quick or --no-cluster)")
    print(f"planner (engines/tp/transfer.py, in this process)\n{cols}")
    for k in ("writes/page", "writes/page scattered", "bytes/write", "bytes/write scattered", "plan ms"):
        print(f"  {k:<48}" + "".join(f"{plans[pair][k]:>12.3f}" for pair in pairs))
