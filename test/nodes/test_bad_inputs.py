"""The catalogue of bad inputs (docs/reliability.md), fast layer: each case is fed to the code the
nodes run (boundary conversions, stages, controller, parameter checks, start-up checks) and must
give a clear diagnostic, leave a safe state, and never let NaN or an out-of-limit value out.
test/ros/test_faults.py feeds a subset to the real nodes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.testing.controllers import small_controller
from vla_runtime.io.messages import InputError, JointStateAssembler, image_from_msg
from vla_runtime.ipc.layout import FieldSpec, SlotLayout
from vla_runtime.ipc.ring import LayoutMismatchError, RingBuffer, RingNotFoundError
from vla_runtime.nodes import params as P
from vla_runtime.nodes.conversions import CameraFeed, StampCheck, instruction_from_msg, stamp_ns, usable_images
from vla_runtime.nodes.pipeline import LocalPipeline, PipelineSpec
from vla_runtime.nodes.profile import CacheSpec, EngineSpec, ProfileError, profile_from_dict
from vla_runtime.nodes.stages import (CacheStage, PolicyStage, PrefixRequestNote, RingNames, SlotNote, VisionStage,
                                      load_policy)

CAMS = ("top", "wrist")
S = 1_000_000_000


def _img(h=4, w=5, enc="rgb8", data=None, step=None, ch=3):
    arr = np.arange(h * w * ch, dtype=np.uint8)
    return NS(height=h, width=w, encoding=enc, step=w * ch if step is None else step,
              data=arr.tobytes() if data is None else data)


def _stamped(sec: float):
    s, ns = divmod(int(sec * S), S)
    return NS(header=NS(stamp=NS(sec=s, nanosec=ns)))


def _rings(tag: str) -> RingNames:
    return RingNames(f"t{os.getpid()}_bad_{tag}_p", f"t{os.getpid()}_bad_{tag}_w")




class _closing:
    def __init__(self, stage):
        self.stage = stage

    def __enter__(self):
        return self.stage

    def __exit__(self, *exc):
        self.stage.close()


@pytest.fixture(scope="module")
def policy(demo) -> Pi05Policy:
    return load_policy(demo["checkpoint"], EngineSpec(preset="pi05-tiny", share_weights=False), CAMS, 7)


@pytest.fixture(scope="module")
def frame(demo):
    f = demo["episode"].frames[0]
    return {k: np.asarray(v) for k, v in f.images.items()}, np.asarray(f.state, dtype=np.float32), demo["episode"].task


# ------------------------------------------------------------------ images (vision node boundary)

@pytest.mark.parametrize("enc", ["yuv422", "16UC1", "rgb16", ""])
def test_image_wrong_encoding_is_refused(enc):
    with pytest.raises(InputError, match="camera 'top': unsupported Image encoding"):
        image_from_msg(_img(enc=enc), compressed=False, camera="top")


def test_image_size_inconsistent_with_its_data_is_refused():
    with pytest.raises(InputError, match="inconsistent"):
        image_from_msg(_img(h=480, w=640, data=bytes(60)), compressed=False, camera="top")   # 60 bytes, 640x480
    with pytest.raises(InputError, match="inconsistent"):
        image_from_msg(_img(step=2), compressed=False, camera="top")              # rows shorter than width


def test_image_of_zero_size_is_refused():
    with pytest.raises(InputError, match="invalid size"):
        image_from_msg(_img(h=0, w=0, data=b""), compressed=False, camera="top")


def test_image_too_large_is_refused():
    with pytest.raises(InputError, match="exceeds 4096 pixels"):
        image_from_msg(_img(h=1, w=5000), compressed=False, camera="top")


def test_image_channel_order_is_honoured_and_a_wrong_channel_count_refused():
    rgb = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    for enc, data in [("bgr8", rgb[..., ::-1]), ("rgba8", np.dstack([rgb, np.full((4, 5), 7, np.uint8)])),
                      ("bgra8", np.dstack([rgb[..., ::-1], np.zeros((4, 5), np.uint8)]))]:
        msg = _img(enc=enc, data=np.ascontiguousarray(data).tobytes(), ch=data.shape[2])
        np.testing.assert_array_equal(image_from_msg(msg, compressed=False, camera="top"), rgb)
    mono = image_from_msg(_img(enc="mono8", ch=1), compressed=False, camera="top")
    assert mono.shape == (4, 5, 3) and (mono[..., 0] == mono[..., 2]).all()
    with pytest.raises(InputError, match="inconsistent"):   # 1-channel data labelled rgb8
        image_from_msg(_img(enc="rgb8", data=bytes(20), step=5), compressed=False, camera="top")


def test_compressed_image_undecodable_or_empty_is_refused():
    with pytest.raises(InputError, match="could not decode"):
        image_from_msg(NS(format="jpeg", data=b"\xff\xd8 not really"), compressed=True, camera="wrist")
    with pytest.raises(InputError, match="no data"):
        image_from_msg(NS(format="png", data=b""), compressed=True, camera="wrist")


def test_image_of_odd_size_is_resized_and_gives_a_finite_chunk(policy, frame):
    _, state, task = frame
    rings = _rings("odd")
    with _closing(VisionStage(policy, rings)) as vs, _closing(PolicyStage(policy, rings)) as ps:
        note = vs.encode(PrefixRequestNote(0, 0, tuple(state), task), {"top": np.zeros((3, 7, 3), np.uint8),
                                                                       "wrist": np.full((1, 1, 3), 255, np.uint8)})
        res = ps.act(note)
        assert res.meta.cameras == 2 and np.isfinite(res.chunk).all()


# ------------------------------------------------------------------ missing / stale cameras

def test_missing_camera_is_masked_and_reported(policy, frame):
    images, state, task = frame
    feeds = {c: CameraFeed(c) for c in CAMS}
    feeds["top"].offer(0, 5 * S, lambda: images["top"])
    use, missing, stale = usable_images(feeds, 5 * S, max_age_s=1.0, frozen_after=10)
    assert list(use) == ["top"] and missing == ["wrist"] and stale == []
    rings = _rings("miss")
    with _closing(VisionStage(policy, rings)) as vs, _closing(PolicyStage(policy, rings)) as ps:
        res = ps.act(vs.encode(PrefixRequestNote(0, 0, tuple(state), task), use))
        assert res.meta.cameras == 1 and np.isfinite(res.chunk).all()


def test_no_camera_at_all_refuses_the_call(policy, frame):
    _, state, task = frame
    use, missing, _ = usable_images({c: CameraFeed(c) for c in CAMS}, 0, 1.0, 10)
    assert use == {} and missing == list(CAMS)          # the vision node refuses: "no camera image yet"
    with _closing(VisionStage(policy, _rings("none"))) as vs, pytest.raises(ValueError, match="no camera image"):
        vs.encode(PrefixRequestNote(0, 0, tuple(state), task), {})


def test_frozen_camera_is_stale_until_a_new_frame_comes():
    feed, decoded = CameraFeed("wrist"), []
    for i in range(12):                                    # a driver re-sending one frame, fresh arrival times
        feed.offer(7 * S, (10 + i) * S // 10, lambda: decoded.append(1) or np.zeros((2, 2, 3), np.uint8))
    assert len(decoded) == 1                               # repeats are not decoded again
    assert "frozen" in feed.stale(2 * S, max_age_s=0.0, frozen_after=10)
    assert "no new frame for" in feed.stale(3 * S, max_age_s=1.0, frozen_after=0)   # also too old by then
    assert feed.stale(2 * S, max_age_s=0.0, frozen_after=0) == ""                      # checks off: usable
    feed.offer(8 * S, 3 * S, lambda: np.ones((2, 2, 3), np.uint8))
    assert feed.stale(3 * S, max_age_s=1.0, frozen_after=10) == "" and feed.image.max() == 1


def test_repeated_frame_is_counted_before_it_is_judged():
    """The vision node checks a frame's stamp inside ``decode``: a frozen driver's repeats are
    still counted once that stamp is too old, so it is reported as frozen, not as old frames."""
    feed = CameraFeed("wrist")
    feed.offer(7 * S, 1 * S, lambda: np.zeros((2, 2, 3), np.uint8))

    def too_old():
        raise InputError("stamp is 2.0 s old, older than 1.0 s")

    for i in range(9):
        feed.offer(7 * S, (2 + i) * S, too_old)            # no error: a repeat is not decoded
    assert feed.repeats == 9 and "frozen" in feed.stale(11 * S, max_age_s=1.0, frozen_after=10)
    with pytest.raises(InputError):
        feed.offer(8 * S, 12 * S, too_old)                 # a new frame is judged


def test_camera_that_stopped_sending_is_stale():
    feed = CameraFeed("top")
    feed.offer(0, 1 * S, lambda: np.zeros((2, 2, 3), np.uint8))   # unstamped: freshness by arrival
    assert feed.stale(int(1.5 * S), 1.0, 10) == ""
    why = feed.stale(int(2.5 * S), 1.0, 10)
    assert "no new frame for 1.50 s" in why
    _, _, stale = usable_images({"top": feed}, int(2.5 * S), 1.0, 10)
    assert stale == [why]


def test_bad_image_leaves_the_previous_frame():
    feed = CameraFeed("top")
    feed.offer(1 * S, 1 * S, lambda: np.zeros((2, 2, 3), np.uint8))
    with pytest.raises(InputError):
        feed.offer(2 * S, 2 * S, lambda: image_from_msg(_img(enc="yuv422"), False, "top"))
    assert feed.stamp_ns == 1 * S and feed.new_frame_ns == 1 * S      # unchanged: it ages and goes stale


# ------------------------------------------------------------------ joint states (policy node boundary)

def test_joint_state_with_wrong_names_is_refused():
    js = JointStateAssembler(["a", "b"])
    with pytest.raises(InputError, match="match none of the profile's joints"):
        js.update(NS(name=["x", "y"], position=[0.0, 0.0]), 1)
    assert not js.complete()


def test_joint_state_with_wrong_length_is_refused():
    js = JointStateAssembler(["a", "b"])
    js.update(NS(name=["a", "b"], position=[0.1, 0.2]), 1)
    with pytest.raises(InputError, match="2 names but 3 positions"):
        js.update(NS(name=["a", "b"], position=[1.0, 2.0, 3.0]), 2)
    np.testing.assert_array_equal(js.vector(), np.float32([0.1, 0.2]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_joint_state_with_nan_or_inf_is_refused(bad):
    js = JointStateAssembler(["a", "b"])
    js.update(NS(name=["a", "b"], position=[0.1, 0.2]), 1)
    with pytest.raises(InputError, match=r"non-finite positions for \['b'\]"):
        js.update(NS(name=["a", "b"], position=[0.5, bad]), 2)
    np.testing.assert_array_equal(js.vector(), np.float32([0.1, 0.2]))   # nothing of the message applied


def test_joint_state_naming_a_joint_twice_is_refused():
    js = JointStateAssembler(["a", "b"])
    with pytest.raises(InputError, match=r"names a joint twice: \['a'\]"):
        js.update(NS(name=["a", "a", "b"], position=[0.0, 1.0, 2.0]), 1)


def test_partial_joint_state_waits_for_every_joint():
    js = JointStateAssembler(["a", "b", "c"])
    js.update(NS(name=["c", "a"], position=[3.0, 1.0]), 1)
    assert not js.complete() and js.missing() == ["b"]     # the policy node does not start calling
    with pytest.raises(InputError, match=r"no joint state received yet for \['b'\]"):
        js.vector()


def test_measured_state_beyond_the_limits_is_held_inside_them():
    c = small_controller()
    c.set_initial(np.array([5.0, -9.0]))                  # a sensor reading past the limits
    cmd = c.tick(0)
    assert cmd.status == "held"
    np.testing.assert_array_equal(cmd.action, [1.0, -1.0])


# ------------------------------------------------------------------ stamps

def test_stamp_from_the_future_is_refused():
    now = 100 * S
    with pytest.raises(InputError, match="JointState: stamp 2.000 s in the future"):
        StampCheck(1.0, 0.5).check(stamp_ns(_stamped(102.0)), now, "JointState")
    StampCheck(1.0, 0.5).check(stamp_ns(_stamped(100.4)), now, "JointState")     # within the tolerance
    StampCheck(1.0, 0.0).check(stamp_ns(_stamped(1e6)), now, "JointState")        # check turned off


def test_stamp_too_old_is_refused():
    with pytest.raises(InputError, match="camera 'top': stamp 5.000 s old, older than 1.0 s"):
        StampCheck(1.0, 0.5).check(stamp_ns(_stamped(95.0)), 100 * S, "camera 'top'")


def test_unstamped_message_is_not_stamp_checked():
    assert stamp_ns(NS(name=[])) == 0 and stamp_ns(_stamped(0.0)) == 0
    StampCheck(1.0, 0.5).check(0, 100 * S, "JointState")


# ------------------------------------------------------------------ instruction

@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty_instruction_is_ignored(text):
    with pytest.raises(InputError, match="empty instruction ignored: the current task continues"):
        instruction_from_msg(NS(data=text))


def test_over_long_or_control_character_instruction_is_refused():
    with pytest.raises(InputError, match="1001 characters refused"):
        instruction_from_msg(NS(data="x" * 1001))
    with pytest.raises(InputError, match=r"control characters refused \(U\+0000 at 4\): the current task continues"):
        instruction_from_msg(NS(data="pick\x00up"))
    with pytest.raises(InputError, match=r"\(U\+0007 at 0, U\+001B at 5\)"):
        instruction_from_msg(NS(data="\x07pick\x1bup"))
    assert instruction_from_msg(NS(data="  pick up the cube \n")) == "pick up the cube"


def test_changed_instruction_starts_a_new_episode_in_the_cache_manager(demo, frame):
    images, state, task = frame
    spec = PipelineSpec(Path(demo["checkpoint"]), CAMS, CacheSpec(enabled=True, repository=str(demo["repo"])),
                        rings=_rings("instr"), seed=3, time_available_s=10.0)
    with LocalPipeline(spec) as pipe:
        worker = pipe.cache.worker
        # not announced ahead: the first call runs dense (no window of this task yet, never a wait) and
        # its selection note starts the episode in the cache manager, so the next call is cached
        first = pipe.call(images, state, task)
        assert not first.used_reference and worker.manager.task == task and worker.episodes_started == 1
        assert pipe.call(images, state, task).used_reference
        assert worker.episodes_started == 1                        # same task: same episode
        other = "put the bowl on the shelf"                          # a task the repository has no pack for
        res = pipe.call(images, state, other)
        assert worker.manager.task == other and worker.episodes_started == 2
        assert not res.used_reference and "unknown task" in pipe.last_choice.reason    # dense, says why
        assert np.isfinite(res.chunk).all()
        pipe.call(images, state, task)                               # back: a third episode ...
        assert worker.episodes_started == 3 and worker.manager.task == task
        assert pipe.call(images, state, task).used_reference        # ... cached again once its window is up


def test_changed_instruction_abandons_the_call_in_flight():
    c = small_controller()
    req = c.maybe_request(0, np.zeros(2), 0.0)
    c.abandon(1)                                       # what the policy node does when the task changes
    assert not c.on_chunk(req.request_seq, np.zeros((10, 2)), 2, 0.04)   # the old task's chunk is not merged
    assert c.maybe_request(2, np.zeros(2), 0.0) is not None


# ------------------------------------------------------------------ cache repository

def _cache_stage(policy, demo, repo: Path, tag: str) -> CacheStage:
    return CacheStage(policy, CacheSpec(enabled=True, repository=str(repo)), _rings(tag))


def test_corrupted_repository_index_runs_dense_with_the_reason(policy, demo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(demo["repo"], repo)
    (repo / "index.json").write_text("{not json")
    stage = _cache_stage(policy, demo, repo, "idx")
    assert not stage.enabled and stage.disabled_reason == "repository refused"
    assert stage.working_set is None                     # no window published: every call runs dense
    stage.close()


def test_repository_with_a_damaged_episode_file_is_refused(policy, demo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(demo["repo"], repo)
    ep = sorted((repo / "episodes").glob("*.safetensors"))[0]
    data = bytearray(ep.read_bytes())
    data[-100] ^= 0xFF                                   # one flipped byte in the tensor data
    ep.write_bytes(bytes(data))
    stage = _cache_stage(policy, demo, repo, "rot")
    assert not stage.enabled and "repository refused" in stage.disabled_reason and ep.stem in stage.disabled_reason
    stage.close()


def test_repository_of_another_checkpoint_is_refused(policy, demo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(demo["repo"], repo)
    index = json.loads((repo / "index.json").read_text())
    index["checkpoint_hash"] = "0" * 64
    (repo / "index.json").write_text(json.dumps(index))
    stage = _cache_stage(policy, demo, repo, "hash")
    assert not stage.enabled
    stage.close()
    from vla_runtime.cache.repository import ReferenceRepository, RepositoryError
    with pytest.raises(RepositoryError, match="repository was built for 0000"):
        ReferenceRepository.open(repo, expect_checkpoint_hash=policy.checkpoint_hash)


def test_missing_repository_is_refused(policy, demo, tmp_path):
    stage = _cache_stage(policy, demo, tmp_path / "nowhere", "gone")
    assert not stage.enabled and stage.worker is None
    stage.close()


# ------------------------------------------------------------------ checkpoint vs profile

def test_checkpoint_of_another_preset_is_refused_at_start_up(demo):
    with pytest.raises(ValueError, match=r"architecture is not engine.preset 'pi05-small': vision_depth 4 \(preset"):
        load_policy(demo["checkpoint"], EngineSpec(preset="pi05-small", share_weights=False), CAMS, 7)


def test_checkpoint_with_other_state_or_action_dims_is_refused_at_start_up(tiny_checkpoint_dir):
    with pytest.raises(ValueError, match="state has 4 dims, the profile has 7 joints.*actions have 5 dims"):
        load_policy(tiny_checkpoint_dir, EngineSpec(share_weights=False), CAMS, 7)


def test_damaged_checkpoint_is_refused_at_start_up(demo, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo["checkpoint"], ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])     # truncated
    with pytest.raises(Exception, match="model.safetensors"):
        load_policy(ckpt, EngineSpec(share_weights=False), CAMS, 7)


def test_unknown_preset_in_the_profile_is_refused():
    import yaml
    d = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "sim.yaml").read_text())
    d["engine"]["preset"] = "pi06"
    with pytest.raises(ProfileError, match="engine.preset: must be null or one of"):
        profile_from_dict(d)


# ------------------------------------------------------------------ ring-buffer slots (policy side)

def test_slot_note_with_a_wrong_layout_tag_is_refused_before_reading(policy, frame):
    images, state, task = frame
    rings = _rings("tag")
    with _closing(VisionStage(policy, rings)) as vs, _closing(PolicyStage(policy, rings)) as ps:
        note = vs.encode(PrefixRequestNote(0, 0, tuple(state), task), images)
        bad = SlotNote(note.ring, note.slot, note.seq, "f" * 32)
        with pytest.raises(LayoutMismatchError, match="layout tag ffff.* this policy reads"):
            ps.act(bad)
        assert ps.act(note) is not None                   # the good note still works


def test_ring_with_another_layout_is_refused_naming_the_difference(policy):
    name = f"t{os.getpid()}_bad_layout"
    other = SlotLayout((FieldSpec("k", (2, 2), torch.float32),))
    with RingBuffer.create(name, other, 2) as ring, _closing(PolicyStage(policy)) as ps:
        with ring.begin_write() as w:
            slot, seq = w.commit({"x": 1})
        with pytest.raises(LayoutMismatchError, match="reader vs writer: .*fields only in"):
            ps.act(SlotNote(name, slot, seq))


def test_slot_with_garbled_metadata_is_refused(policy):
    rings = _rings("meta")
    with _closing(VisionStage(policy, rings)) as vs, _closing(PolicyStage(policy, rings)) as ps:
        with vs.prefix.begin_write() as w:
            slot, seq = w.commit({"length": "lots", "request_seq": 0, "start_tick": 0})
        with pytest.raises(ValueError, match="prefix slot metadata unusable"):
            ps.act(SlotNote(vs.prefix.name, slot, seq))


def test_slot_declaring_a_prefix_outside_the_model_is_refused(policy, frame):
    images, state, task = frame
    rings = _rings("len")
    with _closing(VisionStage(policy, rings)) as vs, _closing(PolicyStage(policy, rings)) as ps:
        vs.encode(PrefixRequestNote(0, 0, tuple(state), task), images)
        with vs.prefix.begin_write() as w:
            meta = {"length": 10**6, "valid_len": 5, "cameras": 2, "state_dim": 7, "observation_seq": 1,
                    "stamp_ns": 1, "request_seq": 1, "start_tick": 0}
            slot, seq = w.commit(meta)
        with pytest.raises(ValueError, match="outside the model's bounds"):
            ps.act(SlotNote(vs.prefix.name, slot, seq))


def test_overwritten_slot_gives_no_chunk(policy, frame):
    images, state, task = frame
    rings = _rings("over")
    with _closing(VisionStage(policy, rings, slots=2)) as vs, _closing(PolicyStage(policy, rings)) as ps:
        notes = [vs.encode(PrefixRequestNote(i, 0, tuple(state), task), images) for i in range(3)]
        assert ps.act(notes[0]) is None                  # slot 0 holds call 2 by now
        assert ps.act(notes[2]).request_seq == 2


def test_slot_of_a_ring_that_is_gone_is_refused(policy):
    with _closing(PolicyStage(policy)) as ps, pytest.raises(RingNotFoundError, match="does not exist"):
        ps.act(SlotNote(f"t{os.getpid()}_bad_gone", 0, 0))


# ------------------------------------------------------------------ chunks coming back (controller)

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_chunk_with_nan_or_inf_is_not_executed(bad):
    c = small_controller()
    req = c.maybe_request(0, np.zeros(2), 0.0)
    chunk = np.full((10, 2), 0.5)
    chunk[3, 1] = bad
    assert not c.on_chunk(req.request_seq, chunk, 2, 0.04)
    assert c.rejected == 1 and "NaN/Inf" in c.last_rejection and c.in_flight is None
    assert c.tick(2).status == "held" and c.upcoming(3)[1].shape == (0, 2)      # nothing planned, holding
    assert c.maybe_request(3, np.zeros(2), 0.0) is not None                        # and asking again


def test_chunk_beyond_the_joint_limits_is_published_clamped():
    c = small_controller()
    req = c.maybe_request(0, np.zeros(2), 0.0)
    chunk = np.tile([[3.0, -0.5]], (10, 1))
    assert c.on_chunk(req.request_seq, chunk, 2, 0.04)
    _, upcoming = c.upcoming(3)
    assert np.abs(upcoming).max() <= 1.0 and (upcoming[:, 0] == 1.0).all()     # trajectory points
    np.testing.assert_array_equal(c.within_limits(chunk)[0], [1.0, -0.5])     # the ActionChunk
    assert c.tick(3).status == "clamped"


def test_chunk_arriving_after_the_watchdog_deadline_is_not_executed():
    c = small_controller()
    req = c.maybe_request(0, np.zeros(2), 0.0)
    assert not c.on_chunk(req.request_seq, np.zeros((10, 2)), now=51, latency_s=1.02)   # 1.02 s > 1.0 s
    assert "past the 1.0 s deadline" in c.last_rejection and c.tick(51).status == "held"
    req = c.maybe_request(52, np.zeros(2), 0.0)
    assert c.on_chunk(req.request_seq, np.zeros((10, 2)), now=54, latency_s=0.04)          # in time: merged


def test_chunk_of_the_wrong_shape_is_not_executed():
    c = small_controller()
    req = c.maybe_request(0, np.zeros(2), 0.0)
    assert not c.on_chunk(req.request_seq, np.zeros((10, 3)), 2, 0.04)
    assert "expected [C, 2]" in c.last_rejection


# ------------------------------------------------------------------ parameters

@pytest.mark.parametrize("table,name,value,why", [
    (P.POLICY, "request_timeout_s", 0.0, r"must be in \(0, 600\]"),
    (P.POLICY, "request_timeout_s", float("nan"), r"must be in \(0, 600\]"),
    (P.POLICY, "seed", -1, r"must be in \[0,"),
    (P.POLICY, "seed", 1.5, "must be a int"),
    (P.VISION, "ring_slots", 1, r"must be in \[2, 64\]"),
    (P.VISION, "ring", "a/b", "without '/'"),
    (P.VISION, "frozen_after", 1, r"must be 0 or in \[2, 100000\]"),
    (P.VISION, "max_image_age_s", -0.5, r"must be in \[0, 3600\]"),
    (P.CACHE_MANAGER, "time_available_s", -1.0, r"must be in \[0, 3600\]"),
    (P.CACHE_MANAGER, "working_set", "x" * 201, "at most 200 characters"),   # "": derived from the namespace
])
def test_parameter_out_of_range_at_start_up_is_refused(table, name, value, why):
    problems = P.check_values(table, {name: value})
    assert len(problems) == 1 and problems[0].startswith(f"{name}: ")
    import re
    assert re.search(why, problems[0]), problems[0]
    assert P.check_values(table, {n: p.default for n, p in table.items()}) == []   # the defaults are valid


def test_parameter_fixed_at_start_up_cannot_change_at_run_time():
    for table, name, value in [(P.POLICY, "seed", 3), (P.POLICY, "profile", "x.yaml"), (P.VISION, "ring", "r2"),
                               (P.CACHE_MANAGER, "working_set", "w2")]:
        assert P.check_change(table, name, value) == f"{name} is fixed at start-up (restart the node to change it)"


def test_parameter_out_of_range_at_run_time_is_refused_and_in_range_accepted():
    assert "must be in (0, 600]" in P.check_change(P.POLICY, "request_timeout_s", -1.0)
    assert "must be a float" in P.check_change(P.POLICY, "request_timeout_s", "soon")
    assert P.check_change(P.POLICY, "request_timeout_s", 3.0) == ""
    assert P.check_change(P.VISION, "frozen_after", 0) == "" and P.check_change(P.VISION, "frozen_after", 1)
    assert P.check_change(P.POLICY, "use_sim_time", True) == ""    # not ours: rclpy's own rules apply
    assert P.check_change(P.VISION, "peer_timeout_s", 0.0) and P.check_change(P.CACHE_MANAGER, "peer_timeout_s", 5.0) == ""
    dynamic = {n for t in (P.VISION, P.POLICY, P.CACHE_MANAGER) for n, p in t.items() if p.dynamic}
    assert dynamic == {"request_timeout_s", "max_input_age_s", "max_future_s", "max_image_age_s", "frozen_after",
                       "time_available_s", "peer_timeout_s"}


# ------------------------------------------------------------------ validation happens once, at the boundary

def test_input_errors_are_raised_only_by_the_boundary_conversions():
    """Node code reports InputError; only conversions.py decides one (no scattered checks)."""
    nodes = Path(__file__).resolve().parents[2] / "vla_runtime" / "nodes"
    raisers = {p.name for p in nodes.glob("*.py") if "raise InputError(" in p.read_text()}
    assert raisers == {"conversions.py"}
    for name in ("vision_node.py", "policy_node.py"):
        text = (nodes / name).read_text()
        assert "isfinite" not in text and ".strip()" not in text, name


def test_observation_checks_of_the_engine_stay_a_second_line(policy, frame):
    """What the boundary refuses, the engine API refuses too (library users call it directly):
    a NaN state never reaches the model either way."""
    images, state, task = frame
    bad = state.copy()
    bad[0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        policy.prepare(Observation(images, bad, task))
