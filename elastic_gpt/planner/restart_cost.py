"""What one restart of the whole run costs, term by term: the restart path's recovery `R`.

- Detection: a rank that fails is noticed by the others only when it stops answering. A process
  or node that dies is reported by Ray at once (its actor's death, its node's missed health
  checks); a rank that hangs (a GPU fault that leaves the process alive, a peer that vanished
  without closing its connections) is a failure only after `elastic.hang_timeout_s`, the
  trainer's bound on every collective of a steady step. The planner plans for that bound
  (`--detect-s` for another).
- Re-placement: Ray Train stops the group and starts it again at the size that is up
  (`--restart-s`, measured by bench/bench_recovery.py; docs/design.md).
- Compilation: `train.compile` compiles each block's graph again in every new process
  (`--compile-s`; the trainer logs the first step's time).
- The checkpoint read: 12 bytes per parameter, every node reading its part at `--ckpt-bandwidth`,
  all of them together at most the storage's sustained bandwidth (`--storage-bandwidth`: Meta's
  Tectonic sustained 2 TB/s for Llama 3's 16K GPUs, Dubey et al. 2024 sec. 3.3.1).
- The work since the last checkpoint, done again: half an interval on average, counted by the
  goodput formula itself (reliability.py), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_gpt.hardware import GB


@dataclass(frozen=True)
class RestartCost:
    detect_s: float
    restart_s: float
    compile_s: float
    read_s: float

    @property
    def total_s(self) -> float:
        return self.detect_s + self.restart_s + self.compile_s + self.read_s

    def breakdown(self) -> str:
        return (f"detect {self.detect_s:.0f} s + restart {self.restart_s:.0f} s + compile "
                f"{self.compile_s:.0f} s + checkpoint read {self.read_s:.1f} s")


def checkpoint_io_s(ckpt_bytes: float, nodes: int, per_node_gbps: float,
                    storage_gbps: float | None) -> float:
    """Writing or reading the whole checkpoint: every node its part, at most the storage's
    sustained bandwidth all together."""
    rate = nodes * per_node_gbps
    if storage_gbps is not None:
        rate = min(rate, storage_gbps)
    return ckpt_bytes / (rate * GB)
