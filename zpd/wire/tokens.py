"""The token stream: ``Tokens``, the one wire message that carries generated tokens
(worker → router → client, many requests per send), and ``TokenPart``, one request's
share of it in memory. Its codec is ``zpd.wire.protocol``'s, like every message's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from zpd.wire.messages import Message, ProtocolError


@dataclass(frozen=True, slots=True)
class TokenPart:
    """One request's share of a ``Tokens`` message, in memory only (never sent alone):
    its new tokens, one weight version each. ``finish`` is the finish_reason once the
    request has ended, ``meta`` its final meta. ``logprobs`` (one per token) only when
    the request asked for logprobs, ``top_logprobs`` (per token, [(token id, logprob),
    ...] highest first) only when it asked for top logprobs, ``ids_logprobs`` (per
    token, the logprobs of its token_ids_logprob ids, in the order asked) only when it
    asked for those; None otherwise. ``start``: the index of its first token in the
    request's output, where its sender knows it (a worker always does), so that a
    client drops the tokens it has already (``zpd.wire.resume.Resumes.got``): the
    router passes a decode's tokens on without looking inside them."""

    rid: str
    token_ids: list[int]
    weight_versions: list[str]
    finish: Optional[dict] = None
    meta: dict = field(default_factory=dict)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    ids_logprobs: Optional[list[list[float]]] = None
    start: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def logprob_mode(self) -> int:
        """What the part carries besides tokens: 0 nothing, 1 logprobs, 2 logprobs and
        top logprobs (the per-rid value of ``Tokens.logprob_mode``)."""
        return 0 if self.logprobs is None else 1 if self.top_logprobs is None else 2

    def skip(self, n: int) -> "TokenPart":
        """The part without its first `n` tokens (and their logprobs)."""
        return TokenPart(self.rid, self.token_ids[n:], self.weight_versions[n:], self.finish,
                         self.meta, _tail(self.logprobs, n), _tail(self.top_logprobs, n),
                         _tail(self.ids_logprobs, n),
                         None if self.start is None else self.start + n)

    def then(self, later: "TokenPart") -> "TokenPart":
        """This part followed by a later one of the same request; the later one's
        finish and meta win."""
        return TokenPart(self.rid, self.token_ids + later.token_ids,
                         self.weight_versions + later.weight_versions, later.finish, later.meta,
                         _join(self.logprobs, later.logprobs),
                         _join(self.top_logprobs, later.top_logprobs),
                         _join(self.ids_logprobs, later.ids_logprobs), self.start)

    @classmethod
    def abort(cls, rid: str, status: int, message: str, meta: Optional[dict] = None) -> "TokenPart":
        """A request's final answer when it ends in an abort or failure (``status``: a
        DESIGN status code); the one place that builds that finish_reason."""
        return cls(rid, [], [], {"type": "abort", "status_code": status, "message": message},
                   dict(meta or {}))


