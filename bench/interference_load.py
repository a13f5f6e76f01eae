"""bench_interference.py's load: what both sides send and when (Plan, Traffic), and
the two runners, each recording every token's time (Record, Run)."""
from __future__ import annotations

import argparse
import math
import time
from collections import deque
from dataclasses import dataclass, field

from common import random_prompts
from engines.loader import LoadedModel
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from zpd.client import Client, NoAnswerError


# --- the load -------------------------------------------------------------------------

@dataclass
class Record:
    """One request of a run and the times its tokens arrived."""
    rid: str
    kind: str                          # "steady" or "long"
    prompt: list[int]
    new_tokens: int
    submitted: float
    stream: int | None = None
    stamps: list[float] = field(default_factory=list)
    done: bool = False

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def sampling(self) -> dict:
        return {"temperature": 0, "max_new_tokens": self.new_tokens, "ignore_eos": True}


@dataclass
class Plan:
    """What both sides send: the steady streams' requests and the long prompts' offsets."""
    args: argparse.Namespace
    vocab: int
    duration: float
    long_at: list[float]
    long_prompts: list[list[int]]

    @classmethod
    def make(cls, args: argparse.Namespace, vocab: int, duration: float, with_long: bool = True) -> "Plan":
        first = args.long_every / 2
        n = max(0, int((duration - first) // args.long_every)) if with_long else 0
        return cls(args, vocab, duration, [first + i * args.long_every for i in range(n)],
                   random_prompts(n, args.long_len, vocab, args.seed + 1))

    def steady(self, k: int, n: int) -> tuple[list[int], int]:
        """Prompt and new tokens of stream k's n-th request."""
        a = self.args
        tokens = max(2, a.steady_tokens * (k + 1) // a.streams) if n == 0 else a.steady_tokens
        return random_prompts(1, a.steady_len, self.vocab, f"{a.seed}/{k}/{n}")[0], tokens


class Traffic:
    """When to send what, during one run: each long prompt at its offset, and a new
    request for every steady stream that has none running."""

    def __init__(self, plan: Plan, start: float, tag: str) -> None:
        self.plan, self.start, self.tag = plan, start, tag
        self.idle, self.sent, self.next_long = deque(range(plan.args.streams)), {}, 0
        self.records: list[Record] = []

    def due(self, now: float) -> list[Record]:
        out = []
        while self.next_long < len(self.plan.long_at) and self.at(self.next_long) <= now:
            i = self.next_long
            out.append(Record(f"{self.tag}-L{i}", "long", self.plan.long_prompts[i],
                              self.plan.args.long_tokens, self.at(i)))
            self.next_long += 1
        while self.idle:
            k = self.idle.popleft()
            n = self.sent[k] = self.sent.get(k, -1) + 1
            prompt, tokens = self.plan.steady(k, n)
            out.append(Record(f"{self.tag}-S{k}.{n}", "steady", prompt, tokens, now, stream=k))
        self.records += out
        return out

    def at(self, i: int) -> float:
        return self.start + self.plan.long_at[i]

    def wait(self, now: float) -> float:
        """Seconds until the next long prompt is due (inf when none is left)."""
        if self.next_long >= len(self.plan.long_at):
            return math.inf
        return max(0.0, self.at(self.next_long) - now)

    def finished(self, rec: Record) -> None:
        rec.done = True
        if rec.stream is not None:
            self.idle.append(rec.stream)

    def run(self) -> "Run":
        return Run(self.start, self.plan.duration, self.records, self.plan.long_at)


@dataclass
class Run:
    """Every request a run sent; long_at: the long prompts' offsets into it, s."""
    start: float
    duration: float
    records: list[Record]
    long_at: list[float]
    others_cores: float = float("nan")


# --- colocated: the `zpd run` engine in this process -----------------------------------

def run_colocated(model: LoadedModel, plan: Plan, args: argparse.Namespace) -> Run:
    engine = OfflineEngine(model, kv_cache_mb=args.kv_cache_mb, max_batch=args.max_batch)
    start = time.monotonic()
    traffic, live = Traffic(plan, start, "co"), {}
    while (now := time.monotonic()) < start + plan.duration:
        for rec in traffic.due(now):
            req = Request(rec.rid, rec.prompt, SamplingParams.from_dict(rec.sampling()))
            engine.submit(req)
            live[rec.rid] = rec, req
        engine.step()
        now = time.monotonic()
        for rid, (rec, req) in list(live.items()):
            rec.stamps += [req.first_token_at if k == 0 else now
                           for k in range(len(rec.stamps), len(req.output))]
            if req.finished:
                del live[rid]
                traffic.finished(rec)
    return traffic.run()


# --- 1P1D: `zpd launch` -----------------------------------------------------------------

def run_disagg(router: str, plan: Plan, args: argparse.Namespace, tag: str = "pd") -> Run:
    with Client(router, timeout=args.timeout) as client:
        start = time.monotonic()
        end = start + plan.duration
        traffic, live = Traffic(plan, start, tag), {}
        while (now := time.monotonic()) < end:
            for rec in traffic.due(now):
                client.submit(input_ids=rec.prompt, sampling_params=rec.sampling(), rid=rec.rid,
                              stream=True)
                live[rec.rid] = rec
            chunk = receive(client, min(traffic.wait(now), end - now))
            if chunk is None or chunk["rid"] not in live:
                continue
            rec = live[chunk["rid"]]
            rec.stamps += [time.monotonic()] * len(chunk["token_ids"])
            if chunk["finished"]:
                if chunk["finish_reason"].get("type") != "length":
                    raise RuntimeError(f"{rec.rid} ended with {chunk['finish_reason']}")
                traffic.finished(live.pop(rec.rid))
        cut(client, live)
        return traffic.run()


def receive(client: Client, wait_s: float) -> dict | None:
    """The next chunk, or None if none came within wait_s."""
    try:
        return client.receive(timeout=max(0.001, wait_s))
    except NoAnswerError:
        raise
    except TimeoutError:
        return None


def cut(client: Client, live: dict[str, Record]) -> None:
    """Abort what is still running at the end and wait until each has finished."""
    for rid in live:
        client.abort(rid, "benchmark run over")
    while live:
        chunk = client.receive(timeout=30)
        if chunk["finished"]:
            live.pop(chunk["rid"], None)
