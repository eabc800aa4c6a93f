"""Typed run configuration: YAML file + dotted `key=value` overrides, validated up front.

Every field's type is the check (`config_types.py` reads the resolved type hints: int, float,
bool, str, `Literal` for closed sets, `X | None` for optional fields, `Annotated[..., Range]` for
bounds), so a value is judged the moment it is set. `validate()` holds only what no single field's type can
say: rules between fields, the preset registry, the required dataset path. Every user error is a
`ValueError` whose message names the key and the fix, raised before any cluster, checkpoint or
MLflow run is touched (C6 clear errors).

It must not know how the layers it configures work, and imports neither Ray, torch nor the
trainer: only the data layer's order rules (the shuffle-window default, the batch rule), the
tensor-parallel rules (parallel/tp_rules.py) and, to validate, the model presets
(model/config.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Literal, get_type_hints

import yaml

from elastic_gpt.config_types import AtLeastOne, Range, coerce
from elastic_gpt.console import first_line
from elastic_gpt.data.order import DEFAULT_READ_BLOCK_BYTES, DEFAULT_SHUFFLE_WINDOW
from elastic_gpt.parallel.tp_rules import workers_problem

log = logging.getLogger(__name__)




@dataclass
class ModelSection:
    preset: str = "tiny"
    """A name from elastic_gpt.model.config.PRESETS (GPT-2's: tiny, mini, ..., gpt3-175b;
    Llama 3's: llama3-tiny, llama3-mini, llama3-8b, llama3-70b, llama3-405b, ...); the fields
    below override its shape."""
    family: Literal["gpt2", "llama"] | None = None
    """The block the model is built of: gpt2 (LayerNorm, learned positions, GELU, tied
    embeddings) or llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention). None: the
    preset's. A GPT-2 preset with family=llama is a Llama of the preset's sizes."""
    n_layer: int | None = None
    """Transformer blocks. None: the preset's."""
    n_head: int | None = None
    """Attention heads per block (must divide n_embd). None: the preset's."""
    n_embd: int | None = None
    """Width of the residual stream. None: the preset's."""
    seq_len: int | None = None
    """Context length. None: the dataset manifest's seq_len."""
    vocab_size: int | None = None
    """Embedding rows. None: the manifest's tokenizer vocab padded up to a multiple of 64."""
    dropout: Annotated[float, Range(0, 1)] = 0.0
    """Dropout probability in attention, after each residual branch and on the embeddings."""
    n_kv_head: Annotated[int, Range(1)] | None = None
    """llama: key/value heads (grouped-query attention; must divide n_head). None: the
    preset's, else n_head."""
    ffn_hidden: Annotated[int, Range(1)] | None = None
    """llama: the SwiGLU MLP's hidden width. None: the preset's, else Llama's rule (8/3 of the
    width, rounded up to a multiple of 256)."""
    rope_theta: Annotated[float, Range(1)] | None = None
    """llama: the rotary embeddings' base. None: the preset's (500,000)."""
    rope_scaling: bool | None = None
    """llama: Llama 3.1's RoPE frequency scaling (factor 8 over an original context of 8,192).
    None: the preset's (on)."""
    tie_embeddings: bool | None = None
    """llama: the output layer is the token embedding (one matrix). None: the preset's (untied,
    but Llama 3.2's 1B)."""


@dataclass
class DataSection:
    path: str = ""
    """Dataset directory written by `elastic-gpt prepare-data --output` (any fsspec URL)."""
    seed: int = 1234
    """Seeds the sample order (C2 data order): same seed + dataset => same order at any world
    size."""
    shuffle_window: int = DEFAULT_SHUFFLE_WINDOW
    """Samples shuffled together inside a window after the per-epoch shard shuffle."""
    prefetch_steps: int = 4
    """Steps of batches each worker reads ahead in a background thread."""
    read_block_bytes: Annotated[int, Range(0)] = DEFAULT_READ_BLOCK_BYTES
    """Bytes per ranged read: each worker reads aligned blocks of a shard (and each shard's whole
    index) once and keeps them while the shuffle window draws from them, about D requests per
    block for D data-parallel ranks instead of ~2 per sample, for D times the bytes. Blocks holding
    under 4 of a rank's samples, or 0 here: each record read alone (fewest bytes, most requests).
    See docs/data.md."""
    sources: list[dict] | None = None
    """A weighted mixture instead of one data.path: a list of {path: URL, weight: number > 0},
    each a dataset from `prepare-data`. Step t's samples are a seeded, world-size independent
    interleave of the sources in proportion to their weights (C2 data order). Leave data.path
    empty."""


