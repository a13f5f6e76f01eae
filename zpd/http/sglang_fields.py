"""SGLang's request fields, each with what zpd does with it: one readable place.

The lists are the field names of SGLang's current request types (read from its
sources: `GenerateReqInput` in managers/io_struct.py, `SamplingParams` in
sampling/sampling_params.py, `CompletionRequest` and `ChatCompletionRequest` in
entrypoints/openai/protocol.py), plus OpenAI's own names. Each field is

- IMPLEMENTED: a field of bodies.py's models, read by native.py or openai_protocol.py;
- IGNORED: accepted whatever its value, because no value asks for anything zpd
  lacks (bookkeeping, routing hints, observability, defaults sglang-router sends);
- REFUSED: accepted only while its value asks for nothing (null, false, "", [], {},
  a list of those, or one of the rule's `idle` values); any other value is a 400
  that names the field. These are features zpd does not have.

A name on none of the lists is accepted, logged once at WARNING (UnknownFields), and
never reaches the engine, as SGLang's dataclass bodies drop what they do not declare.

The IMPLEMENTED fields are declared with their types in bodies.py's models; the
IGNORED and REFUSED ones are screened here on the raw body, so a refused field is
named whatever its type.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from zpd.http.records import BadRequest

log = logging.getLogger("zpd.http.fields")

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"
MAX_REMEMBERED = 256        # unknown names remembered for warn-once (a client picks them)


@dataclass(frozen=True)
class Rule:
    """What zpd does with one field; `idle`: values of a REFUSED field that ask for
    nothing besides the empty ones, `why`: the missing feature, for the error."""
    kind: str
    idle: tuple = ()
    why: str = ""


IMPL, IGN = Rule(IMPLEMENTED), Rule(IGNORED)


def refused(why: str, *idle: Any) -> Rule:
    return Rule(REFUSED, idle, why)


MULTIMODAL = refused("zpd serves text models")
LORA = refused("zpd has no LoRA adapters")
HIDDEN = refused("zpd does not return hidden states")
PD_BOOTSTRAP = refused("zpd moves the KV cache itself; SGLang's bootstrap server is not used")
NOT_RETURNED = refused("zpd does not return it")

# sampling_params of /generate (SGLang's SamplingParams), and zpd's own engine names.
SAMPLING: dict[str, Rule] = {
    "max_new_tokens": IMPL, "min_new_tokens": IMPL, "stop": IMPL, "stop_token_ids": IMPL,
    "temperature": IMPL, "top_p": IMPL, "top_k": IMPL, "min_p": IMPL,
    "frequency_penalty": IMPL, "presence_penalty": IMPL, "repetition_penalty": IMPL,
    "n": IMPL, "ignore_eos": IMPL, "skip_special_tokens": IMPL, "no_stop_trim": IMPL,
    "sampling_seed": IMPL,
    # Hugging Face's fast tokenizers (what SGLang decodes with) ignore it; so does ours.
    "spaces_between_special_tokens": IGN,
    "custom_params": IGN,            # read only by a custom logit processor, refused below
    "stream_interval": IGN,          # how often SGLang streams; zpd streams every chunk
    "stop_regex": refused("zpd has no regex stop conditions"),
    "json_schema": IMPL, "regex": IMPL, "ebnf": IMPL,    # one at most (zpd/http/structured.py)
    "structural_tag": refused("zpd has no structural tags"),
    "logit_bias": refused("zpd has no logit bias"),
    "beam_width": refused("zpd has no beam search", 1),
    # zpd's engine names (SamplingParams fields of its own)
    "seed": IMPL, "return_logprob": IMPL, "top_logprobs_num": IMPL,
}

# POST /generate (SGLang's GenerateReqInput)
GENERATE: dict[str, Rule] = {
    "model": IGN,                    # not SGLang's, but sglang-router adds it to every body
    "text": IMPL, "input_ids": IMPL, "sampling_params": IMPL, "rid": IMPL, "stream": IMPL,
    "return_logprob": IMPL, "top_logprobs_num": IMPL, "return_text_in_logprobs": IMPL,
    "logprob_start_len": IMPL,       # prompt logprobs, with return_logprob
    "token_ids_logprob": IMPL,       # at output positions, and prompt ones with logprob_start_len
    "session_id": IGN, "log_metrics": IGN, "routed_experts_start_len": IGN,
    "routed_dp_rank": IGN, "data_parallel_rank": IGN, "disagg_prefill_dp_rank": IGN,
    "kv_router_hint": IGN, "routing_key": IGN, "conversation_id": IGN,
    "http_worker_ipc": IGN, "priority": IGN, "extra_key": IGN, "no_logs": IGN,
    "custom_labels": IGN, "return_bytes": IGN, "external_trace_header": IGN,
    "received_time": IGN, "max_dynamic_patch": IGN, "min_dynamic_patch": IGN,
    "image_max_dynamic_patch": IGN, "video_max_dynamic_patch": IGN, "images_config": IGN,
    "input_embeds": refused("zpd takes text or token ids"),
    "image_data": MULTIMODAL, "video_data": MULTIMODAL, "audio_data": MULTIMODAL,
    "mm_hashes": MULTIMODAL, "mm_content_hashes": MULTIMODAL, "use_audio_in_video": MULTIMODAL,
    "video_config": MULTIMODAL, "modalities": MULTIMODAL, "need_wait_for_mm_inputs": MULTIMODAL,
    "num_items_assigned": MULTIMODAL, "encoder_urls": MULTIMODAL,
    "return_sampling_mask": NOT_RETURNED,
    "return_flat_raw_top_logprobs": NOT_RETURNED, "return_flat_raw_top_logprobs_b64": NOT_RETURNED,
    "return_hidden_states": HIDDEN,
    # meta_info.routed_experts (engines/routed.py); zpd's own: routed_expert_weights
    "return_routed_experts": IMPL, "return_routed_expert_weights": IMPL,
    "return_indexer_topk": NOT_RETURNED, "return_entropy": NOT_RETURNED,
    "return_prompt_token_ids": NOT_RETURNED,
    "session_params": refused("zpd has no sessions"),
    "lora_path": LORA, "lora_id": LORA,
    "custom_logit_processor": refused("zpd runs no custom logit processors"),
    "positional_embed_overrides": refused("zpd takes text or token ids"),
    "bootstrap_host": PD_BOOTSTRAP, "bootstrap_port": PD_BOOTSTRAP,
    "bootstrap_room": PD_BOOTSTRAP, "bootstrap_pair_key": PD_BOOTSTRAP,
    "decode_tp_size": PD_BOOTSTRAP,
    "background": refused("zpd has no background responses"),
    "require_reasoning": refused("zpd has no reasoning controls"),
    "max_thinking_tokens": refused("zpd has no reasoning controls"),
    "multi_item_delimiter_indices": refused("zpd has no multi-item scoring"),
    "cache_salt": refused("zpd's prefix cache has no namespaces"),
}

# What /v1/completions and /v1/chat/completions share (SGLang's and OpenAI's names).
_OPENAI_COMMON: dict[str, Rule] = {
    "model": IGN, "user": IGN, "frequency_penalty": IMPL, "presence_penalty": IMPL,
    "max_tokens": IMPL, "n": IMPL, "seed": IMPL, "stop": IMPL, "stream": IMPL,
    "stream_options": IMPL, "temperature": IMPL, "top_p": IMPL, "top_k": IMPL, "min_p": IMPL,
    "min_tokens": IMPL, "repetition_penalty": IMPL, "stop_token_ids": IMPL,
    "no_stop_trim": IMPL, "ignore_eos": IMPL, "skip_special_tokens": IMPL, "rid": IMPL,
    "routed_experts_start_len": IGN, "session_id": IGN, "custom_params": IGN,
    "images_config": IGN, "routed_dp_rank": IGN, "disagg_prefill_dp_rank": IGN,
    "data_parallel_rank": IGN, "extra_key": IGN, "ngram_corpus_id": IGN, "priority": IGN,
    "custom_labels": IGN,
    "logit_bias": refused("zpd has no logit bias"),
    "return_hidden_states": HIDDEN, "return_routed_experts": NOT_RETURNED,
    "return_cached_tokens_details": NOT_RETURNED, "return_token_ids": NOT_RETURNED,
    "json_schema": IMPL, "regex": IMPL, "ebnf": IMPL, "response_format": IMPL,
    "stop_regex": refused("zpd has no regex stop conditions"),
    "lora_path": LORA, "session_params": refused("zpd has no sessions"),
    "custom_logit_processor": refused("zpd runs no custom logit processors"),
    "bootstrap_host": PD_BOOTSTRAP, "bootstrap_port": PD_BOOTSTRAP,
    "bootstrap_room": PD_BOOTSTRAP,
    "cache_salt": refused("zpd's prefix cache has no namespaces"),
}

COMPLETION: dict[str, Rule] = _OPENAI_COMMON | {
    "prompt": IMPL, "best_of": IMPL, "echo": IMPL, "logprobs": IMPL,
    "suffix": refused("zpd has no insertion"),
}

CHAT: dict[str, Rule] = _OPENAI_COMMON | {
    "messages": IMPL, "logprobs": IMPL, "top_logprobs": IMPL, "max_completion_tokens": IMPL,
    "tools": IMPL, "tool_choice": IMPL, "parallel_tool_calls": IMPL,
    "chat_template_kwargs": IMPL, "metadata": IGN, "store": IGN, "service_tier": IGN,
    "prompt_cache_key": IGN, "safety_identifier": IGN,
    # zpd has no reasoning parser; SGLang without one returns the text whole either way.
    "separate_reasoning": IGN, "stream_reasoning": IGN,
    "max_dynamic_patch": IGN, "min_dynamic_patch": IGN,
    "functions": refused("zpd reads tool calls of 'tools', not the older 'functions'"),
    "function_call": refused("zpd reads tool calls of 'tools', not the older 'functions'",
                             "none", "auto"),
    "return_prompt_token_ids": NOT_RETURNED, "return_meta_info": NOT_RETURNED,
    "reasoning_effort": refused("zpd has no reasoning controls"),
    "reasoning": refused("zpd has no reasoning controls"),
    "task": refused("zpd has no task tokens"),
    "continue_final_message": refused("the workers render the template with a generation prompt"),
    "use_audio_in_video": MULTIMODAL, "modalities": refused("zpd serves text", ["text"]),
    "audio": MULTIMODAL,
    "prediction": refused("zpd has no predicted outputs"),
    "web_search_options": refused("zpd has no web search"),
    "input_ids": refused("chat prompts are rendered from messages"),
}


def asks(value: Any, idle: tuple = ()) -> bool:
    """Whether `value` asks for something: not null, false, "", [], {}, one of `idle`
    (compared with its type: 1 is not true), nor a list of such."""
    if value is None or value is False or (type(value) in (str, list, dict) and not value):
        return False
    if any(type(value) is type(i) and value == i for i in idle):
        return False
    if type(value) is list:
        return any(asks(v, idle) for v in value)
    return True


def screen(body: dict, table: dict[str, Rule], where: str = "") -> list[str]:
    """400 naming the first REFUSED field of `body` whose value asks for something;
    the names `table` does not know (for UnknownFields), sorted."""
    unknown = []
    for name, value in body.items():
        rule = table.get(name)
        if rule is None:
            unknown.append(name)
        elif rule.kind == REFUSED and asks(value, rule.idle):
            raise BadRequest(f"'{where}{name}' is not supported by this server ({rule.why})")
    return sorted(unknown, key=str)


class UnknownFields:
    """Warns once per unknown field name. At most `limit` names are remembered, so a
    client sending endless new names can grow neither memory nor the log: past the
    limit one line says so and further new names go unlogged."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self.seen: set[str] = set()
        self.full = False

    def note(self, names: Iterable[str], where: str) -> None:
        for name in names:
            key = f"{where} {name}"[:300]
            if key in self.seen or self.full:
                continue
            if len(self.seen) >= self.limit:
                self.full = True
                log.warning("%d unknown field names logged; further ones are not", self.limit)
                continue
            self.seen.add(key)
            log.warning("%s: ignoring unknown field %r (neither SGLang nor OpenAI has it)",
                        where, name[:100])
