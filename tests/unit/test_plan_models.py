"""The planner's first-order models against published numbers, and their own invariants: memory per
GPU, step time (FSDP, tensor parallelism, HSDP) and the restart path's goodput (pure Python)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_gpt.config import ElasticSection
from elastic_gpt.cost_model.activations import activation_bytes_per_layer
from elastic_gpt.cost_model.kernels import (
    MATRIX_EFFICIENCY,
    Kernels,
    block_times,
    step_efficiency,
)
from elastic_gpt.cost_model.memory import memory_per_gpu, zero_model_state_bytes
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.network import (
    NCCL_BASE_LATENCY_S,
    NCCL_NET_HOP_S,
    NCCL_NVLINK_HOP_S,
    Network,
    ring_bytes,
)
from elastic_gpt.cost_model.shape import model_shape, training_flops_per_token
from elastic_gpt.cost_model.step_time import step_time, time_to_train_s
from elastic_gpt.cost_model.tensor_parallel import tp_traffic
from elastic_gpt.hardware import get_gpu
from elastic_gpt.model.config import LOSS_CHUNK_LOGITS, GPTConfig, preset_config
from elastic_gpt.planner.inputs import DAY, PlanError, PlanInputs
from elastic_gpt.planner.reliability import (
    goodput,
    optimal_interval_s,
    rollback_mtbf_s,
    spike_cost_s,
    young_interval_s,
)
from elastic_gpt.planner.report import training_config
from elastic_gpt.planner.training_plan import plan_training
from tests.planner_helpers import within

# ----------------------------------------------------------------------------- published results


def test_megatron_gpt3_175b_time_to_train_is_about_34_days():
    """Narayanan et al. 2021, section 5.1: 8TP/(nX) for GPT-3 175B, 300B tokens, 1024 A100s at
    140 TFLOP/s per GPU is ~34 days."""
    assert within(time_to_train_s(300e9, 8 * 175e9, 1024, 140e12) / DAY, 34.0)
    plan = plan_training(PlanInputs(model="gpt3-175b", gpu="A100-80GB", n_gpus=1024,
                                    global_batch_size=1536, tokens=300e9,
                                    achieved_flops_per_gpu=140e12,
                                    activation_checkpointing=True))
    # Our FLOPs/token counts attention and the lm_head too (~8.2P with recompute, not 8P).
    hw = training_flops_per_token(plan.shape, True)
    assert within(hw / plan.shape.params, 8.0, rel=0.05)
    assert within(plan.time_to_train_s / DAY, 34.0)
    # the mesh is the modelled-fastest one, the one the step-time model chooses
    modelled = plan_training(PlanInputs(model="gpt3-175b", gpu="A100-80GB", n_gpus=1024,
                                        global_batch_size=1536, tokens=300e9,
                                        activation_checkpointing=True))
    assert plan.chosen.activation_checkpointing and plan.chosen.mesh == modelled.chosen.mesh


def test_zero_paper_memory_arithmetic_for_7_5b_on_64_gpus():
    """Rajbhandari et al. 2020, figure 1: 7.5B params, Adam mixed precision (K=12), N_d=64:
    120 GB baseline, 31.4 (P_os), 16.6 (P_os+g), 1.9 GB (P_os+g+p)."""
    published = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}
    for stage, expected in published.items():
        assert within(zero_model_state_bytes(7.5e9, 64, stage), expected), stage
    # The FSDP2 planner's sharded state for a real 7.5B-parameter GPT on 64 GPUs is the same.
    cfg = GPTConfig(n_layer=36, n_head=32, n_embd=4096, seq_len=2048, vocab_size=50304)
    shape = model_shape(cfg)
    assert within(shape.params, 7.5e9, rel=0.02)
    mem = memory_per_gpu(shape, 64, 1, activation_checkpointing=True)
    assert within(mem.sharded_state, 1.9e9)
    assert within(memory_per_gpu(shape, 1, 1, activation_checkpointing=True).sharded_state, 120e9)


def test_zero_paper_trillion_parameters_on_1024_gpus_is_16_gb_each():
    """ZeRO, section 1: with P_os+g+p a 1T-parameter model fits in 16 GB per GPU on 1024 GPUs."""
    assert within(zero_model_state_bytes(1e12, 1024, 3), 16e9)


def test_activations_are_korthikantis_with_flash_attentions_output_for_the_scores():
    """Korthikanti et al. 2022 count sbh(34 + 5as/h) bytes per layer with dropout (their eq. 1):
    5as^2b of it the attention scores, their softmax, its mask and its dropout. SDPA's flash
    attention keeps none of those, only its output (sbh, copied by the transpose back to
    (B, T, C)) and a fp32 log-sum-exp per row and head (4asb); without dropout there are no
    masks (2sbh). For GPT-3's shape that is ~3x less."""
    s, b, h, a = 2048, 4, 12288, 96
    korthikanti = s * b * h * (34 + 5 * a * s / h)
    scores = 5 * a * s * s * b
    flash = 2 * s * b * h + 4 * a * s * b
    got = activation_bytes_per_layer(s, b, h, a, act_bytes=2, dropout=True)
    assert got == pytest.approx(korthikanti - scores + flash)
    no_dropout = activation_bytes_per_layer(s, b, h, a, act_bytes=2, dropout=False)
    assert no_dropout == pytest.approx(got - 2 * s * b * h) and no_dropout < korthikanti / 3


