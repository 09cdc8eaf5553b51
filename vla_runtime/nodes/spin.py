"""The entry point every node shares: init, spin, clean shutdown (also on Ctrl-C).

Ctrl-C (or SIGTERM) asks the spin loop to end (``StopRequest``), but the node's call thread
(``call_thread.py``) may still be in a call: encoding into a ring, or denoising from one. ``CallbackGate``
lets ``destroy_node`` stop new callbacks, wake the waiting ones and wait for the ones in flight
before it unmaps the rings they write to (closing a ring under a running call would fault, and
a wait sat out in full kept the process alive past any launcher's patience).
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class CallbackGate:
    """Counts the callbacks in flight; once closing, new ones are skipped. A managed node opens
    it again when it is configured (or activated) again (``open``)."""

    def __init__(self, closed: bool = False) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closing = closed

    @property
    def closing(self) -> bool:
        return self._closing

    @contextmanager
    def call(self) -> Iterator[bool]:
        """``with gate.call() as entered``: False when the node is closing (return at once)."""
        with self._cond:
            entered = not self._closing
            self._active += int(entered)
        try:
            yield entered
        finally:
            if entered:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    def open(self) -> None:
        """Let callbacks in again."""
        with self._cond:
            self._closing = False

    def close(self, timeout_s: float, wake: Callable[[], None] = lambda: None) -> bool:
        """Refuse new callbacks, call ``wake`` (to cut short the waits of those in flight) and
        wait for them to finish. False if one is still running after ``timeout_s``."""
        with self._cond:
            self._closing = True
        wake()
        with self._cond:
            return self._cond.wait_for(lambda: self._active == 0, timeout_s)


def gated(callback: F) -> F:
    """A node method run inside its node's ``gate`` (skipped once the node is closing)."""
    @functools.wraps(callback)
    def run_gated(self, *args: Any, **kwargs: Any) -> Any:
        with self.gate.call() as entered:
            return callback(self, *args, **kwargs) if entered else None
    return run_gated  # type: ignore[return-value]


def spin_until_shutdown(spin: Callable[[], None], context_ok: Callable[[], bool],
                        shutdown_errors: tuple[type[BaseException], ...]) -> None:
    """Run ``spin`` until Ctrl-C or a shutdown of the ROS context; return normally on either.

    One SIGINT does two things in rclpy: its handler shuts the context down (the next wait then
    raises an ``RCLError`` or ``ExternalShutdownException``) and it raises ``KeyboardInterrupt``
    in the main thread, in either order. So a shutdown error is a normal end when the context is
    down (re-raised while it is up: a real fault), and the interrupt may still arrive while that
    error is being handled.
    """
    try:
        try:
            spin()
        except shutdown_errors:
            if context_ok():
                raise
    except KeyboardInterrupt:
        pass


SPIN_WAKE_S = 0.2   # the longest a stop request waits to be noticed by an idle node


class StopRequest:
    """The SIGINT / SIGTERM handler of a node: it only records the request (an exception raised
    at an arbitrary point inside rclpy's executor could be swallowed there, or leave its state
    half-changed); the spin loop sees it at its next wake-up and ends."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def __call__(self, _signum: int = 0, _frame: Any = None) -> None:
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


def spin_interruptibly(executor: Any, keep_going: Callable[[], bool]) -> None:
    """``executor.spin()`` while ``keep_going()``, back in Python at least every ``SPIN_WAKE_S``:
    a node with nothing to do (a simulated clock that stopped, no messages) would otherwise wait
    in C for ever and never see a stop request."""
    while keep_going():
        executor.spin_once(timeout_sec=SPIN_WAKE_S)


def ignore_sigint() -> None:
    """Ignore further Ctrl-C, so that the clean-up (closing the rings, destroying the node) runs to
    its end: a terminal's Ctrl-C reaches the node twice (directly and relayed by ``ros2 launch``),
    and an interrupt already pending is raised here rather than in the middle of the clean-up."""
    while True:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return
        except KeyboardInterrupt:
            continue


START_FAILED = 3   # the exit status of a node that could not start (the launch files stop on it)


def start_failure(name: str, exc: BaseException) -> str:
    """The one line a node that cannot start prints (no traceback: the reason is the message; a
    ValueError or OSError carries it in its text, anything else is named by its type too)."""
    text = " ".join(str(exc).split())
    if not isinstance(exc, (ValueError, OSError)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{name}: cannot start: {text}"


def run(make_node: Callable[[], object], name: str, args: list[str] | None = None) -> None:
    """Start ``make_node`` and spin it until shutdown. A node that cannot start (bad profile,
    checkpoint, device, parameter) prints one line saying why on stderr and the process exits
    with ``START_FAILED``, so that a launcher, or a shell, sees the failure and its reason.

    A node with a ``start()`` method (a managed node, ``managed.ManagedNode``) has it called
    before spinning: its own configure and activate with ``autostart``, where a failure is a
    start failure too. One whose ``finished`` becomes true (the lifecycle ``shutdown``
    transition) ends the spin, and the process exits 0."""
    import rclpy
    from rclpy._rclpy_pybind11 import RCLError
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    # rclpy's own SIGINT handler shuts the context down at once, under the callbacks still running
    # in the executor's threads (their publish then fails: "publisher's context is invalid"). Here
    # Ctrl-C (and SIGTERM) only asks the spin loop to end; the context goes down last, after the node.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop = StopRequest()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        node = make_node()
        start = getattr(node, "start", None)
        if callable(start):
            try:
                start()
            except BaseException:
                node.destroy_node()   # what a half-done configure made (rings) goes with it
                raise
    except (Exception, KeyboardInterrupt) as e:   # noqa: BLE001 - every reason is reported the same way
        print(start_failure(name, e), file=sys.stderr, flush=True)
        rclpy.try_shutdown()
        raise SystemExit(START_FAILED) from None
    executor = SingleThreadedExecutor()   # a node's long calls run on its CallThread (call_thread.py: why)
    executor.add_node(node)
    try:
        spin_until_shutdown(lambda: spin_interruptibly(executor, lambda: rclpy.ok() and not stop.requested
                                                       and not getattr(node, "finished", False)),
                            rclpy.ok, (RCLError, ExternalShutdownException))
    finally:
        ignore_sigint()
        node.destroy_node()        # waits for the callbacks in flight (CallbackGate), then the rings
        executor.shutdown(timeout_sec=0)
        rclpy.try_shutdown()
