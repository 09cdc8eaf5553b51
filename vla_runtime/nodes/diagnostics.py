"""Per-call health as ``diagnostic_msgs/DiagnosticArray`` (rqt_robot_monitor, diagnostic_aggregator)."""

from __future__ import annotations

from typing import Any

DIAGNOSTICS_TOPIC = "/diagnostics"
POLICY_STATUS = "vla_runtime: policy"   # the policy node's status name (its peers watch for it)


def status_name(namespace: str, name: str) -> str:
    """A status name as published from ``namespace``: /diagnostics is shared by every pipeline,
    so a namespaced node says whose status it is (``/robot1/vla_runtime: policy``)."""
    return name if namespace == "/" else f"{namespace}/{name}"


def diagnostic_array(node: Any, name: str, hardware_id: str, values: dict[str, str], warning: str = "",
                     error: str = "") -> Any:
    """One status: OK, WARN with ``warning`` as its message, or ERROR with ``error`` (and the
    warning after it); ``values`` become key/value pairs. A node in a namespace prefixes the
    status name with it (``status_name``)."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

    level = DiagnosticStatus.ERROR if error else DiagnosticStatus.WARN if warning else DiagnosticStatus.OK
    status = DiagnosticStatus(name=status_name(node.get_namespace(), name), hardware_id=hardware_id, level=level,
                              message="; ".join(m for m in (error, warning) if m) or "ok")
    status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
    msg = DiagnosticArray(status=[status])
    msg.header.stamp = node.get_clock().now().to_msg()
    return msg