# ----------------------------------------------------------------------------- model invariants


def test_more_gpus_means_less_memory_per_gpu():
    shape = model_shape(preset_config("gpt3-1.3b"))
    totals = [memory_per_gpu(shape, n, 2, activation_checkpointing=False).total
              for n in (1, 2, 8, 64, 512)]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]


def test_checkpointing_cuts_activation_memory_and_adds_a_forward():
    shape = model_shape(preset_config("gpt2-350m"))
    off = memory_per_gpu(shape, 8, 8, activation_checkpointing=False)
    on = memory_per_gpu(shape, 8, 8, activation_checkpointing=True)
    assert on.activations < off.activations / 4
    assert on.sharded_state == off.sharded_state and on.logits == off.logits
    ratio = training_flops_per_token(shape, True) / training_flops_per_token(shape, False)
    assert 1.25 < ratio < 4 / 3  # the lm_head is not recomputed


def test_bigger_micro_batch_needs_more_memory():
    shape = model_shape(preset_config("gpt2-124m"))
    totals = [memory_per_gpu(shape, 8, mb, activation_checkpointing=False).total
              for mb in (1, 2, 4, 8)]
    assert totals == sorted(totals) and len(set(totals)) == 4


def test_no_sync_keeps_unsharded_fp32_grads_and_reduces_once_per_step():
    shape = model_shape(preset_config("gpt2-124m"))
    gpu, net = get_gpu("A100-80GB"), Network(8, 230, 40)
    per_mb = step_time(shape, gpu, net, 16, 4, 4, activation_checkpointing=False,
                       grad_sync="microbatch")
    per_step = step_time(shape, gpu, net, 16, 4, 4, activation_checkpointing=False,
                         grad_sync="step")
    assert per_mb.reduce_scatter_bytes == pytest.approx(4 * per_step.reduce_scatter_bytes)
    # ring reduce-scatter of fp32 grads: (N-1)/N * 4 bytes * params, once per step
    assert per_step.reduce_scatter_bytes == pytest.approx(15 / 16 * 4 * shape.params)
    assert per_mb.all_gather_bytes == per_step.all_gather_bytes  # gathered per micro-batch anyway
    mem = memory_per_gpu(shape, 16, 4, activation_checkpointing=False, grad_sync="step",
                         micro_batches_per_rank=4)
    assert mem.accumulated_grads == 4 * shape.params


def test_keeping_blocks_gathered_holds_every_block_and_nothing_else():
    shape = model_shape(preset_config("gpt2-350m"))
    L, kw = shape.cfg.n_layer, dict(activation_checkpointing=False, grad_sync="step",
                                    micro_batches_per_rank=4, fragmentation=0.0)
    zero3 = memory_per_gpu(shape, 8, 4, reshard_after_forward=True, **kw)
    kept = memory_per_gpu(shape, 8, 4, reshard_after_forward=False, **kw)
    # ZeRO-3 holds the current + the prefetched block; kept, all L: L - 2 more bf16 blocks
    assert kept.gathered_params - zero3.gathered_params == pytest.approx(
        (L - 2) * 2 * shape.block_params)
    for part in ("sharded_state", "accumulated_grads", "activations", "logits", "overhead"):
        assert getattr(kept, part) == getattr(zero3, part), part
    assert kept.total > zero3.total


