"""CallbackGate: what destroy_node relies on to close the rings only after the call in flight."""

from __future__ import annotations

import threading

from vla_runtime.nodes.spin import CallbackGate, gated


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
    gate = CallbackGate()
    try:
        with gate.call() as entered:
            assert entered
            raise ValueError("bad message")
    except ValueError:
        pass
    assert gate.close(0.1)
