"""bench_e2e.py's component timings, in this process: one prefill forward and one decode
step on 1 and 2 torch threads, one KV write between two Mooncake backends of the
project's transport, and a ZeroMQ DEALER/ROUTER round trip between two processes
(back to back, and after idling)."""
from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import zmq

from common import median_time, random_prompts  # first: it puts the repository on sys.path

import transport  # noqa: E402
from engines.kv.layout import KVLayout  # noqa: E402
from engines.kv.pool import KVPool  # noqa: E402
from engines.loader import LoadedModel  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402
from engines.compute import Compute  # noqa: E402
from engines.request import Request  # noqa: E402

PAGE_SIZE = 16


def compute_times(model: LoadedModel, prompt_len: int, short_len: int, batch: int, ctx: int,
                  threads: int, repeats: int, kv_mb: float) -> dict[str, float]:
    """Seconds: prefill of one prompt (the call a prefill worker makes, with sampling),
    and one decode step of `batch` requests at context `ctx` (KV contents irrelevant)."""
    torch.set_num_threads(threads)
    layout = KVLayout.for_model(model.cfg, PAGE_SIZE, model.dtype)
    pool = KVPool.with_budget(layout, kv_mb, model.dtype, model.device)
    compute = Compute(model, pool)
    greedy = SamplingParams(temperature=0, max_new_tokens=4096, ignore_eos=True)
    rng = random.Random(7)

    def prefill(n: int):
        prompts = iter(random_prompts(4 * repeats + 2, n, model.cfg.vocab_size, rng.randrange(1 << 30)))

        def run() -> None:
            r = Request("p", next(prompts), greedy)
            r.pages = pool.allocator.alloc(pool.pages_for(n))
            compute.prefill([r])
            pool.allocator.free_pages(r.pages)
        return run
    reqs = []
    for i in range(batch):
        r = Request(f"s{i}", [1] * (ctx - 1), greedy)
        r.output = [1]
        r.pages = pool.allocator.alloc(pool.pages_for(ctx + repeats + 2))
        reqs.append(r)
    with torch.inference_mode():
        got = {"prefill": median_time(prefill(prompt_len), repeats),
               "prefill_short": median_time(prefill(short_len), repeats * 3),
               "decode_step": median_time(lambda: compute.decode(reqs), repeats)}
    return got


def transfer_time(model: LoadedModel, tokens: int, repeats: int) -> float:
    """Seconds for one KV write of a `tokens`-token prompt (contiguous pages both sides,
    as the allocators hand them out) between two Mooncake backends, completion seen
    through the fd, as a prefill worker sees it."""
    page_bytes = KVLayout.for_model(model.cfg, PAGE_SIZE, model.dtype).page_bytes
    pages = -(-tokens // PAGE_SIZE)
    src = np.ones(pages * page_bytes, dtype=np.uint8)
    dst = np.zeros(2 * pages * page_bytes, dtype=np.uint8)
    a = transport.create_backend("mooncake", host="127.0.0.1")
    b = transport.create_backend("mooncake", host="127.0.0.1")
    try:
        a.register(src.ctypes.data, src.nbytes)
        b.register(dst.ctypes.data, dst.nbytes)
        runs = transport.coalesce_runs(src.ctypes.data, list(range(pages)), dst.ctypes.data,
                                       list(range(1, pages + 1)), page_bytes)
        poller = zmq.Poller()
        poller.register(a.fileno(), zmq.POLLIN)
        ids = iter(range(1, 1 << 30))

        def write() -> None:
            a.write(next(ids), b.session_id, runs)
            while True:
                poller.poll(10_000)
                done = a.poll_completions()
                if done:
                    assert done[0].ok, done
                    return
        return median_time(write, repeats)
    finally:
        a.close()
        b.close()


ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER)
print(s.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    m = s.recv_multipart()
    if m[1] == b"stop":
        break
    s.send_multipart(m)
"""


def zmq_round_trip(samples: int, idle_s: float = 0.0) -> float:
    """Median seconds of a 200-byte DEALER -> ROUTER -> DEALER round trip between two
    processes on loopback, back to back (idle_s=0) or each after idle_s of silence,
    when both processes have gone to sleep (as between isolated requests)."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE)
    ctx = zmq.Context()
    try:
        port = int(echo.stdout.readline())
        d = ctx.socket(zmq.DEALER)
        d.connect(f"tcp://127.0.0.1:{port}")
        payload, times = b"x" * 200, []
        for i in range(samples + 100):
            if idle_s and i >= 100:
                time.sleep(idle_s)
            t = time.perf_counter()
            d.send(payload)
            d.recv()
            if i >= 100:
                times.append(time.perf_counter() - t)
        d.send(b"stop")
        echo.wait(5)
        return statistics.median(times)
    finally:
        if echo.poll() is None:
            echo.kill()
            echo.wait()
        ctx.destroy(linger=0)
