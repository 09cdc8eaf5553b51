"""Reference repository: round trip, atomic writes, admission, and every refusal."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from vla_runtime.cache import repository as repo_mod
from vla_runtime.cache.repository import (
    FIELDS,
    EpisodeRecord,
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
    assert isinstance(ep, EpisodeTensors) and (ep.episode_id, ep.num_calls, ep.task) == ("ep1", 5, "pick cube")
    for i, c in enumerate(calls["ep1"]):
        assert_call_equal(ep.call(i), c)
        assert_call_equal(repo.load_call("ep1", i), c)

    keys, feats = repo.retrieval_matrix("pick cube")
    assert keys == [("ep0", i) for i in range(3)] + [("ep1", i) for i in range(5)]
    assert feats.dtype == torch.float16 and feats.shape == (8, N_CAMS * P * WV)
    assert torch.equal(feats[3 + 2], calls["ep1"][2].retrieval.flatten())
    hist_keys, hist = repo.state_histories("pick cube")
    assert hist_keys == keys and hist.shape == (8, L, D) and torch.equal(hist[1], calls["ep0"][1].state_history)

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


def fails_leaving_the_index(root: Path, monkeypatch, write, message: str) -> None:
    """``write``, with a failure patched in, raises exactly ``message``; index.json is left byte for byte."""
    before = (root / "index.json").read_bytes()
    with pytest.raises(OSError, match=f"^{re.escape(message)}$"):
        write()
    monkeypatch.undo()
    assert (root / "index.json").read_bytes() == before


def test_index_unchanged_when_episode_write_fails(built, monkeypatch):
    root, _ = built
    repo = ReferenceRepository.open(root)
    real = repo_mod._atomic_write

    def failing(path, data):
        if path.suffix == ".safetensors":
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(repo_mod, "_atomic_write", failing)
    fails_leaving_the_index(root, monkeypatch, lambda: repo.add_episode("ep2", "pick cube", make_calls(2, 2)),
                            "disk full")
    assert not (root / "episodes" / "ep2.safetensors").exists()
    assert "ep2" not in [r.episode_id for r in repo.episodes()]


def fail_index_rename(monkeypatch) -> None:
    """Make the rename that commits index.json fail (a crash at the commit point)."""
    real_replace = repo_mod.os.replace

    def failing_replace(src, dst):
        if Path(dst).name == "index.json":
            raise OSError("crash during index rename")
        real_replace(src, dst)

    monkeypatch.setattr(repo_mod.os, "replace", failing_replace)


def test_index_write_failure_rolls_back(built, monkeypatch):
    root, _ = built
    repo = ReferenceRepository.open(root)
    fail_index_rename(monkeypatch)
    fails_leaving_the_index(root, monkeypatch, lambda: repo.add_episode("ep2", "pick cube", make_calls(2, 2)),
                            "crash during index rename")
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
    with refused(RepositoryError, f"{_where(root)}: file is missing"):
        ReferenceRepository.open(root)


def test_refuses_flipped_byte(built):
    root, _ = built
    path = root / "episodes" / "ep0.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    recorded = json.loads((root / "index.json").read_text())["episodes"]["ep0"]["sha256"]
    with refused(RepositoryError, f"{_where(root, 'ep0')}: sha256 mismatch (index.json {recorded}, file "
                                  f"sha256:{hashlib.sha256(bytes(data)).hexdigest()}); the file is damaged or was "
                                  f"modified"):
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
    # it is part of the schema check: refused before the checkpoint is compared
    with pytest.raises(RepositoryError, match=r"index.json: field 'half_timing'.context_cache.dense_s: must be a "
                                              r"positive number"):
        ReferenceRepository.open(root, expect_checkpoint_hash="sha256:" + "b" * 64)
    with pytest.raises(RepositoryError, match="half_timing"):
        make_meta(half_timing={"context_cache": {}})


# ----------------------------------------------------------------------------- exact refusals


def refused(exc: type[BaseException], message: str):
    """``pytest.raises`` for exactly ``message``: a refusal names the value at fault, in full."""
    return pytest.raises(exc, match=f"^{re.escape(message)}$")


def refused_from(exc: type[BaseException], start: str):
    """The same for a message whose tail is a library's own wording (a decoder's error text)."""
    return pytest.raises(exc, match=f"^{re.escape(start)}")


def one_call(**change) -> ReferenceCall:
    """A call of the test's shapes with some fields replaced (validated as it is built)."""
    fields_ = {name: getattr(make_calls(1, 0)[0], name) for name in FIELDS}
    return ReferenceCall(**{**fields_, **change})


def tiny_call(value: int) -> ReferenceCall:
    """The smallest valid call: every field of one element per dimension."""
    return ReferenceCall(
        images=torch.full((1, 1, 1, 3), value, dtype=torch.uint8), image_mask=torch.tensor([True]),
        tokens=torch.tensor([value]), token_mask=torch.tensor([True]), state=torch.tensor([float(value)]),
        state_history=torch.tensor([[float(value)]]), retrieval=torch.tensor([[float(value)]]).half(),
        masks=torch.tensor([[[value]]], dtype=torch.int32))


# ----------------------------------------------------------------------------- ReferenceCall


_SHAPES = {"images": (N_CAMS, S, S, 3), "image_mask": (N_CAMS,), "tokens": (LMAX,), "token_mask": (LMAX,),
           "state": (D,), "state_history": (L, D), "retrieval": (N_CAMS * P, WV), "masks": (G, DEPTH, K)}


@pytest.mark.parametrize("name", list(FIELDS))
def test_each_field_refuses_another_dtype_rank_or_no_elements(name):
    dtype, _, rank = FIELDS[name]
    good = getattr(make_calls(1, 0)[0], name)
    with refused(RepositoryError, f"ReferenceCall.{name} must be a non-empty {dtype} with {rank} dims, "
                                  f"got torch.float64 {tuple(good.shape)}"):
        one_call(**{name: good.double()})
    with refused(RepositoryError, f"ReferenceCall.{name} must be a non-empty {dtype} with {rank} dims, "
                                  f"got {dtype} {(1, *good.shape)}"):
        one_call(**{name: good.unsqueeze(0)})
    empty = torch.zeros((0,) + tuple(good.shape[1:]), dtype=dtype)
    with refused(RepositoryError, f"ReferenceCall.{name} must be a non-empty {dtype} with {rank} dims, "
                                  f"got {dtype} {tuple(empty.shape)}"):
        one_call(**{name: empty})
    with refused(RepositoryError, f"ReferenceCall.{name} must be a torch.Tensor, got ndarray"):
        one_call(**{name: good.numpy()})


