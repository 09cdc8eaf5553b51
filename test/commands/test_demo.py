"""``vla-runtime demo-data``: the stored weights' dtype (full pi05 is written in bfloat16 on a
24 GB machine, where float32 and its copy while saving do not fit)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from vla_runtime.commands.demo import DemoSpec, make_demo
from vla_runtime.engine.policy import Pi05Policy


def test_a_bfloat16_demo_checkpoint_stores_bfloat16_and_loads(tmp_path):
    info = make_demo(tmp_path / "d", DemoSpec(preset="pi05-tiny", episodes=2, held_out=1, checkpoint_dtype="bfloat16"),
                     log=lambda *_: None)
    with safe_open(str(tmp_path / "d" / "checkpoint" / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    policy = Pi05Policy.from_checkpoint(info["checkpoint"], camera_names=info["cameras"])
    assert next(policy.engine.model.parameters()).dtype == torch.float32   # the runtime's dtype is its own


def test_another_checkpoint_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="checkpoint_dtype must be one of"):
        DemoSpec(checkpoint_dtype="float16").validate()
