"""What every HTTP route shares: the request record a generation becomes, the error it
answers when a body is wrong, and the checks that read a JSON body field by field.

A body is checked whole before anything goes to the router, and every error names
the field: `{"error": {"message", "type", "code"}}` with HTTP 400 (OpenAI's shape,
on every route). JSON null counts as absent, as it does for the APIs we mirror.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import orjson

from engines.sampling_params import INT32_MAX, MAX_TOKEN_IDS_LOGPROB, SamplingParams
from zpd.config import HttpConfig, PromptLimits, default_of

MAX_TOP_LOGPROBS = 20
MAX_REQUESTS = default_of(HttpConfig, "max_batch_requests")   # generations per call (prompts x n)
MAX_RID_CHARS = 256


class BadRequest(ValueError):
    """A request the HTTP front refuses, answered with `status` in OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind


def error_body(message: str, status: int, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


@dataclass(frozen=True)
class GenRequest:
    """One generation as the router gets it: exactly one of `input_ids`, `text` or
    `messages` (a conversation the workers render with the model's chat template),
    and its sampling parameters, checked once here at the edge (checked_sampling)."""
    sampling: SamplingParams
    input_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict] | None = None
    # beside `messages`: the template's "tools" and "chat_template_kwargs", where given
    chat_extra: dict | None = None
    rid: str | None = None
    stream: bool = False
    trim_stop: bool = True       # the text ends before a matched stop (SGLang's default)
    skip_special: bool = True    # the text leaves special tokens out (SGLang's default)
    text_in_logprobs: bool = False   # logprobs name their tokens' text (return_text_in_logprobs)
    received: float = field(default_factory=time.monotonic)    # when the front took it

    @property
    def logprobs(self) -> bool:
        return self.sampling.return_logprob

    @property
    def top_logprobs(self) -> int:
        return self.sampling.top_logprobs_num

    @property
    def token_ids_logprob(self) -> tuple[int, ...]:
        return self.sampling.token_ids_logprob

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop


def prompt_logprob_entries(req: GenRequest) -> int:
    """The prompt logprob entries one generation asks for: scored positions x (1 +
    top_logprobs_num + len(token_ids_logprob)). A text prompt counts its UTF-8 bytes as
    its tokens, which no byte-level tokenizer's count exceeds (the router's rule)."""
    start = req.sampling.logprob_start_len
    if not req.logprobs or start < 0:
        return 0
    length = len(req.input_ids) if req.input_ids is not None else len((req.text or "").encode())
    return max(0, length - max(start, 1)) * (1 + req.top_logprobs + len(req.token_ids_logprob))


def check_call_logprobs(items: list[GenRequest], limit: int) -> None:
    """BadRequest when one call's prompt logprobs, summed over its generations, pass
    `limit` (--max-call-logprobs): each entry is ~30 bytes of answer, held whole by the
    front, and computed in one prefill step after another while other callers wait."""
    asked = sum(map(prompt_logprob_entries, items))
    if asked > limit:
        raise BadRequest(f"this call asks for {asked} prompt logprob entries (scored positions x "
                         f"(1 + top_logprobs_num + len(token_ids_logprob)), summed over its "
                         f"{len(items)} prompt(s)); the front's --max-call-logprobs is {limit}: "
                         "split it into smaller calls, raise logprob_start_len or ask fewer "
                         "top_logprobs_num")


# --- reading a body ---------------------------------------------------------------

def json_object(raw: bytes, required: bool = True) -> dict:
    """The body as a JSON object; an empty body is {} where none is `required`."""
    if not raw.strip() and not required:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if type(body) is not dict:
        raise BadRequest(f"the body must be a JSON object, not {_kind(body)}")
    return body


Check = Callable[[str, Any], Any]       # (field name, value) -> the value, or BadRequest


def take(body: dict, name: str, check: Check, default: Any = None) -> Any:
    """Field `name` of `body` as `check` accepts it; `default` when absent or null."""
    value = body.get(name)
    return default if value is None else check(name, value)


