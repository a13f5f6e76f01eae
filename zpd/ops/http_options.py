"""`zpd http`'s command-line options (and those `zpd launch` takes for its front), and
the HttpConfig they describe; the flags shared with the other subcommands are in
zpd/ops/options.py."""
from __future__ import annotations

import argparse

from zpd.config import HttpConfig
from zpd.failover import parse_routers
from zpd.ops.exposure import check_admin_key, given_http_keys
from zpd.ops.options import (ROUTER_ENDPOINT, add_default, add_prompt_limit_options,
                             add_text_options, model_overrides, prompt_limits)

# What `zpd launch` hands its HTTP front: it must turn text into the workers' ids.
HTTP_PASSTHROUGH = ("served_model_name", "tokenizer_path", "chat_template",
                    "max_text_bytes", "max_input_ids", "max_batch_requests",
                    "incremental_streaming_output", "cumulative_bytes_per_token",
                    "stream_write_timeout", "stream_buffer_bytes", "stream_buffer_total_bytes",
                    "max_call_logprobs", "max_answer_bytes",
                    "keepalive_timeout", "header_timeout", "body_timeout", "max_connections",
                    "allowed_hosts")

def add_http_options(p: argparse.ArgumentParser) -> None:
    """`zpd http`: where it serves and which router it is a client of."""
    p.add_argument("--router", default=ROUTER_ENDPOINT, help=f"router endpoint (default "
                   f"{ROUTER_ENDPOINT}), or several routers of one pool, comma-separated: "
                   "each front sends its requests to one of them (front i of --workers to "
                   "router i), while it is up; when it dies the next ones go to the others "
                   "and those in flight end with 503 unless it comes back within 10 s "
                   "(resumed); admin routes go to the first router up (docs/http.md, "
                   "\"Several fronts and routers\")")
    add_http_workers_option(p, "--workers")
    p.add_argument("--model", "--model-path", dest="model", required=True,
                   help="the cluster's --model: its tokenizer and chat template turn token ids "
                        "into text (its weights are not loaded); --model-path is SGLang's name")
    add_served_model_name(p)
    add_text_options(p)
    add_default(p, "--host", HttpConfig, "interface to serve on, as SGLang's --host "
                "(default {default})")
    add_default(p, "--port", HttpConfig, "port, as SGLang's --port (default {default}, SGLang's "
                "too; 0 = any free port)", type=int)
    add_http_key_options(p)
    add_default(p, "--insecure", HttpConfig, "serve on a non-loopback --host without --api-key; "
                "refused without this flag", action="store_true")
    add_default(p, "--curve-keys", HttpConfig, "the cluster's CURVE key directory (see `zpd "
                "keys`): connects to the router with its admin key")
    add_default(p, "--ready-file", HttpConfig, "write {role, endpoint, pid} here once serving")
    add_default(p, "--connect-timeout", HttpConfig, "seconds within which the router must "
                "acknowledge each request, else it fails with 503 (default {default})", type=float)
    add_default(p, "--weights-timeout", HttpConfig, "seconds a weight update may take: "
                "update_weights_from_disk, or a trainer's push from its first broadcast to the "
                "commit (a stalled trainer fails the push after this; default {default})",
                type=float)
    add_prompt_limit_options(p)
    add_http_front_options(p)


def add_http_workers_option(g: argparse._ActionsContainer, flag: str) -> None:
    g.add_argument(flag, dest="http_workers", type=int, default=1, metavar="N",
                   help="HTTP front processes serving the same host:port (SO_REUSEPORT; "
                        "default 1): each is a whole front with its own router connections, "
                        "for more than one core of HTTP work. One that dies is restarted; one "
                        "that dies at start-up or within 10 s of its start stops them all")


def add_http_front_options(g: argparse._ActionsContainer) -> None:
    """`zpd http` (and `zpd launch` for it): what one call may ask for, and its streams."""
    add_default(g, "--max-batch-requests", HttpConfig, "generations one HTTP call may start "
                "(prompts x n); more is refused with 400 (default {default})", type=int)
    add_default(g, "--incremental-streaming-output", HttpConfig, "each streamed /generate event "
                "carries only the text, output_ids and logprobs new since the last (SGLang's "
                "flag); by default each carries everything so far, as SGLang's",
                action="store_true")
    add_default(g, "--cumulative-bytes-per-token", HttpConfig, "without "
                "--incremental-streaming-output, a streamed /generate's events (each carrying "
                "everything so far) are spaced so that it writes about this many bytes per "
                "token; the last event always comes (default {default})", type=int)
    add_default(g, "--stream-write-timeout", HttpConfig, "a stream whose client reads nothing "
                "for this many seconds is closed and its requests aborted (default {default})",
                type=float)
    add_default(g, "--stream-buffer-bytes", HttpConfig, "bytes of a stream the front holds "
                "unsent before it waits for the client; the socket's kernel send buffer is "
                "set to it too (default {default})", type=int)
    add_default(g, "--stream-buffer-total-bytes", HttpConfig, "bytes all streams together may "
                "hold unsent: past it, a stream whose client is not reading waits until the "
                "client takes what it has (else it is closed after --stream-write-timeout) "
                "before the front holds more of it (default {default})", type=int)
    add_default(g, "--max-call-logprobs", HttpConfig, "prompt logprob entries one call may ask "
                "for, summed over its prompts: scored positions x (1 + top_logprobs_num + "
                "len(token_ids_logprob)), about 30 bytes of answer each; more is refused with "
                "400 naming this flag (default {default})", type=int)
    add_default(g, "--max-answer-bytes", HttpConfig, "bytes a call's answer (not streamed) may "
                "hold, about 32 per token id or logprob entry; past it the call's requests are "
                "aborted and it is answered 400 naming this flag (default {default})", type=int)


