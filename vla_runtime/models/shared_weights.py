"""Model weights shared, not copied, between processes on CPU (DESIGN §3, last bullet).

Every process of the runtime (vision, policy, cache manager) holds the same pi0.5 weights. Loaded
the normal way, each builds its own private fused copy (fused QKV, blocked gate/up MLP, norms with
``1 + w`` folded, time-modulation tables): 3 processes of the full model hold 3 x ~7 GB. Here the
first process to load a checkpoint writes the model's *runtime* state (every parameter and every
weight-derived buffer, already fused, in the runtime dtype) to one safetensors file in a cache
directory, and every process then maps that file and points each parameter at its bytes. The
kernel keeps one copy of the pages in its page cache for all of them.

Decisions and why:

* **Read-only shared mapping** (``mmap.ACCESS_READ``: ``MAP_SHARED`` + ``PROT_READ``). Clean file
  pages are shared by every process that maps them, a write through the mapping can never reach
  the file (so one process cannot corrupt the weights of the others), and a read-only mapping is
  not charged to the commit limit (a writable private mapping is charged in full under strict
  overcommit, which would defeat the sharing there). Inference never writes a weight; an
  accidental in-place write to one is a bug and faults at once instead of silently un-sharing
  pages. ``copy_on_write=True`` (``ACCESS_COPY``: ``MAP_PRIVATE``) is there for callers that
  must write: clean pages are still shared, written pages become private to the writer.
* **Only weights are mapped.** KV caches (``KVCache`` buffers) and the denoising ``Workspace``
  are written on every call; they stay private allocations and are never exported or mapped.
* **Alignment.** The writer starts every tensor at a multiple of 64 bytes of the file (the header
  is padded, and explicit ``__pad__.N`` byte tensors fill the gaps because safetensors forbids
  holes between tensors), like torch's own allocations, so every tensor is a zero-copy view and
  kernels see the same alignment as after a normal load. A file from elsewhere whose tensor is not
  aligned to its element size gets that one tensor copied into private memory (reported in
  ``SharedWeights.copied``); never for files written here.
* **Keyed, verified, atomic.** The file name is derived from the checkpoint's content hash, the
  architecture (``config.json`` changes the derived tables), the runtime dtype, the runtime-layout
  version (``RUNTIME_LAYOUT_VERSION``: a changed fusion never reuses an old file) and the torch
  version (the derived tables are computed by torch kernels). Builders hold an exclusive
  ``flock`` so processes starting together build once and all map the same inode, and write to a
  temporary file that is fsynced and ``os.replace``-d into place: a reader sees a complete file
  or none. On reuse the header is checked against the model (names, shapes, dtypes, offsets
  inside the file, the key's metadata); a stale, truncated or damaged file is rebuilt (with a
  warning) by the loader, and refused with a ``SharedWeightsError`` by ``map_shared``.

On GPU the design shares weights differently (one owner exports them through CUDA IPC); that is
not this module.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import mmap
import os
import re
import struct
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from ..io.files import fsync_dir
from .checkpoint_meta import CheckpointError
from .config import Pi05Config, config_to_dict
from .layers import KVCache
from .pi05 import Pi05Model

# Version of the fused in-memory layout built at load (``checkpoint.layout_groups``' fusions,
# the derived buffers of ``Pi05Model.refresh_derived``). Shared weight files hold that layout
# and are keyed by this number: bump it whenever the layout changes, even when the shapes stay
# the same, so that no process ever maps a file written in an older layout.
# 2: the text embedding comes from embed_tokens (was lm_head); a file built by version 1 from a
# checkpoint whose two tensors differ holds the wrong embedding.
RUNTIME_LAYOUT_VERSION = 2
CACHE_ENV = "VLA_RUNTIME_CACHE"
FORMAT = "vla_runtime.shared_weights"
ALIGN = 64
_PAD = "__pad__."
_MAX_HEADER = 100 << 20  # the reference safetensors reader's limit too
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
# Modules whose buffers are runtime state written on every call, never weights.
_RUNTIME_STATE_MODULES: tuple[type[nn.Module], ...] = (KVCache,)


class SharedWeightsError(CheckpointError):
    """A shared weight file cannot be used for this model (stale, damaged, or not one of ours)."""


@dataclass(frozen=True)
class SharedWeights:
    """What ``map_shared`` did: which file, how much is mapped, what had to be copied."""

    path: Path
    nbytes: int                  # tensor bytes now viewed in the file (copied ones excluded)
    tensors: int                 # tensors replaced (mapped or copied)
    copied: tuple[str, ...] = ()  # tensors copied into private memory (misaligned in the file)
    writable: bool = False       # mapped copy-on-write (ACCESS_COPY) instead of read-only
    built: bool = False          # this process wrote the file (set by the loader)


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


@dataclass(frozen=True)
class _FileLayout:
    tensors: dict[str, _Entry]
    metadata: dict[str, str]
    size: int


# --------------------------------------------------------------------------- what is shared
def _slots(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool, Tensor]]:
    """Every weight slot: (qualified name, owner, attribute, is parameter, tensor), aliases included.

    Buffers of runtime-state modules (the KV caches, attached after loading) are skipped: they
    are written on every call and must stay private.
    """
    skip: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        if any(prefix == s or prefix.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, _RUNTIME_STATE_MODULES):
            skip.append(prefix)
            continue
        dot = prefix + "." if prefix else ""
        for attr, t in module._parameters.items():
            if t is not None:
                yield dot + attr, module, attr, True, t
        for attr, t in module._buffers.items():
            if t is not None:
                yield dot + attr, module, attr, False, t


def weight_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The runtime weights of ``model`` by name: parameters and weight-derived buffers (folded
    norm scales, modulation tables), one entry per tensor even when it is reachable twice."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, _, _, _, t in _slots(model):
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def runtime_skeleton(cfg: Pi05Config, dtype: torch.dtype) -> Pi05Model:
    """A ``Pi05Model`` on the meta device whose tensors have the shapes and dtypes of a loaded one.

    ``load_checkpoint`` casts the parameters to ``dtype`` and then derives the fp32 buffers; doing
    the same on meta tensors costs nothing and gives the exact specification a shared file must
    satisfy, without reading a single weight.
    """
    with torch.device("meta"):
        model = Pi05Model(cfg)
    model.to(dtype)
    model.refresh_derived()
    return model.eval().requires_grad_(False)


# --------------------------------------------------------------------------- naming the file
def default_cache_dir() -> Path:
    """``$VLA_RUNTIME_CACHE`` when set, else ``~/.cache/vla_runtime/weights``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vla_runtime" / "weights"


