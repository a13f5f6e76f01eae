"""What tensor parallelism costs on a CPU machine, side by side in one run.

    python bench/bench_tp.py [--tp 1,2,4] [--batches 1,16] [--steps 32] [--rounds 3]
                             [--micro-iters 200] [--pairs 1:1,2:2,2:1,1:2] [--prompts 16]
                             [--prompt-tokens 512] [--quiet-wait 2] [--no-cluster] [--quick]

On this 2-core machine TP buys no speed: every rank's share of the tiny model is
microseconds of work, so what a step at TP N adds over TP 1 is its coordination.

Engine: the decode step of the embedded tiny model (2 layers, hidden 64, 4 heads,
2 kv heads; float32) through the path `zpd run --tp N` takes: OfflineEngine with
`tp=` the group engines.tp.spawn.lead starts, one torch thread per rank. Every TP
size's engine is started once; each round then runs every (TP, batch) in turn
(the TP order rotates), `batch` prompts of --prompt-len ids and --steps + 1 greedy
tokens, and times each engine.step() after the first (each one decode step). A
row gives the median over rounds of each round's median step; "added" is TP N
minus TP 1 of the same round.

Where the added time goes, each piece measured on its own and added up per step
(rounds interleaved with the engine's):
  tell   the leader's TpGroup.tell of each decode forward, timed inside the engine
         (the leader's own time, sending the encoded inputs to the other ranks);
  word   a standalone group of the same size (engines.tp.group.join, same threads):
         the leader tells a real decode's inputs, every other rank hears it and
         does nothing with it, then all meet in an all_reduce of one float; minus
         that all_reduce alone: how late the other ranks start their forward
         (beside it the same for one 8-byte broadcast: `tell` makes two);
  reduce one TpGroup.all_reduce of a [batch, hidden] float32 tensor in that
         group, x 2 per layer (after attention's o and the MLP's down projection).
A rank's compute at TP N is its share of the heads and MLP, so "accounted" is
not meant to equal "added" to the microsecond: the gap is the part of a step this
split does not name (the compute saved, the ranks' imbalance, scheduling).

Transfer (bench/tp_transfer.py): one `zpd launch --prefill-tp P --decode-tp D
--threads 1` cluster per --pairs entry, all started at once; each round sends every
cluster (in rotating order) the same --prompts prompts of --prompt-tokens ids with
max_new_tokens 1, one at a time, so each KV write has the link to itself. Per pair:
the answers' `kv_transfer` ms (the transport's write until its completion; a
mismatched pair's staging copy comes before it and is not in it), MB/s = the
prefill's kv_bytes_written / kv_transfer_seconds counters over the round, and the
prefill's forward. The writes per page are the planner's (engines/tp/transfer.py
TransferPlanner.plan and zpd/worker/writes.py transfer_runs, run in this process on
the same model's rank pools): the workers do not expose the runs they write, so
they are computed for one prompt's pages both consecutive on each side (a fresh
pool's) and scattered (no two adjacent: the most runs), with `plan`'s time, which
is the staging copy where the heads differ. --quick skips the clusters.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log_step, med, random_prompts, wait_quiet  # noqa: E402
from tp_transfer import cluster_rounds, print_transfer  # noqa: E402

from engines.loader import load_model  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402
from engines.tp import words as word_codec  # noqa: E402
from engines.tp.group import Rendezvous, TpGroup, join  # noqa: E402
from engines.tp.spawn import lead, stop  # noqa: E402

MODEL = "tiny"
HIDDEN, REDUCES = 64, 4      # the tiny model's hidden size; 2 all-reduces x 2 layers


# --- the engine at each TP size --------------------------------------------------------

class Clock:
    """Wraps one method of the leader's TpGroup (tell, all_reduce): each call's seconds,
    and the last decode forward's word per batch size (the standalone group sends it)."""

    def __init__(self, tp: TpGroup, name: str) -> None:
        self.real, self.times = getattr(tp, name), []
        self.words: dict[int, tuple] = {}
        setattr(tp, name, self)

    def __call__(self, *args: object):
        t = time.perf_counter()
        out = self.real(*args)
        self.times.append(time.perf_counter() - t)
        if args[:2] == ("forward", "decode"):
            self.words[len(args[2][0])] = args
        return out


