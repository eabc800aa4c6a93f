"""Every metric name the project logs to MLflow, in one table (part of contract C5 one MLflow run).
The trainer, the evaluator, the run set-up and the publishing code take their names from here, and
so do the tests and benchmarks that read a run back.

The prefixes decide what a user sees first. MLflow's run page draws one chart group per prefix
(the name up to its last `/`) and orders the groups by code point, so lower-case `cluster/`,
`debug/` or `goodput/` groups would come before `train/`. Metrics under `system/` go to the run's
separate "System metrics" tab instead, so the run's "Model metrics" page holds just `train/`
(loss, lr, grad norm, tokens/s, MFU and the step's shape) and then `val/`, and the rest is grouped
in the System metrics tab beside MLflow's own host metrics.

Step numbering (C5 one MLflow run): a metric logged at step k describes the state after k optimizer
steps, the same k as the console's `step k/N` and the checkpoint folder `step_0000000k`.

Nothing here imports MLflow, torch or the model.
"""

from __future__ import annotations

# ---- the training view: the run's "Model metrics" page, in this order ----------------------------

TRAIN_LOSS = "train/loss"                  # mean nats per token of the step's global batch
TRAIN_LR = "train/lr"                      # the learning rate the step used
TRAIN_GRAD_NORM = "train/grad_norm"        # before clipping
TRAIN_TOKENS_PER_S = "train/tokens_per_s"
TRAIN_MFU = "train/mfu"
TRAIN_STEP_TIME_S = "train/step_time_s"
TRAIN_WORLD_SIZE = "train/world_size"      # workers in the group (elastic runs change it)
TRAIN_GRAD_ACCUM = "train/grad_accum"      # micro-batches per data-parallel rank
TRAIN_SAMPLES_SEEN = "train/samples_seen"  # the resume cursor: steps * global batch (C2 data order)
# Groups in the step's quorum (with replica groups only: C7 all-or-nothing step).
TRAIN_REPLICA_GROUPS = "train/replica_groups_live"

VAL_LOSS = "val/loss"
VAL_PERPLEXITY = "val/perplexity"
VAL_BITS_PER_BYTE = "val/bits_per_byte"

# ---- the System metrics tab ----------------------------------------------------------------------

SYSTEM_PREFIX = "system/"
GOODPUT_PREFIX = "system/goodput/"
CLUSTER_PREFIX = "system/cluster/"
DEBUG_PREFIX = "system/debug/"

GOODPUT = GOODPUT_PREFIX + "fraction"      # productive / wall time
GOODPUT_EVENTS = GOODPUT_PREFIX + "events"
GOODPUT_LOST_STEPS = GOODPUT_PREFIX + "lost_steps"
GOODPUT_WALL_S = GOODPUT_PREFIX + "wall_s"

# A 52-bit hash of the step's samples (C2 data order).
DATA_FINGERPRINT = DEBUG_PREFIX + "data_fingerprint"
DATA_WAIT_S = DEBUG_PREFIX + "data_wait_s"
EVENT_RECOVERY_S = DEBUG_PREFIX + "event_recovery_s"  # logged once per resume
EVENT_LOST_STEPS = DEBUG_PREFIX + "event_lost_steps"
# Once per attempt, at its first step: from the Trainer's start, and the weight init and the
# checkpoint read within it (a resume skips the init).
STARTUP_S = DEBUG_PREFIX + "startup_s"
STARTUP_INIT_S = DEBUG_PREFIX + "startup_init_s"
STARTUP_CHECKPOINT_READ_S = DEBUG_PREFIX + "startup_checkpoint_read_s"
# ...and the attempt's start by part, in order (train/metrics.py `startup_breakdown`), where
# known: the controller (the failure or restart request to the group sized), the placement (its
# placement group made), the worker start (to the Trainer's construction: actors, imports, the
# process group), the build (the Trainer: data, mesh, model, optimizer), the rest before the first
# step, and the first step itself (logged with it).
STARTUP_CONTROLLER_S = DEBUG_PREFIX + "startup_controller_s"
STARTUP_PLACEMENT_S = DEBUG_PREFIX + "startup_placement_s"
STARTUP_WORKER_START_S = DEBUG_PREFIX + "startup_worker_start_s"
STARTUP_BUILD_S = DEBUG_PREFIX + "startup_build_s"
STARTUP_TO_FIRST_STEP_S = DEBUG_PREFIX + "startup_to_first_step_s"
STARTUP_FIRST_STEP_S = DEBUG_PREFIX + "startup_first_step_s"

# Training health (health/recovery.py), logged at the step a spike is acted on: the run's totals.
HEALTH_PREFIX = "system/health/"
HEALTH_SPIKES = HEALTH_PREFIX + "spikes"
HEALTH_ROLLBACKS = HEALTH_PREFIX + "rollbacks"
HEALTH_SKIPPED_STEPS = HEALTH_PREFIX + "skipped_steps"
HEALTH_HARDWARE_FAULTS = HEALTH_PREFIX + "hardware_faults"
# At each share of the ranks' compute (health/stragglers.py, every health.straggler_every_steps
# steps): each rank's compute per step over its window (`rank_compute_s`), the ranks' median, the
# slowest rank's figure over it, and which rank that is.
HEALTH_COMPUTE_MEDIAN_S = HEALTH_PREFIX + "compute_median_s"
HEALTH_COMPUTE_SLOWEST_RATIO = HEALTH_PREFIX + "compute_slowest_ratio"
HEALTH_COMPUTE_SLOWEST_RANK = HEALTH_PREFIX + "compute_slowest_rank"
RANK_COMPUTE_PREFIX = HEALTH_PREFIX + "compute_s/rank_"

