"""bench_http.py --cpu: what the HTTP front costs per token, CPU seconds of the `zpd
http` process from /proc, at saturation, over simulated null-model workers
(bench/sim_workers.py: --decodes decodes at --step-ms steps, one prefill), a real
`zpd router` and one `zpd http` per variant: this tree's and, with --baseline REV,
the front of that revision (`git archive`, run from its own directory), both on the
same router and pool, measured in turns (old, new, old, new, ...) so a burst of
other work on the shared machine falls on both.

Loads (closed loop: --streams connections, each sending its next request as its
last ends, as a pooled client does; --cpu-tokens new tokens each, fresh random
prompts):

- generate: streamed POST /generate, SGLang's default events (each carries the
  output so far);
- incremental: the same through a front with --incremental-streaming-output (a
  third process per variant);
- chat: streamed POST /v1/chat/completions (deltas);
- whole: POST /generate without streaming (the answer comes at the end).

For each, the front's CPU over the round (the drain of the last requests included)
divided by the tokens its answers carried, the events per token it wrote (1.0: one
event per token; less: several tokens per event, which a front that falls behind
or a decode step of several tokens gives), and the tokens/s. Every answer is
checked against the null model's tokens (`predict`): a variant that got tokens
wrong or lost is reported, never averaged in.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import SSEConnection  # noqa: E402
from common import ROOT, cpu_seconds  # noqa: E402
from cp_procs import Proc, SimPool, router_argv  # noqa: E402
from engines.models.null import predict  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
LOADS = ("generate", "incremental", "chat", "whole")


class Front(Proc):
    """One `zpd http` process, run from `tree` (this repository or an old revision's
    files): its own directory goes first on sys.path."""

    def __init__(self, tree: Path, router: str, tmp: Path, name: str, extra: list[str],
                 profile: str = "") -> None:
        run = "runpy.run_module('zpd', run_name='__main__', alter_sys=True)"
        boot = f"import cProfile, runpy, sys; sys.path[:0] = [{str(tree)!r}]; " + \
            (f"cProfile.run({run!r}, {profile!r})" if profile else run)
        super().__init__([sys.executable, "-c", boot, "http", "--router", router, "--model",
                          "null", "--port", "0", "--chat-template", TEMPLATE, *extra], tmp, name)


def old_tree(rev: str, tmp: Path) -> Path:
    """Revision `rev`'s zpd and engines, extracted under `tmp`."""
    out = tmp / f"tree-{rev.replace('/', '_')}"
    out.mkdir()
    archive = subprocess.run(["git", "archive", rev, "zpd", "engines"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


@dataclass
class Tally:
    """One round of one load: requests, tokens, events, and what went wrong."""
    requests: int = 0
    tokens: int = 0
    events: int = 0
    wrong: list[str] = field(default_factory=list)


class Load:
    """--streams connections in a closed loop against one front, for one load."""

    def __init__(self, endpoint: str, kind: str, tokens: int, prompt_len: int, seed: int) -> None:
        self.endpoint, self.kind, self.max_new = endpoint, kind, tokens
        self.rng, self.prompt_len = random.Random(seed), prompt_len
        self.tally = Tally()

    def body(self, prompt: list[int]) -> tuple[str, bytes]:
        sampling = {"max_new_tokens": self.max_new, "temperature": 0, "ignore_eos": True}
        if self.kind == "chat":
            text = bytes(prompt).decode("latin-1")
            return "/v1/chat/completions", orjson.dumps({
                "model": "null", "messages": [{"role": "user", "content": text}],
                "max_tokens": self.max_new, "temperature": 0, "ignore_eos": True,
                "stream": True})
        return "/generate", orjson.dumps({"input_ids": prompt, "sampling_params": sampling,
                                          "stream": self.kind != "whole"})

    async def one(self, conn: SSEConnection) -> None:
        prompt = [self.rng.randrange(32, 127) for _ in range(self.prompt_len)]
        path, body = self.body(prompt)
        events: list[bytes] = []
        await conn.post(path, body, events.append)
        if self.kind == "whole":
            got = orjson.loads(events.pop())
            ids, text = got["output_ids"], got["text"]
        else:
            ids, text = self.read_events(events)
        # the sim pool answers a chat's messages as a prompt of no ids
        want = predict([] if self.kind == "chat" else prompt, self.max_new)
        t = self.tally
        t.requests, t.tokens, t.events = t.requests + 1, t.tokens + len(want), t.events + len(events)
        if (ids is not None and ids != want) or text != bytes(want).decode("latin-1"):
            t.wrong.append(f"{self.kind}: {text[:40]!r}... for {bytes(want[:40])!r}...")

    def read_events(self, events: list[bytes]) -> tuple[list[int] | None, str]:
        """A stream's ids (None for chat) and text, as a client reads them."""
        datas = [line[6:] for e in events for line in e.split(b"\n\n")
                 if line.startswith(b"data: {")]
        if self.kind == "generate":              # each event: the output so far
            last = orjson.loads(datas[-1])
            return last["output_ids"], last["text"]
        parsed = [orjson.loads(d) for d in datas]
        if self.kind == "incremental":
            return [i for p in parsed for i in p["output_ids"]], "".join(p["text"] for p in parsed)
        return None, "".join(p["choices"][0]["delta"].get("content") or "" for p in parsed)

    async def run(self, streams: int, duration: float) -> Tally:
        conns = [await SSEConnection.open(self.endpoint) for _ in range(streams)]
        stop = time.monotonic() + duration

        async def loop(conn: SSEConnection) -> None:
            while time.monotonic() < stop:
                await self.one(conn)
        try:
            await asyncio.gather(*(loop(c) for c in conns))
        finally:
            for c in conns:
                c.transport.close()
        return self.tally


def measure(front: Front, kind: str, args, seed: int) -> dict:
    before = cpu_seconds(front.pid)
    t0 = time.monotonic()
    tally = asyncio.run(Load(front.info["endpoint"], kind, args.cpu_tokens, 16, seed)
                        .run(args.streams, args.duration))
    wall = time.monotonic() - t0
    time.sleep(0.05)
    cpu = cpu_seconds(front.pid) - before
    return {"us_per_token": cpu / max(1, tally.tokens) * 1e6, "tok_per_s": tally.tokens / wall,
            "events_per_token": tally.events / max(1, tally.tokens), "cores": cpu / wall,
            "requests": tally.requests, "wrong": tally.wrong}


def run_cpu(args) -> int:
    loads = [x for x in args.loads.split(",") if x]
    bad = [x for x in loads if x not in LOADS]
    if bad:
        raise SystemExit(f"--loads: unknown {bad} (known: {', '.join(LOADS)})")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        trees = {"new": ROOT} | ({"old": old_tree(args.baseline, tmp)} if args.baseline else {})
        pool = SimPool(tmp, args.decodes, 1, args)
        procs: list[Proc] = [pool]
        try:
            router = Proc(router_argv(pool.info["prefill"], pool.info["decode"], []), tmp, "router")
            procs.append(router)
            fronts: dict[tuple[str, bool], Front] = {}
            for name, tree in trees.items():
                for inc in (False, True) if "incremental" in loads else (False,):
                    label = f"{name}{'-inc' if inc else ''}"
                    fronts[name, inc] = Front(tree, router.info["endpoint"], tmp, f"front-{label}",
                                              ["--incremental-streaming-output"] if inc else [],
                                              f"{args.profile}.{label}" if args.profile else "")
                    procs.append(fronts[name, inc])
            for f in fronts.values():               # connections up, code warm
                measure(f, "chat" if "chat" in loads else "whole", _short(args), 0)
            rows: dict[tuple[str, str], list[dict]] = {}
            for r in range(args.rounds):
                for kind in loads:
                    for name in reversed(trees) if r % 2 else trees:
                        got = measure(fronts[name, kind == "incremental"], kind, args, r)
                        rows.setdefault((kind, name), []).append(got)
                        print(f"  round {r + 1} {kind:<11} {name}: {got['us_per_token']:6.2f} us/token "
                              f"{got['events_per_token']:5.3f} events/token {got['tok_per_s']:8.0f} tok/s"
                              + (f"  WRONG {len(got['wrong'])}: {got['wrong'][0]}" if got["wrong"] else ""),
                              flush=True)
        finally:
            for p in reversed(procs):
                p.stop()
    report(rows, trees, loads, args)
    return 1 if any(g["wrong"] for v in rows.values() for g in v) else 0


def _short(args):
    from argparse import Namespace
    return Namespace(**vars(args) | {"duration": 0.5, "cpu_tokens": 16})


def report(rows: dict, trees: dict, loads: list[str], args) -> None:
    print(f"\nfront CPU per token: {args.streams} streams x {args.cpu_tokens} tokens, "
          f"{args.decodes} sim decodes at {args.step_ms:g} ms steps; median (min-max) of "
          f"{args.rounds} rounds of {args.duration:g} s")
    print(f"{'load':<12}" + "".join(f"{name + ' us/token':>24}{'ev/tok':>7}{'tok/s':>8}"
                                    for name in trees))
    for kind in loads:
        line = f"{kind:<12}"
        for name in trees:
            got = rows[kind, name]
            us = [g["us_per_token"] for g in got]
            line += f"{statistics.median(us):>10.2f} ({min(us):5.2f}-{max(us):5.2f})" \
                    f"{statistics.median(g['events_per_token'] for g in got):>7.3f}" \
                    f"{statistics.median(g['tok_per_s'] for g in got):>8.0f}"
        print(line)
