"""The managed (lifecycle) node each pipeline node is: rclpy's ``LifecycleNode`` with the
transitions mapped onto four hooks of the node class.

- configure -> ``_setup``: load the checkpoint, warm up, create or attach the rings, create the
  subscriptions, publishers and timers (each recorded with ``own`` so that cleanup removes it);
- activate -> ``_enable``: start the node's effect (commands, prefills, window upkeep); the
  lifecycle publishers publish from here on;
- deactivate -> ``_disable``: stop it (the policy holds the robot first); lifecycle publishers
  are silenced after the hook, so a hold published in it still goes out;
- cleanup -> ``_release``: release everything ``_setup`` made (rings unmapped and unlinked,
  weights dropped), after which what was ``own``-ed is destroyed;
- shutdown, from any state: deactivate and cleanup as far as needed, then ``finished`` (the spin
  loop ends and the process exits 0).

Why hooks rather than rclpy's callbacks directly: rclpy swallows an exception raised in a
transition callback (the transition just fails, nothing says why); here every failure is caught,
kept (``failure``) and logged in one line, a half-done configure is undone, and deactivate and
cleanup never fail (a node that cannot stop commanding is worse than one that logs).
With the ``autostart`` parameter (default true) the node drives its own configure and activate
before spinning (``start``, called by ``spin.run``), where a failure is a start failure: one line,
exit status 3. With it false the node waits unconfigured for its standard lifecycle services
(``ros2 lifecycle set``, an external lifecycle manager as nav2's).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.lifecycle.publisher import LifecyclePublisher
from rclpy.publisher import Publisher
from rclpy.subscription import Subscription
from rclpy.timer import Timer

from .diagnostics import DIAGNOSTICS_TOPIC, status_name
from .lifecycle import PeerWatch, release_memory, settle_heap
from .params import Param, declare_parameters
from .call_thread import CallThread
from .spin import CallbackGate, start_failure

SHUTDOWN_WAIT_S = 5.0   # for the call in flight when the node stops (cleanup, deactivate, Ctrl-C)
SUCCESS = TransitionCallbackReturn.SUCCESS
FAILURE = TransitionCallbackReturn.FAILURE
E = TypeVar("E")


class ManagedNode(LifecycleNode):
    """A lifecycle node whose parameters (``table``) are declared at construction; everything
    else is made by the transitions (see the module docstring)."""

    def __init__(self, name: str, table: dict[str, Param]):
        super().__init__(name)
        self.params = declare_parameters(self, table, self._on_parameter)
        self.active = False
        self.finished = False                    # shut down: the process ends
        self.failure: BaseException | None = None
        self._owned: list[Any] = []
        self._quiet = False                      # autostart: the failure is printed by spin.run instead
        self._watched: dict[str, str] = {}       # status name -> peer (watch_peers)
        self.peers: PeerWatch | None = None
        self.stage: Any = None                   # what _setup loads: a stage of stages.py (rings, weights)
        self.gate: CallbackGate | None = None    # the callbacks that use the stage's rings (None: single-threaded)
        self.call_thread: CallThread | None = None   # where the node's long calls run (call_thread.py), if it has one

    # ------------------------------------------------------------ hooks of the node classes
    def _setup(self) -> None:
        raise NotImplementedError

    def _enable(self) -> None:
        pass

    def _disable(self) -> None:
        pass

    def _release(self) -> None:
        """Close the stage (its rings: unmapped, and unlinked by their creator) once no callback
        uses it, then drop it with its weights. A callback still running after ``SHUTDOWN_WAIT_S``
        keeps the rings mapped (unmapping under it would fault; the next start replaces them)."""
        if self.call_thread is not None:
            self.call_thread.drop_pending()   # calls taken before cleanup never run on a later configure
        if self.gate is None or self.gate.close(SHUTDOWN_WAIT_S):
            if self.stage is not None:
                self.stage.close()
        else:
            self.get_logger().error(f"a callback was still running {SHUTDOWN_WAIT_S} s after cleanup began: "
                                    "leaving the ring buffers mapped (the next start replaces them)")
        self.stage = None
        release_memory()

    def _publish_diagnostics(self) -> None:
        """The node's status on /diagnostics (the node classes'); also sent on every activation
        and deactivation, so that a monitor sees a state change at once."""

    def _on_parameter(self, name: str, value: object) -> None:
        self.params[name] = value   # read on every use: takes effect from the next message / tick
        if name == "peer_timeout_s" and self.peers is not None:
            self.peers.timeout_s = float(value)

    # ------------------------------------------------------------ peers' liveness
    def watch_peers(self, statuses: dict[str, str]) -> None:
        """Watch peer nodes of this pipeline by their periodic diagnostics (``statuses``: status
        name -> what to call the peer); ``peer_health`` then says which went silent. Called by
        ``_setup``: the subscription goes with cleanup."""
        from diagnostic_msgs.msg import DiagnosticArray

        self._watched = {status_name(self.get_namespace(), s): peer for s, peer in statuses.items()}
        self.peers = None
        self._peer_watch()

        def on_diagnostics(msg: DiagnosticArray) -> None:
            watch = self._peer_watch()
            for st in msg.status:
                peer = self._watched.get(st.name)
                if peer is not None and watch is not None:
                    watch.heard(peer, self._clock_s())
        self.own(self.create_subscription(DiagnosticArray, DIAGNOSTICS_TOPIC, on_diagnostics, 50))

    def _clock_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _peer_watch(self) -> PeerWatch | None:
        """The watch, started now unless the clock has not started (sim time before the first /clock)."""
        if self.peers is None and self._watched and self._clock_s() != 0.0:
            self.peers = PeerWatch(tuple(self._watched.values()), self._clock_s(), float(self.params["peer_timeout_s"]))
        return self.peers

    def peer_health(self) -> tuple[dict[str, str], str, str]:
        """(diagnostic values, ERROR message, WARN message) of the watched peers ('' when none)."""
        watch = self._peer_watch()
        if watch is None:
            return {}, "", ""
        now = self._clock_s()
        return watch.values(now), *watch.report(now)

    @property
    def state_label(self) -> str:
        """For diagnostics (published only while configured)."""
        return "active" if self.active else "inactive"

    # ------------------------------------------------------------ entities made by a transition
    def own(self, entity: E) -> E:
        """Record a subscription, timer or publisher made by ``_setup`` / ``_enable``: cleanup destroys it."""
        self._owned.append(entity)
        return entity

    def drop(self, entity: Any) -> None:
        """Destroy one owned entity now (e.g. the policy's control timer on deactivate)."""
        if entity in self._owned:
            self._owned.remove(entity)
        if isinstance(entity, Timer):
            self.destroy_timer(entity)
        elif isinstance(entity, Subscription):
            self.destroy_subscription(entity)
        elif isinstance(entity, LifecyclePublisher):
            self.destroy_lifecycle_publisher(entity)
        elif isinstance(entity, Publisher):
            self.destroy_publisher(entity)

    def _drop_owned(self) -> None:
        for entity in reversed(list(self._owned)):
            self.drop(entity)

    # ------------------------------------------------------------ rclpy transition callbacks
    def _step(self, what: str, hook: Callable[[], None]) -> TransitionCallbackReturn:
        try:
            hook()
            return SUCCESS
        except Exception as e:   # noqa: BLE001 - rclpy would swallow it: keep it and say it
            self.failure = e
            if not self._quiet:
                self.get_logger().error(start_failure(self.get_name(), e).replace(": cannot start: ",
                                                                                  f": {what} failed: "))
            return FAILURE

    def _cleanup(self) -> None:
        self._step("cleanup", self._release)
        self._drop_owned()

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.failure = None
        result = self._step("configure", self._setup)
        if result != SUCCESS:
            failure = self.failure
            self._cleanup()        # undo what the configure made before it failed
            self.failure = failure
        else:
            frozen = settle_heap()
            self.get_logger().info(f"configured ({frozen} objects left out of garbage collection)")
        return result

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        super().on_activate(state)          # lifecycle publishers publish from here on
        result = self._step("activate", self._enable)
        if result != SUCCESS:
            super().on_deactivate(state)
            return result
        self.active = True
        self.get_logger().info("active")
        self._step("report", self._publish_diagnostics)
        return SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = False
        self._step("deactivate", self._disable)   # logged; the node stops all the same
        super().on_deactivate(state)        # lifecycle publishers silent from here on
        self.get_logger().info("inactive")
        self._step("report", self._publish_diagnostics)
        return SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._cleanup()
        self.get_logger().info("cleaned up: unconfigured")
        return SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if state.label == "active":
            self.on_deactivate(state)
        if state.label in ("active", "inactive"):
            self._cleanup()
        self.finished = True
        return SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = False
        self._cleanup()
        return SUCCESS                      # back to unconfigured

    # ------------------------------------------------------------ process start and end
    def start(self) -> None:
        """With ``autostart``: configure and activate now; raises the reason when either fails."""
        if not self.params["autostart"]:
            self.get_logger().info("autostart is false: unconfigured, waiting for lifecycle transitions "
                                   "(configure, then activate)")
            return
        self._quiet = True
        try:
            for what, trigger in (("configure", self.trigger_configure), ("activate", self.trigger_activate)):
                if trigger() != SUCCESS:
                    raise self.failure or RuntimeError(f"{what} failed")
        finally:
            self._quiet = False

    def destroy_node(self) -> None:
        """Shut down from whatever state the node is in (Ctrl-C, end of the process)."""
        if not self.finished:
            try:
                self.trigger_shutdown()
            except Exception:   # noqa: BLE001 - mid-transition: release directly
                if self.active:
                    self._step("deactivate", self._disable)
                self._cleanup()
            self.finished = True
        if self.call_thread is not None and not self.call_thread.stop(SHUTDOWN_WAIT_S):
            self.get_logger().error(f"{self.call_thread.name}: a call was still running {SHUTDOWN_WAIT_S} s after shutdown")
        super().destroy_node()