def test_kept_gathered_blocks_are_gathered_once_per_step():
    shape = model_shape(preset_config("gpt2-124m"))
    gpu, net, N, L = get_gpu("H100"), Network(8, 370, 320), 16, shape.cfg.n_layer
    kw = dict(activation_checkpointing=False, grad_sync="step")

    def gathered(k: int, reshard: bool):
        return step_time(shape, gpu, net, N, 2, k, reshard_after_forward=reshard, **kw)

    once = ring_bytes(2 * (shape.root_params + L * shape.block_params), N)
    zero3_mb = ring_bytes(2 * (shape.root_params + (2 * L - 1) * shape.block_params), N)
    for k in (1, 2, 4, 8):
        kept, zero3 = gathered(k, False), gathered(k, True)
        assert kept.all_gather_bytes == pytest.approx(once)  # whatever the micro-batches
        assert zero3.all_gather_bytes == pytest.approx(k * zero3_mb)  # grows with them
        assert kept.reduce_scatter_bytes == zero3.reduce_scatter_bytes
        assert kept.comm_s <= zero3.comm_s and kept.exposed_comm_s <= zero3.exposed_comm_s
        assert kept.compute_s == zero3.compute_s
    # one micro-batch: never saves exactly the L - 1 backward re-gathers
    assert gathered(1, True).all_gather_bytes - gathered(1, False).all_gather_bytes == \
        pytest.approx(ring_bytes(2 * (L - 1) * shape.block_params, N))
    # on a slow network the saved gathers are exposed time: never is faster
    slow = Network(8, 370, 5)
    assert step_time(shape, gpu, slow, N, 2, 4, reshard_after_forward=False, **kw).step_s < \
        step_time(shape, gpu, slow, N, 2, 4, reshard_after_forward=True, **kw).step_s


def test_all_gather_bytes_follow_the_ring_formula():
    shape = model_shape(preset_config("gpt2-124m"))
    st = step_time(shape, get_gpu("H100"), Network(8, 370, 320), 8, 4, 3,
                   activation_checkpointing=False)
    L = shape.cfg.n_layer
    # forward: root + every block; backward: every block again but the last (kept gathered)
    elems = shape.root_params + (2 * L - 1) * shape.block_params
    assert st.all_gather_bytes == pytest.approx(3 * 7 / 8 * 2 * elems)


def test_inter_node_bandwidth_is_the_bottleneck_across_nodes():
    net = Network(gpus_per_node=8, intra_node_gbps=370, inter_node_gbps=50)
    assert net.bus_gbps(8) == 370 and net.bus_gbps(16) == 50
    assert net.collective_s(1e9, 16) > 5 * net.collective_s(1e9, 8)
    assert net.collective_s(1e9, 1) == 0.0


def test_slow_network_exposes_communication():
    shape = model_shape(preset_config("gpt3-1.3b"))
    gpu = get_gpu("H100")
    kw = dict(activation_checkpointing=False)
    fast = step_time(shape, gpu, Network(8, 370, 320), 64, 2, 2, **kw)
    slow = step_time(shape, gpu, Network(8, 370, 5), 64, 2, 2, **kw)
    assert fast.compute_s == slow.compute_s
    assert slow.exposed_comm_s > 10 * fast.exposed_comm_s
    assert 0 <= fast.overlapped_fraction <= 1 and fast.exposed_comm_s <= fast.comm_s


def test_young_daly_interval_maximises_goodput_numerically():
    delta, recovery, mtbf = 30.0, 120.0, 6 * 3600.0
    grid = [10.0 + i * 0.5 for i in range(20000)]  # 10 s .. 10,000 s
    best = max(grid, key=lambda t: goodput(t, delta, recovery, mtbf))
    assert best == pytest.approx(optimal_interval_s(delta, recovery, mtbf), abs=1.0)
    assert within(best, young_interval_s(delta, mtbf), rel=0.05)  # sqrt(2 * delta * MTBF)
    assert goodput(best, delta, recovery, mtbf) > goodput(best / 3, delta, recovery, mtbf)
    assert goodput(best, delta, recovery, mtbf) > goodput(best * 3, delta, recovery, mtbf)


def test_more_nodes_lower_goodput_and_shorter_intervals():
    small = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=8))
    big = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=256,
                                   global_batch_size=512))
    assert big.spot.mtbf_s == pytest.approx(small.spot.mtbf_s / 32)
    assert big.spot.goodput < small.spot.goodput
    assert big.spot.young_interval_s < small.spot.young_interval_s
    assert small.spot.goodput < small.on_demand.goodput


