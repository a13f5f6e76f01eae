"""Loading a model by name or directory, and replacing its weights in place."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from engines.config import ModelConfig, ModelError
from engines.llama import LlamaForCausalLM
from engines.tiny import TINY_CONFIG, is_tiny, tiny_seed, tiny_state_dict, tiny_tokenizer
from engines.tokenizer import Tokenizer
from engines.weights import apply_checkpoint, iter_tensors, read_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModel:
    """A model ready to run: network, config, tokenizer and the weights' version."""
    spec: str
    cfg: ModelConfig
    net: LlamaForCausalLM
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    version: str


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ModelError(f"unsupported device {name!r}; use cpu or cuda[:N]")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("device cuda requested but torch sees no CUDA device")
    return torch.device(name)


def _source(spec: str) -> tuple[ModelConfig, Iterable[tuple[str, torch.Tensor]], Tokenizer | None]:
    if is_tiny(spec):
        return ModelConfig.from_dict(TINY_CONFIG), tiny_state_dict(tiny_seed(spec)).items(), \
            tiny_tokenizer()
    root = Path(spec)
    if not root.is_dir():
        raise ModelError(f"model {spec!r} is neither 'tiny' nor an existing directory")
    cfg = ModelConfig.from_dir(root)
    tok_file = root / "tokenizer.json"
    return cfg, iter_tensors(root), Tokenizer.from_file(tok_file) if tok_file.is_file() else None


def load_model(spec: str, device: str = "cpu", dtype: str = "float32",
               version: str | None = None) -> LoadedModel:
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    cfg, tensors, tokenizer = _source(spec)
    with torch.device(dev):
        net = LlamaForCausalLM(cfg).to(dt)
    apply_checkpoint(net, read_checkpoint(net, tensors, spec))
    net.setup_rotary(dt, dev)
    net.eval()
    return LoadedModel(spec, cfg, net, tokenizer, dev, dt, version or default_version(spec))


def update_weights(model: LoadedModel, path: str, version: str | None = None) -> str:
    """Replace the weights from checkpoint `path` of the same architecture. On any error
    the old weights stay. Returns the new version string."""
    cfg, tensors, _ = _source(path)
    if cfg.fingerprint() != model.cfg.fingerprint() or \
            cfg.intermediate_size != model.cfg.intermediate_size:
        raise ModelError(f"{path}: architecture differs from the loaded model "
                         f"({cfg.fingerprint()} vs {model.cfg.fingerprint()})")
    plan = read_checkpoint(model.net, tensors, path)
    apply_checkpoint(model.net, plan)
    model.version = version or default_version(path)
    return model.version


def default_version(spec: str) -> str:
    return spec if is_tiny(spec) else Path(spec).resolve().name
