"""CallbackGate: what destroy_node relies on to close the rings only after the call in flight; and\nthe end of the spin on Ctrl-C, which rclpy reports in two ways, in either order."""

from __future__ import annotations

import signal
import threading

import pytest

from vla_runtime.nodes.spin import CallbackGate, gated, ignore_sigint, spin_until_shutdown


class _Node:
    def __init__(self) -> None:
        self.gate = CallbackGate()
        self.calls = 0
        self.inside = threading.Event()
        self.release = threading.Event()

    @gated
    def on_message(self, block: bool = False) -> str:
        self.calls += 1
        if block:
            self.inside.set()
            self.release.wait(10.0)
        return "done"


def test_close_waits_for_the_callback_in_flight_after_waking_it():
    node = _Node()
    worker = threading.Thread(target=node.on_message, kwargs={"block": True})
    worker.start()
    assert node.inside.wait(10.0)
    order: list[str] = []

    def wake() -> None:
        order.append("wake")
        node.release.set()

    assert node.gate.close(10.0, wake=wake)     # returned only once the callback left the gate
    order.append("closed")
    worker.join(10.0)
    assert order == ["wake", "closed"] and not worker.is_alive()


def test_callbacks_after_close_are_skipped():
    node = _Node()
    assert node.on_message() == "done" and node.calls == 1
    assert node.gate.close(1.0)
    assert node.gate.closing
    assert node.on_message() is None and node.calls == 1


def test_close_reports_a_callback_that_does_not_finish():
    node = _Node()
    worker = threading.Thread(target=node.on_message, kwargs={"block": True})
    worker.start()
    assert node.inside.wait(10.0)
    assert node.gate.close(0.05) is False         # not woken: still running
    node.release.set()
    worker.join(10.0)
    assert node.gate.close(1.0) is True           # now idle


def test_a_callback_that_raises_leaves_the_gate():
    """The callback's error reaches the caller (the gate does not swallow it) and the gate no
    longer counts the callback as running."""
    gate = CallbackGate()
    with pytest.raises(ValueError, match="bad message"):
        with gate.call() as entered:
            assert entered
            raise ValueError("bad message")
    assert gate.close(0.1)


class _ShutdownError(Exception):
    """Stands for rclpy's RCLError raised by a wait on a context the signal already shut down."""


def _raise(exc: BaseException):
    def spin() -> None:
        raise exc
    return spin


def test_ctrl_c_ends_the_spin_normally():
    spin_until_shutdown(_raise(KeyboardInterrupt()), lambda: True, (_ShutdownError,))


def test_a_shutdown_error_after_the_context_went_down_ends_the_spin_normally():
    spin_until_shutdown(_raise(_ShutdownError("context is not valid")), lambda: False, (_ShutdownError,))


def test_the_interrupt_arriving_while_the_shutdown_error_is_handled_ends_the_spin_normally():
    def context_ok() -> bool:   # the KeyboardInterrupt of the same SIGINT, raised a moment later
        raise KeyboardInterrupt
    spin_until_shutdown(_raise(_ShutdownError("context is not valid")), context_ok, (_ShutdownError,))


def test_a_shutdown_error_with_the_context_up_is_a_real_fault():
    with pytest.raises(_ShutdownError):
        spin_until_shutdown(_raise(_ShutdownError("wait set")), lambda: True, (_ShutdownError,))
    with pytest.raises(ValueError):
        spin_until_shutdown(_raise(ValueError("bug in a callback")), lambda: False, (_ShutdownError,))


def test_ignore_sigint_survives_a_pending_interrupt(monkeypatch):
    calls = []
    real = signal.signal

    def flaky_signal(num, handler):   # the pending Ctrl-C is raised inside the first attempt
        calls.append(handler)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(num, handler)

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(signal, "signal", flaky_signal)
    try:
        ignore_sigint()
        # retried after the interrupt; SIGTERM (a launcher's second request) is ignored as well
        assert calls == [signal.SIG_IGN] * 3 and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for s, handler in old.items():
            real(s, handler)


def test_the_spin_comes_back_to_python_while_idle():
    """An idle node must still notice Ctrl-C: each wait is bounded, so the interpreter runs (and
    raises the pending KeyboardInterrupt) at least every SPIN_WAKE_S."""
    from vla_runtime.nodes.spin import SPIN_WAKE_S, spin_interruptibly

    class Executor:
        def __init__(self):
            self.timeouts = []

        def spin_once(self, timeout_sec=None):
            self.timeouts.append(timeout_sec)
            if len(self.timeouts) == 3:
                raise KeyboardInterrupt   # what a pending Ctrl-C does once back in Python

    ex = Executor()
    with pytest.raises(KeyboardInterrupt):
        spin_interruptibly(ex, lambda: True)
    assert ex.timeouts == [SPIN_WAKE_S] * 3 and 0 < SPIN_WAKE_S <= 0.5
    assert spin_interruptibly(Executor(), lambda: False) is None      # context down: returns


def test_a_stop_request_ends_the_spin_at_its_next_wake_up():
    """SIGINT / SIGTERM only set the request (no exception inside rclpy's executor); the loop
    ends after the spin_once in progress."""
    from vla_runtime.nodes.spin import StopRequest, spin_interruptibly

    stop = StopRequest()
    calls = []

    class Executor:
        def spin_once(self, timeout_sec=None):
            calls.append(timeout_sec)
            if len(calls) == 2:
                stop(signal.SIGINT, None)     # what the handler does on Ctrl-C

    spin_interruptibly(Executor(), lambda: not stop.requested)
    assert stop.requested and len(calls) == 2


def test_a_gate_made_closed_skips_callbacks_until_opened_and_can_close_again():
    """A managed node's gate: closed until configure (or activate) opens it, closed again on
    deactivate or cleanup, open again on the next activation."""
    node = _Node()
    node.gate = CallbackGate(closed=True)
    assert node.on_message() is None and node.calls == 0
    node.gate.open()
    assert node.on_message() == "done" and node.calls == 1
    assert node.gate.close(1.0) and node.on_message() is None and node.calls == 1
    node.gate.open()
    assert node.on_message() == "done" and node.calls == 2
