"""``vla-runtime bench-ipc``: ring-buffer hand-offs between processes for one pi0.5 prefix slot (JSON).

Two phases on the same slot layout (per-layer K and V of every VLM layer plus the small fields,
``stress.prefix_layout``):

- ``stress``: free-running writer, few slots, several readers: the most contention the protocol
  can meet. Counts hand-offs, torn copies thrown away (``torn_retries``) and torn copies accepted
  (``torn_accepted``, checked by content; must be 0).
- ``latency``: paced writer (one slot per ``--period-ms``), one reader: commit-to-copy-complete
  latency of a hand-off without queueing, median and p99.

Absolute times are only meaningful on the machine they were taken on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class IpcBenchSpec:
    preset: str = "pi05-small"
    prefix_len: int | None = None  # default: the preset's max prefix (cameras x patches + prompt tokens)
    handoffs: int = 100_000  # stress phase, total over the readers
    readers: int = 2
    slots: int = 3
    latency_handoffs: int = 5_000
    latency_slots: int = 4
    period_ms: float = 2.0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.handoffs < self.readers or self.readers < 1:
            raise ValueError(f"need readers >= 1 and handoffs >= readers, got {self.readers} and {self.handoffs}")
        if self.slots < 1 or self.latency_slots < 1 or self.latency_handoffs < 1:
            raise ValueError("slots, latency_slots and latency_handoffs must be >= 1")
        if self.period_ms <= 0:
            raise ValueError(f"period_ms must be > 0, got {self.period_ms}")
        if self.prefix_len is not None and self.prefix_len < 1:
            raise ValueError(f"prefix_len must be >= 1, got {self.prefix_len}")


def run_ipc_bench(spec: IpcBenchSpec, log=lambda msg: None) -> dict:
    import torch

    from .stress import StressSpec, prefix_layout, run_stress

    layout = prefix_layout(spec.preset, spec.prefix_len)
    text = layout.to_json()
    log(f"bench-ipc: {spec.preset} prefix slot {layout.nbytes / 2**20:.2f} MiB, stress {spec.handoffs} hand-offs "
        f"({spec.readers} readers, {spec.slots} slots)")
    per_reader = -(-spec.handoffs // spec.readers)
    stress = run_stress(StressSpec(text, slots=spec.slots, readers=spec.readers, handoffs_per_reader=per_reader,
                                   threads=spec.threads), timeout_s=3600)
    log(f"bench-ipc: stress done in {stress['wall_s']:.1f}s; latency {spec.latency_handoffs} paced hand-offs")
    latency = run_stress(StressSpec(text, slots=spec.latency_slots, readers=1,
                                    handoffs_per_reader=spec.latency_handoffs, writer_period_s=spec.period_ms / 1e3,
                                    threads=spec.threads), timeout_s=3600)
    kv = layout.fields[0]
    return {
        "bench": "ipc-ring", "spec": asdict(spec),
        "layout": {"preset": spec.preset, "tag": layout.tag, "slot_bytes": layout.nbytes, "fields": len(layout.fields),
                   "kv_shape": list(kv.shape), "kv_dtype": str(kv.dtype).removeprefix("torch."),
                   "describe": layout.describe()},
        "stress": stress, "latency": latency,
        "torn_accepted": stress["torn_accepted"] + latency["torn_accepted"],
        "ok": stress["torn_accepted"] == 0 and latency["torn_accepted"] == 0 and stress["meta_mismatch"] == 0,
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "processor": platform.processor()},
    }


def bench_ipc_main(args: argparse.Namespace) -> int:
    """CLI handler: run, print the JSON (and write it to ``--out``); exit 1 if a torn read got through."""
    spec = IpcBenchSpec(preset=args.preset, prefix_len=args.prefix_len, handoffs=args.handoffs, readers=args.readers,
                        slots=args.slots, latency_handoffs=args.latency_handoffs, period_ms=args.period_ms,
                        threads=args.threads)
    result = run_ipc_bench(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0 if result["ok"] else 1