def check_front_options(args: argparse.Namespace) -> None:
    """ValueError naming a flag of add_http_front_options that cannot work."""
    if getattr(args, "http_workers", 1) < 1:
        raise ValueError("--workers (--http-workers) must be at least 1")
    for name in ("max_batch_requests", "cumulative_bytes_per_token", "stream_buffer_bytes",
                 "stream_buffer_total_bytes", "max_call_logprobs", "max_answer_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.stream_write_timeout > 0:
        raise ValueError("--stream-write-timeout must be positive")


def add_served_model_name(g: argparse._ActionsContainer) -> None:
    g.add_argument("--served-model-name", default=None,
                   help="the model id /v1/models, OpenAI answers, /get_server_info and the "
                        "metrics' model_name report (SGLang's flag; default: --model as given)")


def add_http_key_options(g: argparse._ActionsContainer) -> None:
    g.add_argument("--api-key", default=None, help="Bearer token every HTTP route but /health "
                   "needs ('Authorization: Bearer KEY'; default $ZPD_API_KEY, else none)")
    g.add_argument("--admin-api-key", default=None, help="Bearer token the admin routes need "
                   "(pause, continue, update weights, abort, memory, flush); without it they "
                   "take --api-key (default $ZPD_ADMIN_API_KEY)")
    g.add_argument("--api-key-file", default=None, help="read --api-key from this file (its "
                   "first line; a key on the command line is readable by every local user)")
    g.add_argument("--admin-api-key-file", default=None, help="read --admin-api-key from this "
                   "file. An admin key needs --curve-keys (or --insecure): without CURVE any "
                   "local process can send admin commands to the router directly")
    add_http_guard_options(g)


def add_http_guard_options(g: argparse._ActionsContainer) -> None:
    """The HTTP front's defences against slow, idle and browser clients (docs/operating.md, "Security")."""
    add_default(g, "--keepalive-timeout", HttpConfig, "seconds an HTTP connection may stay "
                "idle between requests (default {default})", type=float)
    add_default(g, "--header-timeout", HttpConfig, "seconds a request's headers may take from "
                "its first byte (default {default})", type=float)
    add_default(g, "--body-timeout", HttpConfig, "seconds a request's body may take to arrive "
                "(408 after; default {default})", type=float)
    add_default(g, "--max-connections", HttpConfig, "HTTP connections open at once; past it the "
                "one idle longest is closed, or the new one refused (default {default}: three "
                "quarters of the descriptor limit)", type=int)
    g.add_argument("--allowed-hosts", default=None, help="without --api-key, the front answers "
                   "only requests whose Host is an IP address, localhost, its --host or this "
                   "machine's name (against DNS rebinding): comma-separated further names, or "
                   "'*' for any")


def http_config(args: argparse.Namespace) -> HttpConfig:
    """The HttpConfig that the flags of `zpd http` (and its environment) describe."""
    api_key, admin_key = given_http_keys(args)
    check_admin_key(admin_key, args.curve_keys, args.insecure)
    check_front_options(args)
    return HttpConfig(router=",".join(parse_routers(args.router)), workers=args.http_workers,
                      model=args.model, host=args.host, port=args.port,
                      served_model_name=args.served_model_name, overrides=model_overrides(args),
                      api_key=api_key, admin_api_key=admin_key, insecure=args.insecure,
                      keepalive_timeout=args.keepalive_timeout, header_timeout=args.header_timeout,
                      body_timeout=args.body_timeout, max_connections=args.max_connections,
                      allowed_hosts=tuple(h.strip() for h in (args.allowed_hosts or "").split(",")
                                          if h.strip()),
                      curve_keys=args.curve_keys, ready_file=args.ready_file,
                      connect_timeout=args.connect_timeout, weights_timeout=args.weights_timeout,
                      prompt_limits=prompt_limits(args), max_batch_requests=args.max_batch_requests,
                      incremental_streaming_output=args.incremental_streaming_output,
                      cumulative_bytes_per_token=args.cumulative_bytes_per_token,
                      stream_write_timeout=args.stream_write_timeout,
                      stream_buffer_bytes=args.stream_buffer_bytes,
                      stream_buffer_total_bytes=args.stream_buffer_total_bytes,
                      max_call_logprobs=args.max_call_logprobs,
                      max_answer_bytes=args.max_answer_bytes)
