"""Typed run configuration: YAML file + dotted `key=value` overrides, validated up front.

Every user error is a `ValueError` whose message names the key and the fix, raised before any
cluster, checkpoint or MLflow run is touched (C6).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

log = logging.getLogger("elastic_gpt")


@dataclass
class ModelSection:
    preset: str = "tiny"
    """A name from model.PRESETS; the fields below override its shape."""
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    seq_len: int | None = None
    """Context length. None: the dataset manifest's seq_len."""
    vocab_size: int | None = None
    """Embedding rows. None: the manifest's tokenizer vocab padded up to a multiple of 64."""
    dropout: float = 0.0


@dataclass
class DataSection:
    path: str = ""
    """Dataset directory written by `elastic-gpt prepare-data --output` (any fsspec URL)."""
    seed: int = 1234
    """Seeds the sample order (C2): same seed + dataset => same order at any world size."""
    shuffle_window: int = 16384
    """Samples shuffled together inside a window after the per-epoch shard shuffle."""
    prefetch_steps: int = 4
    """Steps of batches each worker reads ahead in a background thread."""


@dataclass
class TrainSection:
    global_batch_size: int = 32
    """Sequences per optimizer step, fixed for the whole run whatever the world size (C1)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one worker; G / micro_batch_size micro-batches per step."""
    max_steps: int = 100
    lr: float = 6e-4
    """Peak learning rate, reached after warmup_steps, then cosine-decayed to min_lr at max_steps."""
    min_lr: float | None = None
    """Floor of the cosine schedule. None: lr / 10 (Chinchilla, nanoGPT)."""
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    dtype: str = "auto"
    """Compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16."""
    activation_checkpointing: bool = False
    compile: bool = False
    """torch.compile each transformer block (GPU; on CPU it costs minutes of compile time)."""
    reshard_after_forward: str = "auto"
    """always: free each block's gathered weights after forward and gather again in backward
    (ZeRO-3, least memory, 2L - 1 all-gathers per micro-batch); never: keep them from a step's
    first forward to its last backward (L all-gathers per step); auto: never while the gathered
    model fits in 1/8 of every worker's memory. `elastic-gpt plan` writes always or never."""
    grad_sync: str = "step"
    """step: reduce-scatter gradients once per step, after the last micro-batch (fp32 gradients
    accumulate unsharded); microbatch: after every micro-batch (sharded, more communication)."""
    seed: int = 0
    """Seeds weight init and dropout (dropout RNG is derived from (seed, step, micro-batch))."""
    log_every: int = 1
    """Print a progress line every N steps (metrics go to MLflow every step regardless)."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker; 0: cpus_per_worker."""
    nan_patience: int = 0
    """Consecutive non-finite losses tolerated (step skipped) before the run stops."""


@dataclass
class ScalingSection:
    min_workers: int = 2
    max_workers: int = 2
    use_gpu: str | bool = "auto"
    """auto: GPUs when the cluster has any."""
    cpus_per_worker: int = 1
    accelerator_type: str | None = None
    """Pin workers to a GPU type (a Ray accelerator_type resource, e.g. H100)."""


@dataclass
class CheckpointSection:
    path: str = ""
    """Root URL (file://, s3://, gs://, or a local path) for step_<N> directories.
    Empty: runs/<run.name>/checkpoints under the working directory."""
    every_steps: int = 50
    keep: int = 3
    """Committed checkpoints kept; the newest is never deleted (C4)."""
    async_save: bool = False
    """Write in a background thread after a CPU copy, so training continues during the upload."""


@dataclass
class TrackingSection:
    uri: str = ""
    """MLflow tracking URI. Empty: MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db."""
    experiment: str = "elastic-gpt"
    enabled: bool = True
    log_model: bool = True
    """At the end of a finished run, log the model (HF format + mlflow.pytorch) to the run."""


@dataclass
class RunSection:
    name: str = "default"
    """MLflow run name; one name + checkpoint root = one experiment continued across restarts (C5)."""
    storage_path: str = ""
    """Where Ray Train keeps its run state. Empty: runs/ under the working directory."""
    stop_at_step: int | None = None
    """End this session after committing this step; the LR schedule still targets max_steps.
    For time-boxed allocations: the next `train` resumes from it."""