@dataclass
class EvalSection:
    path: str = ""
    """Validation dataset (a `prepare-data` output). Empty: the held-out split prepare-data wrote
    next to the training data (<data.path>/val), when there is one; none: no evaluation."""
    every_steps: Annotated[int, Range(0)] = 0
    """Evaluate every N steps (0: only the final evaluation at the end of the run)."""
    samples: Annotated[int, Range(0)] = 64
    """Validation sequences per evaluation: the first N of the validation set, the same set at
    any world size (0 disables evaluation)."""


@dataclass
class TrainSection:
    global_batch_size: int = 32
    """Sequences per optimizer step, fixed for the whole run whatever the world size (C1 fixed global
    batch)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one worker; G / micro_batch_size micro-batches per step."""
    max_steps: AtLeastOne = 100
    """Optimizer steps of the whole run; the LR schedule ends here."""
    lr: float = 6e-4
    """Peak learning rate, reached after warmup_steps, then cosine-decayed to min_lr at max_steps."""
    min_lr: float | None = None
    """Floor of the cosine schedule. None: lr / 10 (Chinchilla, nanoGPT)."""
    warmup_steps: int = 10
    """Steps of linear warmup from lr / warmup_steps up to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay on weight matrices and embeddings; biases and LayerNorm get none."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16."""
    peak_tflops: Annotated[float, Range(0)] = 0.0
    """One worker's peak in TFLOP/s that train/mfu is measured against. 0: the hardware table's
    dense bf16 peak on a GPU (NaN for a GPU it lacks: set this), a measured fp32 GEMM rate on a
    CPU."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them: less memory."""
    activation_checkpointing_mode: Literal["full", "selective"] = "full"
    """With activation_checkpointing: full recomputes each block whole; selective keeps the
    outputs of its matmuls, attention and reduce-scatters and recomputes the rest (per-op, as
    torchtitan's `selective` op mode). The memory model counts selective as no checkpointing."""
    compile: bool = False
    """torch.compile each transformer block (GPU; on CPU it costs minutes of compile time)."""
    float8: bool = False
    """The blocks' matmuls in float8 (torchao, dynamic scaling, FSDP2 gathering float8 weights):
    for H100/H200-class GPUs, with train.compile (eager float8 is slower than bf16). Needs the
    `float8` extra (torchao); not with parallel.tp > 1 yet."""
    reshard_after_forward: Literal["auto", "always", "never"] = "auto"
    """always: free each block's gathered weights after forward and gather again in backward
    (ZeRO-3, least memory, 2L - 1 all-gathers per micro-batch); never: keep them from a step's
    first forward to its last backward (L all-gathers per step); auto: as the planner would
    choose for this group, from its memory and step-time models (docs/planner.md, "Settings
    resolved at run time"). `elastic-gpt plan` writes always or never."""
    grad_sync: Literal["auto", "step", "microbatch"] = "auto"
    """step: reduce-scatter gradients once per step, after the last micro-batch (fp32 gradients
    accumulate unsharded: 4 bytes per parameter of a tensor-parallel rank); microbatch: after
    every micro-batch (sharded, more communication); auto: as the planner would choose."""
    seed: int = 0
    """Seeds weight init and dropout (dropout RNG is derived from (seed, step, micro-batch))."""
    log_every: AtLeastOne = 1
    """Print a progress line every N steps (metrics go to MLflow every step regardless)."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker; 0: cpus_per_worker."""
    nan_patience: int = 0
    """Consecutive non-finite losses tolerated (step skipped) before the run rolls back
    (health.spike_action=rollback) or stops."""