def test_a_restart_at_16k_gpus_costs_what_llama_3_reports():
    """Llama 3 (Dubey et al. 2024, sec. 3.3.4): 419 unexpected interruptions in 54 days on 16K
    H100s, with more than 90% effective training time. The recovery is counted term by term
    (planner/restart_cost.py): the trainer's hang timeout before a hung rank is a failure,
    Ray Train's restart, the checkpoint read at the storage's sustained 2 TB/s (Tectonic). The
    plan's goodput lands in the 88-95% such runs report; a constant restart alone (the planner
    before) put it above 97%."""
    cfg = GPTConfig(n_layer=126, n_head=128, n_embd=16384, seq_len=8192, vocab_size=128256)
    run = dict(model=cfg, gpu="H100", n_gpus=16384, global_batch_size=2048, tokens=15.6e12,
               tp=8, pp=16, replica_groups="off", market="on-demand",
               node_mtbf_h=54 * 24 * 2048 / 419, storage_gbps=2000.0)
    plan = plan_training(PlanInputs(**run))
    cost, rel = plan.restart_cost, plan.on_demand
    assert rel.mtbf_s == pytest.approx(54 * 86400 / 419)
    assert cost.detect_s == ElasticSection.hang_timeout_s and cost.restart_s == 90.0
    assert cost.read_s == pytest.approx(12 * plan.shape.params / 2000e9)  # the storage's cap
    assert rel.recovery_s == pytest.approx(cost.total_s)
    assert 0.88 <= rel.goodput <= 0.95
    constant = plan_training(PlanInputs(**{**run, "storage_gbps": None}, detect_s=0.0))
    assert constant.on_demand.goodput > 0.97
    # a compile in every new process is one more term of every recovery
    compiled = plan_training(PlanInputs(**run, compile_s=120.0))
    assert compiled.on_demand.recovery_s == pytest.approx(rel.recovery_s + 120.0)
    assert compiled.on_demand.goodput < rel.goodput


def test_float8_plans_faster_matmuls_and_half_the_gathered_bytes():
    """`--dtype float8` (the trainer's `train.float8`): the blocks' matmuls at the float8 peak
    and its measured ceiling, with the casts torchao's dynamic scaling adds; FSDP2 gathering the
    blocks' weights in float8 (one byte, not two); activations still bf16. Refused without
    float8 tensor cores and at tp > 1, as the trainer refuses them."""
    base = dict(model="gpt3-13b", gpu="H100", n_gpus=64, tokens=300e9, micro_batch_size=4,
                activation_checkpointing=False, reshard_after_forward="always",
                grad_sync="microbatch", replica_groups="off")
    bf16 = plan_training(PlanInputs(**base, tp=1))
    fp8 = plan_training(PlanInputs(**base, dtype="float8"))
    assert fp8.chosen.mesh == bf16.chosen.mesh and fp8.chosen.tp == 1
    assert 1.1 < bf16.step_s / fp8.step_s < 2.0  # faster, not the peaks' 2x
    # every micro-batch gathers the blocks in forward and all but the last again in backward, a
    # byte a parameter fewer each; the root (the tied embedding) stays bf16
    L, k = fp8.cfg.n_layer, fp8.chosen.micro_batches_per_rank
    saved = bf16.chosen.step.all_gather_bytes - fp8.chosen.step.all_gather_bytes
    assert saved == pytest.approx(63 / 64 * k * (2 * L - 1) * fp8.shape.block_params)
    assert fp8.chosen.memory.activations == bf16.chosen.memory.activations
    written = training_config(fp8)["train"]
    assert written["float8"] is True and written["compile"] is True
    assert written["dtype"] == "bfloat16"
    with pytest.raises(PlanError, match="--dtype float8 needs float8 tensor cores .*A100-80GB"):
        plan_training(PlanInputs(**{**base, "gpu": "A100-80GB"}, dtype="float8"))
    with pytest.raises(PlanError, match="--dtype float8 runs at --tp 1"):
        plan_training(PlanInputs(**base, dtype="float8", tp=2))


# ----------------------------------------------------------------------------- tensor parallelism


