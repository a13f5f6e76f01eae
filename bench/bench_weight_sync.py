"""Trainer weight sync: the time to push the weights of a random ~125M-parameter
float32 Llama (~500 MB) into a 1P1D `zpd launch --http-port` cluster, next to a raw
torch.distributed broadcast of the same bytes to as many ranks, and next to
update_weights_from_disk of the same checkpoint, all in one run.

    python bench/bench_weight_sync.py [--hidden 768] [--layers 12] [--intermediate 2048]
                                      [--vocab 32000] [--heads 12] [--kv-heads 4]
                                      [--dtype float32] [--rounds 3] [--bucket-mib 512]
                                      [--order model] [--methods raw,push,...]
                                      [--quiet-wait 10]

The trainer sends its tensors in its model's own order (transformers'
LlamaForCausalLM `named_parameters`, as slime's and SGLang's updaters walk theirs;
`--order sorted`: by name, as the checkpoint file holds them), buckets of at most
--bucket-mib MiB (slime's --update-weight-buffer-size defaults to 512 MiB), in
--dtype (slime pushes bfloat16; the cluster serves the same dtype).

Methods, run in a rotated order each round; seconds are medians over rounds:
- raw / raw buckets: this process (gloo rank 0) broadcasts every tensor (or the same
  flat buckets the bucketed push sends) to one receiver process per cluster worker,
  into buffers they allocated and touched once up front; from the first broadcast to
  the receivers' acknowledgement (a one-element allreduce).
- raw fresh: as raw, but the receivers allocate a new tensor for each broadcast, as a
  worker's staging does: what receiving into untouched memory costs.
- push: POST /update_weights_from_distributed with one broadcast per tensor, from just
  before the first broadcast to the HTTP answer, which the front sends as soon as the
  router has the commit from every worker (so it also holds one HTTP reply).
- push buckets: the same with load_format "flattened_bucket", one call per
  --bucket-mib bucket (built before timing), from the first broadcast to the last answer.
- push relay / relay buckets: the same two through a group that gives the cluster
  one rank (world_size 2, AReaL's `sglang:d1`, built as SGLang's
  init_custom_process_group): one worker receives and passes each broadcast on to
  the other (zpd/worker/weights/trainer_group.py). Against push: the relay's cost.
- from disk: POST /update_weights_from_disk of the checkpoint directory (just
  written, so read from the page cache).
Each cluster update loads the checkpoint the cluster does not hold (two random
ones, alternating), and the cluster's greedy output afterwards must equal that
checkpoint's reference output. MB are 10^6 bytes of weights (each sent once per
receiver). Target (issue 47): push and push buckets >= 0.9x the raw broadcast's bytes/s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log_step, make_model, med, wait_quiet  # noqa: E402
from weight_sync_raw import BUCKETS, FRESH, TENSORS, RawBaseline, Weights, free_port  # noqa: E402
from tests.e2e.cluster import Cluster  # noqa: E402
from tests.unit.trainer_side import sglang_style_group  # noqa: E402

GROUP = "bench_weight_sync"
METHODS = ("raw", "raw fresh", "raw buckets", "push", "push buckets", "push relay",
           "relay buckets", "from disk")
RELAY_GROUP = "bench_weight_sync_relay"
RECEIVED = re.compile(r"received \d+ bytes from group .* in ([\d.]+) s")
COMMITTED = re.compile(r"committed: version .* \(\d+ elements, ([\d.]+) s\)")
Buckets = list[tuple[list[str], torch.Tensor]]      # names and their flat uint8 bucket


# --- HTTP -------------------------------------------------------------------------------

def post(url: str, path: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read()) | {"http_status": e.code}


def get(url: str, path: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url + path, timeout=timeout) as r:
        return json.loads(r.read())


def ok(path: str, answer: dict) -> dict:
    if not answer.get("success"):
        raise RuntimeError(f"{path} failed: {answer}")
    return answer


def greedy(url: str, tokens: int = 4) -> list[int]:
    body = {"input_ids": [1, 5, 9, 13], "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                            "max_new_tokens": tokens}}
    answer = post(url, "/generate", body, 120)
    if "output_ids" not in answer:
        raise RuntimeError(f"/generate failed: {answer}")
    return answer["output_ids"]


# --- the weights ------------------------------------------------------------------------

def config(args: argparse.Namespace) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads)


def model_order(args: argparse.Namespace) -> list[str]:
    """The tensor names as a trainer holding transformers' Llama walks them."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**config(args), tie_word_embeddings=False)
    with torch.device("meta"):
        return [n for n, _ in LlamaForCausalLM(cfg).named_parameters()]


