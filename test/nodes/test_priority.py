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
