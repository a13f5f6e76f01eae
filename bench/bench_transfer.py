"""The project's transport vs one raw contiguous Mooncake write, side by side.

    python bench/bench_transfer.py [--repeats 7] [--tokens 256,1024,4096]

Two Mooncake engines in this process, TCP over 127.0.0.1. The prefill side's
KV pool is page-major (one page of all layers is one contiguous chunk of
page_bytes) and its pages are contiguous; the decode side's pages are either a
mostly contiguous allocation (two runs) or fully scattered (no two pages
adjacent: the worst case for coalescing). "transport" is `write` of the
coalesced runs, timed until its completion comes back through the fd and
`poll_completions`; "raw" is one `transfer_sync_write` of the same total bytes
from a separate engine into the same destination memory. Medians of at least
--repeats runs after a warm-up (more for short transfers); GB/s = 1e9 bytes/s;
ratio = transport / raw. Other work on the machine skews small transfers most.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transport  # noqa: E402
from transport.mooncake import import_transfer_engine  # noqa: E402

PAGE_SIZE = 16  # tokens per page
LAYOUTS = {
    # layers * (K, V) * page_size * kv_heads * head_dim * bytes
    "tiny": 2 * 2 * PAGE_SIZE * 2 * 16 * 4,          # float32: 8 KiB per page
    "realistic": 32 * 2 * PAGE_SIZE * 8 * 128 * 2,   # bf16: 2 MiB per page
}


def dst_pages(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Decode-side page ids inside a pool of 2n pages."""
    if kind == "2 runs":
        half = n // 2
        return np.concatenate([np.arange(n + 1, n + 1 + half), np.arange(1, 1 + n - half)])
    return 2 * rng.permutation(n)  # even ids only: never two adjacent pages


class Rig:
    """Source and destination pools registered on two transport backends and a raw engine."""

    def __init__(self, page_bytes: int, pages: int) -> None:
        self.page_bytes = page_bytes
        self.src = np.random.default_rng(0).integers(0, 256, pages * page_bytes, dtype=np.uint8)
        self.dst = np.zeros(2 * pages * page_bytes, dtype=np.uint8)
        self.a = transport.create_backend("mooncake", host="127.0.0.1")
        self.b = transport.create_backend("mooncake", host="127.0.0.1")
        self.a.register(self.src.ctypes.data, self.src.nbytes)
        self.b.register(self.dst.ctypes.data, self.dst.nbytes)
        self.raw = import_transfer_engine()()
        assert self.raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert self.raw.register_memory(self.src.ctypes.data, self.src.nbytes) == 0
        self.poller = zmq.Poller()
        self.poller.register(self.a.fileno(), zmq.POLLIN)
        self.next_id = 0

    def transport_write(self, runs: list[transport.Run]) -> float:
        self.next_id += 1
        started = time.perf_counter()
        self.a.write(self.next_id, self.b.session_id, runs)
        while True:
            self.poller.poll(10_000)
            done = self.a.poll_completions()
            if done:
                assert done[0].ok, done
                return time.perf_counter() - started

    def raw_write(self, nbytes: int) -> float:
        started = time.perf_counter()
        rc = self.raw.transfer_sync_write(self.b.session_id, self.src.ctypes.data,
                                          self.dst.ctypes.data, nbytes)
        assert rc == 0
        return time.perf_counter() - started

    def close(self) -> None:
        self.a.close()
        self.b.close()


def median_time(fn, repeats: int, min_total_s: float = 0.5) -> float:
    """Median of at least `repeats` runs, more (up to 20x) for short ones."""
    fn()  # warm-up: connections, page faults
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_total_s and len(times) < 20 * repeats):
        times.append(fn())
    return statistics.median(times)


def bench(layout: str, tokens: list[int], repeats: int, rng: np.random.Generator) -> list[tuple]:
    page_bytes = LAYOUTS[layout]
    rig = Rig(page_bytes, max(tokens) // PAGE_SIZE)
    rows = []
    for n_tokens in tokens:
        pages = n_tokens // PAGE_SIZE
        nbytes = pages * page_bytes
        for kind in ("2 runs", "scattered"):
            dst = dst_pages(kind, pages, rng)
            runs = transport.coalesce_runs(rig.src.ctypes.data, np.arange(pages),
                                           rig.dst.ctypes.data, dst, page_bytes)
            rig.dst[:] = 0
            t_transport = median_time(lambda: rig.transport_write(runs), repeats)
            got = rig.dst.reshape(-1, page_bytes)[dst]
            assert (got == rig.src.reshape(-1, page_bytes)[:pages]).all(), "bytes differ"
            t_raw = median_time(lambda: rig.raw_write(nbytes), repeats)
            rows.append((layout, n_tokens, pages, page_bytes, kind, len(runs), nbytes,
                         nbytes / t_transport / 1e9, nbytes / t_raw / 1e9, t_raw / t_transport))
    rig.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", default="256,1024,4096")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(1)
    rows = [row for layout in LAYOUTS for row in bench(layout, tokens, args.repeats, rng)]
    header = ("layout", "tokens", "pages", "page B", "dst alloc", "runs", "MiB",
              "transport GB/s", "raw GB/s", "ratio")
    print(f"{header[0]:>9} {header[1]:>6} {header[2]:>5} {header[3]:>8} {header[4]:>10} "
          f"{header[5]:>5} {header[6]:>7} {header[7]:>14} {header[8]:>9} {header[9]:>6}")
    for layout, n, pages, pb, kind, runs, nbytes, gbs_t, gbs_r, ratio in rows:
        print(f"{layout:>9} {n:>6} {pages:>5} {pb:>8} {kind:>10} {runs:>5} {nbytes / 2**20:>7.2f} "
              f"{gbs_t:>14.3f} {gbs_r:>9.3f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