@dataclass
class ScalingSection:
    min_workers: AtLeastOne = 2
    """Fewest workers the run trains with; below this it waits for nodes instead."""
    max_workers: int = 2
    """Most workers the run grows to when nodes join."""
    use_gpu: Literal["auto"] | bool = "auto"
    """One GPU per worker. auto: GPUs when the cluster has any up; a cluster whose autoscaler
    declares GPU node types none of which is up yet is refused with one line (true waits for
    them, false trains on CPUs)."""
    cpus_per_worker: AtLeastOne = 1
    """CPUs Ray reserves for each worker."""
    accelerator_type: str | None = None
    """Pin workers to a GPU type (a Ray accelerator_type resource, e.g. H100)."""


@dataclass
class ParallelSection:
    tp: AtLeastOne = 1
    """Tensor-parallel degree: ranks each layer is split over (Megatron style, with sequence
    parallelism), always inside one node; must divide model.n_head, the sequence length, the
    workers of every node and scaling.min/max_workers. The data-parallel degree is W / tp."""
    hsdp: Literal["auto", "on", "off"] = "auto"
    """on: FSDP shards within a node and replicates across nodes (all-gathers stay on the
    intra-node links, gradients are all-reduced across nodes); off: one FSDP group over every
    data-parallel rank; auto: as the planner would choose for this group (on needs nodes with the
    same worker count, and a node's share of the model state on every GPU)."""
    async_tp: bool = False
    """Overlap each tensor-parallel matmul with its all-gather or reduce-scatter (torch's
    micro-pipelined TP over symmetric memory, torchtitan's async TP): tp > 1 on CUDA GPUs with
    train.compile."""
    pp: AtLeastOne = 1
    """Pipeline-parallel degree: the model's layers split into stages over pp runs of ranks
    (embeddings on the first, the output layer and loss on the last, blocks balanced by cost),
    each step's micro-batches streamed through them. Workers come in whole pipelines of pp x tp;
    the data-parallel degree is W / (pp x tp), and elasticity changes only it."""
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "interleaved_zero_bubble"] = "1f1b"
    """1f1b: one stage per rank; interleaved_1f1b: parallel.pp_stages_per_rank stages per rank
    (Megatron's virtual stages: a bubble that many times smaller, for as many more transfers);
    interleaved_zero_bubble: as interleaved, with each backward split into its input and its
    weight gradients so the latter fill the bubble (torch's schedule after Qi et al. 2024)."""
    pp_stages_per_rank: AtLeastOne = 1
    """Stages per pipeline rank: 1 for 1f1b, at least 2 for the interleaved schedules."""


@dataclass
class CheckpointSection:
    path: str = ""
    """Root URL (file://, s3://, gs://, or a local path) for step_<N> directories.
    Empty: runs/<run.name>/checkpoints under the working directory."""
    every_steps: Annotated[int, Range(0)] = 50
    """Commit a checkpoint every N steps (0: no step cadence), and at the last step of a
    session."""
    every_minutes: Annotated[float, Range(0)] = 0.0
    """Also commit one when this many minutes of wall time have passed since the last save
    (0: no clock cadence); rank 0's clock decides for every rank. With both set a save is due
    when either is, and any save restarts the clock. `elastic-gpt plan --write-config` writes
    its Young/Daly interval here (and every_steps: 0): a cadence that holds whatever a step
    costs."""
    keep: AtLeastOne = 3
    """Committed checkpoints kept; the newest is never deleted (C4 atomic commit)."""
    async_save: Literal["auto"] | bool = "auto"
    """Write in a background thread after a copy to (pinned) CPU memory, so training continues
    during the upload. auto: on when the model trains on CUDA, off on the CPU, where the
    background write would take cores from the training."""
    write_streams: Annotated[int, Range(1, 65)] = 8
    """Files each rank writes at once, each by its own thread (and, to an object store, its own
    upload): one upload per rank cannot fill a node's network link."""
    init_from: str = ""
    """A Hugging Face model directory (config.json and safetensors weights: GPT-2 or Llama) a
    fresh run starts from instead of a random init: the model's shape is the directory's (the
    model.* shape keys may be left unset, and must agree if set), each rank reads only the
    slices of the weights its shards hold, and a run with a committed checkpoint resumes from
    that instead. The dataset must be tokenized with the directory's tokenizer."""


