"""A node's long calls (a denoising, a prefill) on one thread of their own, so the node can spin
rclpy's single-threaded executor.

Why not rclpy's ``MultiThreadedExecutor``: while one of its pool threads runs a callback, the
executor's own thread keeps finding that callback's entity (or the next message of a busy
callback group) ready, and loops through its Python wait-set construction without sleeping. With
py-spy (``--gil``) on the policy node of ``bench/control_tick.py``, that loop held the
interpreter lock in 94 % of the samples with no call running, 0.43 of a core, and every control
tick had to win the lock from it: tick period p99 30 ms idle, 19 gaps over 1.5 periods in 30 s on
an otherwise quiet machine. With a single-threaded executor the node sleeps in the wait set
between messages; the one call that may take long runs here instead, off the executor, so joint
states and instructions are still taken while it runs.

Calls run one at a time in the order they were submitted (as in the mutually exclusive callback
group they replace). A periodic call (a heartbeat, a status) is submitted with ``coalesce``: one
already waiting stands for it, so a long call never lets them pile up and crowd the queue.
``drop_pending`` forgets those not started (a node that deactivates must not run a call it took
while active, after it is activated again).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class CallThread:
    """A daemon thread running submitted calls in order; at most ``max_pending`` wait."""

    def __init__(self, name: str, max_pending: int = 4) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.name = name
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], bool] | None] = queue.Queue(max_pending)
        self.dropped = 0     # calls refused because max_pending were already waiting
        self._waiting: set[Callable[[], Any]] = set()   # coalesced calls queued, not started
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int:
        """The kernel's id of the thread (its CPU priority is set by it: ``priority.control_priority``)."""
        tid = self._thread.native_id
        assert tid is not None   # set before Thread.start() in __init__ returned
        return tid

    def submit(self, call: Callable[..., Any], *args: Any, coalesce: bool = False) -> bool:
        """Queue ``call(*args)``; False (and counted in ``dropped``) when the queue is full or the
        thread has stopped. With ``coalesce`` (a call without arguments), True without queuing when
        the same call is already waiting. Never blocks: it is called from the executor's only thread."""
        if coalesce and args:
            raise ValueError(f"only a call without arguments can be coalesced, got {len(args)} argument(s)")
        item = (call, args, coalesce)
        with self._lock:
            if self._stopped:
                self.dropped += 1
                return False
            if coalesce and call in self._waiting:
                return True
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                return False
            if coalesce:
                self._waiting.add(call)
        return True

    def drop_pending(self) -> int:
        """Forget the calls not started yet; returns how many."""
        with self._lock:
            return self._drain()

    def _drain(self) -> int:
        n = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return n
            if item is not None:
                self._forget(item)
                n += 1

    def _forget(self, item: tuple[Callable[..., Any], tuple[Any, ...], bool]) -> None:
        if item[2]:
            self._waiting.discard(item[0])

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Drop the pending calls, let the running one finish, end the thread; False if it is
        still running after ``timeout_s`` (a daemon: it does not keep the process alive)."""
        with self._lock:
            self._stopped = True
            self._drain()
            self._queue.put_nowait(None)   # room: the queue was just emptied, and nothing is submitted after a stop
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._lock:
                self._forget(item)
            call, args, _ = item
            try:
                call(*args)
            except Exception:   # noqa: BLE001 - one failed call must not end the node's calls
                log.exception("%s: a call failed", self.name)
