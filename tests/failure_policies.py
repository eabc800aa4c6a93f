"""The elastic failure policy with a clock the test moves, and a worker group's failure as Ray
Train reports it (its `worker_failures` by rank)."""

from __future__ import annotations

from ray.train import FailureConfig

from elastic_gpt.elastic.membership import RunRecords
from elastic_gpt.elastic.policies import ElasticFailurePolicy


class WorkerGroupError(Exception):
    def __init__(self, failures):
        super().__init__("workers failed")
        self.worker_failures = failures


class ManualClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def failure_policy(run_key: str = "test-no-gcs", budget: float = 3):
    """The policy over `run_key`'s records in the GCS (none needed unless it records), and its
    clock."""
    clock = ManualClock()
    return ElasticFailurePolicy(FailureConfig(), RunRecords(run_key), budget, clock=clock), clock