@pytest.mark.parametrize("change, message", [
    (dict(images=torch.zeros(N_CAMS, S, S, 4, dtype=torch.uint8)), "ReferenceCall.images must be [N_cams, S, S, 3], "
                                                                     "got (2, 8, 8, 4)"),
    (dict(images=torch.zeros(N_CAMS, S, S - 1, 3, dtype=torch.uint8)), "ReferenceCall.images must be "
                                                                         "[N_cams, S, S, 3], got (2, 8, 7, 3)"),
    (dict(image_mask=torch.ones(3, dtype=torch.bool)), "ReferenceCall.image_mask has 3 cameras, images 2"),
    (dict(token_mask=torch.ones(LMAX + 1, dtype=torch.bool)), "ReferenceCall.token_mask must be shaped like tokens"),
    (dict(state_history=torch.zeros(L, D + 1)), "ReferenceCall.state_history must be [L, 4], got (3, 5)"),
    (dict(retrieval=torch.zeros(N_CAMS * P + 1, WV, dtype=torch.float16)),
     "ReferenceCall.retrieval rows (9) must be N_cams * P with N_cams = 2"),
])
def test_call_shapes_that_disagree_are_refused_by_name(change, message):
    with refused(RepositoryError, message):
        one_call(**change)


def test_the_smallest_call_round_trips_through_a_repository(tmp_path):
    # every dimension 1 (one camera of 1x1 pixels, one token, one joint, one history row, one group)
    repo = ReferenceRepository.create(tmp_path / "r", make_meta(mask_groups=[[0, 10]], history_len=1))
    calls = [tiny_call(0)]
    assert calls[0].layout() == {"images": [1, 1, 1, 3], "image_mask": [1], "tokens": [1], "token_mask": [1],
                                 "state": [1], "state_history": [1, 1], "retrieval": [1, 1], "masks": [1, 1, 1]}
    repo.add_episode("one", "t", calls)
    again = ReferenceRepository.open(tmp_path / "r")
    assert again.episode("one").num_calls == 1
    assert_call_equal(again.load_call("one", 0), calls[0])
    assert again.nbytes_per_call() == {"images": 3, "image_mask": 1, "tokens": 8, "token_mask": 1, "state": 4,
                                       "state_history": 4, "retrieval": 2, "masks": 4, "total": 27}


def test_layout_lists_every_field_in_file_order():
    layout = make_calls(1, 0)[0].layout()
    assert list(layout) == list(FIELDS)
    assert layout == {name: list(shape) for name, shape in _SHAPES.items()}


def test_episode_record_defaults():
    rec = EpisodeRecord("e", "t", 1, "episodes/e.safetensors", "sha256:0", 10)
    assert (rec.source, rec.admitted_online, rec.added) == ("", False, "")


# ----------------------------------------------------------------------------- RepositoryMeta


def _meta_message(name: str, want: str, value: object) -> str:
    return f"RepositoryMeta: field '{name}' must be {want}, got {value!r}"


_GROUPS = "contiguous [start, end) step ranges starting at 0, e.g. [[0, 5], [5, 10]]"


@pytest.mark.parametrize("name, value, want", [
    ("checkpoint_hash", "", "a non-empty string such as 'sha256:...'"),
    ("checkpoint_hash", 5, "a non-empty string such as 'sha256:...'"),
    ("model", ["a"], "a dict"),
    ("retrieval_layer", 0, "a positive int"),
    ("retrieval_layer", True, "a positive int"),
    ("retrieval_layer", 2.0, "a positive int"),
    ("rho_n", 0.0, "a number in (0, 1]"),
    ("rho_n", 1.0000001, "a number in (0, 1]"),
    ("rho_n", float("nan"), "a number in (0, 1]"),
    ("rho_n", float("inf"), "a number in (0, 1]"),
    ("rho_n", True, "a number in (0, 1]"),
    ("rho_n", "0.5", "a number in (0, 1]"),
    ("history_len", 0, "a positive int"),
    ("history_len", False, "a positive int"),
    ("format_version", 2, "1"),
    ("mask_groups", [], "a non-empty list of [start, end) step ranges"),
    ("mask_groups", "0:5", "a non-empty list of [start, end) step ranges"),
    ("mask_groups", [[1, 5]], _GROUPS),
    ("mask_groups", [[0, 5], [6, 10]], _GROUPS),
    ("mask_groups", [[0, 5], [5, 5]], _GROUPS),
    ("mask_groups", [[0, 5], [5, 3]], _GROUPS),
    ("mask_groups", [[0, 5, 10]], _GROUPS),
    ("mask_groups", [[0]], _GROUPS),
    ("mask_groups", [[0, 5.0]], _GROUPS),
    ("mask_groups", [[False, 5]], _GROUPS),
    ("mask_groups", [[0, 5], None], _GROUPS),
    ("mask_groups", [[0, 5], "ab"], _GROUPS),
    ("half_timing", {"context_cache": {}}, "None or a HalfTiming"),
])
def test_meta_refusals_name_the_field_and_value(name, value, want):
    with refused(RepositoryError, _meta_message(name, want, value)):
        make_meta(**{name: value})


def test_meta_refuses_a_model_json_cannot_write():
    with refused(RepositoryError, "RepositoryMeta: field 'model' must be JSON-serialisable "
                                  "(Object of type object is not JSON serializable)"):
        make_meta(model={"x": object()})


def test_meta_accepts_the_boundaries_and_stores_groups_as_lists():
    m = make_meta(retrieval_layer=1, rho_n=1.0, history_len=1, mask_groups=((0, 1), (1, 3)))
    assert m.mask_groups == [[0, 1], [1, 3]] and all(type(g) is list for g in m.mask_groups)
    assert make_meta(rho_n=1).rho_n == 1 and make_meta(mask_groups=[[0, 1]]).mask_groups == [[0, 1]]
    assert (m.format_version, m.half_timing) == (1, None)


