"""A Trainer's one step on a gloo group, shared by the tests that compare a parallel step with the
one-process step (pipelines, Llama)."""

from __future__ import annotations


def one_trainer_step(rank: int, world: int, overrides: list[str]) -> dict:
    """One rank of a Trainer's step on the default job's config with `overrides`: the loss over
    the group, every full gradient and the clipped norm, for comparing layouts with one process."""
    import torch.distributed as dist

    from elastic_gpt.config import load_config
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config("jobs/configs/mini.yaml", overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
    stream = open_step_stream(cfg.data.path, batch_split=trainer.batch_split, rank=trainer.dp_rank,
                              world_size=trainer.dp_degree, start_step=0, seed=cfg.data.seed)
    batch = next(stream)
    stream.close()
    loss_sum = trainer.forward_backward(batch)
    counted = trainer.tp_rank == 0 and (trainer.pipeline is None or trainer.pipeline.last)
    if not counted:
        loss_sum.zero_()
    dist.all_reduce(loss_sum)
    grads = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""):
             p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    norm = trainer.clip_gradients()
    return {"loss": float(loss_sum) / (12 * trainer.gpt_cfg.seq_len), "grads": grads,
            "norm": float(norm), "setup": trainer.setup_line(), "family": trainer.gpt_cfg.family}
