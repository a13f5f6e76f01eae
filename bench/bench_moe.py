"""Mixtures of experts on CPU: a random Qwen3-MoE against the same model dense with
equal active parameters (intermediate = top_k * moe_intermediate), side by side in
one run, and the cost of recording each token's routed experts.

    python bench/bench_moe.py [--size mid|tiny] [--dtypes float32,bfloat16]
                              [--batches 1,16] [--context 128] [--steps 16]
                              [--prefill-len 256] [--threads 2] [--repeats 5] [--quiet-wait 5]
                              [--keep DIR]

Sizes: "mid" is 16 experts, top-2, moe_intermediate 384, 4 layers, hidden 512, 8
query / 4 KV heads of 64, vocab 16384 (its dense twin: intermediate 768); "tiny" (the
smoke test's) 8 experts, top-2, hidden 64, 2 layers. Both are written as Hugging Face
directories by transformers (random weights) and loaded by zpd's loader.

Through engines/runner.py's ModelRunner on a KV pool, as a worker steps: decode tok/s
at each batch (B sequences of --context tokens, --steps greedy steps per round),
with and without `net.capture = RoutingCapture(...)` set before each step as the
runner does for routed experts (`capture`: the tok/s it costs, from per-repeat
ratios; `alone`: its own work timed apart, as a share of a step), and with the
experts by torch's grouped loop instead of the library's kernel (`moe loop`,
`ker/loop`); prefill tok/s of one --prefill-len prompt. The
variants run back to back within each repeat; rates are medians of --repeats, ratios
medians of the per-repeat ratios.

Bandwidth limit (batch 1): the bytes a decode step must read (the chosen experts'
weights, attention, router, norms, head, one embedding row, the KV of the context)
over this machine's memory bandwidth, measured by a large torch copy (best of 5;
read + write bytes, best of 8; the machine idle first, like every measurement,
--quiet-wait); `x limit` is the measured step time over that floor.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import med, wait_quiet  # noqa: E402  (also puts the repository on sys.path)

from engines.cpu import backend as cpu_backend  # noqa: E402
from engines.kv.layout import KVLayout  # noqa: E402
from engines.kv.pool import KVPool  # noqa: E402
from engines.loader import load_model  # noqa: E402
from engines.models.moe import RoutingCapture  # noqa: E402
from engines.runner import ModelRunner  # noqa: E402

SIZES = {
    "mid": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                head_dim=64, vocab_size=16384, num_experts=16, num_experts_per_tok=2,
                moe_intermediate_size=384),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=300, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32),
}
PAGE = 16


def make_models(root: Path, size: dict) -> tuple[Path, Path]:
    """The MoE and its dense twin, random, as Hugging Face directories."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    common = dict(size, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    moe = {k: common.pop(k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    paths = []
    for name, cfg in (("moe", transformers.Qwen3MoeConfig(**common, **moe, norm_topk_prob=True,
                                                           intermediate_size=moe["moe_intermediate_size"])),
                      ("dense", transformers.Qwen3Config(
                          **common, intermediate_size=moe["num_experts_per_tok"] * moe["moe_intermediate_size"]))):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
        model.save_pretrained(root / name)
        paths.append(root / name)
    return paths[0], paths[1]


class Stepper:
    """One model on a KV pool: B sequences of `context` tokens prefilled once, then
    rounds of greedy decode steps from the same positions (their KV rewritten)."""

    def __init__(self, model, batch: int, context: int, steps: int, prefill_len: int) -> None:
        self.model, self.batch, self.context, self.steps = model, batch, context, steps
        per_seq = -(-(max(context + steps, prefill_len) + 1) // PAGE)
        layout = KVLayout.for_model(model.cfg, PAGE, model.dtype)
        self.pool = KVPool(layout, batch * per_seq, model.dtype, model.device)
        self.runner = ModelRunner(model, self.pool)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        g = torch.Generator().manual_seed(batch)
        vocab = model.cfg.vocab_size
        self.prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]
        self.long = torch.randint(0, vocab, (prefill_len,), generator=g).tolist()
        logits = self.runner.prefill(self.prompts, self.tables)
        self.first = self.runner.backend.argmax(logits).tolist()

    def decode(self, capture: bool = False, loop: bool = False) -> float:
        """tok/s of one round of `steps` steps; `loop`: the experts by torch's grouped
        loop, not the library's kernel (engines/cpu/backend.py)."""
        net, m = self.model.net, self.model.cfg.moe
        kept = cpu_backend.GROUPED_MAX_ROWS_PER_EXPERT
        cpu_backend.GROUPED_MAX_ROWS_PER_EXPERT = -1 if loop else kept
        tokens, start = list(self.first), time.perf_counter()
        for s in range(self.steps):
            if capture:
                net.capture = RoutingCapture(self.batch, self.model.cfg.num_layers, m.top_k, False)
            logits = self.runner.decode(tokens, [self.context + s] * self.batch, self.tables)
            tokens = self.runner.backend.argmax(logits).tolist()
        net.capture = None
        cpu_backend.GROUPED_MAX_ROWS_PER_EXPERT = kept
        return self.batch * self.steps / (time.perf_counter() - start)

    def prefill(self) -> float:
        start = time.perf_counter()
        self.runner.prefill([self.long], self.tables[:1])
        return len(self.long) / (time.perf_counter() - start)


