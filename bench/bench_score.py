"""Scoring throughput: prompts scored with `max_new_tokens: 0` (every prompt position's
logprob, from the prefill alone) next to a plain prefill of the same prompts, on one
1P1D `zpd launch` cluster, side by side in one run; and the same two calls of the
engine (ModelRunner.prefill vs prefill_with_logprobs) in this process.

    python bench/bench_score.py [--prompts 256] [--tokens 512] [--model tiny|deep|smollm2|DIR]
                                [--rounds 3] [--quiet-wait 10] [--quick]

Cluster: `zpd launch --prefill 1 --decode 1 --threads 1 --no-prefix-cache` (the sides
share their prompts: with the cache on, the second side of a round would find them
cached). Each round sends every prompt at once on one zpd.Client, once as a scoring
request (max_new_tokens 0, return_logprob, logprob_start_len 0: the router sends it
to the prefill alone) and once as a plain one (max_new_tokens 1, no logprobs: the
prefill, its KV write and one token from the decode), alternating which side goes
first, fresh prompts each round; before each side the script waits up to
--quiet-wait s for the machine to go idle. Prompt tokens/s = prompts x tokens / wall
(first submit to last answer). The table gives medians over rounds; "prefill compute
s" is the prefill's own forward time (its status counters), and the CPU seconds are
each process's. Target: scoring >= 0.9x the plain prefill's prompt tokens/s (the
issue counts the logits projection over the vocabulary as the only extra work; the
work count below adds the last layer's).
The scores are checked against this process's engine on the first prompts.

Engine: the same prompts in batches the size the prefill worker forms (its
--max-prefill-tokens, 8192 tokens), each batch timed with prefill and with
prefill_with_logprobs from position 0, alternately, one torch thread; prompt tokens/s
is the median of the batches', per CPU second of this process (on a shared machine
the wall clock also counts the other processes' turns). The peak memory of the
logits chunking (engines/prompt_logprobs.py: chunks of at most 64 MiB of logits) is
what torch's profiler sees allocated during prompt_logprobs on one batch, above what
was allocated when it began; beside it, the same with every row in one chunk.

The default model is the embedded "tiny" one (2 layers, hidden 64, vocab 258), where
the control plane outweighs the model; --model smollm2 (30 layers, vocab 49152) is
where the logits projection costs most against the prefill. --model deep is a random
Llama written for the run (engines/models/tiny.py save_tiny: 16 layers, hidden 256, 4
heads over 2 KV heads, MLP 512, tiny's 258-token byte vocabulary; 32 prompts unless
--prompts says), where the issue's premise holds: the work scoring adds is a few %.
What scoring must add is counted and printed beside the ratio: the multiply-adds of
the last layer's attention, o_proj and MLP for every position but the last (a plain
prefill runs them for each prompt's last token alone) and of the vocabulary projection
for every position, against a plain prefill's per token; plain / (plain + added) is the
ratio that work alone allows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Launch, cpu_seconds, log_step, med, random_prompts, wait_quiet  # noqa: E402

import engines.prompt_logprobs as pl  # noqa: E402
import engines.runner  # noqa: E402
from engines.kv.layout import KVLayout  # noqa: E402
from engines.kv.pool import KVPool  # noqa: E402
from engines.loader import LoadedModel, load_model  # noqa: E402
from engines.config import ModelConfig  # noqa: E402
from engines.models.tiny import TINY_CONFIG, save_tiny  # noqa: E402
from engines.runner import ModelRunner  # noqa: E402
from zpd.client import Client  # noqa: E402
from zpd.config import WorkerConfig  # noqa: E402

SIDES = ("score", "plain")
SAMPLING = {"score": {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0},
            "plain": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
CHECKED = 4                                  # prompts whose scores are checked against the engine
CHECK_TOLERANCE = 1e-3                       # float32, other batch shapes: rounding only
# --model deep: many layers, a vocabulary small against the hidden size.
DEEP = TINY_CONFIG | {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 16,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
DEEP_PROMPTS = 32                            # a run in ~1 minute on 2 busy cores


# --- the cluster ------------------------------------------------------------------------

def launch(model: str, args: argparse.Namespace, tmp: Path) -> Launch:
    return Launch(tmp, model, ["--dtype", "float32", "--threads", "1", "--no-prefix-cache",
                               "--kv-cache-mb", str(args.kv_cache_mb), "--max-batch", str(args.prompts),
                               "--kv-wait-timeout", f"{args.timeout:g}", "--log-level", "WARNING"])


def prefill_seconds(client: Client) -> float:
    return sum(w.get("counters", {}).get("prefill_forward_seconds", 0.0)
               for w in client.admin("status")["workers"] if w["role"] == "prefill")


def load(client: Client, prompts: list[list[int]], side: str, tag: str, timeout: float
         ) -> tuple[float, dict[int, dict]]:
    """Every prompt at once; wall s and each prompt's final meta."""
    rids = {f"{tag}-{side}-{i}": i for i in range(len(prompts))}
    t0 = time.perf_counter()
    for rid, i in rids.items():
        client.submit(input_ids=prompts[i], rid=rid, sampling_params=SAMPLING[side])
    metas: dict[int, dict] = {}
    while len(metas) < len(rids):
        chunk = client.receive(timeout)
        if chunk["rid"] not in rids or not chunk["finished"]:
            continue
        finish = chunk["finish_reason"] or {}
        if finish.get("type") not in ("length", "stop"):
            raise RuntimeError(f"{side} request {chunk['rid']} ended with {finish}")
        metas[rids[chunk["rid"]]] = chunk["meta"]
    return time.perf_counter() - t0, metas