class TpEngine:
    """One OfflineEngine over `size` ranks (size 1: no group)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tp = self.procs = None
        self.clocks: dict[str, Clock] = {}
        if size == 1:
            model = load_model(MODEL, "cpu", "float32", None, None)
        else:
            model, self.tp, self.procs = lead(MODEL, "cpu", "float32", None, None, size, threads=size)
            self.clocks = {name: Clock(self.tp, name) for name in ("tell", "all_reduce")}
        self.engine = OfflineEngine(model, kv_cache_mb=64, page_size=16, tp=self.tp)

    def steps(self, batch: int, prompt_len: int, steps: int, seed: int) -> dict[str, list[float]]:
        """Seconds of each decode step after the first ("step"), the CPU seconds of this
        thread in it ("cpu"), and of the leader's tells and all-reduces in it."""
        params = SamplingParams(temperature=0, max_new_tokens=steps + 1, ignore_eos=True)
        for i, p in enumerate(random_prompts(batch, prompt_len, 256, seed)):
            self.engine.submit(Request(f"s{seed}-{i}", p, params))
        self.engine.step()                    # the prefill and the first decode step
        got: dict[str, list[float]] = {k: [] for k in ("step", "cpu", *self.clocks)}
        while len(self.engine.batch):
            before = {k: len(c.times) for k, c in self.clocks.items()}
            t, cpu = time.perf_counter(), time.thread_time()
            self.engine.step()
            got["step"].append(time.perf_counter() - t)
            got["cpu"].append(time.thread_time() - cpu)
            for k, c in self.clocks.items():
                got[k].append(sum(c.times[before[k]:]))
        return got

    def stop(self) -> None:
        if self.tp is not None:
            stop(self.tp, self.procs)


# --- a standalone group: the word and the all-reduce alone ---------------------------------

# Micro's own orders (a broadcast of 4 int64: order, rows, columns, n), apart from the
# engine's words, which name only what a rank of a worker does (engines/tp/words.py).
STOP, REDUCE, PING_WORD, PING_BCAST = range(4)


def _order(tp: TpGroup, *order: int) -> tuple[int, ...]:
    x = torch.tensor(list(order) or [0, 0, 0, 0], dtype=torch.int64)
    tp.words.broadcast(x, 0).wait()
    return tuple(int(v) for v in x)


def _micro_follower(rank: int, size: int, rendezvous: str) -> None:
    """The other ranks' side of Micro: each order of the leader says what to do next."""
    torch.set_num_threads(1)
    tp = join(rank, size, rendezvous)
    while True:
        op, rows, cols, n = _order(tp)
        if op == STOP:
            return
        if op == REDUCE:
            for _ in range(n):
                tp.all_reduce(torch.zeros(rows, cols))
        else:
            whole = op == PING_WORD
            for _ in range(n):
                if whole:
                    tp.hear()
                else:
                    one_broadcast(tp)
                tp.all_reduce(torch.zeros(1))


def one_broadcast(tp: TpGroup) -> None:
    """The smallest word there is: one broadcast of 8 bytes (`tell` makes two: the
    word's length, then the word)."""
    tp.words.broadcast(torch.zeros(1, dtype=torch.int64), 0).wait()


class Micro:
    """A group of `size` ranks (this process rank 0, one torch thread each) that time
    the word and the all-reduce with nothing else in a step."""

    def __init__(self, size: int) -> None:
        self.meeting = Rendezvous()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_micro_follower, args=(r, size, self.meeting.path),
                                  daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()
        self.tp = join(0, size, self.meeting.path)

    def reduce(self, shape: tuple[int, ...], n: int) -> float:
        """Median seconds of one all_reduce of a float32 tensor of `shape` ([rows, cols])."""
        _order(self.tp, REDUCE, *shape, n)
        x, times = torch.zeros(shape), []
        for _ in range(n):
            t = time.perf_counter()
            self.tp.all_reduce(x)
            times.append(time.perf_counter() - t)
        return med(times)

    def ping(self, word: tuple | None, n: int) -> float:
        """Median seconds of the leader telling `word` (None: one_broadcast) and all
        ranks then meeting."""
        _order(self.tp, PING_WORD if word is not None else PING_BCAST, 0, 0, n)
        one, times = torch.zeros(1), []
        for _ in range(n):
            t = time.perf_counter()
            if word is not None:
                self.tp.tell(*word)
            else:
                one_broadcast(self.tp)
            self.tp.all_reduce(one)
            times.append(time.perf_counter() - t)
        return med(times)

    def stop(self) -> None:
        _order(self.tp, STOP, 0, 0, 0)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        self.meeting.close()


# --- rounds ---------------------------------------------------------------------------

def engine_rounds(args: argparse.Namespace) -> dict:
    """Per (figure, tp, batch): one value per round (ms; "word kB" in kB)."""
    sizes, batches = args.tp, args.batches
    engines = {n: TpEngine(n) for n in sizes}
    micros = {n: Micro(n) for n in sizes if n > 1}
    figs: dict = {}

    def put(key: str, n: int, b: int, v: float, scale: float = 1e3) -> None:
        figs.setdefault((key, n, b), []).append(v * scale)
    try:
        for n in sizes:                                           # warm-up, not counted
            for b in batches:
                engines[n].steps(b, args.prompt_len, 2, seed=1)
        for r in range(args.rounds):
            wait_quiet(args.quiet_wait)
            for n in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                for b in batches:
                    for key, times in engines[n].steps(b, args.prompt_len, args.steps, 100 + r).items():
                        put(key, n, b, med(times))
                    if n > 1:
                        standalone(micros[n], engines[n].clocks["tell"].words[b], b, args, put)
            log_step(f"round {r + 1}: " + ", ".join(
                f"TP{n} b{b} {figs[('step', n, b)][-1]:.3f} ms" for n in sizes for b in batches))
    finally:
        for m in micros.values():
            m.stop()
        for e in engines.values():
            e.stop()
    return figs


