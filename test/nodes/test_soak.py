"""A short soak of the three-process pipeline (CI size; bench/soak_pipeline.py runs the long one):
no NaN, memory that does not run away, no shared memory left after shutdown, and after every
stage was SIGKILLed a restart under the same names cleans up what the crash left."""

from __future__ import annotations

import os
from pathlib import Path

from vla_runtime.commands.pipeline_soak import run_pipeline_soak, segments, summary


def test_short_soak_of_the_three_process_pipeline(demo, tmp_path):
    prefix = f"t{os.getpid()}_soak"
    report = run_pipeline_soak(tmp_path, calls=200, warmup=20, samples=4, prefix=prefix,
                               demo=(Path(demo["checkpoint"]), Path(demo["repo"]), [demo["episode"]]),
                               log=lambda m: None)
    print(summary(report))
    assert report["calls"] == 200 and report["nan_calls"] == 0 and report["cached_calls"] > 0
    assert report["leaked_after_shutdown"] == []
    mem = report["memory"]
    assert mem["shm_growth_bytes"] == 0 and mem["start"]["segments"] == 2   # prefix ring + working set
    # a gross-leak bound only (200 calls): the long run's trend is what shows flatness
    assert all(growth < 64 for growth in mem["rss_growth_mb"].values()), mem["rss_growth_mb"]
    crash = report["crash"]
    assert crash["segments_after_kill"] == sorted(f"{prefix}_{n}" for n in ("prefix", "refs"))
    assert crash["ok"] and crash["leaked_after_restart_shutdown"] == [] and report["ok"]
    assert segments(prefix) == {}
