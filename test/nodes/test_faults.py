"""Faults with real processes, without ROS: the three-process pipeline with stages killed, stalled
and restarted. Every chunk is compared with what the call must return, computed in this process
(a shadow of the cache manager that lives and dies like the pipeline's: dense while none runs, a
new episode when one starts again), so a stage that kept reading a dead writer's shared memory
(its sequences restart at 0 and collide with the old ones) would be caught, not just a crash."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.cache.manager import CacheManager
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.engine.cached import CacheConfig, CachedEngine
from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.nodes.pipeline import PipelineSpec, ProcessPipeline, StageDied
from vla_runtime.nodes.profile import CacheSpec, EngineSpec
from vla_runtime.nodes.stages import PolicyStage, PrefixRequestNote, RingNames, VisionStage, load_policy, manager_config

CAMS = ("top", "wrist")
SEED = 3


class Shadow:
    """The chunk each pipeline call must return, computed in this process."""

    def __init__(self, demo: dict, cache: CacheSpec):
        self.cache = cache
        self.policy = Pi05Policy.from_checkpoint(demo["checkpoint"], camera_names=list(CAMS))
        self.repo = ReferenceRepository.open(demo["repo"])
        self.engine = CachedEngine(self.policy.engine.model, CacheConfig(
            rho_p=0.4, rho_n=self.repo.meta.rho_n, groups=tuple(tuple(g) for g in self.repo.meta.mask_groups)))
        self.cache_up = True
        self.cache_restarted()

    def cache_restarted(self) -> None:
        # the cache manager stage's own configuration (fallback rules included)
        self.manager = CacheManager(self.policy.engine.model, self.repo, manager_config(self.cache, self.repo))

    def expect(self, frame, task: str, request_seq: int) -> tuple[np.ndarray, object]:
        obs = Observation(frame.images, frame.state, task)
        noise = self.policy.engine.make_noise(1, torch.Generator().manual_seed(SEED * 1_000_003 + request_seq))
        if not self.cache_up:
            return self.policy.predict(obs, noise=noise).actions, None
        if self.manager.task != task:
            self.manager.start_episode(task)
        self.manager.observe_state(torch.as_tensor(frame.state))
        res = self.engine.infer(self.policy.prepare(obs), noise=noise, select=self.manager.select)
        self.manager.prepare(10.0)
        return (self.policy.action_norm.unnormalize(res.actions[0]).numpy(),
                None if res.reference is None else res.reference.key)


def _rings(tag: str) -> RingNames:
    return RingNames(f"t{os.getpid()}_{tag}_p", f"t{os.getpid()}_{tag}_q", f"t{os.getpid()}_{tag}_w")


@pytest.fixture(scope="module")
def rig(demo):
    # The calls cycle through one short episode again and again, so they keep matching the
    # references' last calls: no past-the-references limit, or the episode would latch dense and
    # the tests could not see the cache resume after a fault (that rule has its own tests).
    spec = PipelineSpec(Path(demo["checkpoint"]), CAMS, CacheSpec(enabled=True, repository=str(demo["repo"]),
                                                                  reference_timeout_s=60.0, max_end_matches=0),
                        EngineSpec(threads=1, share_weights=False),   # 3 processes on 2 cores: no oversubscription
                        rings=_rings("fault"), seed=SEED, time_available_s=10.0)
    with ProcessPipeline(spec) as pipeline:
        yield pipeline, Shadow(demo, spec.cache), demo["episode"]


def _frame(episode, i: int):
    return episode.frames[i % len(episode.frames)]


def _call_and_check(rig, i: int) -> bool:
    """Frame i through the pipeline; the chunk must be exactly the shadow's. Returns used_reference."""
    pipeline, shadow, episode = rig
    frame = _frame(episode, i)
    res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
    want, key = shadow.expect(frame, episode.task, res.request_seq)
    assert res.request_seq == pipeline.numbering.seq - 1              # this call's chunk, never an earlier one's
    np.testing.assert_allclose(res.chunk, want, rtol=0, atol=1e-5)
    choice = pipeline.last_choice
    assert ((choice.episode, choice.index) if res.used_reference else None) == key   # the same reference
    return res.used_reference


def test_cache_manager_killed_mid_episode_turns_calls_dense_at_once_and_recovers_on_restart(rig):
    pipeline, shadow, _ = rig
    assert any([_call_and_check(rig, i) for i in range(2)])
    pipeline.kill("cache")                                   # SIGKILL: its working set stays behind
    shadow.cache_up = False
    for i in range(2, 4):
        assert not _call_and_check(rig, i)
        assert "cache manager not running" in pipeline.last_choice.reason   # no wait for an answer
    pipeline.restart("cache")                                # replaces the dead writer's working set
    shadow.cache_up = True
    shadow.cache_restarted()
    # vision and policy re-attach to the new working set (the old mapping holds entries whose
    # slot/sequence the new cache manager reuses): exact equality shows they read the new one
    assert sum(_call_and_check(rig, i) for i in range(4, 8)) >= 2


def test_vision_killed_policy_and_cache_survive_and_it_resumes_on_restart(rig):
    pipeline, _, episode = rig
    _call_and_check(rig, 8)
    os.kill(pipeline.processes["vision"].pid, signal.SIGKILL)     # a crash, unannounced
    frame = _frame(episode, 9)
    with pytest.raises(StageDied, match="vision"):
        pipeline.call(frame.images, np.asarray(frame.state), episode.task)
    assert pipeline.processes["policy"].is_alive() and pipeline.processes["cache"].is_alive()
    pipeline.restart("vision")   # new prefix and query rings: policy and cache manager re-attach
    assert any([_call_and_check(rig, i) for i in range(9, 12)])


def test_stalled_policy_times_out_and_its_late_chunk_is_never_handed_out(rig):
    pipeline, shadow, episode = rig
    pid = pipeline.processes["policy"].pid
    os.kill(pid, signal.SIGSTOP)                                   # the engine stalls
    frame = _frame(episode, 12)
    try:
        with pytest.raises(TimeoutError, match="a stage is stalled"):
            pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=3.0)
    finally:
        os.kill(pid, signal.SIGCONT)                               # its chunk for that call now comes late
    shadow.expect(frame, episode.task, pipeline.numbering.seq - 1)         # the cache manager did see that call
    _call_and_check(rig, 13)                                      # the next call gets its own chunk


def test_policy_killed_mid_call_resumes_without_stale_chunks(rig):
    pipeline, shadow, episode = rig
    pid = pipeline.processes["policy"].pid
    os.kill(pid, signal.SIGSTOP)
    frame = _frame(episode, 14)
    with pytest.raises(TimeoutError):
        pipeline.call(frame.images, np.asarray(frame.state), episode.task, timeout_s=3.0)
    shadow.expect(frame, episode.task, pipeline.numbering.seq - 1)
    os.kill(pid, signal.SIGKILL)                                   # dies with a slot note pending
    pipeline.restart("policy")
    assert pipeline.processes["vision"].is_alive() and pipeline.processes["cache"].is_alive()
    for i in range(15, 17):
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
