"""The Ray Train job of one worker group, as both fault-tolerance modes start it.

The restart path runs one such job for the whole run (`launcher.build_trainer_factory`: min..max
workers); replica groups run one of a fixed size per group (`replica_groups.run_group`, C7
all-or-nothing step). Both need the same things, which live here once:

* `tune_ray_train_env`: what Ray Train's controller reads from its driver's environment;
* `worker_env`: the workers' environment (our packages, storage endpoints, the fabric's, NCCL's
  and the allocator's settings; never credentials);
* `use_gpu`, `run_key`: whether a worker takes a GPU, and the name of a run's GCS records;
* `job_factory`: the `ElasticTorchTrainer` (scaling, run and torch config, the loop config);
* `fatal_cause`, `budget_spent_line`: how the end of a job is read (C6 clear errors).

Ray, Ray Train and the worker's entry point are imported only inside functions: the driver's
preflight imports this module before Ray is reached.
"""

from __future__ import annotations

import os

from elastic_gpt.config import Config
from elastic_gpt.console import last_line

# Storage endpoints and regions travel to the workers; credentials never do (they would show in
# the job's runtime env): workers get those from the node (instance role, env, or config files).
# RUST_LOG: the level of torchft's Rust core with replica groups (warn unless set,
# parallel/replicate.keep_torchft_detail). MLFLOW_DISABLE_TELEMETRY: the driver's choice (off
# unless the user turned it on, see elastic_gpt/__init__.py), in place before a worker imports
# MLflow.
FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION",
                 "FSSPEC_S3_ENDPOINT_URL", "STORAGE_EMULATOR_HOST", "RUST_LOG",
                 "MLFLOW_DISABLE_TELEMETRY")

# The fabric's, NCCL's and the CUDA allocator's settings a GPU run is tuned with on the driver
# (or in the job's environment): NCCL_* (NCCL itself), FI_* (libfabric: EFA), TORCH_NCCL_*
# (torch's NCCL process group: flight recorder, error handling), PYTORCH_CUDA_ALLOC_CONF, and
# CUDA_DEVICE_MAX_CONNECTIONS (what Megatron-style overlap sets). They name no secrets.
FORWARDED_PREFIXES = ("NCCL_", "FI_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF",
                      "CUDA_DEVICE_MAX_CONNECTIONS")
# What a worker gets unless the driver's environment says otherwise:
# - expandable segments: the allocator grows segments instead of keeping fixed-size blocks,
#   the fragmentation that otherwise runs a large model out of memory after hours (torchtitan
#   sets it too);
# - the NCCL flight recorder: the last collectives of every rank, dumped when one times out, so
#   a hang names the rank and the collective it stopped in (torchtitan's comm.trace_buf_size);
#   the dumps go to local files of TORCH_NCCL_DEBUG_INFO_TEMP_FILE + rank (`/tmp/nccl_trace_rank_`
#   by default).
WORKER_ENV_DEFAULTS = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}

TORCH_PG_SHUTDOWN_TIMEOUT = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"  # ray.train.constants


def worker_env() -> dict:
    """The environment every worker process starts with: our packages, storage endpoints, the
    GPU settings above (the driver's own values first), never credentials."""
    # Workers find our packages even when the driver runs from a source checkout.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **WORKER_ENV_DEFAULTS}
    env.update({k: os.environ[k] for k in FORWARDED_ENV if k in os.environ})
    env.update({k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)})
    return env


def use_gpu(cfg: Config) -> bool:
    """scaling.use_gpu, with `auto` decided from the GPUs up now. On a cluster whose autoscaler
    declares GPU node types, none of which is up yet, `auto` would train on the CPUs of a GPU
    cluster without a word: that is one clear line instead (true waits for the GPU nodes, which
    the autoscaler starts on the workers' request)."""
    import ray
    if cfg.scaling.use_gpu != "auto":
        return cfg.scaling.use_gpu
    if ray.cluster_resources().get("GPU", 0) > 0:
        return True
    from elastic_gpt.elastic.ray_internals import declared_max_resources

    declared = declared_max_resources().get("GPU", 0)
    if declared > 0:
        raise ValueError(
            f"scaling.use_gpu=auto: the cluster's node types bring up to {declared} GPUs, but "
            "no GPU node is up yet; set scaling.use_gpu=true to wait for them (the autoscaler "
            "starts them for the workers) or scaling.use_gpu=false to train on CPUs")
    return False


