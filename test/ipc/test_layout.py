"""Slot layouts: 64-byte field offsets, and a tag that changes with anything readers must agree on."""

from __future__ import annotations

import pytest
import torch

from vla_runtime.ipc.layout import ALIGN, FieldSpec, SlotLayout


def _layout(**over) -> SlotLayout:
    fields = over.pop("fields", (FieldSpec("k0", (1, 10, 64), torch.float32), FieldSpec("state", (7,), torch.float32),
                                 FieldSpec("mask", (10,), torch.bool)))
    return SlotLayout(tuple(fields), **over)


def test_offsets_are_aligned_and_do_not_overlap():
    layout = _layout()
    assert layout.offsets[0] == 0
    for (f, off), nxt in zip(zip(layout.fields, layout.offsets), layout.offsets[1:]):
        assert off % ALIGN == 0 and nxt % ALIGN == 0
        assert off + f.nbytes <= nxt
    assert layout.offsets == (0, 2560, 2560 + 64)
    assert layout.nbytes % ALIGN == 0 and layout.nbytes >= layout.offsets[-1] + 10


@pytest.mark.parametrize("change", [
    dict(version=2),
    dict(fields=(FieldSpec("k1", (1, 10, 64), torch.float32), FieldSpec("state", (7,), torch.float32),
                 FieldSpec("mask", (10,), torch.bool))),
    dict(fields=(FieldSpec("k0", (1, 11, 64), torch.float32), FieldSpec("state", (7,), torch.float32),
                 FieldSpec("mask", (10,), torch.bool))),
    dict(fields=(FieldSpec("k0", (1, 10, 64), torch.bfloat16), FieldSpec("state", (7,), torch.float32),
                 FieldSpec("mask", (10,), torch.bool))),
    dict(fields=(FieldSpec("state", (7,), torch.float32), FieldSpec("k0", (1, 10, 64), torch.float32),
                 FieldSpec("mask", (10,), torch.bool))),
])
def test_tag_changes_with_names_shapes_dtypes_order_and_version(change):
    base, other = _layout(), _layout(**change)
    assert len(base.tag) == 32 and int(base.tag, 16) >= 0
    assert base.tag == _layout().tag  # deterministic
    assert other.tag != base.tag
    assert base.diff(other)  # and the difference can be named


def test_diff_names_what_differs():
    a = _layout()
    b = SlotLayout((FieldSpec("k0", (1, 12, 64), torch.float32), FieldSpec("extra", (1,), torch.int64)), version=3)
    text = a.diff(b)
    assert "version 1 vs 3" in text
    assert "k0[1, 10, 64]:float32 vs k0[1, 12, 64]:float32" in text
    assert "['extra']" in text and "'state'" in text and "'mask'" in text
    assert a.diff(_layout()) == ""


def test_json_round_trip_keeps_the_tag():
    a = _layout(version=4)
    b = SlotLayout.from_json(a.to_json())
    assert b == a and b.tag == a.tag and b.offsets == a.offsets


@pytest.mark.parametrize("make, message", [
    (lambda: FieldSpec("", (1,), torch.float32), "identifier"),
    (lambda: FieldSpec("a b", (1,), torch.float32), "identifier"),
    (lambda: FieldSpec("x", (0, 3), torch.float32), ">= 1"),
    (lambda: FieldSpec("x", (2.5,), torch.float32), "int >= 1"),
    (lambda: FieldSpec("x", 3, torch.float32), "sequence of ints"),
    (lambda: FieldSpec("x", (1,), "float32"), "dtype"),
    (lambda: FieldSpec("x", (1,), torch.complex64), "dtype"),
    (lambda: SlotLayout(()), "at least one field"),
    (lambda: SlotLayout((FieldSpec("a", (1,), torch.float32), FieldSpec("a", (2,), torch.int64))), "repeated: ['a']"),
    (lambda: SlotLayout((FieldSpec("a", (1,), torch.float32),), version=0), "version"),
    (lambda: SlotLayout(("a",)), "FieldSpec"),
])
def test_invalid_specs_are_refused_with_a_clear_message(make, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_field_lookup():
    layout = _layout()
    assert layout.field("state").shape == (7,)
    with pytest.raises(KeyError, match="no field 'nope'"):
        layout.field("nope")
