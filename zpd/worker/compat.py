"""Whether two workers may exchange KV: the hash both announce in their hello."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from engines.config import ModelConfig
from engines.kv.layout import KVLayout


def compat_hash(model, layout: KVLayout, cfg: ModelConfig | None = None) -> str:
    """Two workers may exchange KV only if this matches: same model shape, same
    KV layout and dtype, same tokenizer and chat template (both sides turn a text or a
    conversation into ids, and must get the same ones). `cfg` is the whole model's
    (`model.cfg` unless given: at --tp > 1 a rank's model and `layout` hold part of
    the heads): the hash names every kv head, never one rank's, so a prefill and a
    decode of different TP sizes match."""
    cfg = cfg or model.cfg
    tok = model.tokenizer.to_json() if model.tokenizer is not None else ""
    chat = model.chat.source if model.chat is not None else ""
    whole = replace(layout, num_kv_heads=cfg.num_kv_heads)
    blob = json.dumps({"model": cfg.fingerprint(), "layout": whole.to_dict(),
                       "tokenizer": hashlib.sha256(tok.encode()).hexdigest(),
                       "chat": hashlib.sha256(chat.encode()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]

