"""What a worker says about its run on the console, and records of its setup: the setup line
(the layout, the model, the batch and what `auto` settings chose), the predicted peak against
the usable memory, the progress line of a step, and the final evaluation next to gzip."""

from __future__ import annotations

import logging

import torch.distributed as dist

from elastic_gpt.console import say
from elastic_gpt.data.tokenizers import get_tokenizer
from elastic_gpt.hardware import GiB
from elastic_gpt.parallel.fsdp import reshard_label
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.train.evaluate import EvalResult, gzip_bits_per_byte

log = logging.getLogger(__name__)


def setup_line(layout, n_params: int, reshard_setting: str, grad_sync_setting: str) -> str:
    """What a group runs (its layout, model, batch and the settings `auto` chose), so a log shows
    the choices. `layout`: train/layout.RunLayout; the settings as the config gave them."""
    ms, split = layout.memory, layout.batch_split
    policy = reshard_label(ms.reshard_after_forward, reshard_setting)
    sync = ms.grad_sync + (" (auto)" if grad_sync_setting == "auto" else "")
    return (f"[elastic-gpt] {layout.world_size} worker(s) on {layout.device.type} "
            f"({dist.get_backend()}), {layout.threads} thread(s) each | "
            f"{layout.dims.describe()} | "
            f"model {n_params / 1e6:,.1f}M params, "
            f"{str(layout.compute_dtype).removeprefix('torch.')} | global batch "
            f"{split.global_batch_size} = micro-batches of {split.micro_batch_size}, "
            f"{split.slots(layout.dims.dp_degree)} per data-parallel rank | "
            f"FSDP2 reshard_after_forward={policy}, grad_sync={sync} | predicted peak "
            f"{ms.memory.total / GiB:,.1f} of {ms.usable_bytes / GiB:,.1f} GiB usable per "
            f"worker")


def record_memory_settings(metrics, ms, world_size: int) -> None:
    """The resolved settings and the predicted peak as the run's params, keyed by the group's
    size (a resized group resolves again), and a warning when the prediction does not fit."""
    metrics.log_params({f"resolved.w{world_size}.{k}": v for k, v in ms.params().items()})
    if not ms.fits:
        say(f"[elastic-gpt] warning: the predicted peak, {ms.memory.total / GiB:,.1f} GiB per "
            f"worker, is above the {ms.usable_bytes / GiB:,.1f} GiB usable; lower "
            "train.micro_batch_size, turn on train.activation_checkpointing, raise "
            "parallel.tp, or run `elastic-gpt plan` for a layout that fits")


def progress_line(step: int, max_steps: int, m: dict) -> str:
    """`step` is the number of optimizer steps done, as in the metrics and checkpoint folders."""
    return (f"[elastic-gpt] step {step}/{max_steps} | loss {m[mn.TRAIN_LOSS]:.4f} | lr "
            f"{m[mn.TRAIN_LR]:.2e} | grad {m[mn.TRAIN_GRAD_NORM]:.2f} | "
            f"{m[mn.TRAIN_TOKENS_PER_S]:,.0f} tok/s | mfu {m[mn.TRAIN_MFU]:.1%} | "
            f"W={m[mn.TRAIN_WORLD_SIZE]} accum={m[mn.TRAIN_GRAD_ACCUM]} | "
            f"{m[mn.TRAIN_STEP_TIME_S]:.2f}s/step "
            f"(data {m[mn.DATA_WAIT_S] / m[mn.TRAIN_STEP_TIME_S]:.1%})")


def say_against_gzip(evaluator, result: EvalResult) -> None:
    """At the final evaluation: val bits/byte next to gzip -9 on exactly that text."""
    try:
        ref = gzip_bits_per_byte(evaluator.manifest, evaluator.num_samples,
                                 get_tokenizer(evaluator.manifest.tokenizer,
                                               base=evaluator.manifest.url))
    except Exception as e:  # a yardstick only: never fail a finished run over it
        log.warning("could not compress the validation text for comparison (%s)", e)
        return
    if ref is not None:
        say(f"[elastic-gpt] held-out text ({ref[1]:,} bytes): model {result.bits_per_byte:.3f} "
            f"bits/byte, gzip -9 {ref[0]:.3f} bits/byte")
