"""The reference repository: compact records of successful episodes, one per policy call.

Why compact: the expanded FFN states of a reference are ~100 MB per call for three-view pi0.5,
so the repository keeps only what is needed to *rebuild* them (model-size images, prompt
tokens, state), plus what retrieval needs without rebuilding (intermediate ViT features, the
state history) and what the Action Cache needs as is (offline neuron masks). Expansion happens
online, for the few entries of the sliding window (``cache.window``).

Layout (readable with nothing but ``json`` and ``safetensors``)::

    REPO/
      index.json                          format, version, checkpoint hash, model summary,
                                          cache parameters, per-call tensor layout, tasks, episodes
      episodes/<episode_id>.safetensors   the episode's calls stacked on dim 0 (see FIELDS)

Trust model: a repository is tied to one checkpoint (its content hash) and one model summary.
``ReferenceRepository.open`` validates everything it can without reading tensor data (index
schema, file presence and size, safetensors headers against the recorded layout) and, with
``verify=True``, every file's sha256. Every problem is a ``RepositoryError`` naming the file
and field at fault, raised at open or load time, so a caller can fall back to dense inference
instead of failing later inside a kernel.

Writes are atomic (temporary file, fsync, rename; the index last), so a crash leaves either the
old or the new repository, never a half-written one. A single writer is assumed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from safetensors import safe_open
from torch import Tensor

from ..io.files import fsync_dir
from .halves import HalfTiming

FORMAT_NAME = "vla_runtime.reference_repository"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
EPISODE_DIR = "episodes"


class RepositoryError(ValueError):
    """A reference repository cannot be used: wrong model, wrong format, or damaged."""


# Field -> (torch dtype, safetensors dtype tag, per-call rank). Order is the on-disk order.
FIELDS: dict[str, tuple[torch.dtype, str, int]] = {
    "images": (torch.uint8, "U8", 4),            # [N_cams, S, S, 3] model-size RGB
    "image_mask": (torch.bool, "BOOL", 1),       # [N_cams]
    "tokens": (torch.int64, "I64", 1),           # [Lmax]
    "token_mask": (torch.bool, "BOOL", 1),       # [Lmax]
    "state": (torch.float32, "F32", 1),          # [D] raw robot state
    "state_history": (torch.float32, "F32", 2),  # [L, D], last row = this call
    "retrieval": (torch.float16, "F16", 2),      # [N_cams * P, Wv] intermediate ViT features
    "masks": (torch.int32, "I32", 3),            # [G, depth, K] Action Cache neuron indices
}
_ITEMSIZE = {"U8": 1, "BOOL": 1, "I64": 8, "F32": 4, "F16": 2, "I32": 4}
_EPISODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- records


@dataclass
class ReferenceCall:
    """One policy call in compact form; shapes are per call (no leading episode axis).

    Dtypes are exact (no silent casts): e.g. the ViT features must be converted to float16 by
    the caller, who knows whether the range fits.
    """

    images: Tensor         # uint8  [N_cams, S, S, 3]
    image_mask: Tensor     # bool   [N_cams]
    tokens: Tensor         # int64  [Lmax]
    token_mask: Tensor     # bool   [Lmax]
    state: Tensor          # float32 [D]
    state_history: Tensor  # float32 [L, D]
    retrieval: Tensor      # float16 [N_cams * P, Wv]
    masks: Tensor          # int32  [G, depth, K]

    def __post_init__(self) -> None:
        for name, (dtype, _, rank) in FIELDS.items():
            t = getattr(self, name)
            if not isinstance(t, Tensor):
                raise RepositoryError(f"ReferenceCall.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype or t.ndim != rank or t.numel() == 0:
                raise RepositoryError(f"ReferenceCall.{name} must be a non-empty {dtype} with {rank} dims, "
                                      f"got {t.dtype} {tuple(t.shape)}")
        n_cams = self.images.shape[0]
        if self.images.shape[3] != 3 or self.images.shape[1] != self.images.shape[2]:
            raise RepositoryError(f"ReferenceCall.images must be [N_cams, S, S, 3], got {tuple(self.images.shape)}")
        if self.image_mask.shape[0] != n_cams:
            raise RepositoryError(f"ReferenceCall.image_mask has {self.image_mask.shape[0]} cameras, images {n_cams}")
        if self.token_mask.shape != self.tokens.shape:
            raise RepositoryError("ReferenceCall.token_mask must be shaped like tokens")
        if self.state_history.shape[1] != self.state.shape[0]:
            raise RepositoryError(f"ReferenceCall.state_history must be [L, {self.state.shape[0]}], "
                                  f"got {tuple(self.state_history.shape)}")
        if self.retrieval.shape[0] % n_cams:
            raise RepositoryError(f"ReferenceCall.retrieval rows ({self.retrieval.shape[0]}) must be "
                                  f"N_cams * P with N_cams = {n_cams}")

    def layout(self) -> dict[str, list[int]]:
        """Per-call shapes by field (what ``index.json`` records as ``call_layout``)."""
        return {name: list(getattr(self, name).shape) for name in FIELDS}


@dataclass
class EpisodeTensors:
    """An episode's calls stacked on dim 0 (exactly the tensors of its file)."""

    episode_id: str
    task: str
    tensors: dict[str, Tensor]

    @property
    def num_calls(self) -> int:
        return int(self.tensors["images"].shape[0])

    def call(self, index: int) -> ReferenceCall:
        return ReferenceCall(**{name: t[index] for name, t in self.tensors.items()})


