"""Reading a loaded model's weights back by their Hugging Face names, as SGLang's
`/get_weights_by_name` does (a trainer's check that a push landed): the first rows
of one tensor, the part of a packed projection (q/k/v, gate/up) or an expert's
rows included; a tied `lm_head.weight` reads the embedding."""
from __future__ import annotations

import math

import torch
from torch import nn

from engines.config import ModelError
from engines.formats.weights import placement

MAX_VALUES = 1 << 18          # values one answer carries (its JSON stays a few MB)


def first_rows(model: nn.Module, name: str, rows: int) -> torch.Tensor:
    """Tensor `name`'s first `rows` rows (along its first dimension), a view of the
    model's own weights; ModelError names what is wrong."""
    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    try:
        where = placement(model, name)
    except AttributeError:
        where = None
    params = dict(model.named_parameters())
    if where is None or where[0] not in params:
        raise ModelError(f"no weight named {name!r:.200} in this model")
    pname, start, n = where
    param = params[pname]
    tensor = param if n < 0 else param[start:start + n]
    part = tensor[:rows] if tensor.dim() else tensor
    if part.numel() > MAX_VALUES:
        raise ModelError(f"{rows} rows of {name!r:.200} ({tuple(tensor.shape)}) are "
                         f"{part.numel()} values, more than {MAX_VALUES}: ask fewer rows "
                         f"(truncate_size <= {max(1, MAX_VALUES // max(1, math.prod(tensor.shape[1:])))})")
    return part
