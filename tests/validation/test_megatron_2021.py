"""Megatron-LM 2021 as the cost model's software (validation/megatron_2021.py): Korthikanti et
al.'s activation counts with the scores materialised, whole tensors on every TP rank, the TP
all-reduces, the replicas' one all-reduce of 16-bit gradients after backward, the pipeline cuts
Megatron-LM 2021 could make and the gather of what each TP rank receives; each against this
trainer's software on the same layout (pure Python)."""

from __future__ import annotations

import dataclasses

import pytest

from elastic_gpt.cost_model.activations import activation_bytes_per_layer
from elastic_gpt.cost_model.kernels import Kernels
from elastic_gpt.cost_model.memory import memory_per_gpu
from elastic_gpt.cost_model.network import Network, ring_bytes
from elastic_gpt.cost_model.pipeline import pipelined_step_time
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.cost_model.step_time import step_time
from elastic_gpt.cost_model.tensor_parallel import tp_traffic
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.hardware import get_gpu
from elastic_gpt.model.config import GPTConfig, preset_config
from elastic_gpt.planner.inputs import PlanError
from elastic_gpt.planner.search import mesh_choices
from elastic_gpt.planner.training_plan import plan_training
from validation.checks import gpt3_175b_on_1024
from validation.megatron_2021 import (
    MEGATRON_2021,
    MEGATRON_2021_KERNELS,
    ReplicatedMesh,
    materialised_activation_bytes,
)
from validation.runs import SELENE_NIC_GBPS, SELENE_NVLINK_GBPS


def test_korthikantis_counts_with_the_scores_materialised():
    """sbh(34 + 5as/h) bytes a layer with dropout and no tensor parallelism (their eq. 1);
    sbh(10 + 24/t + 5as/(ht)) without sequence parallelism (section 4.2.1, Megatron-LM 2021);
    sbh(34/t + 5as/(ht)) with it (4.2.2), plus the two column-parallel inputs DTensor keeps whole.
    With flash attention's output in place of the scores, the last is the trainer's count."""
    s, b, h, a = 2048, 1, 12288, 96
    assert materialised_activation_bytes(s, 4, h, a, dropout=True) == pytest.approx(
        s * 4 * h * (34 + 5 * a * s / h))
    for t in (1, 2, 4, 8):
        eq2 = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert materialised_activation_bytes(s, b, h, a, dropout=True, tp=t) == pytest.approx(eq2)
        gathered = 2 * 2 * s * b * h * (1 - 1 / t)
        sp = materialised_activation_bytes(s, b, h, a, dropout=True, tp=t, sequence_parallel=True)
        assert sp == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)) + gathered)
        scores, flash = 5 * a * s * s * b / t, (2 * s * b * h + 4 * a * s * b) / t
        assert activation_bytes_per_layer(s, b, h, a, dropout=True, tp=t) == pytest.approx(
            sp - scores + flash)


def test_megatron_2021_keeps_whole_tensors_on_every_tp_rank():
    """Its checkpoint keeps each block's input whole on every TP rank (no
    --distribute-checkpointed-activations), where the trainer's sequence parallelism keeps 1/t
    of it, and its recomputed layer keeps section 4.2.1's tensors and the scores."""
    cfg = dataclasses.replace(preset_config("gpt3-175b"), dropout=0.1)
    shape, t, L, sbh = model_shape(cfg), 8, cfg.n_layer, cfg.seq_len * cfg.n_embd
    kw = dict(activation_checkpointing=True, tp=t, dp_shard=1)
    megatron = memory_per_gpu(shape, t, 1, software=MEGATRON_2021_KERNELS, **kw)
    trainer = memory_per_gpu(shape, t, 1, **kw)
    recomputed = (materialised_activation_bytes(cfg.seq_len, 1, cfg.n_embd, cfg.n_head, tp=t,
                                                dropout=True)
                  - activation_bytes_per_layer(cfg.seq_len, 1, cfg.n_embd, cfg.n_head, tp=t,
                                               dropout=True))
    # every block's input and ln_f's, whole where the trainer keeps 1/t, and the recomputed
    # layer's tensors and scores
    assert megatron.activations - trainer.activations == pytest.approx(
        (L + 1) * 2 * sbh * (1 - 1 / t) + recomputed)
    assert megatron.sharded_state == trainer.sharded_state and megatron.logits == trainer.logits


