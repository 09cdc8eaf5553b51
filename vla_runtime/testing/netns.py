"""Run ROS 2 processes where DDS discovery cannot leave the machine.

DDS participants announce themselves by multicast on every interface they find. Every process
that creates a ROS 2 node in tests or tools therefore runs inside a private network namespace
whose only interface is loopback (``unshare -n``, then ``ip link set lo up``), with
``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST`` on top. Needs root (or CAP_SYS_ADMIN) for unshare.

A network namespace does not separate ``/dev/shm``, and with the LOCALHOST range the rmw gives
Fast DDS its shared-memory transport, whose port files outlive a participant killed with SIGKILL
(the fault tests kill nodes) and are opened again by a later participant of the same domain, in
any namespace. So inside the namespace (a fresh one: loopback is its only link), discovery
runs over UDP alone (``ROS_AUTOMATIC_DISCOVERY_RANGE=SUBNET``, whose only subnet there is
loopback, and ``FASTDDS_BUILTIN_TRANSPORTS=UDPv4``): each namespace's DDS traffic stays in it.
The messages of these tests are small; the bulk tensors go through our own rings either way.

- :func:`run_in_private_netns` runs a command in a fresh namespace, bounded by a timeout.
- :func:`assert_only_loopback`, called inside the namespace, proves it is private.
- :func:`ros_env` builds the environment in which rclpy and our built messages import.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

# Runs inside the namespace before exec: `lo` is down in a new namespace, and DDS over a down
# loopback never discovers anyone. It only ever runs right after `unshare --net`, where loopback
# is the one link, so the SUBNET range reaches loopback alone; with it Fast DDS runs over UDP
# alone and keeps nothing in the /dev/shm every namespace shares.
_NETNS_PRELUDE = ('ip link set lo up && '
                  'export ROS_AUTOMATIC_DISCOVERY_RANGE=SUBNET FASTDDS_BUILTIN_TRANSPORTS=UDPv4 && '
                  'exec "$@"')


def run_in_private_netns(cmd: list[str] | str, env: dict[str, str], timeout: float,
                         cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in a new network namespace with only loopback, up; capture its output.

    `cmd` is an argv list, or a string run by ``bash -c``. Returns the CompletedProcess (text
    stdout/stderr; check ``returncode`` yourself). The command runs in its own process group:
    on timeout the whole group (the command and anything it started) is killed and
    :class:`subprocess.TimeoutExpired` is raised with the output gathered so far.
    """
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool!r} not found: install util-linux (unshare) and iproute2 (ip)")
    argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    wrapped = ["unshare", "--net", "--", "bash", "-c", _NETNS_PRELUDE, "netns"] + argv
    proc = subprocess.Popen(wrapped, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(wrapped, timeout, output=stdout, stderr=stderr) from None
    finally:
        if proc.poll() is None:  # interrupted (KeyboardInterrupt, ...): leave nothing behind
            _kill_group(proc)
    # The command may have left background children in its group; they die with it.
    _kill_group(proc)
    if proc.returncode != 0 and "unshare" in stderr and "Operation not permitted" in stderr:
        raise PermissionError(f"unshare --net needs root or CAP_SYS_ADMIN:\n{stderr}")
    return subprocess.CompletedProcess(wrapped, proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process group that `proc` leads (it was started with start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_only_loopback() -> None:
    """Raise AssertionError unless this process sees no network interface but ``lo``.

    Uses ``socket.if_nameindex()`` (the kernel's view of this network namespace);
    ``/sys/class/net`` would still list the host's interfaces inside ``unshare -n``.
    """
    names = sorted(name for _, name in socket.if_nameindex())
    if names != ["lo"]:
        raise AssertionError(f"expected only the loopback interface, found {names}: "
                             "not inside a private network namespace")


# Domain ids partition DDS traffic; a distinct one per call keeps concurrent tests apart even
# if two ever shared a namespace. 1..100 stays inside the range every rmw accepts.
_domain_ids = itertools.count(os.getpid() % 100)


def ros_env(install_dir: str | Path, venv: str | Path | None = None,
            domain_id: int | None = None) -> dict[str, str]:
    """The environment in which rclpy and the messages built into `install_dir` import.

    `install_dir` is colcon's install space (``install/``, made by ``make ros``); its
    ``setup.bash`` is sourced in a bash subprocess and the resulting environment captured.
    `venv` is the prefix holding the ROS 2 wheels (default: this interpreter's ``sys.prefix``);
    colcon does not chain it into setup.bash, so it is appended to AMENT_PREFIX_PATH here.
    Sets ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``, ``RMW_IMPLEMENTATION=rmw_fastrtps_cpp`` and
    a fresh ``ROS_DOMAIN_ID`` (or `domain_id`) on every call.
    """
    install_dir = Path(install_dir).resolve()
    prefix = Path(venv).resolve() if venv is not None else Path(sys.prefix)
    setup = install_dir / "setup.bash"
    if not setup.is_file():
        raise FileNotFoundError(f"{setup} not found: build the ROS 2 side first (make ros)")
    if not (prefix / "share" / "rclpy").is_dir():
        raise FileNotFoundError(f"no ROS 2 wheels in {prefix} (share/rclpy missing): run make ros")

    base = dict(os.environ)
    # Let the wheels' bootstrapper recompute LD_LIBRARY_PATH for the child interpreter.
    base.pop("_ROS_WHEELS_BOOTSTRAP_COMPLETE", None)
    script = f'set +u; source "{setup}" || exit 1; env -0'
    out = subprocess.run(["bash", "-c", script], env=base, capture_output=True, timeout=30, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"sourcing {setup} failed:\n{out.stderr.decode(errors='replace')}")
    env = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)

    env["AMENT_PREFIX_PATH"] = _join_path(env.get("AMENT_PREFIX_PATH", ""), str(prefix))
    env["PATH"] = _join_path(str(prefix / "bin"), env.get("PATH", os.defpath))
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    env["RMW_IMPLEMENTATION"] = "rmw_fastrtps_cpp"
    env["ROS_DOMAIN_ID"] = str(domain_id if domain_id is not None else 1 + next(_domain_ids) % 100)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _join_path(*parts: str) -> str:
    """Join PATH-like lists, dropping empty entries and repeats (first occurrence wins)."""
    seen: list[str] = []
    for part in parts:
        for entry in part.split(os.pathsep):
            if entry and entry not in seen:
                seen.append(entry)
    return os.pathsep.join(seen)