def measure(cluster: Launch, client: Client, prompts: list[list[int]], side: str, tag: str,
            args: argparse.Namespace) -> tuple[dict[str, float], dict[int, dict]]:
    wait_quiet(args.quiet_wait)
    cpu0, forward0 = {k: cpu_seconds(p) for k, p in cluster.pids.items()}, prefill_seconds(client)
    wall, metas = load(client, prompts, side, tag, args.timeout)
    tokens = sum(map(len, prompts))
    figures = {"prompt tok/s": tokens / wall, "wall s": wall,
               "prefill compute s": prefill_seconds(client) - forward0}
    for k, pid in cluster.pids.items():
        figures[f"{k} CPU s"] = cpu_seconds(pid) - cpu0[k]
    return figures, metas


def check_scores(metas: dict[int, dict], prompts: list[list[int]], reference: list) -> float:
    """Every answer has one entry per prompt token, the first null; the first prompts'
    logprobs are the engine's (max difference returned)."""
    worst = 0.0
    for i, p in enumerate(prompts):
        entries = metas[i].get("input_token_logprobs")
        if entries is None or [t for _, t in entries] != p or entries[0][0] is not None:
            raise RuntimeError(f"prompt {i}: input_token_logprobs {str(entries)[:200]}")
        if i < len(reference):
            got = torch.tensor([v for v, _ in entries[1:]], dtype=torch.float64)
            worst = max(worst, float((got - torch.tensor(reference[i].token_logprobs)).abs().max()))
    return worst


def cluster_rounds(model: str, vocab: int, engine: "Engine", args: argparse.Namespace, tmp: Path
                   ) -> tuple[dict[str, list[dict]], float, str]:
    """Both sides each round, alternating which goes first; per side its figures per
    round, the largest score difference from the engine, the cluster's command line."""
    cluster = launch(model, args, tmp)
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    worst = 0.0
    try:
        with Client(cluster.router, timeout=args.timeout) as client:
            warm = random_prompts(2, args.tokens, vocab, seed=7)
            for side in SIDES:
                load(client, warm, side, "warm", args.timeout)
            for r in range(args.rounds):
                prompts = random_prompts(args.prompts, args.tokens, vocab, seed=1000 + r)
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    figures, metas = measure(cluster, client, prompts, side, f"r{r}", args)
                    runs[side].append(figures)
                    log_step(f"round {r + 1} {side}: {figures['prompt tok/s']:.0f} prompt tok/s")
                    if side == "score":
                        worst = max(worst, check_scores(metas, prompts, engine.scores(prompts[:CHECKED])))
    finally:
        cluster.stop()
    return runs, worst, cluster.shown.replace(str(tmp), "$TMP")


# --- the engine in this process --------------------------------------------------------------

