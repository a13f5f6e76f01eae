"""Reading safetensors checkpoints into a model: load once, or update in place.

Both go through `read_checkpoint`, which checks every tensor against the model before
any parameter is touched, so a mismatched or corrupt checkpoint leaves the weights as
they were.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engines.config import ModelError
from engines.models.llama import PACKED_WEIGHTS

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# one expert's projection in a mixture: Qwen3-MoE's and GLM's names, Mixtral's w1/w3/w2
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# one checkpoint tensor bound for (parameter name, row offset, row count)
Placement = tuple[str, int, int]
# one checkpoint tensor: (name, shape, read it) -- GGUF weights are dequantized only
# when read, one at a time, so a file is never in memory twice
LazyTensor = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


def checkpoint_files(path: str | Path) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise ModelError(f"{index}: malformed index file: {e}") from None
        # A shard is a file of this directory: an index must not reach outside it.
        if not all(isinstance(s, str) and s and Path(s).name == s for s in shards):
            raise ModelError(f"{index}: shard names must be plain file names in its directory")
        files = [root / s for s in sorted(shards)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{index} names missing shard files: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{root}: no *.safetensors files")
    return files


def iter_tensors(path: str | Path) -> Iterator[LazyTensor]:
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield lazy(name, f.get_tensor(name))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelError(f"{file}: corrupt or unreadable safetensors file: {e}") from None


def lazy(name: str, tensor: torch.Tensor) -> LazyTensor:
    return name, tuple(tensor.shape), lambda: tensor


def placement(model: nn.Module, name: str) -> Placement | None:
    """Where checkpoint tensor `name` goes in `model`; None for tensors we ignore."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
        return None
    name = name.replace(".block_sparse_moe.", ".mlp.")        # Mixtral's name for the mixture
    layer = LAYER.match(name)
    if layer and int(layer.group(1)) >= model.cfg.num_layers \
            and model.cfg.architecture == "Glm4MoeForCausalLM":
        return None            # GLM's multi-token-prediction layers: no speculative decoding here
    expert = EXPERT.match(name)
    if expert:
        owner = model.get_submodule(expert.group(1))
        index = int(expert.group(2))
        if not 0 <= index < owner.num:
            raise AttributeError(name)
        ours, start, rows = owner.rows(index, EXPERT_PARTS[expert.group(3)])
        return f"{expert.group(1)}.{ours}", start, rows
    for ckpt, (ours, shard) in PACKED_WEIGHTS.items():
        marker = f".{ckpt}."
        if marker in name:
            owner = model.get_submodule(name.split(marker)[0])
            start, rows = owner.shards[shard]
            return name.replace(marker, f".{ours}."), start, rows
    return name, 0, -1


def checked_placement(model: nn.Module, params: dict[str, nn.Parameter], name: str,
                      shape) -> Placement | None:
    """`placement` of tensor `name`, refused (ModelError) unless it is one of the
    model's parameters, or rows of one, of exactly that shape."""
    try:
        where = placement(model, name)
    except AttributeError:
        raise ModelError(f"tensor {name!r:.200} does not belong to this model") from None
    if where is None:
        return None
    pname, _, rows = where
    if pname not in params:
        raise ModelError(f"tensor {name!r:.200} does not belong to this model")
    want = params[pname].shape if rows < 0 else (rows, *params[pname].shape[1:])
    if tuple(shape) != tuple(want):
        raise ModelError(f"tensor {name!r:.200} has shape {tuple(shape)}, "
                         f"the model expects {tuple(want)}")
    return where


def read_checkpoint(model: nn.Module, tensors: Iterable[LazyTensor],
                    path: str) -> list[tuple[Placement, Callable[[], torch.Tensor]]]:
    """Every tensor of a checkpoint, validated against `model`'s parameters;
    `path` names the checkpoint in errors."""
    params = dict(model.named_parameters())
    covered: dict[str, int] = {}
    plan: list[tuple[Placement, Callable[[], torch.Tensor]]] = []
    for name, shape, read in tensors:
        try:
            where = checked_placement(model, params, name, shape)
        except ModelError as e:
            raise ModelError(f"{path}: {e}") from None
        if where is None:
            continue
        pname, start, rows = where
        covered[pname] = covered.get(pname, 0) + (shape[0] if rows >= 0 else params[pname].shape[0])
        plan.append(((pname, start, rows), read))
    missing = [n for n, p in params.items() if covered.get(n, 0) != (p.shape[0] if p.dim() else 1)]
    if missing:
        raise ModelError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return plan


@torch.inference_mode()
def apply_checkpoint(model: nn.Module,
                     plan: list[tuple[Placement, Callable[[], torch.Tensor]]]) -> None:
    params = dict(model.named_parameters())
    for (pname, start, rows), read in plan:
        target = params[pname] if rows < 0 else params[pname][start:start + rows]
        target.copy_(read())