def boolean(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise BadRequest(f"{name!r} must be true or false, not {_kind(value)}")
    return value


def string(name: str, value: Any) -> str:
    if type(value) is not str:
        raise BadRequest(f"{name!r} must be a string, not {_kind(value)}")
    return value


def text_field(name: str, value: Any) -> str:
    """A non-empty string."""
    if not string(name, value):
        raise BadRequest(f"{name!r} must not be empty")
    return value


def integer(low: int, high: int) -> Check:
    def check(name: str, value: Any) -> int:
        if type(value) is not int or not low <= value <= high:
            raise BadRequest(f"{name!r} must be an integer in [{low}, {high}], got {_show(value)}")
        return value
    return check


def token_ids(name: str, value: Any) -> list[int]:
    """A non-empty list of token ids (what the wire carries: int32, not negative)."""
    if type(value) is not list or not value:
        raise BadRequest(f"{name!r} must be a non-empty list of token ids")
    for i, t in enumerate(value):
        if type(t) is not int or not 0 <= t <= INT32_MAX:
            raise BadRequest(f"{name}[{i}] must be a token id in [0, {INT32_MAX}], got {_show(t)}")
    return value


def id_list(name: str, value: Any) -> list[int]:
    """A list of at most MAX_TOKEN_IDS_LOGPROB token ids (the vocabulary's bound is the
    worker's to check)."""
    if type(value) is not list or len(value) > MAX_TOKEN_IDS_LOGPROB:
        raise BadRequest(f"{name!r} must be a list of at most {MAX_TOKEN_IDS_LOGPROB} token ids")
    for i, t in enumerate(value):
        if type(t) is not int or not 0 <= t <= INT32_MAX:
            raise BadRequest(f"{name}[{i}] must be a token id in [0, {INT32_MAX}], got {_show(t)}")
    return value


def stop_strings(name: str, value: Any) -> list[str]:
    """A string or a list of strings."""
    items = [value] if isinstance(value, str) else value
    if type(items) is not list or not all(type(s) is str for s in items):
        raise BadRequest(f"{name!r} must be a string or a list of strings")
    return items


def checked_sampling(sampling: dict) -> SamplingParams:
    """`sampling` (the engine's names) as the record the request carries from here on:
    the one check of its values (BadRequest names a bad one). The logprob fields get
    the HTTP front's words for their errors, as the body's other fields do."""
    take(sampling, "return_logprob", boolean)
    take(sampling, "top_logprobs_num", integer(0, MAX_TOP_LOGPROBS))
    take(sampling, "logprob_start_len", integer(-1, INT32_MAX))
    take(sampling, "token_ids_logprob", id_list)
    try:
        return SamplingParams.from_dict(sampling)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def logprob_sampling(want: bool, top: int, start: int = -1, ids: list[int] = ()) -> dict:
    """What asks the workers for logprobs (nothing when not wanted): the prompt's too
    from `start` (SGLang's logprob_start_len) when it is not -1, and `ids`' logprobs
    at every output position (and prompt position asked)."""
    if not want:
        return {}
    prompt = {"logprob_start_len": start} if start >= 0 else {}
    return {"return_logprob": True, "top_logprobs_num": top} | prompt | \
        ({"token_ids_logprob": list(ids)} if ids else {})


def check_count(prompts: int, n: int = 1, cap: int = MAX_REQUESTS) -> None:
    """Each generation is a request at the router: one call may start `cap` of them."""
    if prompts * n > cap:
        raise BadRequest(f"{prompts} prompt(s) x 'n'={n} is more than {cap} generations in "
                         "one request (--max-batch-requests): lower 'n' or split the batch")


def check_prompts(prompts: list[dict], limits: PromptLimits, name: str) -> None:
    """The cluster's prompt caps, checked here so that an over-limit prompt never reaches
    the router (whose frame limit a large one would exceed): 400 naming the prompt and
    the flag. `prompts`: {"text"}, {"input_ids"} or {"messages"[, "chat_extra"]} each; `name` is the
    field they came from (indexed when there are several)."""
    for i, prompt in enumerate(prompts):
        messages = prompt.get("messages")
        chat = {"messages": messages} | (prompt.get("chat_extra") or {})
        why = limits.refusal(prompt.get("input_ids") or [], prompt.get("text") or "",
                             chat if messages is not None else None)
        if why is not None:
            raise BadRequest(f"{name}[{i}]: {why}" if len(prompts) > 1 else f"{name}: {why}")


def rid_field(name: str, value: Any) -> str:
    if not text_field(name, value) or len(value) > MAX_RID_CHARS:
        raise BadRequest(f"{name!r} must be at most {MAX_RID_CHARS} characters")
    return value


def item_rids(value: Any, prompts: int, n: int, batch: bool) -> list[str | None]:
    """A rid for each of `prompts` x `n` generations, copy-major (copy j of prompt p at
    j * prompts + p), as SGLang names them: one rid for a single generation; in a
    batch, a string is a prefix (rid_0, rid_1, ...) and a list names each prompt
    (rid_j for its copy j when n > 1). Each is checked (MAX_RID_CHARS)."""
    total = prompts * n
    if value is None:
        return [None] * total
    if type(value) is str and total == 1 and not batch:
        return [rid_field("rid", value)]
    if type(value) is str:
        rid_field("rid", value)
        return [rid_field("rid", f"{value}_{i}") for i in range(total)]
    if type(value) is not list or not batch:
        raise BadRequest("'rid' must be a string" + (" or a list of strings, one per prompt"
                                                     if batch else ""))
    if len(value) != prompts:
        raise BadRequest(f"'rid' has {len(value)} entries for {prompts} prompts")
    names = [rid_field(f"rid[{i}]", r) for i, r in enumerate(value)]
    if n == 1:
        return names
    return [rid_field(f"rid[{p}]", f"{names[p]}_{j}") for j in range(n) for p in range(prompts)]


def seeded_copies(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """`n` copies of a request's sampling; with a seed, copy i gets seed + i, so the
    copies differ and the whole answer is still reproducible."""
    seed = sampling.seed
    if seed is None or n == 1:
        return [sampling] * n
    if seed + n - 1 >= 2 ** 63:
        raise BadRequest(f"'seed' must be an integer below 2**63 - {n - 1} with n={n}")
    return [replace(sampling, seed=seed + i) for i in range(n)]


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), "a value")


def _show(value: Any) -> str:
    text = orjson.dumps(value).decode() if _jsonable(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _jsonable(value: Any) -> bool:
    try:
        orjson.dumps(value)
        return True
    except TypeError:
        return False
