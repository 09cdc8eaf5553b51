"""Reference repository: round trip, atomic writes, admission, and every refusal."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from vla_runtime.cache import repository as repo_mod
from vla_runtime.cache.repository import (
    FIELDS,
    EpisodeTensors,
    ReferenceCall,
    ReferenceRepository,
    RepositoryError,
    RepositoryMeta,
)

N_CAMS, S, LMAX, D, L, P, WV, G, DEPTH, K = 2, 8, 6, 4, 3, 4, 5, 2, 2, 3
HASH = "sha256:" + "a" * 64
MODEL = {"name": "pi05-tiny", "vision": {"depth": 4, "width": WV}, "expert_mlp": 16}


def make_meta(**kw) -> RepositoryMeta:
    args = dict(checkpoint_hash=HASH, model=MODEL, retrieval_layer=2, rho_n=0.2,
                mask_groups=[[0, 5], [5, 10]], history_len=L)
    args.update(kw)
    return RepositoryMeta(**args)


def make_call(g: torch.Generator) -> ReferenceCall:
    return ReferenceCall(
        images=torch.randint(0, 256, (N_CAMS, S, S, 3), generator=g, dtype=torch.uint8),
        image_mask=torch.tensor([True, False]),
        tokens=torch.randint(0, 300, (LMAX,), generator=g),
        token_mask=torch.arange(LMAX) < 4,
        state=torch.randn(D, generator=g),
        state_history=torch.randn(L, D, generator=g),
        retrieval=torch.randn(N_CAMS * P, WV, generator=g).half(),
        masks=torch.randint(0, 16, (G, DEPTH, K), generator=g, dtype=torch.int32),
    )


def make_calls(n: int, seed: int) -> list[ReferenceCall]:
    g = torch.Generator().manual_seed(seed)
    return [make_call(g) for _ in range(n)]


def assert_call_equal(a: ReferenceCall, b: ReferenceCall) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, dict[str, list[ReferenceCall]]]:
    root = tmp_path / "repo"
    repo = ReferenceRepository.create(root, make_meta())
    calls = {"ep0": make_calls(3, 0), "ep1": make_calls(5, 1)}
    repo.add_episode("ep0", "pick cube", calls["ep0"], source="bags/ep0")
    repo.add_episode("ep1", "pick cube", calls["ep1"], source="bags/ep1")
    return root, calls


# ----------------------------------------------------------------------------- round trip


def test_round_trip(built):
    root, calls = built
    repo = ReferenceRepository.open(root, expect_checkpoint_hash=HASH, expect_model=MODEL)
    assert repo.tasks() == ["pick cube"]
    assert [r.episode_id for r in repo.episodes("pick cube")] == ["ep0", "ep1"]
    rec = repo.episode("ep1")
    assert (rec.num_calls, rec.source, rec.admitted_online) == (5, "bags/ep1", False)
    assert rec.bytes == (root / rec.file).stat().st_size
    assert repo.meta.mask_groups == [[0, 5], [5, 10]] and repo.meta.history_len == L

    ep = repo.load_episode("ep1")
    assert isinstance(ep, EpisodeTensors) and ep.num_calls == 5 and ep.task == "pick cube"
    for i, c in enumerate(calls["ep1"]):
        assert_call_equal(ep.call(i), c)
        assert_call_equal(repo.load_call("ep1", i), c)

    keys, feats = repo.retrieval_matrix("pick cube")
    assert keys == [("ep0", i) for i in range(3)] + [("ep1", i) for i in range(5)]
    assert feats.dtype == torch.float16 and feats.shape == (8, N_CAMS * P * WV)
    assert torch.equal(feats[3 + 2], calls["ep1"][2].retrieval.flatten())
    _, hist = repo.state_histories("pick cube")
    assert hist.shape == (8, L, D) and torch.equal(hist[1], calls["ep0"][1].state_history)

    nb = repo.nbytes_per_call()
    assert nb["images"] == N_CAMS * S * S * 3 and nb["retrieval"] == N_CAMS * P * WV * 2
    assert nb["masks"] == G * DEPTH * K * 4 and nb["total"] == sum(v for k, v in nb.items() if k != "total")


def test_files_readable_without_our_code(built):
    root, calls = built
    index = json.loads((root / "index.json").read_text())
    assert index["format"] == "vla_runtime.reference_repository" and index["format_version"] == 1
    assert index["checkpoint_hash"] == HASH and index["tasks"] == {"pick cube": ["ep0", "ep1"]}
    assert index["call_layout"]["retrieval"] == {"dtype": "float16", "shape": [N_CAMS * P, WV]}
    rec = index["episodes"]["ep0"]
    tensors = safetensors.torch.load_file(root / rec["file"])
    assert tensors["masks"].shape == (3, G, DEPTH, K) and tensors["masks"].dtype == torch.int32
    assert torch.equal(tensors["state"][2], calls["ep0"][2].state)
    from safetensors import safe_open
    with safe_open(root / rec["file"], "pt") as f:
        assert f.metadata()["episode_id"] == "ep0" and f.metadata()["task"] == "pick cube"


def test_load_call_reads_only_a_slice(built, monkeypatch):
    root, calls = built
    repo = ReferenceRepository.open(root)

    def forbidden(*a, **k):
        raise AssertionError("load_call must not read the whole file")

    monkeypatch.setattr(safetensors.torch, "load_file", forbidden)
    monkeypatch.setattr(safetensors.torch, "load", forbidden)
    assert_call_equal(repo.load_call("ep0", 1), calls["ep0"][1])
    with pytest.raises(IndexError):
        repo.load_call("ep0", 3)


def test_remove_episode(built):
    root, _ = built
    repo = ReferenceRepository.open(root)
    path = root / repo.episode("ep0").file
    repo.remove_episode("ep0")
    assert not path.exists()
    reopened = ReferenceRepository.open(root)
    assert [r.episode_id for r in reopened.episodes()] == ["ep1"]
    reopened.remove_episode("ep1")
    reopened = ReferenceRepository.open(root)
    assert reopened.tasks() == [] and reopened.call_layout is None and reopened.nbytes_per_call() == {}


# ----------------------------------------------------------------------------- writing rules


def test_create_refuses_non_empty_dir(built):
    root, _ = built
    with pytest.raises(RepositoryError, match="non-empty"):
        ReferenceRepository.create(root, make_meta())


def test_add_refuses_bad_episodes(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    with pytest.raises(RepositoryError, match="episode id"):
        repo.add_episode("../evil", "t", make_calls(1, 0))
    with pytest.raises(RepositoryError, match="history_len"):
        c = make_calls(1, 0)[0]
        c.state_history = torch.zeros(L + 1, D)
        repo.add_episode("e", "t", [c])
    with pytest.raises(RepositoryError, match="mask_groups"):
        c = make_calls(1, 0)[0]
        c.masks = torch.zeros(G + 1, DEPTH, K, dtype=torch.int32)
        repo.add_episode("e", "t", [c])
    repo.add_episode("e", "t", make_calls(2, 0))
    with pytest.raises(RepositoryError, match="already exists"):
        repo.add_episode("e", "t", make_calls(2, 0))
    g = torch.Generator().manual_seed(0)
    other = make_call(g)
    other.tokens, other.token_mask = torch.zeros(LMAX + 1, dtype=torch.int64), torch.ones(LMAX + 1, dtype=torch.bool)
    with pytest.raises(RepositoryError, match="per-call shapes differ"):
        repo.add_episode("f", "t", [other])


def test_reference_call_validated_at_construction():
    c = make_calls(1, 0)[0]
    fields = {name: getattr(c, name) for name in FIELDS}
    with pytest.raises(RepositoryError, match="retrieval must be a non-empty torch.float16"):
        ReferenceCall(**{**fields, "retrieval": fields["retrieval"].float()})
    with pytest.raises(RepositoryError, match="image_mask"):
        ReferenceCall(**{**fields, "image_mask": torch.ones(3, dtype=torch.bool)})


def test_meta_validated():
    with pytest.raises(RepositoryError, match="mask_groups"):
        make_meta(mask_groups=[[0, 5], [6, 10]])
    with pytest.raises(RepositoryError, match="rho_n"):
        make_meta(rho_n=0.0)


def test_index_unchanged_when_episode_write_fails(built, monkeypatch):
    root, _ = built
    repo = ReferenceRepository.open(root)
    before = (root / "index.json").read_bytes()
    real = repo_mod._atomic_write

    def failing(path, data):
        if path.suffix == ".safetensors":
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(repo_mod, "_atomic_write", failing)
    with pytest.raises(OSError, match="disk full"):
        repo.add_episode("ep2", "pick cube", make_calls(2, 2))
    assert (root / "index.json").read_bytes() == before
    assert not (root / "episodes" / "ep2.safetensors").exists()
    assert "ep2" not in [r.episode_id for r in repo.episodes()]


def test_index_write_failure_rolls_back(built, monkeypatch):
    root, _ = built
    repo = ReferenceRepository.open(root)
    before = (root / "index.json").read_bytes()
    real_replace = repo_mod.os.replace

    def failing_replace(src, dst):
        if Path(dst).name == "index.json":
            raise OSError("crash during index rename")
        real_replace(src, dst)

    monkeypatch.setattr(repo_mod.os, "replace", failing_replace)
    with pytest.raises(OSError, match="crash"):
        repo.add_episode("ep2", "pick cube", make_calls(2, 2))
    monkeypatch.undo()
    assert (root / "index.json").read_bytes() == before
    assert not (root / "episodes" / "ep2.safetensors").exists()
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name]
    assert [r.episode_id for r in repo.episodes()] == ["ep0", "ep1"]
    ReferenceRepository.open(root)                       # still valid


# ----------------------------------------------------------------------------- admission


def test_admit_evicts_oldest_online_then_oldest(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    repo.add_episode("off0", "t", make_calls(2, 0))
    repo.add_episode("off1", "t", make_calls(2, 1))
    repo.add_episode("other", "u", make_calls(2, 2))
    assert repo.admit("on0", "t", make_calls(2, 3), max_episodes_per_task=4) == []
    assert repo.admit("on1", "t", make_calls(2, 4), max_episodes_per_task=4) == []
    assert repo.admit("on2", "t", make_calls(2, 5), max_episodes_per_task=4) == ["on0"]
    assert repo.admit("on3", "t", make_calls(2, 6), max_episodes_per_task=2) == ["on1", "on2", "off0"]
    assert repo.admit("on4", "t", make_calls(2, 7), max_episodes_per_task=1) == ["on3", "off1"]
    reopened = ReferenceRepository.open(tmp_path / "r")
    assert [r.episode_id for r in reopened.episodes("t")] == ["on4"]
    assert reopened.episode("on4").admitted_online
    assert [r.episode_id for r in reopened.episodes("u")] == ["other"]       # other tasks untouched
    assert sorted(p.name for p in (tmp_path / "r" / "episodes").iterdir()) == ["on4.safetensors", "other.safetensors"]


def test_admit_byte_bound(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    size = repo.add_episode("a", "t", make_calls(2, 0)).bytes
    repo.add_episode("b", "t", make_calls(2, 1))
    evicted = repo.admit("c", "t", make_calls(2, 2), max_episodes_per_task=10, max_bytes=2 * size + 10)
    assert evicted == ["a"]
    with pytest.raises(RepositoryError, match="max_bytes"):
        repo.admit("d", "t", make_calls(2, 3), max_episodes_per_task=10, max_bytes=size // 2)
    assert [r.episode_id for r in repo.episodes("t")] == ["b", "c"]


# ----------------------------------------------------------------------------- refusals


def test_refuses_checkpoint_hash_mismatch(built):
    root, _ = built
    other = "sha256:" + "b" * 64
    with pytest.raises(RepositoryError, match=f"built for {HASH}, the loaded checkpoint is {other}"):
        ReferenceRepository.open(root, expect_checkpoint_hash=other)


def test_refuses_model_mismatch(built):
    root, _ = built
    with pytest.raises(RepositoryError, match=r"model summary mismatch: 'vision.depth' repository=4 loaded=27"):
        ReferenceRepository.open(root, expect_model={**MODEL, "vision": {"depth": 27, "width": WV}})


def _edit_index(root: Path, fn) -> None:
    index = json.loads((root / "index.json").read_text())
    fn(index)
    (root / "index.json").write_text(json.dumps(index))


def test_refuses_bad_index(built, tmp_path):
    root, _ = built
    with pytest.raises(RepositoryError, match="missing"):
        ReferenceRepository.open(tmp_path / "nowhere")
    _edit_index(root, lambda ix: ix.update(format_version=2))
    with pytest.raises(RepositoryError, match="format_version"):
        ReferenceRepository.open(root)
    _edit_index(root, lambda ix: ix.update(format_version=1, format="something.else"))
    with pytest.raises(RepositoryError, match="'format'"):
        ReferenceRepository.open(root)
    _edit_index(root, lambda ix: ix.update(format="vla_runtime.reference_repository", rho_n="half"))
    with pytest.raises(RepositoryError, match="rho_n"):
        ReferenceRepository.open(root)
    _edit_index(root, lambda ix: ix.update(rho_n=0.2, mask_groups=None))
    with pytest.raises(RepositoryError, match="mask_groups"):
        ReferenceRepository.open(root)
    _edit_index(root, lambda ix: ix.update(mask_groups=[[0, 5], [5, 10]], tasks={"pick cube": ["ep0"]}))
    with pytest.raises(RepositoryError, match="ep1.*not listed"):
        ReferenceRepository.open(root)
    (root / "index.json").write_text('{"format": "vla_runtime.reference_rep')
    with pytest.raises(RepositoryError, match="not valid JSON"):
        ReferenceRepository.open(root)


def test_refuses_missing_episode_file(built):
    root, _ = built
    (root / "episodes" / "ep1.safetensors").unlink()
    with pytest.raises(RepositoryError, match="ep1.*missing"):
        ReferenceRepository.open(root)


def test_refuses_flipped_byte(built):
    root, _ = built
    path = root / "episodes" / "ep0.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(RepositoryError, match="sha256 mismatch"):
        ReferenceRepository.open(root)
    ReferenceRepository.open(root, verify=False)       # same size, valid header: only the hash can tell


def test_refuses_truncated_file_without_verify(built):
    root, _ = built
    path = root / "episodes" / "ep1.safetensors"
    repo = ReferenceRepository.open(root, verify=False)
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(RepositoryError, match="ep1"):
        ReferenceRepository.open(root, verify=False)
    # Damaged after open: loading still fails with a RepositoryError, not a crash.
    with pytest.raises(RepositoryError, match="ep1"):
        repo.load_call("ep1", 4)
    with pytest.raises(RepositoryError, match="ep1"):
        repo.load_episode("ep1")
    # Even with the index patched to the new size, the header no longer covers the file.
    _edit_index(root, lambda ix: ix["episodes"]["ep1"].update(bytes=len(data) - 7))
    with pytest.raises(RepositoryError, match="truncated or corrupt"):
        ReferenceRepository.open(root, verify=False)


def _rewrite_episode(root: Path, eid: str, change) -> None:
    """Replace an episode file with altered tensors and make the index agree on size and hash."""
    path = root / "episodes" / f"{eid}.safetensors"
    tensors = safetensors.torch.load_file(path)
    change(tensors)
    data = safetensors.torch.save(tensors, metadata={"episode_id": eid, "task": "pick cube"})
    path.write_bytes(data)
    import hashlib
    _edit_index(root, lambda ix: ix["episodes"][eid].update(
        bytes=len(data), sha256="sha256:" + hashlib.sha256(data).hexdigest()))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(retrieval=t["retrieval"].float()), "'retrieval' is F32"),
    (lambda t: t.update(masks=t["masks"].long()), "'masks' is I64"),
    (lambda t: t.update(state=t["state"][:, :-1].contiguous()), r"'state' is F32 \[5, 3\]"),
    (lambda t: t.update(tokens=t["tokens"][:4].contiguous()), r"'tokens' is I64 \[4, 6\], expected I64 \[5, 6\]"),
    (lambda t: t.pop("image_mask"), "expected"),
])
def test_refuses_bad_tensors(built, change, message):
    root, _ = built
    _rewrite_episode(root, "ep1", change)
    with pytest.raises(RepositoryError, match=message):
        ReferenceRepository.open(root)


def test_refuses_corrupt_header(built):
    root, _ = built
    path = root / "episodes" / "ep0.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8:8 + n] = b"{" + b" " * (n - 1)
    path.write_bytes(bytes(data))
    with pytest.raises(RepositoryError, match="corrupt safetensors header"):
        ReferenceRepository.open(root, verify=False)


# ----------------------------------------------------------------------------- half timing


def _half_timing():
    from vla_runtime.cache.halves import HalfTiming, PhaseTiming

    return HalfTiming(PhaseTiming(0.02, 0.025, 6), PhaseTiming(0.03, 0.02, 6), device="cpu", threads=2,
                      dtype="float32", rho_p=0.4, rho_n=0.2, calls=2, repeats=3)


def test_half_timing_is_recorded_and_read_back(built, tmp_path):
    root, _ = built
    repo = ReferenceRepository.open(root)
    assert repo.meta.half_timing is None                 # not measured
    timing = _half_timing()
    repo.record_half_timing(timing)
    again = ReferenceRepository.open(root)
    assert again.meta.half_timing == timing
    assert json.loads((root / "index.json").read_text())["half_timing"]["action_cache"]["speedup"] == pytest.approx(1.5)
    # given at creation it is written with the index
    made = ReferenceRepository.create(tmp_path / "other", make_meta(half_timing=timing))
    assert ReferenceRepository.open(made.root).meta.half_timing == timing


def test_a_repository_written_before_the_half_timing_opens_as_not_measured(built):
    root, calls = built
    _edit_index(root, lambda ix: ix.pop("half_timing"))
    repo = ReferenceRepository.open(root)
    assert repo.meta.half_timing is None
    assert_call_equal(repo.load_call("ep1", 4), calls["ep1"][4])


def test_a_damaged_half_timing_is_refused_by_field(built):
    root, _ = built
    bad = _half_timing().as_dict()
    bad["context_cache"]["dense_s"] = "fast"
    _edit_index(root, lambda ix: ix.update(half_timing=bad))
    with pytest.raises(RepositoryError, match=r"index.json: field 'half_timing'.context_cache.dense_s: must be a "
                                              r"positive number"):
        ReferenceRepository.open(root)
    with pytest.raises(RepositoryError, match="half_timing"):
        make_meta(half_timing={"context_cache": {}})
