"""Weights shared between processes on CPU: exactness, reuse, damage, concurrency, real sharing."""

from __future__ import annotations

import gc
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import vla_runtime.models.checkpoint as checkpoint_module
import vla_runtime.models.shared_weights as sw
from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.models.checkpoint import content_hash, load_checkpoint, read_checkpoint_layout
from vla_runtime.models.config import preset
from vla_runtime.models.gemma import Workspace
from vla_runtime.models.shared_weights import (
    ALIGN,
    SharedWeightsError,
    export_runtime_state,
    map_shared,
    mapping_usage,
    runtime_skeleton,
    shared_metadata,
    shared_weights_path,
    weight_tensors,
)

CAMS = ["top", "wrist"]
REPO = Path(__file__).resolve().parents[2]


def _obs() -> Observation:
    rng = np.random.default_rng(0)
    return Observation(images={"top": rng.integers(0, 255, (48, 64, 3), dtype=np.uint8),
                               "wrist": rng.integers(0, 255, (30, 30, 3), dtype=np.uint8)},
                       state=np.array([0.1, -0.5, 0.3, 0.9], dtype=np.float32), task="pick up the red cube")


def _actions(policy: Pi05Policy) -> torch.Tensor:
    return policy.predict(_obs(), generator=torch.Generator().manual_seed(0)).engine.actions


def _target(ckpt: Path, cache: Path, dtype: torch.dtype = torch.float32) -> tuple[Path, dict[str, str]]:
    files, _, _, cfg = read_checkpoint_layout(ckpt)
    meta = shared_metadata(content_hash(files), cfg, dtype)
    return shared_weights_path(meta, cache), meta


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    target = os.path.realpath(path)
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == target:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def _inside(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ranges)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint_dir: Path) -> dict[torch.dtype, torch.Tensor]:
    """Actions of the normal (private-copy) load, per dtype."""
    return {dt: _actions(Pi05Policy.from_checkpoint(tiny_checkpoint_dir, CAMS, dtype=dt))
            for dt in (torch.float32, torch.bfloat16)}


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_load_is_bit_identical(tiny_checkpoint_dir: Path, tmp_path: Path, reference, dtype):
    normal = load_checkpoint(tiny_checkpoint_dir, dtype=dtype)
    policy = Pi05Policy.from_checkpoint(tiny_checkpoint_dir, CAMS, dtype=dtype, share_weights=True,
                                        weights_cache_dir=tmp_path)
    assert policy.shared_weights is not None and policy.shared_weights.built
    assert policy.checkpoint_hash == normal.content_hash
    assert torch.equal(_actions(policy), reference[dtype])
    ours, theirs = weight_tensors(policy.engine.model), weight_tensors(normal.model)
    assert ours.keys() == theirs.keys()
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k


def test_weights_are_views_of_the_file_and_runtime_state_is_not(tiny_checkpoint_dir: Path, tmp_path: Path):
    policy = Pi05Policy.from_checkpoint(tiny_checkpoint_dir, CAMS, share_weights=True, weights_cache_dir=tmp_path)
    model = policy.engine.model
    info = policy.shared_weights
    assert info.copied == () and not info.writable
    ranges = _mapped_ranges(info.path)
    weights = weight_tensors(model)
    assert all(_inside(t, ranges) for t in weights.values())
    assert info.nbytes == sum(t.nbytes for t in weights.values()) and info.tensors == len(weights)
    # KV caches and the denoising workspace are written every call: private memory, never the file.
    assert model.caches and not any(_inside(c.k, ranges) or _inside(c.v, ranges) for c in model.caches)
    ws = model.workspace
    assert not any(_inside(getattr(ws, f), ranges) for f in Workspace.__dataclass_fields__)
    assert not any("cache" in k for k in weights)
    _actions(policy)  # the calls write caches and workspace without touching the read-only weights


def test_file_is_plain_safetensors_with_aligned_tensors(tiny_checkpoint_dir: Path, tmp_path: Path):
    normal = load_checkpoint(tiny_checkpoint_dir)
    path = export_runtime_state(normal.model, tmp_path / "w.safetensors", {"format": sw.FORMAT})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % ALIGN == 0
    tensors = {k: h for k, h in header.items() if k != "__metadata__" and not k.startswith("__pad__.")}
    assert all(h["data_offsets"][0] % ALIGN == 0 for h in tensors.values())
    weights = weight_tensors(normal.model)
    with safe_open(str(path), framework="pt") as f:  # the reference reader accepts it as is
        assert f.metadata()["format"] == sw.FORMAT
        assert {k for k in f.keys() if not k.startswith("__pad__.")} == set(weights)
        for k, t in weights.items():
            assert torch.equal(f.get_tensor(k), t), k


