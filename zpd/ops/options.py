"""Command-line options shared by the subcommands, and the configs they describe.

A flag that sets a config field takes its default from that field of the
dataclass (zpd/config.py) through `add_default`, which also shows it in --help;
`worker_config` and `router_config` are the only places flags become a config."""
from __future__ import annotations

import argparse
import os
from typing import Any

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
}


# What `zpd generate` and `zpd admin` dial unless told otherwise: the router's defaults.
ROUTER_ENDPOINT = f"{default_of(RouterConfig, 'host')}:{default_of(RouterConfig, 'port')}"
CURVE_HELP = ("CURVE key directory made by `zpd keys`: encrypt every connection and admit "
              "only authorised keys (default: plaintext)")
ROUTER_SECRET_HELP = (
    "without --curve-keys: a file (mode 0600, at least 16 bytes) holding the secret the "
    "cluster's routers prove themselves with, the same file for every router and worker "
    "(`zpd launch` makes one; `zpd keys DIR --router-secret` writes DIR/router.secret). Workers then "
    "take requests only from those routers, a decode lets a restarted router adopt its "
    "predecessor's requests, and a coordinator accepts followers; without it requests "
    "stay open to anyone who reaches a worker's port and adopt and follow are refused "
    "(docs/operating.md, Security)")
INSECURE_HELP = ("serve without --curve-keys on a non-loopback --host (anyone who reaches the "
                 "port may send requests and admin commands); refused without this flag")


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "--model-path", dest="model", required=True,
                   help="Hugging Face-format directory (Llama, Mistral, Qwen2, Qwen3), a .gguf "
                        "file, 'smollm2', 'tiny' (embedded default; 'tiny:SEED' for other "
                        "weights) or 'null[:STEP_MS]' (no model: a simulation, docs/serving.md); "
                        "--model-path is SGLang's name for it")
    add_text_options(g)
    g.add_argument("--context-length", type=int, default=None,
                   help="serve at most this many tokens per request (prompt + max_new_tokens; "
                        "SGLang's flag); at most the model's own max_position_embeddings, "
                        "which is the default")
    add_default(g, "--device", WorkerConfig, "cpu or cuda[:N] (default {default})")
    add_default(g, "--dtype", WorkerConfig, "weights and KV dtype; float64 keeps near-ties out of "
                "exactness tests", choices=["float32", "bfloat16", "float16", "float64"])
    add_default(g, "--weight-version", WorkerConfig,
                "version string reported with every token (default: model name)")
    add_default(g, "--page-size", WorkerConfig, "tokens per KV page (default {default})", type=int)
    kv = g.add_mutually_exclusive_group()
    # None when not given, so that giving both is refused (the default lives in WorkerConfig)
    kv.add_argument("--kv-cache-mb", type=float, default=None,
                    help=f"KV pool size in MiB (default {default_of(WorkerConfig, 'kv_cache_mb'):g})")
    kv.add_argument("--mem-fraction-static", type=float, default=None,
                    help="instead of --kv-cache-mb (SGLang's flag): weights + KV pool take this "
                         "fraction of the device's memory; the pool gets fraction x total memory "
                         "(GPU; on cpu the RAM, within the cgroup limit) minus the loaded "
                         "weights. Each worker takes it: N workers sharing a device give 1/N each")
    add_default(g, "--max-batch", WorkerConfig, "most requests decoding at once, counting those "
                "whose KV is still arriving (default {default})", type=int)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1,
                   help="tensor parallelism: the model split over this many processes (attention "
                        "heads and the MLP, Megatron's way; key/value heads replicated when "
                        "fewer than the ranks); gloo on cpu, NCCL on cuda with rank r on "
                        "cuda:r; --threads is shared among them (default 1)")


def add_text_options(g: argparse._ActionsContainer) -> None:
    """SGLang's tokenizer and chat template flags: every process that turns text into
    ids (workers, `zpd http`) must be given the same."""
    g.add_argument("--tokenizer-path", default=None,
                   help="tokenizer instead of the model's: a tokenizer.json, a directory with "
                        "one (its chat template comes along), or a .gguf file; hub names are "
                        "not fetched, and a tokenizer larger than the model's vocabulary is "
                        "refused")
    g.add_argument("--chat-template", default=None,
                   help="chat template instead of the model's (or the tokenizer's): a Jinja "
                        "file, or the template text itself; SGLang's built-in names and JSON "
                        "templates are refused")


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
    return SamplingParams.from_dict(d)