class Engine:
    """ModelRunner over a pool that holds one batch of the prefill worker's size."""

    def __init__(self, model: LoadedModel, args: argparse.Namespace) -> None:
        self.model = model
        self.batch = max(1, min(args.prompts, WorkerConfig.max_prefill_tokens // args.tokens))
        layout = KVLayout.for_model(model.cfg, 16, model.dtype)
        pages = -(-args.tokens // 16)
        self.pool = KVPool(layout, self.batch * pages, model.dtype, model.device)
        self.runner = ModelRunner(model, self.pool)
        self.tables = [list(range(i * pages, (i + 1) * pages)) for i in range(self.batch)]

    def batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        return [prompts[i:i + self.batch] for i in range(0, len(prompts), self.batch)]

    @torch.inference_mode()
    def run(self, batch: list[list[int]], side: str):
        tables = self.tables[:len(batch)]
        if side == "plain":
            return self.runner.prefill(batch, tables)
        return self.runner.prefill_with_logprobs(batch, tables, None, [0] * len(batch))[1]

    def scores(self, prompts: list[list[int]]) -> list:
        return [s for b in self.batches(prompts) for s in self.run(b, "score")]

    def timed(self, prompts: list[list[int]], repeats: int) -> dict[str, float]:
        """Prompt tokens per CPU second of each side (this process's, one torch
        thread: what other processes take of the machine does not count), batch by
        batch, alternating which goes first; the median of the batches'."""
        rates: dict[str, list[float]] = {s: [] for s in SIDES}
        batches = self.batches(prompts)
        for side in SIDES:                                                     # warm-up
            self.run(batches[0], side)
        for r in range(repeats):
            for k, batch in enumerate(batches):
                for side in SIDES if (r + k) % 2 == 0 else SIDES[::-1]:
                    t = time.process_time()
                    self.run(batch, side)
                    rates[side].append(sum(map(len, batch)) / (time.process_time() - t))
        return {side: med(rates[side]) for side in SIDES}

    def chunking_peak(self, batch: list[list[int]], chunk_bytes: int) -> float:
        """Bytes torch allocated at most during prompt_logprobs on `batch`, above what
        was allocated when it began, with chunks of at most chunk_bytes of logits."""
        real, kept, peaks = pl.prompt_logprobs, pl.LOGITS_CHUNK_BYTES, []

        def profiled(*a, **kw):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        profile_memory=True) as prof:
                out = real(*a, **kw)
            peaks.append(_peak(prof))
            return out
        engines.runner.prompt_logprobs, pl.LOGITS_CHUNK_BYTES = profiled, chunk_bytes
        try:
            self.run(batch, "score")
        finally:
            engines.runner.prompt_logprobs, pl.LOGITS_CHUNK_BYTES = real, kept
        return peaks[0]


def _peak(prof) -> float:
    """The profile's largest CPU allocation total above the total before its first event."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                 key=lambda e: e["ts"])
    if not mem:
        return float("nan")
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - start


# --- the report ----------------------------------------------------------------------------

def added_work(cfg: ModelConfig, tokens: int) -> tuple[float, float, float]:
    """Multiply-adds per prompt token: a plain prefill's, and what scoring adds to them:
    the last layer's attention, o_proj and MLP (a plain prefill runs them for the last
    token alone; its q/k/v projections run for every position either way) and the
    vocabulary projection."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    keys = (tokens + 1) / 2                           # causal: the mean keys a query reads
    tail = 2 * q * keys + q * h + 3 * h * cfg.intermediate_size       # QK and PV, o_proj, MLP
    plain = cfg.num_layers * (h * (q + 2 * kv) + tail) - tail
    return plain, tail, h * cfg.vocab_size


def report_work(cfg: ModelConfig, tokens: int, rates: dict[str, float]) -> None:
    """rates: scoring/plain prompt tok/s by where it was measured."""
    plain, tail, vocab = added_work(cfg, tokens)
    cap = plain / (plain + tail + vocab)
    print(f"\nwork a token (multiply-adds, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}): plain prefill {plain / 1e6:.3g} M; scoring adds the last layer for every "
          f"position {tail / 1e6:.3g} M and the vocabulary projection {vocab / 1e6:.3g} M")
    print(f"ratio that work allows: {cap:.3f}; measured / allowed: "
          + ", ".join(f"{k} {r / cap:.3f}" for k, r in rates.items()))


def report_cluster(runs: dict[str, list[dict]], worst: float, shown: str, args: argparse.Namespace) -> None:
    print(f"cluster: {shown}")
    print(f"load: {args.prompts} prompts x {args.tokens} tokens at once per side, {args.rounds} rounds; "
          f"score = {json.dumps(SAMPLING['score'])}, plain = {json.dumps(SAMPLING['plain'])}")
    print(f"\n{'median of ' + str(args.rounds) + ' rounds':<24}{'score':>12}{'plain':>12}{'score/plain':>13}")
    for k in runs["score"][0]:
        a, b = (med([f[k] for f in runs[s]]) for s in SIDES)
        ratio = f"{a / b:>13.3f}" if b else f"{'-':>13}"
        print(f"{k:<24}{a:>12.3f}{b:>12.3f}{ratio}")
    per_round = [a["prompt tok/s"] / b["prompt tok/s"] for a, b in zip(runs["score"], runs["plain"])]
    rate = med([f["prompt tok/s"] for f in runs["score"]]) / med([f["prompt tok/s"] for f in runs["plain"]])
    print(f"ratio scoring/plain prompt tok/s: {rate:.3f} (target >= 0.9; per round: "
          f"{', '.join(f'{x:.2f}' for x in per_round)})")
    cpu = med([f["prefill CPU s"] for f in runs["plain"]]) / med([f["prefill CPU s"] for f in runs["score"]])
    print(f"ratio by the prefill's CPU s, plain/score: {cpu:.3f} (what the throughput ratio would be "
          f"with the prefill alone on its core)")
    print(f"scores check: {'PASS' if worst <= CHECK_TOLERANCE else 'FAIL'} (the first {CHECKED} prompts "
          f"of each round against this process's engine: max difference {worst:.2g})")


def report_engine(engine: Engine, speeds: dict[str, float], rows: int, peaks: tuple[float, float],
                  args: argparse.Namespace) -> None:
    """rows: the scored rows of the batch whose peaks (chunked, one chunk) were measured."""
    vocab = engine.model.cfg.vocab_size
    per_chunk = pl.chunk_rows(vocab, torch.float32, pl.LOGITS_CHUNK_BYTES)
    print(f"\nengine (ModelRunner in this process, 1 torch thread): batches of {engine.batch} prompts "
          f"x {args.tokens} tokens, {args.engine_repeats} passes over the prompts, medians of the batches, per CPU s")
    print(f"{'prompt tok/s':<24}{'logprobs':>12}{'prefill':>12}{'ratio':>13}")
    print(f"{'':<24}{speeds['score']:>12.1f}{speeds['plain']:>12.1f}{speeds['score'] / speeds['plain']:>13.3f}")
    print(f"ratio engine logprobs/prefill prompt tok/s: {speeds['score'] / speeds['plain']:.3f}")
    mib = 1 << 20
    print(f"logits chunking: a batch of {rows} scored rows, vocab {vocab}, chunks of <= {per_chunk} rows "
          f"(<= {pl.LOGITS_CHUNK_BYTES // mib} MiB of float32 logits); peak allocated during "
          f"prompt_logprobs {peaks[0] / mib:.1f} MiB, all rows in one chunk {peaks[1] / mib:.1f} MiB "
          f"([{rows}, {vocab}] float32: {rows * vocab * 4 / mib:.1f} MiB)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, help=f"256 ({DEEP_PROMPTS} with --model deep)")
    ap.add_argument("--tokens", type=int, default=512, help="each prompt's length")
    ap.add_argument("--model", default="tiny",
                    help="tiny (embedded), deep (DEEP, written for the run), smollm2, or what `zpd --model` takes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-repeats", type=int, default=2, help="passes over the prompts in process")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="zpd launch --kv-cache-mb")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="wait at most this long for an idle machine before each side")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for any one answer; also the cluster's --kv-wait-timeout")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 prompts x 64 tokens, 1 round")
    args = ap.parse_args()
    args.prompts = args.prompts or (DEEP_PROMPTS if args.model == "deep" else 256)
    if args.quick:
        args.prompts, args.tokens, args.rounds, args.engine_repeats, args.quiet_wait = 8, 64, 1, 1, 0.0
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="zpd-score-") as name:
        tmp = Path(name)
        spec = str(save_tiny(tmp / "deep", config=DEEP)) if args.model == "deep" else args.model
        model = load_model(spec, dtype="float32")
        engine = Engine(model, args)
        vocab = model.cfg.vocab_size
        log_step("engine side by side")
        prompts = random_prompts(args.prompts, args.tokens, vocab, seed=1)
        speeds = engine.timed(prompts, args.engine_repeats)
        first = engine.batches(prompts)[0]
        peaks = (engine.chunking_peak(first, pl.LOGITS_CHUNK_BYTES), engine.chunking_peak(first, 1 << 62))
        log_step("starting the cluster")
        runs, worst, shown = cluster_rounds(spec, vocab, engine, args, tmp)
    print(f"model: {args.model}, float32; {os.cpu_count()} CPUs; torch {torch.__version__}")
    report_cluster(runs, worst, shown, args)
    report_engine(engine, speeds, sum(len(p) - 1 for p in first), peaks, args)
    rate, cpu = ({side: med([f[k] for f in runs[side]]) for side in SIDES}
                 for k in ("prompt tok/s", "prefill CPU s"))
    report_work(model.cfg, args.tokens, {"1P1D": rate["score"] / rate["plain"],
                                         "1P1D by CPU s": cpu["plain"] / cpu["score"],
                                         "engine": speeds["score"] / speeds["plain"]})
    return 0 if worst <= CHECK_TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
