"""The goodput ledger: where a run's wall time went, and what each membership event cost.

    productive_s   steps that count (each step of the final trajectory, timed once), at the
                   run's own healthy pace
    slow_s         the part of those steps' time above that pace: time lost to running slow (a
                   straggler, a throttled node, a data stall) without anything failing
    lost_s         steps trained and then re-done after a failure (work since the last checkpoint)
    checkpoint_s   time the training loop was blocked writing checkpoints
    recovery_s     from a failure/preemption/resize (or process start) to the first step after it
    eval_s         held-out evaluations (useful, but not training)

and, with replica groups (C7 all-or-nothing step), where the run went on with fewer of them:

    degraded_s     the part of productive_s stepped with fewer live replica groups than configured
                   (the steps count, the throughput was lower): not a sixth total

goodput = productive_s / (productive_s + slow_s + lost_s + checkpoint_s + recovery_s + eval_s).

The healthy pace is the run's own: the median of its last `PACE_STEPS` healthy steps at the same
world size (and, with replica groups, all groups live or not), kept in the ledger so that it
survives restarts. A step longer than `SLOW_STEP` times it is slow: the pace's worth of it is
productive, the rest is slow_s, and it does not join the pace (a long slowdown does not become
the norm). A step within it is productive whole (a healthy run's noise is not slowness). The
first step of each attempt carries one-off set-up and is neither judged nor part of the pace, and
a pace needs `PACE_MIN_STEPS` steps at that size before any step is judged against it: a run that
is slow from its first steps at a size has no healthy pace to compare with (the straggler
detector, which compares ranks with each other, still finds a slow rank).

The ledger travels
with the run: rank 0 publishes it with its progress (GCS KV, at each attempt's start and every
poll) and in every checkpoint's trainer state, so it survives worker, node and driver failures; a
resumed attempt starts from the newer of the two (the checkpoint's ends at its step).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

TOTALS = ("productive_s", "slow_s", "lost_s", "checkpoint_s", "recovery_s", "eval_s")
PACE_STEPS = 32
"""Healthy steps per world size whose median is the run's pace there."""
PACE_MIN_STEPS = 5
"""Healthy steps at a size before a step there is judged against its pace."""
SLOW_STEP = 1.25
"""A step this many times the pace or more is slow (a healthy step's noise stays below)."""