def test_megatron_2021_kernels_cost_more_than_the_trainers():
    """Unfused attention over materialised scores, and the layer norms, dropouts and residual
    adds over the whole sequence on every TP rank."""
    k = Kernels(get_gpu("A100-80GB"), act_bytes=2)
    cfg = GPTConfig(n_layer=1, n_head=96, n_embd=12288, seq_len=2048, vocab_size=51200,
                    dropout=0.1)
    theirs = MEGATRON_2021_KERNELS.block_times(k, 1, cfg, 8)
    trainer = TRAINER.block_times(k, 1, cfg, 8)
    assert theirs.forward_s > trainer.forward_s and theirs.backward_s > trainer.backward_s


def test_megatron_2021_tp_all_reduces_whole_activations_and_recomputes_them():
    """Megatron-LM 2021 (no sequence parallelism): per block 2 all-reduces forward, 2 backward
    and 2 more in the recomputed forward; the root's embedding output and lm_head input gradient
    and the loss's 3; no gradient sync. The bytes are the trainer's all-gather + reduce-scatter
    pairs' (an all-reduce moves both), plus the one pair the trainer's early-stopping
    recomputation skips, less its position-embedding and sequence-sharded terms."""
    shape = model_shape(dataclasses.replace(preset_config("tiny"), n_layer=2))
    cfg = shape.cfg
    kw = dict(act_bytes=4, grad_bytes=4)
    off = MEGATRON_2021.tp_traffic(shape, 3, 2, activation_checkpointing=False, **kw)
    on = MEGATRON_2021.tp_traffic(shape, 3, 2, activation_checkpointing=True, **kw)
    assert (off.all_gathers, off.reduce_scatters, off.all_reduces) == (0, 0, 2 * 4 + 2 + 3)
    assert on.all_reduces == 2 * 6 + 2 + 3
    assert off.sync_collectives == on.sync_collectives == 0 and on.bytes_per_sync == 0
    act = 3 * cfg.seq_len * cfg.n_embd * 4
    loss = 3 * 2 * ring_bytes(4 * 3 * cfg.seq_len, 2)
    assert on.bytes_per_micro_batch == pytest.approx((2 * 6 + 2) * 2 * ring_bytes(act, 2) + loss)
    trainer = tp_traffic(shape, 3, 2, activation_checkpointing=True, **kw)
    assert trainer.all_reduces == 3 and trainer.sync_collectives > 0


def test_megatron_2021_replicas_all_reduce_their_16_bit_grads_after_backward():
    """Each rank holds its tp part whole (16-bit params and grads, fp32 master and Adam), no FSDP
    collective runs, and the step's one all-reduce of the 16-bit gradients is on the critical
    path, where FSDP2's reduce-scatter of the same layout hides under the backward; the 16-bit
    gradients accumulate in place after each micro-batch, and its optimizer step moves more
    bytes than FSDP2's."""
    shape = model_shape(preset_config("gpt3-13b"))
    gpu, net = get_gpu("A100-80GB"), Network(8, 195, 160)
    kw = dict(activation_checkpointing=True, grad_sync="step", tp=8)
    mesh = MEGATRON_2021.mesh(128, 8, False, 8)
    assert isinstance(mesh, ReplicatedMesh)
    assert (mesh.tp, mesh.dp_shard, mesh.dp_replicate) == (8, 1, 16)
    assert not mesh.hsdp and mesh.short() == "tp=8 DDP 16"
    ddp = step_time(shape, gpu, net, 128, 1, 4, software=MEGATRON_2021, **kw)
    fsdp = step_time(shape, gpu, net, 128, 1, 4, **kw)
    local = shape.local_params(8)
    assert ddp.all_gather_bytes == ddp.reduce_scatter_bytes == 0
    assert ddp.all_reduce_bytes == pytest.approx(2 * ring_bytes(2 * local, 16))
    # one ring per TP position, one member per node, the 8 of a node through its NICs
    expected = net.ring_s(ddp.all_reduce_bytes, ranks=16, per_node=1, nic_sharing=8,
                          all_reduce=True)
    assert ddp.comm_s == ddp.exposed_comm_s == pytest.approx(expected)
    assert fsdp.exposed_comm_s < fsdp.comm_s  # FSDP2 hides some of its collectives
    one = step_time(shape, gpu, net, 128, 1, 1, software=MEGATRON_2021, **kw)
    assert ddp.compute_s - 4 * one.compute_s == pytest.approx(
        3 * Kernels(gpu, 2).memory_s(6 * local))  # not FSDP2's fp32 sum, 10 B a parameter
    # the whole part, not 1/16 of it, and Megatron-LM's fp16 optimizer step moves 52 B a
    # parameter (the grad copied to fp32, unscaled, its norm, Adam, the weights copied back) to
    # FSDP2's 32 (Adam and the norm)
    assert ddp.optimizer_s == pytest.approx(16 * 52 / 32 * fsdp.optimizer_s, rel=1e-6)
    mem = memory_per_gpu(shape, 128, 1, activation_checkpointing=True, tp=8, dp_shard=1,
                         grad_sync="step", micro_batches_per_rank=4, software=MEGATRON_2021)
    assert mem.sharded_state == pytest.approx(12 * local)
    assert mem.gathered_params == pytest.approx(4 * local) and mem.accumulated_grads == 0


