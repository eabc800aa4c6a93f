"""Held-out evaluation: `val/loss`, `val/perplexity` and `val/bits_per_byte` on a fixed set of
validation sequences, the same set at any world size.

The set is the first `eval.samples` records of the validation dataset, in stored order. The
data-parallel ranks split it in contiguous blocks (differing by at most one sequence, as C1 fixed
global batch splits a step), and the tensor-parallel ranks of a group read the same block. Every
rank runs the same number of forwards, a rank with fewer sequences padding with zero-weight ones, so
FSDP's all-gathers pair up. The sums of token losses, target tokens and the bytes behind them
are all-reduced once, so the result is the same at any W up to float reduction order.

bits per byte = summed loss in nats / (ln 2 * UTF-8 bytes of the target tokens): the loss a
tokenizer-independent measure, comparable with a compressor's output size (end-of-text stands
for no text and counts 0 bytes). It needs the dataset's byte table (manifest version 2).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from elastic_gpt.data.manifest import Manifest
from elastic_gpt.data.stream import ShardReader
from elastic_gpt.parallel.tensor import summed_token_loss
from elastic_gpt.tracking import metric_names as mn


@dataclass(frozen=True)
class EvalResult:
    loss: float                   # mean nats per target token
    bits_per_byte: float | None   # None: the dataset has no byte counts (manifest version 1)
    tokens: int
    text_bytes: int | None
    samples: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows a float past ~709

    def metrics(self) -> dict[str, float]:
        out = {mn.VAL_LOSS: self.loss, mn.VAL_PERPLEXITY: self.perplexity}
        if self.bits_per_byte is not None:
            out[mn.VAL_BITS_PER_BYTE] = self.bits_per_byte
        return out

    def line(self, step: int) -> str:
        """`step`: optimizer steps done, the numbering of the metrics and checkpoint folders."""
        bpb = f"{self.bits_per_byte:.4f}" if self.bits_per_byte is not None else "n/a"
        return (f"[elastic-gpt] eval after step {step} | val loss {self.loss:.4f} | "
                f"perplexity {self.perplexity:,.2f} | bits/byte {bpb} | {self.samples} "
                f"sequences, {self.tokens:,} tokens | {self.seconds:.2f}s")


def eval_block(num_samples: int, dp_rank: int, dp_degree: int) -> range:
    """The validation sequences (indices into the evaluated set) data-parallel rank r reads."""
    return range(dp_rank * num_samples // dp_degree, (dp_rank + 1) * num_samples // dp_degree)


def first_records(manifest: Manifest, n: int) -> list[tuple[int, int]]:
    """(shard, record) of the first n records of a dataset, in stored order."""
    out: list[tuple[int, int]] = []
    for k, shard in enumerate(manifest.shards):
        take = min(shard.num_samples, n - len(out))
        out.extend((k, i) for i in range(take))
        if len(out) == n:
            break
    return out


class Evaluator:
    """One rank's share of the evaluation set, read once and kept (it is small), and the
    collective that evaluates a model on it."""

    def __init__(self, manifest: Manifest, *, samples: int, micro_batch_size: int, seq_len: int,
                 dp_rank: int, dp_degree: int, count_rank: bool, device: torch.device,
                 storage_options: dict | None = None):
        self.manifest = manifest
        self.num_samples = min(samples, manifest.num_samples)
        self.seq_len, self.device, self.count_rank = seq_len, device, count_rank
        mine = eval_block(self.num_samples, dp_rank, dp_degree)
        records = first_records(manifest, self.num_samples)[mine.start:mine.stop]
        tokens, _ = ShardReader(manifest, storage_options).read(records)
        tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        table = manifest.load_token_bytes(storage_options)
        self.has_byte_counts = table is not None
        # Every rank runs as many forwards as the rank with the largest block needs.
        largest = -(-self.num_samples // dp_degree)
        self.slots = max(1, -(-largest // micro_batch_size))
        self.batches: list[tuple[torch.Tensor, float, int]] = []
        for j in range(self.slots):
            chunk = tokens[j * micro_batch_size:(j + 1) * micro_batch_size]
            if len(chunk):
                targets = chunk[:, 1:seq_len + 1]
                nbytes = int(table[targets.numpy()].sum()) if table is not None else 0
                self.batches.append((chunk, 1.0, nbytes))
            else:  # a zero-weight forward keeps this rank's collectives paired with the others'
                self.batches.append((torch.zeros(1, seq_len + 1, dtype=torch.int64), 0.0, 0))

    def _through(self, pipeline, compute_dtype: torch.dtype, loss_parallel: bool):
        """(summed loss, tokens, text bytes) of this rank's share through the pipeline's
        stages: its schedule's micro-batch count of chunks per call, each padded to the
        micro-batch size with rows whose targets are ignored (the schedule's shapes are the
        training step's)."""
        from elastic_gpt.parallel.pipeline import IGNORED

        T, rows, per_call = self.seq_len, pipeline.micro_batch_rows, pipeline.micro_batches
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = text_bytes = 0
        for start in range(0, len(self.batches), per_call):
            x = torch.zeros(per_call * rows, T, dtype=torch.int64)
            y = torch.full((per_call * rows, T), IGNORED, dtype=torch.int64)
            for k, (chunk, weight, nbytes) in enumerate(self.batches[start:start + per_call]):
                if weight:
                    n = chunk.size(0)
                    x[k * rows:k * rows + n] = chunk[:, :T]
                    y[k * rows:k * rows + n] = chunk[:, 1:T + 1]
                    tokens += n * T
                    text_bytes += nbytes
            loss_sum += pipeline.evaluate(x, y, compute_dtype, loss_parallel, self.device)
        return loss_sum, tokens, text_bytes

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, *, compute_dtype: torch.dtype,
                 loss_parallel: bool, pipeline=None) -> EvalResult:
        """Collective over every rank of the group: all call it at the same step. `pipeline`
        (parallel/pipeline.py's `Pipeline`): the model's stages run it, a step's worth of
        micro-batches at a time."""
        t0 = time.perf_counter()
        T = self.seq_len
        was_training = model.training
        model.eval()  # no dropout
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = text_bytes = 0
        try:
            if pipeline is not None:
                loss_sum, tokens, text_bytes = self._through(pipeline, compute_dtype,
                                                             loss_parallel)
            for chunk, weight, nbytes in self.batches if pipeline is None else ():
                chunk = chunk.to(self.device, non_blocking=True)
                x, y = chunk[:, :T], chunk[:, 1:T + 1]
                # The training step's loss, without its backward.
                with summed_token_loss(model, x, y, compute_dtype=compute_dtype,
                                       vocab_sharded=loss_parallel) as summed:
                    pass
                if isinstance(summed, DTensor):
                    summed = summed.to_local()
                loss_sum += summed.double() * weight
                tokens += int(weight) * y.numel()
                text_bytes += nbytes
        finally:
            release_gathered_weights(model)
            model.train(was_training)
        # The tensor-parallel ranks of a group evaluated the same sequences: one of them counts.
        if not self.count_rank:
            loss_sum.zero_()
            tokens = text_bytes = 0
        stats = torch.tensor([0.0, tokens, text_bytes], dtype=torch.float64, device=self.device)
        stats[0] = loss_sum
        dist.all_reduce(stats)
        total_loss, total_tokens, total_bytes = stats.tolist()
        loss = total_loss / total_tokens
        bpb = total_loss / (math.log(2) * total_bytes) \
            if self.has_byte_counts and total_bytes > 0 else None
        return EvalResult(loss=loss, bits_per_byte=bpb, tokens=int(total_tokens),
                          text_bytes=int(total_bytes) if self.has_byte_counts else None,
                          samples=self.num_samples, seconds=time.perf_counter() - t0)


