"""What an RL trainer does with zpd over HTTP, SGLang's native routes only:

1. generate a batch of rollouts with logprobs (POST /generate, a list of prompts),
2. while they run, push new weights: pause_generation (retract: the requests keep
   their place, their KV is dropped), update_weights_from_disk, continue_generation,
3. read back, for every token, which weight version produced it.

Tokens from before the pause come from the old weights; the rest are the new
weights' continuation of the whole prefix (the KV is recomputed under the new
weights), so a trainer can tell on-policy tokens from stale ones.

    python examples/rl_loop.py                      # starts its own tiny cluster
    python examples/rl_loop.py --url http://127.0.0.1:30000 --checkpoint /ckpt/step-1

Without --checkpoint it writes `tiny:1` (the tiny model with other weights) as a
checkpoint directory, which fits the tiny cluster it starts.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp


class Server:
    """The HTTP API of a zpd cluster (`zpd http`, or `zpd launch --http-port`)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, api_key: str | None,
                 admin_key: str | None) -> None:
        self.session, self.url = session, url.rstrip("/")
        self.user = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.admin = {"Authorization": f"Bearer {admin_key or api_key}"} if admin_key or api_key else {}

    async def post(self, path: str, body: dict | None = None, admin: bool = False) -> tuple[int, object]:
        async with self.session.post(self.url + path, json=body or {},
                                     headers=self.admin if admin else self.user) as r:
            return r.status, await r.json()

    async def weight_version(self) -> str:
        async with self.session.get(self.url + "/get_weight_version", headers=self.user) as r:
            return (await r.json())["weight_version"]

    async def command(self, path: str, body: dict | None = None) -> None:
        status, answer = await self.post(path, body, admin=True)
        if status != 200 or not answer.get("success"):
            raise RuntimeError(f"{path} failed ({status}): {answer}")
        print(f"  {path}: {answer['message']}")


async def rollout(server: Server, prompts: list[list[int]], max_new: int) -> list[dict]:
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True,
                                "seed": 1234}}
    status, answer = await server.post("/generate", body)
    if status == 400 and "return_logprob" in answer["error"]["message"]:
        print("  (this cluster's engine returns no logprobs yet: rolling out without them)")
        body.pop("return_logprob")
        status, answer = await server.post("/generate", body)
    if status != 200:
        raise RuntimeError(f"/generate failed ({status}): {answer}")
    return answer


async def train_step(server: Server, checkpoint: str, version: str, after_s: float) -> None:
    """What the trainer does once it has new weights: swap them under the rollouts."""
    await asyncio.sleep(after_s)
    print(f"new weights ready after {after_s:g} s:")
    await server.command("/pause_generation", {"mode": "retract"})
    await server.command("/update_weights_from_disk", {"model_path": checkpoint,
                                                       "weight_version": version})
    await server.command("/continue_generation")


def spans(versions: list[str]) -> str:
    """["a", "a", "b"] -> "2 by a, 1 by b"."""
    return ", ".join(f"{len(list(g))} by {v}" for v, g in itertools.groupby(versions))


async def main(args: argparse.Namespace) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        server = Server(session, args.url, args.api_key, args.admin_api_key)
        before = await server.weight_version()
        prompts = [[(7 * i + j) % 200 + 32 for j in range(5 + i)] for i in range(args.prompts)]
        print(f"rolling out {len(prompts)} prompts x {args.max_new_tokens} tokens "
              f"on weights {before!r}")
        outs, _ = await asyncio.gather(rollout(server, prompts, args.max_new_tokens),
                                       train_step(server, args.checkpoint, args.version, args.after))
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            lps = meta.get("output_token_logprobs")
            mean = f", mean logprob {sum(lp for lp, _, _ in lps) / len(lps):.3f}" if lps else ""
            print(f"rollout {i}: {len(out['output_ids'])} tokens: {spans(meta['output_token_weight_versions'])}"
                  f" (retracted {meta['retractions']}x{mean})")
        print(f"weight version now: {await server.weight_version()!r}")
    return 0


def launch_tiny(tmp: Path) -> tuple[subprocess.Popen, str]:
    """A local tiny cluster with an HTTP server; returns it and its URL."""
    ready, log = tmp / "cluster.json", tmp / "cluster.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "zpd", "launch", "--model", "tiny",
                                 "--port", "0", "--http-port", "0", "--ready-file", str(ready)],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("the tiny cluster did not start:\n" + log.read_text()[-3000:])
        time.sleep(0.2)
    return proc, "http://" + json.loads(ready.read_text())["http"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="zpd http URL (default: start a tiny cluster)")
    p.add_argument("--api-key", default=os.environ.get("ZPD_API_KEY"))
    p.add_argument("--admin-api-key", default=os.environ.get("ZPD_ADMIN_API_KEY"))
    p.add_argument("--checkpoint", default=None, help="new weights (default: tiny:1 written "
                   "to a temporary directory)")
    p.add_argument("--version", default="step-1", help="the new weights' version string")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--after", type=float, default=0.3, help="seconds into the rollout at which "
                   "the new weights arrive")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            from engines.models.tiny import save_tiny
            args.checkpoint = str(save_tiny(Path(tmp) / "tiny-1", seed=1))
        cluster = None
        if args.url is None:
            cluster, args.url = launch_tiny(Path(tmp))
        try:
            sys.exit(asyncio.run(main(args)))
        finally:
            if cluster is not None:
                cluster.terminate()
                cluster.wait(30)