def test_megatron_2021_pipelines_are_cut_only_as_megatron_lm_2021_could():
    """A pipeline has the same blocks on every stage and interleaves only past 2 stages, each
    rank's blocks split evenly over its chunks, with a multiple of pp micro-batches (Megatron-LM
    at a8d172b3); the trainer's FSDP2 balances uneven cuts. One line for each rule broken."""
    p = gpt3_175b_on_1024(True, megatron_layouts=True)
    net = Network(8, SELENE_NVLINK_GBPS, SELENE_NIC_GBPS)
    megatron = mesh_choices(p, p.model, net, 1024)
    fsdp = mesh_choices(dataclasses.replace(p, software=MEGATRON_2021_KERNELS), p.model, net,
                        1024)
    cuts = {(m.pp, m.stages_per_rank) for m in megatron}
    assert all(isinstance(m, ReplicatedMesh) and m.dp_shard == 1 and not m.hsdp
               for m in megatron)
    assert {(8, 4), (16, 2), (32, 1)} <= cuts  # 96 blocks: 12, 6 and 3 on each rank
    assert not cuts & {(8, 8), (16, 4), (32, 2), (64, 1)}
    assert {(8, 8), (64, 1)} <= {(m.pp, m.stages_per_rank) for m in fsdp}
    plan = plan_training(p)
    c = plan.chosen
    assert isinstance(c.mesh, ReplicatedMesh) and c.mesh.stages_per_rank > 1
    assert c.micro_batches_per_rank % c.mesh.pp == 0
    for forced, message in ((dict(pp=64), "Megatron-LM 2021 needs --pp=64 to divide the "
                                          "model's 96 blocks"),
                            (dict(pp=8, pp_stages_per_rank=8), "split evenly into "
                                                               "--pp-stages-per-rank=8"),
                            (dict(pp=2, pp_stages_per_rank=2), "more than 2 stages")):
        with pytest.raises(PlanError, match=message):
            plan_training(dataclasses.replace(p, **forced))


def test_megatron_2021_pipelines_regather_what_each_tp_rank_receives():
    """Megatron-LM 2021's scatter/gather (on by default): each TP rank sends 1/tp of a whole
    (s, b, h) tensor, the same bytes as the trainer's sequence shard, and the receiver
    all-gathers it over the node's link; the plan adds one such all-gather per send."""
    cfg = GPTConfig(n_layer=96, n_head=96, n_embd=12288, seq_len=2048, vocab_size=51200)
    shape, gpu, net = model_shape(cfg), get_gpu("A100-80GB"), Network(8, 195, 160)
    mesh = MEGATRON_2021.mesh(1024, 8, False, 8, 8, 4)
    kw = dict(activation_checkpointing=True)
    theirs = pipelined_step_time(shape, gpu, net, mesh, 3, 32, software=MEGATRON_2021, **kw)
    trainer = pipelined_step_time(shape, gpu, net, mesh, 3, 32, **kw)
    assert theirs.p2p_bytes == trainer.p2p_bytes
    whole = 3 * 2048 * 12288 * 2
    gather = net.ring_s(whole * 7 / 8, ranks=8, per_node=8)
    sends = 32 * 2 * 4
    assert theirs.p2p_s - trainer.p2p_s == pytest.approx(sends * gather)
    assert theirs.all_reduce_bytes > 0 and theirs.exposed_comm_s == theirs.comm_s


def test_a_plan_of_megatron_2021_names_its_replicas():
    """The checks print a plan's mesh: Megatron-LM 2021's names its data parallelism (DDP,
    replicas), not FSDP or HSDP, though its replicas span nodes."""
    plan = plan_training(gpt3_175b_on_1024(True, megatron_layouts=True))
    mesh = plan.chosen.mesh
    assert mesh.dp_replicate > 1 and not mesh.hsdp
    assert mesh.short() == f"tp=8 DDP {mesh.dp} pp={mesh.pp}x{mesh.stages_per_rank}"
    assert "replicated over" in mesh.label() and "FSDP" not in mesh.label()