def buckets(tensors: Weights, bucket_mib: float) -> Buckets:
    """Names in groups of at most `bucket_mib` MiB, each with its flat uint8 bucket."""
    groups, size = [[]], 0
    for name, t in tensors.items():
        if groups[-1] and size + t.nbytes > bucket_mib * 2**20:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += t.nbytes
    return [(g, torch.cat([tensors[n].view(-1).view(torch.uint8) for n in g])) for g in groups]


# --- the cluster ------------------------------------------------------------------------------

class Trainer:
    """Rank 0 of a weight group of the cluster's, pushing over HTTP + torch.distributed:
    GROUP, this process's default group with a rank per worker, or RELAY_GROUP, a
    named group of world size 2 (the cluster relays). `offsets`: how far the workers'
    logs were read, shared by the trainers."""

    def __init__(self, url: str, world: int, logs: Path, timeout_s: float,
                 offsets: dict[Path, int], name: str = GROUP) -> None:
        self.url, self.timeout, self.logs, self.name = url, timeout_s, logs, name
        self.pool = ThreadPoolExecutor(1)
        self.offsets = offsets
        self.log_breakdown()                     # skip what the start logged
        port, timeout = free_port(), timedelta(seconds=timeout_s)
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": world, "group_name": name, "backend": "gloo"}
        if name == GROUP:                         # this process's default group
            answer = self.pool.submit(post, url, "/init_weights_update_group",
                                      body | {"trainer_init": "init_process_group"}, timeout_s)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    world_size=world, rank=0, timeout=timeout)
            self.group = None
        else:
            answer = self.pool.submit(post, url, "/init_weights_update_group", body, timeout_s)
            self.group = sglang_style_group("127.0.0.1", port, world, name, "gloo", timeout)
        ok("/init_weights_update_group", answer.result(timeout_s))

    def push(self, tensors: Weights, flats: Buckets | None, version: str) -> tuple[float, float]:
        """Seconds from the first broadcast to the last answer, and the router's own
        seconds (stage start to commit) summed over calls."""
        calls = flats or [(list(tensors), None)]
        started, router = None, 0.0
        for names, flat in calls:
            part = [tensors[n] for n in names]
            body = {"names": names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in part],
                    "shapes": [list(t.shape) for t in part], "group_name": self.name,
                    "weight_version": version} | ({"load_format": "flattened_bucket"} if flats else {})
            answer = self.pool.submit(post, self.url, "/update_weights_from_distributed", body,
                                      self.timeout)
            started = started or time.perf_counter()
            for t in [flat] if flats else part:
                dist.broadcast(t, src=0, group=self.group)
            router += ok("/update_weights_from_distributed", answer.result(self.timeout))["seconds"]
        return time.perf_counter() - started, router

    def from_disk(self, path: Path, version: str) -> float:
        started = time.perf_counter()
        ok("/update_weights_from_disk", post(self.url, "/update_weights_from_disk",
                                             {"model_path": str(path), "weight_version": version},
                                             self.timeout))
        return time.perf_counter() - started

    def log_breakdown(self) -> tuple[float, float]:
        """Receive and commit seconds the workers logged since the last call (summed
        over calls, the slower worker's)."""
        recv, commit = [0.0], [0.0]
        for f in sorted(self.logs.glob("prefill*.log")) + sorted(self.logs.glob("decode*.log")):
            with open(f, errors="replace") as text:
                text.seek(self.offsets.get(f, 0))
                new = text.read()
                self.offsets[f] = text.tell()
            recv.append(sum(float(s) for s in RECEIVED.findall(new)))
            commit.append(sum(float(s) for s in COMMITTED.findall(new)))
        return max(recv), max(commit)

    def close(self) -> None:
        post(self.url, "/destroy_weights_update_group", {"group_name": self.name}, 60)
        dist.destroy_process_group(self.group)
        self.pool.shutdown()


