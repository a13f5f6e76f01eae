"""The transport interface: what every backend offers, what it reports, and the
page-run arithmetic shared by all of them.

A backend moves bytes from this process's registered memory into a peer's
registered memory. Writes never block the caller: `write` queues the transfer
and exactly one `Completion` per transfer id comes back later through
`poll_completions`, which the scheduler calls when `fileno()` turns readable.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterator, Sequence

# (src_addr, dst_addr, nbytes): one contiguous copy.
Run = tuple[int, int, int]

# More than ~2048 entries to one peer at once overflow Mooncake's per-peer TCP
# queue (1024 queued + 1024 waiting for admission) and the peer session then
# fails every write for seconds (FACTS.md). 1024 leaves the admission queue free.
MAX_BATCH_ENTRIES = 1024


class TransportError(Exception):
    """A transport operation failed (registration, bad arguments, bad fault plan)."""


class BackendUnavailableError(TransportError, ImportError):
    """The requested backend's library is not installed or does not load."""


@dataclass(frozen=True)
class Completion:
    """The one final outcome of a transfer.

    `nbytes` is the number of bytes the transfer covered (the sum of its runs),
    reported on failure too; `seconds` runs from `write()` to the outcome.
    `reason` is "" on success, otherwise a short human-readable cause
    ("cancelled", "closed", "timeout", ...).
    """

    transfer_id: int
    ok: bool
    reason: str
    nbytes: int
    seconds: float


class Backend(abc.ABC):
    """A transport endpoint: registered memory plus non-blocking writes to peers.

    Thread-safety: `write`, `cancel` and `poll_completions` may be called from
    any thread, though the intended user is one scheduler thread.
    """

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """What a peer passes as `peer` to `write` into this backend's memory."""

    @abc.abstractmethod
    def register(self, addr: int, length: int) -> None:
        """Make [addr, addr+length) a valid source and destination of transfers."""

    @abc.abstractmethod
    def unregister(self, addr: int) -> None:
        """Forget the region that starts at `addr`."""

    @abc.abstractmethod
    def write(self, transfer_id: int, peer: str, runs: Sequence[Run]) -> None:
        """Queue a transfer of `runs` into `peer`'s memory; never blocks on I/O."""

    def connect(self, peer: str) -> None:
        """Open the session to `peer` ahead of its first write, off the caller's
        thread; never blocks. A backend without sessions ignores it."""

    @abc.abstractmethod
    def cancel(self, transfer_id: int) -> None:
        """Best effort: parts not yet handed to the fabric are skipped."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A file descriptor that is readable whenever completions are pending."""

    @abc.abstractmethod
    def poll_completions(self) -> list[Completion]:
        """Return (and forget) every completion available now."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop; every transfer still pending completes with ok=False."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_runs(runs: Sequence[Run]) -> list[Run]:
    """Validate runs and drop empty ones; raise TransportError on nonsense."""
    checked = []
    for run in runs:
        if len(run) != 3:
            raise TransportError(f"a run is (src_addr, dst_addr, nbytes), got {run!r}")
        src, dst, nbytes = (int(x) for x in run)
        if src < 0 or dst < 0 or nbytes < 0:
            raise TransportError(f"negative address or length in run {run!r}")
        if nbytes:
            checked.append((src, dst, nbytes))
    return checked


def split_batches(runs: Sequence[Run], max_entries: int = MAX_BATCH_ENTRIES) -> list[list[Run]]:
    """Cut runs into consecutive batches of at most `max_entries` entries."""
    if max_entries < 1:
        raise TransportError(f"max_entries must be >= 1, got {max_entries}")
    return [list(runs[i:i + max_entries]) for i in range(0, len(runs), max_entries)]


def coalesce_runs(src_base: int, src_pages: Sequence[int], dst_base: int,
                  dst_pages: Sequence[int], page_bytes: int) -> list[Run]:
    """Turn page pairs (src_pages[i] -> dst_pages[i]) into as few runs as possible.

    Consecutive pairs whose source pages and destination pages both advance by
    one are merged into one run; everything else starts a new run. The order of
    the pairs is kept, so the runs cover exactly the per-page copies.
    """
    if len(src_pages) != len(dst_pages):
        raise TransportError(
            f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    if page_bytes <= 0:
        raise TransportError(f"page_bytes must be positive, got {page_bytes}")
    return [(src_base + s * page_bytes, dst_base + d * page_bytes, n * page_bytes)
            for s, d, n in _page_runs(src_pages, dst_pages)]


def _page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Yield (first src page, first dst page, page count) of each merged run."""
    start_s = start_d = count = 0
    for s, d in zip(map(int, src_pages), map(int, dst_pages)):
        if count and s == start_s + count and d == start_d + count:
            count += 1
            continue
        if count:
            yield start_s, start_d, count
        start_s, start_d, count = s, d, 1
    if count:
        yield start_s, start_d, count
