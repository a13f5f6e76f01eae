"""`zpd` command line: one subcommand per role (docs/design.md, "Command line")."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

import orjson

from engines.config import ModelError
from engines.formats.overrides import ModelOverrides
from zpd.ops.admin import add_admin_parser
from zpd.ops.exposure import check_admin_key, check_bind, check_http_bind, given_http_keys
from zpd.ops.flags import COMMAND_FLAGS, add_flags, apply_config_file, usage
from zpd.ops.keys import add_keys_parser
from zpd.env import configure_engine
from zpd.ops.http_options import http_config
from zpd.ops.options import (ROUTER_ENDPOINT, add_prompt_options, add_sampling_options,
                             check_fraction, check_tp, kv_cache_mb, model_overrides,
                             router_config, sampling_params, worker_argv, worker_config)
from zpd.wire.status import StatusError


def _cmd_run(args: argparse.Namespace) -> int:
    from engines.allocator_tuning import freeze_startup_objects, tune_allocator
    from engines.loader import load_model
    from engines.offline import OfflineEngine
    from engines.request import Request
    from zpd.worker.mem_fraction import kv_cache_mb as kv_budget_mb

    params = sampling_params(args)
    check_fraction(args.mem_fraction_static)
    tune_allocator()
    configure_engine()
    check_tp(args.tp, args.ep, args.deterministic)
    tp = procs = None
    if args.tp == 1 and args.ep == 1:
        model = load_model(args.model, args.device, args.dtype, args.weight_version,
                           model_overrides(args))
    else:
        from engines.tp.spawn import lead
        model, tp, procs = lead(args.model, args.device, args.dtype, args.weight_version,
                                model_overrides(args), args.tp, args.threads, args.ep)
    try:
        inputs = [_encode(model, text, args.chat) for text in args.prompt] + list(args.input_ids)
        if not inputs:
            raise StatusError(400, "give at least one --prompt or --input-ids")
        kv_mb = kv_budget_mb(args.mem_fraction_static, kv_cache_mb(args), model.net, model.device)
        engine = OfflineEngine(model, kv_mb, args.page_size, args.max_batch, tp=tp,
                               routed_experts=args.enable_return_routed_experts,
                               deterministic=args.deterministic)
        freeze_startup_objects()
        reqs = [Request(f"run-{i}", ids, params) for i, ids in enumerate(inputs)]
        for out in engine.run(reqs):
            _print_response(out, args.json)
    finally:
        if tp is not None:
            from engines.tp.spawn import stop
            stop(tp, procs)
    return 0


def _encode(model, text: str, chat: bool) -> list[int]:
    if model.tokenizer is None:
        raise ModelError(f"{model.text_problem}: use --input-ids")
    if chat and model.chat is None:
        raise ModelError(f"{model.text_problem}: drop --chat or use --input-ids")
    return model.encode_chat(user_turn(text)) if chat else model.encode(text)


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _print_response(out: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
    elif out["finish_reason"].get("type") == "abort":
        print(f"[{out['rid']} failed: {out['finish_reason']['status_code']} "
              f"{out['finish_reason']['message']}]")
    elif not out["output_ids"] and "input_token_logprobs" in out:     # a scored prompt
        scored = [v for v, _ in out["input_token_logprobs"] if v is not None]
        print(f"[{out['rid']} scored: {len(scored)} prompt tokens, logprob sum "
              f"{sum(scored):.4f}; --json gives each]")
    else:
        print(out["text"] if out["text"] is not None else " ".join(map(str, out["output_ids"])))


def _cmd_prefill(args: argparse.Namespace) -> int:
    from zpd.worker.prefill import PrefillScheduler
    from zpd.ops.serve import serve_worker
    cfg = worker_config(args, "prefill")
    check_bind("prefill", cfg.host, cfg.curve_keys, cfg.insecure)
    return serve_worker(lambda core, ctx: PrefillScheduler(core), cfg)


def _cmd_decode(args: argparse.Namespace) -> int:
    from zpd.ops.serve import serve_worker
    from zpd.ops.worker import decode_scheduler
    cfg = worker_config(args, "decode")
    check_bind("decode", cfg.host, cfg.curve_keys, cfg.insecure)
    return serve_worker(decode_scheduler, cfg)


def _cmd_router(args: argparse.Namespace) -> int:
    from zpd.ops.serve import serve_router
    cfg = router_config(args)
    check_bind("router", cfg.host, cfg.curve_keys, cfg.insecure)
    return serve_router(cfg)


def _cmd_http(args: argparse.Namespace) -> int:
    from zpd.ops.serve import serve_http
    cfg = http_config(args)
    check_http_bind(cfg.host, cfg.api_key, cfg.insecure)
    return serve_http(cfg)


def _cmd_launch(args: argparse.Namespace) -> int:
    from zpd.ops.launch import launch
    # Every child binds --host: refuse here, before any of them starts.
    check_bind("launch", args.host, args.curve_keys, args.insecure)
    if args.http_port is not None:
        api_key, admin_key = given_http_keys(args)
        check_http_bind(args.host, api_key, args.insecure)
        check_admin_key(admin_key, args.curve_keys, args.insecure)
    _check_cluster(args)
    return launch(args, worker_argv(args))


def _cmd_slurm(args: argparse.Namespace) -> int:
    from zpd.ops.slurm import run_slurm
    _check_cluster(args)
    if args.max_restarts < 0 or not args.restart_backoff >= 0:
        raise ValueError("--max-restarts and --restart-backoff must be at least 0")
    return run_slurm(args)


def _check_cluster(args: argparse.Namespace) -> None:
    """`zpd launch`'s and `zpd slurm`'s shape and model flags, before anything starts."""
    if args.prefill < 1 or args.decode < 1 or args.routers < 1:
        raise ValueError("--prefill, --decode and --routers must be at least 1")
    if args.http_workers < 1:
        raise ValueError("--http-workers must be at least 1")
    check_fraction(args.mem_fraction_static)
    overrides = model_overrides(args)
    if overrides != ModelOverrides():
        from engines.text import load_text
        load_text(args.model, overrides)     # one clear error now, not one per worker's log
    for flag in ("prefill_threads", "decode_threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    for tp, ep in ((args.tp, args.ep), (args.prefill_tp or args.tp, args.prefill_ep or args.ep),
                   (args.decode_tp or args.tp, args.decode_ep or args.ep)):
        check_tp(tp, ep, args.deterministic)


def _cmd_generate(args: argparse.Namespace) -> int:
    from zpd.client import Client
    texts = [{"messages": user_turn(t)} if args.chat else {"prompt": t} for t in args.prompt]
    inputs = texts + [{"input_ids": i} for i in args.input_ids]
    if not inputs:
        raise StatusError(400, "give at least one --prompt or --input-ids")
    sampling = sampling_params(args)
    from zpd.wire.security import client_curve
    curve = client_curve(args.curve_keys, "client") if args.curve_keys else None
    with Client(args.router, timeout=args.timeout, curve=curve,
                connect_timeout=args.connect_timeout) as client:
        if args.stream and len(inputs) == 1:
            for chunk in client.stream(sampling_params=sampling, **inputs[0]):
                if args.json:
                    sys.stdout.write(orjson.dumps(chunk).decode() + "\n")
                    sys.stdout.flush()
            return 0
        outs = client.generate_many([r | {"sampling_params": sampling} for r in inputs])
    for out in outs:
        _print_response(out, args.json)
    return 0 if all(o["finish_reason"].get("type") != "abort" for o in outs) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zpd", description="Prefill/decode disaggregated LLM serving. "
                                "'zpd COMMAND --help' explains each command.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO (one line per request event), WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = _command(sub, "run", _cmd_run, "offline generation in one process (the reference path)",
                   "Generate offline in one process, with continuous batching of all given "
                   "prompts. No disaggregation.")
    add_prompt_options(run)
    add_sampling_options(run)
    run.add_argument("--json", action="store_true", help="one JSON response per line")

    for role, func, text in (("prefill", _cmd_prefill, "computes prompts' KV and writes it to decode"),
                             ("decode", _cmd_decode, "receives KV from prefill and generates")):
        _command(sub, role, func, f"start a {role} worker ({text})",
                 f"Start a {role} worker: it {text}.")
    _command(sub, "router", _cmd_router, "start the router", "Start the router: clients "
             "connect here; it picks the least loaded prefill and decode for each request.")
    _command(sub, "launch", _cmd_launch, "a whole cluster on this host",
             "Start a router and N prefill + K decode workers on this host; Ctrl-C (or "
             "SIGTERM) stops them all.")
    _command(sub, "slurm", _cmd_slurm, "a whole cluster inside a Slurm job",
             "Inside a Slurm job (scripts/slurm/zpd.sbatch): routers and the HTTP front on "
             "the allocation's first node, the workers on the others, each an `srun --exact` "
             "step; dead steps are started again. Takes `zpd launch`'s flags.")
    _command(sub, "http", _cmd_http, "serve SGLang's and OpenAI's HTTP APIs",
             "Serve SGLang's native routes (/generate, /pause_generation, "
             "/update_weights_from_disk, a trainer's /init_weights_update_group and "
             "/update_weights_from_distributed, ...) and OpenAI's (/v1/models, "
             "/v1/completions, /v1/chat/completions, /v1/responses) over HTTP, as a client "
             "of a running router.")

    g = sub.add_parser("generate", parents=[common], help="send requests to a router",
                       description="Send requests to a running cluster and print the responses.")
    g.add_argument("--router", default=ROUTER_ENDPOINT, help=f"router endpoint (default "
                   f"{ROUTER_ENDPOINT}), or several of one pool, comma-separated (one takes "
                   "each request; a dead one's requests go to the others)")
    add_prompt_options(g)
    add_sampling_options(g)
    g.add_argument("--stream", action="store_true", help="print chunks as they arrive (one request)")
    g.add_argument("--json", action="store_true", help="JSON output, one object per line")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for an answer")
    g.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds within which the router must acknowledge each request; "
                        "fails fast when none listens at --router (default 5)")
    g.add_argument("--curve-keys", default=None,
                   help="CURVE key directory (see `zpd keys`); connects with its client key")
    g.set_defaults(func=_cmd_generate)
    add_admin_parser(sub, common)
    add_keys_parser(sub, common)
    return parser


def _command(sub: argparse._SubParsersAction, name: str, func: Callable, summary: str,
             description: str) -> argparse.ArgumentParser:
    """Subcommand `name`, its flags built from their declarations (COMMAND_FLAGS)."""
    p = sub.add_parser(name, help=summary, description=description,
                       usage=usage(COMMAND_FLAGS[name]))
    add_flags(p, COMMAND_FLAGS[name])
    p.set_defaults(func=func)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    apply_config_file(parser, argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except (ModelError, StatusError, ValueError, TimeoutError) as e:
        print(f"zpd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