# ----------------------------------------------------------------------------- create


def test_create_writes_every_index_field(tmp_path, monkeypatch):
    times = iter(f"2026-01-01T00:00:{i:02d}+00:00" for i in range(60))
    monkeypatch.setattr(repo_mod, "_now", lambda: next(times))
    model = {"name": "pi05-tiny", "sizes": (1, 2)}          # a tuple is stored as JSON writes it
    meta = make_meta(model=model, rho_n=1, mask_groups=((0, 5), (5, 10)), half_timing=_half_timing())
    ReferenceRepository.create(tmp_path / "a" / "b", meta)  # parents created
    index = json.loads((tmp_path / "a" / "b" / "index.json").read_text())
    assert index == {
        "format": "vla_runtime.reference_repository", "format_version": 1, "checkpoint_hash": HASH,
        "model": {"name": "pi05-tiny", "sizes": [1, 2]}, "retrieval_layer": 2, "rho_n": 1.0,
        "mask_groups": [[0, 5], [5, 10]], "history_len": L, "half_timing": _half_timing().as_dict(),
        "created": "2026-01-01T00:00:00+00:00", "updated": "2026-01-01T00:00:00+00:00", "call_layout": None,
        "tasks": {}, "episodes": {}}
    assert '"rho_n": 1.0' in (tmp_path / "a" / "b" / "index.json").read_text()
    assert (tmp_path / "a" / "b" / "episodes").is_dir()
    model["name"] = "changed"                                 # the index kept its own copy
    assert ReferenceRepository.open(tmp_path / "a" / "b").meta.model["name"] == "pi05-tiny"


def test_create_in_an_empty_directory_and_never_over_a_file(tmp_path):
    (tmp_path / "empty").mkdir()
    ReferenceRepository.create(tmp_path / "empty", make_meta())
    assert ReferenceRepository.open(tmp_path / "empty").tasks() == []
    (tmp_path / "file").write_text("x")
    with refused(RepositoryError, f"{tmp_path / 'file'}: refusing to create a repository in a non-empty location"):
        ReferenceRepository.create(tmp_path / "file", make_meta())


