"""What one ring-buffer slot holds: named fields with fixed shapes and dtypes, packed at 64-byte offsets.

The layout is agreed between processes that never share Python objects, so it travels as a short
``tag`` (a digest of names, shapes, dtypes and version) in the ring's control block, next to a
JSON description. A reader whose layout has a different tag is refused before it interprets a
single byte, and the description lets the refusal say *what* differs instead of just "mismatch".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

ALIGN = 64  # cache-line alignment: fields never share a line, and every dtype view is aligned

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool)
}


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FieldSpec:
    """One tensor of a slot. ``shape`` is fixed: slots are allocated once and never resized."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isidentifier():
            raise ValueError(f"FieldSpec name must be a non-empty identifier, got {self.name!r}")
        if not isinstance(self.dtype, torch.dtype) or dtype_name(self.dtype) not in _DTYPES:
            raise ValueError(f"FieldSpec {self.name!r}: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        try:
            shape = tuple(int(s) for s in self.shape)
        except TypeError:
            raise ValueError(f"FieldSpec {self.name!r}: shape must be a sequence of ints, got {self.shape!r}") from None
        if any(s < 1 for s in shape) or any(s != o for s, o in zip(shape, self.shape)):
            raise ValueError(f"FieldSpec {self.name!r}: every dimension must be an int >= 1, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.name}{list(self.shape)}:{dtype_name(self.dtype)}"


@dataclass(frozen=True)
class SlotLayout:
    """Ordered fields of a slot plus a version bumped whenever their *meaning* changes.

    ``offsets[i]`` is the byte offset of ``fields[i]`` inside a slot's payload (64-aligned),
    ``nbytes`` the payload size, ``tag`` a 32-hex-digit digest of everything that must agree.
    """

    fields: tuple[FieldSpec, ...]
    version: int = 1
    offsets: tuple[int, ...] = field(init=False, repr=False)
    nbytes: int = field(init=False, repr=False)
    tag: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fields_ = tuple(self.fields)
        if not fields_:
            raise ValueError("SlotLayout needs at least one field")
        bad = [f for f in fields_ if not isinstance(f, FieldSpec)]
        if bad:
            raise ValueError(f"SlotLayout fields must be FieldSpec, got {bad[0]!r}")
        names = [f.name for f in fields_]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"SlotLayout field names must be unique, repeated: {dup}")
        if not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"SlotLayout version must be an int >= 1, got {self.version!r}")
        offsets, pos = [], 0
        for f in fields_:
            pos = align_up(pos)
            offsets.append(pos)
            pos += f.nbytes
        object.__setattr__(self, "fields", fields_)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "nbytes", align_up(pos))
        object.__setattr__(self, "tag", hashlib.sha256(self.describe().encode()).hexdigest()[:32])

    def describe(self) -> str:
        return f"v{self.version};" + ";".join(f.describe() for f in self.fields)

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r} in layout (fields: {[f.name for f in self.fields]})")

    def to_json(self) -> str:
        return json.dumps({"version": self.version,
                           "fields": [[f.name, list(f.shape), dtype_name(f.dtype)] for f in self.fields]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "SlotLayout":
        d = json.loads(text)
        return cls(tuple(FieldSpec(n, tuple(s), _DTYPES[t]) for n, s, t in d["fields"]), version=d["version"])

    def diff(self, other: "SlotLayout") -> str:
        """Human-readable differences from ``other`` ('' when the tags agree)."""
        if self.tag == other.tag:
            return ""
        out = []
        if self.version != other.version:
            out.append(f"version {self.version} vs {other.version}")
        mine, theirs = {f.name: f for f in self.fields}, {f.name: f for f in other.fields}
        if missing := [n for n in theirs if n not in mine]:
            out.append(f"fields only in the other layout: {missing}")
        if extra := [n for n in mine if n not in theirs]:
            out.append(f"fields only in this layout: {extra}")
        for n in mine:
            if n in theirs and mine[n] != theirs[n]:
                out.append(f"field {mine[n].describe()} vs {theirs[n].describe()}")
        if not out:
            out.append(f"field order {[f.name for f in self.fields]} vs {[f.name for f in other.fields]}")
        return "; ".join(out)
