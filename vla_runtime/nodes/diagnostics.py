"""Per-call health as ``diagnostic_msgs/DiagnosticArray`` (rqt_robot_monitor, diagnostic_aggregator)."""

from __future__ import annotations

from typing import Any

DIAGNOSTICS_TOPIC = "/diagnostics"


def diagnostic_array(node: Any, name: str, hardware_id: str, values: dict[str, str], warning: str = "") -> Any:
    """One status: OK, or WARN with ``warning`` as its message; ``values`` become key/value pairs.
    A node in a namespace prefixes the status name with it (``/robot1/vla_runtime: policy``)."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

    ns = node.get_namespace()   # /diagnostics is shared by every pipeline: say whose status this is
    status = DiagnosticStatus(name=name if ns == "/" else f"{ns}/{name}", hardware_id=hardware_id,
                              level=DiagnosticStatus.WARN if warning else DiagnosticStatus.OK,
                              message=warning or "ok")
    status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
    msg = DiagnosticArray(status=[status])
    msg.header.stamp = node.get_clock().now().to_msg()
    return msg
