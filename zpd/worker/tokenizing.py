"""Long prompts tokenized on a helper thread, so the scheduler loop keeps going.

A megabyte of text takes the tokenizer about a second (a chat template's rendering
more). On the scheduler thread that second stalls every other request's decode
steps, the loop's deadlines and admin commands such as `status` (issue 30, item
3). A prompt of at least `LONG_PROMPT_BYTES` is tokenized here instead, one at a
time; the scheduler gets the result on its loop, as if the generate arrived then.
While one is pending the scheduler may `cancel` it (an abort, its router gone);
its result is then dropped. Shorter prompts take milliseconds and stay inline.

`tokenizers` releases the GIL while it encodes (engines/formats/tokenizer.py), so this
thread and the scheduler run at once.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable

from zpd.limits import chat_bytes
from zpd.wire.loop import Loop

log = logging.getLogger("zpd.worker.tokenizing")

LONG_PROMPT_BYTES = 1 << 15      # ~20 ms of tokenizing: less is done inline


def is_long(text: str, chat: dict | None) -> bool:
    """Worth a trip to the helper thread (characters: a lower bound on UTF-8 bytes)."""
    return len(text) >= LONG_PROMPT_BYTES or bool(chat) and chat_bytes(chat) >= LONG_PROMPT_BYTES


class Tokenizing:
    """The helper thread and the prompts it has not finished; used on the loop thread
    only, except for what the helper's completion hands to `Loop.call_soon_threadsafe`."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.pending: dict[Hashable, Any] = {}   # key -> what the scheduler keeps with it
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def submit(self, key: Hashable, tag: Any, work: Callable[[], list[int]],
               done: Callable[[list[int] | Exception], None]) -> None:
        """Run `work` on the helper; then, on the loop, `done(ids or the exception)`
        unless `key` was cancelled meanwhile."""
        self.pending[key] = tag
        future = self._pool.submit(work)
        future.add_done_callback(lambda f: self._hand_back(key, f, done))

    def cancel(self, key: Hashable) -> Any:
        """Forget a pending prompt; its tag, or None if it was not pending (tags are
        never None)."""
        return self.pending.pop(key, None)

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _hand_back(self, key: Hashable, future: Future, done: Callable) -> None:
        """On the helper thread: queue the result for the loop (not once closed: the
        loop's wake-up pipe may be gone)."""
        if self._closed.is_set() or future.cancelled():
            return
        error = future.exception()
        self.loop.call_soon_threadsafe(self._finish, key, future.result() if error is None
                                       else error, done)

    def _finish(self, key: Hashable, got: list[int] | Exception, done: Callable) -> None:
        if key in self.pending:
            del self.pending[key]
            done(got)