def add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    add_default(g, "--transport", WorkerConfig, "KV transfer backend (default {default})",
                choices=["mooncake"])
    add_default(g, "--ib-device", WorkerConfig, "RDMA device name(s) for Mooncake, e.g. mlx5_0 "
                "('' = auto; TCP without RDMA NICs)")
    add_default(g, "--protocol", WorkerConfig, "Mooncake protocol hint (Mooncake picks RDMA when "
                "NICs exist; MC_FORCE_TCP=1 forces TCP)", choices=["tcp", "rdma"])
    add_default(g, "--max-prefill-tokens", WorkerConfig,
                "most prompt tokens in one prefill forward (default {default})", type=int)
    add_default(g, "--prefill-step-seconds", WorkerConfig, "a prefill step also takes at most "
                "the tokens this worker computes in this many seconds (measured as it runs), "
                "so that a request from another caller waits little behind a long batch; a "
                "single prompt is still computed in one step (0 = off; default {default})",
                type=float)
    add_default(g, "--transfer-timeout", Deadlines, "seconds one KV write may take before the "
                "request fails with 504 (default {default})", field="transfer", type=float)
    add_default(g, "--kv-wait-timeout", Deadlines, "seconds to wait for KV pages, kv_dest or "
                "kv_done before 504 (default {default})", field="kv_wait", type=float)
    add_default(g, "--dead-fence", Deadlines, "decode: longest pages stay fenced for a prefill "
                "that stopped answering in the middle of writing them (default {default})",
                type=float)
    add_default(g, "--router-grace", Deadlines, "decode: seconds a silent router's requests go "
                "on running, their pages held, so that a router restarted on the same endpoint "
                "can adopt them; then they end with 503 (0: at once; default {default})",
                type=float)
    add_liveness_options(g, Deadlines)
    add_default(g, "--curve-keys", WorkerConfig, CURVE_HELP)
    add_default(g, "--router-secret-file", WorkerConfig, ROUTER_SECRET_HELP)
    add_default(g, "--weights-root", WorkerConfig, "update_weights loads checkpoints only from "
                "under this directory (relative paths are taken from it; anything else is 403); "
                "default: any path on the worker's host")
    add_default(g, "--weight-sync-timeout", WorkerConfig, "seconds a trainer's "
                "init_weights_update_group or weight push may take on a worker before it fails "
                "with 504, the old weights kept (default {default}); `zpd admin "
                "cancel-weight-update` ends one sooner", type=float)
    add_default(g, "--clear-freed-pages", WorkerConfig, "zero every KV page when it is freed, so "
                "no request's KV outlives it in memory (Mooncake lets any engine that reaches its "
                "port read registered memory; docs/operating.md, Security); costs a memset per freed page",
                action="store_true")
    g.add_argument("--no-prefix-cache", action="store_true", help="do not keep computed prompt "
                   "pages for reuse (by default a prefill reuses the KV of a prompt prefix it "
                   "computed before under the same weights; docs/serving.md, Prefix cache)")
    add_default(g, "--insecure", WorkerConfig, INSECURE_HELP, action="store_true")
    add_prompt_limit_options(g)


def add_worker_server_options(p: argparse.ArgumentParser) -> None:
    """Where one worker listens (`zpd launch` picks these for its workers)."""
    add_default(p, "--host", WorkerConfig, "interface to bind (default {default})")
    add_default(p, "--port", WorkerConfig, "port to bind (default {default}: any free port)",
                type=int)
    add_default(p, "--ready-file", WorkerConfig, "write {role, endpoint, pid} here once ready")


