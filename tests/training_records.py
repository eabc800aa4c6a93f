"""What a finished run logged, read back for the tests that compare runs: each step's metric from
MLflow, and the data fingerprints an uninterrupted run logs (C2 data order)."""

from __future__ import annotations


def uninterrupted_fingerprints(cfg, steps: int) -> dict[int, float]:
    """What an uninterrupted run of `cfg` logs as each step's data fingerprint (C2 data order):
    at step s + 1, the fingerprint of the (s + 1)-th step's G samples."""
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream

    plan = BatchSplit(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    with open_step_stream(cfg.data.path, batch_split=plan, rank=0, world_size=1, start_step=0,
                          seed=cfg.data.seed, shuffle_window=cfg.data.shuffle_window) as stream:
        return {s + 1: float(next(stream).fingerprint) for s in range(steps)}


def metric_by_step(uri: str, run_id: str, key: str) -> dict[int, float]:
    """The last value logged for each step (a step re-done after a failure is logged twice)."""
    import mlflow

    history = mlflow.MlflowClient(uri).get_metric_history(run_id, key)
    out = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        out[m.step] = m.value
    return out
