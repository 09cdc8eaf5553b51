"""Tests for camera image decoding, resize-with-pad and scaling to [-1, 1]."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_runtime.models.preprocess import (
    ImagePreprocessor,
    decode_image,
    resize_with_pad,
    to_model_image,
)


def _lerobot_resize_with_pad(img_hwc01: np.ndarray, height: int, width: int) -> np.ndarray:
    """Independent restatement of LeRobot's resize_with_pad_torch for float [0, 1] input."""
    t = torch.from_numpy(img_hwc01).permute(2, 0, 1)[None]
    _, _, h, w = t.shape
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    r = F.interpolate(t, size=(rh, rw), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    ph0, rem_h = divmod(height - rh, 2)
    pw0, rem_w = divmod(width - rw, 2)
    r = F.pad(r, (pw0, pw0 + rem_w, ph0, ph0 + rem_h), value=0.0)
    return r[0].permute(1, 2, 0).numpy()


def _rand_rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


# --- decode ------------------------------------------------------------------------------


def test_decode_png_round_trip_is_exact_and_rgb():
    rgb = _rand_rgb(31, 47)
    ok, enc = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok
    out = decode_image(enc.tobytes())
    assert out.dtype == np.uint8 and out.shape == (31, 47, 3)
    np.testing.assert_array_equal(out, rgb)


def test_decode_jpeg_channel_order():
    rgb = np.zeros((16, 16, 3), np.uint8)
    rgb[..., 0] = 250  # pure red in RGB
    ok, enc = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    out = decode_image(bytes(enc))
    assert out.shape == (16, 16, 3)
    assert out[..., 0].mean() > 240 and out[..., 1:].mean() < 10


def test_decode_grayscale_png_gives_three_channels():
    ok, enc = cv2.imencode(".png", np.full((5, 7), 77, np.uint8))
    out = decode_image(enc.tobytes())
    assert out.shape == (5, 7, 3) and (out == 77).all()


@pytest.mark.parametrize("data, msg", [(b"", "0 bytes"), (b"definitely not an image", "could not decode")])
def test_decode_rejects(data, msg):
    with pytest.raises(ValueError, match=msg):
        decode_image(data)


def test_decode_rejects_non_bytes():
    with pytest.raises(ValueError, match="bytes"):
        decode_image("abc")  # type: ignore[arg-type]


# --- resize_with_pad geometry ------------------------------------------------------------


@pytest.mark.parametrize(
    "h, w, content, top, left",
    [
        (480, 640, (168, 224), 28, 0),  # landscape: pad top/bottom equally
        (640, 480, (224, 168), 0, 28),  # portrait: pad left/right
        (100, 301, (74, 224), 75, 0),  # odd padding: 150 -> 75 top, 75 bottom
        (101, 300, (75, 224), 74, 0),  # 149 -> 74 top, 75 bottom (extra row at the bottom)
        (50, 50, (224, 224), 0, 0),  # upscale, no padding
    ],
)
def test_resize_with_pad_geometry(h, w, content, top, left):
    img = np.full((h, w, 3), 200, np.uint8)
    out = resize_with_pad(img, 224)
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8
    ch, cw = content
    inside = out[top : top + ch, left : left + cw]
    assert (inside == 200).all()
    assert int((out != 0).any(axis=2).sum()) == ch * cw  # everything else is black padding


def test_resize_with_pad_top_left_mode():
    out = resize_with_pad(np.full((480, 640, 3), 9, np.uint8), 224, pad_mode="top_left")
    assert (out[56:, :] == 9).all() and (out[:56] == 0).all()


def test_resize_with_pad_same_size_is_copy():
    img = _rand_rgb(224, 224)
    out = resize_with_pad(img)
    np.testing.assert_array_equal(out, img)
    assert out is not img


def test_resize_with_pad_non_square_target():
    out = resize_with_pad(np.ones((100, 100, 3), np.float32), (50, 80))
    assert out.shape == (50, 80, 3)
    assert (out[:, 15:65] == 1).all() and (out[:, :15] == 0).all() and (out[:, 65:] == 0).all()


@pytest.mark.parametrize("hw", [(480, 640), (37, 41), (224, 500), (300, 200)])
def test_resize_matches_lerobot_reference(hw):
    img = _rand_rgb(*hw, seed=1).astype(np.float32) / 255.0
    ref = _lerobot_resize_with_pad(img, 224, 224)
    exact = resize_with_pad(img, 224, backend="torch")
    np.testing.assert_array_equal(exact, ref)
    approx = resize_with_pad(img, 224, backend="cv2")
    np.testing.assert_allclose(approx, ref, atol=2e-4, rtol=0)


def test_resize_rejects():
    with pytest.raises(ValueError, match="HW|H, W, C"):
        resize_with_pad(np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match="empty"):
        resize_with_pad(np.zeros((0, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="dtype"):
        resize_with_pad(np.zeros((4, 4, 3), np.int32))
    with pytest.raises(ValueError, match="pad mode"):
        resize_with_pad(np.zeros((4, 8, 3), np.uint8), 224, pad_mode="middle")  # type: ignore[arg-type]


# --- to_model_image ----------------------------------------------------------------------


def test_to_model_image_range_and_padding_value():
    img = np.full((120, 160, 3), 255, np.uint8)
    out = to_model_image(img)
    assert out.shape == (3, 224, 224) and out.dtype == torch.float32
    assert out.min().item() == -1.0 and out.max().item() == 1.0
    assert (out[:, :28] == -1).all() and (out[:, 28:196] == 1).all() and (out[:, 196:] == -1).all()


def test_to_model_image_uint8_equals_float_path():
    img = _rand_rgb(224, 224, seed=3)
    a = to_model_image(img)
    b = to_model_image(torch.from_numpy(img).permute(2, 0, 1).float() / 255.0)  # CHW float [0, 1]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, torch.from_numpy(img).permute(2, 0, 1).float() / 255.0 * 2 - 1)


def test_to_model_image_matches_lerobot_pipeline():
    img = _rand_rgb(480, 640, seed=4)
    unit = img.astype(np.float32) / 255.0
    ref = torch.from_numpy(_lerobot_resize_with_pad(unit, 224, 224)).permute(2, 0, 1) * 2.0 - 1.0
    torch.testing.assert_close(to_model_image(img, backend="torch"), ref, rtol=0, atol=0)
    torch.testing.assert_close(to_model_image(img), ref, rtol=0, atol=4e-4)


def test_to_model_image_channel_handling():
    gray = np.full((10, 10), 128, np.uint8)
    g = to_model_image(gray, 10)
    assert g.shape == (3, 10, 10) and torch.equal(g[0], g[1]) and torch.equal(g[1], g[2])
    gray1 = to_model_image(gray[:, :, None], 10)
    assert torch.equal(g, gray1)
    rgba = np.concatenate([_rand_rgb(10, 10), np.zeros((10, 10, 1), np.uint8)], axis=2)
    assert torch.equal(to_model_image(rgba, 10), to_model_image(rgba[:, :, :3].copy(), 10))


def test_to_model_image_explicit_layout():
    img = _rand_rgb(20, 30)
    chw = np.ascontiguousarray(img.transpose(2, 0, 1))
    assert torch.equal(to_model_image(chw, 32, layout="chw"), to_model_image(img, 32))


@pytest.mark.parametrize(
    "img, msg",
    [
        (np.zeros((0, 5, 3), np.uint8), "empty"),
        (np.zeros((5, 5, 2), np.uint8), "channels"),
        (np.zeros((3, 5, 5), np.uint8), "channels"),  # CHW numpy without layout='chw'
        (np.zeros((2, 5, 5, 3), np.uint8), "dims"),
        (np.zeros((5, 5, 3), np.int16), "dtype"),
        (np.full((5, 5, 3), np.nan, np.float32), "non-finite"),
        (np.full((5, 5, 3), 255.0, np.float32), r"\[0, 1\]"),
        (np.full((5, 5, 3), -0.5, np.float32), r"\[0, 1\]"),
        (torch.full((3, 5, 5), float("inf")), "non-finite"),
        ("not an image", "numpy array or torch tensor"),
    ],
)
def test_to_model_image_rejects(img, msg):
    with pytest.raises(ValueError, match=msg):
        to_model_image(img)


# --- ImagePreprocessor -------------------------------------------------------------------


def test_image_preprocessor():
    pre = ImagePreprocessor()
    img = _rand_rgb(48, 64)
    ok, enc = cv2.imencode(".png", cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    assert torch.equal(pre.from_bytes(enc.tobytes()), pre(img))
    batch = pre.batch([img, img])
    assert batch.shape == (2, 3, 224, 224)
    blank = pre.blank(2)
    assert blank.shape == (2, 3, 224, 224) and (blank == -1).all()
    assert pre.blank().shape == (3, 224, 224)


def test_image_preprocessor_validates():
    with pytest.raises(ValueError, match="pad_mode"):
        ImagePreprocessor(pad_mode="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        ImagePreprocessor(backend="pil")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        ImagePreprocessor(size=(0, 224))
