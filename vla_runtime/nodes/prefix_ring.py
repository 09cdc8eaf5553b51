"""The ring buffer of prefix slots between the vision and policy nodes (layout), and the topics
of the small notifications between the three nodes."""

from __future__ import annotations

from ..ipc.layout import FieldSpec, SlotLayout
from .workers import PrefixSlotSpec

DEFAULT_RING = "vla_prefix"
REQUEST_TOPIC = "/vla_runtime/prefix_request"   # policy -> vision: PrefixRequest
READY_TOPIC = "/vla_runtime/slot_ready"         # vision -> policy: SlotReady
SELECTION_TOPIC = "/vla_runtime/reference_selection"   # vision -> cache manager: ReferenceSelection (after the fact)
EPISODE_TOPIC = "/vla_runtime/episode_start"    # robot -> policy: std_msgs/Empty, the same task starts again


def prefix_layout(spec: PrefixSlotSpec) -> SlotLayout:
    """One slot: every VLM layer's prefix keys/values, the retrieval features and the state."""
    return SlotLayout(tuple(FieldSpec(name, shape, dtype) for name, (shape, dtype) in spec.shapes().items()))
