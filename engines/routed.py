"""A request's routed experts (SGLang's `return_routed_experts`), for a trainer that
replays the rollout's routing.

Row i is the routing of the forward that took token i as input: every layer
(num_hidden_layers; a dense layer's row is zeros) times the num_experts_per_tok
experts chosen, in the order of the score they were chosen by. A finished request of
P prompt and O output tokens has P + O - 1 rows (its last token was never an input);
the answer is SGLang's: base64 of the little-endian int32 array, and beyond SGLang the
gate weights of those experts (float32, after normalisation and scaling) the same way.

The prompt's rows come from the prefill (a recompute's replace them all, under the
new weights), each output token's from the decode step that fed it.
"""
from __future__ import annotations

import base64
import sys

import torch

from engines.config import ModelConfig

# The most values (rows x layers x experts per token, twice with weights) one request
# may ask for: its final answer carries them base64 in one message header, which must
# stay well inside the wire's 16 MiB frame (2M int32 are 8 MiB, 10.7 MiB as base64).
MAX_ROUTED_VALUES = 1 << 21


class RoutedExperts:
    """The rows of one request so far: ids [n, layers, k] int32 and, where asked, the
    weights [n, layers, k] float32, kept as the chunks they came in."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        self._ids, self._weights = [ids], ([weights] if weights is not None else None)
        self.rows = ids.shape[0]

    def append(self, ids: torch.Tensor, weights: torch.Tensor | None) -> None:
        """The rows of the next positions."""
        self._ids.append(ids)
        if self._weights is not None:
            self._weights.append(weights)
        self.rows += ids.shape[0]

    def ids(self) -> torch.Tensor:
        self._ids = [torch.cat(self._ids)] if len(self._ids) > 1 else self._ids
        return self._ids[0]

    def weights(self) -> torch.Tensor | None:
        if self._weights is None:
            return None
        self._weights = [torch.cat(self._weights)] if len(self._weights) > 1 else self._weights
        return self._weights[0]

    def fields(self, rows: int) -> dict:
        """The answer's meta fields, of the first `rows` rows: routed_experts and, where
        kept, routed_expert_weights."""
        out = {"routed_experts": _base64(self.ids()[:rows], torch.int32)}
        w = self.weights()
        if w is not None:
            out["routed_expert_weights"] = _base64(w[:rows], torch.float32)
        return out


def routing_of(wants: list[str | None]) -> str | None:
    """What one forward records for requests that each want None, "ids" or "weights":
    the most any of them asks."""
    return "weights" if "weights" in wants else ("ids" if "ids" in wants else None)


def row_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(layers, experts per token) of one row; the model must be a mixture."""
    return cfg.num_layers, cfg.moe.top_k


def from_flat(cfg: ModelConfig, rows: int, ids: list[int] | None,
              weights: list[float] | None, want_weights: bool) -> RoutedExperts | str:
    """The rows a peer sent flat (a kv_done's), or what is wrong with them."""
    layers, k = row_shape(cfg)
    n = rows * layers * k
    if ids is None or len(ids) != n:
        return f"no routed experts for {rows} positions ({n} ids, got " \
               f"{'none' if ids is None else len(ids)})"
    if want_weights and (weights is None or len(weights) != n):
        return f"no routed expert weights for {rows} positions"
    got = torch.tensor(ids, dtype=torch.int32).view(rows, layers, k)
    if n and not bool(((got >= 0) & (got < cfg.moe.num_experts)).all()):
        return f"routed expert ids outside [0, {cfg.moe.num_experts})"
    w = torch.tensor(weights, dtype=torch.float32).view(rows, layers, k) if want_weights else None
    return RoutedExperts(got, w)


def flat_fields(routed: RoutedExperts | None) -> dict:
    """A kv_done's routed fields: the prefill's rows, flat (none if it kept none)."""
    if routed is None:
        return {}
    out = {"routed_experts": routed.ids().flatten().tolist()}
    w = routed.weights()
    if w is not None:
        out["routed_expert_weights"] = w.flatten().tolist()
    return out


def routed_refusal(cfg: ModelConfig, enabled: bool, want: str | None, max_context: int) -> str | None:
    """Why a request asking `want` of routed experts cannot be served here, or None."""
    if want is None:
        return None
    if cfg.moe is None:
        return (f"return_routed_experts: the model ({cfg.architecture}) is dense, not a "
                "mixture of experts: it has no routed experts")
    if not enabled:
        return ("return_routed_experts needs the workers started with "
                "--enable-return-routed-experts")
    layers, k = row_shape(cfg)
    values = (max_context - 1) * layers * k * (2 if want == "weights" else 1)
    if values > MAX_ROUTED_VALUES:
        return (f"return_routed_experts: prompt + max_new_tokens - 1 positions x {layers} layers "
                f"x {k} experts{' x 2 (with weights)' if want == 'weights' else ''} are {values} "
                f"values, more than {MAX_ROUTED_VALUES} in one answer: ask fewer tokens")
    return None


def _base64(t: torch.Tensor, dtype: torch.dtype) -> str:
    data = t.to(dtype).contiguous()
    if sys.byteorder == "big":
        data = data.view(torch.uint8).view(-1, 4).flip(1)
    return base64.b64encode(data.numpy().tobytes()).decode("ascii")
