"""A request's routed experts (SGLang's `return_routed_experts`), for a trainer that
replays the rollout's routing.

Row i is the routing of the forward that took token i as input: every layer
(num_hidden_layers; a dense layer's row is zeros) times the num_experts_per_tok
experts chosen, in the order of the score they were chosen by. A finished request of
P prompt and O output tokens has P + O - 1 rows (its last token was never an input);
the answer is SGLang's: base64 of the little-endian int32 array, and beyond SGLang the
gate weights of those experts (float32, after normalisation and scaling) the same way.

The prompt's rows come from the prefill (a recompute's replace them all, under the
new weights), each output token's from the decode step that fed it. Inside zpd the
ids are kept and sent compact (engines/routed_wire.py): uint8 where the model has at
most 256 experts.
"""
from __future__ import annotations

import numpy as np
import torch

from engines.config import ModelConfig
from engines.routed_wire import (ID_BYTES, MAX_ROUTED_IDS, MAX_ROUTED_WEIGHTS, WEIGHT_BYTES,
                                 float32_base64, id_dtype, int32_base64, joined, pieces)

TORCH_IDS = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}
_ID_NAMES = {t: name for name, t in TORCH_IDS.items()}


class RoutedExperts:
    """The rows of one request so far: ids [n, layers, k] in the model's compact dtype
    (`compact`) and, where asked, the weights [n, layers, k] float32, kept as the chunks
    they came in."""

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
        kept, routed_expert_weights (what zpd's clients make of `wire`'s bytes)."""
        dtype, ids, weights = self.wire(rows)
        out = {"routed_experts": int32_base64(ids, dtype)}
        if weights is not None:
            out["routed_expert_weights"] = float32_base64(weights)
        return out

    def wire(self, rows: int) -> tuple[str, bytes, bytes | None]:
        """The first `rows` rows as they travel: the ids' dtype, the ids and the weights
        (None where not kept), flat little-endian bytes."""
        ids = self.ids()[:rows]
        w = self.weights()
        return _ID_NAMES[ids.dtype], _le_bytes(ids), None if w is None else _le_bytes(w[:rows])


def routing_of(wants: list[str | None]) -> str | None:
    """What one forward records for requests that each want None, "ids" or "weights":
    the most any of them asks."""
    return "weights" if "weights" in wants else ("ids" if "ids" in wants else None)


def row_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(layers, experts per token) of one row; the model must be a mixture."""
    return cfg.num_layers, cfg.moe.top_k


def compact(ids: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """`ids` in the narrowest dtype that holds the model's expert ids (a copy)."""
    return ids.to(TORCH_IDS[id_dtype(cfg.moe.num_experts)], copy=True)


def from_pieces(cfg: ModelConfig, rows: int, ids: list[bytes] | None,
                weights: list[bytes] | None, want_weights: bool) -> RoutedExperts | str:
    """The rows a peer sent in pieces (a kv_done's), or what is wrong with them."""
    layers, k = row_shape(cfg)
    n, dtype = rows * layers * k, id_dtype(cfg.moe.num_experts)
    size = 0 if ids is None else sum(map(len, ids))
    if ids is None or size != n * ID_BYTES[dtype]:
        return f"no routed experts for {rows} positions ({n} ids of {dtype}, got " \
               f"{'none' if ids is None else f'{size} bytes'})"
    if want_weights and (weights is None or sum(map(len, weights)) != n * WEIGHT_BYTES):
        return f"no routed expert weights for {rows} positions"
    got = _from_le(joined(ids), dtype).view(rows, layers, k)
    if n and not (int(got.min()) >= 0 and int(got.max()) < cfg.moe.num_experts):
        return f"routed expert ids outside [0, {cfg.moe.num_experts})"
    w = _from_le(joined(weights), "float32").view(rows, layers, k) if want_weights else None
    return RoutedExperts(got, w)


def piece_fields(routed: RoutedExperts | None) -> dict:
    """A kv_done's routed fields: the prefill's rows, in pieces (none if it kept none)."""
    if routed is None:
        return {}
    _, ids, weights = routed.wire(routed.rows)
    out = {"routed_experts": pieces(ids)}
    if weights is not None:
        out["routed_expert_weights"] = pieces(weights)
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
    positions = max_context - 1
    for what, budget, asked in (("ids", MAX_ROUTED_IDS, True),
                                ("weights", MAX_ROUTED_WEIGHTS, want == "weights")):
        if asked and positions * layers * k > budget:
            field = "return_routed_experts" if what == "ids" else "return_routed_expert_weights"
            return (f"{field}: prompt + max_new_tokens - 1 = {positions} positions x {layers} "
                    f"layers x {k} experts are {positions * layers * k} {what}, more than "
                    f"{budget} in one answer: at most {budget // (layers * k)} positions")
    return None


def _le_bytes(t: torch.Tensor) -> bytes:
    """`t`'s values as little-endian bytes, whatever this host's order."""
    a = t.contiguous().numpy()
    return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _from_le(data: bytes, dtype: str) -> torch.Tensor:
    """A tensor of the little-endian `dtype` values in `data` (a copy: its own memory)."""
    a = np.frombuffer(data, np.dtype(dtype).newbyteorder("<"))
    return torch.from_numpy(a.astype(np.dtype(dtype), copy=True))
