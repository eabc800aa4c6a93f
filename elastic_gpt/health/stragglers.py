"""Stragglers found from the step's own work, and evicted: a rank that computes slower than its
peers holds every step of a synchronous group back, and nothing fails.

What a user feels is the step's own work being slow on one rank, so that is what is measured:
each rank times its compute in the steps it runs (health/compute_timer.py: its FSDP units'
forward and backward, on a GPU by CUDA events around their kernels, with FSDP's waits for its
peers outside the sections; a step's wall time would not do, since every rank waits for the
slowest in FSDP's collectives). Each rank keeps its last `health.straggler_window` steps and
every `health.straggler_every_steps` steps shares one float, its window's mean with its slowest
steps left out (`trimmed_mean`), in an all-reduce that runs at that step anyway (the known-answer
probe's, below). A rank whose figure is `health.straggler_slowdown` times the ranks' (lower)
median is a straggler: an event naming the rank, its node and the ratio, and its node is drained
(the group checkpoints at the next step and restarts without it, in the same data order; the
autoscaler replaces the node).

Why a window and not a count of slow checks in a row: slowness comes steady, in bursts shorter
than a step, or periodic, and a window's total counts it however it is spread in time; the
window's slowest steps are left out so that a single slow step (a page-fault storm, a checkpoint
write's contention) never makes a straggler, whatever its length. The bound: a rank slowed by at
least the threshold from step s on (s past its attempt's first `WARMUP_STEPS`, which are not
judged) fills a whole window with slowed steps by step s + window, and is named at the first share
after that, so by step s + `straggler_window` + `straggler_every_steps` (at the slowed pace: the
group's steps take the straggler's time); its node's drain is seen within a poll and the group
stops at the next step boundary (docs/training-health.md).

With replica groups each group's figure (its slowest rank's) is compared with the other groups'
too: every `straggler_every_steps` steps the groups sum a vector with a slot per group in one
more cross-group all-reduce, in the next step (inside its quorum, as torchft needs), and the group
whose figure is the threshold times the groups' median leaves: its rank 0 drains its nodes, so
the group leaves the quorum at the next step boundary and the others train on. A node that hosts
every rank of the restart path's one group is not drained (there would be nothing to train on):
the straggler is reported.

The fixed-matmul probe stays, as a known-answer test of each device, as fleets screen for silent
data corruption (Dixit et al., "Silent Data Corruptions at Scale", Meta 2021; Hochschild et al.,
"Cores that don't count", HotOS 2021): its result is a fixed function of a fixed input, the same
bits on every healthy device of a kind and on one device over time. Its checksum rides in the same
all-reduce as the compute figures; a rank whose answer differs from its own first one, or from a
strict majority of the ranks' (a group runs on one kind of device), computes wrong: a `hardware
fault`, its node drained as a straggler's is (`health.straggler_action`). A persistent fault is
what a re-run cannot tell from bad data (it reproduces itself), and that two replicas cannot
settle (they differ with no majority): before a spike is blamed on the data, and before such
replicas roll back, every rank runs the probe once more (`wrong_answers`, health/monitor.py).
Found, the group restarts without the drained node from the last state known good
(health/recovery.py `device_fault`).

Each share's per-rank compute figures, their median and the slowest rank's ratio are
`system/health/*` metrics, and every rank's figure and probe time is a line of
`<run log dir>/probes.jsonl` (one file per replica group: `probes-g<G>.jsonl`), written by rank 0:
a line naming each rank's node at every start of the group, then one per share.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_gpt.config import HealthSection
from elastic_gpt.console import say
from elastic_gpt.health.compute_timer import ComputeTimer
from elastic_gpt.health.faults import FaultInjection, NoFaults
from elastic_gpt.parallel.gradient_checksum import bit_sum
from elastic_gpt.tracking import metric_names as mn

# The answer's checksum travels in float64 with the times: its residue below 2**52 is exact.
ANSWER_MODULUS = 1 << 52

WARMUP_STEPS = 3
"""An attempt's first steps, not timed: one-off set-up (the first step's lazy initialisation,
caches and allocators warming, the first checkpoint's writers starting) that lands on some ranks
more than on others."""

# The probe's work: n square matmuls of this size. On a GPU about a millisecond of an H100's
# bf16 tensor cores; on a CPU thread tens of milliseconds.
PROBE = {"cuda": (2048, 16, torch.bfloat16), "cpu": (256, 32, torch.float32)}


# ---- the window: pure arithmetic, no collective --------------------------------------------------

def trimmed_steps(window: int) -> int:
    """How many of a window's slowest steps its figure leaves out: at least one, so that a single
    slow step is never a straggler, and a tenth of a long window."""
    return max(1, window // 10)


def trimmed_mean(seconds: Sequence[float], trim: int) -> float:
    """The mean of `seconds` without its `trim` largest values."""
    kept = sorted(seconds)[:max(1, len(seconds) - trim)]
    return sum(kept) / len(kept)


class ComputeWindow:
    """One rank's compute over its last `steps` steps, and the figure it shares."""

    def __init__(self, steps: int):
        self.seconds: collections.deque[float] = collections.deque(maxlen=steps)
        self.trim = trimmed_steps(steps)

    def add(self, seconds: float) -> None:
        self.seconds.append(seconds)

    @property
    def full(self) -> bool:
        return len(self.seconds) == self.seconds.maxlen

    def figure(self) -> float:
        """The window's trimmed mean; 0 until it is full (a figure that judges nothing)."""
        return trimmed_mean(self.seconds, self.trim) if self.full else 0.0


