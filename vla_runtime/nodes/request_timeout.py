"""How long the policy node waits for the answer to a prefix request before asking again.

A fixed wait shorter than a call on this machine is a livelock: every request is given up on
before its answer comes, the answer then belongs to a request already replaced and is dropped,
and the robot never gets a chunk (seen under a real ``ros2 launch`` with ``pi05-small`` on a loaded
2-core CPU: 177 requests asked again, none answered in time, the robot held for 6 minutes). So the
wait learns: when the answer to a request that was given up on arrives after all, a call's
latency on this machine is known, and from then on the node waits ``margin`` times that long
(never less than the configured ``request_timeout_s``, at most ``ceiling_s``) and says so.
The requests given up on are kept (the last ``kept``) until their answers come, to tell a late
answer from a leftover.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Asked:
    """When a prefix request went out: on the node's clock (timeouts, latency; simulated time
    with use_sim_time) and on the machine's monotonic clock (the vision node stamps its slots
    with that one: a slot encoded before the request is a leftover)."""

    clock_s: float
    monotonic_ns: int


@dataclass
class RequestTimeout:
    """The effective wait: the configured one, raised by late answers (``late_answer``)."""

    margin: float = 1.5
    ceiling_s: float = 600.0     # the parameter's own upper bound
    learned_s: float = 0.0       # margin x the slowest late answer seen (0: none yet)
    kept: int = 8                # requests given up on whose answers may still teach the wait
    given_up: dict[int, Asked] = field(default_factory=dict)   # request_seq -> when it was asked

    def __post_init__(self) -> None:
        if not self.margin >= 1.0 or not self.ceiling_s > 0:
            raise ValueError(f"margin must be >= 1 and ceiling_s > 0, got {self.margin!r}, {self.ceiling_s!r}")
        if isinstance(self.kept, bool) or not isinstance(self.kept, int) or self.kept < 1:
            raise ValueError(f"kept must be an int >= 1, got {self.kept!r}")

    def give_up(self, request_seq: int, asked: Asked) -> None:
        """Request ``request_seq`` is asked again: keep when it was asked (its answer may still
        come), forgetting the oldest beyond ``kept``."""
        self.given_up[request_seq] = asked
        for seq in sorted(self.given_up)[:-self.kept]:
            del self.given_up[seq]

    def take_given_up(self, request_seq: int) -> Asked | None:
        """When ``request_seq`` was asked, if it was given up on (and forget it); else None."""
        return self.given_up.pop(request_seq, None)

    def seconds(self, configured_s: float) -> float:
        """How long to wait now, given the configured ``request_timeout_s``."""
        return min(max(configured_s, self.learned_s), self.ceiling_s)

    def late_answer(self, latency_s: float, configured_s: float) -> str:
        """The answer to a request given up on arrived ``latency_s`` after it was asked: wait
        longer from now on. Returns the warning to log, '' when the wait does not change."""
        wanted = min(self.margin * latency_s, self.ceiling_s)
        if not wanted > self.seconds(configured_s):
            return ""
        self.learned_s = wanted
        return (f"a call took {latency_s:.2f} s here, longer than request_timeout_s ({configured_s:g} s): its answer "
                f"came after the request was given up on; waiting up to {wanted:.2f} s from now on (set "
                f"request_timeout_s for this machine to silence this)")