def test_memory_with_tp_divides_what_tp_splits():
    """At the same data-parallel shard degree, tp=8 holds 1/8 of everything TP splits: the
    sharded state and gathered blocks (but for the replicated LayerNorms and c_proj biases), the
    sequence-parallel activations (but for c_attn's and c_fc's gathered inputs) and the logits."""
    shape = model_shape(preset_config("gpt3-175b"))
    cfg, t, dp = shape.cfg, 8, 16
    kw = dict(activation_checkpointing=True, fragmentation=0.0, context_bytes=0.0)
    one = memory_per_gpu(shape, dp, 4, **kw)
    tp8 = memory_per_gpu(shape, dp * t, 4, tp=t, **kw)
    h, L = cfg.n_embd, cfg.n_layer
    replicated = L * 9 * h + 2 * h  # per block ln_1, ln_2 (4h), c_attn's and c_proj's biases
    assert shape.local_params(t) == pytest.approx((shape.params - replicated) / t + replicated)
    assert tp8.sharded_state == pytest.approx(16 * shape.local_params(t) / dp)
    assert tp8.sharded_state / one.sharded_state == pytest.approx(1 / t, rel=1e-3)
    assert tp8.gathered_params / one.gathered_params == pytest.approx(1 / t, rel=1e-3)
    # tp=1 chunks its loss (the logits' bf16 gradient + one fp32 chunk); tp=8 keeps four fp32
    # buffers of its vocabulary slice (LOGIT_BYTES, as the dry run measures).
    logits = 4 * cfg.seq_len * cfg.vocab_size
    assert one.logits == pytest.approx(2 * logits + 12 * min(logits, LOSS_CHUNK_LOGITS))
    assert tp8.logits == pytest.approx(16 * logits / t)
    sbh = cfg.seq_len * 4 * h * 2  # bytes of one (b, s, h) bf16 tensor
    per_layer = activation_bytes_per_layer(cfg.seq_len, 4, h, cfg.n_head, tp=t)
    assert tp8.activations == pytest.approx(L * sbh / t + per_layer + sbh * (1 + 1 / t))
    assert per_layer == pytest.approx(
        activation_bytes_per_layer(cfg.seq_len, 4, h, cfg.n_head) / t + 2 * sbh * (1 - 1 / t))
    # the default shard degree is every data-parallel rank: N / tp
    assert memory_per_gpu(shape, dp * t, 4, tp=t, dp_shard=dp, **kw) == tp8


def test_sequence_parallel_activations_are_korthikantis_plus_the_gathered_inputs():
    """Korthikanti et al. 2022, section 4.2.2: with TP and sequence parallelism a layer stores
    sbh(34/t + 5as/(ht)); flash attention keeps its output and log-sum-exp for the scores' 5as/ht
    (both split over the heads). DTensor's column-parallel layers keep their all-gathered input
    whole (Megatron-LM re-gathers it in backward): two (b, s, h) tensors more, 2 bytes x 2 x
    (1 - 1/t)."""
    s, b, h, a = 2048, 1, 12288, 96
    for t in (1, 2, 4, 8):
        korthikanti = s * b * h * 34 / t
        flash = (2 * s * b * h + 4 * a * s * b) / t
        got = activation_bytes_per_layer(s, b, h, a, act_bytes=2, dropout=True, tp=t)
        assert got == pytest.approx(korthikanti + flash + 2 * 2 * s * b * h * (1 - 1 / t)), t


def test_tp_traffic_counts_the_collectives_dtensor_runs():
    """The counts CommDebugMode reports for the trainer's plan on a 2-layer model, forward +
    backward: 11 all-gathers, 11 reduce-scatters (4 per block each way, 3 at the root: wte, wpe,
    lm_head) and the loss's 3 all-reduces; checkpointing re-runs 2 gathers and 1 scatter per block
    (the recomputation stops at the MLP's c_proj input)."""
    shape = model_shape(dataclasses.replace(preset_config("tiny"), n_layer=2))
    cfg = shape.cfg
    off = tp_traffic(shape, 3, 2, activation_checkpointing=False, act_bytes=4, grad_bytes=4)
    on = tp_traffic(shape, 3, 2, activation_checkpointing=True, act_bytes=4, grad_bytes=4)
    assert (off.all_gathers, off.reduce_scatters, off.all_reduces) == (11, 11, 3)
    assert (on.all_gathers, on.reduce_scatters) == (11 + 2 * 2, 11 + 2 * 1)
    act = 3 * cfg.seq_len * cfg.n_embd * 4  # (b, s, h) fp32
    pos = cfg.seq_len * cfg.n_embd * 4
    loss = 3 * 2 * ring_bytes(4 * 3 * cfg.seq_len, 2)
    assert off.bytes_per_micro_batch == pytest.approx(
        20 * ring_bytes(act, 2) + 2 * ring_bytes(pos, 2) + loss)
    # per gradient sync: the 4 LayerNorm tensors of each block and ln_f's 2, all-reduced, and
    # each block's c_attn bias (3h, this rank's heads) all-gathered
    assert off.sync_collectives == 4 * 2 + 2 + 2
    assert off.bytes_per_sync == pytest.approx(2 * ring_bytes(4 * (2 * 4 + 2) * cfg.n_embd, 2)
                                               + ring_bytes(4 * 2 * 3 * cfg.n_embd, 2))
    assert tp_traffic(shape, 3, 1, activation_checkpointing=True, act_bytes=4,
                      grad_bytes=4).bytes_per_micro_batch == 0


