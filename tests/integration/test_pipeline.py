"""Pipeline parallelism on real gloo ranks (parallel/pipeline.py): a pipelined step (1F1B,
interleaved 1F1B, with FSDP over data parallelism, with tensor parallelism) gives the loss, every
full gradient and the clipped norm of one process on the same global batch, in the Trainer too;
checkpoints reshard between pipelined and data-parallel runs; evaluation runs through the stages;
the planner's bytes and activations are what torch's schedules have."""

from __future__ import annotations

import pytest
import torch

from elastic_gpt.cost_model.pipeline import (
    in_flight,
)
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT
from elastic_gpt.testing.gloo import run_gloo
from tests.trainer_steps import one_trainer_step

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=64)
G = 8  # sequences per step
CLIP = 0.05  # below the gradient's norm, so clipping scales


def _batch() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (G, CFG.seq_len + 1),
                         generator=torch.Generator().manual_seed(1))


def _reference() -> dict:
    """One process, the whole model, the same global batch: the mean loss over G sequences."""
    model = GPT(CFG)
    model.init_weights(seed=0)
    data = _batch()
    T = CFG.seq_len
    loss = model(data[:, :T], targets=data[:, 1:]) / (G * T)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "norm": float(norm), "clipped": clipped}


def _pipelined(rank: int, world: int, pp: int, schedule: str, per_rank: int, tp: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from elastic_gpt.parallel.pipeline import (
        TiedEmbedding,
        build_schedule,
        clip_grad_norm,
        run_step,
        summed_loss,
    )
    from elastic_gpt.testing.pipeline_stages import cpu_stages

    dp = world // (pp * tp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    dp_rank = mesh.get_local_rank("dp_shard")
    stages = cpu_stages(CFG, mesh, per_rank)
    tied = TiedEmbedding(mesh, stages, mesh.mesh.tolist())
    T = CFG.seq_len
    local = _batch()[dp_rank * G // dp:(dp_rank + 1) * G // dp]
    # Each rank's loss is its share of the mean over G*T tokens; FSDP averages over dp ranks.
    sched = build_schedule(stages, mesh["pp"].get_group(), torch.device("cpu"),
                           n_microbatches=local.size(0), loss_fn=summed_loss(dp / (G * T)),
                           schedule=schedule)
    with loss_parallel():  # vocab-sharded logits under tensor parallelism (a no-op without)
        loss = run_step(sched, stages, local[:, :T], local[:, 1:])
    tied.sum_gradients()
    grads = {n: p.grad.full_tensor().clone() for s in stages for n, p in s.named_parameters()}
    norm = clip_grad_norm(stages, CLIP, mesh["pp"].get_group())
    clipped = {n: p.grad.full_tensor() for s in stages for n, p in s.named_parameters()}
    # The tp ranks of a stage hold the same (replicated) loss: one reports it.
    counted = loss is not None and mesh.get_local_rank("tp") == 0
    return {"loss": float(loss) / dp if counted else None, "grads": grads,
            "norm": float(norm), "clipped": clipped,
            "stages": [s.index for s in stages]}


@pytest.mark.parametrize("world,pp,schedule,per_rank,tp", [
    (2, 2, "1f1b", 1, 1),
    (2, 2, "interleaved_1f1b", 2, 1),
    (2, 2, "interleaved_zero_bubble", 2, 1),
    (4, 2, "1f1b", 1, 1),
    (4, 2, "1f1b", 1, 2),
], ids=["pp2", "pp2-interleaved", "pp2-zero-bubble", "pp2xdp2", "pp2xtp2"])
def test_a_pipelined_step_is_the_one_process_step(world, pp, schedule, per_rank, tp):
    ref = _reference()
    ranks = run_gloo(_pipelined, world, pp, schedule, per_rank, tp)
    # Every stage is somewhere, and every parameter of the model is on some rank.
    assert sorted({i for r in ranks for i in r["stages"]}) == list(range(pp * per_rank))
    assert set().union(*(r["grads"] for r in ranks)) == set(ref["grads"])
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert sum(losses) == pytest.approx(ref["loss"], rel=1e-5)
    for r in ranks:
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        for name, grad in r["grads"].items():
            # wte is held by the first and the last stage: each copy has the whole gradient.
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(r["clipped"][name], ref["clipped"][name], rtol=1e-5,
                                       atol=1e-7)


# ---- the Trainer's pipelined step ----------------------------------------------------------


def trainer_step(world: int, data: str, tmp_path, extra: tuple[str, ...] = ()) -> list[dict]:
    overrides = ["model.preset=tiny", "model.n_layer=4", f"data.path={data}",
                 "train.global_batch_size=12", "train.micro_batch_size=2",
                 f"scaling.max_workers={world}", f"scaling.min_workers={world}", "eval.samples=0",
                 "checkpoint.path=" + str(tmp_path / "unused"), *extra]
    return run_gloo(one_trainer_step, world, overrides)


@pytest.fixture(scope="module")
def single_step(stdlib_dataset, tmp_path_factory):
    """The step at W=1, the reference every pipelined layout is checked against."""
    return trainer_step(1, stdlib_dataset, tmp_path_factory.mktemp("w1"))[0]


@pytest.mark.parametrize("world,extra,layout", [
    (2, ("parallel.pp=2",), "dp 1 x tp 1 x pp 2"),
    (2, ("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
         "parallel.pp_stages_per_rank=2"), "dp 1 x tp 1 x pp 2"),
    (2, ("parallel.pp=2", "parallel.pp_schedule=interleaved_zero_bubble",
         "parallel.pp_stages_per_rank=2"), "dp 1 x tp 1 x pp 2"),
    (4, ("parallel.pp=2", "parallel.tp=2"), "dp 1 x tp 2 x pp 2"),
    (4, ("parallel.pp=2", "train.activation_checkpointing=true"), "dp 2 x tp 1 x pp 2"),
], ids=["pp2", "pp2-interleaved", "pp2-zero-bubble", "pp2xtp2", "pp2xdp2-checkpointing"])
def test_the_trainers_pipelined_step_is_its_one_process_step(single_step, stdlib_dataset,
                                                              tmp_path, world, extra, layout):
    single = single_step
    ranks = trainer_step(world, stdlib_dataset, tmp_path, extra)
    assert layout in ranks[0]["setup"], ranks[0]["setup"]
    held = set().union(*(r["grads"] for r in ranks))
    assert held == set(single["grads"])
    for r in ranks:
        assert r["loss"] == pytest.approx(single["loss"], rel=1e-6)
        assert r["norm"] == pytest.approx(single["norm"], rel=1e-5)
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, single["grads"][name], rtol=1e-5, atol=1e-6)


# ---- resharding between pipeline and data parallelism through checkpoints ----------------------

STEPS = 6


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from elastic_gpt.testing.step_recorder import train_recorded

    trainer, recorder = train_recorded(overrides, rank, world)
    return {"seen": recorder.seen, "setup": trainer.setup_line()}


def train(data: str, ckpt, pp: int, stop_at: int) -> dict:
    overrides = ["model.preset=tiny", "model.n_layer=4", f"data.path={data}",
                 "train.global_batch_size=8", "train.micro_batch_size=2",
                 f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.lr=3e-3",
                 "train.log_every=100", "checkpoint.every_steps=2", "checkpoint.keep=5",
                 f"checkpoint.path={ckpt}", "scaling.min_workers=2", "scaling.max_workers=2",
                 f"parallel.pp={pp}", f"run.stop_at_step={stop_at}", "eval.samples=0"]
    return run_gloo(_train_worker, 2, overrides)[0]


def test_checkpoints_reshard_between_pipeline_and_data_parallel(stdlib_dataset, tmp_path):
    """Saved at (pp 2, dp 1), resumed at (pp 1, dp 2) and back: every step trains on the
    uninterrupted run's samples with its losses; the pipelined checkpoint is GPT-2's layout."""
    from transformers import GPT2LMHeadModel

    from elastic_gpt.checkpoint.sharded import load_model_weights
    from elastic_gpt.inference.hf_export import export_hf
    from elastic_gpt.model.gpt import GPT

    whole = train(stdlib_dataset, tmp_path / "whole", pp=1, stop_at=STEPS)["seen"]
    ckpt = tmp_path / "resharded"
    first = train(stdlib_dataset, ckpt, pp=2, stop_at=2)  # (pp 2, dp 1)
    assert "dp 1 x tp 1 x pp 2" in first["setup"]
    seen = dict(first["seen"])
    seen.update(train(stdlib_dataset, ckpt, pp=1, stop_at=4)["seen"])  # (pp 1, dp 2) from step 2
    seen.update(train(stdlib_dataset, ckpt, pp=2, stop_at=STEPS)["seen"])  # back, from step 4
    assert sorted(seen) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert seen[s][1] == whole[s][1], f"step {s} trained on other samples (C2 data order)"
        assert seen[s][0] == pytest.approx(whole[s][0], abs=2e-3), f"step {s}"

    # The pipelined session's last checkpoint: one GPT-2 (tied embedding and all), which
    # Hugging Face's model reads and computes the whole model's logits with.
    step_dir = str(ckpt / f"step_{STEPS:08d}")
    export_hf(step_dir, str(tmp_path / "hf"))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    c = hf.config
    ours = GPT(GPTConfig(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                         seq_len=c.n_positions, vocab_size=c.vocab_size))
    load_model_weights(step_dir, ours)
    assert c.n_layer == 4
    x = torch.arange(2 * 32).reshape(2, 32) % c.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)


