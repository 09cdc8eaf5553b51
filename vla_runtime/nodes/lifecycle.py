"""What the managed (lifecycle) nodes decide, without ROS: what a deactivated policy holds,
which peer has gone silent, keeping the garbage collector out of the control loop after a
configure, and giving memory back after a cleanup.

The rclpy side (``managed.py`` and the three node classes) only calls these; tests drive them
directly.
"""

from __future__ import annotations

import gc

import numpy as np

from ..engine.controller import StreamingController


def hold_target(controller: StreamingController, measured: np.ndarray | None) -> np.ndarray | None:
    """Where a policy that stops commanding holds the robot: the last command it sent (where
    the robot is right now, or is about to be: holding anything else would move it), else, when
    it never commanded, the measured joint state clamped into the limits; None when neither is
    known (nothing was ever sent, so there is nothing to stop)."""
    last = controller.safety.last_command
    if last is not None:
        return last
    if measured is None:
        return None
    return controller.within_limits(np.asarray(measured, dtype=np.float64))


class PeerWatch:
    """When each peer node was last heard (its periodic diagnostics), on the watching node's
    clock: a peer not heard for ``timeout_s`` is reported silent, naming it. The watch's start
    counts as heard, so a peer still loading is given ``timeout_s`` before it is reported, and
    then only as a warning until it has been heard once (a node starting, or kept unconfigured, is
    not a node that died)."""

    def __init__(self, peers: tuple[str, ...], now_s: float, timeout_s: float):
        if not peers:
            raise ValueError("PeerWatch needs at least one peer to watch")
        self.timeout_s = timeout_s
        self.last_heard: dict[str, float] = {p: now_s for p in peers}
        self.ever_heard: dict[str, bool] = {p: False for p in peers}

    def heard(self, peer: str, now_s: float) -> None:
        if peer in self.last_heard:
            self.last_heard[peer] = max(self.last_heard[peer], now_s)
            self.ever_heard[peer] = True

    def silent(self, now_s: float) -> dict[str, float]:
        """Peers silent for longer than ``timeout_s``: seconds since last heard (or since the watch began)."""
        return {p: now_s - t for p, t in self.last_heard.items() if now_s - t > self.timeout_s}

    def report(self, now_s: float) -> tuple[str, str]:
        """(error, warning): a peer heard before and silent now is an error (it died, or was
        cleaned up); one never heard since this node started is a warning (still starting, or
        left unconfigured by a lifecycle manager). '' when every peer is heard."""
        errors, warnings = [], []
        for peer, age in self.silent(now_s).items():
            if self.ever_heard[peer]:
                errors.append(f"{peer} node silent for {age:.1f} s (stopped reporting): not running or not configured?")
            else:
                warnings.append(f"{peer} node not heard since this node started {age:.1f} s ago")
        return "; ".join(errors), "; ".join(warnings)

    def values(self, now_s: float) -> dict[str, str]:
        """Diagnostic key/values: seconds since each peer was last heard (the watch's start counts),
        and whether it has been heard at all since this node started."""
        out = {}
        for p, t in self.last_heard.items():
            out[f"{p}_last_heard_s"] = f"{now_s - t:.1f}"
            out[f"{p}_heard"] = str(self.ever_heard[p])
        return out


def settle_heap() -> int:
    """After a configure: collect once, then freeze what is left (the model, rclpy, the stage).

    A node process holds about 300k Python objects once its model is loaded. CPython's full
    (oldest-generation) collection walks all of them, holding the interpreter lock: measured
    at 100-300 ms here (2-core CPU). The executor's per-message garbage sets one off now and
    then, and the control tick, which needs the interpreter to run, waits it out: ticks missed
    while no call ran (``bench/control_tick.py``). Frozen objects are left out of every
    collection (they are freed by their reference counts as usual), so a full collection then
    walks only what was allocated since. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_memory() -> None:
    """After a cleanup dropped the model: collect it now and hand cached GPU blocks back, so the
    memory is free while the node waits to be configured again (not only at the next collection).
    What ``settle_heap`` froze is thawed first: a frozen cycle would never be collected."""
    gc.unfreeze()
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
