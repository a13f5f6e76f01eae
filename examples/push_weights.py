"""What a trainer does to push its weights into a running zpd cluster over
torch.distributed, the calls slime, AReaL and verl make against SGLang:

1. POST /init_weights_update_group and, at the same time, join the group as rank 0
   the way SGLang's `init_custom_process_group` does (`trainer_group` below; the HTTP
   call returns once every rank has joined);
2. optionally pause_generation (retract: running requests keep their place), then
   GET /flush_cache as slime and verl do;
3. POST /update_weights_from_distributed with the names, dtypes and shapes, and at
   the same time broadcast each tensor from rank 0 in that order (or, with
   --bucket-mb, one flat bucket per call, load_format "flattened_bucket");
   the answer comes once every worker has the new weights, or none has;
4. continue_generation, destroy_weights_update_group.

    python examples/push_weights.py --url http://127.0.0.1:30000 --weights tiny:7
    python examples/push_weights.py --url URL --weights /ckpt/step-10 --pause retract

`--weights` is `tiny:SEED` (the embedded model with other weights) or a directory of
Hugging Face safetensors; a real trainer sends its live parameters instead.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import _new_process_group_helper, _world


def post(url: str, path: str, body: dict, key: str | None = None, timeout: float = 600) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read()) | {"http_status": e.code}


def check(path: str, answer: dict) -> dict:
    if not answer.get("success"):
        sys.exit(f"{path} failed: {answer}")
    print(f"{path}: {answer['message']}", flush=True)
    return answer


def load_weights(spec: str) -> dict[str, torch.Tensor]:
    if spec.startswith("tiny"):
        from engines.models.tiny import tiny_seed, tiny_state_dict
        return tiny_state_dict(tiny_seed(spec))
    return {k: v for f in sorted(Path(spec).glob("*.safetensors")) for k, v in load_file(f).items()}


def buckets(tensors: dict[str, torch.Tensor], bucket_mb: float) -> list[list[str]]:
    """Names in groups of about `bucket_mb` (0: all in one call, one broadcast each)."""
    if bucket_mb <= 0:
        return [list(tensors)]
    out, size = [[]], 0
    for name, t in tensors.items():
        if out[-1] and size + t.nbytes > bucket_mb * 2**20:
            out.append([])
            size = 0
        out[-1].append(name)
        size += t.nbytes
    return out


def trainer_group(backend: str, address: str, port: int, world_size: int,
                  group_name: str) -> dist.ProcessGroup:
    """Rank 0 of a named group, built as SGLang's `init_custom_process_group` (which
    slime, AReaL and verl carry) builds it: the rendezvous store, a PrefixStore named
    after the group, and torch's `_new_process_group_helper` for the group itself (the
    call those frameworks make; torch has no public one for a named group over a given
    store). zpd's workers key their side to match."""
    timeout = timedelta(seconds=600)
    store, _, _ = next(dist.rendezvous(f"tcp://{address}:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, 0, [], backend,
                                         dist.PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}    # for dist.broadcast
    return group


def get_status(url: str, path: str, key: str | None = None) -> int:
    """The HTTP status of GET `path` (slime retries /flush_cache until it is 200)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the cluster's HTTP API (zpd http / launch --http-port)")
    ap.add_argument("--weights", required=True, help="tiny:SEED or a safetensors directory")
    ap.add_argument("--version", default=None, help="weight version the new weights report")
    ap.add_argument("--group-name", default="weight_update_group")
    ap.add_argument("--master-address", default="127.0.0.1", help="this trainer's address, "
                    "reachable from every worker")
    ap.add_argument("--master-port", type=int, default=0, help="0: a free port")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--bucket-mb", type=float, default=0.0, help="flat buckets of this size")
    ap.add_argument("--pause", choices=("retract", "in_place", "abort"), default=None,
                    help="pause generation around the push (and continue after)")
    ap.add_argument("--admin-api-key", default=None)
    args = ap.parse_args()
    url, key = args.url.rstrip("/"), args.admin_api_key
    tensors = load_weights(args.weights)
    with urllib.request.urlopen(url + "/get_server_info") as r:
        workers = json.loads(r.read())["tp_size"]         # the worker ranks to count
    port = args.master_port or free_port()
    pool = ThreadPoolExecutor(1)

    # 1. every worker joins as rank 1..N while this process joins as rank 0
    answer = pool.submit(post, url, "/init_weights_update_group", {
        "master_address": args.master_address, "master_port": port, "rank_offset": 1,
        "world_size": workers + 1, "group_name": args.group_name, "backend": args.backend}, key)
    group = trainer_group(args.backend, args.master_address, port, workers + 1, args.group_name)
    check("/init_weights_update_group", answer.result())

    # 2. pause, flush, 3. push, continue
    if args.pause:
        check("/pause_generation", post(url, "/pause_generation", {"mode": args.pause}, key))
    flushed = get_status(url, "/flush_cache", key)
    if flushed != 200:
        sys.exit(f"GET /flush_cache failed: HTTP {flushed}")
    print("GET /flush_cache: 200", flush=True)
    started = time.perf_counter()
    for names in buckets(tensors, args.bucket_mb):
        part = [tensors[n] for n in names]
        body = {"names": names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in part],
                "shapes": [list(t.shape) for t in part], "group_name": args.group_name,
                "weight_version": args.version}
        if args.bucket_mb > 0:
            body["load_format"] = "flattened_bucket"
        answer = pool.submit(post, url, "/update_weights_from_distributed", body, key)
        if args.bucket_mb > 0:
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in part])
            dist.broadcast(flat, src=0, group=group)
        else:
            for t in part:
                dist.broadcast(t.contiguous(), src=0, group=group)
        check("/update_weights_from_distributed", answer.result())
    nbytes = sum(t.nbytes for t in tensors.values())
    print(f"pushed {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB in "
          f"{time.perf_counter() - started:.3f} s", flush=True)
    if args.pause:
        check("/continue_generation", post(url, "/continue_generation", {}, key))

    # 4. leave
    check("/destroy_weights_update_group",
          post(url, "/destroy_weights_update_group", {"group_name": args.group_name}, key))
    dist.destroy_process_group(group)


if __name__ == "__main__":
    main()
