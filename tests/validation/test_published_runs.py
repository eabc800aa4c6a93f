"""The planner against published runs (validation/runs.py, validation/checks.py): SC21's Tables
1 and 2, Korthikanti et al. 2022's iteration times, Llama 3 405B's, torchtitan's and MosaicML's
FSDP runs, each planned with its own model, GPUs, batch, tp and pp on its own network with its
own software. Every pipelined run lands within 15%; the ZeRO-3 rows and the FSDP runs of
flash-attention stacks are pinned as misses, so that a change to the step-time model shows here
and in validation/README.md, and DeepSpeed's module-by-module gathers fit the 530B ones."""

from __future__ import annotations

import dataclasses

import pytest

from validation import checks, runs
from validation.checks import check
from validation.deepspeed_zero3_2021 import DEEPSPEED_ZERO3
from validation.megatron_2021 import ReplicatedMesh
from validation.runs import RUNS


def _key(run) -> tuple:
    return run.source, run.label, run.gpus, run.gpu


@pytest.fixture(scope="module")
def default_model():
    """Each run planned by the one-figure model (one efficiency for every FLOP, a fixed latency
    per collective: `--efficiency 0.6`)."""
    return {_key(r): check(r, calibrated=False) for r in RUNS}


@pytest.fixture(scope="module")
def calibrated_model():
    return {_key(r): check(r) for r in RUNS}


def test_published_throughputs_are_sc21_eq3_over_the_measured_time():
    """Korthikanti 2022 gives seconds per iteration: converted with SC21's eq. (3) (175B, 64
    GPUs, batch 64, 18.13 s -> 162 TFLOP/s per GPU, the 52% of peak they report)."""
    k175 = next(r for r in RUNS if r.source == runs.KORTHIKANTI and r.label == "175B")
    assert k175.published_tflops == pytest.approx(162, abs=1)


def test_one_efficiency_for_every_flop_misses_the_small_models(default_model):
    """`--efficiency 0.6`: 1.7B and 3.6B (no pipeline, small matmuls) more than 15% too fast,
    the largest pipelines slower than the smallest by a third of the published figure: the drift
    the calibrated model removes."""
    table1 = {k[1]: c.ratio for k, c in default_model.items() if k[0] == runs.SC21}
    assert table1["1.7B"] > 1.15 and table1["3.6B"] > 1.15
    assert table1["1.7B"] - table1["1008.0B"] > 0.3


def test_the_calibrated_model_plans_every_pipelined_run_within_15_percent(default_model,
                                                                         calibrated_model):
    """The calibrated model (the default): every row of SC21's Table 1 (1.7B to 1T), every PTD-P
    row of Table 2, GPT-3 175B on 1024 GPUs in Megatron-LM's layout (sec. 5.1: the 140 TFLOP/s
    of its 34 days) and Korthikanti's four runs (Megatron-LM's 2021 kernels and data
    parallelism), and Llama 3 405B on 8192 and 16384 H100s (this trainer's kernels), within 15%;
    its ratio flat across sizes (a spread under a third of the one-figure model's) where the
    one-figure model's drifts with them."""
    megatron = {k: c.ratio for k, c in calibrated_model.items()
                if "ZeRO-3" not in k[1]
                and k[0] not in (runs.TORCHTITAN, runs.MOSAICML)}
    assert len(megatron) == 10 + 6 + 1 + 4 + 2
    assert all(abs(r - 1) <= 0.15 for r in megatron.values()), megatron
    table1 = [k for k in megatron if k[0] == runs.SC21]
    spread = lambda model: (max(model[k].ratio for k in table1)  # noqa: E731
                            - min(model[k].ratio for k in table1))
    assert spread(calibrated_model) < spread(default_model) / 3 and spread(default_model) > 0.4
    # ZeRO-3 stays out of reach of the step-time model: every row planned far too fast (module
    # docstring); with DeepSpeed's module-by-module gathers 530B fits, as the record says.
    zero3 = {k: c.ratio for k, c in calibrated_model.items() if "ZeRO-3" in k[1]}
    assert len(zero3) == 6 and all(r is not None and r > 1.5 for r in zero3.values()), zero3


