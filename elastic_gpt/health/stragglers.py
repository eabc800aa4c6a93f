"""Stragglers found and evicted: a rank whose device computes slower than its peers' holds every
step of a synchronous group back, and nothing else in the run says so.

A rank's step time cannot show it: under FSDP every rank waits for the slowest in each all-gather
and reduce-scatter, so all step times come out equal. What differs is the time of compute alone,
so every `health.straggler_every_steps` steps each rank times the same fixed matmuls on its device
(a few milliseconds on a GPU, tens on a CPU thread: no collective inside, so no wait is counted),
and the times are all-reduced (one vector of a float per rank), as NVIDIA's resiliency
extension scores GPU performance with a fixed workload. A rank slower than the group's median
(the lower median: with two ranks, the faster one) by `health.straggler_slowdown` at
`health.straggler_checks` consecutive probes is a straggler: an event, and its node is drained
(the group checkpoints at the next step and restarts without it, with the same data order; the
autoscaler replaces the node). With replica groups the drain takes its group out of the quorum
the same way, and the others train on. A node that hosts every rank of the group is not drained
(there would be nothing to train on): the straggler is reported.

The same probe is a known-answer test of each device, as fleets screen for silent data
corruption (Dixit et al., "Silent Data Corruptions at Scale", Meta 2021; Hochschild et al., "Cores
that don't count", HotOS 2021): its result is a fixed function of a fixed input, the same bits on
every healthy device of a kind and on one device over time. The probe's checksum rides in the same
all-reduce as its time; a rank whose answer differs from its own first one, or from a strict
majority of the ranks' (a group runs on one kind of device), computes wrong: a `hardware fault`,
its node drained as a straggler's is (`health.straggler_action`). A persistent fault is what a
re-run cannot tell from bad data (it reproduces itself), and that two replicas cannot settle
(they differ with no majority): before a spike is blamed on the data, and before such replicas
roll back, every rank runs the probe once more (`wrong_answers`, health/monitor.py). Found,
the group restarts without the drained node from the last state known good (health/recovery.py
`device_fault`).

Each probe's slowest rank and its ratio to the median are `system/health/*` metrics, and every
rank's time is a line of `<run log dir>/probes.jsonl` (one file per replica group:
`probes-g<G>.jsonl`), written by rank 0: a line naming each rank's node at every start of the
group, then one per probe. A rank's probe time is its compute time with no wait in it; a step's
time is not (the FSDP argument above).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from elastic_gpt.config import HealthSection
from elastic_gpt.console import say
from elastic_gpt.health.faults import FaultInjection, NoFaults
from elastic_gpt.parallel.gradient_checksum import bit_sum
from elastic_gpt.tracking import metric_names as mn

# The answer's checksum travels in float64 with the times: its residue below 2**52 is exact.
ANSWER_MODULUS = 1 << 52

# The probe's work: n square matmuls of this size. On a GPU about a millisecond of an H100's
# bf16 tensor cores; on a CPU thread tens of milliseconds, longer than a scheduler's time slice,
# so a starved process shows up in it.
PROBE = {"cuda": (2048, 16, torch.bfloat16), "cpu": (256, 32, torch.float32)}


class StragglerWatch:
    """One rank's part of the probe; every rank calls `after_step` at every step."""

    def __init__(self, cfg: HealthSection, *, rank: int, world_size: int, device: torch.device,
                 rank_nodes: list[str] | None = None, metrics=None, membership=None,
                 record_path: str | None = None, faults: FaultInjection = NoFaults()):
        """`record_path`: the JSONL file rank 0 appends every probe's per-rank times to (None:
        none kept). `faults`: a test's injected faults (health/faults.py)."""
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.rank_nodes, self.metrics, self.membership = rank_nodes, metrics, membership
        self.slow_streak = [0] * world_size
        self.evicted: set[int] = set()
        self.worst_ratio = 1.0
        """The highest slowest-over-median ratio of any probe so far (a healthy run's margin)."""
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

    @property
    def active(self) -> bool:
        return (self.cfg.straggler_action != "off" and self.cfg.straggler_every_steps > 0
                and self.world_size > 1)

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

    def _probe_all(self, step: int) -> tuple[list[float], list[int]]:
        """Collective: every rank's probe time and answer, in one all-reduce."""
        values = torch.zeros(2 * self.world_size, dtype=torch.float64)
        values[self.rank], values[self.world_size + self.rank] = self.probe(step)
        if dist.is_initialized() and self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values)
        values = values.tolist()
        return values[:self.world_size], [int(a) for a in values[self.world_size:]]

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
        """Collective every `straggler_every_steps` steps: the ranks found straggling at this
        probe, or computing wrong (their nodes drained by rank 0 when
        `straggler_action=evict`)."""
        due = self.active and step % self.cfg.straggler_every_steps == 0
        if self.first_answers is None and self.baseline and not due:
            # the known answers, at this attempt's first step
            self._check_answers(self._probe_all(step)[1], step, ledger, "the first probe")
        if not due:
            return []
        times, answers = self._probe_all(step)
        self._check_answers(answers, step, ledger, f"step {step}")
        median = statistics.median_low(times)
        ratios = [t / median for t in times]
        for r, ratio in enumerate(ratios):
            slow = ratio >= self.cfg.straggler_slowdown
            self.slow_streak[r] = self.slow_streak[r] + 1 if slow else 0
        slowest = max(range(self.world_size), key=lambda r: ratios[r])
        self.worst_ratio = max(self.worst_ratio, ratios[slowest])
        self._record({"step": step, "probe_s": [round(t, 6) for t in times]})
        if self.metrics is not None:
            self.metrics.log({mn.HEALTH_PROBE_MEDIAN_S: median,
                              mn.HEALTH_PROBE_SLOWEST_RATIO: ratios[slowest],
                              mn.HEALTH_PROBE_SLOWEST_RANK: slowest}, step)
        found = [r for r in range(self.world_size)
                 if self.slow_streak[r] >= self.cfg.straggler_checks and r not in self.evicted]
        if found:
            self.evicted.update(found)
            self._act("straggler", found, step, ledger,
                      f"rank(s) {found} computed "
                      f"{', '.join(f'{ratios[r]:.2f}x' for r in found)} the median "
                      f"({median * 1e3:.1f} ms) at {self.cfg.straggler_checks} probes in a row",
                      ratios=[ratios[r] for r in found])
        return found

    def _record(self, line: dict) -> None:
        """Appended by rank 0; a file that cannot be written is said once, and training goes on
        (the metrics and events still say what the probe found)."""
        if self.record_path is None:
            return
        try:
            with open(self.record_path, "a") as f:
                f.write(json.dumps({"t": round(time.time(), 3), **line}) + "\n")
        except OSError as e:
            say(f"[elastic-gpt] the straggler probe's per-rank times are not kept: {e}")
            self.record_path = None

    def _act(self, kind: str, ranks: list[int], step: int, ledger, detail: str,
             **extra) -> bool:
        """The event, and the drain of the ranks' nodes where `straggler_action=evict` and the
        group keeps a node to train on; whether they are drained."""
        nodes = sorted({self.rank_nodes[r] for r in ranks}) if self.rank_nodes else []
        # Draining a node that hosts every rank would leave the group nowhere to train.
        drainable = [n for n in nodes if self.rank_nodes.count(n) < len(self.rank_nodes)]
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