# --- the rounds -------------------------------------------------------------------------------

@dataclass
class Bench:
    """The two checkpoints (a, b), the cluster's trainer and the raw baseline; `held`:
    the checkpoint the cluster holds, `times`: per method, one row per round."""
    args: argparse.Namespace
    dirs: list[Path]
    weights: list[Weights]
    flats: list[Buckets]
    refs: list[list[int]]                     # each checkpoint's greedy output
    trainer: Trainer
    relay: Trainer
    raw: RawBaseline
    held: int = 1
    updates: int = 0
    times: dict[str, list[tuple[float, ...]]] = field(
        default_factory=lambda: {m: [] for m in METHODS})

    def run(self, method: str) -> float:
        wait_quiet(self.args.quiet_wait)
        target = 1 - self.held
        if method.startswith("raw"):
            kind, parts = (BUCKETS, [f for _, f in self.flats[target]]) if "buckets" in method \
                else (FRESH if "fresh" in method else TENSORS, list(self.weights[target].values()))
            took, router = self.raw.send(parts, kind), float("nan")
        else:
            self.updates += 1
            version = f"bench-{self.updates}-{'ab'[target]}"
            if method == "from disk":
                took, router = self.trainer.from_disk(self.dirs[target], version), float("nan")
            else:
                flats = self.flats[target] if "buckets" in method else None
                trainer = self.relay if "relay" in method else self.trainer
                took, router = trainer.push(self.weights[target], flats, version)
            self.check(target, version)
        self.times[method].append((took, router, *self.trainer.log_breakdown()))
        return took

    def check(self, target: int, version: str) -> None:
        got = get(self.trainer.url, "/get_weight_version")["weight_version"]
        out = greedy(self.trainer.url)
        if got != version or out != self.refs[target]:
            raise RuntimeError(f"after loading checkpoint {'ab'[target]}: version {got!r} "
                               f"(want {version!r}), output {out} (want {self.refs[target]})")
        self.held = target


def report(bench: Bench, nbytes: int, rounds: int) -> None:
    print(f"\nmedian of {rounds} rounds (best: the fastest round); MB = 10^6 bytes of weights; "
          "breakdown: router stage->commit, worker receive, worker commit (the slower worker's, "
          "summed over calls)")
    print(f"{'method':<14}{'seconds':>9}{'best s':>8}{'MB/s':>9}{'x raw':>7}{'router s':>10}"
          f"{'recv s':>8}{'commit s':>10}")
    med_s = {m: [med([r[i] for r in rows]) for i in range(4)]
             for m, rows in bench.times.items() if rows}
    raw = med_s.get("raw", [float("nan")])[0]
    for m, (s, router, recv, commit) in med_s.items():
        best = min(r[0] for r in bench.times[m])
        extra = f"{router:>10.3f}{recv:>8.3f}{commit:>10.3f}" if "push" in m or "relay" in m \
            else ""
        print(f"{m:<14}{s:>9.3f}{best:>8.3f}{nbytes / s / 1e6:>9.1f}{raw / s:>7.2f}{extra}")

    def ratio(a: str, b: str) -> float:
        return med_s[b][0] / med_s[a][0] if a in med_s and b in med_s else float("nan")
    print(f"ratio push/raw bytes/s: {ratio('push', 'raw'):.2f} (target >= 0.9)")
    print(f"ratio push buckets/raw bytes/s: {ratio('push buckets', 'raw'):.2f} (target >= 0.9; "
          f"vs raw buckets: {ratio('push buckets', 'raw buckets'):.2f})")
    print(f"ratio from disk/raw bytes/s: {ratio('from disk', 'raw'):.2f}")
    print(f"relay cost: push relay / push seconds {ratio('push', 'push relay'):.2f}, "
          f"relay buckets / push buckets {ratio('push buckets', 'relay buckets'):.2f}")