def test_deepspeed_2021s_own_collectives_leave_the_zero3_rows_planned_too_fast(calibrated_model):
    """DeepSpeed 2021's ZeRO-3, as its source runs it (deepspeed_zero3_2021.py): a small model
    keeps each weight gathered from its forward to its backward (the reuse distance, 1e9
    elements, spans the model); at 175B each block's four weights are gathered in forward and
    again in the recomputation, and all but the last again for the backward (two MLP weights of
    604M elements run between the first MLP weight's recomputation and its backward). Even with
    every one of those collectives after the plan's compute, none overlapped, each ZeRO-3 row of
    SC21's Table 2 is planned more than 15% too fast, if less so than by the overlapped plan:
    these collectives are not what made those runs slow (validation/README.md)."""
    from collections import Counter

    from elastic_gpt.model.config import GPTConfig
    from validation.deepspeed_zero3_2021 import gathers

    def per_weight(cfg):
        return Counter(p.split(".", 1)[1] if p[0].isdigit() else p for p, _ in gathers(cfg))

    small = GPTConfig(n_layer=4, n_head=8, n_embd=1024, seq_len=1024, vocab_size=50304)
    # the word embedding twice: the output layer's backward releases it (its own next use is
    # none), and the embedding's backward gathers it again
    assert per_weight(small) == {"qkv.w": 4, "proj.w": 4, "fc.w": 4, "fc_proj.w": 4, "wte": 2,
                                 "wpe": 1}
    gpt3 = next(r for r in RUNS if r.label == "175B ZeRO-3").config()
    L = gpt3.n_layer
    assert per_weight(gpt3) == {"qkv.w": 3 * L, "proj.w": 3 * L, "fc.w": 3 * L,
                                "fc_proj.w": 2 * L, "wte": 3, "wpe": 2}
    bounds = {}
    for run in RUNS:
        if run.zero3:
            bounds[_key(run)] = checks.zero3_2021_unoverlapped_tflops(run) / \
                run.published_tflops
    assert len(bounds) == 6
    assert all(1.15 < r < calibrated_model[k].ratio for k, r in bounds.items()), bounds


def test_deepspeeds_zero3_fits_530b_where_gathering_whole_blocks_does_not():
    """SC21 ran ZeRO-3 530B on 640 A100-80GB at micro-batch 4. Counting a whole block gathered
    (10 GB of bf16 at 530B) and its gradients, as FSDP2 holds them, refuses that run; DeepSpeed's
    gathers of at most stage3_max_live_parameters and its reduce buckets fit it, within the GPU's
    memory though above the planner's default margin (with Megatron-LM's materialised attention
    scores, 10.7 GB at micro-batch 4, in the recomputed layer): a run that gives its micro-batch
    and checkpointing is checked against the memory, not the headroom. Blocks kept gathered hold
    every block whatever the gather unit."""
    from elastic_gpt.cost_model.memory import memory_per_gpu
    from elastic_gpt.cost_model.shape import model_shape
    from elastic_gpt.hardware import GiB
    from elastic_gpt.planner.inputs import MEMORY_MARGIN, PlanError
    from elastic_gpt.planner.training_plan import plan_training
    from validation.megatron_2021 import MEGATRON_2021_KERNELS

    run = next(r for r in RUNS if r.label == "530B ZeRO-3" and r.gpus == 640)
    inputs = checks.plan_inputs(run)
    assert inputs.software == DEEPSPEED_ZERO3
    assert inputs.memory_margin == 0.0
    plan = plan_training(inputs)
    memory = plan.gpu.memory_gib * GiB
    assert plan.chosen.micro_batch == 4
    assert (1 - MEMORY_MARGIN) * memory < plan.chosen.memory.total <= memory
    with pytest.raises(PlanError, match="does not fit on 640 x A100-80GB"):
        plan_training(dataclasses.replace(inputs, memory_margin=MEMORY_MARGIN))
    # FSDP2's gathers of whole blocks, with the same kernels
    with pytest.raises(PlanError, match="does not fit on 640 x A100-80GB"):
        plan_training(dataclasses.replace(inputs, software=MEGATRON_2021_KERNELS))
    shape = model_shape(run.config())
    whole, parts = dict(software=MEGATRON_2021_KERNELS), dict(software=DEEPSPEED_ZERO3)
    kw = dict(activation_checkpointing=True, reshard_after_forward=True)
    block = shape.block_local()
    saved = (memory_per_gpu(shape, 640, 4, **whole, **kw).gathered_params
             - memory_per_gpu(shape, 640, 4, **parts, **kw).gathered_params)
    # two blocks' bf16 and one block's bf16 + fp32 gradients, against DeepSpeed's live
    # parameters in bf16 and its reduce bucket in bf16 + fp32 (a 530B block exceeds both)
    ds = DEEPSPEED_ZERO3
    assert 2 * block > ds.live_params and block > ds.reduce_bucket_params
    assert saved == pytest.approx(2 * block * 2 + block * 6 - ds.live_params * 2
                                  - ds.reduce_bucket_params * 6)
    # blocks kept gathered (the trainer's `never`) hold every block whatever the gather unit
    never = dict(activation_checkpointing=True, reshard_after_forward=False)
    assert (memory_per_gpu(shape, 640, 4, **whole, **never)
            == memory_per_gpu(shape, 640, 4, **parts, **never))