# --------------------------------------------------------------------------- reuse and keys
def test_second_load_maps_the_existing_file(tiny_checkpoint_dir: Path, tmp_path: Path, reference, monkeypatch):
    first = Pi05Policy.from_checkpoint(tiny_checkpoint_dir, CAMS, share_weights=True, weights_cache_dir=tmp_path)
    path = first.shared_weights.path
    before = os.stat(path)

    def no_private_load(*a, **k):
        raise AssertionError("the shared file was valid: no normal load expected")

    monkeypatch.setattr(checkpoint_module, "load_checkpoint", no_private_load)  # the shared loader's build step
    second = Pi05Policy.from_checkpoint(tiny_checkpoint_dir, CAMS, share_weights=True, weights_cache_dir=tmp_path)
    after = os.stat(path)
    assert not second.shared_weights.built and second.shared_weights.path == path
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert torch.equal(_actions(second), reference[torch.float32])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.name + ".lock"])


def test_env_var_names_the_cache_dir(tiny_checkpoint_dir: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv(sw.CACHE_ENV, str(tmp_path / "env"))
    ck = load_checkpoint(tiny_checkpoint_dir, share_weights=True)
    assert ck.shared.path.parent == tmp_path / "env" and ck.shared.path.exists()


def test_key_covers_dtype_and_layout_version(tiny_checkpoint_dir: Path, tmp_path: Path, monkeypatch):
    f32, _ = _target(tiny_checkpoint_dir, tmp_path, torch.float32)
    bf16, _ = _target(tiny_checkpoint_dir, tmp_path, torch.bfloat16)
    assert f32 != bf16
    old = load_checkpoint(tiny_checkpoint_dir, share_weights=True, cache_dir=tmp_path).shared
    monkeypatch.setattr(sw, "RUNTIME_LAYOUT_VERSION", sw.RUNTIME_LAYOUT_VERSION + 1)
    new = load_checkpoint(tiny_checkpoint_dir, share_weights=True, cache_dir=tmp_path).shared
    assert new.built and new.path != old.path and old.path.exists()


def test_shared_weights_need_a_cpu_device(tiny_checkpoint_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="CPU"):
        load_checkpoint(tiny_checkpoint_dir, device="cuda", share_weights=True, cache_dir=tmp_path)


# --------------------------------------------------------------------------- stale / damaged files
def _truncate(path: Path, meta: dict, ckpt: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _garbage_header(path: Path, meta: dict, ckpt: Path) -> None:
    with path.open("r+b") as f:
        f.seek(8)
        f.write(b"\x00not json at all")


def _huge_header_length(path: Path, meta: dict, ckpt: Path) -> None:
    with path.open("r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))


def _other_checkpoint(path: Path, meta: dict, ckpt: Path) -> None:
    export_runtime_state(load_checkpoint(ckpt).model, path, meta | {"checkpoint_hash": "sha256:" + "0" * 64})


def _other_shapes(path: Path, meta: dict, ckpt: Path) -> None:
    from vla_runtime.models.pi05 import Pi05Model, init_random_

    other = init_random_(Pi05Model(preset("pi05-tiny").with_depths(vision=2, vlm=2)))
    export_runtime_state(other, path, meta)  # right key, wrong model (e.g. a changed fusion)


@pytest.mark.parametrize("damage", [_truncate, _garbage_header, _huge_header_length, _other_checkpoint, _other_shapes])
def test_damaged_or_stale_file_is_rebuilt(tiny_checkpoint_dir: Path, tmp_path: Path, reference, damage):
    path, meta = _target(tiny_checkpoint_dir, tmp_path)
    export_runtime_state(load_checkpoint(tiny_checkpoint_dir).model, path, meta)  # not mapped here
    damage(path, meta, tiny_checkpoint_dir)
    with pytest.warns(RuntimeWarning, match="rebuilding the shared weight file"):
        policy = Pi05Policy.from_checkpoint(tiny_checkpoint_dir, CAMS, share_weights=True, weights_cache_dir=tmp_path)
    assert policy.shared_weights.built and policy.shared_weights.path == path
    assert torch.equal(_actions(policy), reference[torch.float32])
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_leftover_of_a_killed_builder_is_removed(tiny_checkpoint_dir: Path, tmp_path: Path):
    path, _ = _target(tiny_checkpoint_dir, tmp_path)
    tmp_path.mkdir(exist_ok=True)
    leftover = tmp_path / f".{path.name}.abc123.tmp"
    leftover.write_bytes(b"half a model")
    ck = load_checkpoint(tiny_checkpoint_dir, share_weights=True, cache_dir=tmp_path)
    assert ck.shared.built and not leftover.exists()


def test_map_shared_refuses_a_mismatch_and_leaves_the_model_alone(tiny_checkpoint_dir: Path, tmp_path: Path):
    path, meta = _target(tiny_checkpoint_dir, tmp_path)
    export_runtime_state(load_checkpoint(tiny_checkpoint_dir).model, path, meta)
    other = runtime_skeleton(preset("pi05-tiny").with_depths(vision=2, vlm=2), torch.float32)
    with pytest.raises(SharedWeightsError, match=r"unexpected tensors \(41\): expert_layers\.2\.attn"):
        map_shared(other, path)
    assert all(t.is_meta for t in weight_tensors(other).values())
    skeleton = runtime_skeleton(load_checkpoint(tiny_checkpoint_dir).config, torch.bfloat16)
    with pytest.raises(SharedWeightsError, match="mismatched tensors"):
        map_shared(skeleton, path)
    with pytest.raises(SharedWeightsError, match="metadata checkpoint_hash"):
        map_shared(runtime_skeleton(load_checkpoint(tiny_checkpoint_dir).config, torch.float32), path,
                   expect_metadata=meta | {"checkpoint_hash": "sha256:other"})


def test_misaligned_foreign_file_is_copied_only_where_needed(tiny_checkpoint_dir: Path, tmp_path: Path, reference):
    """A safetensors file not written here, whose data start is 2 mod 4: fp32 tensors cannot be
    viewed in place, so they are copied (and reported); the model is still exact."""
    normal = load_checkpoint(tiny_checkpoint_dir)
    weights = weight_tensors(normal.model)
    header, blobs, pos = {}, [], 0
    for k, t in weights.items():
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    raw = json.dumps(header).encode()
    raw += b" " * ((2 - (8 + len(raw))) % 4)
    path = tmp_path / "foreign.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    model = runtime_skeleton(normal.config, torch.float32)
    info = map_shared(model, path)
    assert set(info.copied) == set(weights) and info.nbytes == 0
    model.setup_caches(1)
    policy = Pi05Policy.from_checkpoint(tiny_checkpoint_dir, CAMS)
    from vla_runtime.engine.dense import DenseEngine

    policy.engine = DenseEngine(model)
    assert torch.equal(_actions(policy), reference[torch.float32])


def test_copy_on_write_mapping_keeps_writes_private(tiny_checkpoint_dir: Path, tmp_path: Path):
    path, meta = _target(tiny_checkpoint_dir, tmp_path)
    export_runtime_state(load_checkpoint(tiny_checkpoint_dir).model, path, meta)
    cfg = load_checkpoint(tiny_checkpoint_dir).config
    writer, reader = runtime_skeleton(cfg, torch.float32), runtime_skeleton(cfg, torch.float32)
    assert map_shared(writer, path, copy_on_write=True).writable
    map_shared(reader, path)
    before = reader.projector.weight.clone()
    writer.projector.weight.add_(1.0)
    assert torch.equal(reader.projector.weight, before)
    assert torch.equal(writer.projector.weight, before + 1.0)
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("projector.weight"), before)


# --------------------------------------------------------------------------- concurrency
def test_concurrent_exports_never_expose_a_partial_file(tiny_checkpoint_dir: Path, tmp_path: Path):
    """Unlocked writers racing on one path (os.replace of complete temporary files): every
    state a reader can observe maps cleanly."""
    normal = load_checkpoint(tiny_checkpoint_dir)
    path, meta = _target(tiny_checkpoint_dir, tmp_path)
    export_runtime_state(normal.model, path, meta)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(10):
                export_runtime_state(normal.model, path, meta)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers) or reads == 0:
        map_shared(runtime_skeleton(normal.config, torch.float32), path, expect_metadata=meta)
        reads += 1
    for w in writers:
        w.join()
    assert not errors
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


_CHILD = r"""
import json, os, sys
import numpy as np, torch
torch.set_num_threads(1)
from vla_runtime.engine.policy import Observation, Pi05Policy
from vla_runtime.models.shared_weights import mapping_usage, weight_tensors

ckpt, cache = sys.argv[1], sys.argv[2]
print(json.dumps({"event": "started"}), flush=True)
sys.stdin.readline()  # go: all children start loading together
policy = Pi05Policy.from_checkpoint(ckpt, ["top", "wrist"], share_weights=True, weights_cache_dir=cache)
rng = np.random.default_rng(0)
obs = Observation(images={"top": rng.integers(0, 255, (48, 64, 3), dtype=np.uint8),
                          "wrist": rng.integers(0, 255, (30, 30, 3), dtype=np.uint8)},
                  state=np.array([0.1, -0.5, 0.3, 0.9], dtype=np.float32), task="pick up the red cube")
actions = policy.predict(obs, generator=torch.Generator().manual_seed(0)).engine.actions
# The normal (private) load in this same process and thread setting is the exactness reference.
private = Pi05Policy.from_checkpoint(ckpt, ["top", "wrist"])
exact = torch.equal(private.predict(obs, generator=torch.Generator().manual_seed(0)).engine.actions, actions)
del private
for t in weight_tensors(policy.engine.model).values():  # read every weight page, as a long run would
    float(t.float().sum())
info = policy.shared_weights
target = os.path.realpath(info.path)
inodes = sorted({int(l.split()[4]) for l in open("/proc/self/maps") if l.rstrip().endswith(" " + target)})
print(json.dumps({"event": "ready", "built": info.built, "inodes": inodes, "path": str(info.path),
                  "actions": actions.flatten().tolist(), "exact": exact}), flush=True)
sys.stdin.readline()  # report: every child is alive and has touched its weights
print(json.dumps({"event": "usage", **mapping_usage(info.path)}), flush=True)
sys.stdin.read()  # stay alive (and mapped) until the parent closes stdin
"""


class _Children:
    """Children running ``_CHILD`` driven line by line over stdin/stdout (stderr to files)."""

    def __init__(self, n: int, ckpt: Path, cache: Path, logs: Path):
        self.logs = [logs / f"child{i}.err" for i in range(n)]
        self.procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(ckpt), str(cache)], cwd=REPO,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                       text=True) for log in self.logs]

    def send(self, line: str = "\n") -> None:
        for p in self.procs:
            p.stdin.write(line)
            p.stdin.flush()

    def read(self, event: str) -> list[dict]:
        out = []
        for p, log in zip(self.procs, self.logs):
            line = p.stdout.readline()
            if not line:
                p.wait()
                raise AssertionError(f"child exited ({p.returncode}) before {event!r}:\n{log.read_text()[-3000:]}")
            msg = json.loads(line)
            assert msg["event"] == event, msg
            out.append(msg)
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=60)  # a guard against a hung child, not a timing assertion
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_two_processes_loading_at_once_build_once(tiny_checkpoint_dir: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    kids = _Children(2, tiny_checkpoint_dir, cache, tmp_path)
    try:
        kids.read("started")
        kids.send()  # go
        ready = kids.read("ready")
    finally:
        kids.close()
    assert all(p.returncode == 0 for p in kids.procs)
    assert sorted(r["built"] for r in ready) == [False, True]  # the lock: one builds, one maps
    assert ready[0]["inodes"] == ready[1]["inodes"] and len(ready[0]["inodes"]) == 1  # same file
    assert ready[0]["exact"] and ready[1]["exact"]  # each equals its own private load ...
    assert ready[0]["actions"] == ready[1]["actions"]  # ... and the other process
    path = Path(ready[0]["path"])
    assert sorted(p.name for p in cache.iterdir()) == sorted([path.name, path.name + ".lock"])


def test_two_processes_share_the_weight_pages(tiny_checkpoint_dir: Path, tmp_path: Path):
    """Both alive, both touched every weight: the file's resident pages are all shared, so each
    process's proportional share (Pss) of the mapping is half its resident size (Rss)."""
    cache = tmp_path / "cache"
    path, meta = _target(tiny_checkpoint_dir, cache)
    export_runtime_state(load_checkpoint(tiny_checkpoint_dir).model, path, meta)  # built, not mapped here
    gc.collect()
    assert not _mapped_ranges(path)
    kids = _Children(2, tiny_checkpoint_dir, cache, tmp_path)
    try:
        kids.read("started")
        kids.send()
        ready = kids.read("ready")
        kids.send()  # report
        usage = kids.read("usage")
    finally:
        kids.close()
    assert not any(r["built"] for r in ready)
    size = path.stat().st_size
    for u in usage:
        assert u["Rss"] >= 0.9 * size, u                      # the weights are resident ...
        assert u["Shared_Clean"] + u["Shared_Dirty"] == u["Rss"], u  # ... every page also in the other
        assert u["Private_Dirty"] == 0, u                      # nothing copied on write
        assert abs(2 * u["Pss"] - u["Rss"]) <= 0.01 * u["Rss"], u  # so each pays half
