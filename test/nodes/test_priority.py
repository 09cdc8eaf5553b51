"""CPU priorities of the node processes (Linux nice values are per thread)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vla_runtime.nodes import priority
from vla_runtime.nodes.priority import control_priority

ROOT = Path(__file__).resolve().parents[2]


# In a process of its own: the nice value of every thread changes, the pytest process keeps its own.
SCRIPT = """
import json, os, sys, threading
from vla_runtime.nodes.priority import control_priority
started, done = threading.Event(), threading.Event()
def before():
    started.set()
    done.wait()
t = threading.Thread(target=before)
t.start()
started.wait()
base = os.getpriority(os.PRIO_PROCESS, 0)
target = min(base + 2, 19)   # raising the nice value is always permitted
out = {"base": base, "target": target, "kept": control_priority(None)}
out["returned"] = control_priority(target)
out["caller"] = os.getpriority(os.PRIO_PROCESS, 0)
out["earlier_thread"] = os.getpriority(os.PRIO_PROCESS, t.native_id)
later = {}
t2 = threading.Thread(target=lambda: later.setdefault("nice", os.getpriority(os.PRIO_PROCESS, 0)))
t2.start(); t2.join(); done.set(); t.join()
out["later_thread"] = later["nice"]
print(json.dumps(out))
"""


def test_control_priority_sets_every_thread_and_none_leaves_it() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["kept"] == out["base"]
    assert out["returned"] == out["caller"] == out["target"]
    assert out["earlier_thread"] == out["target"]   # a thread started before the call
    assert out["later_thread"] == out["target"]     # one started after it inherits


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