def test_fsdp_on_h100_is_planned_a_quarter_too_fast(calibrated_model):
    """torchtitan's Llama 3.1 8B runs (FSDP2, compile, bf16 and float8, 8 and 128 H100s), the
    nearest published kin of this trainer: planned 1.2-1.3x their throughput, float8's gain
    over bf16 within 5% of theirs. Their GPUs ran at 500 W, below the peak the plan assumes, by
    an amount they do not give; the rest is not found. Pinned so that it shows when it moves."""
    titan = {(k[1], k[2]): c for k, c in calibrated_model.items()
             if k[0] == runs.TORCHTITAN}
    assert len(titan) == 4 and all(1.15 < c.ratio < 1.4 for c in titan.values())
    for gpus in (8, 128):
        planned = titan["8B float8", gpus].planned_tflops / titan["8B bfloat16", gpus].planned_tflops
        published = (titan["8B float8", gpus].run.published_tflops
                     / titan["8B bfloat16", gpus].run.published_tflops)
        assert planned == pytest.approx(published, rel=0.05)


def test_fsdp_runs_of_flash_attention_stacks_are_planned_too_fast_but_scale_as_measured(
        calibrated_model):
    """MosaicML's MPT runs (llm-foundry; PyTorch FSDP FULL_SHARD, flash attention, no tensor or
    pipeline parallelism) on 32-128 A100s and 128-512 H100s. Every one is planned too fast: the
    checkpointed A100 runs by 1.1-1.3x but one (the run the plan puts nearest its memory), the
    H100 runs by 1.2-1.6x, as torchtitan's. Pinned so that it shows when it moves.

    Their throughput fell 5% from 128 to 512 H100s at 70B and 2.5% at 13B; the plan's falls
    as little (within 5 points of theirs). FSDP at 512 GPUs did not collapse as SC21's ZeRO-3
    did (144 -> 44 TFLOP/s from 384 to 1536 A100s), which is not planned either."""
    mpt = {(c.run.label, c.run.gpus, c.run.gpu): c for k, c in calibrated_model.items()
           if k[0] == runs.MOSAICML}
    assert len(mpt) == 15 and all(c.ratio is not None for c in mpt.values())
    a100 = {k: c.ratio for k, c in mpt.items() if k[2].startswith("A100")}
    tightest = ("MPT 70B", 64, "A100-40GB")
    assert 1.4 < a100.pop(tightest) < 1.8
    assert all(1.1 < r < 1.3 for r in a100.values()), a100
    h100 = {k: c.ratio for k, c in mpt.items() if k[2] == "H100"}
    assert len(h100) == 8 and all(1.2 < r < 1.6 for r in h100.values()), h100
    for label in ("MPT 70B", "MPT 13B"):
        small, large = mpt[label, 128, "H100"], mpt[label, 512, "H100"]
        measured = large.run.published_tflops / small.run.published_tflops
        planned = large.planned_tflops / small.planned_tflops
        assert 0.9 < measured < 1.0 and planned == pytest.approx(measured, abs=0.05)


def test_memory_model_counts_every_run_mosaicml_ran_within_its_gpus_memory():
    """MosaicML ran each of its FSDP runs, the one-node ones at the largest micro-batch their
    memory allowed: the plan's count of each (sharded state, gathered blocks, activations,
    logits, workspace) must be within the GPU's memory. Three of them are above the planner's
    default 10% margin, which would refuse them: the margin is headroom, not the model."""
    from elastic_gpt.hardware import GiB
    from elastic_gpt.planner.inputs import MEMORY_MARGIN
    from elastic_gpt.planner.training_plan import plan_training

    mpt = [r for r in RUNS if r.source == runs.MOSAICML]
    mpt += runs.MPT_ON_ONE_NODE
    above_margin = []
    for run in mpt:
        plan = plan_training(dataclasses.replace(checks.plan_inputs(run),
                                                 memory_margin=0.0))
        c = plan.chosen
        assert (c.micro_batch, c.activation_checkpointing) == (run.micro_batch,
                                                               run.activation_checkpointing)
        assert c.memory.total <= plan.gpu.memory_gib * GiB, (run, c.memory.total / GiB)
        if c.memory.total > plan.gpu.memory_gib * GiB * (1 - MEMORY_MARGIN):
            above_margin.append((run.label, run.gpus, run.gpu))
    assert sorted(above_margin) == [("MPT 13B", 8, "A100-40GB"), ("MPT 30B", 8, "A100-80GB"),
                                    ("MPT 7B", 8, "A100-80GB")], above_margin