@dataclass
class TrackingSection:
    uri: str = ""
    """MLflow tracking URI. Empty: MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db."""
    experiment: str = "elastic-gpt"
    """MLflow experiment the run is logged under."""
    enabled: bool = True
    """Log params and metrics to an MLflow run; false: no MLflow run is made."""
    log_model: bool = True
    """At the end of a finished run, log the model (HF format + mlflow.pytorch) to the run."""


@dataclass
class RunSection:
    name: str = "default"
    """MLflow run name; one name + checkpoint root = one experiment continued across restarts (C5 one
    MLflow run)."""
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
    grow_settle_s: Annotated[float, Range(0)] = 30.0
    """When capacity appears under a running group and Ray's autoscaler reports more launches
    in flight, wait for them at most this long after the first new node, then size the grow to
    every node up by then: the nodes of a burst (a cloud's batch of instances registers with Ray
    over tens of seconds) cost one restart, not one each. With none reported the group grows at
    once. A lost node is acted on at once."""
    node_mtbf_h: Annotated[float, Range(0.001)] = 200.0
    """A node's mean time between losses, in hours, that the grow rule assumes until the run has
    a record of its own changes: a grow is made only when the larger group repays its restart
    before the next change expected (elastic/resize_rule.py). The planner's spot figure by
    default (`elastic-gpt plan --spot-node-mtbf-hours`)."""
    hang_timeout_s: Annotated[float, Range(1)] = 600.0
    """A hung rank (a stuck process, a peer that vanished without closing its connections) is a
    failure after this long: the bound on every collective of a steady step and on a worker not
    answering Ray Train's health check (torchft's quorum waits twice that: another group's hang
    first). Above the longest legitimate wait of a step (a checkpoint write)."""
    init_timeout_s: Annotated[float, Range(1)] = 1800.0
    """The bound on collectives while an attempt starts, until its first step is done, and
    around its first checkpoint: communicators of a large group, the first compile, the
    checkpoint read and the first write wait far longer than a steady step."""
    replica_groups: Literal["off"] | Annotated[int, Range(1)] = "off"
    """off: one worker group, restarted from the newest checkpoint on any membership change.
    N: N replica groups (docs/replica-groups.md): each its own Ray Train run of
    scaling.max_workers / N workers with FSDP2 (and tp) inside it, torchft's fault-tolerant
    all-reduce across groups; a lost group drops out of the next step's quorum and the others
    keep training, and its replacement heals from a live peer (C7 all-or-nothing step). Needs
    torchft (the ft extra)."""
    replica_heartbeat_timeout_s: Annotated[float, Range(0.1)] = 2.0
    """Replica groups: a group whose heartbeats stop this long is dropped from the quorum (one
    that leaves, or whose process is gone, is dropped at once). Too short evicts healthy groups
    on a loaded machine."""
    replica_collective_timeout_s: Annotated[float, Range(0.1)] = 10.0
    """Replica groups: a collective across groups (the gradient average, the summed stats, a
    heal's transfers) with a group that stopped answering gives up after this long, and the step
    is re-done without it: with the heartbeat timeout, the survivors' stall when a group's node
    vanishes from the network. Above the longest cross-group all-reduce of a step."""


