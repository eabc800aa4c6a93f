"""The published training runs the planner is checked against: each run's model, GPUs, batch,
layout, network and software, and the throughput it was measured at (checks.py plans them).

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21): Table 1 (GPT models from 1.7B to 1T parameters, tp x pp as given, weak
  scaling on up to 3072 A100-80GB) and Table 2 (GPT-3 175B and 530B: ZeRO-3 without model
  parallelism against PTD-P, on 384 to 2240 GPUs), and sec. 5.1's GPT-3 175B on 1024 GPUs
  (140 TFLOP/s, its 34 days) in the layout of Megatron-LM's GPT-3 example script. Vocabulary
  51,200, sequence 2048, activation recomputation on; throughput is their eq. (3) FLOPs,
  recomputation included, per second per GPU. Their network (sec. 5): 8 A100s per node on
  NVLink/NVSwitch, 8 HDR InfiniBand NICs of 200 Gb/s per node. Megatron-LM's runs ran
  Megatron-LM 2021 (megatron_2021.py), ZeRO-3's DeepSpeed's of 2021 (deepspeed_zero3_2021.py).
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 5: seconds per iteration of 22B, 175B, 530B and 1T on the same machine, full
  recomputation, micro-batch 1 (22B: 4), one pipeline (data-parallel degree 1).
- Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: Llama 3 405B (126 layers, width
  16384, 128 heads, sequence 8192, 16M tokens per step) on 8192 and 16384 H100s, tp 8 x pp 16,
  at 43% and 41% BF16 MFU, on RoCE at 400 Gb/s per GPU (the H100 row's network). Planned as the
  GPT of its width, depth and heads (406B parameters; Llama's grouped-query attention and
  SwiGLU MLP differ in FLOPs by a few percent), with this trainer's software; compared as MFU
  (model FLOPs, no recomputation).
- torchtitan's benchmarks (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3): Llama
  3.1 8B with FSDP2 and torch.compile, in bf16 and with float8 linears, on 8 and 128 H100s
  (96 GB HBM2e at 2.4 TB/s, 500 W), 2 sequences of 8192 per GPU, in tokens per second per GPU:
  the nearest published kin of this trainer (FSDP2, SDPA, compile, torchao float8). Planned as
  the GPT of its width and depth; compared as model FLOP/s (torchtitan's count, 6 x the
  non-embedding parameters + 12 L h q T per token, against the plan's MFU).
- MosaicML's llm-foundry benchmarks (scripts/train/benchmarking/README.md at 5e85bd62, January
  2024): MPT models (GPT blocks without biases, ALiBi, flash attention, vocabulary 50,368,
  sequence 2048) trained with FSDP and no tensor or pipeline parallelism, in tokens per second
  per GPU: on 32 to 128 A100s (40 and 80 GB) with 8 x 200 Gb/s RoCE per node (SC21's
  bandwidth), and on 128 to 512 H100s (their network unstated: the H100 row's). FULL_SHARD
  (resharded after forward), micro-batch, accumulation and checkpointing as each row gives
  them. Compared as model FLOP/s: their tokens per second x the plan's FLOPs per
  token of the GPT of that width and depth (their MFU's count, 6 x the parameters + 12 L h T).

Every run here is planned by the kernel model as it stands (uncalibrated: checks.py), which is
what the tuned stacks reach. torchtitan's and MosaicML's runs are this trainer's kind of software
(FSDP, flash attention, no tensor or pipeline parallelism): `FSDP_RUNS`; they, with torchtitan's
other published runs, are what the default calibration of this trainer's software is fitted and
checked on (calibration_runs.py). The plan's figure is the same FLOPs over the planned step time,
for what these runs ran: for Megatron-LM, its dropout of 0.1 and its software of 2021.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.cost_model.software import Software
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.hardware import GPUS, GiB
from elastic_gpt.model.config import GPTConfig
from validation.deepspeed_zero3_2021 import DEEPSPEED_ZERO3
from validation.megatron_2021 import MEGATRON_2021

TORCHTITAN_H100 = dataclasses.replace(GPUS["H100"], name="H100-HBM2e-500W", hbm_gbps=2400,
                                      memory_gib=96e9 / GiB)
"""torchtitan's H100s: HBM2e 96 GB at 2.4 TB/s; their 500 W limit lowers the peak to somewhere
between the SXM's and the NVL's, by how much they do not know: the SXM's is kept."""
LLAMA31_8B_FLOPS_PER_TOKEN = 6 * (8.03e9 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
SELENE_NIC_GBPS = 8 * 200 / 8 * 0.8
"""A Selene node's NCCL bandwidth between nodes, GB/s: 8 NICs of 200 Gb/s (SC21 sec. 5), at the
0.8 of line rate hardware.py's rows assume."""
SELENE_NVLINK_GBPS = 300 * 0.65
"""NVLink3 inside a Selene node, GB/s: 300 per direction at the 0.65 Calculon's A100-80GB
system file measures for collectives (systems/a100_80g.json)."""
VOCAB, SEQ = 51200, 2048
DROPOUT = 0.1
"""Megatron-LM's default hidden and attention dropout."""


@dataclass(frozen=True)
class PublishedRun:
    source: str
    label: str
    n_layer: int
    n_head: int
    n_embd: int
    gpus: int
    batch: int
    tp: int
    pp: int
    published_tflops: float
    """Per GPU: SC21's eq. (3) FLOPs (recomputation included), or with `model_flops` the MFU's
    (without)."""
    micro_batch: int | None = None
    """None: the plan chooses (SC21 Table 1 does not give it)."""
    zero3: bool = False
    """DeepSpeed's ZeRO-3 without model parallelism: sharded over every GPU, resharded after
    forward, its parameters gathered module by module (deepspeed_zero3_2021.py)."""
    fsdp: bool = False
    """PyTorch FSDP's FULL_SHARD without model parallelism: over every GPU, resharded after
    forward, gradients reduce-scattered after every micro-batch."""
    activation_checkpointing: bool | None = True
    """None: the plan chooses (the paper does not say)."""
    gpu: str = "A100-80GB"
    seq_len: int = SEQ
    vocab_size: int = VOCAB
    dropout: float = DROPOUT
    software: Software = MEGATRON_2021
    """What ran it: Megatron-LM 2021 (the SC21 and Korthikanti rows), DeepSpeed's ZeRO-3 of 2021,
    or this trainer's kind (`TRAINER`: FSDP, flash attention)."""
    selene: bool = True
    """SC21's network (Selene: NVLink3, 8 x 200 Gb/s per node), which MosaicML's A100 nodes
    match; False: the GPU row's."""
    model_flops: bool = False
    """The published figure is MFU x peak: compare the plan's MFU."""
    dtype: str = "bfloat16"
    stages_per_rank: tuple[int, ...] | None = (1, 2)
    """The pipeline schedules the plan weighs (stages per rank). SC21 does not say which its
    runs used: 1F1B or its interleaved schedule with 2 stages per rank, SC21's own comparison
    (sec. 5.3.2). None: the planner's choice."""

    def config(self) -> GPTConfig:
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         seq_len=self.seq_len, vocab_size=self.vocab_size, dropout=self.dropout)


