"""A trainer on the workers' host pushing its weights through shared memory, the
call slime's colocated mode and verl make against SGLang:
POST /update_weights_from_tensor {"serialized_named_tensors": [...], ...}.

Each entry is base64 of a torch `ForkingPickler` dump of `[(name, tensor), ...]`: only
handles of the trainer's shared memory travel, so the zpd workers must run on this
host. CPU tensors must be shared with torch's "file_system" strategy (the default,
"file_descriptor", hands file descriptors to the trainer's own multiprocessing
children only: a cluster started apart answers 400 naming the fix); CUDA tensors
travel as CUDA IPC handles. The trainer keeps the
tensors alive until the answer, which comes once every worker has the new weights,
or none has.

    python examples/push_tensors.py --url http://127.0.0.1:30000 --weights tiny:7 --version v7

One entry: every worker takes it; `--per-rank` sends one per worker (tp_size of
/get_server_info), as a trainer whose ranks each hold their own shard does.
`--bucket` sends SGLang's load_format "flattened_bucket": one flat tensor and a
FlattenedTensorMetadata per tensor (fewer handles; slime's colocated default).
`--verl` sends each tensor as a LocalSerializedTensor (one value, or one per rank
with `--per-rank`), as sglang's `weight_sync.utils.update_weights` does for verl.
"""
from __future__ import annotations

import argparse
import base64
import importlib
import json
import sys
import types
import urllib.error
import urllib.request
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401  (torch's tensor reductions)
from safetensors.torch import load_file


def post(url: str, path: str, body: dict, key: str | None = None, timeout: float = 600) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def load_weights(spec: str) -> dict[str, torch.Tensor]:
    if spec.startswith("tiny"):
        from engines.models.tiny import tiny_seed, tiny_state_dict
        return tiny_state_dict(tiny_seed(spec))
    return {k: v for f in sorted(Path(spec).glob("*.safetensors")) for k, v in load_file(f).items()}


@dataclass
class FlattenedTensorMetadata:
    """SGLang's metadata of one tensor in a flat bucket (sglang 0.5: byte offsets and a
    byte count). zpd takes it only as SGLang's class, so without sglang installed this
    stand-in pickles under SGLang's module path."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """SGLang's per-rank tensor (verl's path): one MultiprocessingSerializer dump of
    the tensor per rank of the server."""
    values: list


def sglang_class(module: str, standin: type) -> type:
    """SGLang's own class where sglang is installed, else the stand-in under its name."""
    try:
        return getattr(importlib.import_module(module), standin.__name__)
    except ImportError:
        for i in range(1, module.count(".") + 2):
            name = ".".join(module.split(".")[:i])
            sys.modules.setdefault(name, types.ModuleType(name))
        standin.__module__ = module
        setattr(sys.modules[module], standin.__name__, standin)
        return standin


def flattened(named: list[tuple[str, torch.Tensor]]) -> dict:
    """What SGLang's FlattenedTensorBucket holds: every tensor's bytes back to back."""
    record = sglang_class("sglang.srt.weight_sync.tensor_bucket", FlattenedTensorMetadata)
    parts, metadata, at = [], [], 0
    for name, t in named:
        raw = t.contiguous().view(-1).view(torch.uint8)
        metadata.append(record(name, t.shape, t.dtype, at, at + raw.numel(), raw.numel()))
        parts.append(raw)
        at += raw.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def serialize(obj: object) -> str:
    """One rank's entry: the tensors move to shared memory, their handles are pickled."""
    return base64.b64encode(bytes(ForkingPickler.dumps(obj))).decode()


def per_rank(named: list[tuple[str, torch.Tensor]], ranks: int) -> list:
    """What sglang's weight_sync.utils.update_weights sends (verl): per tensor a
    LocalSerializedTensor with every rank's dump (here the same tensor for each)."""
    record = sglang_class("sglang.srt.model_executor.model_runner_components.weight_updater",
                          LocalSerializedTensor)
    return [(name, record(values=[bytes(ForkingPickler.dumps(t))] * ranks)) for name, t in named]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the cluster's HTTP API (zpd http / launch --http-port)")
    ap.add_argument("--weights", required=True, help="tiny:SEED or a safetensors directory")
    ap.add_argument("--version", default=None, help="weight version (left out: it stays)")
    ap.add_argument("--per-rank", action="store_true", help="one entry per worker rank")
    ap.add_argument("--bucket", action="store_true", help='load_format "flattened_bucket"')
    ap.add_argument("--verl", action="store_true",
                    help="each tensor a LocalSerializedTensor, as verl sends them")
    ap.add_argument("--admin-api-key", default=None)
    args = ap.parse_args()
    url = args.url.rstrip("/")
    mp.set_sharing_strategy("file_system")
    named = list(load_weights(args.weights).items())
    ranks = 1
    if args.per_rank:
        with urllib.request.urlopen(url + "/get_server_info") as r:
            ranks = json.loads(r.read())["tp_size"]
    payload = flattened(named) if args.bucket else per_rank(named, ranks) if args.verl else named
    entries = [serialize(payload)] * ranks
    body = {"serialized_named_tensors": entries, "flush_cache": True,
            "load_format": "flattened_bucket" if args.bucket else None,
            "abort_all_requests": False, "weight_version": args.version}
    status, answer = post(url, "/update_weights_from_tensor", body, args.admin_api_key)
    if status != 200 or not answer.get("success"):
        sys.exit(f"/update_weights_from_tensor failed: HTTP {status} {answer}")
    print(f"/update_weights_from_tensor: {answer['message']} (version "
          f"{answer.get('weight_version')!r}, {sum(map(len, entries))} payload characters)", flush=True)


if __name__ == "__main__":
    main()
