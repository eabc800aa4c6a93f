"""What the Trainer is given by the cluster around it, as protocols with do-nothing defaults:
where step metrics go (`MetricSink`: MLflow's `MetricLogger` on rank 0 of a tracked run) and
rank 0's view of the group's membership (`Membership`: `WorkerMembership` under Ray). The
defaults serve ranks other than 0, untracked runs, tests and benchmarks; they hold no state, so
one instance can serve every Trainer."""

from __future__ import annotations

from typing import Protocol


class MetricSink(Protocol):
    """Where step metrics go (MLflow's `MetricLogger` on rank 0 of a tracked run)."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict[str, str]) -> None: ...

    def flush(self, timeout_s: float) -> bool:
        """Block until everything logged is stored; False if `timeout_s` passed first."""
        ...

    def close(self) -> None: ...


class NullMetricSink:
    """Drops every metric: ranks other than 0, untracked runs, tests and benchmarks."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_params(self, params: dict[str, str]) -> None:
        pass

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        pass


class Membership(Protocol):
    """Rank 0's view of the cluster (`WorkerMembership` under Ray)."""

    reason: str | None
    """Turns non-None when this group should checkpoint and restart (drain, resize)."""
    previous: dict | None
    """The previous attempt's last published progress, if any (the goodput ledger's input)."""
    cause: dict | None
    """Why the previous attempt ended, if it did."""

    def publish(self, step: int, step_time_s: float | None, ledger: dict) -> None: ...

    def record_restart(self, reason: str, step: int) -> None: ...

    def drain_node(self, node_id: str, reason: str) -> None:
        """Have a node of this group drained (a hardware fault found on it): the group restarts
        without it, and the autoscaler replaces it."""
        ...

    def close(self) -> None: ...


class NullMembership:
    """A group nobody resizes or drains, with no attempt before it: ranks other than 0, and any
    Trainer run outside Ray."""

    reason = None
    previous = None
    cause = None

    def publish(self, step: int, step_time_s: float | None, ledger: dict) -> None:
        pass

    def record_restart(self, reason: str, step: int) -> None:
        pass

    def drain_node(self, node_id: str, reason: str) -> None:
        pass

    def close(self) -> None:
        pass
