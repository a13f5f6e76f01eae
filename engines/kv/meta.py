"""What one forward pass needs to know about its batch's pages: where each token's
keys and values go, and what each sequence attends to. Built by the runner (and, for
decode attention, by its backend's `prepare`), read by the backend's attention."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PrefillMeta:
    """A packed batch of prompts: sequence i computes seq_lens[i] tokens. With a cached
    prefix (starts[i] > 0) its tokens also attend to the KV of positions
    0..starts[i]-1, already in the pool at context_rows[i]."""
    seq_lens: list[int]
    write_rows: torch.Tensor      # [T] pool row of each token for layer 0, K
    starts: list[int] | None = None                       # None: no sequence has a prefix
    context_rows: list[torch.Tensor | None] | None = None  # [starts[i]] rows, layer 0, K
    last: LastTokens | None = None                        # None: every token's output is read
    scored: ScoredRows | None = None                      # with `last`: rows for prompt logprobs


@dataclass
class DecodeMeta:
    """One new token per sequence, attending to its whole context through its pages:
    `reads` says where, in the form the backend's decode attention reads it (its
    `prepare` makes it: torch's, groups of similar length; the CPU kernel's, every
    context's rows)."""
    write_rows: torch.Tensor      # [B] pool row of the new token for layer 0, K
    reads: Any


@dataclass
class LastTokens:
    """The tokens of a prefill whose output is read: each sequence's last, for its
    logits. The model's last layer computes only them past the KV write (the other
    tokens' keys and values are all any later step reads of that layer), their
    attention a decode step's over the pool, where the layer has just written every
    token's keys and values; forward returns [B, hidden]. The others' attention, o_proj
    and MLP in that layer were ~1/30 of SmolLM2's prefill."""
    rows: torch.Tensor            # [B] their rows in the packed batch
    attend: DecodeMeta            # their attention, each to its whole sequence


@dataclass
class ScoredRows:
    """The tokens of a prefill whose logits give prompt logprobs (engines/prompt_logprobs.py):
    a run of consecutive positions per sequence that asks. The last layer computes them
    in a pass of its own after `LastTokens`' (forward returns theirs after the last
    tokens' rows), so each prompt's last logits are the same bits whether or not its
    batch asks for logprobs. Their attention is a prefill's: each run a sequence whose
    positions before it are a cached prefix in the pool (`attend`)."""
    rows: torch.Tensor            # [R] their rows in the packed batch
    attend: PrefillMeta           # the runs as sequences
