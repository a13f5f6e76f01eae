"""Loading a model by name, directory or GGUF file, and replacing its weights in place."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from engines.cpu import products as cpu_products
from engines.formats.chat import ChatTemplate, encode_chat
from engines.config import ModelConfig, ModelError
from engines.models.llama import LlamaForCausalLM
from engines.models.null import NullNet, NullSpec, is_null
from engines.formats.overrides import ModelOverrides
from engines.tp.plan import Shard
from engines.models.tiny import is_tiny, tiny_seed, tiny_state_dict
from engines.formats.tokenizer import Tokenizer
from engines.formats.weights import LazyTensor, apply_checkpoint, iter_tensors, lazy, read_checkpoint
# the config and text handling, torch-free for the HTTP front and `zpd launch`
from engines.text import model_text, resolve_spec

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
    chat: ChatTemplate | None = None
    # why there is no tokenizer or chat template, for the error a text prompt gets
    text_problem: str = ""
    # one tensor-parallel rank's part of a model (engines/tp/): `cfg` and `net` are the
    # part's, this says of what
    shard: Shard | None = None

    @property
    def whole_cfg(self) -> ModelConfig:
        """The config of the whole model (`cfg` unless this is one rank's part)."""
        return self.cfg if self.shard is None else self.shard.whole

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids; ModelError (a bad request) where the model has no tokenizer."""
        if self.tokenizer is None:
            raise ModelError(f"{self.text_problem}: send token ids instead of text")
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list, tools: list | None = None,
                    variables: dict | None = None) -> list[int]:
        """A conversation through the model's chat template, ready for the assistant's turn
        (`tools` and `variables`: see ChatTemplate.render). ValueError for malformed
        messages, ModelError where the model has no template."""
        if self.tokenizer is None or self.chat is None:
            raise ModelError(f"{self.text_problem}: send token ids or a plain prompt")
        return encode_chat(self.tokenizer, self.chat, messages, tools, variables)


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


@dataclass
class Source:
    """What a model spec provides: config, weights, and (on request) text handling."""
    cfg: ModelConfig
    tensors: Iterable[LazyTensor]
    tokenizer: Tokenizer | None = None
    chat: ChatTemplate | None = None
    text_problem: str = ""


def _source(spec: str, text: bool) -> Source:
    """`text`: also build the tokenizer and chat template (not needed for a weight update)."""
    t = model_text(spec, text)
    if is_tiny(spec):
        tensors: Iterable[LazyTensor] = [lazy(n, w) for n, w in
                                         tiny_state_dict(tiny_seed(spec)).items()]
    elif t.gguf is not None:
        tensors = t.gguf.tensors()
    else:
        tensors = [] if is_null(spec) else iter_tensors(Path(spec))
    return Source(t.cfg, tensors, t.tokenizer, t.chat, t.text_problem)


def load_model(spec: str, device: str = "cpu", dtype: str = "float32",
               version: str | None = None, overrides: ModelOverrides | None = None) -> LoadedModel:
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    path = resolve_spec(spec)
    src = _source(path, text=True)
    o = overrides or ModelOverrides()
    null = NullSpec.parse(path) if is_null(path) else None
    if null is not None:       # its KV size is in bytes: the head is sized for `dt`
        src.cfg = null.config(dt.itemsize)
    cfg = o.config(src.cfg)
    tokenizer, chat, problem = o.text(cfg, src.tokenizer, src.chat, src.text_problem)
    net = NullNet(null) if null is not None else _loaded_net(cfg, src, path, dev, dt)
    return LoadedModel(spec, cfg, net, tokenizer, dev, dt,
                       version or default_version(path), chat, problem)


def _loaded_net(cfg: ModelConfig, src: Source, path: str, dev: torch.device,
                dt: torch.dtype) -> LlamaForCausalLM:
    net = new_net(cfg, dev, dt)
    apply_checkpoint(net, read_checkpoint(net, src.tensors, path))
    net.setup_rotary(dt, dev)
    net.eval()
    return net


def new_net(cfg: ModelConfig, dev: torch.device, dt: torch.dtype) -> LlamaForCausalLM:
    """A network of `cfg` whose weights are still to be loaded, laid out for the products
    that will multiply by them."""
    with torch.device(dev):
        net = LlamaForCausalLM(cfg).to(dt)
    if dev.type == "cpu" and dt == torch.float32 and cpu_products.small_linear(dt) is None:
        net.column_major_float32()         # F.linear's faster layout; the kernel wants row-major
    return net


def update_weights(model: LoadedModel, path: str, version: str | None = None) -> str:
    """Replace the weights from checkpoint `path` (a directory or GGUF file) of the same
    architecture. On any error the old weights stay. The version becomes `version`;
    without one it stays what it was (SGLang's update_weights_from_disk does the same:
    a version is only ever set by the caller). Returns the version."""
    if model.shard is not None:
        raise ValueError("one rank's part of a model updates through engines.tp.runner (read_whole, swap_part)")
    path = resolve_spec(path)
    if isinstance(model.net, NullNet):
        model.net.update(path)
        model.version = version or model.version
        return model.version
    src = _checked_source(path, model.cfg)
    plan = read_checkpoint(model.net, src.tensors, path)
    apply_checkpoint(model.net, plan)
    if version:
        model.version = version
    return model.version


def _checked_source(path: str, cfg: ModelConfig) -> Source:
    """Checkpoint `path`'s weights, which must be of `cfg`'s architecture (else ModelError)."""
    src = _source(path, text=False)
    if src.cfg.shape() != cfg.shape():
        raise ModelError(f"{path}: architecture differs from the loaded model "
                         f"({src.cfg.shape()} vs {cfg.shape()})")
    return src


def whole_net(path: str, cfg: ModelConfig, dev: torch.device, dt: torch.dtype) -> LlamaForCausalLM:
    """The network of checkpoint `path`, of `cfg`'s architecture (ModelError if not):
    what a tensor-parallel rank cuts its new part from."""
    path = resolve_spec(path)
    src = _checked_source(path, cfg)
    net = new_net(src.cfg, dev, dt)
    apply_checkpoint(net, read_checkpoint(net, src.tensors, path))
    return net


def default_version(spec: str) -> str:
    if is_null(spec):
        return NullSpec.parse(spec).version
    return spec if is_tiny(spec) else Path(spec).resolve().name
