"""The published runs (runs.py) planned with their own settings: the plan's throughput beside the
measured one, the bound DeepSpeed 2021's own collectives put on its ZeRO-3 rows, GPT-3 175B on
1024 A100s left to choose its layout. These check the kernel model itself (uncalibrated: the
speeds of the tuned stacks it was built on); the calibration of this trainer's software on top of
it is calibration.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_gpt.cost_model.calibration import UNCALIBRATED
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.shape import model_shape, training_flops_per_token
from elastic_gpt.cost_model.step_time import MATMUL_EFFICIENCY
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.hardware import GPUS
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.planner.inputs import MEMORY_MARGIN, PlanError, PlanInputs
from elastic_gpt.planner.training_plan import plan_training
from validation.deepspeed_zero3_2021 import collectives
from validation.megatron_2021 import MEGATRON_2021, MEGATRON_2021_KERNELS, Megatron2021
from validation.runs import (
    DROPOUT,
    RUNS,
    SELENE_NIC_GBPS,
    SELENE_NVLINK_GBPS,
    SEQ,
    TORCHTITAN_H100,
    VOCAB,
    PublishedRun,
)

REPLICA_SETTINGS = dict(hsdp="off", grad_sync="step", reshard_after_forward="never")
"""What a plan of Megatron-LM 2021's replicas asks for: no sharding to place across nodes,
whole weights, the gradients synced once after the step's backward; nothing for the planner's
search to weigh there."""


@dataclass(frozen=True)
class Checked:
    run: PublishedRun
    planned_tflops: float | None
    """None: the plan refuses the run (`refusal` says why)."""
    layout: str = ""
    refusal: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.planned_tflops is None else self.planned_tflops / \
            self.run.published_tflops


def plan_inputs(run: PublishedRun, calibrated: bool = True,
                stages_per_rank: int | None = None) -> PlanInputs:
    """The plan of `run` on its network with its software; `calibrated`: by the kernel model
    (each kernel by its size; uncalibrated, the speeds of the stacks it was built on), else by
    one efficiency for every FLOP (`--efficiency 0.6`). A run that gives its micro-batch and its
    checkpointing ran with them: its count must fit the GPU's memory, not also the margin the
    planner keeps for what the count leaves out (`--memory-margin`)."""
    network = (dict(intra_node_gbps=SELENE_NVLINK_GBPS, inter_node_gbps=SELENE_NIC_GBPS)
               if run.selene else {})
    if isinstance(run.software, Megatron2021):
        settings = REPLICA_SETTINGS
    elif run.zero3 or run.fsdp:  # sharded over every GPU, resharded after forward
        settings = dict(hsdp="off", reshard_after_forward="always", grad_sync="microbatch")
    else:
        settings = dict(hsdp="off")
    return PlanInputs(
        model=run.config(), gpu=run.gpu, n_gpus=run.gpus, global_batch_size=run.batch,
        micro_batch_size=run.micro_batch,
        activation_checkpointing=run.activation_checkpointing, tp=run.tp, pp=run.pp,
        pp_stages_per_rank=stages_per_rank, replica_groups="off", market="on-demand",
        tokens=300e9, software=run.software, dtype=run.dtype,
        memory_margin=(0.0 if run.micro_batch and run.activation_checkpointing is not None
                       else MEMORY_MARGIN),
        hardware={**GPUS, TORCHTITAN_H100.name: TORCHTITAN_H100},
        efficiency=None if calibrated else MATMUL_EFFICIENCY, calibration=UNCALIBRATED,
        **settings, **network)


def gpt3_175b_on_1024(sc21_software: bool, megatron_layouts: bool = False) -> PlanInputs:
    """GPT-3 175B on 1024 A100-80GB, 300B tokens, SC21's network and batch (1536), left to
    choose its layout: with this trainer's software, or with the kernels SC21 ran (Megatron-LM's
    2021 kernels, dropout 0.1, every block recomputed) on this trainer's FSDP2. Megatron-LM took
    34 days (SC21 sec. 5.1). `megatron_layouts`: only the layouts Megatron-LM ran at this scale:
    tp=8 (SC21's runs from 18B up), and Megatron-LM 2021's data parallelism and pipelines
    (replicas each holding its tp x pp part of the model state whole, gradients all-reduced
    after backward; every stage the same number of blocks)."""
    cfg = GPTConfig(n_layer=96, n_head=96, n_embd=12288, seq_len=SEQ, vocab_size=VOCAB,
                    dropout=DROPOUT if sc21_software else 0.0)
    software = MEGATRON_2021_KERNELS if sc21_software else TRAINER
    layouts = {}
    if megatron_layouts:
        software, layouts = MEGATRON_2021, dict(tp=8, **REPLICA_SETTINGS)
    return PlanInputs(model=cfg, gpu="A100-80GB", n_gpus=1024, global_batch_size=1536,
                      activation_checkpointing=True if sc21_software else None,
                      software=software, replica_groups="off", market="on-demand",
                      tokens=300e9, intra_node_gbps=SELENE_NVLINK_GBPS,
                      inter_node_gbps=SELENE_NIC_GBPS, calibration=UNCALIBRATED, **layouts)


MEGATRON_GPT3_EXAMPLE = dict(pp=16, pp_stages_per_rank=1, micro_batch_size=1)
"""The rest of the layout of SC21's 34 days beside `gpt3_175b_on_1024(True, True)`'s tp=8:
Megatron-LM's examples/pretrain_gpt3_175B.sh (at a8d172b3), pp=16, micro-batch 1, 1F1B."""


def check(run: PublishedRun, calibrated: bool = True) -> Checked:
    """The plan's throughput for `run`: the fastest of the schedules it weighs."""
    plans, refusal = [], ""
    for v in run.stages_per_rank or (None,):
        try:
            plans.append(plan_training(plan_inputs(run, calibrated, v if run.pp > 1 else None)))
        except PlanError as e:
            refusal = str(e)
    if not plans:
        return Checked(run, None, refusal=refusal)
    plan = min(plans, key=lambda p: p.step_s)
    c = plan.chosen
    if run.model_flops:
        tflops = plan.mfu * plan.gpu.peak_flops / 1e12
    else:
        tflops = _sc21_tflops(run, c.step.step_s)
    layout = f"{c.mesh.short()}, micro-batch {c.micro_batch}"
    return Checked(run, tflops, layout)


def zero3_2021_unoverlapped_tflops(run: PublishedRun) -> float:
    """A ZeRO-3 row's throughput if every collective DeepSpeed 2021's ZeRO-3 runs
    (deepspeed_zero3_2021.py) were added to the plan's compute, none overlapped: the slowest step
    those collectives can make of it."""
    if not run.zero3:
        raise ValueError(f"{run.source} {run.label} is not a ZeRO-3 run")
    p = plan_inputs(run)
    plan = plan_training(p)
    c = plan.chosen
    net = Network(plan.gpu.gpus_per_node, p.intra_node_gbps, p.inter_node_gbps)
    sent = collectives(run.config(), run.gpus, net, run.dtype, c.activation_checkpointing)
    step_s = c.step.compute_s + c.step.optimizer_s + c.micro_batches_per_rank * sent.seconds
    return _sc21_tflops(run, step_s)


def _sc21_tflops(run: PublishedRun, step_s: float) -> float:
    """TFLOP/s per GPU of `run` at `step_s` a step, SC21's way: recomputation counted."""
    per_token = training_flops_per_token(model_shape(run.config()), True)
    return per_token * run.batch * run.seq_len / step_s / run.gpus / 1e12


def check_all(calibrated: bool = True) -> list[Checked]:
    return [check(r, calibrated) for r in RUNS]