def add_router_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="prefill endpoints H:P[,H:P...]")
    p.add_argument("--decode", required=True, help="decode endpoints H:P[,H:P...]")
    add_default(p, "--host", RouterConfig, "interface to bind (default {default})")
    add_default(p, "--port", RouterConfig, "port to bind (default {default})", type=int)
    add_default(p, "--ready-file", RouterConfig, "write {role, endpoint, pid} here once ready")
    add_default(p, "--curve-keys", RouterConfig, CURVE_HELP)
    add_default(p, "--router-secret-file", RouterConfig, ROUTER_SECRET_HELP)
    add_default(p, "--insecure", RouterConfig, INSECURE_HELP, action="store_true")
    add_default(p, "--coordinator", RouterConfig, "run beside other routers over the same "
                "workers: H:P of the router that coordinates pauses, continues, weight "
                "pushes and abort_all across them; this one follows it, holding its new "
                "requests while the pool is paused, and passes those admin commands on to "
                "it. Requests are served either way (default: none, this router coordinates)")
    add_liveness_options(p, RouterConfig)
    add_prompt_limit_options(p)
    add_client_limit_options(p)


def add_prompt_limit_options(g: argparse._ActionsContainer) -> None:
    """Router and workers: a larger prompt is refused with 400 (docs/operating.md, "Limits")."""
    add_default(g, "--max-text-bytes", PromptLimits, "refuse a text prompt of more bytes of "
                "UTF-8 (default {default})", type=int)
    add_default(g, "--max-input-ids", PromptLimits, "refuse a prompt of more token ids "
                "(default {default})", type=int)


def add_client_limit_options(g: argparse._ActionsContainer) -> None:
    """The router: each client's share and the queue where requests past it, or past
    --max-concurrent-requests, wait their turn (docs/operating.md, "Limits")."""
    add_default(g, "--max-client-requests", RouterConfig, "one client's share: requests it may "
                "have routed to the workers at once; more wait in the router's queue, served "
                "fairly between clients, then between the users a client names (the HTTP front "
                "names each caller), then between a user's calls (each HTTP request): fewest "
                "routed first (default {default})", type=int)
    add_default(g, "--max-client-tokens", RouterConfig, "one client's share of KV pages, in "
                "tokens: prompt + max_new_tokens summed over its routed requests; more wait. "
                "A single request needing more is refused with 400 (default {default})", type=int)
    add_default(g, "--max-concurrent-requests", RouterConfig, "requests routed to the workers "
                "at once, all clients together; the rest wait in the router's queue, so the "
                "workers' own queues stay short (their --kv-wait-timeout never fires for "
                "load). About the decodes' --max-batch times their number (default "
                "{default}: 64 per decode)", type=int)
    add_default(g, "--queue-size", RouterConfig, "requests that may wait in the router's "
                "queue. When full, the newest request of whoever holds most there (the client, "
                "then its user, then its call) is refused with 429 'queue full' (Retry-After at "
                "the HTTP front): the newcomer's own unless it holds less than the others, so "
                "one caller alone may fill it but not keep others out (default {default})",
                type=int)
    add_default(g, "--queue-timeout", RouterConfig, "seconds a request may wait in the "
                "router's queue (paused or not) before it ends with 503 'queue timeout' "
                "(default {default})", type=float)


def add_liveness_options(g: argparse._ActionsContainer, config: type) -> None:
    """--heartbeat and --peer-timeout with the defaults of `config` (Deadlines or RouterConfig)."""
    add_default(g, "--heartbeat", config, "seconds between pings to every peer (default {default})",
                type=float)
    add_default(g, "--peer-timeout", config, "a peer silent this long is dead: its requests fail "
                "with 503 and no new ones go to it until it answers again (default {default})",
                type=float)
    add_default(g, "--busy-poll-us", config, "after each message the loop polls without sleeping "
                "for this many microseconds, so the next hop of a request (usually within a "
                "millisecond) finds it awake; costs up to that much CPU per message burst "
                "(default {default})", type=float)


def add_default(g: argparse._ActionsContainer, flag: str, config: type, text: str,
                field: str | None = None, **kw: Any) -> None:
    """Add `flag` with the default of `config`'s field `field` (default: the flag's name),
    so the dataclass stays the one source of defaults; "{default}" in `text` shows it."""
    value = default_of(config, field or flag.lstrip("-").replace("-", "_"))
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    g.add_argument(flag, default=value, help=text.replace("{default}", shown), **kw)


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
    check_tp(args.tp)
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
        weight_sync_timeout=args.weight_sync_timeout, tp=args.tp)


def check_tp(tp: int | None) -> None:
    if tp is not None and tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")


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
