"""Faults with real processes, without ROS: the three-process pipeline with stages killed, stalled
and restarted. Every chunk is compared with what the call must return given the reference it
reports, computed in this process from the repository (``ReferenceOracle``), so a stage that kept
reading a dead writer's shared memory where a new one lives (sequences restart at 0 and collide
with the old ones) would be caught, not just a crash."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.engine.policy import Observation
from vla_runtime.nodes.pipeline import PipelineSpec, ProcessPipeline, StageDied
from vla_runtime.nodes.profile import CacheSpec, EngineSpec
from vla_runtime.nodes.stages import PolicyStage, PrefixRequestNote, RingNames, VisionStage, load_policy

CAMS = ("top", "wrist")
SEED = 3


def _rings(tag: str) -> RingNames:
    return RingNames(f"t{os.getpid()}_{tag}_p", f"t{os.getpid()}_{tag}_w")


@pytest.fixture(scope="module")
def rig(demo, oracle_for):
    # The calls cycle through one short episode again and again, so they keep matching the
    # references' last calls: no past-the-references limit, or the episode would latch dense and
    # the tests could not see the cache resume after a fault (that rule has its own tests).
    spec = PipelineSpec(Path(demo["checkpoint"]), CAMS, CacheSpec(enabled=True, repository=str(demo["repo"]),
                                                                  max_end_matches=0),
                        EngineSpec(threads=1, share_weights=False),   # 3 processes on 2 cores: no oversubscription
                        rings=_rings("fault"), seed=SEED, time_available_s=10.0)
    with ProcessPipeline(spec) as pipeline:
        pipeline.start_episode(demo["episode"].task)
        yield pipeline, oracle_for(demo, SEED), demo["episode"]


def _frame(episode, i: int):
    return episode.frames[i % len(episode.frames)]


def _call_and_check(rig, i: int) -> bool:
    """Frame i through the pipeline; the chunk must be exactly the oracle's for the reference the
    call reports. Returns used_reference."""
    pipeline, oracle, episode = rig
    frame = _frame(episode, i)
    res = pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=120.0)
    assert res.request_seq == pipeline.numbering.seq - 1              # this call's chunk, never an earlier one's
    oracle.check(res, pipeline.last_choice, frame, episode.task)
    return res.used_reference


def test_cache_manager_killed_mid_episode_never_holds_up_a_call_and_recovers_on_restart(rig):
    pipeline, _, _ = rig
    assert any([_call_and_check(rig, i) for i in range(2)])
    pipeline.kill("cache")                                   # SIGKILL: its working set stays behind
    for i in range(2, 4):                                    # served from the window it left, or dense: never a wait
        _call_and_check(rig, i)
    pipeline.restart("cache")                                # replaces the dead writer's working set
    # vision and policy re-attach to the new working set (the old mapping holds entries whose
    # slot/sequence the new cache manager reuses): exact equality shows they read the new one.
    # The new cache manager starts empty; the first selection note starts the episode in it.
    used = [_call_and_check(rig, i) for i in range(4, 10)]
    assert sum(used) >= 2 and pipeline.last_choice is not None


def test_vision_killed_policy_and_cache_survive_and_it_resumes_on_restart(rig):
    pipeline, _, episode = rig
    _call_and_check(rig, 10)
    os.kill(pipeline.processes["vision"].pid, signal.SIGKILL)     # a crash, unannounced
    frame = _frame(episode, 11)
    with pytest.raises(StageDied, match="vision"):
        pipeline.call(frame.images, np.asarray(frame.state), episode.task)
    assert pipeline.processes["policy"].is_alive() and pipeline.processes["cache"].is_alive()
    pipeline.restart("vision")   # a new prefix ring: the policy re-attaches; the window is still there
    assert any([_call_and_check(rig, i) for i in range(11, 15)])


def test_stalled_policy_times_out_and_its_late_chunk_is_never_handed_out(rig):
    pipeline, _, episode = rig
    pid = pipeline.processes["policy"].pid
    os.kill(pid, signal.SIGSTOP)                                   # the engine stalls
    frame = _frame(episode, 15)
    try:
        with pytest.raises(TimeoutError, match="a stage is stalled"):
            pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=3.0)
    finally:
        os.kill(pid, signal.SIGCONT)                               # its chunk for that call now comes late
    _call_and_check(rig, 16)                                      # the next call gets its own chunk


def test_the_window_follows_a_call_only_once_the_call_is_over(rig, monkeypatch):
    """The cache manager slides its window (a dense prefill per entering entry) while the robot
    executes a chunk, not while the policy denoises it: the call's selection leaves for the cache
    stage when the call ends, here 2 s after its slot, which a stopped policy stage never answers."""
    pipeline, _, episode = rig
    sent: list[tuple[str, float]] = []
    send = pipeline._send

    def spy(name: str, msg) -> bool:
        if msg[0] != "ahead":   # the call's reference named to the policy before the prefill: not a hand-over
            sent.append((name, time.monotonic()))
        return send(name, msg)
    monkeypatch.setattr(pipeline, "_send", spy)
    pid = pipeline.processes["policy"].pid
    os.kill(pid, signal.SIGSTOP)
    frame = _frame(episode, 20)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=2.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [name for name, _ in sent] == ["vision", "policy", "cache"]
    assert sent[1][1] - t0 < 1.0 and sent[2][1] - t0 >= 2.0     # slot at once, selection after the call
    monkeypatch.undo()
    _call_and_check(rig, 21)                                      # the late chunk is dropped, the next call served


def test_policy_killed_mid_call_resumes_without_stale_chunks(rig):
    pipeline, _, episode = rig
    pid = pipeline.processes["policy"].pid
    os.kill(pid, signal.SIGSTOP)
    frame = _frame(episode, 17)
    with pytest.raises(TimeoutError):
        pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=3.0)
    os.kill(pid, signal.SIGKILL)                                   # dies with a slot note pending
    pipeline.restart("policy")
    assert pipeline.processes["vision"].is_alive() and pipeline.processes["cache"].is_alive()
    for i in range(18, 20):
        _call_and_check(rig, i)


def test_restarted_vision_stage_is_re_attached_not_read_stale(demo):
    """In one process: a policy stage attached to a vision stage's ring that is replaced by a new
    one under the same name. The new ring's first slot has the same (slot, sequence) as the old
    one's; the policy must denoise the new prefix, not the old mapping's."""
    policy = load_policy(demo["checkpoint"], EngineSpec(share_weights=False), CAMS, 7)
    ep = demo["episode"]
    rings = _rings("reattach")
    ps = PolicyStage(policy, rings, seed=SEED)
    try:
        first = VisionStage(policy, rings)
        note = first.encode(PrefixRequestNote(0, 0, tuple(ep.frames[1].state), ep.task), ep.frames[1].images)
        ps.act(note)
        first.close()                                              # the vision node stops ...
        second = VisionStage(policy, rings)                        # ... and starts again
        try:
            note2 = second.encode(PrefixRequestNote(0, 0, tuple(ep.frames[0].state), ep.task), ep.frames[0].images)
            assert (note2.slot, note2.seq) == (note.slot, note.seq)
            got = ps.act(note2).chunk
        finally:
            second.close()
    finally:
        ps.close()
    want = policy.predict(Observation(ep.frames[0].images, ep.frames[0].state, ep.task),
                          generator=torch.Generator().manual_seed(SEED * 1_000_003)).actions
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