def shared_metadata(checkpoint_hash: str, cfg: Pi05Config, dtype: torch.dtype) -> dict[str, str]:
    """Everything the runtime state depends on besides the code; stored in the file's header."""
    arch = json.dumps(config_to_dict(cfg), sort_keys=True)
    return {
        "format": FORMAT,
        "runtime_layout_version": str(RUNTIME_LAYOUT_VERSION),
        "checkpoint_hash": checkpoint_hash,
        "arch_sha256": hashlib.sha256(arch.encode()).hexdigest(),
        "dtype": _DTYPE_NAMES[dtype],
        "torch": torch.__version__,
    }


def shared_weights_path(metadata: dict[str, str], cache_dir: str | Path | None = None) -> Path:
    """Cache file for a key: readable parts first, then a digest of the whole key."""
    key = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()).hexdigest()[:16]
    ckpt = metadata["checkpoint_hash"].split(":")[-1][:16]
    name = f"pi05-{ckpt}-{metadata['dtype'].lower()}-rl{metadata['runtime_layout_version']}-{key}.safetensors"
    return Path(cache_dir).expanduser() / name if cache_dir is not None else default_cache_dir() / name


# --------------------------------------------------------------------------- writing
def _plan(tensors: dict[str, Tensor], metadata: dict[str, str]) -> tuple[bytes, list[tuple[str, int, Tensor | None]]]:
    """Header bytes and the write order (name, padding before it, tensor) with 64-byte alignment.

    Offsets in the header are relative to the data start, which the header padding puts at a
    multiple of ``ALIGN``; gaps are filled by explicit byte tensors (safetensors forbids holes).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    order: list[tuple[str, int, Tensor | None]] = []
    pos = 0
    for name, t in tensors.items():
        if name.startswith(_PAD):
            raise ValueError(f"tensor name {name!r} collides with the padding entries")
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored")
        gap = -pos % ALIGN
        if gap:
            pad = f"{_PAD}{len(order)}"
            header[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
            order.append((pad, gap, None))
            pos += gap
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        order.append((name, 0, t))
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # trailing spaces: allowed, and aligns the data start
    return raw, order


def export_runtime_state(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``model``'s runtime weights to ``path`` atomically (temporary file, fsync, rename).

    A process killed half-way leaves only its temporary file behind, never a partial ``path``;
    a concurrent reader opens either the previous complete file or the new one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = weight_tensors(model)
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}: shared weight files are built from a CPU model")
    header, order = _plan(tensors, metadata or {})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for _, gap, t in order:
                if t is None:
                    f.write(bytes(gap))
                elif t.numel():
                    f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # other users' processes (ROS nodes) map it too; it holds no secrets
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


# --------------------------------------------------------------------------- reading + checking
def _read_layout(fd: int, path: Path) -> _FileLayout:
    """Parse and sanity-check the header of the open file ``fd`` (the very inode that gets mapped)."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise SharedWeightsError(f"{path}: truncated shared weight file ({size} bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
        raise SharedWeightsError(f"{path}: truncated: header declares {n} bytes, file has {size}")
    if n > _MAX_HEADER:  # a damaged length field must not make us read gigabytes as JSON
        raise SharedWeightsError(f"{path}: corrupt shared weight file header (declares {n} bytes)")
    try:
        header = json.loads(os.pread(fd, n, 8))
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ValueError("metadata is not a mapping")
        start = 8 + n
        tensors: dict[str, _Entry] = {}
        for name, h in header.items():
            if h["dtype"] not in _DTYPES:
                raise ValueError(f"{name}: unknown dtype {h['dtype']!r}")
            dtype = _DTYPES[h["dtype"]]
            shape = tuple(int(s) for s in h["shape"])
            b, e = (int(x) for x in h["data_offsets"])
            if b < 0 or b > e or e - b != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{name}: {e - b} bytes for shape {list(shape)} {h['dtype']}")
            tensors[name] = _Entry(dtype, shape, start + b, start + e)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SharedWeightsError(f"{path}: corrupt shared weight file header ({e})") from None
    end = max((t.end for t in tensors.values()), default=8 + n)
    if end > size:
        raise SharedWeightsError(f"{path}: truncated: tensors need {end} bytes, file has {size}")
    return _FileLayout(tensors, {str(k): str(v) for k, v in metadata.items()}, size)


def _check(layout: _FileLayout, expected: dict[str, Tensor], expect_metadata: dict[str, str] | None,
           path: Path) -> None:
    """Refuse the file unless it holds exactly the model's weights (names, shapes, dtypes, key)."""
    problems: list[str] = []
    if expect_metadata is not None:
        for k, v in expect_metadata.items():
            if layout.metadata.get(k) != v:
                problems.append(f"metadata {k}: file has {layout.metadata.get(k)!r}, expected {v!r}")
    stored = {k: e for k, e in layout.tensors.items() if not k.startswith(_PAD)}
    missing = sorted(k for k in expected if k not in stored)
    unexpected = sorted(k for k in stored if k not in expected)
    mismatched = sorted(
        f"{k}: file {stored[k].dtype} {list(stored[k].shape)}, model {t.dtype} {list(t.shape)}"
        for k, t in expected.items() if k in stored and (stored[k].dtype != t.dtype or stored[k].shape != tuple(t.shape)))
    for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                         ("mismatched tensors", mismatched)):
        if items:
            shown = ", ".join(items[:5]) + (f", ... and {len(items) - 5} more" if len(items) > 5 else "")
            problems.append(f"{title} ({len(items)}): {shown}")
    if problems:
        raise SharedWeightsError(f"{path}: shared weight file does not match the model:\n  " + "\n  ".join(problems))


