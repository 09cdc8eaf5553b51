"""CPU priorities of the node processes, set in a thread of the test's own (Linux nice values
are per thread: the pytest process keeps its own)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from vla_runtime.nodes import priority
from vla_runtime.nodes.priority import control_priority


def in_thread(fn):
    out: dict = {}

    def body() -> None:
        out["value"] = fn()
        out["now"] = os.getpriority(os.PRIO_PROCESS, 0)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def test_control_priority_sets_the_nice_value_and_none_leaves_it() -> None:
    current = os.getpriority(os.PRIO_PROCESS, 0)
    target = min(current + 2, 19)    # raising the nice value is always permitted
    out = in_thread(lambda: control_priority(target))
    assert out["value"] == target and out["now"] == target
    out = in_thread(lambda: control_priority(None))
    assert out["value"] == current and out["now"] == current


def test_a_refused_priority_is_logged_not_fatal(monkeypatch, caplog) -> None:
    def refuse(*_args) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(priority.os, "setpriority", refuse)
    current = os.getpriority(os.PRIO_PROCESS, 0)
    with caplog.at_level(logging.WARNING):
        assert control_priority(-20 if current != -20 else -19) == current
    assert "could not set the policy node's CPU priority" in caplog.text


@pytest.mark.parametrize("bad", [-21, 20, 1.0, True, "5"])
def test_control_priority_refuses_values_outside_nice(bad) -> None:
    with pytest.raises(ValueError, match="nice"):
        control_priority(bad)


def test_control_priority_also_sets_threads_started_before_it() -> None:
    """The policy node's call thread starts before the profile says the nice value; it is set by
    its native id (Linux: a nice value per thread), as is the calling thread, while a thread
    not named keeps its own."""
    from vla_runtime.nodes.call_thread import CallThread

    current = os.getpriority(os.PRIO_PROCESS, 0)
    target = min(current + 3, 19)
    calls, bystander = CallThread("calls"), CallThread("bystander")
    try:
        seen: list[int] = []
        ran = threading.Event()
        calls.submit(lambda: (seen.append(threading.get_native_id()), ran.set()))
        assert ran.wait(120.0) and seen == [calls.native_id]
        out = in_thread(lambda: control_priority(target, threads=[calls.native_id]))
        assert out["value"] == target and out["now"] == target
        assert os.getpriority(os.PRIO_PROCESS, calls.native_id) == target
        assert os.getpriority(os.PRIO_PROCESS, bystander.native_id) == current
        assert os.getpriority(os.PRIO_PROCESS, 0) == current   # the test's own thread untouched
    finally:
        calls.stop(), bystander.stop()