@dataclass(frozen=True)
class Verdict:
    median: float
    """The (lower) median of the figures: with two, the faster one."""
    ratios: list[float]
    """Each figure over the median (0 where there was none)."""
    slow: list[int]
    """The indices at `slowdown` times the median or more."""

    @property
    def slowest(self) -> int:
        return max(range(len(self.ratios)), key=lambda r: self.ratios[r])


def judge(figures: Sequence[float], slowdown: float) -> Verdict | None:
    """Which of `figures` (a rank's or a group's compute per step; 0: none) are at `slowdown`
    times the lower median of those given, or more. None with fewer than two figures."""
    given = [f for f in figures if f > 0]
    if len(given) < 2:
        return None
    median = statistics.median_low(given)
    ratios = [f / median if f > 0 else 0.0 for f in figures]
    return Verdict(median, ratios, [i for i, r in enumerate(ratios) if r >= slowdown])


# ---- one rank's part -----------------------------------------------------------------------------

class StragglerWatch:
    """One rank's part: `before_step` before every step's forward, `after_step` after every
    committed step (collective at the shares)."""

    def __init__(self, cfg: HealthSection, *, rank: int, world_size: int, device: torch.device,
                 rank_nodes: list[str] | None = None, metrics=None, membership=None,
                 record_path: str | None = None, faults: FaultInjection = NoFaults(),
                 groups=None):
        """`record_path`: the JSONL file rank 0 appends every share's per-rank figures to (None:
        none kept). `faults`: a test's injected faults (health/faults.py). `groups`: the
        replica groups' exchange of their figures (train/fault_tolerance.py's
        `ReplicaGroupPath`), or None on the restart path."""
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.rank_nodes, self.metrics, self.membership = rank_nodes, metrics, membership
        self.groups = groups if groups is not None and groups.group_count > 1 else None
        self.window = ComputeWindow(cfg.straggler_window)
        self.timer: ComputeTimer | None = None
        self._steps = 0  # steps this attempt has taken (its first WARMUP_STEPS are not judged)
        self.evicted: set[int] = set()
        self.group_left = False  # replica groups: this group was found slow and leaves
        self.worst_ratio = 1.0
        """The highest slowest-over-median ratio of any share so far (a healthy run's margin)."""
        n, reps, dtype = PROBE["cuda" if device.type == "cuda" else "cpu"]
        gen = torch.Generator(device="cpu").manual_seed(0)
        self._a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        self._reps = reps
        self.first_answers: list[int] | None = None
        """Every rank's answer at this attempt's first probe: what each must keep computing."""
        self.baseline = self.active
        """Probe at this attempt's first step even when no periodic probe is due there: set
        where the known answer may be asked for (health/monitor.py)."""
        self.faulty: set[int] = set()
        self._drained: set[int] = set()
        self.last_right_step = 0
        """The step of the last probe at which every rank's answer was right (0: none yet)."""
        self.pending: tuple[list[int], bool] | None = None
        """Wrong answers a probe found and not yet acted on: (the ranks, their nodes drained)."""
        self.faults = faults
        self.record_path = record_path if rank == 0 and self.active else None
        if self.record_path:
            try:
                os.makedirs(os.path.dirname(self.record_path), exist_ok=True)
            except OSError:
                pass  # the first write says what is wrong, once
        self._record({"event": "start", "world_size": world_size, "nodes": rank_nodes})
        if self.groups is not None and self.active:
            self.groups.exchange_group_compute(cfg.straggler_every_steps)

    @property
    def active(self) -> bool:
        return (self.cfg.straggler_action != "off" and self.cfg.straggler_every_steps > 0
                and (self.world_size > 1 or self.groups is not None))

    def before_step(self, model: torch.nn.Module) -> None:
        """Before a step's forward: its compute starts being timed (the timer's hooks are put
        on the model the first time)."""
        if not self.active:
            return
        if self.timer is None:
            self.timer = ComputeTimer(model, self.device)
        self.timer.begin_step()

    def probe(self, step: int) -> tuple[float, int]:
        """Seconds this rank takes for the fixed matmuls (the device drained first), and the
        checksum of their result: the known answer."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        x = self._a
        for _ in range(self._reps):
            x = torch.mm(self._a, x)
            x = x / x.abs().amax().clamp_min(1)  # bounded: no overflow, same work every time
        sync()
        seconds = time.perf_counter() - t0
        return seconds, self.faults.probe_answer(int(bit_sum(x)) % ANSWER_MODULUS, step)

    def _probe_all(self, step: int, compute: float = 0.0
                   ) -> tuple[list[float], list[int], list[float]]:
        """Collective: every rank's probe time, answer and compute figure, in one all-reduce."""
        w = self.world_size
        values = torch.zeros(3 * w, dtype=torch.float64)
        values[self.rank], values[w + self.rank] = self.probe(step)
        values[2 * w + self.rank] = compute
        if dist.is_initialized() and w > 1:
            values = values.to(self.device)
            dist.all_reduce(values)
        values = values.tolist()
        return values[:w], [int(a) for a in values[w:2 * w]], values[2 * w:]

    def wrong_answers(self, step: int, ledger, why: str) -> tuple[list[int], bool]:
        """Collective: every rank probes now. The ranks whose device computes wrong (those not
        named before are named, and their nodes drained: `_act`), and whether they are."""
        wrong = self._check_answers(self._probe_all(step)[1], step, ledger, why)
        self.pending = None
        return wrong, any(r in self._drained for r in wrong)

    def take_wrong_answers(self) -> tuple[list[int], bool] | None:
        """Once, after a periodic probe named a device computing wrong: (its ranks, whether
        their nodes were drained)."""
        found, self.pending = self.pending, None
        return found

    def _check_answers(self, answers: list[int], step: int, ledger, why: str) -> list[int]:
        """The ranks computing wrong; those not named before are named (`pending`)."""
        if self.first_answers is None:
            self.first_answers = answers
        value, count = collections.Counter(answers).most_common(1)[0]
        majority = value if 2 * count > len(answers) else None
        wrong = [r for r, a in enumerate(answers)
                 if a != self.first_answers[r] or (majority is not None and a != majority)]
        if not wrong:
            self.last_right_step = step
        new = [r for r in wrong if r not in self.faulty]
        if new:
            self.faulty.update(new)
            if self._act("hardware fault", new, step, ledger,
                         f"rank(s) {new} computed a wrong known answer in the device probe "
                         f"({why}): a device that computes wrong"):
                self._drained.update(new)
            self.pending = (new, any(r in self._drained for r in new))
        return wrong

    def after_step(self, step: int, ledger) -> list[int]:
        """After committed step `step`: its compute joins the window. Collective every
        `straggler_every_steps` steps: the ranks found straggling at this share, or computing
        wrong (their nodes drained by rank 0 when `straggler_action=evict`)."""
        if self.timer is not None:
            seconds = self.timer.end_step()
            self._steps += 1
            if self._steps > WARMUP_STEPS:
                self.window.add(seconds)
        if self.groups is not None and self.active:
            self._judge_groups(self.groups.take_group_compute(), step, ledger)
        due = self.active and step % self.cfg.straggler_every_steps == 0
        if self.first_answers is None and self.baseline and not due:
            # the known answers, at this attempt's first step
            self._check_answers(self._probe_all(step)[1], step, ledger, "the first probe")
        if not due:
            return []
        times, answers, computes = self._probe_all(step, self.window.figure())
        self._check_answers(answers, step, ledger, f"step {step}")
        verdict = judge(computes, self.cfg.straggler_slowdown) if all(computes) else None
        self._record({"step": step, "probe_s": [round(t, 6) for t in times],
                      **({"compute_s": [round(c, 6) for c in computes]} if verdict else {})})
        if self.groups is not None:
            # The group's pace is its slowest rank's; the groups compare theirs in the next step.
            self.groups.offer_group_compute(max(computes) if all(computes) else 0.0)
        if verdict is None:
            return []
        self.worst_ratio = max(self.worst_ratio, verdict.ratios[verdict.slowest])
        if self.metrics is not None:
            self.metrics.log({**{mn.rank_compute_s(r): c for r, c in enumerate(computes)},
                              mn.HEALTH_COMPUTE_MEDIAN_S: verdict.median,
                              mn.HEALTH_COMPUTE_SLOWEST_RATIO: verdict.ratios[verdict.slowest],
                              mn.HEALTH_COMPUTE_SLOWEST_RANK: verdict.slowest}, step)
        found = [r for r in verdict.slow if r not in self.evicted]
        if found:
            self.evicted.update(found)
            self._act("straggler", found, step, ledger,
                      f"rank(s) {found} computed "
                      f"{', '.join(f'{verdict.ratios[r]:.2f}x' for r in found)} the median "
                      f"rank's compute ({verdict.median * 1e3:.1f} ms a step) over the last "
                      f"{self.cfg.straggler_window} steps",
                      ratios=[round(verdict.ratios[r], 3) for r in found])
        return found

    def _judge_groups(self, figures: list[float] | None, step: int, ledger) -> None:
        """Replica groups: the groups' figures exchanged in this step. The group at the threshold
        times the groups' median leaves: its rank 0 drains its nodes."""
        verdict = judge(figures, self.cfg.straggler_slowdown) if figures else None
        if verdict is None:
            return
        me = self.groups.group_index
        self.worst_ratio = max(self.worst_ratio, verdict.ratios[verdict.slowest])
        if me not in verdict.slow or self.group_left:
            return
        self.group_left = True
        ratio = verdict.ratios[me]
        ranks = list(range(self.world_size))
        self._act("straggler", ranks, step, ledger,
                  f"replica group {me} computed {ratio:.2f}x the median group's compute "
                  f"({verdict.median * 1e3:.1f} ms a step, its slowest rank's) over the last "
                  f"{self.cfg.straggler_window} steps: the group leaves",
                  ratios=[round(ratio, 3)], groups=[me], whole_group=True)

    def _record(self, line: dict) -> None:
        """Appended by rank 0; a file that cannot be written is said once, and training goes on
        (the metrics and events still say what the shares found)."""
        if self.record_path is None:
            return
        try:
            with open(self.record_path, "a") as f:
                f.write(json.dumps({"t": round(time.time(), 3), **line}) + "\n")
        except OSError as e:
            say(f"[elastic-gpt] the straggler watch's per-rank figures are not kept: {e}")
            self.record_path = None

    def _act(self, kind: str, ranks: list[int], step: int, ledger, detail: str,
             whole_group: bool = False, **extra) -> bool:
        """The event, and the drain of the ranks' nodes where `straggler_action=evict` and the
        run keeps a node to train on; whether they are drained. `whole_group`: a replica group
        leaves (the others train on), so even a node hosting every rank of it is drained."""
        nodes = sorted({self.rank_nodes[r] for r in ranks}) if self.rank_nodes else []
        # Draining a node that hosts every rank would leave the group nowhere to train.
        drainable = nodes if whole_group else \
            [n for n in nodes if self.rank_nodes.count(n) < len(self.rank_nodes)]
        evict = self.cfg.straggler_action == "evict" and bool(drainable)
        ledger.events.append({"at": time.time(), "kind": kind, "step": step, "detail": detail,
                              "ranks": ranks, "nodes": nodes, **extra,
                              "action": "node drained" if evict else "reported"})
        if self.rank != 0:
            return evict
        where = f" on node {', '.join(n[:12] for n in nodes)}" if nodes else ""
        say(f"[elastic-gpt] {kind} at step {step}: {detail}{where}; "
            + ("draining its node" if evict else "reported"))
        if evict and self.membership is not None:
            for node in drainable:
                self.membership.drain_node(node, f"{kind}: {detail}")
        return evict
