"""A metric sink for tests that run the Trainer without MLflow: each logged step's loss and data
fingerprint, what the C2 and C3 checks compare between runs."""

from __future__ import annotations

from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.train.collaborators import NullMetricSink


class StepRecorder(NullMetricSink):
    def __init__(self):
        self.seen: dict[int, tuple[float, float]] = {}
        """step -> (loss, data fingerprint), for every step logged with a loss."""

    def log(self, metrics: dict, step: int) -> None:
        if mn.TRAIN_LOSS in metrics:
            self.seen[step] = (metrics[mn.TRAIN_LOSS], metrics[mn.DATA_FINGERPRINT])


def train_recorded(overrides: list[str], rank: int, world: int):
    """A Trainer of jobs/configs/mini.yaml with `overrides`, trained to its end on this rank of
    an existing process group; (the trainer, what it logged)."""
    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import Trainer

    recorder = StepRecorder()
    trainer = Trainer(load_config("jobs/configs/mini.yaml", overrides), rank=rank,
                      world_size=world, mlflow_run_id=None, metrics=recorder)
    trainer.train()
    return trainer, recorder
