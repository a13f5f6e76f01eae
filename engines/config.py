"""Model configuration: the Llama family read from a Hugging Face config.json."""
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
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ModelError(ValueError):
    """A model directory, config or checkpoint that cannot be used."""


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
                qk_norm=qk_norm,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
            )
        except KeyError as e:
            raise ModelError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelError(f"config.json has a malformed field: {e}") from None
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu'")
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
            "num_kv_heads", "head_dim", "rope_theta")} | {"rope_scaling": self.rope_scaling}


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
    return {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": kind}


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
