"""Camera image preprocessing for pi0.5 (decode, resize with padding, scale to [-1, 1]).

This mirrors what LeRobot 0.6.1 does to an image between the dataset/robot and SigLIP
(``PI05Policy._preprocess_images`` and ``resize_with_pad_torch``, an openpi copy):

1. the image is float32 in [0, 1] (LeRobot's pipelines store uint8 frames as ``x / 255``);
2. if it is not already 224x224 it is resized, keeping aspect ratio, with
   ``ratio = max(w / W, h / H)``, new size ``(int(h / ratio), int(w / ratio))``, bilinear
   with ``align_corners=False`` and no antialiasing, then clamped to [0, 1];
3. it is padded with 0.0 (black) *centred*: ``pad_top = (H - h') // 2`` and the odd pixel,
   if any, goes to the bottom (likewise left/right);
4. it is mapped to [-1, 1] with ``x * 2 - 1``, so the padding ends up at -1.

Missing cameras are fed as an all ``-1`` image with a False image mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import cv2
import numpy as np
import torch
import torch.nn.functional as F

PadMode = Literal["center", "top_left"]
ResizeBackend = Literal["cv2", "torch"]
Layout = Literal["auto", "hwc", "chw"]

DEFAULT_IMAGE_SIZE = 224

_FLOAT_DTYPES_NP = (np.float16, np.float32, np.float64)


def decode_image(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode JPEG/PNG (or any format OpenCV reads) bytes to a uint8 RGB ``[H, W, 3]`` array.

    Grayscale is expanded to 3 channels, alpha is dropped and 16-bit images are reduced to
    8 bits (``cv2.IMREAD_COLOR``); JPEG EXIF orientation is applied, as OpenCV does by default.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected encoded image bytes, got {type(data).__name__}")
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size == 0:
        raise ValueError("cannot decode an image from 0 bytes")
    bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR)
    if bgr is None:
        head = bytes(buf[:8]).hex()
        raise ValueError(
            f"could not decode {buf.size} bytes as an image (first bytes: {head}); expected JPEG or PNG"
        )
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _target_hw(size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size, int):
        h = w = size
    else:
        h, w = size
    if h < 1 or w < 1:
        raise ValueError(f"target size must be positive, got {(h, w)}")
    return int(h), int(w)


def _pad_amounts(total: int, used: int, mode: PadMode) -> tuple[int, int]:
    """Padding before/after along one axis."""
    extra = total - used
    if mode == "center":
        before = extra // 2  # the odd pixel goes after (bottom/right), as in openpi
        return before, extra - before
    if mode == "top_left":
        return extra, 0
    raise ValueError(f"pad mode must be 'center' or 'top_left', got {mode!r}")


def resize_with_pad(
    img: np.ndarray,
    size: int | tuple[int, int] = DEFAULT_IMAGE_SIZE,
    *,
    pad_mode: PadMode = "center",
    backend: ResizeBackend = "cv2",
) -> np.ndarray:
    """Resize an ``[H, W, C]`` image to ``size`` without distortion, padding with black.

    Semantics follow LeRobot's ``resize_with_pad_torch`` (pi0/pi0.5): same scale ratio and
    integer truncation of the resized size, bilinear, centred zero padding with the odd
    pixel at the bottom/right. ``pad_mode="top_left"`` puts all padding on the top and
    left instead (the smolvla convention), for other policies. An image already at the
    target size is returned unchanged (as a copy).

    Interpolation is always done in float32: uint8 input is converted, resized, then
    rounded and clamped back to uint8, which is what the torch version does for uint8;
    float input must be in [0, 1] and is clamped to [0, 1] after resizing.

    ``backend="cv2"`` uses ``cv2.resize(INTER_LINEAR)``, which like ``F.interpolate``
    (bilinear, ``align_corners=False``, no antialias) samples at half-pixel centres and
    replicates the border; the two differ only by float rounding in the weights (measured
    max abs difference about 1e-4 on [0, 1] images). ``backend="torch"`` calls
    ``F.interpolate`` itself for bit-exact parity with LeRobot.
    """
    if not isinstance(img, np.ndarray):
        raise ValueError(f"expected a numpy array, got {type(img).__name__}")
    if img.ndim != 3:
        raise ValueError(f"expected an [H, W, C] image, got shape {img.shape}")
    h, w, c = img.shape
    if h == 0 or w == 0 or c == 0:
        raise ValueError(f"image is empty: shape {img.shape}")
    th, tw = _target_hw(size)
    is_uint8 = img.dtype == np.uint8
    if not is_uint8 and img.dtype != np.float32:
        raise ValueError(f"expected uint8 or float32 image, got dtype {img.dtype}")
    if (h, w) == (th, tw):
        return img.copy()

    ratio = max(w / tw, h / th)
    rh, rw = int(h / ratio), int(w / ratio)
    if rh < 1 or rw < 1:
        raise ValueError(f"image of shape {img.shape} is too thin to resize to {(th, tw)}")
    src = img.astype(np.float32) if is_uint8 else img
    if backend == "cv2":
        resized = cv2.resize(src, (rw, rh), interpolation=cv2.INTER_LINEAR)
        if resized.ndim == 2:  # cv2 drops a trailing channel axis of size 1
            resized = resized[:, :, None]
    elif backend == "torch":
        t = torch.from_numpy(np.ascontiguousarray(src)).permute(2, 0, 1)[None]
        t = F.interpolate(t, size=(rh, rw), mode="bilinear", align_corners=False)
        resized = t[0].permute(1, 2, 0).numpy()
    else:
        raise ValueError(f"backend must be 'cv2' or 'torch', got {backend!r}")

    if is_uint8:
        resized = np.clip(np.round(resized), 0, 255).astype(np.uint8)
    else:
        resized = np.clip(resized, 0.0, 1.0).astype(np.float32, copy=False)

    top, bottom = _pad_amounts(th, rh, pad_mode)
    left, right = _pad_amounts(tw, rw, pad_mode)
    return np.pad(resized, ((top, bottom), (left, right), (0, 0)), mode="constant", constant_values=0)


def _to_hwc_numpy(img: np.ndarray | torch.Tensor, layout: Layout) -> np.ndarray:
    """Bring an image to a numpy ``[H, W, C]`` array, keeping its dtype."""
    if isinstance(img, torch.Tensor):
        arr_layout = "chw" if layout == "auto" else layout
        t = img.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16
            t = t.float()
        arr = t.numpy()
    elif isinstance(img, np.ndarray):
        arr_layout = "hwc" if layout == "auto" else layout
        arr = img
    else:
        raise ValueError(f"expected a numpy array or torch tensor image, got {type(img).__name__}")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    elif arr.ndim == 3:
        if arr_layout == "chw":
            arr = arr.transpose(1, 2, 0)
        elif arr_layout != "hwc":
            raise ValueError(f"layout must be 'auto', 'hwc' or 'chw', got {layout!r}")
    else:
        raise ValueError(
            f"expected an image with 2 (H, W) or 3 dims ({arr_layout.upper()}), got shape {tuple(arr.shape)}"
        )
    if 0 in arr.shape:
        raise ValueError(f"image is empty: shape {tuple(arr.shape)} ({arr_layout.upper()})")
    return arr


def _to_rgb(arr: np.ndarray) -> np.ndarray:
    c = arr.shape[2]
    if c == 3:
        return arr
    if c == 1:
        return np.repeat(arr, 3, axis=2)
    if c == 4:
        return arr[:, :, :3]  # RGBA: alpha is not seen by the model
    raise ValueError(
        f"expected 1 (gray), 3 (RGB) or 4 (RGBA) channels, got {c} (image shape in HWC: {arr.shape}); "
        "pass layout='hwc' or 'chw' if the layout was guessed wrong"
    )


def to_unit_float(img: np.ndarray | torch.Tensor, *, layout: Layout = "auto") -> np.ndarray:
    """Validate an image and return it as float32 RGB ``[H, W, 3]`` in [0, 1].

    Accepted: uint8 (0..255) or float (0..1), as numpy ``[H, W(, C)]`` or torch
    ``[(C,) H, W]`` unless ``layout`` says otherwise; C in {1, 3, 4}.
    """
    arr = _to_rgb(_to_hwc_numpy(img, layout))
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / np.float32(255.0)
    if arr.dtype.type not in _FLOAT_DTYPES_NP:
        raise ValueError(f"expected a uint8 or floating-point image, got dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    finite = np.isfinite(arr)
    if not finite.all():
        raise ValueError(f"image has {int((~finite).sum())} non-finite values (NaN/inf)")
    lo, hi = float(arr.min()), float(arr.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(
            f"float images must be in [0, 1], got values in [{lo:.4g}, {hi:.4g}]; "
            "pass uint8 for 0..255 data"
        )
    return np.ascontiguousarray(arr)


def to_model_image(
    img: np.ndarray | torch.Tensor,
    size: int | tuple[int, int] = DEFAULT_IMAGE_SIZE,
    *,
    pad_mode: PadMode = "center",
    backend: ResizeBackend = "cv2",
    layout: Layout = "auto",
) -> torch.Tensor:
    """Turn one camera image into SigLIP input: float32 ``[3, H, W]`` in [-1, 1].

    Resizing happens on the [0, 1] float image (as in LeRobot, whose pipeline hands the
    policy float frames), so uint8 input is not rounded between steps.
    """
    unit = to_unit_float(img, layout=layout)
    unit = resize_with_pad(unit, size, pad_mode=pad_mode, backend=backend)
    out = torch.from_numpy(np.ascontiguousarray(unit)).permute(2, 0, 1).contiguous()
    return out * 2.0 - 1.0


@dataclass(frozen=True)
class ImagePreprocessor:
    """Per-camera preprocessing settings for pi0.5, bundled so a model config can carry them.

    Attributes:
        size: target ``(height, width)``, (224, 224) for pi0.5.
        pad_mode: ``"center"`` (pi0/pi0.5, openpi) or ``"top_left"``.
        backend: ``"cv2"`` (default, no extra cost) or ``"torch"`` (bit-exact with LeRobot).
    """

    size: tuple[int, int] = (DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
    pad_mode: PadMode = "center"
    backend: ResizeBackend = "cv2"

    def __post_init__(self) -> None:
        _target_hw(self.size)
        if self.pad_mode not in ("center", "top_left"):
            raise ValueError(f"pad_mode must be 'center' or 'top_left', got {self.pad_mode!r}")
        if self.backend not in ("cv2", "torch"):
            raise ValueError(f"backend must be 'cv2' or 'torch', got {self.backend!r}")

    def __call__(self, img: np.ndarray | torch.Tensor, *, layout: Layout = "auto") -> torch.Tensor:
        """One image (array, tensor) to float32 ``[3, H, W]`` in [-1, 1]."""
        return to_model_image(img, self.size, pad_mode=self.pad_mode, backend=self.backend, layout=layout)

    def from_bytes(self, data: bytes | bytearray | memoryview) -> torch.Tensor:
        """Encoded JPEG/PNG bytes to model input."""
        return self(decode_image(data))

    def batch(self, imgs: list[np.ndarray | torch.Tensor], *, layout: Layout = "auto") -> torch.Tensor:
        """Several images of one camera (one per batch element) to ``[B, 3, H, W]``."""
        if len(imgs) == 0:
            raise ValueError("batch needs at least one image, got 0")
        return torch.stack([self(im, layout=layout) for im in imgs])

    def blank(self, batch_size: int | None = None) -> torch.Tensor:
        """Stand-in for a missing camera: all -1 (LeRobot's filler; pair it with a False mask)."""
        h, w = self.size
        shape = (3, h, w) if batch_size is None else (batch_size, 3, h, w)
        return torch.full(shape, -1.0, dtype=torch.float32)