@dataclass
class GoodputLedger:
    productive_s: float = 0.0
    lost_s: float = 0.0
    checkpoint_s: float = 0.0
    recovery_s: float = 0.0
    eval_s: float = 0.0
    lost_steps: int = 0
    degraded_s: float = 0.0
    slow_s: float = 0.0
    events: list[dict] = field(default_factory=list)
    pace: dict[str, list[float]] = field(default_factory=dict)
    """The last healthy step times (up to PACE_STEPS) per world size: the run's own pace."""
    _open_event: dict | None = None
    _attempt_started: float = field(default_factory=time.time)
    _pace_key: str = "?"
    _attempt_steps: int = 0

    @classmethod
    def from_dict(cls, d: dict | None) -> GoodputLedger:
        d = dict(d or {})
        return cls(**{k: d[k] for k in (*TOTALS, "lost_steps", "degraded_s", "events", "pace")
                      if k in d})

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def adopt(self, peer: dict) -> None:
        """A replica group healed from a live peer takes the peer's account of the run (C7
        all-or-nothing step), keeping the events only it saw (why it restarted, say): one ledger,
        whichever group leads at the end."""
        mine = self.events
        self._take(peer)
        self.events = merge_events(self.events, mine)

    def _take(self, d: dict) -> None:
        """Every total and event of `d` in place of this ledger's (the attempt's own state, what
        starts with "_", stays)."""
        for name, value in vars(GoodputLedger.from_dict(d)).items():
            if not name.startswith("_"):
                setattr(self, name, value)

    def on_step(self, seconds: float, degraded: bool = False) -> None:
        """A committed step of `seconds`: productive up to the run's healthy pace at this size,
        slow above it (the module docstring)."""
        self._attempt_steps += 1
        key = self._pace_key + ("-degraded" if degraded else "")
        recent = self.pace.setdefault(key, [])
        pace = statistics.median(recent) if len(recent) >= PACE_MIN_STEPS else None
        productive = seconds
        if self._attempt_steps == 1:
            pass  # one-off set-up: neither judged nor part of the pace
        elif pace is not None and seconds >= SLOW_STEP * pace:
            productive = pace
            self.slow_s += seconds - pace
        else:
            recent.append(round(seconds, 4))
            del recent[:-PACE_STEPS]
        self.productive_s += productive
        if degraded:
            self.degraded_s += productive

    def pace_s(self, world_size: int, degraded: bool = False) -> float | None:
        """The run's healthy step time at `world_size` (None: not enough steps there yet)."""
        recent = self.pace.get(str(world_size) + ("-degraded" if degraded else ""), [])
        return statistics.median(recent) if len(recent) >= PACE_MIN_STEPS else None

    def on_lost_attempt(self, seconds: float) -> None:
        """A replica groups' step attempt that did not commit: it is re-done (C7 all-or-nothing
        step)."""
        self.lost_s += seconds
        self.lost_steps += 1

    def on_quorum_change(self, before: int, after: int, groups: int, step: int,
                      waited_s: float = 0.0) -> dict:
        """Replica groups left or joined the quorum at `step`; the run did not stop (C7
        all-or-nothing step), but it waited `waited_s` in that quorum (a lost group's heartbeat
        timing out, a joining group's state being sent): recovery, not productive time."""
        event = {"kind": "replica group lost" if after < before else "replica group joined",
                 "detail": f"{before} -> {after} of {groups} replica groups live",
                 "at": time.time(), "from_groups": before, "to_groups": after, "step": step,
                 "lost_steps": 0, "recovery_s": round(waited_s, 3)}
        self.recovery_s += waited_s
        self.events.append(event)
        return event

    def on_rollback(self, steps: int, seconds: float) -> None:
        """A loss spike rolled the run back (health/recovery.py): the `steps` it had trained since
        the checkpoint, `seconds` of them, are re-done."""
        self.productive_s = max(0.0, self.productive_s - seconds)
        self.lost_s += seconds
        self.lost_steps += steps

    def on_checkpoint(self, seconds: float) -> None:
        self.checkpoint_s += seconds

    def on_eval(self, seconds: float) -> None:
        self.eval_s += seconds

    def on_resume(self, *, restored_step: int, world_size: int, previous: dict | None,
                  cause: dict | None, attempt_started: float) -> dict | None:
        """Open the event that explains why this attempt started (None for a fresh run)."""
        self._attempt_started = attempt_started
        self._pace_key, self._attempt_steps = str(world_size), 0
        if previous is None and cause is None:
            return None
        newer = (previous or {}).get("ledger")
        if newer is not None and previous.get("step", -1) >= restored_step:
            # The previous attempt published its ledger as it went: it has the time and the
            # events after the checkpoint this attempt restored (whose ledger ends at its step),
            # and the work since then is moved from productive to lost below.
            self._take(newer)
        elif newer is not None:
            # A replica group back behind its peers restores a checkpoint they wrote since: its
            # totals are theirs, and what only its previous attempt saw (why it left) is kept.
            self.events = merge_events(self.events, newer.get("events") or [])
        lost_steps = max(0, (previous or {}).get("step", restored_step) - restored_step)
        lost_s = lost_steps * (previous or {}).get("avg_step_s", 0.0)
        # The previous attempt counted those steps as productive; they are being re-done.
        self.productive_s = max(0.0, self.productive_s - lost_s)
        self.lost_s += lost_s
        self.lost_steps += lost_steps
        reason = (cause or {}).get("reason") or (cause or {}).get("error") or "resubmitted"
        kind = (cause or {}).get("kind") or "resume"
        self._open_event = {
            "kind": kind, "detail": str(reason)[:300],
            "at": (cause or {}).get("at") or (previous or {}).get("at") or attempt_started,
            "from_world_size": (previous or {}).get("world_size"), "to_world_size": world_size,
            "resumed_from_step": restored_step, "lost_steps": lost_steps,
            "lost_s": round(lost_s, 3),
        }
        return self._open_event

    def on_first_step_started(self, now: float | None = None) -> dict | None:
        """Recovery ends when the first step of the attempt starts."""
        now = now or time.time()
        event, self._open_event = self._open_event, None
        if event is None:  # a fresh run: startup is the only "recovery"
            self.recovery_s += now - self._attempt_started
            return None
        event["recovery_s"] = round(now - event["at"], 3)
        self.recovery_s += max(0.0, now - event["at"])
        self.events.append(event)
        return event

    def summary(self) -> dict:
        wall = sum(getattr(self, k) for k in TOTALS)
        return {**{k: round(getattr(self, k), 3) for k in TOTALS}, "lost_steps": self.lost_steps,
                "degraded_s": round(self.degraded_s, 3),
                "goodput": round(self.productive_s / wall, 4) if wall else 1.0,
                "events": len(self.events)}


def merge_events(*lists: list[dict]) -> list[dict]:
    """The union of several copies of a run's events (the replica groups' ledgers share most of
    them), each once, in time order."""
    seen: dict[str, dict] = {}
    for events in lists:
        for event in events:
            seen.setdefault(json.dumps(event, sort_keys=True, default=str), event)
    return sorted(seen.values(), key=lambda e: e.get("at") or 0.0)
