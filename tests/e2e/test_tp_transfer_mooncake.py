"""The KV transfer between prefill and decode of different TP sizes over real Mooncake
on 127.0.0.1: the staging buffers registered on first use are valid sources, and every
decode rank's pages hold exactly its heads (tests/unit/test_tp_transfer.py's checks)."""
from __future__ import annotations

import pytest

import transport

pytest.importorskip("mooncake.engine", reason="Mooncake is not installed "
                    "(pip install mooncake-transfer-engine-non-cuda)")

from tests.e2e.test_transport_mooncake import wait_one  # noqa: E402
from tests.unit.test_tp_transfer import Pair  # noqa: E402


@pytest.mark.parametrize("kv,p,d", [(4, 1, 2), (4, 2, 1), (4, 2, 4), (2, 1, 4), (4, 2, 2)])
def test_mismatched_tp_pages_land_over_mooncake(kv, p, d):
    backends = tuple(transport.create_backend("mooncake", host="127.0.0.1", transfer_timeout_s=4.0)
                     for _ in range(2))
    try:
        pair = Pair(kv, p, d, seed=p * 10 + d, backends=backends, wait=wait_one)
        for _ in range(2):                      # the second reuses the staging
            ours, theirs = pair.pages(6)
            whole = pair.fill(ours)
            for dst in pair.dests:
                dst.buffer.zero_()
            pair.send(ours, theirs)
            pair.check_landed(whole, theirs)
        assert len(pair.registered) == len(set(pair.planner.staging))
    finally:
        for b in backends:
            b.close()