def _iteration_tflops(n_layer: int, n_embd: int, gpus: int, batch: int, seconds: float) -> float:
    """SC21 eq. (3) over a measured iteration time: 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    B, s, L, h, V = batch, SEQ, n_layer, n_embd, VOCAB
    flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return flops / seconds / gpus / 1e12


SC21 = "SC21 Table 1"
SC21_T2 = "SC21 Table 2"
SC21_GPT3 = "SC21 sec. 5.1"
KORTHIKANTI = "Korthikanti 2022 Table 5"
LLAMA3 = "Llama 3 Table 4"
TORCHTITAN = "torchtitan H100 benchmarks"
MOSAICML = "llm-foundry MPT benchmarks"
MPT_VOCAB = 50368
MPT_SHAPES = {"7B": (32, 32, 4096), "13B": (40, 40, 5120), "30B": (48, 56, 7168),
              "70B": (80, 64, 8192)}
"""(layers, heads, width) of llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml."""


def _mpt(label: str, gpus: int, gpu: str, micro_batch: int, accumulation: int,
         tokens_per_s_per_gpu: float, checkpointing: bool) -> PublishedRun:
    """A row of llm-foundry's benchmark tables: tokens per second per GPU at sequence 2048."""
    n_layer, n_head, n_embd = MPT_SHAPES[label]
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, seq_len=SEQ,
                    vocab_size=MPT_VOCAB, dropout=0.0)
    tflops = tokens_per_s_per_gpu * model_shape(cfg).model_flops_per_token / 1e12
    return PublishedRun(MOSAICML, f"MPT {label}", n_layer, n_head, n_embd, gpus,
                        micro_batch * accumulation * gpus, 1, 1, tflops, micro_batch, gpu=gpu,
                        vocab_size=MPT_VOCAB, dropout=0.0, software=TRAINER,
                        selene=gpu.startswith("A100"), model_flops=True, stages_per_rank=None,
                        fsdp=True, activation_checkpointing=checkpointing)


