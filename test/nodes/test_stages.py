"""The stages' cache configuration: the profile's auto/on/off for each half against the timing the
repository records, as the pipeline then runs it (a half profiled slower than dense is skipped
under ``auto`` and runs under ``on``)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from vla_runtime.cache.halves import HalfTiming, PhaseTiming
from vla_runtime.cache.repository import ReferenceRepository
from vla_runtime.cache.retrieval import Match
from vla_runtime.cache.selector import Selection
from vla_runtime.nodes.pipeline import LocalPipeline, PipelineSpec
from vla_runtime.nodes.profile import CacheSpec
from vla_runtime.nodes.stages import RingNames, cache_config

CAMS = ("top", "wrist")


def _timed_repository(demo: dict, root: Path, context_speedup: float, action_speedup: float,
                      rho_p: float = 0.4, dense_s: tuple[float, float] = (0.010, 0.020)) -> Path:
    """A copy of the demo repository recording that each half ran at the given speed-up, the
    Context Cache at ``rho_p`` (what build-cache --profile records: the fraction it suggests), from
    the dense prefill and denoise times ``dense_s``."""
    out = root / f"repo_{context_speedup}_{action_speedup}_{rho_p}_{dense_s[0]}_{dense_s[1]}"
    shutil.copytree(demo["repo"], out)
    prefill, denoise = dense_s
    ReferenceRepository.open(out).record_half_timing(HalfTiming(
        PhaseTiming(prefill, prefill / context_speedup, 4), PhaseTiming(denoise, denoise / action_speedup, 4),
        device="cpu", threads=1, dtype="float32", rho_p=rho_p, rho_n=0.5, calls=2, repeats=2))
    return out


def _calls(demo: dict, repo: Path, tag: str, **halves: str) -> list:
    cache = CacheSpec(enabled=True, repository=str(repo), **halves)
    rings = RingNames(f"t{os.getpid()}_{tag}_p", f"t{os.getpid()}_{tag}_w")
    with LocalPipeline(PipelineSpec(Path(demo["checkpoint"]), CAMS, cache, rings=rings, seed=3,
                                    time_available_s=10.0)) as pipeline:
        pipeline.start_episode(demo["episode"].task)   # the window up before the first call, as on a robot
        return [pipeline.call(f.images, np.asarray(f.state), demo["episode"].task) for f in demo["episode"].frames]


def _served(results: list) -> tuple[set[bool], set[bool]]:
    """Over the calls a reference served: did the prefill reuse it, did the denoising use its masks."""
    with_ref = [r for r in results if r.cached]
    assert with_ref, "no call was served by a reference"
    return {bool(r.meta.context_cache) for r in with_ref}, {r.used_reference for r in with_ref}


@pytest.mark.parametrize("slow", ["context_cache", "action_cache"])
def test_a_half_profiled_slower_than_dense_is_skipped_under_auto_and_runs_under_on(demo, tmp_path, slow):
    repo = _timed_repository(demo, tmp_path, context_speedup=0.7 if slow == "context_cache" else 1.4,
                             action_speedup=0.7 if slow == "action_cache" else 1.4)
    context, action = _served(_calls(demo, repo, f"auto{slow}"))
    # auto: the slower half never served a call, the faster one served every call that had a reference
    assert context == {slow != "context_cache"} and action == {slow != "action_cache"}
    context, action = _served(_calls(demo, repo, f"on{slow}", **{slow: "on"}))
    assert context == {True} and action == {True}


def test_both_halves_slower_than_dense_leave_the_cache_effectively_dense(demo, tmp_path, caplog):
    repo = _timed_repository(demo, tmp_path, context_speedup=0.8, action_speedup=0.9)
    with caplog.at_level(logging.WARNING, logger="vla_runtime.nodes.stages"):
        cc = cache_config(CacheSpec(enabled=True, repository=str(repo)), ReferenceRepository.open(repo))
    assert cc.dense and "effectively dense" in cc.reason
    assert [r.message for r in caplog.records if "effectively dense" in r.message] == [f"muscle-memory cache: {cc.reason}"]
    results = _calls(demo, repo, "bothslow")
    assert not any(r.cached for r in results)


def test_without_a_recorded_timing_auto_runs_both_halves_and_says_so(demo):
    repo = ReferenceRepository.open(demo["repo"])
    assert repo.meta.half_timing is None
    cc = cache_config(CacheSpec(enabled=True, repository=str(demo["repo"])), repo)
    assert (cc.context_cache, cc.action_cache) == (True, True) and "unmeasured" in cc.reason
    forced = cache_config(CacheSpec(enabled=True, repository=str(demo["repo"]), context_cache=False), repo)
    assert (forced.context_cache, forced.action_cache) == (False, True)


def test_auto_runs_dense_once_choosing_a_reference_costs_more_than_its_halves_save(demo, tmp_path, caplog):
    """Both halves timed faster than dense by about a microsecond a call: after the calls the
    profile gives the check (2), the vision stage has measured that choosing a reference costs
    more, says so and runs every later call dense, choosing nothing. The same halves forced on are
    never second-guessed."""
    repo = _timed_repository(demo, tmp_path, context_speedup=1.0001, action_speedup=1.0001)
    cache = CacheSpec(enabled=True, repository=str(repo), selection_check_calls=2, max_end_matches=0)
    rings = RingNames(f"t{os.getpid()}_budget_p", f"t{os.getpid()}_budget_w")
    with caplog.at_level(logging.WARNING, logger="vla_runtime.nodes.stages"), \
            LocalPipeline(PipelineSpec(Path(demo["checkpoint"]), CAMS, cache, rings=rings, seed=3,
                                       time_available_s=10.0)) as pipeline:
        assert pipeline.vision.budget is not None and "weighed against what choosing a reference costs over the " \
            "first 2 calls" in pipeline.vision.cache_reason
        results = _cycled_calls(pipeline, demo, 6)
        stage = pipeline.vision
        assert stage.budget.keep is False and stage.selector is None and stage.beside is None
        assert "off for the rest of the run (auto): choosing a reference cost" in stage.cache_reason
        assert pipeline.last_choice is not None and not pipeline.last_choice.found   # reported dense, and why
        assert pipeline.last_choice.reason.startswith("cache off for the rest of the run (auto): choosing")
    assert not any(r.cached for r in results[2:])
    assert any("muscle-memory cache off for the rest of the run (auto): choosing a reference cost" in r.message
               for r in caplog.records)
    forced = replace(cache, context_cache="on", action_cache="on")
    rings = RingNames(f"t{os.getpid()}_forced_p", f"t{os.getpid()}_forced_w")
    with LocalPipeline(PipelineSpec(Path(demo["checkpoint"]), CAMS, forced, rings=rings, seed=3,
                                    time_available_s=10.0)) as pipeline:
        assert pipeline.vision.budget is None
        assert any(r.cached for r in _cycled_calls(pipeline, demo, 6)[2:])


def test_auto_keeps_the_cache_where_its_halves_save_more_than_choosing_costs(demo, tmp_path):
    repo = _timed_repository(demo, tmp_path, context_speedup=2.0, action_speedup=2.0, dense_s=(10.0, 10.0))
    cache = CacheSpec(enabled=True, repository=str(repo), selection_check_calls=2, max_end_matches=0)
    rings = RingNames(f"t{os.getpid()}_keep_p", f"t{os.getpid()}_keep_w")
    with LocalPipeline(PipelineSpec(Path(demo["checkpoint"]), CAMS, cache, rings=rings, seed=3,
                                    time_available_s=10.0)) as pipeline:
        results = _cycled_calls(pipeline, demo, 6)
        assert pipeline.vision.budget.keep is True and pipeline.vision.selector is not None
    assert any(r.cached for r in results[2:])


def test_a_profile_without_rho_p_runs_the_fraction_the_repository_was_profiled_at(demo, tmp_path, caplog, oracle_for):
    """``cache.rho_p`` unset: the stages take the fraction ``build-cache --profile`` timed the halves
    at, say so at start-up, and the vision stage's Context Cache runs it; its cached calls agree
    with the oracle at that fraction. (On the demo episodes the query drifts so little from its
    reference that 0.2 and 0.4 move a chunk by only about 2e-6, so the oracle alone could not tell
    the two apart: the stage's own configuration is checked for that.) A fraction given still wins."""
    repo = _timed_repository(demo, tmp_path, context_speedup=1.4, action_speedup=1.4, rho_p=0.2)
    with caplog.at_level(logging.WARNING, logger="vla_runtime.nodes.stages"):
        cc = cache_config(CacheSpec(enabled=True, repository=str(repo)), ReferenceRepository.open(repo))
    assert cc.rho_p == 0.2 and cc.reason.startswith("rho_p 0.2 (the repository's profiling); context cache on")
    assert f"muscle-memory cache: {cc.reason}" in caplog.text
    given = cache_config(CacheSpec(enabled=True, repository=str(repo), rho_p=0.6), ReferenceRepository.open(repo))
    assert given.rho_p == 0.6 and given.reason.startswith("rho_p 0.6 (given)")
    assert "the profile runs rho_p 0.6, the Context Cache was timed at 0.2" in given.reason

    profiled = oracle_for(demo, 3, rho_p=0.2)
    episode, served = demo["episode"], 0
    rings = RingNames(f"t{os.getpid()}_rho_p", f"t{os.getpid()}_rho_w")
    with LocalPipeline(PipelineSpec(Path(demo["checkpoint"]), CAMS, CacheSpec(enabled=True, repository=str(repo)),
                                    rings=rings, seed=3, time_available_s=10.0)) as pipeline:
        assert pipeline.vision.worker.cache.rho_p == 0.2
        pipeline.start_episode(episode.task)
        for frame in episode.frames:
            res = pipeline.call(frame.images, np.asarray(frame.state), episode.task)
            profiled.check(res, pipeline.last_choice, frame, episode.task)
            served += bool(res.cached and res.meta.context_cache)
    assert served >= 1


def _cached_pipeline(demo: dict, tag: str) -> LocalPipeline:
    rings = RingNames(f"t{os.getpid()}_{tag}_p", f"t{os.getpid()}_{tag}_w")
    return LocalPipeline(PipelineSpec(Path(demo["checkpoint"]), CAMS,
                                      CacheSpec(enabled=True, repository=str(demo["repo"])),
                                      rings=rings, seed=3, time_available_s=10.0))


def _say_who_chooses(stage, chooser: list[str], entered: threading.Event | None = None) -> None:
    """Wrap the stage's ``choose``: each call appends its thread's name (and sets ``entered``)."""
    choose = stage.selector.choose

    def choose_and_say(*args):
        chooser.append(threading.current_thread().name)
        if entered is not None:
            entered.set()
        return choose(*args)

    stage.selector.choose = choose_and_say


def _cycled_calls(pipeline: LocalPipeline, demo: dict, n: int) -> list:
    """``n`` calls of one episode cycling through the demo episode's frames (it has only a few)."""
    pipeline.start_episode(demo["episode"].task)
    frames = demo["episode"].frames
    return [pipeline.call(frames[i % len(frames)].images, np.asarray(frames[i % len(frames)].state),
                          demo["episode"].task) for i in range(n)]


def _episode_calls(pipeline: LocalPipeline, demo: dict) -> list:
    return _cycled_calls(pipeline, demo, len(demo["episode"].frames))


def test_the_reference_is_chosen_while_the_vision_tower_runs_its_later_layers(demo):
    """rMuscle §5: selection starts at the tower's retrieval layer and overlaps its later layers.
    The first layer after the retrieval layer waits (up to 120 s, a bound against hanging) until
    the selection has entered ``choose`` on its own thread: had selection started only after the
    tower, every wait would run out. The calls still select (some are served by a reference)."""
    with _cached_pipeline(demo, "ovl") as pipeline:
        stage = pipeline.vision
        model = stage.worker.engine.model
        choosing, waited, chooser = threading.Event(), [], []
        encoding = threading.local()
        encode = stage.encode

        def encode_marked(*args):
            encoding.on = True
            try:
                return encode(*args)
            finally:
                encoding.on = False

        def after_the_retrieval_layer(_module, _inputs):
            if getattr(encoding, "on", False):   # not the cache manager's rebuilds on the same model
                waited.append(choosing.wait(120.0))
                choosing.clear()

        _say_who_chooses(stage, chooser, choosing)
        stage.encode = encode_marked
        stage.beside.MIN_TAIL_S = 0.0   # the tiny test tower's tail is shorter than any real one
        hook = model.vision.layers[model.cfg.retrieval_layer].register_forward_pre_hook(after_the_retrieval_layer)
        try:
            results = _episode_calls(pipeline, demo)
        finally:
            hook.remove()
    assert waited == [True] * len(demo["episode"].frames)
    assert set(chooser) == {n for n in chooser if n.startswith("vision-select")} and len(chooser) == len(waited)
    assert any(r.cached for r in results)


def test_a_selection_whose_thread_never_started_is_run_by_the_call_itself(demo):
    """The selection's thread is kept busy (as when no core is free for it): the call does not wait
    for it but takes its selection back and chooses on its own thread, with the same outcome
    (the calls are served by references as usual)."""
    with _cached_pipeline(demo, "stl") as pipeline:
        stage, release, chooser = pipeline.vision, threading.Event(), []
        _say_who_chooses(stage, chooser)
        stage.beside.MIN_TAIL_S = 0.0
        busy = stage.beside._pool.submit(release.wait, 120.0)   # the only worker, held for the whole run
        try:
            results = _episode_calls(pipeline, demo)
        finally:
            release.set()
            busy.result()
    assert len(chooser) == len(results) and not any(n.startswith("vision-select") for n in chooser)
    assert any(r.cached for r in results)


def test_a_tower_whose_tail_is_short_gets_its_selection_in_series(demo):
    """A tower whose layers after the retrieval layer take less than ``BesideTower.MIN_TAIL_S`` (here
    every tower: the bound is an hour) is not worth a hand-off to another thread: every call
    chooses on its own thread, after the tower, and the measured tail is kept."""
    with _cached_pipeline(demo, "ser") as pipeline:
        stage, chooser = pipeline.vision, []
        _say_who_chooses(stage, chooser)
        stage.beside.MIN_TAIL_S = 3600.0
        results = _episode_calls(pipeline, demo)
        tail = stage.beside.tail_s
    assert len(chooser) == len(results) and not any(n.startswith("vision-select") for n in chooser)
    assert 0.0 < tail < 3600.0 and any(r.cached for r in results)


def test_a_call_is_in_progress_from_its_encoding_to_its_denoising_and_the_upkeep_waits_for_it(demo):
    """The vision stage marks the call begun, the policy stage done; the cache stage's upkeep,
    started while the call is in progress (as on a 2-core robot computer when the gap before
    the next call is short), rebuilds nothing until the policy has denoised it. A failed
    encoding leaves no call in progress."""
    from vla_runtime.ipc.ring import read_call_words
    from vla_runtime.nodes.call_gate import CallGate

    frames, task = demo["episode"].frames, demo["episode"].task
    with _cached_pipeline(demo, "gate") as p:
        name = p.spec.rings.prefix
        p.cache.gate = CallGate(name, first_guess_s=60.0)   # bounds far beyond this test: only the call ends a wait
        p.start_episode(task)
        manager = p.cache.worker.manager
        first, other = sorted(manager.window.lengths)[:2]
        # the window narrows to one reference (no call in progress: no wait), and forgets the
        # others' entries, so that following another reference during the call rebuilds entries
        # (the demo's references are short enough for the initial window to hold them all)
        narrow = Selection(0, task, p.episode, Match(first, 0, 1.0, 0.0), (first,))
        p.cache.follow(narrow)
        p.cache.upkeep(10.0)
        assert p.cache.gate.stats.waits == 0 and all(k[0] == first for k in manager.entries)
        manager._rebuilt.clear()
        manager._rebuilt_bytes = 0
        assert not read_call_words(name).in_flight
        note = p.vision.encode(p.numbering.request(np.asarray(frames[0].state), task, 0), frames[0].images)
        assert read_call_words(name).in_flight
        p.cache.follow(replace(narrow, request_seq=1, match=Match(other, 0, 1.0, 0.0), candidates=(other,)))
        rebuilt_before = len(manager._rebuild_s)
        upkeep = threading.Thread(target=p.cache.upkeep, args=(10.0,))
        upkeep.start()
        upkeep.join(0.5)
        assert upkeep.is_alive(), "the upkeep did not wait for the call in progress"
        assert len(manager._rebuild_s) == rebuilt_before   # nothing rebuilt meanwhile
        assert p.policy.act(note) is not None
        assert not read_call_words(name).in_flight
        upkeep.join(120)
        assert not upkeep.is_alive()
        assert any(k[0] == other for k in manager.entries)                # rebuilt once the call was over
        assert p.cache.gate.stats.waits == 1 and p.cache.gate.stats.gave_up == 0
        assert p.cache.gate.stats.waited_s >= 0.5
        with pytest.raises(ValueError, match="no camera image"):        # refused after the call began
            p.vision.encode(p.numbering.request(np.asarray(frames[1].state), task, 0), {})
        assert not read_call_words(name).in_flight


def test_the_vision_stages_idle_work_waits_while_its_call_is_being_denoised(demo):
    """Between calls the vision stage takes in the window's changes and reads its features
    (``WindowSelector.idle``); while the call it encoded is still with the policy it does
    neither, so the policy's denoising has the machine's other core to itself."""
    frames, task = demo["episode"].frames, demo["episode"].task
    with _cached_pipeline(demo, "idle") as p:
        p.start_episode(task)
        idled: list[bool] = []
        idle = p.vision.selector.idle
        p.vision.selector.idle = lambda: (idled.append(True), idle())
        p.vision.idle()
        assert len(idled) == 1                                      # no call in progress
        note = p.vision.encode(p.numbering.request(np.asarray(frames[0].state), task, 0), frames[0].images)
        p.vision.idle()
        p.vision.idle()
        assert len(idled) == 1                                      # the call is with the policy
        assert p.policy.act(note) is not None
        p.vision.idle()
        assert len(idled) == 2                                      # denoised: the gap's work runs again


def test_the_reference_announced_before_the_prefill_is_gathered_ahead_and_the_call_gathers_nothing(demo):
    """``VisionStage.ahead`` names the chosen working-set entry before the prefill; the policy stage
    gathers its masks' compact weights then (``PolicyStage.gather_ahead``), so the call's anchors
    gather nothing, and the chunks are exactly those of calls that gathered for themselves. A
    note naming an entry that has since been replaced gathers nothing: the call gathers itself."""
    with _cached_pipeline(demo, "own") as pipeline:
        plain = _episode_calls(pipeline, demo)
    with _cached_pipeline(demo, "ahd") as pipeline:
        notes, done = [], []

        def gather_ahead(note):
            notes.append(note)
            done.append(pipeline.policy.gather_ahead(note))
        pipeline.vision.ahead = gather_ahead
        ahead = _episode_calls(pipeline, demo)
        stale = replace(notes[-1], seq=notes[-1].seq + 1000)
        assert pipeline.policy.gather_ahead(stale) == 0
    served = [r.used_reference for r in ahead]
    assert sum(served) >= len(ahead) - 1 and len(notes) == sum(served)
    assert all(n.ring == pipeline.vision.rings.working_set for n in notes)
    assert sum(r.gathers for r in plain) > 0 and sum(done) == sum(r.gathers for r in plain)
    assert [r.gathers for r in ahead] == [0] * len(ahead)
    for got, want in zip(ahead, plain):
        assert got.used_reference == want.used_reference
        np.testing.assert_array_equal(got.chunk, want.chunk)
