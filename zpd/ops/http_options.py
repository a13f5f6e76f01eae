"""The HttpConfig that `zpd http`'s flags describe (declared on its fields,
zpd/config.py), and those `zpd launch` hands its front."""
from __future__ import annotations

import argparse

from zpd.config import HttpConfig
from zpd.failover import parse_routers
from zpd.ops.exposure import check_admin_key, given_http_keys
from zpd.ops.options import model_overrides, prompt_limits

# What `zpd launch` hands its HTTP front: it must turn text into the workers' ids.
HTTP_PASSTHROUGH = ("served_model_name", "tokenizer_path", "chat_template",
                    "max_text_bytes", "max_input_ids", "max_batch_requests",
                    "incremental_streaming_output", "cumulative_bytes_per_token",
                    "stream_write_timeout", "stream_buffer_bytes", "stream_buffer_total_bytes",
                    "max_call_logprobs", "max_answer_bytes", "tool_call_parser",
                    "keepalive_timeout", "header_timeout", "body_timeout", "max_connections",
                    "allowed_hosts")


def check_front_options(args: argparse.Namespace) -> None:
    """ValueError naming a flag of the HTTP front's streams and caps that cannot work."""
    if getattr(args, "http_workers", 1) < 1:
        raise ValueError("--workers (--http-workers) must be at least 1")
    for name in ("max_batch_requests", "cumulative_bytes_per_token", "stream_buffer_bytes",
                 "stream_buffer_total_bytes", "max_call_logprobs", "max_answer_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.stream_write_timeout > 0:
        raise ValueError("--stream-write-timeout must be positive")


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
                      max_answer_bytes=args.max_answer_bytes,
                      tool_call_parser=args.tool_call_parser)