def test_times_are_utc_iso_seconds(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    rec = repo.add_episode("e", "t", make_calls(1, 0))
    index = json.loads((tmp_path / "r" / "index.json").read_text())
    for stamp in (index["created"], index["updated"], rec.added):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", stamp), stamp


# ----------------------------------------------------------------------------- records written


def test_every_record_field_is_written_and_read_back(tmp_path, monkeypatch):
    times = iter(f"2026-01-01T00:00:{i:02d}+00:00" for i in range(60))
    monkeypatch.setattr(repo_mod, "_now", lambda: next(times))
    root = tmp_path / "r"
    repo = ReferenceRepository.create(root, make_meta())                     # :00
    a = repo.add_episode("a", "t", make_calls(2, 0), source=Path("bags/a"))  # added :01, updated :02
    b = repo.add_episode("b", "t", make_calls(1, 1), admitted_online=1)       # :03, :04
    c = repo.add_episode("c", "u", make_calls(3, 2))                          # :05, :06
    for rec, eid, task, n, source, online, added in ((a, "a", "t", 2, "bags/a", False, ":01"),
                                                     (b, "b", "t", 1, "", True, ":03"),
                                                     (c, "c", "u", 3, "", False, ":05")):
        data = (root / "episodes" / f"{eid}.safetensors").read_bytes()
        want = {"task": task, "num_calls": n, "file": f"episodes/{eid}.safetensors",
                "sha256": "sha256:" + hashlib.sha256(data).hexdigest(), "bytes": len(data), "source": source,
                "admitted_online": online, "added": f"2026-01-01T00:00{added}+00:00"}
        assert type(rec.admitted_online) is bool and type(rec.source) is str
        assert {k: v for k, v in vars(rec).items() if k != "episode_id"} == want
        assert json.loads((root / "index.json").read_text())["episodes"][eid] == want
        assert vars(ReferenceRepository.open(root).episode(eid)) == {"episode_id": eid, **want}
        with safe_open(root / want["file"], "pt") as f:
            assert f.metadata() == {"episode_id": eid, "task": task, "format": "vla_runtime.reference_repository"}
    index = json.loads((root / "index.json").read_text())
    assert (index["created"], index["updated"]) == ("2026-01-01T00:00:00+00:00", "2026-01-01T00:00:06+00:00")
    assert index["tasks"] == {"t": ["a", "b"], "u": ["c"]}
    assert index["call_layout"] == {name: {"dtype": str(FIELDS[name][0]).removeprefix("torch."), "shape": shape}
                                    for name, shape in make_calls(1, 0)[0].layout().items()}
    assert index["call_layout"]["images"]["dtype"] == "uint8" and index["call_layout"]["masks"]["dtype"] == "int32"
    repo.record_half_timing(_half_timing())                                   # :07
    assert json.loads((root / "index.json").read_text())["updated"] == "2026-01-01T00:00:07+00:00"
    assert repo.meta.half_timing == _half_timing()
    repo.remove_episode("c")                                                  # :08
    index = json.loads((root / "index.json").read_text())
    assert index["updated"] == "2026-01-01T00:00:08+00:00" and index["tasks"] == {"t": ["a", "b"]}
    assert repo.tasks() == ["t"] and "c" not in index["episodes"]


def test_record_half_timing_refuses_anything_else(built):
    root, _ = built
    repo = ReferenceRepository.open(root)
    with refused(RepositoryError, f"{root}: half_timing must be a HalfTiming, got dict"):
        repo.record_half_timing(_half_timing().as_dict())


def test_a_stored_tensor_that_required_grad_is_saved_detached(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    call = make_calls(1, 0)[0]
    call.state = call.state.clone().requires_grad_(True)
    repo.add_episode("e", "t", [call])
    loaded = ReferenceRepository.open(tmp_path / "r").load_call("e", 0)
    assert torch.equal(loaded.state, call.state.detach()) and not loaded.state.requires_grad


# ----------------------------------------------------------------------------- episode refusals


@pytest.mark.parametrize("eid", [5, "", "-a", ".a", "a/b", "a b", "a" * 129, "ä"])
def test_episode_ids_that_cannot_name_a_file_are_refused(tmp_path, eid):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    with refused(RepositoryError, f"episode id {eid!r} must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$ "
                                  f"(it names a file)"):
        repo.add_episode(eid, "t", make_calls(1, 0))


def test_episode_ids_up_to_128_characters_of_the_allowed_set(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    for eid in ("a" * 128, "Z9._-x", "0"):
        repo.add_episode(eid, "t", make_calls(1, 0))
    assert [r.episode_id for r in ReferenceRepository.open(tmp_path / "r").episodes("t")] == ["a" * 128, "Z9._-x", "0"]


def test_episode_refusals_name_the_episode_and_write_nothing(tmp_path):
    root = tmp_path / "r"
    repo = ReferenceRepository.create(root, make_meta())
    repo.add_episode("e", "t", make_calls(1, 0))
    before = (root / "index.json").read_bytes()
    bad_layout = one_call(tokens=torch.zeros(LMAX + 1, dtype=torch.int64),
                          token_mask=torch.ones(LMAX + 1, dtype=torch.bool))
    cases = [
        (("e", "t", make_calls(1, 0)), f"{root}: episode 'e' already exists (remove it first)"),
        (("f", "", make_calls(1, 0)), "episode 'f': task must be a non-empty string"),
        (("f", None, make_calls(1, 0)), "episode 'f': task must be a non-empty string"),
        (("f", "t", []), "episode 'f': no calls"),
        (("f", "t", [make_calls(1, 0)[0], "call"]), "episode 'f': call 1 is not a ReferenceCall"),
        (("f", "t", [make_calls(1, 0)[0], bad_layout]),
         f"episode 'f': call 1 shapes {bad_layout.layout()} differ from call 0 {make_calls(1, 0)[0].layout()}"),
        (("f", "t", [bad_layout]), "episode 'f': per-call shapes differ from the repository's "
                                   "(tokens: [7] vs [6]; token_mask: [7] vs [6])"),
        (("f", "t", [one_call(state_history=torch.zeros(L + 2, D))]),      # 5 rows of 4 joints
         "episode 'f': state_history covers 5 calls, the repository's history_len is 3"),
        (("f", "t", [one_call(masks=torch.zeros(G + 1, DEPTH, K, dtype=torch.int32))]),
         "episode 'f': masks has 3 groups, the repository has 2 mask_groups"),
        (("f", "t", [one_call(masks=torch.full((G, DEPTH, K), -1, dtype=torch.int32))]),
         "episode 'f': 'masks' contains negative neuron indices"),
    ]
    for name in ("state", "state_history", "retrieval"):
        for bad in (float("nan"), float("inf")):
            t = getattr(make_calls(1, 0)[0], name).clone()
            t.view(-1)[-1] = bad
            cases.append((("f", "t", [make_calls(1, 0)[0], one_call(**{name: t})]),
                          f"episode 'f': '{name}' contains NaN or Inf"))
    for args, message in cases:
        with refused(RepositoryError, message):
            repo.add_episode(*args)
    assert (root / "index.json").read_bytes() == before
    assert sorted(p.name for p in (root / "episodes").iterdir()) == ["e.safetensors"]


def test_mask_index_zero_is_a_neuron(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    call = one_call(masks=torch.zeros(G, DEPTH, K, dtype=torch.int32))
    repo.add_episode("e", "t", [call])
    assert_call_equal(ReferenceRepository.open(tmp_path / "r").load_call("e", 0), call)


# ----------------------------------------------------------------------------- admission bounds


def test_admit_refuses_bad_bounds_by_value(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    for bad in (0, True, 1.5, None):
        with refused(ValueError, f"max_episodes_per_task must be a positive int, got {bad!r}"):
            repo.admit("a", "t", make_calls(1, 0), max_episodes_per_task=bad)
    for bad in (0, False, 2.0):
        with refused(ValueError, f"max_bytes must be a positive int or None, got {bad!r}"):
            repo.admit("a", "t", make_calls(1, 0), max_episodes_per_task=1, max_bytes=bad)
    assert repo.episodes() == []


def test_admit_byte_bound_is_inclusive(tmp_path):
    root = tmp_path / "r"
    repo = ReferenceRepository.create(root, make_meta())
    size = repo.add_episode("a", "t", make_calls(2, 0)).bytes
    assert repo.add_episode("b", "t", make_calls(2, 1)).bytes == size    # same shapes, same id length
    with refused(RepositoryError, f"episode 'c' alone is {size} bytes, above max_bytes={size - 1}"):
        repo.admit("c", "t", make_calls(2, 2), max_episodes_per_task=10, max_bytes=size - 1)
    assert repo.admit("c", "t", make_calls(2, 2), max_episodes_per_task=3, max_bytes=3 * size, source="live") == []
    rec = ReferenceRepository.open(root).episode("c")
    assert (rec.admitted_online, rec.source, rec.bytes) == (True, "live", size)
    # one byte short of four episodes: the oldest offline one goes (no online one is older here but "c")
    assert repo.admit("d", "t", make_calls(2, 3), max_episodes_per_task=10, max_bytes=4 * size - 1) == ["c"]
    assert repo.admit("e", "t", make_calls(2, 4), max_episodes_per_task=10, max_bytes=size) == ["d", "a", "b"]
    assert [r.episode_id for r in ReferenceRepository.open(root).episodes()] == ["e"]
    assert sorted(p.name for p in (root / "episodes").iterdir()) == ["e.safetensors"]


def test_admit_with_room_evicts_nothing_and_defaults_to_no_byte_bound(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    assert repo.admit("a", "t", make_calls(1, 0), max_episodes_per_task=1) == []
    assert repo.episode("a").source == "" and repo.episode("a").admitted_online
    # the first episode of a repository, admitted online, gives it its call layout
    again = ReferenceRepository.open(tmp_path / "r")
    assert again.call_layout == make_calls(1, 0)[0].layout()
    # one byte is a valid bound (no episode fits in it): refused as too large, not as a bad bound
    size = again.episode("a").bytes
    with refused(RepositoryError, f"episode 'b' alone is {size} bytes, above max_bytes=1"):
        again.admit("b", "t", make_calls(1, 1), max_episodes_per_task=1, max_bytes=1)


# ----------------------------------------------------------------------------- queries


def test_queries_on_an_empty_repository_and_an_unknown_task(built, tmp_path):
    root, _ = built
    repo = ReferenceRepository.open(root)
    keys, feats = repo.retrieval_matrix("unknown")
    assert keys == [] and feats.dtype == torch.float16 and feats.shape == (0, N_CAMS * P * WV)
    keys, hist = repo.state_histories("unknown")
    assert keys == [] and hist.dtype == torch.float32 and hist.shape == (0, L, D)
    assert repo.episodes("unknown") == []
    with refused(RepositoryError, f"{root}: no episode 'ghost'"):
        repo.episode("ghost")
    with refused(RepositoryError, f"{root}: no episode 'ghost'"):
        repo.remove_episode("ghost")
    empty = ReferenceRepository.create(tmp_path / "empty", make_meta())
    assert empty.call_layout is None and empty.nbytes_per_call() == {} and empty.tasks() == []
    assert empty.retrieval_matrix("t")[1].shape == (0, 0)
    assert empty.retrieval_matrix("t")[1].dtype == torch.float16
    assert empty.state_histories("t")[1].shape == (0, L, 0)


def test_episodes_of_every_task_in_task_then_admission_order(tmp_path):
    repo = ReferenceRepository.create(tmp_path / "r", make_meta())
    for eid, task in (("u0", "u"), ("t0", "t"), ("u1", "u"), ("t1", "t")):
        repo.add_episode(eid, task, make_calls(1, 0))
    again = ReferenceRepository.open(tmp_path / "r")
    assert again.tasks() == ["u", "t"]
    assert [r.episode_id for r in again.episodes()] == ["u0", "u1", "t0", "t1"]
    assert [r.episode_id for r in again.episodes("t")] == ["t0", "t1"]


def test_nbytes_per_call_by_field(built):
    repo = ReferenceRepository.open(built[0])
    assert repo.nbytes_per_call() == {"images": 2 * 8 * 8 * 3, "image_mask": 2, "tokens": 6 * 8, "token_mask": 6,
                                      "state": 4 * 4, "state_history": 3 * 4 * 4, "retrieval": 8 * 5 * 2,
                                      "masks": 2 * 2 * 3 * 4, "total": 632}


def test_load_call_bounds(built):
    root, calls = built
    repo = ReferenceRepository.open(root)
    for bad in (-1, 5):
        with refused(IndexError, f"episode 'ep1' has 5 calls, asked for call {bad}"):
            repo.load_call("ep1", bad)
    assert_call_equal(repo.load_call("ep1", 0), calls["ep1"][0])
    assert_call_equal(repo.load_call("ep1", 4), calls["ep1"][4])


# ----------------------------------------------------------------------------- index.json refusals


def _index_refusal(root: Path, edit, message: str) -> None:
    _edit_index(root, edit)
    with refused(RepositoryError, f"{root / 'index.json'}: {message}"):
        ReferenceRepository.open(root)


_LAYOUT_NAMES = str(sorted(FIELDS))
_RECORD_NAMES = str(sorted(["task", "num_calls", "file", "sha256", "bytes", "source", "admitted_online", "added"]))


def _set(*path_and_value):
    """An index edit setting ``index[k1][k2]... = value``."""
    *path, key, value = path_and_value

    def edit(ix):
        for k in path:
            ix = ix[k]
        ix[key] = value
    return edit


def _drop(*path):
    def edit(ix):
        for k in path[:-1]:
            ix = ix[k]
        del ix[path[-1]]
    return edit


def _rename_ep1(ix):
    ix["episodes"]["-ep1"] = ix["episodes"].pop("ep1")
    ix["tasks"]["pick cube"] = ["ep0", "-ep1"]


def _move_ep1(ix):
    ix["episodes"]["ep1"]["task"] = "other"
    ix["tasks"]["other"] = ["ep1"]


@pytest.mark.parametrize("edit, message", [
    (lambda ix: ix.update(format="other"), "field 'format' is 'other', expected 'vla_runtime.reference_repository'"),
    (_drop("format"), "field 'format' is None, expected 'vla_runtime.reference_repository'"),
    (lambda ix: ix.update(format_version=2), "field 'format_version' is 2; this runtime reads version 1"),
    *[(_drop(key), f"field '{key}' is missing") for key in (
        "checkpoint_hash", "model", "retrieval_layer", "rho_n", "mask_groups", "history_len", "created", "updated",
        "call_layout", "tasks", "episodes")],
    (lambda ix: ix.update(rho_n="half"), "field 'rho_n' must be a number in (0, 1], got 'half'"),
    (lambda ix: ix.update(retrieval_layer=0), "field 'retrieval_layer' must be a positive int, got 0"),
    (lambda ix: ix.update(call_layout="x"), f"field 'call_layout' must name exactly {_LAYOUT_NAMES}"),
    (_drop("call_layout", "masks"), f"field 'call_layout' must name exactly {_LAYOUT_NAMES}"),
    (_set("call_layout", "state", [4]), "field 'call_layout.state' is [4], expected dtype float32 with 1 positive dims"),
    (_set("call_layout", "state", "dtype", "float64"),
     "field 'call_layout.state' is {'dtype': 'float64', 'shape': [4]}, expected dtype float32 with 1 positive dims"),
    (_set("call_layout", "masks", "shape", "2x2x3"),
     "field 'call_layout.masks' is {'dtype': 'int32', 'shape': '2x2x3'}, expected dtype int32 with 3 positive dims"),
    (_set("call_layout", "masks", "shape", [2, 2]),
     "field 'call_layout.masks' is {'dtype': 'int32', 'shape': [2, 2]}, expected dtype int32 with 3 positive dims"),
    (_set("call_layout", "tokens", "shape", [0]),
     "field 'call_layout.tokens' is {'dtype': 'int64', 'shape': [0]}, expected dtype int64 with 1 positive dims"),
    (_set("call_layout", "tokens", "shape", [True]),
     "field 'call_layout.tokens' is {'dtype': 'int64', 'shape': [True]}, expected dtype int64 with 1 positive dims"),
    (lambda ix: ix.update(episodes=[]), "fields 'episodes' and 'tasks' must be JSON objects"),
    (lambda ix: ix.update(tasks=[]), "fields 'episodes' and 'tasks' must be JSON objects"),
    (_set("tasks", "", []), "field tasks['']" + " must be a list of episode ids"),
    (_set("tasks", "pick cube", "ep0"), "field tasks['pick cube'] must be a list of episode ids"),
    (_set("tasks", "pick cube", ["ep0", 1]), "field tasks['pick cube'] must be a list of episode ids"),
    (lambda ix: ix.update(call_layout=None), "field 'call_layout' is null but the repository has episodes"),
    (_rename_ep1, "episodes['-ep1']: invalid episode id"),
    (_set("episodes", "ep1", 5), f"episodes['ep1']: must be an object with fields {_RECORD_NAMES}"),
    (_set("episodes", "ep1", "extra", 1), f"episodes['ep1']: must be an object with fields {_RECORD_NAMES}"),
    *[(_set("episodes", "ep1", key, 1), f"episodes['ep1']: field '{key}' must be a string")
      for key in ("task", "file", "sha256", "source", "added")],
    *[(_set("episodes", "ep1", key, bad), f"episodes['ep1']: field '{key}' must be a positive int")
      for key in ("num_calls", "bytes") for bad in (0, True, "5")],
    (_set("episodes", "ep1", "admitted_online", 1), "episodes['ep1']: field 'admitted_online' must be a bool"),
    (_set("episodes", "ep1", "file", "episodes/ep0.safetensors"),
     "episodes['ep1']: field 'file' must be 'episodes/ep1.safetensors', got 'episodes/ep0.safetensors'"),
    (_set("tasks", "pick cube", ["ep0"]), "episodes['ep1']: not listed under tasks['pick cube']"),
    (_set("episodes", "ep1", "task", "place"), "episodes['ep1']: not listed under tasks['place']"),
    (_set("tasks", "pick cube", ["ep0", "ep1", "ghost"]),
     "tasks['pick cube'] lists 'ghost', which is not an episode of that task"),
    (_move_ep1, "tasks['pick cube'] lists 'ep1', which is not an episode of that task"),
    (_set("tasks", "pick cube", ["ep0", "ep1", "ep1"]), "field 'tasks' lists some episodes more than once"),
])
def test_index_refusals_name_the_field(built, edit, message):
    _index_refusal(built[0], edit, message)


def test_index_that_is_not_an_object_or_not_json(built):
    root, _ = built
    path = root / "index.json"
    path.write_text("[]")
    with refused(RepositoryError, f"{path}: not a JSON object"):
        ReferenceRepository.open(root)
    path.write_bytes(b'{"format": "\xff"}')
    with refused_from(RepositoryError, f"{path}: unreadable or not valid JSON ('utf-8' codec can't decode"):
        ReferenceRepository.open(root)
    path.write_text("{")
    with refused_from(RepositoryError, f"{path}: unreadable or not valid JSON (Expecting property name"):
        ReferenceRepository.open(root)
    path.unlink()
    path.mkdir()
    with refused(RepositoryError, f"{path}: missing (not a reference repository)"):
        ReferenceRepository.open(root)


def test_records_of_an_older_index_read_with_their_defaults(built):
    root, calls = built

    def strip(ix):
        for rec in ix["episodes"].values():
            for key in ("added", "source", "admitted_online"):
                del rec[key]
    _edit_index(root, strip)
    rec = ReferenceRepository.open(root).episode("ep1")
    assert (rec.added, rec.source, rec.admitted_online) == ("", "", False)
    assert_call_equal(ReferenceRepository.open(root).load_call("ep1", 3), calls["ep1"][3])


def test_record_sizes_are_checked_against_the_file(built):
    root, _ = built
    size = (root / "episodes" / "ep1.safetensors").stat().st_size
    path = root / "episodes" / "ep1.safetensors"
    _edit_index(root, _set("episodes", "ep1", "bytes", 1))
    with refused(RepositoryError, f"{path} (episode 'ep1'): file is {size} bytes, index.json records 1 "
                                  f"(truncated or replaced)"):
        ReferenceRepository.open(root)


# ----------------------------------------------------------------------------- expected model


def test_model_mismatch_messages(built):
    root, _ = built
    prefix = f"{root / 'index.json'}: model summary mismatch: "
    cases = [
        ({**MODEL, "extra": 1}, "'extra' absent from the repository, loaded model has 1"),
        ({"vision": MODEL["vision"], "expert_mlp": 16}, "'name' is 'pi05-tiny' in the repository, absent from the "
                                                        "loaded model"),
        ({**MODEL, "vision": {"depth": 4}}, "'vision.width' is 5 in the repository, absent from the loaded model"),
        ({**MODEL, "expert_mlp": 17}, "'expert_mlp' repository=16 loaded=17"),
        (["x"], f"'<root>' repository={MODEL!r} loaded=['x']"),
    ]
    for want, message in cases:
        with refused(RepositoryError, prefix + message):
            ReferenceRepository.open(root, expect_model=want)
    five = {f"k{i}": i for i in range(5)}
    diffs = "; ".join(f"'k{i}' absent from the repository, loaded model has {i}" for i in range(5))
    # sorted: expert_mlp, k0..k4, name, vision: the first five, then how many more
    first = "; ".join(["'expert_mlp' is 16 in the repository, absent from the loaded model"]
                      + [f"'k{i}' absent from the repository, loaded model has {i}" for i in range(4)])
    with refused(RepositoryError, prefix + first + " (and 3 more)"):
        ReferenceRepository.open(root, expect_model=five)
    with refused(RepositoryError, prefix + diffs):
        ReferenceRepository.open(root, expect_model={**MODEL, **five})
    with refused(RepositoryError, prefix + diffs + " (and 1 more)"):
        ReferenceRepository.open(root, expect_model={**MODEL, **five, "k5": 5})
    # what JSON would store is compared: a tuple is the list it was written as, an int key its string
    _edit_index(root, lambda ix: ix["model"].update(sizes=[1, 2], ids={"3": "c"}))
    ReferenceRepository.open(root, expect_model={**MODEL, "sizes": (1, 2), "ids": {3: "c"}})


def test_checkpoint_hash_mismatch_message(built):
    root, _ = built
    other = "sha256:" + "b" * 64
    with refused(RepositoryError, f"{root / 'index.json'}: repository was built for {HASH}, "
                                  f"the loaded checkpoint is {other}"):
        ReferenceRepository.open(root, expect_checkpoint_hash=other)
    assert ReferenceRepository.open(root, expect_checkpoint_hash=HASH).meta.checkpoint_hash == HASH


# ----------------------------------------------------------------------------- episode files


def read_raw(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (as JSON) and its data section, read by hand."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def write_episode_bytes(root: Path, eid: str, blob: bytes) -> Path:
    """Replace an episode file by ``blob`` and record its size (not its hash: open with verify=False)."""
    path = root / "episodes" / f"{eid}.safetensors"
    path.write_bytes(blob)
    _edit_index(root, _set("episodes", eid, "bytes", len(blob)))
    return path


def write_raw(root: Path, eid: str, header: object, data: bytes, header_bytes: bytes | None = None) -> Path:
    h = json.dumps(header).encode() if header_bytes is None else header_bytes
    return write_episode_bytes(root, eid, struct.pack("<Q", len(h)) + h + data)


def _where(root: Path, eid: str = "ep1") -> str:
    return f"{root / 'episodes' / f'{eid}.safetensors'} (episode '{eid}')"


def test_header_refusals(built):
    root, _ = built
    header, data = read_raw(root / "episodes" / "ep1.safetensors")
    where = _where(root)

    def refuses(message: str, prefix: bool = False):
        with (refused_from if prefix else refused)(RepositoryError, f"{where}: {message}"):
            ReferenceRepository.open(root, verify=False)

    write_episode_bytes(root, "ep1", b"\x01\x00\x00\x00\x00")
    refuses("not a safetensors file (only 5 bytes)")
    # the length is an unsigned 64-bit integer: past the sign bit it is huge, not negative
    write_episode_bytes(root, "ep1", struct.pack("<Q", (1 << 63) + 5) + b"{}")
    refuses(f"corrupt safetensors header (length {(1 << 63) + 5}, file 10 bytes)")
    size = write_raw(root, "ep1", header, data).stat().st_size
    write_episode_bytes(root, "ep1", struct.pack("<Q", size - 7) + (root / "episodes" / "ep1.safetensors")
                        .read_bytes()[8:])
    refuses(f"corrupt safetensors header (length {size - 7}, file {size} bytes)")
    write_raw(root, "ep1", None, b"", header_bytes=b"[1]")
    refuses("corrupt safetensors header (not a JSON object)")
    write_raw(root, "ep1", None, b"", header_bytes=b'{"a": "\xff"}')
    refuses("corrupt safetensors header ('utf-8' codec can't decode byte 0xff", prefix=True)
    write_raw(root, "ep1", None, b"", header_bytes=b'{"a": ')
    refuses("corrupt safetensors header (Expecting value", prefix=True)
    for broken in ({"dtype": "F32", "shape": [5, 4]}, {"dtype": "F32", "shape": 5, "data_offsets": [240, 320]},
                   {"dtype": "F32", "shape": [5, 4], "data_offsets": [240]}, [1]):
        write_raw(root, "ep1", {**header, "state": broken}, data)
        refuses("corrupt safetensors header entry for 'state'")
    write_raw(root, "ep1", {**header, "state": {**header["state"], "shape": [5, 3]}}, data)
    refuses("tensor 'state' occupies 80 bytes, its shape [5, 3] and dtype F32 need 60")
    gap = {**header, "token_mask": {**header["token_mask"], "data_offsets": [3131, 3161]}}
    write_raw(root, "ep1", gap, data + b"\x00")
    refuses("corrupt safetensors file (tensor data not contiguous)")
    write_raw(root, "ep1", header, data + b"\x00" * 7)
    n = len(json.dumps(header).encode())
    refuses(f"file is {8 + n + len(data) + 7} bytes, its header describes {8 + n + len(data)} (truncated or corrupt)")


def test_a_header_may_end_the_file_and_list_tensors_in_any_order(built):
    root, calls = built
    header, data = read_raw(root / "episodes" / "ep1.safetensors")
    # a header filling the whole file (no tensor data) is a valid safetensors file without our tensors
    write_raw(root, "ep1", {"__metadata__": header["__metadata__"]}, b"")
    with refused(RepositoryError, f"{_where(root)}: tensors [], expected {sorted(FIELDS)}"):
        ReferenceRepository.open(root, verify=False)
    # the format lets the header list tensors in another order than their data
    reordered = dict(reversed(list(header.items())))
    assert [k for k in reordered if k != "__metadata__"] != [k for k in header if k != "__metadata__"]
    write_raw(root, "ep1", reordered, data)
    repo = ReferenceRepository.open(root, verify=False)
    for i in (0, 4):
        assert_call_equal(repo.load_call("ep1", i), calls["ep1"][i])


def test_header_length_is_bounded_before_it_is_read(built):
    root, _ = built
    path = root / "episodes" / "ep1.safetensors"
    where = _where(root)
    for n, message in (((100 << 20) + 1, f"corrupt safetensors header (length {(100 << 20) + 1}, file "),
                       (100 << 20, "corrupt safetensors header (Expecting value")):
        # a sparse file: a header of zero bytes claiming the length, nothing on disk
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", n))
            f.truncate(8 + (100 << 20) + 16)
        _edit_index(root, _set("episodes", "ep1", "bytes", path.stat().st_size))
        with refused_from(RepositoryError, f"{where}: {message}"):
            ReferenceRepository.open(root, verify=False)


def test_unknown_dtype_in_a_header_is_refused_by_the_layout_check(built):
    root, _ = built
    header, data = read_raw(root / "episodes" / "ep1.safetensors")
    write_raw(root, "ep1", {**header, "retrieval": {**header["retrieval"], "dtype": "BF16"}}, data)
    with refused(RepositoryError, f"{_where(root)}: tensor 'retrieval' is BF16 [5, 8, 5], expected F16 [5, 8, 5]"):
        ReferenceRepository.open(root, verify=False)


@pytest.mark.parametrize("metadata, said", [
    ({"episode_id": "ep0", "task": "pick cube"}, "'ep0' / task 'pick cube'"),
    ({"episode_id": "ep1", "task": "place"}, "'ep1' / task 'place'"),
    (None, "None / task None"),
    ("absent", "None / task None"),
])
def test_header_metadata_must_name_the_episode_and_task(built, metadata, said):
    root, _ = built
    header, data = read_raw(root / "episodes" / "ep1.safetensors")
    if metadata == "absent":
        del header["__metadata__"]
    else:
        header["__metadata__"] = metadata
    write_raw(root, "ep1", header, data)
    with refused(RepositoryError, f"{_where(root)}: header metadata names episode {said}, "
                                  f"index.json says 'ep1' / 'pick cube'"):
        ReferenceRepository.open(root, verify=False)


def test_tensor_set_dtype_and_shape_checked_against_the_layout(built):
    root, _ = built
    header, data = read_raw(root / "episodes" / "ep1.safetensors")
    extra = {**header, "extra": {"dtype": "U8", "shape": [1], "data_offsets": [3160, 3161]}}
    write_raw(root, "ep1", extra, data + b"\x00")
    with refused(RepositoryError, f"{_where(root)}: tensors {sorted([*FIELDS, 'extra'])}, expected {sorted(FIELDS)}"):
        ReferenceRepository.open(root, verify=False)
    # same bytes, another per-call shape: [5, 2, 3] instead of [5, 6]
    write_raw(root, "ep1", {**header, "tokens": {**header["tokens"], "shape": [5, 2, 3]}}, data)
    with refused(RepositoryError, f"{_where(root)}: tensor 'tokens' is I64 [5, 2, 3], expected I64 [5, 6]"):
        ReferenceRepository.open(root, verify=False)


# ----------------------------------------------------------------------------- damaged after open


def _replace_tensors(root: Path, eid: str, change) -> Path:
    path = root / "episodes" / f"{eid}.safetensors"
    tensors = safetensors.torch.load_file(path)
    change(tensors)
    path.write_bytes(safetensors.torch.save(tensors, metadata={"episode_id": eid, "task": "pick cube"}))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("masks"), "tensor 'masks' is missing"),
    (lambda t: t.update(retrieval=t["retrieval"].float()),
     "tensor 'retrieval' is torch.float32 (5, 8, 5), expected torch.float16 [5, 8, 5]"),
    (lambda t: t.update(tokens=t["tokens"].reshape(5, 2, 3).contiguous()),
     "tensor 'tokens' is torch.int64 (5, 2, 3), expected torch.int64 [5, 6]"),
    (lambda t: t.update(state=t["state"][:4].contiguous()),
     "tensor 'state' is torch.float32 (4, 4), expected torch.float32 [5, 4]"),
])
def test_load_episode_checks_what_it_read(built, change, message):
    root, _ = built
    repo = ReferenceRepository.open(root)
    path = _replace_tensors(root, "ep1", change)
    with refused(RepositoryError, f"{path}: {message}"):
        repo.load_episode("ep1")


def test_unreadable_files_after_open_name_the_read(built):
    root, _ = built
    repo = ReferenceRepository.open(root)
    path = root / "episodes" / "ep1.safetensors"
    path.write_bytes(b"garbage")
    with refused_from(RepositoryError, f"{path}: cannot read episode 'ep1' ("):
        repo.load_episode("ep1")
    with refused_from(RepositoryError, f"{path}: cannot read call 2 of episode 'ep1' ("):
        repo.load_call("ep1", 2)
    with refused_from(RepositoryError, f"{path}: cannot read 'retrieval' of episode 'ep1' ("):
        repo.retrieval_matrix("pick cube")
    with refused_from(RepositoryError, f"{path}: cannot read 'state_history' of episode 'ep1' ("):
        repo.state_histories("pick cube")


def test_fields_read_alone_are_checked(built):
    root, _ = built
    repo = ReferenceRepository.open(root)
    path = _replace_tensors(root, "ep1", lambda t: t.update(retrieval=t["retrieval"].float()))
    with refused(RepositoryError, f"{path}: tensor 'retrieval' is torch.float32 (5, 8, 5), "
                                  f"expected torch.float16 with 5 calls"):
        repo.retrieval_matrix("pick cube")
    _replace_tensors(root, "ep1", lambda t: t.update(state_history=t["state_history"][:4].contiguous()))
    with refused(RepositoryError, f"{path}: tensor 'state_history' is torch.float32 (4, 3, 4), "
                                  f"expected torch.float32 with 5 calls"):
        repo.state_histories("pick cube")


def test_load_call_validates_the_call_it_read(built):
    root, _ = built
    repo = ReferenceRepository.open(root)
    path = _replace_tensors(root, "ep1", lambda t: t.update(image_mask=torch.ones(5, 3, dtype=torch.bool)))
    with refused(RepositoryError, f"{path}: ReferenceCall.image_mask has 3 cameras, images 2"):
        repo.load_call("ep1", 1)


# ----------------------------------------------------------------------------- atomic writes


def test_a_write_that_fails_before_its_file_exists_raises_its_own_error(built, monkeypatch):
    root, _ = built
    repo = ReferenceRepository.open(root)

    def no_space(*a, **k):
        raise OSError("no space left")

    monkeypatch.setattr(repo_mod, "open", no_space, raising=False)
    fails_leaving_the_index(root, monkeypatch, lambda: repo.add_episode("ep2", "pick cube", make_calls(1, 2)),
                            "no space left")
    assert sorted(p.name for p in (root / "episodes").iterdir()) == ["ep0.safetensors", "ep1.safetensors"]


def test_a_removal_whose_index_write_fails_keeps_the_episode(built, monkeypatch):
    root, calls = built
    repo = ReferenceRepository.open(root)
    fail_index_rename(monkeypatch)
    fails_leaving_the_index(root, monkeypatch, lambda: repo.remove_episode("ep0"), "crash during index rename")
    assert [r.episode_id for r in repo.episodes()] == ["ep0", "ep1"]
    assert_call_equal(ReferenceRepository.open(root).load_call("ep0", 2), calls["ep0"][2])


def test_removing_an_episode_whose_file_is_already_gone(built):
    root, _ = built
    repo = ReferenceRepository.open(root)
    (root / "episodes" / "ep0.safetensors").unlink()
    repo.remove_episode("ep0")
    assert [r.episode_id for r in ReferenceRepository.open(root).episodes()] == ["ep1"]