def test_a_pipeline_rank_runs_only_the_root_collectives_of_the_parts_it_holds():
    """At pp=3 the first rank runs the embeddings' (wte and wpe: reduce-scattered forward,
    all-gathered backward), the last the output layer's, the loss's and ln_f's sync, a middle
    rank none of the root's: its blocks' alone. Their sum is the unpipelined model's."""
    from elastic_gpt.cost_model.pipeline import rank_shape

    whole = model_shape(dataclasses.replace(preset_config("tiny"), n_layer=3))
    kw = dict(activation_checkpointing=False, act_bytes=4, grad_bytes=4)
    first, middle, last = (tp_traffic(rank_shape(whole, 3, 1, r), 3, 2, **kw) for r in range(3))
    block = 4  # all-gathers (and reduce-scatters) of one block, forward and backward
    assert (first.all_gathers, first.reduce_scatters, first.all_reduces) == (block + 2, block + 2, 0)
    assert (middle.all_gathers, middle.reduce_scatters, middle.all_reduces) == (block, block, 0)
    assert (last.all_gathers, last.reduce_scatters, last.all_reduces) == (block + 1, block + 1, 3)
    assert (first.sync_collectives, middle.sync_collectives, last.sync_collectives) == (5, 5, 7)
    t = tp_traffic(whole, 3, 2, **kw)
    for field in ("all_gathers", "reduce_scatters", "all_reduces", "bytes_per_micro_batch",
                  "sync_collectives", "bytes_per_sync"):
        assert sum(getattr(r, field) for r in (first, middle, last)) == pytest.approx(
            getattr(t, field)), field


def test_kernel_efficiency_grows_with_the_kernels_size():
    gpu = get_gpu("A100-80GB")
    k = Kernels(gpu, act_bytes=2)
    assert step_efficiency(MATRIX_EFFICIENCY, 200e9) == 0.95
    assert step_efficiency(MATRIX_EFFICIENCY, 20e9) == 0.9
    assert step_efficiency(MATRIX_EFFICIENCY, 0.5e9) == 0.1
    # a 12288-wide MLP matmul of one 2048-token sequence at tp=8: FLOPs at the curve's top,
    # scaled to the A100's measured ceiling (271.2 of 312 TFLOP/s), plus its three matrices
    # read and written at 0.9 of HBM
    m, kk, n = 2048, 12288, 4 * 12288 / 8
    assert k.matrix_efficiency(2 * m * kk * n) == pytest.approx(271.2 / 312)
    expected = 2 * m * kk * n / 271.2e12 + 2 * (m * kk + kk * n + m * n) / (2039e9 * 0.9)
    assert k.matmul_s(m, kk, n) == pytest.approx(expected)
    # more tensor parallelism, less per rank, in smaller (less efficient) kernels; dropout
    # costs more
    one = block_times(k, 1, 2048, 12288, 1)
    eight = block_times(k, 1, 2048, 12288, 8)
    assert one.forward_s / 8 < eight.forward_s < one.forward_s / 7
    dropped = block_times(k, 1, 2048, 12288, 8, dropout=0.1)
    assert dropped.forward_s > eight.forward_s and dropped.backward_s > eight.backward_s


def test_nccl_ring_latency_grows_with_ranks_and_nodes():
    """NCCL's Ring/Simple model: base + an NVLink hop per step inside a node, a network hop per
    step between nodes; an all-reduce twice the steps."""
    net = Network(8, 230, 40, nccl_latency=True)
    assert net.ring_latency_s(1) == 0.0
    assert net.ring_latency_s(8) == pytest.approx(NCCL_BASE_LATENCY_S + 7 * NCCL_NVLINK_HOP_S)
    # 16 ranks on 2 nodes: 15 steps, 1 of them between the nodes
    assert net.ring_latency_s(16) == pytest.approx(
        NCCL_BASE_LATENCY_S + 14 * NCCL_NVLINK_HOP_S + NCCL_NET_HOP_S)
    # one rank per node (HSDP's replicate groups): every step crosses the network
    assert net.ring_latency_s(4, 1, all_reduce=True) == pytest.approx(
        NCCL_BASE_LATENCY_S + 6 * NCCL_NET_HOP_S)
    assert net.ring_latency_s(1536) > 100 * net.ring_latency_s(8)
    # the uncalibrated model: a fixed cost whatever the ranks
    assert Network(8, 230, 40, nccl_latency=False).ring_latency_s(1536) == 20e-6


