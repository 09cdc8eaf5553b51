"""The ring buffer of prefix slots between the vision and policy nodes (layout), and the topics
of the small notifications between the three nodes (relative: under the nodes' namespace, so two
pipelines in two namespaces never hear each other)."""

from __future__ import annotations

from ..ipc.layout import FieldSpec, SlotLayout
from .workers import PrefixSlotSpec

DEFAULT_RING = "vla_prefix"
REQUEST_TOPIC = "vla_runtime/prefix_request"   # policy -> vision: PrefixRequest
READY_TOPIC = "vla_runtime/slot_ready"         # vision -> policy: SlotReady
# vision -> policy: SlotReady naming the working-set entry a call will use, sent before its prefill
# (the policy gathers the entry's Action Cache weights meanwhile)
AHEAD_TOPIC = "vla_runtime/reference_ahead"
SELECTION_TOPIC = "vla_runtime/reference_selection"   # vision -> cache manager: ReferenceSelection (after the fact)
EPISODE_TOPIC = "vla_runtime/episode_start"    # robot -> policy: std_msgs/Empty, the same task starts again
CHUNK_TOPIC = "vla_runtime/action_chunk"       # policy -> robot adapters, recorders, cache manager: ActionChunk


def subscribe_instruction(node, topic: str, callback) -> list:
    """The two instruction subscriptions of a node. DDS matches a transient-local subscription
    only with transient-local publishers, and a volatile one gets no history: so one of each.
    The transient-local one receives an instruction latched (``ros2 topic pub --qos-durability
    transient_local``) before the node started; the volatile one hears an ordinary ``ros2 topic
    pub`` (the latched one's "incompatible QoS" report about such a publisher is silenced: its
    twin receives it). A latched message arrives on both: the second copy is the same task,
    which changes nothing. Returns both (a managed node destroys them on cleanup)."""
    from rclpy.event_handler import SubscriptionEventCallbacks
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    return [node.create_subscription(String, topic, callback, latched,
                                     event_callbacks=SubscriptionEventCallbacks(incompatible_qos=lambda _event: None)),
            node.create_subscription(String, topic, callback, 10)]


def prefix_layout(spec: PrefixSlotSpec) -> SlotLayout:
    """One slot: every VLM layer's prefix keys/values, the retrieval features and the state."""
    return SlotLayout(tuple(FieldSpec(name, shape, dtype) for name, (shape, dtype) in spec.shapes().items()))