def bandwidth(quiet_s: float) -> float:
    """Bytes per second of a 256 MiB copy (read + write), best of 8, each once the
    machine is idle (up to quiet_s): a copy that shares the cores reads slower."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(8):
        wait_quiet(quiet_s)
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def step_bytes(model, context: int) -> int:
    """What a batch-1 decode step reads: every weight but the experts' and the
    embedding, k experts per sparse layer, one embedding row, the context's KV."""
    cfg, total = model.cfg, 0
    for name, p in model.net.named_parameters():
        if ".experts." in name:
            experts = cfg.moe.num_experts
            total += p.numel() * p.element_size() * cfg.moe.top_k // experts
        elif "embed_tokens" in name:
            total += cfg.hidden_size * p.element_size()
        else:
            total += p.numel() * p.element_size()
    kv = cfg.num_layers * 2 * context * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    return total + kv


def paired(variants: dict, repeats: int, quiet_s: float) -> dict[str, list[float]]:
    """Each variant's rate per repeat, the variants back to back within a repeat (their
    order rotating), so a ratio of two is taken within one repeat: this machine's
    speed drifts by tens of percent within a minute. Each measurement waits (up to
    quiet_s) for the machine to go nearly idle: its cores are shared."""
    for f in variants.values():
        f()                                                   # warm: packed copies, kernels' checks
    names, rates = list(variants), {n: [] for n in variants}
    for i in range(repeats):
        for n in names[i % len(names):] + names[:i % len(names)]:
            wait_quiet(quiet_s)
            rates[n].append(variants[n]())
    return rates


def ratio(rates: dict[str, list[float]], a: str, b: str) -> float:
    """The median of the per-repeat ratios a / b."""
    return med([x / y for x, y in zip(rates[a], rates[b])])


def capture_seconds(cfg, batch: int, rounds: int = 2000) -> float:
    """What routing capture adds to one decode step, alone: a RoutingCapture made and
    each sparse layer's ids recorded into it."""
    m = cfg.moe
    ids, weights = torch.randint(0, m.num_experts, (batch, m.top_k)), torch.rand(batch, m.top_k)
    layers = [i for i in range(cfg.num_layers) if m.sparse(i)]
    start = time.perf_counter()
    for _ in range(rounds):
        capture = RoutingCapture(batch, cfg.num_layers, m.top_k, False)
        for i in layers:
            capture.record(i, ids, weights)
    return (time.perf_counter() - start) / rounds


def run(args, moe_path: Path, dense_path: Path, dtype: str, bw: float) -> None:
    models = {"moe": load_model(str(moe_path), dtype=dtype), "dense": load_model(str(dense_path), dtype=dtype)}
    for batch in args.batches:
        steppers = {n: Stepper(m, batch, args.context, args.steps, args.prefill_len) for n, m in models.items()}
        moe = steppers["moe"]
        rates = paired({"moe": moe.decode, "moe+capture": lambda: moe.decode(capture=True),
                        "moe loop": lambda: moe.decode(loop=True), "dense": steppers["dense"].decode},
                       args.repeats, args.quiet_wait)
        r = {n: med(v) for n, v in rates.items()}
        alone = capture_seconds(models["moe"].cfg, batch) * r["moe"] / batch
        print(f"{dtype:<9} {batch:>5} {r['moe']:>9.1f} {r['dense']:>9.1f} {ratio(rates, 'moe', 'dense'):>7.2f}x "
              f"{r['moe loop']:>9.1f} {ratio(rates, 'moe', 'moe loop'):>7.2f}x {r['moe+capture']:>11.1f} "
              f"{(1 - ratio(rates, 'moe+capture', 'moe')) * 100:>+8.1f}% {alone * 100:>8.2f}%", end="")
        if batch == 1:
            need = step_bytes(models["moe"], args.context)
            floor, step, best = need / bw, 1 / r["moe"], 1 / max(rates["moe"])
            print(f"  step {step * 1e3:.2f} ms (best {best * 1e3:.2f}), floor {floor * 1e3:.2f} ms "
                  f"({need / 2**20:.1f} MiB): {step / floor:.1f}x limit (best {best / floor:.1f}x)", flush=True)
        else:
            print(flush=True)
    pre = {n: Stepper(m, 1, 1, 1, args.prefill_len) for n, m in models.items()}
    rates = paired({n: s.prefill for n, s in pre.items()}, args.repeats, args.quiet_wait)
    print(f"{dtype:<9} prefill {args.prefill_len} tokens: moe {med(rates['moe']):.0f} tok/s, "
          f"dense {med(rates['dense']):.0f} tok/s, ratio moe/dense {ratio(rates, 'moe', 'dense'):.2f}", flush=True)


