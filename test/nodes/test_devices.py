"""``engine.device: auto``: CUDA where the process sees a GPU, the CPU otherwise with a warning that
says what latency to expect; an explicit CUDA device without a GPU is refused naming the way out."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from vla_runtime.models.config import preset
from vla_runtime.nodes.devices import cpu_latency_note, device_problem, resolve_device
from vla_runtime.nodes.profile import EngineSpec
from vla_runtime.nodes.stages import load_policy
from vla_runtime.models.flops import dense_flops

CAMS = ["top", "wrist"]


@pytest.mark.parametrize("setting, cuda, count, want", [
    ("auto", True, 1, "cuda"), ("auto", False, 0, "cpu"), ("cpu", True, 2, "cpu"), ("cuda:1", True, 2, "cuda:1"),
])
def test_auto_takes_cuda_when_present_else_the_cpu(setting, cuda, count, want):
    assert resolve_device(setting, cuda, count) == want


@pytest.mark.parametrize("setting, cuda, count, why", [
    ("cuda", False, 0, "no CUDA device is available to this process; use device:=auto"),
    ("cuda:2", True, 2, "sees 2 CUDA device"),
    ("gpu", True, 1, "must be auto, cpu, cuda or cuda:N, got 'gpu'"),
])
def test_a_device_this_process_cannot_use_is_refused_by_name(setting, cuda, count, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        resolve_device(setting, cuda, count)


def test_device_settings():
    assert [device_problem(v) for v in ("auto", "cpu", "cuda", "cuda:3")] == [""] * 4
    assert all(device_problem(v) for v in ("", "cuda:", "cuda:x", "CPU", None, 1))


def test_the_cpu_note_says_the_work_the_rate_and_the_latency_it_implies():
    cfg = preset("pi05-small")
    gflop = dense_flops(cfg, cfg.max_prefix_len, 2) / 1e9
    note = cpu_latency_note(cfg, 2, gflops=10.0, control_hz=50.0)
    assert f"A call is {gflop:.3g} GFLOP" in note and "about 10 GFLOP/s" in note
    assert f"expect at least {gflop / 10:.3g} s per call" in note
    assert f"a chunk of {cfg.chunk_size} actions lasts {cfg.chunk_size / 50:.2f} s at 50 Hz" in note


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback is what a machine without a GPU does")
def test_auto_loads_on_the_cpu_here_and_warns_of_the_latency(demo, caplog):
    with caplog.at_level(logging.WARNING, logger="vla_runtime.nodes.stages"):
        policy = load_policy(demo["checkpoint"], EngineSpec(device="auto", share_weights=False), CAMS, 7,
                             control_hz=20.0)
    assert str(policy.engine.device) == "cpu"
    assert re.search(r"no CUDA device: running on the CPU \(device:=auto\)\. A call is [\d.e+-]+ GFLOP and this CPU "
                     r"multiplies at about \d+ GFLOP/s, so expect at least [\d.e+-]+ s per call", caplog.text)
    with pytest.raises(ValueError, match="no CUDA device is available"):
        load_policy(demo["checkpoint"], EngineSpec(device="cuda", share_weights=False), CAMS, 7)