def _zero3(size: str, gpus: int, batch: int, tflops: float, micro_batch: int) -> PublishedRun:
    """A ZeRO-3 row of SC21's Table 2: DeepSpeed 2021 without model parallelism."""
    n_layer, n_head, n_embd = {"175B": (96, 96, 12288), "530B": (105, 128, 20480)}[size]
    return PublishedRun(SC21_T2, f"{size} ZeRO-3", n_layer, n_head, n_embd, gpus, batch, 1, 1,
                        tflops, micro_batch, zero3=True, software=DEEPSPEED_ZERO3)


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(SC21, "1.7B", 24, 24, 2304, 32, 512, 1, 1, 137),
    PublishedRun(SC21, "3.6B", 30, 32, 3072, 64, 512, 2, 1, 138),
    PublishedRun(SC21, "7.5B", 36, 32, 4096, 128, 512, 4, 1, 142),
    PublishedRun(SC21, "18.4B", 40, 48, 6144, 256, 1024, 8, 1, 135),
    PublishedRun(SC21, "39.1B", 48, 64, 8192, 512, 1536, 8, 2, 138),
    PublishedRun(SC21, "76.1B", 60, 80, 10240, 1024, 1792, 8, 4, 140),
    PublishedRun(SC21, "145.6B", 80, 96, 12288, 1536, 2304, 8, 8, 148),
    PublishedRun(SC21, "310.1B", 96, 128, 16384, 1920, 2160, 8, 16, 155),
    PublishedRun(SC21, "529.6B", 105, 128, 20480, 2520, 2520, 8, 35, 163),
    PublishedRun(SC21, "1008.0B", 128, 160, 25600, 3072, 3072, 8, 64, 163),
    *(_zero3("175B", gpus, batch, tflops, micro_batch) for gpus, batch, tflops, micro_batch in
      ((384, 1536, 144, 4), (768, 1536, 88, 2), (1536, 1536, 44, 1))),
    *(_zero3("530B", gpus, batch, tflops, micro_batch) for gpus, batch, tflops, micro_batch in
      ((640, 2560, 138, 4), (1120, 2240, 98, 2), (2240, 2240, 48, 1))),
    # GPT-3 175B on 1024 GPUs at 140 TFLOP/s, the figure behind SC21's 34 days, in the layout
    # of Megatron-LM's examples/pretrain_gpt3_175B.sh (1024 GPUs, tp 8, pp 16, micro-batch 1,
    # no interleaving, fp16, recomputation)
    PublishedRun(SC21_GPT3, "175B", 96, 96, 12288, 1024, 1536, 8, 16, 140, 1,
                 stages_per_rank=(1,)),
    PublishedRun(SC21_T2, "175B PTD-P", 96, 96, 12288, 384, 1536, 8, 12, 153, 1),
    PublishedRun(SC21_T2, "175B PTD-P", 96, 96, 12288, 768, 1536, 8, 12, 149, 1),
    PublishedRun(SC21_T2, "175B PTD-P", 96, 96, 12288, 1536, 1536, 8, 12, 141, 1),
    PublishedRun(SC21_T2, "530B PTD-P", 105, 128, 20480, 560, 2240, 8, 35, 171, 1),
    PublishedRun(SC21_T2, "530B PTD-P", 105, 128, 20480, 1120, 2240, 8, 35, 167, 1),
    PublishedRun(SC21_T2, "530B PTD-P", 105, 128, 20480, 2240, 2240, 8, 35, 159, 1),
    # stages per rank as Calculon's validation of these runs sets them (validation/seqsel/fig7)
    PublishedRun(KORTHIKANTI, "22B", 48, 64, 6144, 8, 4, 8, 1,
                 _iteration_tflops(48, 6144, 8, 4, 1.42), 4, stages_per_rank=(1,)),
    PublishedRun(KORTHIKANTI, "175B", 96, 96, 12288, 64, 64, 8, 8,
                 _iteration_tflops(96, 12288, 64, 64, 18.13), 1, stages_per_rank=(3,)),
    PublishedRun(KORTHIKANTI, "530B", 105, 128, 20480, 280, 280, 8, 35,
                 _iteration_tflops(105, 20480, 280, 280, 49.05), 1, stages_per_rank=(3,)),
    PublishedRun(KORTHIKANTI, "1T", 128, 160, 25600, 512, 512, 8, 64,
                 _iteration_tflops(128, 25600, 512, 512, 94.42), 1, stages_per_rank=(1,)),
    *(PublishedRun(LLAMA3, "405B", 126, 128, 16384, gpus, 2048, 8, 16, mfu * 989,
                   gpu="H100", seq_len=8192, vocab_size=128256, dropout=0.0,
                   software=TRAINER, selene=False, model_flops=True,
                   stages_per_rank=None, activation_checkpointing=None)
      for gpus, mfu in ((8192, 0.43), (16384, 0.41))),
    *(PublishedRun(TORCHTITAN, f"8B {dtype}", 32, 32, 4096, gpus, 2 * gpus, 1, 1,
                   tps * LLAMA31_8B_FLOPS_PER_TOKEN / 1e12, 2, gpu=TORCHTITAN_H100.name,
                   seq_len=8192, vocab_size=128256, dropout=0.0, software=TRAINER,
                   selene=False, model_flops=True, stages_per_rank=None, dtype=dtype,
                   activation_checkpointing=None)
      for gpus, dtype, tps in ((8, "bfloat16", 6667), (8, "float8", 8532),
                               (128, "bfloat16", 6514), (128, "float8", 8380))),
    # llm-foundry's tables at sequence 2048 on 32 GPUs or more: A100-80GB and A100-40GB on
    # 1600 Gb/s RoCE, and its "H100 80GB BF16 (Large Scale)" table
    _mpt("70B", 32, "A100-80GB", 2, 16, 373, True),
    _mpt("70B", 64, "A100-80GB", 8, 4, 410, True),
    _mpt("70B", 64, "A100-40GB", 2, 1, 276, True),
    _mpt("70B", 128, "A100-40GB", 4, 1, 376, True),
    _mpt("30B", 128, "A100-40GB", 6, 1, 865, True),
    _mpt("13B", 128, "A100-40GB", 16, 1, 1972, True),
    _mpt("7B", 128, "A100-40GB", 18, 1, 3623, True),
    *(_mpt("70B", gpus, "H100", 8, 1, tps, True)
      for gpus, tps in ((128, 1058), (256, 1035), (512, 1007))),
    *(_mpt("13B", gpus, "H100", 16, 1, tps, True)
      for gpus, tps in ((128, 5080), (256, 4989), (512, 4952))),
    *(_mpt("7B", gpus, "H100", 6, 1, tps, False) for gpus, tps in ((128, 10475), (512, 9670))),
)

MPT_ON_ONE_NODE = (
    _mpt("30B", 8, "A100-80GB", 3, 21, 916, True),
    _mpt("13B", 8, "A100-80GB", 2, 3, 2262, False),
    _mpt("7B", 8, "A100-80GB", 6, 2, 4641, False),
    _mpt("13B", 8, "A100-40GB", 4, 16, 1668, True),
    _mpt("7B", 8, "A100-40GB", 12, 4, 3679, True),
)
"""llm-foundry's runs on one node of 8 A100s at sequence 2048, the largest micro-batch each
model ran at: a check of the memory model (each ran, so the plan must count it within the GPU's
memory), not of the step time, which `RUNS` checks at scale."""


FSDP_RUNS = tuple(r for r in RUNS if r.source in (TORCHTITAN, MOSAICML))
"""torchtitan's and MosaicML's runs at scale: this trainer's kind of software (FSDP, flash
attention, no tensor or pipeline parallelism)."""
