"""The router's relay alone: CPU per relayed token of a decode step's tokens, from
the decode's message as it arrives to the client's send, without the rest of a
cluster (bench_control_plane.py measures the whole router under a simulated pool,
whose steps on a 2-core machine carry few tokens each).

    python bench/bench_relay.py [--steps 3000] [--clients 4] [--batches 4,32,128]
    python bench/bench_relay.py --tree /path/to/an/older/checkout     # its router instead

A real RouterServer (its real front socket, real DEALER clients reading what it
sends) with B requests in flight on one decode, spread over --clients clients; each
step carries one token of each. Two ways in: `step` (protocol 7: one step, one body
per client, passed on unread: zpd/router/relay.py) and `tokens` (one Tokens message
for all clients, decoded, settled part by part, repacked and re-encoded per client:
how every step crossed the router before protocol 7, and the way that the slow path
still goes; an older tree, --tree, has only that way). CPU is the process's (its ZeroMQ I/O thread included) and the main
thread's alone, per token; the clients read on a thread of their own.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import zmq

_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else \
    str(Path(__file__).resolve().parents[1])
sys.path.insert(0, _TREE)

from zpd.config import RouterConfig  # noqa: E402
from zpd.router.flights import InFlight  # noqa: E402
from zpd.router.server import RouterServer  # noqa: E402
from zpd.wire.net import Dealer  # noqa: E402
from zpd.wire.protocol import TokenPart, Tokens, decode, encode  # noqa: E402

try:
    from zpd.wire.step import pack_step  # noqa: E402
except ImportError:                       # a tree from before protocol 7
    pack_step = None


def frames_of(raw: list[bytes], ctx: zmq.Context) -> list[zmq.Frame]:
    """`raw` as the router's recv hands it over: zmq Frames, through a real socket pair."""
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://frames")
    b.connect("inproc://frames")
    a.send_multipart(raw)
    out = b.recv_multipart(copy=False)
    a.close(linger=0)
    b.close(linger=0)
    return out


def run(batch: int, n_clients: int, steps: int, way: str) -> dict:
    ctx = zmq.Context()
    cfg = RouterConfig(("127.0.0.1:1",), ("127.0.0.1:2",), port=0, heartbeat=3600)
    server = RouterServer(cfg, ctx)
    decode_w = next(w for w in server.workers if w.role == "decode")
    prefill_w = next(w for w in server.workers if w.role == "prefill")
    clients = [Dealer(ctx, server.endpoint, identity=f"client-{i}".encode())
               for i in range(n_clients)]
    got = [0]
    stop = threading.Event()

    def read() -> None:
        poller = zmq.Poller()
        for c in clients:
            poller.register(c.socket, zmq.POLLIN)
        while not stop.is_set():
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        got[0] += 1
                    except zmq.Again:
                        break

    for c in clients:                         # connected: the router's front knows them
        c.socket.send_multipart([b'{"v":0}'])
    time.sleep(0.3)
    owners = {}
    for i in range(batch):
        rid = f"r{i}"
        owners[rid] = f"client-{i % n_clients}".encode()
        server.inflight[rid] = InFlight(rid, owners[rid], prefill_w, decode_w, prefilled=True)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    by_client: dict[bytes, list[TokenPart]] = {}
    for rid, owner in owners.items():
        by_client.setdefault(owner, []).append(TokenPart(rid, [7], ["w"], **(
            {"start": 0} if pack_step is not None else {})))
    if way == "step":
        msg = frames_of(pack_step([Tokens.pack(p) for p in by_client.values()]), ctx)
        handle = lambda: server.relayer.step(decode_w, msg)    # noqa: E731
    else:
        raw = encode(Tokens.pack([p for ps in by_client.values() for p in ps]))
        msg = frames_of(raw, ctx)
        handle = lambda: server.relay(decode([f.bytes for f in msg]).unpack(), decode_w)  # noqa: E731
    for _ in range(50):
        handle()
    cpu, thread = time.process_time(), time.thread_time()
    for _ in range(steps):
        handle()
    cpu, thread = time.process_time() - cpu, time.thread_time() - thread
    tokens = steps * batch
    time.sleep(0.2)
    stop.set()
    reader.join()
    server.close()
    for c in clients:
        c.close()
    ctx.term()
    return {"way": way, "batch": batch, "clients": n_clients,
            "us_per_token": cpu / tokens * 1e6, "us_per_token_main": thread / tokens * 1e6,
            "us_per_step": cpu / steps * 1e6, "messages_to_clients": got[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--batches", default="4,32,128", help="requests per decode step")
    p.add_argument("--rounds", type=int, default=3, help="runs of each, interleaved")
    p.add_argument("--tree", default=_TREE, help="the checkout whose router is measured")
    args = p.parse_args()
    print("batch  clients  way     us/token (process / main thread)  us/step  (best of rounds)")
    for batch in map(int, args.batches.split(",")):
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for way in ("tokens", "step") if pack_step is not None else ("tokens",):
                row = run(batch, args.clients, args.steps, way)
                if way not in best or row["us_per_token"] < best[way]["us_per_token"]:
                    best[way] = row
        for way, row in best.items():
            print(f"{batch:5d}  {args.clients:7d}  {way:6s}  {row['us_per_token']:8.2f} / "
                  f"{row['us_per_token_main']:6.2f}                     {row['us_per_step']:8.1f}")


if __name__ == "__main__":
    main()