@dataclass
class EpisodeRecord:
    """What the index knows about one episode (file path relative to the repository root)."""

    episode_id: str
    task: str
    num_calls: int
    file: str
    sha256: str
    bytes: int
    source: str = ""
    admitted_online: bool = False
    added: str = ""        # ISO time of admission (extra, informative; order in tasks[] is authoritative)


@dataclass
class RepositoryMeta:
    """What ties a repository to a model: checkpoint, architecture and cache parameters."""

    checkpoint_hash: str
    model: dict[str, Any]
    retrieval_layer: int
    rho_n: float
    mask_groups: list[list[int]]
    history_len: int
    format_version: int = FORMAT_VERSION
    # each half of the cache timed against dense by ``build-cache --profile`` (None: not measured;
    # repositories written before the field existed read as None)
    half_timing: HalfTiming | None = None

    def __post_init__(self) -> None:
        if isinstance(self.mask_groups, (list, tuple)):
            self.mask_groups = [list(g) if isinstance(g, (list, tuple)) else g for g in self.mask_groups]
        _check_meta(self, where="RepositoryMeta")


def _check_meta(m: RepositoryMeta, where: str) -> None:
    def bad(name: str, want: str) -> RepositoryError:
        return RepositoryError(f"{where}: field '{name}' must be {want}, got {getattr(m, name)!r}")

    if not isinstance(m.checkpoint_hash, str) or not m.checkpoint_hash:
        raise bad("checkpoint_hash", "a non-empty string such as 'sha256:...'")
    if not isinstance(m.model, dict):
        raise bad("model", "a dict")
    try:
        json.dumps(m.model)
    except (TypeError, ValueError) as e:
        raise RepositoryError(f"{where}: field 'model' must be JSON-serialisable ({e})") from None
    if not _is_int(m.retrieval_layer) or m.retrieval_layer < 1:
        raise bad("retrieval_layer", "a positive int")
    if not _is_number(m.rho_n) or not 0.0 < m.rho_n <= 1.0:
        raise bad("rho_n", "a number in (0, 1]")
    if not _is_int(m.history_len) or m.history_len < 1:
        raise bad("history_len", "a positive int")
    if m.format_version != FORMAT_VERSION:
        raise bad("format_version", f"{FORMAT_VERSION}")
    groups = m.mask_groups
    if not isinstance(groups, list) or not groups:
        raise bad("mask_groups", "a non-empty list of [start, end) step ranges")
    prev_end = 0
    for g in groups:
        if (not isinstance(g, list) or len(g) != 2 or not all(_is_int(x) for x in g)
                or g[0] != prev_end or g[1] <= g[0]):
            raise bad("mask_groups", "contiguous [start, end) step ranges starting at 0, e.g. [[0, 5], [5, 10]]")
        prev_end = g[1]
    if m.half_timing is not None and not isinstance(m.half_timing, HalfTiming):
        raise bad("half_timing", "None or a HalfTiming")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ----------------------------------------------------------------------------- file helpers


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary sibling, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _read_safetensors_header(path: Path, where: str) -> tuple[dict[str, dict], dict[str, str]]:
    """Parse and sanity-check a safetensors header without reading tensor data.

    Checks what the format itself guarantees (sizes and offsets tile the data section exactly),
    which is how truncation is caught before any tensor is touched.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise RepositoryError(f"{where}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise RepositoryError(f"{where}: corrupt safetensors header (length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RepositoryError(f"{where}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise RepositoryError(f"{where}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", {}) or {}
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise RepositoryError(f"{where}: corrupt safetensors header entry for '{name}'") from None
        if dtype in _ITEMSIZE and end - start != numel * _ITEMSIZE[dtype]:
            raise RepositoryError(f"{where}: tensor '{name}' occupies {end - start} bytes, "
                                  f"its shape {shape} and dtype {dtype} need {numel * _ITEMSIZE[dtype]}")
        spans.append((start, end))
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            raise RepositoryError(f"{where}: corrupt safetensors file (tensor data not contiguous)")
        pos = end
    if 8 + n + pos != size:
        raise RepositoryError(f"{where}: file is {size} bytes, its header describes {8 + n + pos} "
                              f"(truncated or corrupt)")
    return header, metadata


# ----------------------------------------------------------------------------- repository


class ReferenceRepository:
    """A directory of reference episodes, validated on open, written atomically.

    ``load_episode`` returns the stacked ``EpisodeTensors`` (one read of the file, what batched
    reconstruction wants); ``load_call`` reads only the requested call's slices.
    """

    def __init__(self, root: Path, index: dict[str, Any]):
        # Use create() / open(); the constructor trusts an already validated index.
        self.root = root
        self._index = index
        self.meta = RepositoryMeta(
            checkpoint_hash=index["checkpoint_hash"], model=index["model"],
            retrieval_layer=index["retrieval_layer"], rho_n=index["rho_n"],
            mask_groups=index["mask_groups"], history_len=index["history_len"],
            format_version=index["format_version"], half_timing=_half_timing(index, root / INDEX_FILE))
        self._episodes: dict[str, EpisodeRecord] = {
            eid: EpisodeRecord(episode_id=eid, **rec) for eid, rec in index["episodes"].items()}

    # ---------------------------------------------------------------- create / open

    @classmethod
    def create(cls, root: str | Path, meta: RepositoryMeta) -> ReferenceRepository:
        """Start an empty repository at ``root`` (created if absent; refused if not empty)."""
        root = Path(root)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise RepositoryError(f"{root}: refusing to create a repository in a non-empty location")
        (root / EPISODE_DIR).mkdir(parents=True, exist_ok=True)
        now = _now()
        index = {
            "format": FORMAT_NAME,
            "format_version": meta.format_version,
            "checkpoint_hash": meta.checkpoint_hash,
            "model": json.loads(json.dumps(meta.model)),
            "retrieval_layer": meta.retrieval_layer,
            "rho_n": float(meta.rho_n),
            "mask_groups": [list(g) for g in meta.mask_groups],
            "history_len": meta.history_len,
            "half_timing": None if meta.half_timing is None else meta.half_timing.as_dict(),
            "created": now,
            "updated": now,
            "call_layout": None,
            "tasks": {},
            "episodes": {},
        }
        repo = cls(root, index)
        repo._write_index()
        return repo

    @classmethod
    def open(cls, root: str | Path, expect_checkpoint_hash: str | None = None,
             expect_model: dict | None = None, verify: bool = True) -> ReferenceRepository:
        """Open and validate a repository; any problem is a ``RepositoryError``.

        ``verify`` also hashes every episode file (catches bit rot; costs one read of the
        repository). Without it, sizes and headers are still checked.
        """
        root = Path(root)
        path = root / INDEX_FILE
        if not path.is_file():
            raise RepositoryError(f"{path}: missing (not a reference repository)")
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RepositoryError(f"{path}: unreadable or not valid JSON ({e})") from None
        _check_index(index, path)
        if expect_checkpoint_hash is not None and index["checkpoint_hash"] != expect_checkpoint_hash:
            raise RepositoryError(
                f"{path}: repository was built for {index['checkpoint_hash']}, "
                f"the loaded checkpoint is {expect_checkpoint_hash}")
        if expect_model is not None:
            diff = _dict_diff(index["model"], json.loads(json.dumps(expect_model)))
            if diff:
                raise RepositoryError(f"{path}: model summary mismatch: " + "; ".join(diff[:5])
                                      + (f" (and {len(diff) - 5} more)" if len(diff) > 5 else ""))
        repo = cls(root, index)
        for rec in repo._episodes.values():
            repo._check_episode_file(rec, verify=verify)
        return repo

    def record_half_timing(self, timing: HalfTiming) -> None:
        """Record (or replace) the halves' timing on this machine: what ``auto`` decides from."""
        if not isinstance(timing, HalfTiming):
            raise RepositoryError(f"{self.root}: half_timing must be a HalfTiming, got {type(timing).__name__}")
        self._index["half_timing"] = timing.as_dict()
        self._index["updated"] = _now()
        self.meta.half_timing = timing
        self._write_index()

    # ---------------------------------------------------------------- queries

    def tasks(self) -> list[str]:
        return list(self._index["tasks"])

    def episodes(self, task: str | None = None) -> list[EpisodeRecord]:
        """Episode records, oldest first (per task: admission order)."""
        if task is None:
            return [self._episodes[e] for ids in self._index["tasks"].values() for e in ids]
        return [self._episodes[e] for e in self._index["tasks"].get(task, [])]

    def episode(self, episode_id: str) -> EpisodeRecord:
        try:
            return self._episodes[episode_id]
        except KeyError:
            raise RepositoryError(f"{self.root}: no episode '{episode_id}'") from None

    @property
    def call_layout(self) -> dict[str, list[int]] | None:
        """Per-call tensor shapes shared by every episode (None while the repository is empty)."""
        layout = self._index["call_layout"]
        return None if layout is None else {k: list(v["shape"]) for k, v in layout.items()}

    def nbytes_per_call(self) -> dict[str, int]:
        """Stored bytes per reference call by field, plus ``total`` ({} while empty)."""
        layout = self.call_layout
        if layout is None:
            return {}
        out = {name: math.prod(shape) * _ITEMSIZE[FIELDS[name][1]] for name, shape in layout.items()}
        out["total"] = sum(out.values())
        return out

    # ---------------------------------------------------------------- loading

    def load_episode(self, episode_id: str) -> EpisodeTensors:
        """All calls of an episode, stacked (``EpisodeTensors.call(i)`` gives one call)."""
        rec = self.episode(episode_id)
        path = self.root / rec.file
        try:
            tensors = safetensors.torch.load_file(path)
        except Exception as e:  # safetensors raises its own error types; normalise them
            raise RepositoryError(f"{path}: cannot read episode '{episode_id}' ({e})") from None
        self._check_loaded(rec, tensors, path)
        return EpisodeTensors(episode_id, rec.task, {name: tensors[name] for name in FIELDS})

    def load_call(self, episode_id: str, index: int) -> ReferenceCall:
        """One call, reading only its slice of each tensor (memory-mapped, no full load)."""
        rec = self.episode(episode_id)
        if not 0 <= index < rec.num_calls:
            raise IndexError(f"episode '{episode_id}' has {rec.num_calls} calls, asked for call {index}")
        path = self.root / rec.file
        try:
            # numpy, not "pt": safetensors 0.8.0's torch reads leak ~56 bytes each, and the cache
            # manager makes dozens per call (a soak of 24k calls grew its RSS by 60 MB)
            with safe_open(path, framework="numpy") as f:
                tensors = {name: torch.from_numpy(np.ascontiguousarray(f.get_slice(name)[index])) for name in FIELDS}
        except Exception as e:
            raise RepositoryError(f"{path}: cannot read call {index} of episode '{episode_id}' ({e})") from None
        try:
            return ReferenceCall(**tensors)
        except RepositoryError as e:
            raise RepositoryError(f"{path}: {e}") from None

    def retrieval_matrix(self, task: str) -> tuple[list[tuple[str, int]], Tensor]:
        """Retrieval features of every call of a task, flattened: keys and ``[n, N*P*Wv]`` fp16."""
        keys, feats = [], []
        for rec in self.episodes(task):
            t = self._read_field(rec, "retrieval")
            keys += [(rec.episode_id, i) for i in range(rec.num_calls)]
            feats.append(t.reshape(t.shape[0], -1))
        width = math.prod(self.call_layout["retrieval"]) if self.call_layout else 0
        return keys, (torch.cat(feats) if feats else torch.empty(0, width, dtype=torch.float16))

    def state_histories(self, task: str) -> tuple[list[tuple[str, int]], Tensor]:
        """State histories of every call of a task: keys (as ``retrieval_matrix``) and ``[n, L, D]``."""
        keys, hist = [], []
        for rec in self.episodes(task):
            keys += [(rec.episode_id, i) for i in range(rec.num_calls)]
            hist.append(self._read_field(rec, "state_history"))
        shape = self.call_layout["state_history"] if self.call_layout else [self.meta.history_len, 0]
        return keys, (torch.cat(hist) if hist else torch.empty(0, *shape))

    def _read_field(self, rec: EpisodeRecord, name: str) -> Tensor:
        path = self.root / rec.file
        try:
            with safe_open(path, framework="pt") as f:
                t = f.get_tensor(name)
        except Exception as e:
            raise RepositoryError(f"{path}: cannot read '{name}' of episode '{rec.episode_id}' ({e})") from None
        if t.dtype != FIELDS[name][0] or t.shape[0] != rec.num_calls:
            raise RepositoryError(f"{path}: tensor '{name}' is {t.dtype} {tuple(t.shape)}, "
                                  f"expected {FIELDS[name][0]} with {rec.num_calls} calls")
        return t

    # ---------------------------------------------------------------- writing

    def add_episode(self, episode_id: str, task: str, calls: Sequence[ReferenceCall], source: str = "",
                    admitted_online: bool = False) -> EpisodeRecord:
        """Write one episode (file first, then the index; both atomic)."""
        rec, data, layout = self._prepare(episode_id, task, calls, source, admitted_online)
        self._commit(rec, data, layout, evict=[])
        return rec

    def remove_episode(self, episode_id: str) -> None:
        """Drop an episode: the index stops naming it first, then its file is deleted."""
        rec = self.episode(episode_id)
        self._commit(None, b"", None, evict=[rec.episode_id])

    def admit(self, episode_id: str, task: str, calls: Sequence[ReferenceCall], max_episodes_per_task: int,
              max_bytes: int | None = None, source: str = "") -> list[str]:
        """Admit a new successful episode online under a size bound; returns evicted ids.

        The bound is per task (eviction only touches this task's pack): at most
        ``max_episodes_per_task`` episodes and, if given, ``max_bytes`` bytes of episode files.
        Victims are the oldest online-admitted episodes, then the oldest offline ones; the new
        episode is never a victim. Admission and eviction are one atomic index update.
        """
        if not _is_int(max_episodes_per_task) or max_episodes_per_task < 1:
            raise ValueError(f"max_episodes_per_task must be a positive int, got {max_episodes_per_task!r}")
        if max_bytes is not None and (not _is_int(max_bytes) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        rec, data, layout = self._prepare(episode_id, task, calls, source, admitted_online=True)
        if max_bytes is not None and rec.bytes > max_bytes:
            raise RepositoryError(f"episode '{episode_id}' alone is {rec.bytes} bytes, above max_bytes={max_bytes}")
        existing = self.episodes(task)
        order = [r for r in existing if r.admitted_online] + [r for r in existing if not r.admitted_online]
        count, total = len(existing) + 1, sum(r.bytes for r in existing) + rec.bytes
        evict = []
        for victim in order:
            if count <= max_episodes_per_task and (max_bytes is None or total <= max_bytes):
                break
            evict.append(victim.episode_id)
            count, total = count - 1, total - victim.bytes
        self._commit(rec, data, layout, evict=evict)
        return evict

    def _prepare(self, episode_id: str, task: str, calls: Sequence[ReferenceCall], source: str,
                 admitted_online: bool) -> tuple[EpisodeRecord, bytes, dict]:
        """Validate and serialise an episode in memory (nothing touches the disk here)."""
        if not isinstance(episode_id, str) or not _EPISODE_ID.match(episode_id):
            raise RepositoryError(f"episode id {episode_id!r} must match {_EPISODE_ID.pattern} (it names a file)")
        if episode_id in self._episodes:
            raise RepositoryError(f"{self.root}: episode '{episode_id}' already exists (remove it first)")
        if not isinstance(task, str) or not task:
            raise RepositoryError(f"episode '{episode_id}': task must be a non-empty string")
        if not calls:
            raise RepositoryError(f"episode '{episode_id}': no calls")
        for i, c in enumerate(calls):
            if not isinstance(c, ReferenceCall):
                raise RepositoryError(f"episode '{episode_id}': call {i} is not a ReferenceCall")
        layout = calls[0].layout()
        for i, c in enumerate(calls):
            if c.layout() != layout:
                raise RepositoryError(
                    f"episode '{episode_id}': call {i} shapes {c.layout()} differ from call 0 {layout}")
        self._check_layout(layout, f"episode '{episode_id}'")
        tensors = {name: torch.stack([getattr(c, name).detach().cpu() for c in calls]).contiguous() for name in FIELDS}
        for name in ("state", "state_history", "retrieval"):
            if not bool(torch.isfinite(tensors[name]).all()):
                raise RepositoryError(f"episode '{episode_id}': '{name}' contains NaN or Inf")
        if int(tensors["masks"].min()) < 0:
            raise RepositoryError(f"episode '{episode_id}': 'masks' contains negative neuron indices")
        data = safetensors.torch.save(tensors, metadata={"episode_id": episode_id, "task": task,
                                                         "format": FORMAT_NAME})
        rec = EpisodeRecord(
            episode_id=episode_id, task=task, num_calls=len(calls), file=f"{EPISODE_DIR}/{episode_id}.safetensors",
            sha256="sha256:" + hashlib.sha256(data).hexdigest(), bytes=len(data), source=str(source),
            admitted_online=bool(admitted_online), added=_now())
        return rec, data, {name: {"dtype": str(FIELDS[name][0]).removeprefix("torch."), "shape": shape}
                           for name, shape in layout.items()}

    def _check_layout(self, layout: dict[str, list[int]], where: str) -> None:
        """Per-call shapes must agree with the repository's parameters and earlier episodes."""
        hist, masks = layout["state_history"], layout["masks"]
        if hist[0] != self.meta.history_len:
            raise RepositoryError(f"{where}: state_history covers {hist[0]} calls, "
                                  f"the repository's history_len is {self.meta.history_len}")
        if masks[0] != len(self.meta.mask_groups):
            raise RepositoryError(f"{where}: masks has {masks[0]} groups, "
                                  f"the repository has {len(self.meta.mask_groups)} mask_groups")
        known = self.call_layout
        if known is not None and known != layout:
            bad = [f"{k}: {layout[k]} vs {known[k]}" for k in FIELDS if layout[k] != known[k]]
            raise RepositoryError(f"{where}: per-call shapes differ from the repository's ({'; '.join(bad)})")

    def _commit(self, rec: EpisodeRecord | None, data: bytes, layout: dict | None, evict: list[str]) -> None:
        """Episode file (atomic), then the index (atomic), then delete evicted files.

        The index is the commit point: if anything fails before it is replaced, the new file is
        removed and the repository is unchanged; evicted files are deleted only after the index
        no longer names them (a crash in between leaves unreferenced files, never dangling
        references).
        """
        new_path = None
        if rec is not None:
            new_path = self.root / rec.file
            _atomic_write(new_path, data)
        old_index, old_episodes = json.loads(json.dumps(self._index)), dict(self._episodes)
        try:
            for eid in evict:
                victim = self._episodes.pop(eid)
                ids = self._index["tasks"][victim.task]
                ids.remove(eid)
                if not ids:
                    del self._index["tasks"][victim.task]
                del self._index["episodes"][eid]
            if rec is not None:
                self._episodes[rec.episode_id] = rec
                self._index["tasks"].setdefault(rec.task, []).append(rec.episode_id)
                self._index["episodes"][rec.episode_id] = {
                    k: v for k, v in asdict(rec).items() if k != "episode_id"}
                if self._index["call_layout"] is None:
                    self._index["call_layout"] = layout
            if not self._episodes:
                self._index["call_layout"] = None
            self._index["updated"] = _now()
            self._write_index()
        except BaseException:
            self._index, self._episodes = old_index, old_episodes
            if new_path is not None:
                new_path.unlink(missing_ok=True)
            raise
        for eid in evict:
            (self.root / old_episodes[eid].file).unlink(missing_ok=True)

    def _write_index(self) -> None:
        _atomic_write(self.root / INDEX_FILE, (json.dumps(self._index, indent=2) + "\n").encode("utf-8"))

    # ---------------------------------------------------------------- validation

    def _check_episode_file(self, rec: EpisodeRecord, verify: bool) -> None:
        path = self.root / rec.file
        where = f"{path} (episode '{rec.episode_id}')"
        if not path.is_file():
            raise RepositoryError(f"{where}: file is missing")
        size = path.stat().st_size
        if size != rec.bytes:
            raise RepositoryError(
                f"{where}: file is {size} bytes, index.json records {rec.bytes} (truncated or replaced)")
        if verify:
            digest = _sha256_file(path)
            if digest != rec.sha256:
                raise RepositoryError(f"{where}: sha256 mismatch (index.json {rec.sha256}, file {digest}); "
                                      f"the file is damaged or was modified")
        header, metadata = _read_safetensors_header(path, where)
        if metadata.get("episode_id") != rec.episode_id or metadata.get("task") != rec.task:
            raise RepositoryError(f"{where}: header metadata names episode {metadata.get('episode_id')!r} / task "
                                  f"{metadata.get('task')!r}, index.json says {rec.episode_id!r} / {rec.task!r}")
        if set(header) != set(FIELDS):
            raise RepositoryError(f"{where}: tensors {sorted(header)}, expected {sorted(FIELDS)}")
        layout = self.call_layout
        for name, (_, tag, _) in FIELDS.items():
            info = header[name]
            want = [rec.num_calls] + layout[name]
            if info["dtype"] != tag or list(info["shape"]) != want:
                raise RepositoryError(f"{where}: tensor '{name}' is {info['dtype']} {info['shape']}, "
                                      f"expected {tag} {want}")

    def _check_loaded(self, rec: EpisodeRecord, tensors: Mapping[str, Tensor], path: Path) -> None:
        layout = self.call_layout or {}
        for name, (dtype, _, _) in FIELDS.items():
            t = tensors.get(name)
            if t is None:
                raise RepositoryError(f"{path}: tensor '{name}' is missing")
            want = [rec.num_calls] + layout.get(name, list(t.shape[1:]))
            if t.dtype != dtype or list(t.shape) != want:
                raise RepositoryError(f"{path}: tensor '{name}' is {t.dtype} {tuple(t.shape)}, expected {dtype} {want}")


def _check_index(index: object, path: Path) -> None:
    """Schema check of index.json; each message names the field at fault."""
    if not isinstance(index, dict):
        raise RepositoryError(f"{path}: not a JSON object")
    if index.get("format") != FORMAT_NAME:
        raise RepositoryError(f"{path}: field 'format' is {index.get('format')!r}, expected {FORMAT_NAME!r}")
    if index.get("format_version") != FORMAT_VERSION:
        raise RepositoryError(f"{path}: field 'format_version' is {index.get('format_version')!r}; "
                              f"this runtime reads version {FORMAT_VERSION}")
    required = ("checkpoint_hash", "model", "retrieval_layer", "rho_n", "mask_groups", "history_len",
                "created", "updated", "call_layout", "tasks", "episodes")
    for key in required:
        if key not in index:
            raise RepositoryError(f"{path}: field '{key}' is missing")
    try:
        RepositoryMeta(checkpoint_hash=index["checkpoint_hash"], model=index["model"],
                       retrieval_layer=index["retrieval_layer"], rho_n=index["rho_n"],
                       mask_groups=index["mask_groups"], history_len=index["history_len"],
                       format_version=index["format_version"], half_timing=_half_timing(index, path))
    except RepositoryError as e:
        raise RepositoryError(f"{path}: {str(e).removeprefix('RepositoryMeta: ')}") from None
    layout = index["call_layout"]
    if layout is not None:
        if not isinstance(layout, dict) or set(layout) != set(FIELDS):
            raise RepositoryError(f"{path}: field 'call_layout' must name exactly {sorted(FIELDS)}")
        for name, (dtype, _, rank) in FIELDS.items():
            spec = layout[name]
            if (not isinstance(spec, dict) or spec.get("dtype") != str(dtype).removeprefix("torch.")
                    or not isinstance(spec.get("shape"), list) or len(spec["shape"]) != rank
                    or not all(_is_int(s) and s > 0 for s in spec["shape"])):
                raise RepositoryError(f"{path}: field 'call_layout.{name}' is {spec!r}, expected "
                                      f"dtype {str(dtype).removeprefix('torch.')} with {rank} positive dims")
    episodes, tasks = index["episodes"], index["tasks"]
    if not isinstance(episodes, dict) or not isinstance(tasks, dict):
        raise RepositoryError(f"{path}: fields 'episodes' and 'tasks' must be JSON objects")
    for task, ids in tasks.items():
        if not task or not isinstance(ids, list) or not all(isinstance(e, str) for e in ids):
            raise RepositoryError(f"{path}: field tasks[{task!r}] must be a list of episode ids")
    if episodes and layout is None:
        raise RepositoryError(f"{path}: field 'call_layout' is null but the repository has episodes")
    names = {f.name: f.type for f in fields(EpisodeRecord) if f.name != "episode_id"}
    for eid, rec in episodes.items():
        where = f"{path}: episodes['{eid}']"
        if not _EPISODE_ID.match(eid):
            raise RepositoryError(f"{where}: invalid episode id")
        if not isinstance(rec, dict) or not set(rec) <= set(names):
            raise RepositoryError(f"{where}: must be an object with fields {sorted(names)}")
        rec.setdefault("added", "")
        rec.setdefault("source", "")
        rec.setdefault("admitted_online", False)
        for key in ("task", "file", "sha256", "source", "added"):
            if not isinstance(rec.get(key), str):
                raise RepositoryError(f"{where}: field '{key}' must be a string")
        for key in ("num_calls", "bytes"):
            if not _is_int(rec.get(key)) or rec[key] < 1:
                raise RepositoryError(f"{where}: field '{key}' must be a positive int")
        if not isinstance(rec["admitted_online"], bool):
            raise RepositoryError(f"{where}: field 'admitted_online' must be a bool")
        if rec["file"] != f"{EPISODE_DIR}/{eid}.safetensors":
            raise RepositoryError(
                f"{where}: field 'file' must be '{EPISODE_DIR}/{eid}.safetensors', got {rec['file']!r}")
        if eid not in tasks.get(rec["task"], []):
            raise RepositoryError(f"{where}: not listed under tasks[{rec['task']!r}]")
    listed = [(task, eid) for task, ids in tasks.items() for eid in ids]
    for task, eid in listed:
        if eid not in episodes or episodes[eid]["task"] != task:
            raise RepositoryError(f"{path}: tasks[{task!r}] lists {eid!r}, which is not an episode of that task")
    if len(listed) != len(episodes):
        raise RepositoryError(f"{path}: field 'tasks' lists some episodes more than once")


def _half_timing(index: dict, path: object) -> HalfTiming | None:
    """The recorded half timing, or None where the index has none (older repositories)."""
    raw = index.get("half_timing")
    if raw is None:
        return None
    try:
        return HalfTiming.from_dict(raw, where="field 'half_timing'")
    except ValueError as e:
        raise RepositoryError(f"{path}: {e}") from None


def _dict_diff(have: object, want: object, prefix: str = "") -> list[str]:
    """Human-readable differences between two JSON values (dotted paths)."""
    if isinstance(have, dict) and isinstance(want, dict):
        out = []
        for key in sorted(set(have) | set(want), key=str):
            p = f"{prefix}.{key}" if prefix else str(key)
            if key not in have:
                out.append(f"'{p}' absent from the repository, loaded model has {want[key]!r}")
            elif key not in want:
                out.append(f"'{p}' is {have[key]!r} in the repository, absent from the loaded model")
            else:
                out += _dict_diff(have[key], want[key], p)
        return out
    if have != want:
        return [f"'{prefix or '<root>'}' repository={have!r} loaded={want!r}"]
    return []
