"""What the parsed flags become: the configs they describe, and the flags `zpd
launch` hands its children.

The flags themselves are declared on the config fields (zpd/config.py) and their
parsers built in zpd/ops/flags.py; `worker_config` and `router_config` are the
only places flags become a config."""
from __future__ import annotations

import argparse
import os

from engines.sampling_params import SamplingParams
from engines.formats.overrides import ModelOverrides
from zpd.config import Deadlines, PromptLimits, RouterConfig, WorkerConfig, default_of
from zpd.wire.net import parse_endpoint

SAMPLING_FLAGS = {  # flag -> (type, help); unset flags stay None: SamplingParams has the defaults
    "max_new_tokens": (int, "tokens to generate at most "
                            f"(default {default_of(SamplingParams, 'max_new_tokens')}; 0: score "
                            "the prompt only, its logprobs with --logprob-start-len)"),
    "temperature": (float, f"0 = greedy; default {default_of(SamplingParams, 'temperature')}"),
    "top_p": (float, "nucleus sampling mass in (0, 1]"),
    "top_k": (int, "sample among the k best tokens (-1: all)"),
    "min_p": (float, "drop tokens below min_p x the best token's probability"),
    "repetition_penalty": (float, "> 1 discourages tokens seen in prompt or output"),
    "frequency_penalty": (float, "subtracted per occurrence in the output"),
    "presence_penalty": (float, "subtracted once for any token in the output"),
    "seed": (int, "per-request seed: same seed, same tokens"),
    "top_logprobs_num": (int, "report each token's N most likely alternatives with their "
                              "logprobs (0-20; implies --return-logprob)"),
    "logprob_start_len": (int, "with logprobs, also the prompt's from this position on "
                               "(SGLang's; -1, the default: none)"),
    # structured output, one at most (docs/http.md, "Structured output")
    "regex": (str, "the output matches this regular expression"),
    "json_schema": (str, "the output is JSON following this schema (given as JSON text)"),
    "ebnf": (str, "the output follows this grammar (llama.cpp's GBNF, or Lark)"),
}


# What `zpd generate` and `zpd admin` dial unless told otherwise: the router's defaults.
ROUTER_ENDPOINT = f"{default_of(RouterConfig, 'host')}:{default_of(RouterConfig, 'port')}"


def model_overrides(args: argparse.Namespace) -> ModelOverrides:
    """What the SGLang flags put in place of the model's own (None: not given)."""
    return ModelOverrides(tokenizer_path=args.tokenizer_path, chat_template=args.chat_template,
                          context_length=getattr(args, "context_length", None))


def kv_cache_mb(args: argparse.Namespace) -> float:
    """--kv-cache-mb, else WorkerConfig's default (a --mem-fraction-static replaces it)."""
    if args.kv_cache_mb is None:
        return default_of(WorkerConfig, "kv_cache_mb")
    if not args.kv_cache_mb > 0:
        raise ValueError(f"--kv-cache-mb must be positive, got {args.kv_cache_mb:g}")
    return args.kv_cache_mb


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    for name, (kind, text) in SAMPLING_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable); output text ends before it")
    g.add_argument("--stop-token-ids", default=None, help="comma-separated token ids that end output")
    g.add_argument("--token-ids-logprob", default=None,
                   help="comma-separated token ids whose logprobs to report at each output "
                        "position (and prompt position with --logprob-start-len)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    g.add_argument("--return-logprob", action="store_true",
                   help="report each output token's logprob (--json shows them)")
    g.add_argument("--return-routed-experts", action="store_true",
                   help="report each position's routed experts (a mixture of experts, served "
                        "with --enable-return-routed-experts; --json shows meta.routed_experts)")
    g.add_argument("--return-routed-expert-weights", action="store_true",
                   help="and their gate weights (meta.routed_expert_weights)")


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("input (repeat for several requests)")
    g.add_argument("--prompt", action="append", default=[], help="text prompt (needs a tokenizer)")
    g.add_argument("--chat", action="store_true",
                   help="send each --prompt as one user message through the model's chat "
                        "template, ready for the assistant's answer (its end-of-turn token "
                        "stops generation)")
    g.add_argument("--input-ids", action="append", default=[], type=parse_ids,
                   help="comma-separated token ids, e.g. 1,2,3")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as the record, checked once here (ValueError names a bad one);
    a flag left unset takes SamplingParams' default, their one place."""
    d = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.stop:
        d["stop"] = list(args.stop)
    if args.stop_token_ids:
        d["stop_token_ids"] = parse_ids(args.stop_token_ids)
    if args.token_ids_logprob:
        d["token_ids_logprob"] = parse_ids(args.token_ids_logprob)
    if args.ignore_eos:
        d["ignore_eos"] = True
    if args.return_logprob:
        d["return_logprob"] = True
    for key in ("return_routed_experts", "return_routed_expert_weights"):
        if getattr(args, key):
            d[key] = True
    return SamplingParams.from_dict(d)


