"""A trainer process for the e2e weight-sync tests: rank 0 of a gloo group on
loopback, built as SGLang's init_custom_process_group builds it (slime, AReaL and
verl do; tests/unit/trainer_side.sglang_style_group), that broadcasts tiny:SEED's
tensors (in the order of tiny_state_dict) and prints `sent N` after each, so a test
can kill it mid-push or watch it stall.

    python -m tests.e2e.trainer_proc PORT WORLD SEED [--group G --sleep-after N --sleep S]
"""
from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch.distributed as dist

from engines.models.tiny import tiny_state_dict
from tests.unit.trainer_side import sglang_style_group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("seed", type=int)
    ap.add_argument("--sleep-after", type=int, default=-1, help="pause after this many tensors")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--bad-shape", default=None, help="send this tensor with one more row")
    ap.add_argument("--group", default="weight_update_group")
    args = ap.parse_args()
    group = sglang_style_group("127.0.0.1", args.port, args.world, args.group, "gloo",
                               timedelta(seconds=60))
    print("joined", flush=True)
    tensors = tiny_state_dict(args.seed)
    if args.bad_shape:
        t = tensors[args.bad_shape]
        tensors[args.bad_shape] = t.new_zeros(t.shape[0] + 1, *t.shape[1:])
    if input() != "push":                 # the test says when its HTTP call is out
        return
    for i, t in enumerate(tensors.values(), 1):
        dist.broadcast(t.contiguous(), src=0, group=group)
        print(f"sent {i}", flush=True)
        if i == args.sleep_after:
            time.sleep(args.sleep)
    print("done", flush=True)
    dist.destroy_process_group(group)


if __name__ == "__main__":
    main()