def open_evaluator(cfg, manifest: Manifest, *, micro_batch_size: int, seq_len: int, dp_rank: int,
                   dp_degree: int, count_rank: bool, rank: int, world_size: int,
                   device: torch.device) -> Evaluator | None:
    """Collective. The held-out set (eval.path, else <data.path>/val when prepare-data wrote
    one), or None: eval.samples=0, or no validation set. `count_rank`: this rank's loss counts
    (one rank of each tensor-parallel group, of a pipeline the last stage's)."""
    from elastic_gpt.console import say
    from elastic_gpt.data.manifest import open_validation_manifest

    ev = cfg.eval
    if not ev.samples:
        return None
    val = open_validation_manifest(ev.path, cfg.data.path, manifest)
    # Evaluation is collective: a rank that cannot see the validation set (a local path on
    # another node) must stop the group, not leave the others waiting in its all-gathers.
    seen = torch.tensor([float(val is not None)], device=device)
    dist.all_reduce(seen)
    if 0 < seen.item() < world_size:
        raise ValueError(f"the validation set {val.url if val else cfg.data.path + '/val'}"
                         f" is visible to {int(seen.item())} of {world_size} workers; "
                         "put it on storage every node reads (s3://, gs://, a shared "
                         "filesystem), or set eval.samples=0")
    if val is None:
        if rank == 0:
            why = (f"no validation set at {cfg.data.path}/val; prepare one with "
                   "prepare-data --val-fraction or --val-docs, or set eval.path"
                   if cfg.data.path else
                   "a mixture (data.sources) has no single validation split; set eval.path")
            say(f"[elastic-gpt] no evaluation: {why}")
        return None
    evaluator = Evaluator(val, samples=ev.samples, micro_batch_size=micro_batch_size,
                          seq_len=seq_len, dp_rank=dp_rank, dp_degree=dp_degree,
                          count_rank=count_rank, device=device)
    if rank == 0 and not evaluator.has_byte_counts:
        say(f"[elastic-gpt] val/bits_per_byte unavailable: {val.url} has no byte counts "
            f"(manifest version {val.version}, or a tokenizer without fixed token bytes); "
            "re-run prepare-data to get them")
    return evaluator


def gzip_bits_per_byte(manifest: Manifest, samples: int, tokenizer,
                       storage_options: dict | None = None) -> tuple[float, int] | None:
    """gzip -9's bits per byte on the text of the evaluated sequences, and that text's size:
    the yardstick a model's val bits/byte is printed next to (a model that cannot beat a
    general-purpose compressor on held-out text has not learnt much). The records' target
    tokens are consecutive text, so decoding them in order gives that text back."""
    import gzip

    records = first_records(manifest, min(samples, manifest.num_samples))
    if not records:
        return None
    tokens, _ = ShardReader(manifest, storage_options).read(records)
    ids = [int(t) for t in np.asarray(tokens)[:, 1:].reshape(-1) if int(t) != manifest.eos_id]
    text = tokenizer.decode(ids).encode("utf-8")
    if not text:
        return None
    return 8 * len(gzip.compress(text, compresslevel=9)) / len(text), len(text)


def release_gathered_weights(model: torch.nn.Module) -> None:
    """Reshard every FSDP module: a forward without backward leaves the weights gathered where
    reshard_after_forward is off (and always for the root), and the next training step must
    gather the weights the optimizer updates, with its usual memory and collectives."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