@dataclass
class ElasticSection:
    max_failures_per_hour: float = 10.0
    """Failure budget over a sliding hour; restarts stop once it is spent."""
    worker_start_timeout_s: float = 20.0
    """How long to wait for a worker group's resources before retrying at the live size."""


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    run: RunSection = field(default_factory=RunSection)
    elastic: ElasticSection = field(default_factory=ElasticSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, object]:
        """{'train.lr': 0.0006, ...}: what MLflow logs as params."""
        return {f"{s}.{k}": v for s, sec in self.to_dict().items() for k, v in sec.items()}


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides, then validated."""
    raw: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {path} does not exist; pass --config with a YAML file "
                             "such as jobs/configs/mini.yaml")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {_first_line(e)}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {path} must be a mapping of sections (model:, train:, ...)")
    cfg = Config()
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ValueError(f"config section {section!r} in {path} must be a mapping of keys")
        for key, value in values.items():
            _set(cfg, f"{section}.{key}", value)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. train.lr=3e-4)")
        key, value = item.split("=", 1)
        _set(cfg, key.strip(), yaml.safe_load(value) if value.strip() else "")
    validate(cfg)
    return cfg


def config_from_dict(d: dict) -> Config:
    """Rebuild a Config sent to workers as a plain dict (Ray passes train_loop_config by value)."""
    cfg = Config()
    for section, values in d.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def _set(cfg: Config, dotted: str, value) -> None:
    section, _, key = dotted.partition(".")
    sections = {f.name for f in fields(Config)}
    if section not in sections or not key:
        raise ValueError(f"unknown config key {dotted!r}; sections are: {', '.join(sorted(sections))}")
    sec = getattr(cfg, section)
    names = {f.name: f for f in fields(sec)}
    if key not in names:
        raise ValueError(f"unknown config key {dotted!r}; keys of {section}: {', '.join(names)}")
    setattr(sec, key, _coerce(dotted, value, names[key].type, getattr(sec, key)))


def _coerce(dotted: str, value, type_str, default):
    """YAML already typed the value; check it against the field's declared type."""
    t = str(type_str)
    if value is None:
        if "None" in t:
            return None
        raise ValueError(f"{dotted} cannot be empty")
    if t.startswith("bool"):
        if isinstance(value, bool):
            return value
        raise ValueError(f"{dotted}={value!r} must be true or false")
    if t.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{dotted}={value!r} must be an integer")
        return value
    if t.startswith("float"):
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{dotted}={value!r} must be a number")
        return float(value)
    if t.startswith("str | bool"):
        return value
    if not isinstance(value, (str, int, float)):
        raise ValueError(f"{dotted}={value!r} must be a string")
    return str(value)


def validate(cfg: Config) -> None:
    from elastic_gpt.data.order import BatchPlan
    from elastic_gpt.model.gpt import PRESETS

    if cfg.model.preset not in PRESETS:
        raise ValueError(f"model.preset={cfg.model.preset!r} is unknown; choose one of "
                         f"{', '.join(PRESETS)}")
    t, s = cfg.train, cfg.scaling
    for key, v in [("train.max_steps", t.max_steps), ("checkpoint.every_steps",
                   cfg.checkpoint.every_steps), ("checkpoint.keep", cfg.checkpoint.keep),
                   ("scaling.min_workers", s.min_workers), ("scaling.cpus_per_worker",
                   s.cpus_per_worker), ("train.log_every", t.log_every)]:
        if v < 1:
            raise ValueError(f"{key}={v} must be at least 1")
    if s.max_workers < s.min_workers:
        raise ValueError(f"scaling.max_workers={s.max_workers} is below scaling.min_workers="
                         f"{s.min_workers}; set max_workers >= min_workers")
    if t.lr <= 0 or (t.min_lr is not None and not 0 <= t.min_lr <= t.lr):
        raise ValueError(f"train.lr={t.lr} must be > 0 and train.min_lr={t.min_lr} in [0, lr]")
    if t.warmup_steps < 0 or t.warmup_steps > t.max_steps:
        raise ValueError(f"train.warmup_steps={t.warmup_steps} must be in [0, train.max_steps="
                         f"{t.max_steps}]")
    if t.reshard_after_forward not in ("auto", "always", "never"):
        raise ValueError(f"train.reshard_after_forward={t.reshard_after_forward!r} must be auto, "
                         "always or never")
    if t.grad_sync not in ("step", "microbatch"):
        raise ValueError(f"train.grad_sync={t.grad_sync!r} must be step or microbatch")
    if t.dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"train.dtype={t.dtype!r} must be auto, float32 or bfloat16")
    if str(s.use_gpu) not in ("auto", "True", "False"):
        raise ValueError(f"scaling.use_gpu={s.use_gpu!r} must be auto, true or false")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ValueError(f"model.dropout={cfg.model.dropout} must be in [0, 1)")
    plan = BatchPlan(t.global_batch_size, t.micro_batch_size)
    plan.check_world_size(s.max_workers)
    if not cfg.data.path:
        raise ValueError("data.path is empty; point it at a dataset made by `elastic-gpt "
                         "prepare-data --output URL` (e.g. data.path=data/stdlib)")


def resolve_paths(cfg: Config, cwd: str | None = None) -> Config:
    """Make every local path absolute on the driver: Ray workers run in another directory."""
    cwd = cwd or os.getcwd()
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # inside `ray job submit`
        relative = [k for k, v in (("data.path", cfg.data.path), ("checkpoint.path",
                    cfg.checkpoint.path), ("run.storage_path", cfg.run.storage_path))
                    if v and "://" not in v and not os.path.isabs(v)]
        for key in relative:
            log.warning("%s=%s is relative to the job's unpacked working dir, which is new at "
                        "every submission; use an absolute path or a URL (docs/operations.md)",
                        key, getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]))
    cfg.data.path = absolute_url(cfg.data.path, cwd)
    cfg.checkpoint.path = absolute_url(
        cfg.checkpoint.path or os.path.join("runs", cfg.run.name, "checkpoints"), cwd)
    cfg.run.storage_path = absolute_url(cfg.run.storage_path or "runs", cwd).removeprefix("file://")
    if not cfg.tracking.uri:
        cfg.tracking.uri = os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{os.path.join(cwd, 'mlflow.db')}"
    return cfg


def absolute_url(url: str, cwd: str) -> str:
    if "://" in url:
        return url
    return "file://" + os.path.normpath(os.path.join(cwd, os.path.expanduser(url)))


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