def _view(mm: mmap.mmap, e: _Entry) -> tuple[Tensor, bool]:
    """A tensor over ``mm`` for entry ``e`` (zero copy), or a private copy when misaligned."""
    numel = math.prod(e.shape)
    if numel == 0:
        return torch.empty(e.shape, dtype=e.dtype), False
    with warnings.catch_warnings():
        # torch warns that a read-only buffer gives a tensor it could write to; read-only is the
        # point here (the kernel refuses the write), so the warning says nothing useful.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        if e.begin % e.dtype.itemsize:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=e.end - e.begin, offset=e.begin)
            return raw.clone().view(e.dtype).view(e.shape), True
        return torch.frombuffer(mm, dtype=e.dtype, count=numel, offset=e.begin).view(e.shape), False


def map_shared(model: nn.Module, path: str | Path, *, expect_metadata: dict[str, str] | None = None,
               copy_on_write: bool = False) -> SharedWeights:
    """Point every weight of ``model`` at its bytes in the shared file ``path``, in place.

    The file is checked against the model first (and against ``expect_metadata``); on any
    mismatch a ``SharedWeightsError`` names it and the model is left untouched. ``model`` may be a
    loaded model (its private weights are released) or a ``runtime_skeleton`` on the meta device.
    KV caches stay private. Read-only mapping by default (see the module docstring).
    """
    path = Path(path)
    slots = list(_slots(model))
    expected = weight_tensors(model)
    canonical = {id(t): name for name, t in expected.items()}
    fd = os.open(path, os.O_RDONLY)
    try:
        layout = _read_layout(fd, path)
        _check(layout, expected, expect_metadata, path)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY if copy_on_write else mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the mapping keeps the inode; a later os.replace of the path does not affect it
    views: dict[str, Tensor] = {}
    copied: list[str] = []
    for name in expected:
        views[name], was_copied = _view(mm, layout.tensors[name])
        if was_copied:
            copied.append(name)
    for _, module, attr, is_param, t in slots:
        view = views[canonical[id(t)]]
        if is_param:
            module._parameters[attr] = nn.Parameter(view, requires_grad=False)
        else:
            module._buffers[attr] = view
    nbytes = sum(v.nbytes for k, v in views.items() if k not in copied)
    return SharedWeights(path, nbytes, len(views), tuple(copied), copy_on_write)


