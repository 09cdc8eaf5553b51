"""Shared-memory transport between the runtime's processes: slot layouts and the seqlocked ring."""

from .layout import FieldSpec, SlotLayout
from .ring import (LayoutMismatchError, ReadStats, RingBuffer, RingBufferError, RingExistsError,
                   RingNotFoundError, SlotInfo, SlotWriter)

__all__ = ["FieldSpec", "SlotLayout", "RingBuffer", "SlotWriter", "SlotInfo", "ReadStats", "RingBufferError",
           "RingExistsError", "RingNotFoundError", "LayoutMismatchError"]