def layer_only(args, bw: float) -> None:
    """One mixture layer of --layer's shape alone, random bfloat16 weights: the experts
    kernel against torch's loop at 1, 4 and 16 tokens, 8 routings a round, against the
    floor of the experts' bytes it reads at the copy bandwidth."""
    from engines.models.moe import Experts
    e, k, h, i = (int(v) for v in args.layer.split(","))
    dt, g = torch.bfloat16, torch.Generator().manual_seed(0)
    experts = Experts(e, h, i)
    experts.gate_up_proj.data = torch.randn(e * 2 * i, h, generator=g).to(dt) / h ** 0.5
    experts.down_proj.data = torch.randn(e * h, i, generator=g).to(dt) / i ** 0.5
    backend = cpu_backend.CpuBackend(dt)
    print(f"\none layer: {e} experts, top-{k}, hidden {h}, intermediate {i}, bfloat16; ms a routing, "
          f"best (median) of {args.repeats}")
    for tokens in (1, 4, 16):
        routings = []
        for _ in range(8):
            weights, ids = torch.softmax(torch.randn(tokens, e, generator=g), -1).topk(k)
            routings.append((torch.randn(tokens, h, generator=g).to(dt), ids, weights))
        sides = {"kernel": lambda x, ids, w: cpu_backend.grouped_experts(dt)(x, ids, w, *experts.stacked()),
                 "loop": lambda x, ids, w: super(cpu_backend.CpuBackend, backend).experts(x, ids, w, experts)}

        def per_routing(f, routings=routings):
            def run() -> float:
                start = time.perf_counter()
                for r in routings:
                    f(*r)
                return (time.perf_counter() - start) / len(routings)
            return run
        secs = paired({n: per_routing(f) for n, f in sides.items()}, args.repeats, args.quiet_wait)
        read = med([len(set(r[1].flatten().tolist())) for r in routings])
        floor = read * 3 * h * i * 2 / bw
        cells = ", ".join(f"{n} {min(v) * 1e3:.2f} ({med(v) * 1e3:.2f})" for n, v in secs.items())
        print(f"{tokens:>3} tokens, {read:.0f} experts read, floor {floor * 1e3:.2f} ms: {cells}; "
              f"kernel best {min(secs['kernel']) / floor:.1f}x floor", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="mid")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--context", type=int, default=128, help="tokens of each sequence before decoding")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quiet-wait", type=float, default=5.0,
                    help="seconds to wait at most for an idle machine before each measurement (0: none)")
    ap.add_argument("--layer", default=None, metavar="E,K,H,I",
                    help="instead: one mixture layer of E experts, top-K, hidden H, intermediate I "
                         "(e.g. 128,8,2048,768: Qwen3-30B-A3B's), kernel vs loop against its floor")
    ap.add_argument("--keep", default=None, help="write the two models here (moe/, dense/) and keep them, "
                                                 "e.g. for bench_peer.py --hf-dir DIR/moe (vLLM-CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    bw = bandwidth(args.quiet_wait)
    if args.layer:
        print(f"copy bandwidth {bw / 1e9:.1f} GB/s, {args.threads} threads")
        return layer_only(args, bw)
    print(f"Qwen3-MoE {args.size}: {size}; dense twin intermediate "
          f"{size['num_experts_per_tok'] * size['moe_intermediate_size']}; {args.threads} threads, "
          f"torch {torch.__version__}; copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"\ndecode tok/s, context {args.context}, {args.steps} steps a round, median of {args.repeats}")
    print(f"{'dtype':<9} {'batch':>5} {'moe':>9} {'dense':>9} {'moe/dns':>8} {'moe loop':>9} {'ker/loop':>8} "
          f"{'moe+capture':>11} {'capture':>9} {'alone':>9}")
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        moe_path, dense_path = make_models(Path(args.keep or tmp), size)
        for dtype in args.dtypes.split(","):
            run(args, moe_path, dense_path, dtype, bw)


if __name__ == "__main__":
    main()