# --------------------------------------------------------------------------- the loader
@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Exclusive lock beside ``path``: processes starting together build the file once.

    ``flock`` is dropped by the kernel when its holder dies, so a crashed builder never blocks
    the next one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load_shared_model(cfg: Pi05Config, checkpoint_hash: str, dtype: torch.dtype, build: Callable[[], nn.Module],
                      cache_dir: str | Path | None = None) -> tuple[Pi05Model, SharedWeights]:
    """The model of ``cfg`` with its weights mapped from the shared runtime-layout file.

    First use of a checkpoint (per dtype, layout version, torch version): ``build()`` loads it
    the normal way, its fused weights are written to the cache and the private copy dropped.
    Later processes build the model on the meta device and map the file: no private copy ever
    exists. ``build`` is passed in by the checkpoint loader
    (``checkpoint.load_checkpoint(share_weights=True)``, which reads the layout and the hash),
    so this module never calls back into it.
    """
    meta = shared_metadata(checkpoint_hash, cfg, dtype)
    target = shared_weights_path(meta, cache_dir)
    model = runtime_skeleton(cfg, dtype)
    try:
        info = map_shared(model, target, expect_metadata=meta)
    except (FileNotFoundError, SharedWeightsError):
        with _build_lock(target):
            try:  # another process may have built it while we waited for the lock
                info = map_shared(model, target, expect_metadata=meta)
            except (FileNotFoundError, SharedWeightsError) as e:
                if isinstance(e, SharedWeightsError):
                    warnings.warn(f"rebuilding the shared weight file: {e}", RuntimeWarning, stacklevel=3)
                # Builders write only under this lock, so a temporary file of this target now is
                # what a killed builder left behind (as large as the model): remove it.
                for stale in target.parent.glob(f".{target.name}.*.tmp"):
                    stale.unlink(missing_ok=True)
                export_runtime_state(build(), target, meta)   # the private copy is dropped on return
                info = replace(map_shared(model, target, expect_metadata=meta), built=True)
    return model, info


# --------------------------------------------------------------------------- measuring
_SMAPS_FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")
_VMA = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ [0-9a-f]+ \S+ \d+\s*(.*)$")


def mapping_usage(path: str | Path, pid: int | str = "self") -> dict[str, int]:
    """Bytes of ``/proc/<pid>/smaps`` fields summed over the mappings of file ``path``.

    ``Pss`` well below ``Rss`` (and ``Shared_*`` close to ``Rss``) is the proof that the weight
    pages are shared with other processes; ``Private_Dirty`` > 0 would mean copied-on-write pages.
    """
    target = os.path.realpath(path)
    usage = dict.fromkeys(_SMAPS_FIELDS, 0)
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _VMA.match(line)
            if m:
                inside = m.group(1) == target
                continue
            if inside:
                key, _, rest = line.partition(":")
                if key in usage:
                    usage[key] += int(rest.split()[0]) * 1024
    return usage
