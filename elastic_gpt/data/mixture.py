"""What a run trains on: one prepared dataset (`data.path`) or a weighted mixture of several
(`data.sources`), and the mixture's sample order, C2 data order for several sources.

**A mixture epoch** is E = the sum of the sources' sample counts. Source i gets a quota n_i of
those E positions in proportion to its weight (largest-remainder rounding, so the quotas add up
to E exactly), the way Megatron's blended dataset fixes sample counts proportional to weight over
a fixed total. A source whose quota exceeds its size is up-sampled: its samples repeat, each pass
over it reshuffled (its own epochs); one whose quota is smaller is down-sampled: the next mixture
epoch continues where it stopped, so no sample repeats before all of that source were seen.
With weights proportional to the sizes, a mixture epoch is every sample of every source once.

**The interleave** places source i's j-th item of epoch e at key (j + u_i) / n_i, with a
phase u_i in (0, 1) drawn from (seed, e, i), and orders the epoch by key (ties: list order).
Every window of positions then holds each source within one sample of its share (a smooth,
seeded stride, like Megatron's error-minimising blend), and position v of an epoch is found by
a binary search per source in exact integer arithmetic: no index of E entries is built, any
position (any step, at any world size) is computed directly, so a run resumes mid-epoch from
the step number alone. Source i's item j of epoch e is its own run position e * n_i + j, mapped
through that source's `SampleOrder` (seeded from (seed, i)).

Everything is a pure function of (the sources' shard sizes in list order, the weights, the
seed, the epoch). The sources must hold the same kind of tokens (tokenizer, vocabulary, seq_len).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from elastic_gpt.data.manifest import Manifest, check_compatible, load_manifest
from elastic_gpt.data.order import DEFAULT_SHUFFLE_WINDOW, SampleOrder
from elastic_gpt.data.stream import ShardReader

_PHASE_UNITS = 1 << 20  # a phase is r / 2**20 for an integer r in [1, 2**20): exact arithmetic


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


def mixture_quotas(sizes: list[int], weights: list[float]) -> list[int]:
    """Samples of each source in one mixture epoch of sum(sizes) positions: proportional to the
    weights, rounded by largest remainder (ties to the earlier source), summing exactly."""
    total, wsum = sum(sizes), float(sum(weights))
    exact = [total * w / wsum for w in weights]
    quotas = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in by_remainder[:total - sum(quotas)]:
        quotas[i] += 1
    return quotas


def source_seed(seed: int, source: int) -> int:
    """The seed of one source's own sample order inside a mixture."""
    return int(np.random.SeedSequence([int(seed), int(source), 0x6D6978]).generate_state(1)[0])