def standalone(micro: Micro, word: tuple, b: int, args: argparse.Namespace, put) -> None:
    n, alone = micro.tp.size, micro.reduce((1, 1), args.micro_iters)
    put("late", n, b, micro.ping(word, args.micro_iters) - alone)
    put("bcast", n, b, micro.ping(None, args.micro_iters) - alone)
    put("reduce", n, b, REDUCES * micro.reduce((b, HIDDEN), args.micro_iters))
    put("word kB", n, b, len(word_codec.encode(word[0], word[1:])), 1e-3)


ROWS = (("in the engine (the leader's clocks):", None),
        ("  step", "step"),
        ("  the leader's CPU time in it (main thread)", "cpu"),
        ("  tell of the forward", "tell"),
        ("  inside the 4 all-reduces (incl. waiting)", "all_reduce"),
        ("  the rest (its share of the model, sampling)", "rest"),
        ("standalone group of the same size:", None),
        ("  word round trip - all-reduce of 1 float", "late"),
        ("  one 8-byte broadcast's, the same way", "bcast"),
        ("  4 all-reduces of [batch, 64]", "reduce"),
        ("  word encoded, kB", "word kB"))


def print_engine(figs: dict, args: argparse.Namespace) -> None:
    sizes, batches = args.tp, args.batches
    m = {k: med(v) for k, v in figs.items()}
    for n in (n for n in sizes if n > 1):
        for b in batches:
            m[("rest", n, b)] = m[("step", n, b)] - m[("tell", n, b)] - m[("all_reduce", n, b)]
    print(f"\nDecode step, tiny model, 1 torch thread per rank: ms/step, medians of {args.rounds} "
          f"rounds x {args.steps} steps (prompt {args.prompt_len} ids)")
    print(f"{'batch':>6}" + "".join(f"{'TP ' + str(n):>10}" for n in sizes)
          + "".join(f"{'added TP ' + str(n):>14}" for n in sizes if n > 1)
          + "".join(f"{'CPU TP ' + str(n):>10}" for n in sizes))
    for b in batches:
        added = [med([x - y for x, y in zip(figs[("step", n, b)], figs[("step", 1, b)])])
                 for n in sizes if n > 1] if 1 in sizes else []
        print(f"{b:>6}" + "".join(f"{m[('step', n, b)]:>10.3f}" for n in sizes)
              + "".join(f"{a:>14.3f}" for a in added)
              + "".join(f"{m[('cpu', n, b)]:>10.3f}" for n in sizes))
    for n in (n for n in sizes if n > 1):
        print(f"\nTP {n}, ms per step{'':<30}" + "".join(f"{'batch ' + str(b):>10}" for b in batches))
        for label, key in ROWS:
            print(f"{label:<48}" + ("" if key is None else
                                    "".join(f"{m[(key, n, b)]:>10.3f}" for b in batches)))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]   # noqa: E731
    ap.add_argument("--tp", type=ints, default=[1, 2, 4], help="TP sizes, comma-separated")
    ap.add_argument("--batches", type=ints, default=[1, 16])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per (TP, batch, round)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro-iters", type=int, default=200, help="iterations of each standalone timing")
    ap.add_argument("--quiet-wait", type=float, default=2.0,
                    help="seconds to wait for an idle machine before each round (0: none)")
    pairs = lambda s: [tuple(int(x) for x in pair.split(":")) for pair in s.split(",")]   # noqa: E731
    ap.add_argument("--pairs", type=pairs, default=[(1, 1), (2, 2), (2, 1), (1, 2)],
                    help="transfer: prefill TP:decode TP pairs, comma-separated")
    ap.add_argument("--prompts", type=int, default=16, help="transfer: prompts per pair per round")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--no-cluster", action="store_true", help="skip the clusters (the planner's figures only)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine's figures")
    ap.add_argument("--quick", action="store_true",
                    help="smoke mode: seconds, not figures; no cluster (starting them takes ~10 s)")
    args = ap.parse_args()
    if args.quick:
        args.tp, args.steps, args.rounds, args.micro_iters, args.quiet_wait = [1, 2], 4, 1, 20, 0
        args.no_cluster = True
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if not args.no_engine:
        print_engine(engine_rounds(args), args)
    figs, shown = (None, "") if args.no_cluster else cluster_rounds(args.pairs, args)
    print_transfer(args.pairs, load_model(MODEL, "cpu", "float32", None, None).cfg, args, figs, shown)


if __name__ == "__main__":
    main()