def test_tp_splits_compute_and_puts_its_collectives_on_the_critical_path():
    shape = model_shape(preset_config("gpt3-13b"))
    gpu, net = get_gpu("H100"), Network(8, 370, 320)
    kw = dict(activation_checkpointing=True, grad_sync="microbatch")
    one = step_time(shape, gpu, net, 8, 4, 1, **kw)
    tp = step_time(shape, gpu, net, 8, 4, 1, tp=4, **kw)
    # a quarter of the work, in matmuls a quarter the size: a little less efficient
    assert one.compute_s / 4 < tp.compute_s < one.compute_s / 3.5
    fixed = dict(efficiency=0.6, **kw)  # the uncalibrated model: exactly a quarter
    assert step_time(shape, gpu, net, 8, 4, 1, tp=4, **fixed).compute_s == pytest.approx(
        step_time(shape, gpu, net, 8, 4, 1, **fixed).compute_s / 4)
    assert one.tp_comm_s == 0 and tp.tp_comm_s > 0
    assert tp.step_s == pytest.approx(tp.compute_s + tp.exposed_comm_s + tp.tp_comm_s
                                      + tp.optimizer_s)
    # the TP bytes go at the intra-node bandwidth, with NCCL's ring latency per collective over
    # the 4 ranks of one node (an all-reduce's twice the steps)
    t = tp_traffic(shape, 4, 4, activation_checkpointing=True, act_bytes=2, grad_bytes=2)
    rings = t.all_gathers + t.reduce_scatters
    all_reduces = t.all_reduces + t.sync_collectives
    assert tp.tp_comm_s == pytest.approx(tp.tp_bytes / 370e9 + rings * net.ring_latency_s(4, 4)
                                         + all_reduces * net.ring_latency_s(4, 4, all_reduce=True))


def test_fsdp_across_nodes_with_tp_shares_each_nodes_nics():
    """tp data-parallel groups per node send through the same NICs: each GPU gathers 1/tp of the
    bytes, but a node moves as many as without TP, so the time across nodes barely changes;
    inside one node every GPU has its own link, and the time falls with the bytes."""
    shape = model_shape(preset_config("gpt3-13b"))
    gpu, net = get_gpu("A100-80GB"), Network(8, 230, 40)
    kw = dict(activation_checkpointing=True, grad_sync="microbatch")
    one = step_time(shape, gpu, net, 128, 1, 1, **kw)
    tp = step_time(shape, gpu, net, 128, 1, 1, tp=8, **kw)
    assert tp.all_gather_bytes < one.all_gather_bytes / 7
    assert tp.comm_s == pytest.approx(one.comm_s, rel=0.1)
    node = step_time(shape, gpu, net, 8, 1, 1, tp=2, **kw)
    node_one = step_time(shape, gpu, net, 8, 1, 1, **kw)
    assert node.comm_s < node_one.comm_s / 2


def test_hsdp_gathers_in_the_node_and_all_reduces_across_nodes():
    shape = model_shape(preset_config("gpt3-13b"))
    gpu, net = get_gpu("H100"), Network(8, 370, 320)
    kw = dict(activation_checkpointing=True, grad_sync="step")
    mesh = make_mesh(64, 2, True, 8)
    assert (mesh.tp, mesh.dp_shard, mesh.dp_replicate, mesh.dp) == (2, 4, 8, 32)
    st = step_time(shape, gpu, net, 64, 1, 2, tp=2, hsdp=True, **kw)
    local = shape.local_params(2)
    assert st.reduce_scatter_bytes == pytest.approx(ring_bytes(4 * local, 4))
    assert st.all_reduce_bytes == pytest.approx(2 * ring_bytes(4 * local / 4, 8))
    fsdp = step_time(shape, gpu, net, 64, 1, 2, tp=2, **kw)
    assert fsdp.all_reduce_bytes == 0
    assert fsdp.reduce_scatter_bytes == pytest.approx(ring_bytes(4 * local, 32))
    # memory: HSDP shards the state over one node's data-parallel ranks only
    mem = memory_per_gpu(shape, 64, 1, activation_checkpointing=True, tp=2, dp_shard=4)
    assert mem.sharded_state == pytest.approx(16 * local / 4)
    # one node: HSDP is FSDP
    assert make_mesh(8, 2, True, 8) == make_mesh(8, 2, False, 8)