@dataclass
class HealthSection:
    """Loss spikes and non-finite losses, handled without a person (health/recovery.py,
    docs/training-health.md)."""

    spike_action: Literal["rollback", "report", "off"] = "rollback"
    """rollback: a spike or a non-finite loss rolls the run back to the newest checkpoint before
    it, re-runs the suspect steps to tell a hardware fault from bad data, and skips the data only
    when the re-run reproduces the spike; report: an event and a warning, training goes on; off:
    neither (a non-finite loss then stops the run after train.nan_patience)."""
    spike_window: Annotated[int, Range(8)] = 100
    """Healthy steps whose losses make the running median and median absolute deviation that a
    loss is judged against."""
    spike_deviations: Annotated[float, Range(1)] = 6.0
    """A loss is flagged above median + this many robust standard deviations (1.4826 x MAD) of
    the window."""
    spike_min_rise: Annotated[float, Range(0)] = 0.05
    """...and above the median by at least this fraction of it, so a very smooth loss curve (a
    large batch, MAD near 0) does not flag ordinary noise."""
    spike_steps: AtLeastOne = 3
    """Consecutive flagged losses that make a spike: one high batch the run absorbs is left
    alone. A non-finite loss is a spike at once."""
    spike_min_history: Annotated[int, Range(2)] = 20
    """Healthy steps seen before any loss is judged (the start of training falls fast)."""
    skip_steps_before: Annotated[int, Range(0)] = 1
    """A data-caused spike skips the flagged steps' batches and this many before them: the
    loss at step t is computed on weights that step t-1's batch updated."""
    rerun: bool = True
    """Re-run the suspect steps from the checkpoint before skipping data: a different result means
    the hardware (nothing skipped; the rank whose parameters diverged first is named and its node
    drained), the same result means the data."""
    rerun_tolerance: Annotated[float, Range(0)] = 1e-3
    """Relative difference between a re-run loss and the first one that still counts as the
    same result (a re-run on the same ranks is bit-identical, C3)."""
    max_rollbacks_per_hour: Annotated[float, Range(0)] = 4.0
    """Rollbacks allowed in any hour; one more stops the run with one line: it keeps
    diverging, which skipping data will not cure."""
    max_skipped_steps: Annotated[int, Range(0)] = 500
    """Global batches a run may skip in all; a skip past it stops the run."""
    sdc_every_steps: Annotated[int, Range(0)] = 1
    """Steps between comparisons of the replicas that must hold the same state (HSDP's, across
    nodes; health/silent_corruption.py): a replica that disagrees with the majority is overwritten
    from it before its corrupted value is used, and its node drained. 0: none."""
    straggler_action: Literal["evict", "report", "off"] = "evict"
    """A rank whose compute is slower than its peers' (health/stragglers.py): evict drains its
    node (the group restarts without it; the autoscaler replaces it; with replica groups the
    slow group leaves), report only says so."""
    straggler_every_steps: Annotated[int, Range(0)] = 10
    """Steps between shares of every rank's compute figure (one float each, in the all-reduce of
    the device probe's known answer); 0: neither."""
    straggler_window: Annotated[int, Range(2)] = 20
    """The steps a rank's compute is judged over: the mean of its last this-many steps' compute,
    its slowest tenth (at least one step) left out so that a single slow step never makes a
    straggler. A rank slowed from step s on is named by step s + straggler_window +
    straggler_every_steps; a shorter window names it sooner, and is moved more by noise."""
    straggler_slowdown: Annotated[float, Range(1)] = 1.5
    """A rank whose window's compute is this many times the ranks' (lower) median is a straggler
    (NVIDIA's resiliency extension flags a GPU below 0.7 of the median performance, 1.43x)."""


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    """Model shape: a preset and per-field overrides."""
    data: DataSection = field(default_factory=DataSection)
    """Which prepared dataset, and the seed and window of its sample order."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Held-out evaluation: which validation set, how often, how many sequences."""
    train: TrainSection = field(default_factory=TrainSection)
    """Batch, optimizer, schedule, precision and sharding of the training loop."""
    scaling: ScalingSection = field(default_factory=ScalingSection)
    """How many workers, and what each one reserves."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """How the workers split the model: tensor parallelism and HSDP (data parallel is the rest)."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Where and how often checkpoints are committed, and how many are kept."""
    tracking: TrackingSection = field(default_factory=TrackingSection)
    """MLflow logging."""
    run: RunSection = field(default_factory=RunSection)
    """The run's name and where its state lives."""
    elastic: ElasticSection = field(default_factory=ElasticSection)
    """Failure budget and worker-start patience of the elastic controller."""
    health: HealthSection = field(default_factory=HealthSection)
    """Loss spikes and non-finite losses: detected, rolled back, attributed, skipped."""

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
        if p.is_dir():
            raise ValueError(f"config file {path} is a folder; pass --config with a YAML file "
                             "such as jobs/configs/mini.yaml")
        if not p.is_file():
            raise ValueError(f"config file {path} does not exist; pass --config with a YAML file "
                             "such as jobs/configs/mini.yaml")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            at = lambda m: f"line {m.line + 1}, column {m.column + 1}"  # noqa: E731
            mark, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
            where = f" at {at(mark)}" if mark else ""
            what = getattr(e, "problem", None) or first_line(e)
            if context is not None and getattr(e, "context", None):
                what += f" ({e.context} at {at(context)})"
            raise ValueError(f"config file {path} is not valid YAML{where}: {what}; fix that "
                             "line") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {path} cannot be read ({first_line(e)}); pass a "
                             "readable YAML text file") from None
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
    """Rebuild a Config sent to workers as a plain dict (Ray passes train_loop_config by value).

    The dict may come from an older release (a checkpointed or resubmitted job), so each value
    goes through the same type check as a YAML value: a key or value today's code cannot run
    fails here, naming the key, instead of deep inside a worker.
    """
    cfg = Config()
    for section, values in d.items():
        for key, value in values.items():
            _set(cfg, f"{section}.{key}", value)
    return cfg


