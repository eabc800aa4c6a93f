"""Elastic membership on top of Ray Train V2's controller, and the one hook into it:
`ElasticTorchTrainer`, a TorchTrainer whose controller gets our two policies.

How a membership change plays out:

* **Node lost / worker killed.** The controller sees the worker errors, `ElasticFailurePolicy`
  charges the sliding-hour budget and retries, and `LiveCapacityScalingPolicy` sizes the new group
  from live GCS state (alive, non-draining nodes and their free resources), so no placement group
  is ever sized to capacity that is gone. Workers resume from the newest committed checkpoint.
* **Capacity gained.** The scaling policy sees more room than the group uses, gathers the
  arrivals Ray's autoscaler reports in flight for at most `elastic.grow_settle_s` (a burst of
  nodes is one restart; with none in flight it grows at once), and posts a resize request if
  the larger group repays the restart before the next change expected (`resize_rule.py`); rank
  0's `WorkerMembership` picks it up, all ranks agree at the next step boundary (a flag in the
  per-step all-reduce), write a just-in-time checkpoint and raise `ElasticRestart`, which the
  failure policy retries for free at the new size. No step is lost.
* **Placement.** Each group is planned in whole tensor-parallel groups per node and, where the
  layout needs them whole, every worker is pinned to its node (Ray's PACK placement would split a
  group across nodes of uneven room).
  Should a group land where the layout cannot use it anyway, its ranks raise `PlacementError`
  before any step, and the failure policy retries it for free at no more than the aligned size.
* **Node draining** (spot notice turned into a drain by `preemption.py`, or KubeRay/autoscaler
  drains). The watcher sees the drain of a node hosting a rank and does the same: checkpoint at the
  next step boundary, restart without that node. At most the step in flight is re-done.
* **Unfixable errors** (`FatalTrainingError`: bad config, checkpoint of another shape, NaN beyond
  patience) stop the run at once with the real error.

Where the pieces live: `policies.py` (the two policies), `resize_rule.py` (when a grow pays),
`membership.py` (the run's GCS records,
live capacity, rank 0's watcher), `preemption.py` (spot notices -> drains), `ray_internals.py`
(every private Ray API, and `check_ray_internals()`).

Importing this module imports Ray Train and torch: the launcher does so only to build the trainer,
after `check_ray_internals()` has passed.
"""

from __future__ import annotations

import math

from ray.train.torch import TorchTrainer

from elastic_gpt.elastic.membership import RunRecords
from elastic_gpt.elastic.policies import ElasticFailurePolicy, LiveCapacityScalingPolicy


class ElasticTorchTrainer(TorchTrainer):
    """TorchTrainer whose controller sizes groups from live capacity and budgets failures per
    hour. `run_key` names the run's records in the GCS (`RunRecords`); the rest is TorchTrainer's."""

    def __init__(self, train_loop_per_worker, *, run_key: str, max_failures_per_hour: float,
                 tp: int = 1, hsdp: str = "auto", grow_settle_s: float = 0.0,
                 node_mtbf_h: float = math.inf, pp: int = 1, **trainer_kwargs):
        self.run_key = run_key
        self.max_failures_per_hour = max_failures_per_hour
        # Groups are sized in whole tensor-parallel groups per node and whole pipelines.
        self.tp, self.hsdp, self.pp = tp, hsdp, pp
        self.grow_settle_s, self.node_mtbf_h = grow_settle_s, node_mtbf_h  # the grow rule's
        super().__init__(train_loop_per_worker, **trainer_kwargs)

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        records = RunRecords(self.run_key)
        controller_init_kwargs["scaling_policy"] = LiveCapacityScalingPolicy(
            self.scaling_config, records, tp=self.tp, hsdp=self.hsdp,
            grow_settle_s=self.grow_settle_s, node_mtbf_h=self.node_mtbf_h, pp=self.pp)
        controller_init_kwargs["failure_policy"] = ElasticFailurePolicy(
            self.run_config.failure_config, records, self.max_failures_per_hour)
        return super()._initialize_and_run_controller(**controller_init_kwargs)
