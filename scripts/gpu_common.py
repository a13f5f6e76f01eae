"""What scripts/gpu_check.py (the driver) and scripts/gpu_checks.py (the checks) share:
the rows a check emits, the model sizes of each device, and a random Llama.
Importing it puts the repository and bench/ on sys.path."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

MOONCAKE_BUILDS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13",
                   "mooncake-transfer-engine-non-cuda")


# --- a check's rows ----------------------------------------------------------------------

@dataclass
class Row:
    check: str
    result: str          # PASS | FAIL | SKIP
    figure: str
    detail: str


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