def test_175b_on_1024_a100s_left_to_choose_with_sc21s_software_is_fsdp_across_nodes(
        calibrated_model):
    """GPT-3 175B on 1024 A100s (Megatron-LM: 34 days) given SC21's software too (Megatron-LM's
    2021 kernels, dropout, every block recomputed) and left to choose: FSDP over 512 GPUs, a
    layout Megatron-LM ran in 2021 only as DeepSpeed's ZeRO-3; with this trainer's kernels, the
    same layout, faster, in a tie (within 1%) with an interleaved pipeline, which each rank's
    tensor-parallel traffic of only the root's parts it holds makes as cheap. Slowed by the
    most MosaicML's checkpointed A100 FSDP runs were planned
    too fast (but the one run nearest its memory), it is still not within 15% of 34 days; slowed
    by that one run's, it would be. Kept to Megatron-LM 2021's layouts (tp=8, its replicas, its
    pipeline cuts), it is an interleaved pipeline, slower, and still short of 34 days by more
    than 15%: the layout of the 34 days (Megatron-LM's example script: pp=16, micro-batch 1, no
    interleaving) is planned within 15% (the SC21 sec. 5.1 row above), and the plan prefers
    micro-batch 3 and 4 chunks per rank to it by about 10%. Pinned, as validation/README.md
    says."""
    from elastic_gpt.planner.inputs import DAY
    from elastic_gpt.planner.training_plan import plan_training

    sc21 = plan_training(checks.gpt3_175b_on_1024(sc21_software=True))
    mine = plan_training(checks.gpt3_175b_on_1024(sc21_software=False))
    megatron = plan_training(checks.gpt3_175b_on_1024(True, megatron_layouts=True))
    assert sc21.chosen.activation_checkpointing and sc21.chosen.mesh.pp == 1
    assert sc21.chosen.mesh.dp >= 512 and 20 < sc21.time_to_train_s / DAY < 23
    fsdp = plan_training(dataclasses.replace(checks.gpt3_175b_on_1024(sc21_software=False), pp=1))
    assert fsdp.chosen.mesh.dp >= 512 and fsdp.time_to_train_s <= 1.01 * mine.time_to_train_s
    assert mine.time_to_train_s <= fsdp.time_to_train_s < sc21.time_to_train_s
    a100 = {(c.run.label, c.run.gpus, c.run.gpu): c.ratio for k, c in calibrated_model.items()
            if k[0] == runs.MOSAICML and c.run.gpu.startswith("A100")}
    tightest = a100.pop(("MPT 70B", 64, "A100-40GB"))
    days = sc21.time_to_train_s / DAY
    assert max(a100.values()) * days < 0.85 * 34 < tightest * days < 1.15 * 34
    m = megatron.chosen.mesh
    assert (m.tp, m.dp_shard, type(m)) == (8, 1, ReplicatedMesh) and m.stages_per_rank > 1
    assert sc21.time_to_train_s < megatron.time_to_train_s < 34 / 1.15 * DAY
    example = plan_training(dataclasses.replace(checks.gpt3_175b_on_1024(True, True),
                                                **checks.MEGATRON_GPT3_EXAMPLE))
    assert (example.chosen.mesh.pp, example.chosen.micro_batch) == (16, 1)
    assert 34 / 1.15 < example.time_to_train_s / DAY < 34
    # what the plan prefers to the 34 days' layout: larger micro-batches, interleaved
    chosen, theirs = megatron.chosen.step, example.chosen.step
    assert megatron.chosen.micro_batch > 1 and chosen.bubble_s < theirs.bubble_s
    assert chosen.compute_s < theirs.compute_s and chosen.tp_comm_s < theirs.tp_comm_s
