"""Model configuration: the Llama family and its mixtures of experts (Qwen3-MoE,
Mixtral, GLM-4.5), read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

# architecture name -> (attention bias on q/k/v, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "Glm4MoeForCausalLM": (True, False),      # q/k norms where use_qk_norm says
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "glm4_moe": "Glm4MoeForCausalLM"}
# how a mixture's router picks its experts (engines/models/routing.py)
ROUTERS = {"Qwen3MoeForCausalLM": "softmax", "MixtralForCausalLM": "softmax",
           "Glm4MoeForCausalLM": "grouped_sigmoid"}


class ModelError(ValueError):
    """A model directory, config or checkpoint that cannot be used."""


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts in place of the MLP of the layers not in `dense_layers`."""
    router: str                   # "softmax" (Qwen3-MoE, Mixtral) or "grouped_sigmoid" (GLM-4.5, DeepSeek-V3)
    num_experts: int
    top_k: int
    intermediate_size: int        # of each expert
    dense_layers: tuple[int, ...] = ()    # layers with the dense MLP instead
    norm_topk_prob: bool = True   # the k chosen weights renormalised to sum to 1
    n_group: int = 1              # grouped_sigmoid: experts in n_group groups, top topk_group groups kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0       # an always-on MLP of shared_experts * intermediate_size beside them

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeConfig | None = None
    rotary_dim: int | None = None      # rotary on each head's first rotary_dim dims (None: all)

    @property
    def rotary(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or [MODEL_TYPES.get(raw.get("model_type"), "?")]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position=_max_position(raw),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta")
                                 or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", bias)),
                qk_norm=bool(raw.get("use_qk_norm", qk_norm)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
                moe=_moe(raw, arch),
            )
            cfg = replace(cfg, rotary_dim=_rotary_dim(raw, cfg.head_dim))
        except KeyError as e:
            raise ModelError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelError(f"config.json has a malformed field: {e}") from None
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu'")
        if cfg.moe is not None:
            _check_moe(cfg.moe)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelError("num_attention_heads must be a multiple of num_key_value_heads")
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelError(f"{path}: no config.json (expected a Hugging Face model directory "
                             "or 'tiny')")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{cfg_path}: cannot read: {e}") from None
        if not isinstance(raw, dict):
            raise ModelError(f"{cfg_path}: not a JSON object")
        cfg = cls.from_dict(raw)
        # Instruct models list their end-of-turn tokens in generation_config.json
        # (Llama 3: <|eot_id|> beside <|end_of_text|>): they end a chat answer too.
        extra = _generation_eos(Path(path) / "generation_config.json")
        return replace(cfg, eos_token_ids=tuple(sorted(set(cfg.eos_token_ids) | set(extra))))

    def fingerprint(self) -> dict:
        """Fields that must agree between two workers sharing KV."""
        return {k: getattr(self, k) for k in (
            "architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "rotary_dim")} | {"rope_scaling": self.rope_scaling}

    def shape(self) -> dict:
        """Every size a checkpoint of this model must have (a weight update's check)."""
        moe = None if self.moe is None else vars(self.moe)
        return self.fingerprint() | {"intermediate_size": self.intermediate_size, "moe": moe}


def _moe(raw: dict, arch: str) -> MoeConfig | None:
    """The mixture of `raw`, by its architecture's names (None for a dense model)."""
    router = ROUTERS.get(arch)
    if router is None:
        return None
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0)
    layers = int(raw["num_hidden_layers"])
    if arch == "Qwen3MoeForCausalLM":
        step, only = int(raw.get("decoder_sparse_step", 1) or 1), set(raw.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step)
    elif arch == "Glm4MoeForCausalLM":
        dense = tuple(range(min(layers, int(raw.get("first_k_dense_replace", 0)))))
    else:
        dense = ()
    return MoeConfig(
        router=router, num_experts=experts, top_k=int(raw.get("num_experts_per_tok", 2)),
        intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        dense_layers=dense,
        norm_topk_prob=bool(raw.get("norm_topk_prob", arch == "MixtralForCausalLM")),
        n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        shared_experts=int(raw.get("n_shared_experts") or 0))


def _check_moe(m: MoeConfig) -> None:
    if m.num_experts < 1 or not 1 <= m.top_k <= m.num_experts:
        raise ModelError(f"a mixture of {m.num_experts} experts cannot route each token to {m.top_k}")
    if m.router == "grouped_sigmoid":
        if m.n_group < 1 or m.num_experts % m.n_group or not 1 <= m.topk_group <= m.n_group:
            raise ModelError(f"n_group {m.n_group} / topk_group {m.topk_group} do not split "
                             f"{m.num_experts} experts")
        if m.num_experts // m.n_group < 2 or m.top_k > m.topk_group * (m.num_experts // m.n_group):
            raise ModelError(f"top {m.top_k} of {m.topk_group} groups of {m.num_experts // m.n_group} "
                             "experts cannot be chosen")


def _rotary_dim(raw: dict, head_dim: int) -> int | None:
    """GLM-4.5's partial rotary: only each head's first `partial_rotary_factor` part turns."""
    factor = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
    if factor is None or float(factor) == 1.0:
        return None
    dim = int(head_dim * float(factor))
    if dim < 2 or dim % 2:
        raise ModelError(f"partial_rotary_factor {factor} leaves {dim} of {head_dim} dims to rotate")
    return dim


def _max_position(raw: dict) -> int:
    limit = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    # Sliding-window attention is not implemented: cap the context at the window so
    # every position we compute is exact rather than silently wrong.
    if window and raw.get("use_sliding_window", True):
        limit = min(limit, int(window))
    return limit


def _rope_scaling(raw: dict) -> dict | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelError(f"unsupported rope scaling {kind!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items()
            if k not in ("rope_theta", "partial_rotary_factor")} | {"rope_type": kind}


def _generation_eos(path: Path) -> tuple[int, ...]:
    if not path.is_file():
        return ()
    try:
        return _as_ids(json.loads(path.read_text()).get("eos_token_id"))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ModelError(f"{path}: malformed: {e}") from None


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