@dataclass(frozen=True, slots=True)
class Tokens(Message):
    """Worker → router → client: new tokens of one or more requests, so a decode step
    costs one send per peer instead of one per request. Parallel arrays: request
    ``rids[i]`` gets the next ``counts[i]`` entries of ``token_ids`` and
    ``weight_versions``; ``ends`` maps each finished rid to ``{"finish": finish_reason,
    "meta": meta}``. ``first``: a streamed request's first token, sent by its prefill
    straight to the router ahead of the KV write (the decode sends it again later).

    Logprobs, only for the requests that asked (all None, no frame, when none in the
    message did): ``logprob_mode[i]`` is rid i's ``TokenPart.logprob_mode`` (0, 1, 2);
    ``logprobs`` (float32) has one entry per token of each rid with mode 1 or 2, in
    order; ``top_counts`` one per token of each rid with mode 2, the number of its
    alternatives, whose ids and logprobs are the next that many entries of ``top_ids``
    and ``top_logprobs`` (float32). ``ids_counts``: one per rid, how many token_ids_logprob
    ids each of its tokens has logprobs for (0: it asked none; only with logprobs),
    their logprobs the next that many entries of ``ids_logprobs`` (float32), token by
    token (the ids themselves are the request's own, not sent). ``starts``: one per rid,
    its part's ``start`` (-1: not known); None when no part knows its start."""

    TYPE: ClassVar[str] = "tokens"
    rids: list[str]
    counts: list[int]
    token_ids: list[int]
    weight_versions: list[str]
    ends: dict = field(default_factory=dict)
    first: bool = False
    logprob_mode: Optional[list[int]] = None
    logprobs: Optional[list[float]] = None
    top_counts: Optional[list[int]] = None
    top_ids: Optional[list[int]] = None
    top_logprobs: Optional[list[float]] = None
    ids_counts: Optional[list[int]] = None
    ids_logprobs: Optional[list[float]] = None
    starts: Optional[list[int]] = None

    def __post_init__(self) -> None:
        counts = self.counts
        if len(counts) != len(self.rids) or (counts and min(counts) < 0):
            raise ProtocolError(f"tokens: {len(self.counts)} counts for {len(self.rids)} rids")
        if sum(counts) != len(self.token_ids) or len(self.token_ids) != len(self.weight_versions):
            raise ProtocolError(f"tokens: counts sum to {sum(self.counts)} but there are "
                                f"{len(self.token_ids)} ids and {len(self.weight_versions)} versions")
        rids = set(self.rids)
        if len(rids) != len(self.rids):
            raise ProtocolError("tokens: a rid appears twice")
        for rid, end in self.ends.items():
            # An end without a finish_reason would make the part look unfinished.
            if rid not in rids or type(end) is not dict or type(end.get("finish")) is not dict \
                    or type(end.get("meta", {})) is not dict:
                raise ProtocolError(f"tokens: bad end for rid {rid!r}")
        if self.starts is not None and (len(self.starts) != len(self.rids)
                                        or (self.starts and min(self.starts) < -1)):
            raise ProtocolError(f"tokens: {len(self.starts)} starts for {len(self.rids)} rids")
        self._check_logprobs()
        self._check_ids_logprobs()

    def _check_logprobs(self) -> None:
        """Every logprob array holds exactly what ``logprob_mode`` and the counts say."""
        mode = self.logprob_mode
        if mode is None:
            if (self.logprobs, self.top_counts, self.top_ids, self.top_logprobs) != (None,) * 4:
                raise ProtocolError("tokens: logprob arrays without logprob_mode")
            return
        if len(mode) != len(self.rids) or any(m not in (0, 1, 2) for m in mode):
            raise ProtocolError(f"tokens: logprob_mode {mode[:8]} for {len(self.rids)} rids")
        with_logprobs = sum(c for c, m in zip(self.counts, mode) if m)
        if self.logprobs is None or len(self.logprobs) != with_logprobs:
            raise ProtocolError(f"tokens: {with_logprobs} tokens with logprobs but "
                                f"{_size(self.logprobs)} logprobs")
        with_top = sum(c for c, m in zip(self.counts, mode) if m == 2)
        if 2 not in mode:
            if (self.top_counts, self.top_ids, self.top_logprobs) != (None,) * 3:
                raise ProtocolError("tokens: top logprobs where no rid has mode 2")
            return
        if self.top_counts is None or len(self.top_counts) != with_top or \
                any(n < 0 for n in self.top_counts):
            raise ProtocolError(f"tokens: {with_top} tokens with top logprobs but top_counts "
                                f"has {_size(self.top_counts)}")
        alternatives = sum(self.top_counts)
        if _size(self.top_ids) != alternatives or _size(self.top_logprobs) != alternatives:
            raise ProtocolError(f"tokens: top_counts sum to {alternatives} but there are "
                                f"{_size(self.top_ids)} ids and {_size(self.top_logprobs)} logprobs")

    def _check_ids_logprobs(self) -> None:
        """``ids_logprobs`` holds exactly what ``ids_counts`` and the counts say, and only
        rids with logprobs have any."""
        per = self.ids_counts
        if per is None:
            if self.ids_logprobs is not None:
                raise ProtocolError("tokens: ids_logprobs without ids_counts")
            return
        mode = self.logprob_mode or [0] * len(self.rids)
        if len(per) != len(self.rids) or any(k < 0 or (k and not m) for k, m in zip(per, mode)):
            raise ProtocolError(f"tokens: ids_counts {per[:8]} for {len(self.rids)} rids "
                                f"with logprob_mode {mode[:8]}")
        entries = sum(c * k for c, k in zip(self.counts, per))
        if _size(self.ids_logprobs) != entries:
            raise ProtocolError(f"tokens: ids_counts ask {entries} ids_logprobs but there "
                                f"are {_size(self.ids_logprobs)}")

    @classmethod
    def pack(cls, parts: Sequence[TokenPart], first: bool = False) -> "Tokens":
        """One message for many parts (distinct rids). One pass over the parts: the
        router packs one per client per decode step, so this is per-token work."""
        rids, counts, ids, versions, ends, plain = [], [], [], [], {}, True
        starts, known = [], False
        for t in parts:
            if t.start is None:
                starts.append(-1)
            else:
                starts.append(t.start)
                known = True
            rids.append(t.rid)
            counts.append(len(t.token_ids))
            ids += t.token_ids
            versions += t.weight_versions
            if t.finish is not None:
                ends[t.rid] = {"finish": t.finish, "meta": t.meta}
            if t.logprobs is not None or t.ids_logprobs is not None:
                plain = False
        extra = {} if plain else _pack_logprobs(parts) | _pack_ids_logprobs(parts)
        if known:
            extra["starts"] = starts
        return cls(rids, counts, ids, versions, ends, first, **extra)

    @classmethod
    def abort(cls, rid: str, status: int, message: str, meta: Optional[dict] = None) -> "Tokens":
        """The whole message that ends one request with ``status`` (see TokenPart.abort)."""
        return cls.pack([TokenPart.abort(rid, status, message, meta)])

    def unpack(self) -> list[TokenPart]:
        """The parts, in order."""
        if self.logprob_mode is None and self.ids_counts is None:
            return self._unpack_plain()
        out, at = [], 0
        logprobs = _Reader(self.logprobs or [])
        counts, ids, values = (_Reader(a or []) for a in (self.top_counts, self.top_ids,
                                                          self.top_logprobs))
        asked = _Reader(self.ids_logprobs or [])
        nones = [0] * len(self.rids)
        starts = self.starts or [-1] * len(self.rids)
        for rid, n, mode, per, start in zip(self.rids, self.counts, self.logprob_mode or nones,
                                            self.ids_counts or nones, starts):
            end = self.ends.get(rid) or {}
            top = None if mode < 2 else [list(zip(ids.take(k), values.take(k)))
                                         for k in counts.take(n)]
            out.append(TokenPart(rid, self.token_ids[at:at + n], self.weight_versions[at:at + n],
                                 end.get("finish"), end.get("meta", {}),
                                 logprobs.take(n) if mode else None, top,
                                 [asked.take(per) for _ in range(n)] if per else None,
                                 None if start < 0 else start))
            at += n
        return out

    def _unpack_plain(self) -> list[TokenPart]:
        """`unpack` of a message without logprobs (most are): per-token work at the
        router, so no readers and no per-part logprob slots to fill."""
        out, at, ends, ids, versions = [], 0, self.ends, self.token_ids, self.weight_versions
        starts = self.starts or [-1] * len(self.rids)
        for rid, n, start in zip(self.rids, self.counts, starts):
            end = ends.get(rid)
            first = None if start < 0 else start
            if end is None:
                out.append(TokenPart(rid, ids[at:at + n], versions[at:at + n], start=first))
            else:
                out.append(TokenPart(rid, ids[at:at + n], versions[at:at + n], end["finish"],
                                     end.get("meta", {}), start=first))
            at += n
        return out


