"""The training loop and its fault-tolerance mode: the mode's hooks are called at fixed points,
and an attempt a quorum refuses (C7 all-or-nothing step) is re-done from its own batch, applying
nothing."""

from __future__ import annotations

from elastic_gpt.config import load_config
from elastic_gpt.tracking import metric_names as mn

BASE = ["model.preset=tiny", "train.global_batch_size=12", "train.micro_batch_size=2",
        "train.warmup_steps=2", "train.lr=3e-3", "train.log_every=4",
        "checkpoint.every_steps=4", "checkpoint.keep=3", "elastic.max_failures_per_hour=3"]


class _RecordingRestartPath:
    """The restart path's hooks, recorded in the order the loop calls them; the first attempt at
    `refuse` (0-based: the step after `refuse` steps) is not committed, as a replica groups'
    quorum may refuse one (C7 all-or-nothing step)."""

    def __init__(self, refuse: int | None = None):
        from elastic_gpt.train.fault_tolerance import RestartPath

        self.plain, self.refuse, self.calls = RestartPath(), refuse, []
        self.leads, self.degraded = True, False

    def __getattr__(self, name):
        hook = getattr(self.plain, name)
        if not callable(hook):  # what the mode says of itself (group_name, compares_copies)
            return hook

        def recorded(*args, **kwargs):
            self.calls.append(name)
            return hook(*args, **kwargs)
        return recorded

    def should_commit(self, step, stats):
        self.calls.append("should_commit")
        if step == self.refuse:
            self.refuse = None
            return False
        return True


def test_the_loop_calls_the_fault_tolerance_hooks_at_fixed_points(stdlib_dataset, tmp_path):
    """No Ray: one gloo process. An attempt that is not committed is re-done from its own batch,
    applying nothing: every logged figure equals a run where every step committed."""
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.train.trainer import Trainer

    class Sink:
        def __init__(self):
            self.logged = []

        def log(self, metrics, step):
            self.logged.append((step, metrics[mn.TRAIN_LOSS], metrics[mn.DATA_FINGERPRINT]))

        def log_params(self, params):
            pass

        def flush(self, timeout_s):
            return True

        def close(self):
            pass

    runs = {}
    with gloo_group():
        for name, refuse in (("plain", None), ("refused", 1)):
            cfg = load_config(None, [*BASE, "train.max_steps=3", "eval.samples=0",
                                     "train.dtype=float32", f"data.path={stdlib_dataset}",
                                     f"checkpoint.path={tmp_path}/{name}",
                                     "tracking.enabled=false"])
            mode, sink = _RecordingRestartPath(refuse), Sink()
            summary = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None, metrics=sink,
                              fault_tolerance=mode).train()
            runs[name] = (mode.calls, sink.logged, summary)
    step = ["begin_step", "reduce_gradients", "reduce_stats", "should_commit", "quorum_change"]
    assert runs["plain"][0] == ["attach", "on_start", *step * 3, "close"]
    refused = step[:4] + ["on_uncommitted"]
    assert runs["refused"][0] == ["attach", "on_start", *step, *refused, *step * 2, "close"]
    assert runs["refused"][1] == runs["plain"][1]  # the same losses and data, to the bit
    assert [s for s, _, _ in runs["refused"][1]] == [1, 2, 3]
    assert runs["refused"][2]["ledger"].lost_steps == 1 and runs["plain"][2]["ledger"].lost_steps == 0