def _set(cfg: Config, dotted: str, value) -> None:
    section, _, key = dotted.partition(".")
    sections = {f.name for f in fields(Config)}
    if section not in sections or not key:
        raise ValueError(f"unknown config key {dotted!r}; sections are: {', '.join(sorted(sections))}")
    sec = getattr(cfg, section)
    hints = _field_types(type(sec))
    if key not in hints:
        raise ValueError(f"unknown config key {dotted!r}; keys of {section}: {', '.join(hints)}")
    setattr(sec, key, coerce(dotted, value, hints[key]))


@functools.cache
def _field_types(section: type) -> dict[str, object]:
    """Field name -> its resolved type (annotations are strings under `from __future__`)."""
    hints = get_type_hints(section, include_extras=True)
    return {f.name: hints[f.name] for f in fields(section)}


def validate(cfg: Config) -> None:
    """The rules no single field's type can state: between fields, against the model presets,
    and the one field without a usable default (the dataset)."""
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.model.config import PRESETS

    if cfg.model.preset not in PRESETS:
        raise ValueError(f"model.preset={cfg.model.preset!r} is unknown; choose one of "
                         f"{', '.join(PRESETS)}")
    _check_model_family(cfg.model)
    t, s = cfg.train, cfg.scaling
    if s.max_workers < s.min_workers:
        raise ValueError(f"scaling.max_workers={s.max_workers} is below scaling.min_workers="
                         f"{s.min_workers}; set max_workers >= min_workers")
    if t.lr <= 0 or (t.min_lr is not None and not 0 <= t.min_lr <= t.lr):
        raise ValueError(f"train.lr={t.lr} must be > 0 and train.min_lr={t.min_lr} in [0, lr]")
    if t.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps={t.warmup_steps} must be at least 0")
    if t.warmup_steps > t.max_steps:
        # A short trial run of any shipped config (train.max_steps=5) should just work.
        log.warning("train.warmup_steps=%d is longer than train.max_steps=%d: warming up over all "
                    "%d steps instead", t.warmup_steps, t.max_steps, t.max_steps)
        t.warmup_steps = t.max_steps
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    problem = workers_problem(tp * pp, {"scaling.min_workers": s.min_workers,
                                        "scaling.max_workers": s.max_workers},
                              flag="parallel.tp" if pp == 1 else "parallel.tp x parallel.pp",
                              unit="tensor-parallel groups" if pp == 1 else "pipelines")
    if problem:
        raise ValueError(problem)
    batch_split = BatchSplit(t.global_batch_size, t.micro_batch_size)
    # C1 fixed global batch, over the data-parallel degree
    batch_split.check_world_size(s.max_workers, tp=tp * pp)
    _check_pipeline(cfg, batch_split)
    ck = cfg.checkpoint
    if ck.every_steps == 0 and ck.every_minutes == 0:
        raise ValueError("checkpoint.every_steps=0 and checkpoint.every_minutes=0 leave no "
                         "periodic checkpoint (a failure would lose the whole session); set "
                         "checkpoint.every_minutes (wall-clock) or checkpoint.every_steps")
    if cfg.data.sources is not None:
        _check_sources(cfg.data)
    elif not cfg.data.path:
        raise ValueError("data.path is empty; point it at a dataset made by `elastic-gpt "
                         "prepare-data --output URL` (e.g. data.path=data/stdlib)")


FAMILY_KEYS = {"n_kv_head": "n_kv_head", "ffn_hidden": "ffn_hidden", "rope_theta": "rope_theta",
               "rope_scaling": "rope_factor", "tie_embeddings": "tie_embeddings"}
"""model.* keys that only some families' shapes have -> the shape field each sets."""