def _pack_logprobs(parts: Sequence[TokenPart]) -> dict:
    """``Tokens``' logprob fields for `parts`: none at all when no part has logprobs."""
    modes = [t.logprob_mode for t in parts]
    if not any(modes):
        return {}
    out = {"logprob_mode": modes, "logprobs": [v for t in parts for v in t.logprobs or []]}
    if 2 in modes:
        tops = [top for t in parts for top in t.top_logprobs or []]
        out |= {"top_counts": [len(top) for top in tops],
                "top_ids": [i for top in tops for i, _ in top],
                "top_logprobs": [v for top in tops for _, v in top]}
    return out


def _pack_ids_logprobs(parts: Sequence[TokenPart]) -> dict:
    """``Tokens``' token_ids_logprob fields for `parts` (none when no part has any); a
    part's tokens must each have as many."""
    if all(t.ids_logprobs is None for t in parts):
        return {}
    per = [len(t.ids_logprobs[0]) if t.ids_logprobs else 0 for t in parts]
    if any(len(row) != k for t, k in zip(parts, per) for row in t.ids_logprobs or []):
        raise ProtocolError("tokens: a part's tokens have ids_logprobs of different lengths")
    return {"ids_counts": per, "ids_logprobs": [v for t in parts for row in t.ids_logprobs or []
                                                for v in row]}


class _Reader:
    """Consecutive slices of one list."""

    def __init__(self, values: list) -> None:
        self.values, self.at = values, 0

    def take(self, n: int) -> list:
        self.at += n
        return self.values[self.at - n:self.at]


def _size(values: Optional[list]) -> int:
    return -1 if values is None else len(values)


def _tail(values: Optional[list], n: int) -> Optional[list]:
    return None if values is None else values[n:]


def _join(a: Optional[list], b: Optional[list]) -> Optional[list]:
    return None if a is None and b is None else (a or []) + (b or [])