def rounds(bench: Bench, n: int) -> None:
    methods = [m for m in METHODS if m in bench.args.methods.split(",")]
    for r in range(n):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        took = {m: bench.run(m) for m in order}
        log_step(f"round {r + 1}: " + ", ".join(f"{m} {took[m]:.3f} s" for m in methods))


def build(args: argparse.Namespace, tmp: Path) -> tuple[list[Path], list[Weights], list[Buckets]]:
    c = config(args)
    dirs = [make_model(tmp / name, c, seed, max_position=2048) for seed, name in enumerate("ab")]
    dtype = getattr(torch, args.dtype)
    weights = [load_file(str(d / "model.safetensors")) for d in dirs]
    names = model_order(args) if args.order == "model" else sorted(weights[0])
    weights = [{n: w[n].to(dtype).contiguous() for n in names} for w in weights]
    return dirs, weights, [buckets(w, args.bucket_mib) for w in weights]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the cluster's and the pushed tensors' dtype (slime: bfloat16)")
    p.add_argument("--bucket-mib", type=float, default=512.0,
                   help="bucket size in MiB (slime's --update-weight-buffer-size: 512)")
    p.add_argument("--order", default="model", choices=("model", "sorted"),
                   help="the order a trainer sends tensors in: its model's, or by name")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated methods to time (default: all)")
    p.add_argument("--quiet-wait", type=float, default=10.0,
                   help="wait at most this long for an idle machine before each timed step")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one step may take")
    args = p.parse_args()
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")    # loopback only, here and in children
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="zpd-wsync-") as name:
        tmp = Path(name)
        log_step("writing the two checkpoints")
        dirs, weights, flats = build(args, tmp)
        nbytes = sum(t.nbytes for t in weights[0].values())
        log_step("starting the cluster")
        with Cluster(tmp, model=str(dirs[0]), dtype=args.dtype,
                     extra=("--http-port", "0", "--log-dir", str(tmp / "logs"),
                            "--log-level", "WARNING")) as cluster:
            url = f"http://{cluster.info['http']}"
            workers = get(url, "/get_server_info")["tp_size"]      # live worker ranks
            refs = [greedy(url)]
            ok("/update_weights_from_disk", post(url, "/update_weights_from_disk",
                                                 {"model_path": str(dirs[1])}, args.timeout))
            refs.append(greedy(url))
            if refs[0] == refs[1]:
                raise RuntimeError(f"both checkpoints give the same output {refs[0]}: no check")
            print(f"model: random Llama, {args.layers} layers, hidden {args.hidden}, "
                  f"intermediate {args.intermediate}, vocab {args.vocab}, "
                  f"{nbytes // weights[0][next(iter(weights[0]))].itemsize / 1e6:.1f} M "
                  f"{args.dtype} parameters, {nbytes / 1e6:.1f} MB in {len(weights[0])} tensors "
                  f"({args.order} order), {len(flats[0])} buckets of <= {args.bucket_mib:g} MiB; "
                  f"cluster 1P1D ({workers} workers, --threads 1), {os.cpu_count()} CPUs")
            log_step("starting the raw receivers and joining the cluster's group")
            raw = RawBaseline(workers, weights[0], [f.numel() for _, f in flats[0]], args.timeout)
            trainers: list[Trainer] = []
            try:
                offsets: dict[Path, int] = {}
                for world, name in ((workers + 1, GROUP), (2, RELAY_GROUP)):
                    trainers.append(Trainer(url, world, tmp / "logs", args.timeout, offsets, name))
                bench = Bench(args, dirs, weights, flats, refs, *trainers, raw)
                rounds(bench, args.rounds)
            finally:
                for trainer in reversed(trainers):     # the default group's last: it
                    trainer.close()                     # ends every group
                raw.close()
    report(bench, nbytes, args.rounds)
    print("weights check: PASS (every update gave its checkpoint's greedy output)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