def run_key(cfg: Config) -> str:
    """Names this run's membership records in the GCS: the checkpoint root is the run's identity,
    so a resubmitted driver finds the progress of the one it replaces."""
    import hashlib
    return "run-" + hashlib.sha1(cfg.checkpoint.path.encode()).hexdigest()[:16]


def tune_ray_train_env(cfg: Config) -> None:
    """Ray Train reads these in the controller (it forwards RAY_TRAIN_* from the driver): poll
    workers often, and bound the wait for a placement group that cannot be placed (the policy
    sizes groups from live state, so a wait means capacity vanished since: retry at the new size)."""
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Drains are ours to handle (rank 0's WorkerMembership checkpoints and restarts without the
    # node); Ray Train's own watcher would only add a second reaction, and an error-level line
    # about its restartable actor at every worker group start.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
                          str(cfg.elastic.worker_start_timeout_s))
    # A stopped worker answers no health check: a hung rank is a failure after the same bound as
    # a collective that waits for it.
    os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(cfg.elastic.hang_timeout_s)
    # A failed group's torch process group is destroyed before its workers are killed; a hung
    # or dead rank never answers, and Ray waits this long for it (half a minute by default)
    # before it starts the next group. Destroying a process group takes well under it; the
    # workers are killed right after anyway.
    from elastic_gpt.elastic.ray_internals import propagate_to_ray_train

    os.environ.setdefault(TORCH_PG_SHUTDOWN_TIMEOUT, "5")
    propagate_to_ray_train(TORCH_PG_SHUTDOWN_TIMEOUT)


def job_factory(cfg: Config, *, gpu: bool, num_workers: int | tuple[int, int], key: str,
                name: str):
    """`make(loop_config) -> ElasticTorchTrainer`: the Ray Train job of one worker group of
    `num_workers` (a size, or a (min, max) range the scaling policy sizes from live capacity),
    whose GCS records are `key`'s (`membership.RunRecords`) and whose Ray run is `name`;
    `loop_config` is what each worker's `train_loop_per_worker` gets. Everything is imported and
    configured now, so the restart path's driver sees a problem before an MLflow run exists. Ray
    Train's private classes are loaded here: call `check_ray_internals()` first."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from elastic_gpt.elastic.controller import ElasticTorchTrainer
    from elastic_gpt.elastic.worker import train_loop_per_worker

    s = cfg.scaling
    resources = {"CPU": s.cpus_per_worker, **({"GPU": 1} if gpu else {})}
    scaling = ScalingConfig(num_workers=num_workers, use_gpu=gpu, resources_per_worker=resources,
                            accelerator_type=s.accelerator_type)
    run_config = RunConfig(
        name=name, storage_path=cfg.run.storage_path,
        # Our failure policy (elastic/policies.py) replaces Ray's counter with a sliding-hour
        # budget.
        failure_config=FailureConfig(max_failures=-1),
        worker_runtime_env={"env_vars": worker_env()})

    def make(loop_config: dict) -> ElasticTorchTrainer:
        return ElasticTorchTrainer(
            train_loop_per_worker, run_key=key,
            max_failures_per_hour=cfg.elastic.max_failures_per_hour, tp=cfg.parallel.tp,
            hsdp=cfg.parallel.hsdp, pp=cfg.parallel.pp, grow_settle_s=cfg.elastic.grow_settle_s,
            node_mtbf_h=cfg.elastic.node_mtbf_h, train_loop_config=loop_config,
            scaling_config=scaling,
            run_config=run_config,
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo",
                                     timeout_s=cfg.elastic.init_timeout_s))
    return make


def fatal_cause(error: BaseException) -> BaseException | None:
    """The FatalTrainingError inside a Ray Train failure, if that is what stopped the run."""
    from elastic_gpt.errors import FatalTrainingError
    for cause in getattr(error, "worker_failures", {}).values():
        if isinstance(cause, FatalTrainingError):
            return cause
    return None


def budget_spent_line(cfg: Config, what: str, last: BaseException | None) -> str:
    """The one line for a run whose failures spent its budget. `last` is the last failure; of a
    Ray Train failure, which names each worker's own error, the first worker's is shown."""
    line = (f"{what} more often within an hour than elastic.max_failures_per_hour="
            f"{cfg.elastic.max_failures_per_hour:g} allows")
    if last is not None:
        last = next(iter(getattr(last, "worker_failures", {}).values()), last)
        cause = f"{type(last).__name__}: {last_line(last)}"
        line += f" (last: {cause if len(cause) <= 160 else cause[:157] + '...'})"
    return (f"{line}; the newest checkpoint is intact: fix the cause and run the same command "
            "again, or raise the budget")
