"""A request's sampling parameters and their bounds. Plain Python, no torch: the
command line and the HTTP front check them before anything loads a model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from engines.constraint import GRAMMAR_KINDS, MAX_GRAMMAR_CHARS, Constraint

# Bounds checked at admission (docs/serving.md, "zpd run", lists them). Outside them the
# sampler's arithmetic breaks in float32, the narrowest dtype it computes in: a
# temperature or top_p that rounds to 0 divides by zero, a top_k past int64 cannot
# become a tensor, a tiny or huge repetition penalty overflows the logits.
TEMPERATURE_RANGE = (1e-5, 100.0)        # or exactly 0: greedy
TOP_P_MIN = 1e-6                         # far above float32's smallest normal
INT32_MAX = 2**31 - 1                    # top_k, max_new_tokens, stop token ids
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_MAX = 2.0                        # |frequency_penalty|, |presence_penalty| (OpenAI's range)
SEED_RANGE = (-2**63, 2**63 - 1)         # int64, what the wire and torch carry
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 256   # each step decodes the tail they could end in
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20                    # top_logprobs_num (OpenAI's bound for top_logprobs)
MAX_TOKEN_IDS_LOGPROB = 64               # token_ids_logprob: each prompt position carries one each


def _integer(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _real(value: object, low: float, high: float) -> bool:
    """A number in [low, high]; NaN and infinities fail the comparison."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; a value outside the bounds above raises ValueError
    naming the parameter (status 400 at a worker)."""
    max_new_tokens: int = 128           # 0: score the prompt (its logprobs), generate nothing
    min_new_tokens: int = 0              # no EOS, stop token or stop string finishes it before
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # over prompt and output; > 1 discourages repeats
    frequency_penalty: float = 0.0       # per occurrence in the output
    presence_penalty: float = 0.0        # once per token present in the output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    return_logprob: bool = False         # report each output token's logprob
    top_logprobs_num: int = 0            # and its N most likely alternatives (> 0 implies logprobs)
    # With logprobs: also the prompt's, from this position on (SGLang's; -1: none). The
    # worker refuses a start at or past the prompt's end (engines.request.validate).
    logprob_start_len: int = -1
    token_ids_logprob: tuple[int, ...] = ()   # and these ids' logprobs at each prompt and output position
    # Each position's routed experts (a mixture of experts; workers started with
    # --enable-return-routed-experts: engines/routed.py), and their gate weights.
    return_routed_experts: bool = False
    return_routed_expert_weights: bool = False
    # Constrained decoding (SGLang's names; engines/grammar.py): at most one of them, the
    # text of a regular expression, a JSON schema, or an EBNF (GBNF or Lark) grammar.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        for name, ok in self._oks():
            if not ok:
                raise ValueError(f"{name} must be {_BOUNDS[name]}, got {_show(getattr(self, name))}")
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of regex, json_schema and ebnf may be given, got "
                             f"{' and '.join(given)}")

    def _checks(self) -> list[tuple[str, bool, str]]:
        """(parameter, within bounds, the bounds in words), in field order."""
        return [(name, ok, _BOUNDS[name]) for name, ok in self._oks()]

    def _oks(self) -> list[tuple[str, bool]]:
        """(parameter, within bounds), in field order: once per request at the router
        and at each worker, so the words (`_BOUNDS`) are written once."""
        t_low, t_high = TEMPERATURE_RANGE
        r_low, r_high = REPETITION_PENALTY_RANGE
        return [
            ("max_new_tokens", _integer(self.max_new_tokens, 0, INT32_MAX)),
            ("min_new_tokens", _integer(self.min_new_tokens, 0, _bound(self.max_new_tokens))),
            ("temperature", _real(self.temperature, 0, 0) or _real(self.temperature, t_low, t_high)),
            ("top_p", _real(self.top_p, TOP_P_MIN, 1.0)),
            ("top_k", _integer(self.top_k, -1, INT32_MAX)),
            ("min_p", _real(self.min_p, 0.0, 1.0)),
            ("repetition_penalty", _real(self.repetition_penalty, r_low, r_high)),
            ("frequency_penalty", _real(self.frequency_penalty, -PENALTY_MAX, PENALTY_MAX)),
            ("presence_penalty", _real(self.presence_penalty, -PENALTY_MAX, PENALTY_MAX)),
            ("stop", _stop_ok(self.stop)),
            ("stop_token_ids", _stop_ids_ok(self.stop_token_ids)),
            ("ignore_eos", isinstance(self.ignore_eos, bool)),
            ("seed", self.seed is None or _integer(self.seed, *SEED_RANGE)),
            ("return_logprob", isinstance(self.return_logprob, bool)),
            ("top_logprobs_num", _integer(self.top_logprobs_num, 0, MAX_TOP_LOGPROBS)),
            ("logprob_start_len", _integer(self.logprob_start_len, -1, INT32_MAX)),
            ("token_ids_logprob", _ids_ok(self.token_ids_logprob, MAX_TOKEN_IDS_LOGPROB)),
            ("return_routed_experts", isinstance(self.return_routed_experts, bool)),
            ("return_routed_expert_weights", isinstance(self.return_routed_expert_weights, bool)),
        ] + [(k, _grammar_ok(getattr(self, k))) for k in GRAMMAR_KINDS]

    @classmethod
    def from_dict(cls, raw: dict | None) -> "SamplingParams":
        """The record from the caller's or a peer's dict: the one check of sampling
        parameters (the CLI's, the clients', the HTTP front's and the wire decode's)."""
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"sampling parameters must be an object, got {type(raw).__name__}")
        raw = dict(raw or {})
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(sorted(map(str, unknown)))}")
        for key in ("stop", "stop_token_ids", "token_ids_logprob"):
            if key in raw:
                raw[key] = _as_tuple(raw[key])
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"bad sampling parameters: {e}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        return d | {"stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids),
                    "token_ids_logprob": list(self.token_ids_logprob)}

    def to_wire(self) -> dict:
        """The parameters that differ from their defaults, JSON-ready: what a generate
        or recompute carries (the receiver's ``from_dict`` fills in the rest). Once per
        request at the router: only those that differ are looked at twice."""
        out = {}
        for name, default in _DEFAULTS:
            value = getattr(self, name)
            if value != default:
                out[name] = list(value) if type(value) is tuple else value
        return out

    @property
    def constraint(self) -> Constraint | None:
        """The grammar its output must follow, or None."""
        return next((Constraint(k, getattr(self, k)) for k in GRAMMAR_KINDS
                     if getattr(self, k) is not None), None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def scores_only(self) -> bool:
        """max_new_tokens 0: a prefill computes the prompt (and the logprobs it asks for)
        and the request ends there, with no output token."""
        return self.max_new_tokens == 0

    @property
    def wants_logprobs(self) -> bool:
        return self.return_logprob or self.top_logprobs_num > 0

    @property
    def output_ids_logprob(self) -> tuple[int, ...]:
        """The ids whose logprobs each output position reports (none without logprobs)."""
        return self.token_ids_logprob if self.wants_logprobs else ()

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first prompt position whose logprob the request asks for, or None."""
        return self.logprob_start_len if self.wants_logprobs and self.logprob_start_len >= 0 else None

    @property
    def routing(self) -> str | None:
        """What the request asks of its routed experts: None, "ids", or "weights" (the
        weights with the ids: asking the weights alone asks both)."""
        if self.return_routed_expert_weights:
            return "weights"
        return "ids" if self.return_routed_experts else None

    @property
    def filtered(self) -> bool:
        """Top-k, top-p or min-p cut the distribution (they need it sorted)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty or self.presence_penalty)


def _bound(max_new_tokens: object) -> int:
    """max_new_tokens as min_new_tokens' upper bound (0 when it is itself invalid, whose
    own check then names it first)."""
    return max_new_tokens if _integer(max_new_tokens, 0, INT32_MAX) else 0


def _as_tuple(value: object) -> object:
    """A single stop string or id, or a list of them, as a tuple; anything else is
    left as it is for the check to name."""
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _stop_ok(stop: object) -> bool:
    return isinstance(stop, tuple) and len(stop) <= MAX_STOP_STRINGS and \
        all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)


def _grammar_ok(text: object) -> bool:
    return text is None or isinstance(text, str) and 0 < len(text) <= MAX_GRAMMAR_CHARS


def _stop_ids_ok(ids: object) -> bool:
    return _ids_ok(ids, MAX_STOP_TOKEN_IDS)


def _ids_ok(ids: object, most: int) -> bool:
    return isinstance(ids, tuple) and len(ids) <= most and all(_integer(t, 0, INT32_MAX) for t in ids)


def _show(value: object) -> str:
    """The refused value, short (a huge int has no repr: Python refuses to print it)."""
    if isinstance(value, (tuple, list, dict)):
        return f"{type(value).__name__} of {len(value)}"
    try:
        text = repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:37] + "..."


# (name, default) of every parameter, in field order: `to_wire`'s, read once
_DEFAULTS = tuple((f.name, f.default) for f in fields(SamplingParams))


def _bounds() -> dict[str, str]:
    """Each parameter's bounds in words, for its error."""
    t_low, t_high = TEMPERATURE_RANGE
    r_low, r_high = REPETITION_PENALTY_RANGE
    return {
        "max_new_tokens": f"an integer in [0, {INT32_MAX}] (0: score the prompt only)",
        "min_new_tokens": "an integer in [0, max_new_tokens]",
        "temperature": f"0 (greedy) or in [{t_low}, {t_high:g}]",
        "top_p": f"in [{TOP_P_MIN}, 1]",
        "top_k": f"-1 or 0 (no limit) or in [1, {INT32_MAX}]",
        "min_p": "in [0, 1]",
        "repetition_penalty": f"in [{r_low}, {r_high:g}]",
        "frequency_penalty": f"in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]",
        "presence_penalty": f"in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]",
        "stop": f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
        "stop_token_ids": f"at most {MAX_STOP_TOKEN_IDS} token ids in [0, {INT32_MAX}]",
        "ignore_eos": "true or false",
        "seed": f"null or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
        "return_logprob": "true or false",
        "top_logprobs_num": f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        "logprob_start_len": f"-1 (no prompt logprobs) or an integer in [0, {INT32_MAX}]",
        "token_ids_logprob": f"at most {MAX_TOKEN_IDS_LOGPROB} token ids in [0, {INT32_MAX}]",
        "return_routed_experts": "true or false",
        "return_routed_expert_weights": "true or false",
    } | {k: f"null or a non-empty string of at most {MAX_GRAMMAR_CHARS} characters"
         for k in GRAMMAR_KINDS}


_BOUNDS = _bounds()
