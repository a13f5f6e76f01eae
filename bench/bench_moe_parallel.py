"""Expert parallelism against tensor parallelism for a mixture of experts, on the CPU.

    python bench/bench_moe_parallel.py [--modes 1:1,2:1,1:2,2:2] [--batches 1,16]
                                       [--steps 16] [--rounds 3] [--prompt-tokens 256]

The model: a random Qwen3-MoE checkpoint written here with transformers (hidden 512,
4 layers, 16 experts of intermediate 512, top-2, 8 query heads over 4 kv heads of 64,
vocabulary 2048; float32). Each mode `tp:ep` is the path `zpd run --tp T --ep E`
takes: OfflineEngine over engines.tp.spawn.lead's group (1:1 no group), one torch
thread per rank. Every engine is started once; each round runs every mode in turn
(the order rotating): per batch size, `batch` prompts of 16 ids, --steps + 1 greedy
tokens, each engine.step() after the first timed (one decode step each); then one
prompt of --prompt-tokens ids, its prefill step timed. A row is the median over
rounds of each round's median.

What the modes move per mixture layer (T tokens, hidden H, k = 2): 2:1 one all-reduce
of [T, H] (after each expert's intermediate slice); 1:2 and 2:2 two all-to-alls of
about T*k/2 rows each way plus the same all-reduce (engines/tp/experts.py), and 1:2
computes the whole attention on both ranks.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log_step, random_prompts  # noqa: E402

from engines.loader import load_model  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402
from engines.tp.spawn import lead, stop  # noqa: E402

VOCAB = 2048


def write_model(root: Path) -> str:
    """The random mid-size MoE checkpoint, saved under `root`."""
    import transformers
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16,
        num_experts_per_tok=2, moe_intermediate_size=512, norm_topk_prob=True,
        max_position_embeddings=4096, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    path = root / "moe-mid"
    model.save_pretrained(path)
    return str(path)


class Engine:
    def __init__(self, path: str, tp: int, ep: int) -> None:
        self.name, self.group, self.procs = f"tp{tp} ep{ep}", None, None
        if tp == ep == 1:
            torch.set_num_threads(1)
            model = load_model(path, "cpu", "float32", None, None)
        else:
            model, self.group, self.procs = lead(path, "cpu", "float32", None, None, tp,
                                                 threads=max(tp, ep), ep=ep)
        self.engine = OfflineEngine(model, kv_cache_mb=256, page_size=16, tp=self.group)

    def decode_step(self, batch: int, steps: int, seed: int) -> float:
        params = SamplingParams(temperature=0, max_new_tokens=steps + 1, ignore_eos=True)
        for i, p in enumerate(random_prompts(batch, 16, VOCAB, seed)):
            self.engine.submit(Request(f"d{seed}-{i}", p, params))
        self.engine.step()                    # the prefill and the first decode step
        times = []
        while len(self.engine.batch):
            t = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def prefill(self, tokens: int, seed: int) -> float:
        params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
        self.engine.submit(Request(f"p{seed}", random_prompts(1, tokens, VOCAB, seed)[0], params))
        t = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - t
        while len(self.engine.batch):
            self.engine.step()
        return elapsed

    def close(self) -> None:
        if self.group is not None:
            stop(self.group, self.procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="1:1,2:1,1:2,2:2", help="tp:ep pairs")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    args = ap.parse_args()
    modes = [tuple(int(v) for v in m.split(":")) for m in args.modes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    root = Path(tempfile.mkdtemp(prefix="zpd-moe-bench-"))
    log_step("writing the random MoE checkpoint")
    path = write_model(root)
    engines = []
    try:
        for tp, ep in modes:
            log_step(f"starting tp {tp} ep {ep}")
            engines.append(Engine(path, tp, ep))
        results: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            for e in order:
                for b in batches:
                    results.setdefault((e.name, f"decode b{b}"), []).append(e.decode_step(b, args.steps, r))
                results.setdefault((e.name, "prefill"), []).append(e.prefill(args.prompt_tokens, r))
            log_step(f"round {r + 1}/{args.rounds} done")
    finally:
        for e in engines:
            e.close()
    cols = [f"decode b{b}" for b in batches] + ["prefill"]
    print(f"{'mode':<10}" + "".join(f"{c + ' ms':>16}" for c in cols[:-1])
          + f"{f'prefill {args.prompt_tokens} ms':>18}")
    for e in engines:
        row = [statistics.median(results[(e.name, c)]) * 1e3 for c in cols]
        print(f"{e.name:<10}" + "".join(f"{v:>16.2f}" for v in row[:-1]) + f"{row[-1]:>18.1f}")


if __name__ == "__main__":
    main()
