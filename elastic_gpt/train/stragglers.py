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

Each probe's slowest rank and its ratio to the median are `system/health/*` metrics, and every
rank's time is a line of `<run log dir>/probes.jsonl` (one file per replica group:
`probes-g<G>.jsonl`), written by rank 0: a line naming each rank's node at every start of the
group, then one per probe. A rank's probe time is its compute time with no wait in it; a step's
time is not (the FSDP argument above).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from elastic_gpt.config import HealthSection
from elastic_gpt.console import say
from elastic_gpt.tracking import metric_names as mn

# The probe's work: n square matmuls of this size. On a GPU about a millisecond of an H100's
# bf16 tensor cores; on a CPU thread tens of milliseconds, longer than a scheduler's time slice,
# so a starved process shows up in it.
PROBE = {"cuda": (2048, 16, torch.bfloat16), "cpu": (256, 32, torch.float32)}


class StragglerWatch:
    """One rank's part of the probe; every rank calls `after_step` at every step."""

    def __init__(self, cfg: HealthSection, *, rank: int, world_size: int, device: torch.device,
                 rank_nodes: list[str] | None = None, metrics=None, membership=None,
                 record_path: str | None = None):
        """`record_path`: the JSONL file rank 0 appends every probe's per-rank times to (None:
        none kept)."""
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

    def probe_s(self) -> float:
        """Seconds this rank takes for the fixed matmuls (the device drained first)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        x = self._a
        for _ in range(self._reps):
            x = torch.mm(self._a, x)
            x = x / x.abs().amax().clamp_min(1)  # bounded: no overflow, same work every time
        sync()
        return time.perf_counter() - t0

    def after_step(self, step: int, ledger) -> list[int]:
        """Collective every `straggler_every_steps` steps: the ranks found straggling at this
        probe (their nodes drained by rank 0 when `straggler_action=evict`)."""
        if not self.active or step % self.cfg.straggler_every_steps:
            return []
        times = torch.zeros(self.world_size, dtype=torch.float64)
        times[self.rank] = self.probe_s()
        if dist.is_initialized():
            times = times.to(self.device)
            dist.all_reduce(times)
        times = times.tolist()
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
            self._act(found, ratios, median, step, ledger)
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

    def _act(self, ranks: list[int], ratios: list[float], median: float, step: int,
             ledger) -> None:
        self.evicted.update(ranks)
        nodes = sorted({self.rank_nodes[r] for r in ranks}) if self.rank_nodes else []
        # Draining a node that hosts every rank would leave the group nowhere to train.
        drainable = [n for n in nodes if self.rank_nodes.count(n) < len(self.rank_nodes)]
        evict = self.cfg.straggler_action == "evict" and bool(drainable)
        detail = (f"rank(s) {ranks} computed {', '.join(f'{ratios[r]:.2f}x' for r in ranks)} "
                  f"the median ({median * 1e3:.1f} ms) at {self.cfg.straggler_checks} probes in a "
                  f"row")
        ledger.events.append({"at": time.time(), "kind": "straggler", "step": step,
                              "detail": detail, "ranks": ranks, "nodes": nodes,
                              "ratios": [ratios[r] for r in ranks],
                              "action": "node drained" if evict else "reported"})
        if self.rank != 0:
            return
        where = f" on node {', '.join(n[:12] for n in nodes)}" if nodes else ""
        say(f"[elastic-gpt] straggler at step {step}: {detail}{where}; "
            + ("draining its node" if evict else "reported"))
        if evict and self.membership is not None:
            for node in drainable:
                self.membership.drain_node(node, f"straggler: {detail}")
