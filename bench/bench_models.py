"""SmolLM2-135M-Instruct from its GGUF file: load time, and generation speed of zpd's
engine vs transformers, side by side in one run.

    python bench/bench_models.py [--dtypes float32,bfloat16] [--batches 1,16]
                                 [--new-tokens 64] [--threads 2] [--repeats 3]
                                 [--no-hf-load] [--hf-random-weights]

Load: zpd's `load_model("smollm2")` (read, dequantize tensor by tensor into --dtype) vs
transformers' `from_pretrained(dir, gguf_file=...)`; the peak resident memory each load
adds is printed too (ru_maxrss, measured in a fresh child process per load).
Speed: B copies of the 37-token chat prompt, greedy, --new-tokens each (EOS ignored);
zpd's OfflineEngine (what `zpd run` uses) vs transformers' `generate` on a plain
Llama holding the same dequantized weights in the same dtype (transformers' own GGUF
model computes through float32 kernels whatever the dtype asked for, so the plain one is
the fair peer). Figures are generated tokens per second over the whole request,
prefill included; medians of --repeats, the two sides alternating.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")     # transformers' GGUF loader draws progress bars

from bench.common import med  # noqa: E402
from engines.loader import load_model, resolve_spec  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

LOAD_CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if sys.argv[1] == "zpd":
    from engines.loader import load_model
    load_model("smollm2", dtype=sys.argv[2])
else:
    from pathlib import Path
    import transformers
    from engines.loader import resolve_spec
    path = Path(resolve_spec("smollm2"))
    transformers.utils.logging.disable_progress_bar()
    transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=getattr(torch, sys.argv[2]))
took = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": took, "added_mib": (peak - before) / 1024}))
"""


def load_in_child(side: str, dtype: str, threads: int) -> dict:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", LOAD_CHILD, side, dtype, str(threads)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def zpd_speed(model, prompt: list[int], batch: int, new: int) -> float:
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    engine = OfflineEngine(model, kv_cache_mb=512, max_batch=batch)   # every request at once
    reqs = [Request(f"r{i}", list(prompt), params) for i in range(batch)]
    start = time.perf_counter()
    outs = engine.run(reqs)
    took = time.perf_counter() - start
    assert all(len(o["output_ids"]) == new for o in outs)
    return batch * new / took


@torch.inference_mode()
def hf_speed(model, prompt: list[int], batch: int, new: int) -> float:
    ids = torch.tensor([prompt] * batch)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=2)
    took = time.perf_counter() - start
    assert out.shape[1] == len(prompt) + new
    return batch * new / took


def hf_plain(dtype: torch.dtype):
    """transformers' Llama with the weights transformers dequantized from the file."""
    import contextlib
    import io

    import transformers
    path = Path(resolve_spec("smollm2"))
    with contextlib.redirect_stderr(io.StringIO()):          # its progress bars
        packed = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_config(packed.config).to(dtype)
    model.load_state_dict(packed.state_dict())
    return model.eval()


def hf_random(ours, dtype: torch.dtype):
    """transformers' Llama of the file's shapes with random weights: a generation of a
    fixed length takes as long whatever the weights hold, and this skips transformers'
    GGUF loader (~20 s; the smoke test's choice)."""
    import transformers
    c = ours.cfg
    conf = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings)
    return transformers.LlamaForCausalLM(conf).to(dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf-load", action="store_true",
                    help="skip timing transformers' load (its ~25 s; the smoke test's choice)")
    ap.add_argument("--hf-random-weights", action="store_true",
                    help="transformers' side: random weights of the same shapes, not the file's "
                         "(the same speed, without its ~20 s GGUF load; the smoke test's choice)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes, batches = args.dtypes.split(","), [int(b) for b in args.batches.split(",")]
    print(f"SmolLM2-135M-Instruct, {Path(resolve_spec('smollm2')).name}, "
          f"{args.threads} threads, torch {torch.__version__}")
    print("\nload from the GGUF file (fresh process each)")
    print(f"{'dtype':<10} {'zpd s':>7} {'zpd +MiB':>9} {'hf s':>7} {'hf +MiB':>9}")
    for dtype in dtypes:
        z = load_in_child("zpd", dtype, args.threads)
        h = {"seconds": float("nan"), "added_mib": float("nan")} if args.no_hf_load \
            else load_in_child("hf", dtype, args.threads)
        print(f"{dtype:<10} {z['seconds']:>7.2f} {z['added_mib']:>9.0f} "
              f"{h['seconds']:>7.2f} {h['added_mib']:>9.0f}")
    print(f"\ngenerated tok/s, 37-token chat prompt + {args.new_tokens} new tokens, "
          f"median of {args.repeats}"
          + ("; transformers with random weights (--hf-random-weights)" if args.hf_random_weights else ""))
    print(f"{'dtype':<10} {'batch':>5} {'zpd':>8} {'hf':>8} {'zpd/hf':>7}")
    for dtype in dtypes:
        ours = load_model("smollm2", dtype=dtype)
        ref = hf_random(ours, DTYPES[dtype]) if args.hf_random_weights else hf_plain(DTYPES[dtype])
        prompt = ours.encode_chat(QUESTION)
        for batch in batches:
            zs, hs = [], []
            for _ in range(args.repeats):
                zs.append(zpd_speed(ours, prompt, batch, args.new_tokens))
                hs.append(hf_speed(ref, prompt, batch, args.new_tokens))
            print(f"{dtype:<10} {batch:>5} {med(zs):>8.1f} {med(hs):>8.1f} "
                  f"{med(zs) / med(hs):>6.2f}x")


if __name__ == "__main__":
    main()