class MixtureOrder:
    """Run position -> (source, shard, record): the C2 data order of a weighted mixture."""

    def __init__(self, shard_sizes: list[list[int]], weights: list[float], seed: int,
                 window: int = DEFAULT_SHUFFLE_WINDOW):
        self.orders = [SampleOrder(sizes, source_seed(seed, i), window)
                       for i, sizes in enumerate(shard_sizes)]
        self.seed = int(seed)
        self.epoch_samples = sum(o.num_samples for o in self.orders)
        self.quotas = mixture_quotas([o.num_samples for o in self.orders], weights)
        self._phase_cache: dict[int, list[int]] = {}

    def _phases(self, epoch: int) -> list[int]:
        if epoch not in self._phase_cache:
            if len(self._phase_cache) > 8:
                self._phase_cache.clear()
            self._phase_cache[epoch] = [
                1 + int(_rng(self.seed, epoch, 2, i).integers(_PHASE_UNITS - 1))
                for i in range(len(self.orders))]
        return self._phase_cache[epoch]

    def _before(self, r: list[int], i: int, j: int, k: int) -> int:
        """How many of source k's items come before source i's item j in the epoch's order."""
        n, U = self.quotas, _PHASE_UNITS
        # key(k, l) < key(i, j)  <=>  l * U * n_i < (j * U + r_i) * n_k - r_k * n_i  (=: Y)
        y = (j * U + r[i]) * n[k] - r[k] * n[i]
        a = U * n[i]
        if k < i:  # equal keys: the earlier source first
            count = y // a + 1 if y >= 0 else 0
        else:
            count = (y + a - 1) // a if y > 0 else 0
        return min(n[k], count)

    def _rank(self, r: list[int], i: int, j: int) -> int:
        """Position in its epoch of source i's item j."""
        return j + sum(self._before(r, i, j, k) for k in range(len(self.orders))
                       if k != i and self.quotas[k])

    def _counts_before(self, epoch: int, v: int) -> list[int]:
        """Items of each source among the first v positions of an epoch."""
        r = self._phases(epoch)
        counts = []
        for i, n in enumerate(self.quotas):
            lo, hi = 0, n  # the smallest j whose rank is >= v (n: all of them come before)
            while lo < hi:
                mid = (lo + hi) // 2
                if self._rank(r, i, mid) >= v:
                    hi = mid
                else:
                    lo = mid + 1
            counts.append(lo)
        return counts

    def _epoch_sources(self, epoch: int, start: int, stop: int) -> list[tuple[int, int]]:
        """(source, item index within the epoch) for epoch positions [start, stop)."""
        r, n, U = self._phases(epoch), self.quotas, _PHASE_UNITS
        heads = self._counts_before(epoch, start)
        out = []
        for _ in range(start, stop):
            best = None
            for k in range(len(n)):
                if heads[k] >= n[k]:
                    continue
                # key(k, heads[k]) < key(best, heads[best]), compared exactly
                if best is None or (heads[k] * U + r[k]) * n[best] < \
                        (heads[best] * U + r[best]) * n[k]:
                    best = k
            out.append((best, heads[best]))
            heads[best] += 1
        return out

    def samples_at(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(source, shard, record) for run positions [start, stop)."""
        out = []
        p = start
        while p < stop:
            epoch, v = divmod(p, self.epoch_samples)
            end = min(stop - p, self.epoch_samples - v) + v
            for i, j in self._epoch_sources(epoch, v, end):
                q = epoch * self.quotas[i] + j  # the source's own run position
                (shard, record), = self.orders[i].samples_at(q, q + 1)
                out.append((i, shard, record))
            p += end - v
        return out

    def source_counts(self, stop: int) -> list[int]:
        """Samples of each source among run positions [0, stop): the per-source progress."""
        epoch, v = divmod(stop, self.epoch_samples)
        return [epoch * n + c for n, c in zip(self.quotas, self._counts_before(epoch, v))]


class MixtureReader:
    """Verified reads of (source, shard, record) triples, one ShardReader per source."""

    def __init__(self, manifests: list[Manifest], storage_options: dict | None = None,
                 block_records: int = 1, window: int = DEFAULT_SHUFFLE_WINDOW):
        self.readers = [ShardReader(m, storage_options, block_records, window) for m in manifests]
        self.m = manifests[0]

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers)

    def read(self, samples: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        records = np.zeros((len(samples), self.m.record_tokens), np.dtype(self.m.dtype))
        hashes = np.zeros(len(samples), "<u8")
        for s, reader in enumerate(self.readers):
            where = [n for n, x in enumerate(samples) if x[0] == s]
            if where:
                got, h = reader.read([samples[n][1:] for n in where])
                records[where], hashes[where] = got, h
        return records, hashes


@dataclass(frozen=True)
class Source:
    manifest: Manifest
    weight: float
    name: str   # short and unique within the mixture: its metric name


class TrainingData:
    """The training data of a run: `sources` (one for `data.path`), the reference `manifest`
    that fixes tokenizer, vocabulary and seq_len, and the sample order over them."""

    def __init__(self, sources: list[Source], mixture: bool):
        self.sources = tuple(sources)
        self.is_mixture = mixture

    @property
    def manifest(self) -> Manifest:
        return self.sources[0].manifest

    @property
    def manifests(self) -> list[Manifest]:
        return [s.manifest for s in self.sources]

    @property
    def epoch_samples(self) -> int:
        return sum(s.manifest.num_samples for s in self.sources)

    def make_order(self, seed: int, window: int = DEFAULT_SHUFFLE_WINDOW):
        """SampleOrder for one dataset (exactly the order of data.path), MixtureOrder else."""
        if not self.is_mixture:
            return SampleOrder(self.manifest.shard_sizes, seed, window)
        return MixtureOrder([s.manifest.shard_sizes for s in self.sources],
                            [s.weight for s in self.sources], seed, window)

    def make_reader(self, storage_options: dict | None = None, block_records: int = 1,
                    window: int = DEFAULT_SHUFFLE_WINDOW):
        """The reader of this data (block_records, window: see ShardReader)."""
        if not self.is_mixture:
            return ShardReader(self.manifest, storage_options, block_records, window)
        return MixtureReader(self.manifests, storage_options, block_records, window)

    def describe(self) -> dict:
        """What a checkpoint records about the data."""
        if not self.is_mixture:
            return {"url": self.manifest.url}
        return {"url": self.manifest.url, "sources": [
            {"path": s.manifest.url, "weight": s.weight, "name": s.name} for s in self.sources]}


def _source_names(urls: list[str]) -> list[str]:
    names = []
    for i, url in enumerate(urls):
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", url.rstrip("/").rsplit("/", 1)[-1]) or "source"
        names.append(base if [u.rstrip("/").rsplit("/", 1)[-1] for u in urls].count(
            url.rstrip("/").rsplit("/", 1)[-1]) == 1 else f"{i}_{base}")
    return names


def open_training_data(data, storage_options: dict | None = None) -> TrainingData:
    """The training data a `data` config section names (`data.path`, or `data.sources` with
    their weights), every manifest loaded and checked: ValueError naming the source whose
    tokenizer, vocabulary or seq_len differs from the first one's (C6 clear errors)."""
    if not data.sources:
        m = load_manifest(data.path, storage_options)
        return TrainingData([Source(m, 1.0, "data")], mixture=False)
    manifests = [load_manifest(s["path"], storage_options) for s in data.sources]
    for i, m in enumerate(manifests[1:], 1):
        check_compatible(manifests[0], m, f"data.sources[{i}]")
    names = _source_names([m.url for m in manifests])
    return TrainingData([Source(m, float(s.get("weight", 1.0)), name)
                         for m, s, name in zip(manifests, data.sources, names)], mixture=True)


def load_training_manifest(data, storage_options: dict | None = None) -> Manifest:
    """The manifest that fixes vocabulary, seq_len and tokenizer of the run's training data,
    whether `data.path` or `data.sources` (every source checked against it): what the driver's
    preflight, the planner and `tune` derive the model shape from."""
    return open_training_data(data, storage_options).manifest