def check_fraction(fraction: float | None) -> None:
    """--mem-fraction-static (zpd/worker/mem_fraction.py turns it into a KV pool size)."""
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {fraction}")


def worker_config(args: argparse.Namespace, role: str) -> WorkerConfig:
    """The WorkerConfig that the flags of `zpd prefill`/`zpd decode` describe."""
    if args.weights_root is not None and not os.path.isdir(args.weights_root):
        # Found at the first update_weights, a typo would refuse every checkpoint.
        raise ValueError(f"--weights-root {args.weights_root!r} is not a directory")
    check_fraction(args.mem_fraction_static)
    check_tp(args.tp, args.ep, args.deterministic)
    if not 0 < args.weight_sync_timeout <= 86400:          # NaN fails too
        raise ValueError("--weight-sync-timeout must be a number of seconds in (0, 86400]")
    if not 0 <= args.prefill_step_seconds <= 3600:
        raise ValueError("--prefill-step-seconds must be a number of seconds in [0, 3600]")
    return WorkerConfig(
        role=role, model=args.model, host=args.host, port=args.port, device=args.device,
        dtype=args.dtype, weight_version=args.weight_version, page_size=args.page_size,
        kv_cache_mb=kv_cache_mb(args), mem_fraction_static=args.mem_fraction_static,
        overrides=model_overrides(args), max_batch=args.max_batch,
        max_prefill_tokens=args.max_prefill_tokens, transport=args.transport,
        prefill_step_seconds=args.prefill_step_seconds,
        ib_device=args.ib_device, protocol=args.protocol, deadlines=deadlines(args),
        ready_file=args.ready_file, curve_keys=args.curve_keys, weights_root=args.weights_root,
        router_secret_file=args.router_secret_file,
        clear_freed_pages=args.clear_freed_pages, insecure=args.insecure,
        prefix_cache=not args.no_prefix_cache, prompt_limits=prompt_limits(args),
        weight_sync_timeout=args.weight_sync_timeout, tp=args.tp, ep=args.ep,
        enable_return_routed_experts=args.enable_return_routed_experts,
        deterministic=args.deterministic)


def check_tp(tp: int | None, ep: int | None = None, deterministic: bool = False) -> None:
    """--tp and --ep as flags (the model's sizes are checked when it loads,
    engines/tp/plan.py): each at least 1, --ep 1 or equal to --tp where both are over 1;
    --deterministic at 1 and 1 (docs/deterministic.md)."""
    if deterministic and ((tp or 1) > 1 or (ep or 1) > 1):
        raise ValueError("--deterministic runs at --tp 1 and --ep 1 for now (docs/deterministic.md)")
    if tp is not None and tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if ep is not None and ep < 1:
        raise ValueError(f"--ep must be at least 1, got {ep}")
    if tp is not None and ep is not None and ep > 1 and tp not in (1, ep):
        raise ValueError(f"--ep {ep} with --tp {tp}: --ep must be 1 or equal to --tp")