def test_a_loss_spike_costs_the_work_since_a_checkpoint_twice_and_two_reads():
    """Training health (train/health.py) rolls a spike back, re-runs it and rolls back again
    (blamed on the data, the costlier verdict): at PaLM 540B's rate (~20 spikes in 255k steps)
    the goodput counts that, on the restart path and with replica groups; by default none is
    assumed."""
    from elastic_gpt.config import HealthSection
    from elastic_gpt.elastic.resize_rule import kept_fraction
    from elastic_gpt.planner.inputs import PALM_STEPS_PER_SPIKE
    from elastic_gpt.planner.replica_group_model import replica_reliability

    run = dict(model="gpt3-175b", gpu="A100-80GB", n_gpus=1024, tokens=300e9,
               replica_groups="off", market="on-demand")
    palm = plan_training(PlanInputs(**run, spike_every_steps=PALM_STEPS_PER_SPIKE))
    none = plan_training(PlanInputs(**run))
    rel = palm.on_demand
    assert rel.spike_every_s == pytest.approx(PALM_STEPS_PER_SPIKE * palm.step_s)
    suspect = max(1, HealthSection.skip_steps_before)  # updates before the first flagged loss
    assert rel.spike_s == pytest.approx(2 * (rel.interval_s / 2 + (suspect + HealthSection.spike_steps)
                                             * palm.step_s) + 2 * palm.restart_cost.read_s)
    assert none.on_demand.spike_s == 0
    # Young's interval counts a spike twice (it re-does the work since the checkpoint twice)...
    assert rel.young_interval_s == pytest.approx(young_interval_s(
        rel.ckpt_write_s, rollback_mtbf_s(rel.mtbf_s, rel.spike_every_s)))
    assert rel.goodput == pytest.approx(
        goodput(rel.interval_s, rel.ckpt_write_s, rel.recovery_s, rel.mtbf_s)
        * kept_fraction(rel.spike_s, rel.spike_every_s))
    assert rel.goodput < none.on_demand.goodput
    # ... which keeps more than the interval chosen for node failures alone would.
    blind = none.on_demand.interval_s
    assert rel.interval_s < blind and rel.goodput > (
        goodput(blind, rel.ckpt_write_s, rel.recovery_s, rel.mtbf_s)
        * kept_fraction(spike_cost_s(blind, palm.step_s, palm.restart_cost.read_s),
                        rel.spike_every_s))

    # Replica groups roll a spike back together, from checkpoints as far apart as their fallback
    # needs: the same cost at their own interval.
    groups = {**run, "replica_groups": 8}
    palm = plan_training(PlanInputs(**groups, spike_every_steps=PALM_STEPS_PER_SPIKE))
    none = plan_training(PlanInputs(**groups))
    rep, rep_none = (p.fault_tolerance.replica[0] for p in (palm, none))
    step = rep.layout.step_s  # a group's step, the cross-group average in it
    assert rep.spike_s == pytest.approx(2 * (rep.interval_s / 2 + (suspect + HealthSection.spike_steps)
                                             * step) + 2 * rep.layout.ckpt_read_s)
    assert rep.young_interval_s == pytest.approx(young_interval_s(
        rep.layout.ckpt_write_s, rollback_mtbf_s(rep.fallback_mtbf_s, PALM_STEPS_PER_SPIKE * step)))
    assert rep.interval_s < rep_none.interval_s and rep.goodput < rep_none.goodput
    assert rep_none.spike_s == 0
    # At one interval, the spikes' share of wall time is the restart path's arithmetic.
    market = dict(node_mtbf_h=2000.0, nodes=128, heartbeat_s=10.0, restart_s=120.0,
                  every_steps=100)
    with_spikes = replica_reliability(rep.layout, **market, spike_every_steps=PALM_STEPS_PER_SPIKE)
    without = replica_reliability(rep.layout, **market)
    assert with_spikes.goodput == pytest.approx(
        without.goodput * kept_fraction(with_spikes.spike_s, PALM_STEPS_PER_SPIKE * step))