# MLflow's own names for host metrics (what `mlflow.start_run(log_system_metrics=True)` logs).
SYSTEM_CPU_PERCENT = "system/cpu_utilization_percentage"
SYSTEM_MEMORY_MB = "system/system_memory_usage_megabytes"
SYSTEM_MEMORY_PERCENT = "system/system_memory_usage_percentage"
SYSTEM_PROCESS_RSS_MB = "system/process_memory_rss_megabytes"


def goodput(ledger_key: str) -> str:
    """A goodput ledger total (`productive_s`, `lost_s`, `checkpoint_s`, `recovery_s`,
    `eval_s`, ...) as a metric."""
    return GOODPUT_PREFIX + ledger_key


def cluster(key: str) -> str:
    """The cluster shape at a submission: `nodes`, `cpus`, `gpus`."""
    return CLUSTER_PREFIX + key


def source_samples_seen(source: str) -> str:
    """Samples of one mixture source among the samples seen (data.sources)."""
    return f"system/data/samples_seen/{source}"


def rank_compute_s(rank: int) -> str:
    """One rank's compute per step over the straggler window (health/stragglers.py)."""
    return f"{RANK_COMPUTE_PREFIX}{rank}"


def gpu_memory_mb(index: int) -> str:
    return f"system/gpu_{index}_memory_usage_megabytes"


# What every training step logs (C5 one MLflow run).
STEP_METRICS = (TRAIN_LOSS, TRAIN_LR, TRAIN_GRAD_NORM, TRAIN_TOKENS_PER_S, TRAIN_MFU,
                TRAIN_STEP_TIME_S, TRAIN_WORLD_SIZE, TRAIN_GRAD_ACCUM, TRAIN_SAMPLES_SEEN,
                DATA_WAIT_S, DATA_FINGERPRINT)
VAL_METRICS = (VAL_LOSS, VAL_PERPLEXITY, VAL_BITS_PER_BYTE)
FIXED_NAMES = frozenset((*STEP_METRICS, *VAL_METRICS, TRAIN_REPLICA_GROUPS, GOODPUT,
                         GOODPUT_EVENTS, GOODPUT_LOST_STEPS, GOODPUT_WALL_S, EVENT_RECOVERY_S,
                         EVENT_LOST_STEPS, STARTUP_S, STARTUP_INIT_S, STARTUP_CHECKPOINT_READ_S,
                         STARTUP_CONTROLLER_S, STARTUP_PLACEMENT_S, STARTUP_WORKER_START_S,
                         STARTUP_BUILD_S, STARTUP_TO_FIRST_STEP_S, STARTUP_FIRST_STEP_S,
                         HEALTH_SPIKES, HEALTH_ROLLBACKS, HEALTH_SKIPPED_STEPS,
                         HEALTH_HARDWARE_FAULTS, HEALTH_COMPUTE_MEDIAN_S,
                         HEALTH_COMPUTE_SLOWEST_RATIO, HEALTH_COMPUTE_SLOWEST_RANK,
                         SYSTEM_CPU_PERCENT, SYSTEM_MEMORY_MB, SYSTEM_MEMORY_PERCENT,
                         SYSTEM_PROCESS_RSS_MB))
# Families whose last part is a ledger key, a cluster resource, a source, a GPU index or a rank.
FAMILY_PREFIXES = (GOODPUT_PREFIX, CLUSTER_PREFIX, "system/data/samples_seen/", "system/gpu_",
                   RANK_COMPUTE_PREFIX)


def is_known(name: str) -> bool:
    """Whether `name` is one of this table's names (tests hold every logged key to it)."""
    return name in FIXED_NAMES or any(name.startswith(p) and len(name) > len(p)
                                      for p in FAMILY_PREFIXES)


# The names runs logged before this table (a run resumed across the rename holds both: the old
# series end at the last step trained by the old code, the new ones start after it; nothing is
# rewritten). Readers that draw a whole run (the loss plot) join the two.
OLD_NAMES = {
    TRAIN_LOSS: "loss", TRAIN_LR: "lr", TRAIN_GRAD_NORM: "grad_norm",
    TRAIN_TOKENS_PER_S: "tokens_per_s", TRAIN_MFU: "mfu", TRAIN_STEP_TIME_S: "step_time_s",
    TRAIN_WORLD_SIZE: "world_size", TRAIN_GRAD_ACCUM: "grad_accum",
    TRAIN_SAMPLES_SEEN: "samples_seen", DATA_WAIT_S: "data_wait_s",
    DATA_FINGERPRINT: "data_fingerprint", EVENT_RECOVERY_S: "event_recovery_s",
    EVENT_LOST_STEPS: "event_lost_steps", GOODPUT: "goodput",
}
# The old series also counted steps from 0: old step s is new step s + 1.
OLD_STEP_OFFSET = 1
