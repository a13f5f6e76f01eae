"""Engine vs Hugging Face `transformers` generate, side by side in one run.

    python bench/bench_engine.py [--prompt-len 128] [--new-tokens 64] [--prefill-len 1024]

A ~125M-parameter Llama config (12 layers, hidden 768, GQA 12/4, vocab 32k) with random
weights, float32 on CPU, both sides on the same torch threads. Decode tokens/s is
(time to generate N+1 tokens - time to generate 1) measured the same way on both sides,
so prefill is excluded from it. Medians of --repeats runs.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_time as timed  # noqa: E402  (also puts the repository on sys.path)

from engines.loader import load_model  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402


def make_model(root: Path) -> Path:
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                   num_hidden_layers=12, num_attention_heads=12,
                                   num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root)
    return root


def hf_generate(model, prompts: torch.Tensor, new: int):
    return lambda: model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0)


def zpd_generate(model, prompts: torch.Tensor, new: int):
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine = OfflineEngine(model, kv_cache_mb=512, max_batch=len(prompts))   # pool made once

    def run():
        engine.run([Request(f"b{i}", p.tolist(), params) for i, p in enumerate(prompts)])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both sides (default: torch's; 1 is steadier on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ours = load_model(str(path), dtype="float32")
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        long = torch.randint(0, 32000, (1, args.prefill_len), generator=g)
        t_hf = timed(hf_generate(hf, long, 1), args.repeats)
        t_us = timed(zpd_generate(ours, long, 1), args.repeats)
        rows.append((f"prefill tok/s ({args.prefill_len}-token prompt)",
                     args.prefill_len / t_hf, args.prefill_len / t_us))
        for batch in (1, 16):
            prompts = torch.randint(0, 32000, (batch, args.prompt_len), generator=g)
            n = args.new_tokens
            hf_dec = timed(hf_generate(hf, prompts, n + 1), args.repeats) - \
                timed(hf_generate(hf, prompts, 1), args.repeats)
            us_dec = timed(zpd_generate(ours, prompts, n + 1), args.repeats) - \
                timed(zpd_generate(ours, prompts, 1), args.repeats)
            rows.append((f"decode tok/s batch {batch} ({args.prompt_len}+{n})",
                         batch * n / hf_dec, batch * n / us_dec))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, float32, CPU")
    print(f"{'measure':<42}{'transformers':>14}{'zpd':>12}{'zpd/hf':>9}")
    for name, a, b in rows:
        print(f"{name:<42}{a:>14.1f}{b:>12.1f}{b / a:>8.2f}x")


if __name__ == "__main__":
    main()
