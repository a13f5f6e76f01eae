"""A trainer process for the e2e weight-sync tests: rank 0 of a gloo group on
loopback that broadcasts tiny:SEED's tensors (in the order of tiny_state_dict) and
prints `sent N` after each, so a test can kill it mid-push or watch it stall.

    python -m tests.e2e.trainer_proc PORT WORLD SEED [--sleep-after N --sleep S]
"""
from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch.distributed as dist

from engines.tiny import tiny_state_dict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("seed", type=int)
    ap.add_argument("--sleep-after", type=int, default=-1, help="pause after this many tensors")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--bad-shape", default=None, help="send this tensor with one more row")
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=args.world, rank=0, timeout=timedelta(seconds=60))
    print("joined", flush=True)
    tensors = tiny_state_dict(args.seed)
    if args.bad_shape:
        t = tensors[args.bad_shape]
        tensors[args.bad_shape] = t.new_zeros(t.shape[0] + 1, *t.shape[1:])
    if input() != "push":                 # the test says when its HTTP call is out
        return
    for i, t in enumerate(tensors.values(), 1):
        dist.broadcast(t.contiguous(), src=0)
        print(f"sent {i}", flush=True)
        if i == args.sleep_after:
            time.sleep(args.sleep)
    print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
