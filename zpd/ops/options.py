"""Command-line options shared by the subcommands that load a model or sample."""
from __future__ import annotations

import argparse

from engines.sampler import SamplingParams

SAMPLING_FLAGS = {  # flag -> (type, help)
    "max_new_tokens": (int, "tokens to generate at most (default 128)"),
    "temperature": (float, "0 = greedy; default 1.0"),
    "top_p": (float, "nucleus sampling mass in (0, 1]"),
    "top_k": (int, "sample among the k best tokens (-1: all)"),
    "min_p": (float, "drop tokens below min_p x the best token's probability"),
    "repetition_penalty": (float, "> 1 discourages tokens seen in prompt or output"),
    "frequency_penalty": (float, "subtracted per occurrence in the output"),
    "presence_penalty": (float, "subtracted once for any token in the output"),
    "seed": (int, "per-request seed: same seed, same tokens"),
}


CURVE_HELP = ("CURVE key directory made by `zpd keys`: encrypt every connection and admit "
              "only authorised keys (default: plaintext)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True,
                   help="Hugging Face-format directory (Llama, Mistral, Qwen2, Qwen3) or 'tiny' "
                        "(embedded default; 'tiny:SEED' for other weights)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16", "float16", "float64"],
                   help="weights and KV dtype; float64 keeps near-ties out of exactness tests")
    g.add_argument("--weight-version", default=None,
                   help="version string reported with every token (default: model name)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    g.add_argument("--kv-cache-mb", type=float, default=256,
                   help="KV pool size in MiB (default 256)")
    g.add_argument("--max-batch", type=int, default=64,
                   help="most requests decoding at once (default 64)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    for name, (kind, text) in SAMPLING_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable); output text ends before it")
    g.add_argument("--stop-token-ids", default=None, help="comma-separated token ids that end output")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("input (repeat for several requests)")
    g.add_argument("--prompt", action="append", default=[], help="text prompt (needs a tokenizer)")
    g.add_argument("--input-ids", action="append", default=[], type=parse_ids,
                   help="comma-separated token ids, e.g. 1,2,3")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def sampling_dict(args: argparse.Namespace) -> dict:
    """Only what the user set, so defaults live in one place (SamplingParams)."""
    d = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.stop:
        d["stop"] = list(args.stop)
    if args.stop_token_ids:
        d["stop_token_ids"] = parse_ids(args.stop_token_ids)
    if args.ignore_eos:
        d["ignore_eos"] = True
    SamplingParams.from_dict(d)            # fail early with a clear message
    return d


def add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--transport", default="mooncake", choices=["mooncake"],
                   help="KV transfer backend (default mooncake)")
    g.add_argument("--ib-device", default="",
                   help="RDMA device name(s) for Mooncake, e.g. mlx5_0 ('' = auto; TCP without RDMA NICs)")
    g.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"],
                   help="Mooncake protocol hint (Mooncake picks RDMA when NICs exist; "
                        "MC_FORCE_TCP=1 forces TCP)")
    g.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="most prompt tokens in one prefill forward (default 8192)")
    g.add_argument("--transfer-timeout", type=float, default=20.0,
                   help="seconds one KV write may take before the request fails with 504")
    g.add_argument("--kv-wait-timeout", type=float, default=60.0,
                   help="seconds to wait for KV pages, kv_dest or kv_done before 504")
    g.add_argument("--dead-fence", type=float, default=300.0,
                   help="decode: longest pages stay fenced for a prefill that stopped answering "
                        "in the middle of writing them (default 300)")
    add_liveness_options(g)
    g.add_argument("--curve-keys", default=None, help=CURVE_HELP)


def add_liveness_options(g: argparse._ActionsContainer) -> None:
    g.add_argument("--heartbeat", type=float, default=0.5,
                   help="seconds between pings to every peer (default 0.5)")
    g.add_argument("--peer-timeout", type=float, default=2.0,
                   help="a peer silent this long is dead: its requests fail with 503 and no "
                        "new ones go to it until it answers again (default 2)")


WORKER_PASSTHROUGH = ("model", "device", "dtype", "weight_version", "page_size", "kv_cache_mb",
                      "max_batch", "threads", "transport", "ib_device", "protocol",
                      "max_prefill_tokens", "transfer_timeout", "kv_wait_timeout", "dead_fence",
                      "heartbeat", "peer_timeout", "log_level", "curve_keys")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The model/worker flags of `args` as command-line arguments for a child worker."""
    argv: list[str] = []
    for name in WORKER_PASSTHROUGH:
        value = getattr(args, name, None)
        if value is not None and value != "":
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv
