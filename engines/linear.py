"""The model's matrix products, with bfloat16 weights prepacked for oneDNN on CPU.

A bfloat16 `F.linear` on CPU re-blocks its weight on every call. oneDNN can keep each
weight in its own blocked layout instead (the layout torch's compiler uses for frozen
CPU graphs). Over SmolLM2's 121 products on two threads here (6 alternating rounds,
median ms): 1 row 30.9 -> 24.4, 16 rows 33.3 -> 25.4, 64 rows 52.1 -> 33.7, 256 rows
102 -> 92, but 1,024 rows 588 -> 652; so inputs of up to PACK_MAX_ROWS rows (decode
steps, short prompts) use the packed copy and longer ones the plain weight. In the
engine a batch-1 decode step of SmolLM2 measured 12-18% faster. The packed copy is derived
from the parameter and rebuilt when the parameter changes (a weight update copies into
it, a trainer push swaps its storage), so every writer of weights stays as it is. The
cost is memory: a second copy of each bfloat16 projection and the head.

Other dtypes and devices call `F.linear` unchanged: float32 weights are held
column-major instead (LlamaForCausalLM.column_major_float32), which was faster there.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("zpd.engine")

PACK_BATCH_HINT = 16          # the batch oneDNN picks its blocking for; any batch runs
PACK_MAX_ROWS = 256           # longer inputs measured faster with the plain weight


def _supported() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


class PackedWeights:
    """oneDNN-packed copies of bfloat16 CPU weights, each held on its parameter with the
    storage and in-place version it was packed from, so a stale copy is never used."""

    ATTR = "_zpd_onednn"

    def __init__(self) -> None:
        self.enabled = _supported()

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.enabled or w.dtype != torch.bfloat16 or w.device.type != "cpu" \
                or x.dim() != 2 or x.shape[0] > PACK_MAX_ROWS:
            return F.linear(x, w, bias)
        try:
            key = (w.data_ptr(), w._version)
        except RuntimeError:                   # an inference tensor counts no versions
            return F.linear(x, w, bias)
        got = getattr(w, self.ATTR, None)
        if got is None or got[0] != key:
            try:
                got = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT))
            except RuntimeError as e:          # a torch without the op: plain products from now on
                log.warning("oneDNN weight packing unavailable (%s); using F.linear", e)
                self.enabled = False
                return F.linear(x, w, bias)
            setattr(w, self.ATTR, got)
        return torch.ops.mkldnn._linear_pointwise(x, got[1], bias, "none", [], "")

    def packed(self, w: torch.Tensor) -> bool:
        """Whether `w` holds a packed copy of its current values."""
        got = getattr(w, self.ATTR, None)
        return got is not None and got[0] == (w.data_ptr(), w._version)


PACKED = PackedWeights()
linear = PACKED.linear
