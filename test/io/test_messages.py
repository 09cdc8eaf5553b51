"""Images and joint states from messages, shared by the nodes and the bag reader: bad messages
become InputError diagnostics, good ones exact arrays."""

from __future__ import annotations

from types import SimpleNamespace as NS

import cv2
import numpy as np
import pytest

from vla_runtime.io.messages import InputError, JointStateAssembler, image_from_msg


def _image(h=4, w=5, enc="rgb8", data=None):
    ch = {"rgb8": 3, "bgr8": 3, "mono8": 1}.get(enc, 3)
    arr = np.arange(h * w * ch, dtype=np.uint8).reshape(h, w * ch)
    return NS(height=h, width=w, encoding=enc, step=w * ch, data=arr.tobytes() if data is None else data)


def test_images_decode_and_bad_ones_are_diagnosed():
    rgb = image_from_msg(_image(), compressed=False, camera="top")
    assert rgb.shape == (4, 5, 3) and rgb.dtype == np.uint8
    bgr = image_from_msg(_image(enc="bgr8"), compressed=False, camera="top")
    np.testing.assert_array_equal(bgr, rgb[..., ::-1])
    ok, png = cv2.imencode(".png", np.zeros((6, 7, 3), np.uint8))
    assert image_from_msg(NS(format="png", data=png.tobytes()), compressed=True, camera="wrist").shape == (6, 7, 3)
    for msg, compressed, what in [(_image(enc="yuv422"), False, "unsupported Image encoding"),
                                  (_image(data=b"\x00" * 3), False, "inconsistent"),
                                  (NS(format="jpeg", data=b"not a jpeg"), True, "could not decode"),
                                  (NS(format="jpeg", data=b""), True, "no data")]:
        with pytest.raises(InputError, match=f"camera 'top': .*{what}"):
            image_from_msg(msg, compressed, camera="top")


def test_joint_states_assemble_in_profile_order():
    js = JointStateAssembler(["a1", "a2", "b1"])
    assert not js.complete()
    with pytest.raises(InputError, match=r"no joint state received yet for \['a1', 'a2', 'b1'\]"):
        js.vector()
    js.update(NS(name=["a2", "a1", "extra"], position=[2.0, 1.0, 9.0]), stamp_ns=5)
    js.update(NS(name=["b1"], position=[3.0]), stamp_ns=7)
    np.testing.assert_array_equal(js.vector(), [1.0, 2.0, 3.0])
    assert js.oldest_stamp_ns() == 5
    with pytest.raises(InputError, match="non-finite"):
        js.update(NS(name=["a1"], position=[float("nan")]), stamp_ns=8)
    with pytest.raises(InputError, match="2 names but 1 positions"):
        js.update(NS(name=["a1", "a2"], position=[0.0]), stamp_ns=8)
    with pytest.raises(InputError, match="match none"):
        js.update(NS(name=["zz"], position=[0.0]), stamp_ns=8)
    np.testing.assert_array_equal(js.vector(), [1.0, 2.0, 3.0])   # refused messages changed nothing