def prompt_limits(args: argparse.Namespace) -> PromptLimits:
    return PromptLimits(max_text_bytes=args.max_text_bytes, max_input_ids=args.max_input_ids)


def deadlines(args: argparse.Namespace) -> Deadlines:
    return Deadlines(kv_wait=args.kv_wait_timeout, transfer=args.transfer_timeout,
                     heartbeat=args.heartbeat, peer_timeout=args.peer_timeout,
                     dead_fence=args.dead_fence, busy_poll_us=args.busy_poll_us,
                     router_grace=args.router_grace)


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig that the flags of `zpd router` describe."""
    prefill, decode = _endpoints(args.prefill), _endpoints(args.decode)
    if not prefill or not decode:
        raise ValueError("the router needs at least one --prefill and one --decode endpoint")
    if args.coordinator is not None:
        try:
            parse_endpoint(args.coordinator)
        except ValueError:
            raise ValueError(f"--coordinator {args.coordinator!r} is not HOST:PORT") from None
    return RouterConfig(prefill, decode, host=args.host, port=args.port, heartbeat=args.heartbeat,
                        peer_timeout=args.peer_timeout, busy_poll_us=args.busy_poll_us,
                        ready_file=args.ready_file,
                        curve_keys=args.curve_keys, insecure=args.insecure,
                        router_secret_file=args.router_secret_file,
                        prompt_limits=prompt_limits(args),
                        max_client_requests=args.max_client_requests,
                        max_client_tokens=args.max_client_tokens,
                        max_concurrent_requests=args.max_concurrent_requests,
                        queue_size=args.queue_size, queue_timeout=args.queue_timeout,
                        coordinator=args.coordinator)


def _endpoints(text: str) -> tuple[str, ...]:
    return tuple(e for e in text.split(",") if e)


WORKER_PASSTHROUGH = ("model", "device", "dtype", "weight_version", "page_size", "kv_cache_mb",
                      "mem_fraction_static", "tokenizer_path", "chat_template", "context_length",
                      "max_batch", "threads", "transport", "ib_device", "protocol",
                      "max_prefill_tokens", "prefill_step_seconds", "transfer_timeout", "kv_wait_timeout", "dead_fence",
                      "router_grace", "heartbeat", "peer_timeout", "busy_poll_us", "log_level", "curve_keys",
                      "router_secret_file",
                      "weights_root", "weight_sync_timeout",
                      "clear_freed_pages", "no_prefix_cache", "insecure",
                      "enable_return_routed_experts", "deterministic",
                      "max_text_bytes", "max_input_ids")
# What `zpd launch` hands its router, besides the flags every launch sets.
ROUTER_PASSTHROUGH = ("max_text_bytes", "max_input_ids", "max_client_requests",
                      "max_client_tokens", "max_concurrent_requests", "queue_size",
                      "queue_timeout", "busy_poll_us")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The model/worker flags of `args` as command-line arguments for a child worker."""
    return passthrough_argv(args, WORKER_PASSTHROUGH)


def router_argv(args: argparse.Namespace) -> list[str]:
    """`zpd launch`'s router flags (ROUTER_PASSTHROUGH) as arguments for its router;
    --max-concurrent-requests 0 becomes the decodes' --max-batch times their number,
    which `zpd launch` knows and its router does not."""
    if args.max_concurrent_requests == 0:      # shared by the routers (--routers)
        args = argparse.Namespace(**vars(args) | {"max_concurrent_requests": max(
            1, args.max_batch * args.decode // getattr(args, "routers", 1))})
    return passthrough_argv(args, ROUTER_PASSTHROUGH)


def passthrough_argv(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    argv: list[str] = []
    for name in names:
        value, flag = getattr(args, name, None), "--" + name.replace("_", "-")
        if value is True:                      # a switch: the flag alone
            argv.append(flag)
        elif value is not None and value is not False and value != "":
            argv += [flag, str(value)]
    return argv