def _check_model_family(model: ModelSection) -> None:
    """A key the family's shape does not have (model.n_kv_head on GPT-2) is a mistake, not
    something to ignore."""
    from elastic_gpt.model.config import CONFIG_TYPES, PRESET_FAMILY

    family = model.family or PRESET_FAMILY[model.preset]
    known = {f.name for f in fields(CONFIG_TYPES[family])}
    given = [k for k, field_ in FAMILY_KEYS.items()
             if getattr(model, k) is not None and field_ not in known]
    if given:
        raise ValueError(f"model.{given[0]} is not a setting of the {family} family "
                         f"(model.preset={model.preset}); set model.family=llama (or a llama3-* "
                         f"preset), or drop model.{given[0]}")


def _check_pipeline(cfg: Config, batch_split) -> None:
    """parallel.pp's schedule, and a step that fills the pipeline at the most workers."""
    par = cfg.parallel
    if par.pp_schedule == "1f1b" and par.pp_stages_per_rank != 1:
        raise ValueError(f"parallel.pp_schedule=1f1b runs one stage per rank, and "
                         f"parallel.pp_stages_per_rank is {par.pp_stages_per_rank}; use "
                         "parallel.pp_schedule=interleaved_1f1b or pp_stages_per_rank=1")
    if par.pp_schedule != "1f1b" and par.pp_stages_per_rank < 2:
        raise ValueError(f"parallel.pp_schedule={par.pp_schedule} needs parallel."
                         "pp_stages_per_rank >= 2 (stages per rank); use 2, or "
                         "parallel.pp_schedule=1f1b")
    if par.pp == 1:
        return
    # every live group's pipelines share the step (replica groups: all of them, at the most)
    dp = cfg.scaling.max_workers // (par.pp * par.tp)
    slots = batch_split.slots(dp)
    if slots < par.pp:
        raise ValueError(
            f"at {cfg.scaling.max_workers} workers a step gives each pipeline {slots} "
            f"micro-batch(es), fewer than its parallel.pp={par.pp} stages; raise "
            f"train.global_batch_size to at least {par.pp * dp * batch_split.micro_batch_size} "
            "or lower train.micro_batch_size or scaling.max_workers")


def _check_sources(data: DataSection) -> None:
    if data.path:
        raise ValueError("data.path and data.sources are both set; keep one (data.sources lists "
                         "every dataset of a mixture with its weight)")
    if not data.sources:
        raise ValueError("data.sources is an empty list; give at least one {path: URL, weight: W}")
    for i, src in enumerate(data.sources):
        if not isinstance(src, dict) or set(src) - {"path", "weight"} or "path" not in src:
            raise ValueError(f"data.sources[{i}]={src!r} must be a mapping with keys path and "
                             "weight, e.g. {path: data/stdlib, weight: 1.0}")
        if not isinstance(src["path"], str) or not src["path"]:
            raise ValueError(f"data.sources[{i}].path must be a dataset URL or path")
        weight = src.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or \
                not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"data.sources[{i}].weight={weight!r} must be a finite number > 0")
        src["weight"] = float(weight)


def run_log_dir(cfg: Config) -> str:
    """Where workers keep the run's detail files (torchft's per-step log, the straggler probe's
    per-rank times): the run's folder under run.storage_path, `<run.storage_path>/<run.name>/logs`
    (Ray Train's own folders there are `<run.name>-<time>`); an object store takes no appends,
    so with one there the temp folder of each worker's node."""
    import tempfile

    root = cfg.run.storage_path
    if "://" in root:
        root = os.path.join(tempfile.gettempdir(), "elastic-gpt")
    return os.path.join(root, cfg.run.name, "logs")


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
    if cfg.data.path:
        cfg.data.path = absolute_url(cfg.data.path, cwd)
    for src in cfg.data.sources or ():
        src["path"] = absolute_url(src["path"], cwd)
    if cfg.eval.path:
        cfg.eval.path = absolute_url(cfg.eval.path, cwd)
    if cfg.checkpoint.init_from and "://" not in cfg.checkpoint.init_from:
        cfg.checkpoint.init_from = os.path.normpath(os.path.join(
            cwd, os.path.expanduser(cfg.checkpoint.init_from)))
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
