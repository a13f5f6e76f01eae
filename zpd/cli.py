"""`zpd` command line: one subcommand per role (shared/DESIGN.md, "Contract")."""
from __future__ import annotations

import argparse
import logging
import sys

import orjson

from engines.config import ModelError
from zpd.options import add_model_options, add_prompt_options, add_sampling_options, sampling_dict
from zpd.request import RequestError


def _cmd_run(args: argparse.Namespace) -> int:
    from engines.loader import load_model
    from engines.sampler import SamplingParams
    from zpd.offline import OfflineEngine
    from zpd.request import Request

    params = SamplingParams.from_dict(sampling_dict(args))
    model = load_model(args.model, args.device, args.dtype, args.weight_version)
    inputs = [_encode(model, text) for text in args.prompt] + list(args.input_ids)
    if not inputs:
        raise RequestError(400, "give at least one --prompt or --input-ids")
    engine = OfflineEngine(model, args.kv_cache_mb, args.page_size, args.max_batch)
    reqs = [Request(f"run-{i}", ids, params) for i, ids in enumerate(inputs)]
    for out in engine.run(reqs):
        if args.json:
            sys.stdout.write(orjson.dumps(out).decode() + "\n")
        else:
            print(out["text"] if out["text"] is not None else " ".join(map(str, out["output_ids"])))
    return 0


def _encode(model, text: str) -> list[int]:
    if model.tokenizer is None:
        raise ModelError(f"model {model.spec!r} has no tokenizer.json: use --input-ids")
    return model.tokenizer.encode(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zpd", description="Prefill/decode disaggregated LLM serving.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", parents=[common], help="offline generation in one process (the reference path)",
                         description="Generate offline in one process, with continuous batching "
                                     "of all given prompts. No disaggregation.")
    add_model_options(run)
    add_prompt_options(run)
    add_sampling_options(run)
    run.add_argument("--json", action="store_true", help="one JSON response per line")
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except (ModelError, RequestError, ValueError) as e:
        print(f"zpd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
