"""Multi-process hand-off harness for the ring buffer (shared by the tests and ``bench-ipc``).

One writer process and N reader processes (``spawn`` context, so nothing is inherited but what is
passed). Every payload element carries the payload's own sequence number (``fill_(seq)``), and its
metadata repeats it, so a torn copy that the seqlock failed to reject is visible *by content*: a
field whose min or max differs from the sequence the reader was told it got. The figure that
matters is ``torn_accepted`` (must be 0); ``torn_retries`` shows how often the protocol had to
throw a racing copy away.

Latency is "commit on the writer -> copy complete on the reader": the writer's commit stamps the
slot with ``time.monotonic_ns()`` (system-wide on Linux), the reader takes the difference right
after its copy is validated, before checking content.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .layout import FieldSpec, SlotLayout
from .ring import RingBuffer

_ATTACH_TIMEOUT_S = 120.0  # spawn children import torch first; generous on a loaded 2-core CI box


def small_layout(numel: int = 4096) -> SlotLayout:
    """A cheap slot (16 KiB float32 + int64 + uint8 fields) for protocol stress."""
    return SlotLayout((FieldSpec("f32", (numel,), torch.float32), FieldSpec("i64", (16,), torch.int64),
                       FieldSpec("u8", (100,), torch.uint8)))


def prefix_layout(preset: str = "pi05-small", prefix_len: int | None = None) -> SlotLayout:
    """One prefix slot as the vision node publishes it: per VLM layer K and V [1, prefix, head_dim]
    per KV head, plus the small fields (state at observation time, prefix pad mask, reference id)."""
    from ..models.config import preset as get_preset

    cfg = get_preset(preset)
    p = cfg.max_prefix_len if prefix_len is None else int(prefix_len)
    kv = (cfg.vlm.num_kv_heads, p, cfg.vlm.head_dim)
    fields = [FieldSpec(f"{kind}{layer}", kv, torch.float32) for layer in range(cfg.vlm.depth) for kind in "kv"]
    fields += [FieldSpec("state", (cfg.max_state_dim,), torch.float32), FieldSpec("pad_mask", (p,), torch.uint8),
               FieldSpec("reference", (1,), torch.int64)]
    return SlotLayout(tuple(fields))


def stamp_payload(tensors: dict[str, torch.Tensor], seq: int) -> None:
    for t in tensors.values():
        t.fill_(seq & 0xFF if t.dtype == torch.uint8 else seq)


def payload_matches(tensors: dict[str, torch.Tensor], seq: int) -> bool:
    for t in tensors.values():
        want = seq & 0xFF if t.dtype == torch.uint8 else seq
        lo, hi = torch.aminmax(t)
        if lo.item() != want or hi.item() != want:
            return False
    return True


@dataclass(frozen=True)
class StressSpec:
    """One run: ``readers`` processes each accept ``handoffs_per_reader`` distinct payloads."""

    layout_json: str
    slots: int = 2
    readers: int = 2
    handoffs_per_reader: int = 10_000
    writer_period_s: float = 0.0  # 0: the writer free-runs (maximal contention)
    verify: bool = True
    threads: int = 1
    backend: str = "cpu"  # "cuda": payload in GPU memory shared by CUDA IPC, readers copy into GPU tensors
    device: int = 0       # CUDA device of the "cuda" backend

    def __post_init__(self) -> None:
        if self.backend not in ("cpu", "cuda"):
            raise ValueError(f"backend must be 'cpu' or 'cuda', got {self.backend!r}")
        if self.slots < 1 or self.readers < 1 or self.handoffs_per_reader < 1:
            raise ValueError("slots, readers and handoffs_per_reader must be >= 1")
        if self.writer_period_s < 0:
            raise ValueError(f"writer_period_s must be >= 0, got {self.writer_period_s}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


def _writer_main(name: str, spec: StressSpec, stop: Any, ready: Any, results: Any) -> None:
    torch.set_num_threads(spec.threads)
    layout = SlotLayout.from_json(spec.layout_json)
    with RingBuffer.create(name, layout, spec.slots, backend=spec.backend, device=spec.device) as ring:
        ready.set()
        n, next_t = 0, time.monotonic()
        while not stop.is_set():
            if spec.writer_period_s:
                next_t += spec.writer_period_s
                delay = next_t - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            w = ring.begin_write()
            stamp_payload(w.tensors, w.seq)
            w.commit({"seq": w.seq})
            n += 1
        results.put({"role": "writer", "commits": n})


def _reader_main(name: str, spec: StressSpec, index: int, stop: Any, results: Any) -> None:
    torch.set_num_threads(spec.threads)
    layout = SlotLayout.from_json(spec.layout_json)
    device = torch.device("cuda", spec.device) if spec.backend == "cuda" else torch.device("cpu")
    out = {f.name: torch.empty(f.shape, dtype=f.dtype, device=device) for f in layout.fields}
    lat = np.empty(spec.handoffs_per_reader, dtype=np.int64)
    accepted = torn_accepted = meta_bad = 0
    last = -1
    with RingBuffer.attach(name, layout, timeout_s=_ATTACH_TIMEOUT_S) as ring:
        while accepted < spec.handoffs_per_reader and not stop.is_set():
            info = ring.read_latest(out, min_seq=last + 1)
            if info is None:
                if ring.writer_pid == 0:
                    break
                os.sched_yield()
                continue
            lat[accepted] = time.monotonic_ns() - info.stamp_ns
            if info.seq <= last:
                raise AssertionError(f"read_latest went backwards: {info.seq} after {last}")
            if spec.verify and not payload_matches(out, info.seq):
                torn_accepted += 1
            if not isinstance(info.meta, dict) or info.meta.get("seq") != info.seq:
                meta_bad += 1
            last = info.seq
            accepted += 1
        st = ring.stats
        results.put({"role": "reader", "index": index, "accepted": accepted, "torn_accepted": torn_accepted,
                     "meta_mismatch": meta_bad, "torn_retries": st.torn_retries, "torn_giveups": st.torn_giveups,
                     "checksum_failures": st.checksum_failures, "skipped": last + 1 - accepted,
                     "latency_ns": lat[:accepted]})


def run_stress(spec: StressSpec, timeout_s: float = 600.0, name: str | None = None) -> dict:
    """Run one writer and ``spec.readers`` readers as spawned processes; returns the merged figures.

    ``timeout_s`` only bounds a hang (a child that died); it is not a performance assertion.
    """
    ctx = mp.get_context("spawn")
    name = name or f"vla_stress_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    stop, ready, results = ctx.Event(), ctx.Event(), ctx.Queue()
    writer = ctx.Process(target=_writer_main, args=(name, spec, stop, ready, results), daemon=True)
    writer.start()
    readers = [ctx.Process(target=_reader_main, args=(name, spec, i, stop, results), daemon=True)
               for i in range(spec.readers)]
    for r in readers:
        r.start()
    got: list[dict] = []
    deadline = time.monotonic() + timeout_s
    t0 = None
    try:
        if not ready.wait(timeout_s):
            raise RuntimeError(f"stress writer did not create ring {name!r} within {timeout_s}s")
        t0 = time.monotonic()
        while len(got) < spec.readers:
            try:
                got.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue_mod.Empty:
                raise RuntimeError(f"stress run timed out after {timeout_s}s with {len(got)} of {spec.readers} "
                                   f"readers done; exit codes: {[r.exitcode for r in readers]}") from None
            if time.monotonic() > deadline:
                raise RuntimeError("stress run timed out")
        wall = time.monotonic() - t0
        stop.set()
        writer_res = results.get(timeout=60)
    finally:
        stop.set()
        ready.set()
        for p in [*readers, writer]:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    lat = np.concatenate([g["latency_ns"] for g in got]) if got else np.empty(0, dtype=np.int64)
    per_reader = [{k: v for k, v in g.items() if k not in ("role", "latency_ns")} for g in sorted(got, key=lambda g: g["index"])]
    total = lambda key: int(sum(g[key] for g in got))  # noqa: E731
    return {
        "backend": spec.backend, "slots": spec.slots, "readers": spec.readers,
        "slot_bytes": SlotLayout.from_json(spec.layout_json).nbytes,
        "writer_period_s": spec.writer_period_s, "writer_commits": writer_res["commits"],
        "handoffs": total("accepted"), "torn_accepted": total("torn_accepted"),
        "meta_mismatch": total("meta_mismatch"), "torn_retries": total("torn_retries"),
        "torn_giveups": total("torn_giveups"), "checksum_failures": total("checksum_failures"),
        "wall_s": wall, "handoffs_per_s": total("accepted") / wall if wall > 0 else None,
        "latency_us": _percentiles(lat), "per_reader": per_reader,
    }


def _percentiles(lat_ns: np.ndarray) -> dict:
    if lat_ns.size == 0:
        return {}
    us = lat_ns.astype(np.float64) / 1e3
    return {"n": int(us.size), "median": float(np.median(us)), "p90": float(np.percentile(us, 90)),
            "p99": float(np.percentile(us, 99)), "max": float(us.max()), "min": float(us.min())}