def _trainer_eval(rank: int, world: int, overrides: list[str]) -> dict:
    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config("jobs/configs/mini.yaml", overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
    result = trainer.evaluate(0)
    return {"loss": result.loss, "tokens": result.tokens}


@pytest.mark.parametrize("world,extra", [
    (2, ("parallel.pp=2",)),
    (4, ("parallel.pp=2", "parallel.tp=2")),
], ids=["pp2", "pp2xtp2"])
def test_held_out_evaluation_runs_through_the_stages(stdlib_dataset, world, extra, tmp_path):
    """The held-out loss through the pipeline (a step's micro-batches per call, the last one
    padded with ignored rows) is the one-process loss over the same tokens."""
    base = ["model.preset=tiny", "model.n_layer=4", f"data.path={stdlib_dataset}",
            "train.global_batch_size=8", "train.micro_batch_size=2", f"eval.path={stdlib_dataset}",
            "eval.samples=13", "checkpoint.path=" + str(tmp_path / "unused")]
    single = run_gloo(_trainer_eval, 1, [*base, "scaling.min_workers=1",
                                         "scaling.max_workers=1"])[0]
    ranks = run_gloo(_trainer_eval, world, [*base, f"scaling.min_workers={world}",
                                            f"scaling.max_workers={world}", *extra])
    for r in ranks:
        assert r["tokens"] == single["tokens"] == 13 * 64
        assert r["loss"] == pytest.approx(single["loss"], rel=1e-6)


# ---- the planner's pipeline terms against what torch's schedules do ---------------------------


def _traffic(rank: int, world: int, schedule: str, per_rank: int, micro_batches: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.parallel.pipeline import build_schedule, run_step, summed_loss
    from elastic_gpt.testing.pipeline_stages import cpu_stages
    from elastic_gpt.torch_internals import pipeline_sends

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp_shard"))
    stages = cpu_stages(CFG, mesh, per_rank)
    sched = build_schedule(stages, mesh["pp"].get_group(), torch.device("cpu"), micro_batches,
                           summed_loss(1.0), schedule)
    # The most micro-batches this rank's stages keep for their backward at once, over a step.
    peak = {"in_flight": 0}
    for stage in stages:
        forward = stage.runtime.forward_one_chunk

        def counted(*args, _forward=forward, **kwargs):
            out = _forward(*args, **kwargs)
            held = sum(len(s.runtime.fwd_cache) for s in stages)
            peak["in_flight"] = max(peak["in_flight"], held)
            return out
        stage.runtime.forward_one_chunk = counted
    data = _batch()[:micro_batches]
    T = CFG.seq_len
    run_step(sched, stages, data[:, :T], data[:, 1:])  # the first step infers the shapes
    peak["in_flight"] = 0
    with pipeline_sends() as sent:
        run_step(sched, stages, data[:, :T], data[:, 1:])
    return {"sent": sum(b for _, b in sent), "in_flight": peak["in_flight"]}


@pytest.mark.parametrize("schedule,per_rank", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_the_planner_counts_the_bytes_and_activations_torchs_schedules_have(schedule, per_rank):
    from elastic_gpt.cost_model.pipeline import p2p_bytes

    pp, m = 2, 4
    ranks = run_gloo(_traffic, pp, schedule, per_rank, m)
    for rank, got in enumerate(ranks):
        predicted = p2p_bytes(pp, m, micro_batch=1, seq_len=CFG.seq_len, n_embd=CFG.n_embd,
                              act_bytes=4, stages_per_rank=per_rank, pp_rank=rank)
        assert got["sent"] == predicted, (rank, got, predicted)
        # In micro-batches through one stage: the planner counts them through all of a rank's
        # layers (per_rank stages' worth), so a rank's stage-micro-batches are that x per_rank.
        keeps = in_flight(pp, m, per_rank, pp_rank=rank) * per_rank
        # Every rank's, the last's (fewest) as the first's (most), to one stage-micro-batch.
        assert got["in_flight"] <= keeps, (rank, got["in_flight"], keeps)
        assert got["in_flight"] == pytest.approx(keeps, abs=1), (rank, got["in_flight"], keeps)
