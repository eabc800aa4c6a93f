"""Sample order and its split over ranks: contracts C1 fixed global batch and C2 data order as pure
functions.

C2 data order: the position -> sample map depends only on (shard sizes, seed, epoch). Position p of
the whole run is sample `order.sample_at(p)`; step t trains on positions [t*G, (t+1)*G). The resume
cursor is the number of positions consumed (`samples_seen`); the epoch is `p // num_samples`.

C1 fixed global batch: a step's G samples form M = G / micro_batch_size micro-batches; data-parallel
rank r of D takes a contiguous block of them (block sizes differ by at most one; the tensor-parallel
ranks of one group are one data-parallel rank). Every rank runs the same number of slots, ceil(M /
D), so collectives line up; a rank with one micro-batch fewer fills its last slot with a
zero-weight repeat. Wall time is unchanged by that: the step waits for the busiest rank anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

DEFAULT_SHUFFLE_WINDOW = 16384  # samples: ~33 MB of gpt2 tokens at seq_len 1024, a few shards
DEFAULT_READ_BLOCK_BYTES = 1 << 20  # per ranged read of the step stream (data/stream.py)


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


class SampleOrder:
    """Seeded two-level shuffle: shard order per epoch, then samples within windows.

    The windowed shuffle (rather than one permutation of all samples) keeps memory O(window) for
    corpora of billions of samples and keeps each window's reads within a few shards.
    """

    def __init__(self, shard_sizes: list[int], seed: int, window: int = DEFAULT_SHUFFLE_WINDOW,
                 shuffle: bool = True):
        if not shard_sizes or sum(shard_sizes) == 0:
            raise ValueError("the dataset has no samples; re-run prepare-data on a non-empty corpus")
        self.shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.num_samples = int(self.shard_sizes.sum())
        self.seed = int(seed)
        self.window = int(window)
        self.shuffle = shuffle
        self._window_cache = lru_cache(maxsize=8)(self._window_perm)
        self._layout_cache = lru_cache(maxsize=4)(self._epoch_layout)

    def _epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard order of an epoch and the cumulative sample offsets in that order."""
        order = _rng(self.seed, epoch, 0).permutation(len(self.shard_sizes)) if self.shuffle \
            else np.arange(len(self.shard_sizes))
        starts = np.concatenate([[0], np.cumsum(self.shard_sizes[order])])
        return order, starts

    def _window_perm(self, epoch: int, w: int) -> np.ndarray:
        n = min(self.window, self.num_samples - w * self.window)
        return _rng(self.seed, epoch, 1, w).permutation(n) if self.shuffle else np.arange(n)

    def samples_at(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(shard index, sample index within shard) for run positions [start, stop)."""
        out = []
        for p in range(start, stop):
            epoch, v = divmod(p, self.num_samples)
            w, offset = divmod(v, self.window)
            v = w * self.window + int(self._window_cache(epoch, w)[offset])
            order, starts = self._layout_cache(epoch)
            k = int(np.searchsorted(starts, v, side="right")) - 1
            out.append((int(order[k]), int(v - starts[k])))
        return out


@dataclass(frozen=True)
class BatchSplit:
    """How one step's global batch is cut into micro-batches and spread over ranks (C1 fixed global
    batch)."""

    global_batch_size: int
    micro_batch_size: int

    def __post_init__(self):
        G, m = self.global_batch_size, self.micro_batch_size
        if G <= 0 or m <= 0:
            raise ValueError("train.global_batch_size and train.micro_batch_size must be positive")
        if G % m:
            raise ValueError(
                f"train.global_batch_size={G} is not a multiple of train.micro_batch_size={m}; "
                f"use a micro-batch size that divides it (e.g. {_largest_divisor_at_most(G, m)})"
            )

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def check_world_size(self, max_workers: int, tp: int = 1) -> None:
        """Every data-parallel rank (a group of `tp` workers) needs a micro-batch (C1 fixed global
        batch)."""
        dp = max_workers // tp
        if self.num_micro_batches < dp:
            ranks = (f"scaling.max_workers={max_workers}" if tp == 1 else
                     f"the {dp} data-parallel ranks of scaling.max_workers={max_workers} / "
                     f"parallel.tp={tp}")
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} / train.micro_batch_size="
                f"{self.micro_batch_size} gives {self.num_micro_batches} micro-batches, fewer than "
                f"{ranks}: every data-parallel rank needs one; lower train.micro_batch_size or "
                "scaling.max_workers"
            )

    def slots(self, world_size: int) -> int:
        """Micro-batch slots every rank runs per step: ceil(M / W)."""
        return -(-self.num_micro_batches // world_size)

    def rank_micro_batches(self, rank: int, world_size: int) -> range:
        """Indices (0..M-1) of the micro-batches rank `rank` trains on."""
        M = self.num_micro_batches
        return range(rank * M // world_size, (rank + 1) * M // world_size)

    def micro_batch_positions(self, step: int, j: int) -> range:
        """Run positions of micro-batch j of step `step`."""
        start = step * self.global_batch_size + j * self.micro_batch_size
        return range(start, start + self.micro_batch_size)


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)
