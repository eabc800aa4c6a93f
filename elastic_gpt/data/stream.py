"""Per-rank streaming reader: step t of rank r, read from the shards in the C2 data order.

Each rank computes which samples its micro-batches of step t hold (`BatchSplit` + `SampleOrder`,
pure functions of manifest, seed and position) and reads them with ranged reads, all requests of a
step issued together (`fs.cat_ranges`: concurrent on object stores). A background thread keeps
`prefetch_steps` steps ready. Nothing is shared between ranks and the only resume state is the step
number, so any world size can resume any step (see docs/data.md for why this is not
`streaming_split`).

Two read granularities (`read_block_records`):
- blocks (the default): aligned blocks of a shard, each read once and kept while the shuffle
  window still draws from it, and each shard's whole index read once. An object store bills and
  rate-limits requests, not bytes, and a windowed shuffle draws each rank's samples from a few
  shards' worth of records: requests fall from ~2 per sample to ~D per block of B records (D the
  ranks splitting a step), at the price of each rank reading its window's blocks whole;
- records: exactly this rank's records (adjacent ones coalesced) and their index entries, the
  fewest bytes at ~2 requests per sample; chosen where a block would hold few of a rank's samples.

Integrity: a shard's sizes are checked when it is first used, and every record read is checked
against its `.idx` entry (one sample_hash per record). The verified hashes are also the data
fingerprint, so checking costs nothing extra.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

import fsspec
import numpy as np
import torch

from elastic_gpt.data.fingerprint import FINGERPRINT_MASK, sample_hash, sample_hashes
from elastic_gpt.data.manifest import Manifest, describe_storage_error, load_manifest
from elastic_gpt.data.order import DEFAULT_READ_BLOCK_BYTES, DEFAULT_SHUFFLE_WINDOW, BatchSplit, SampleOrder
from elastic_gpt.data.skips import DataSkips
from elastic_gpt.errors import FatalTrainingError

__all__ = ["StepBatch", "StepStream", "open_step_stream", "sample_hash", "CorruptShardError",
           "ShardReader", "DEFAULT_SHUFFLE_WINDOW", "DEFAULT_READ_BLOCK_BYTES", "read_block_records"]

# Blocks only pay where each holds several of a rank's samples: with fewer, a rank reads B records
# to use under BLOCK_MIN_OWN of them, and requests fall less than bytes grow.
BLOCK_MIN_OWN = 4


def read_block_records(block_bytes: int, record_bytes: int, readers: int) -> int:
    """Records per ranged read for a rank of `readers` splitting each step: `block_bytes` worth,
    or 1 (record reads) when blocks are off (0) or would hold under BLOCK_MIN_OWN of this rank's
    records on average (a rank uses 1 / readers of a window's records)."""
    records = block_bytes // record_bytes
    return records if records >= BLOCK_MIN_OWN * max(1, readers) and records > 1 else 1


class CorruptShardError(FatalTrainingError, ValueError):
    """A shard (or its index) does not match the manifest: re-run prepare-data. No retry reads
    different bytes, so the run stops at once."""


@dataclass
class StepBatch:
    """One rank's batch of one step. Its real micro-batches are one allocation, `real_tokens`
    (page-locked for a GPU), of which `tokens`' real slots are views: the step reaches the device,
    or a group's broadcast, in one copy and with no stacking on the host."""

    step: int
    tokens: list[torch.Tensor]   # one int64 (micro_batch_size, seq_len + 1) tensor per slot
    weights: list[float]         # 1.0 real micro-batch, 0.0 zero-weight padding repeat
    fingerprint: int             # sum of sample_hash over this rank's real samples, mod 2**52
    real_tokens: torch.Tensor    # int64 (real slots, micro_batch_size, seq_len + 1)


class ShardReader:
    """Verified ranged reads of records from the shards of one dataset."""

    def __init__(self, manifest: Manifest, storage_options: dict | None = None,
                 block_records: int = 1, window: int = DEFAULT_SHUFFLE_WINDOW):
        """block_records > 1: read aligned blocks of that many records and keep the blocks the
        shuffle `window` can still draw from (those of one window, plus one partial block per
        shard it crosses); 1: read records alone."""
        self.m = manifest
        self.block_records = max(1, int(block_records))
        smallest = max(1, min((s.num_samples for s in manifest.shards), default=1))
        self._cache_blocks = (math.ceil(window / self.block_records)
                              + math.ceil(window / smallest) + 3)
        self._blocks: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._indexes: dict[int, np.ndarray] = {}  # whole .idx of shards with cached blocks
        try:
            self.fs, _ = fsspec.core.url_to_fs(manifest.url, **(storage_options or {}))
        except Exception as e:
            raise ValueError(describe_storage_error(manifest.url, e)) from None
        self._paths = [self.fs._strip_protocol(manifest.shard_url(k))
                       for k in range(len(manifest.shards))]
        self._index_paths = [self.fs._strip_protocol(manifest.index_url(k))
                             for k in range(len(manifest.shards))]
        self._checked_size: set[int] = set()
        self.data_bytes_read = 0   # record bytes
        self.index_bytes_read = 0  # .idx bytes (8 per record of every shard touched)

    @property
    def bytes_read(self) -> int:
        return self.data_bytes_read + self.index_bytes_read

    @property
    def cached_bytes(self) -> int:
        """What the reader holds between reads: its cached blocks (records and hashes) and the
        whole indexes of their shards."""
        return (sum(rec.nbytes + h.nbytes for rec, h in self._blocks.values())
                + sum(index.nbytes for index in self._indexes.values()))

    def _check_sizes(self, k: int, index: bool = True) -> None:
        """On first use of a shard: its .bin (and .idx, unless it is read whole, which checks
        its size) have the sizes the manifest promises."""
        if k in self._checked_size:
            return
        info = self.m.shards[k]
        files = [(self._paths[k], info.num_bytes)]
        if index:
            files.append((self._index_paths[k], 8 * info.num_samples))
        for path, want in files:
            name = path.rsplit("/", 1)[-1]
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                raise CorruptShardError(f"{name} is missing from {self.m.url}; the dataset is "
                                        "incomplete, re-run prepare-data") from None
            except Exception as e:
                raise ValueError(describe_storage_error(self.m.shard_url(k), e)) from None
            if size != want:
                raise CorruptShardError(
                    f"shard file {name} of {self.m.url} has {size} bytes, the manifest says "
                    f"{want}: it is truncated or replaced; re-run prepare-data")
        self._checked_size.add(k)

    def read(self, samples: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Records (n, seq_len + 1) and their verified hashes for (shard, sample) pairs, in the
        order given."""
        if self.block_records > 1:
            return self._read_blocks(samples)
        return self._read_records(samples)

    def _fetch(self, paths: list[str], starts: list[int], ends: list[int],
               urls: list[str]) -> list:
        """One batch of concurrent ranged reads; a failed one is named by its file's URL."""
        try:
            blobs = self.fs.cat_ranges(paths, starts, ends) if paths else []
        except Exception as e:
            raise ValueError(describe_storage_error(self.m.url, e)) from None
        for url, b in zip(urls, blobs):
            if isinstance(b, Exception):
                raise ValueError(describe_storage_error(url, b))
        return blobs

    def _verify(self, k: int, s: int, rec: np.ndarray, want: np.ndarray) -> np.ndarray:
        """The hashes of records s.. of shard k, checked against their index entries."""
        got = sample_hashes(rec)
        bad = np.nonzero(got != want)[0]
        if len(bad):
            r = s + int(bad[0])
            rb = self.m.record_bytes
            raise CorruptShardError(
                f"shard {self.m.shards[k].path} of {self.m.url}: record {r} (bytes "
                f"{r * rb}..{(r + 1) * rb - 1}) does not match its checksum in "
                f"{self.m.shards[k].index_path}; the shard is corrupt, re-run prepare-data")
        return got

    def _short_read(self, k: int, s: int, n: int) -> CorruptShardError:
        return CorruptShardError(
            f"shard {self.m.shards[k].path} of {self.m.url}: short read at records "
            f"{s}..{s + n - 1}; the shard changed while reading? re-run prepare-data")

    def _read_blocks(self, samples: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Block granularity: the missing blocks of this call (consecutive ones of a shard in one
        request) and the whole index of each shard not yet held, in one batch of requests."""
        B, rb = self.block_records, self.m.record_bytes
        wanted = sorted({(k, s // B) for k, s in samples})
        missing = [kb for kb in wanted if kb not in self._blocks]
        runs: list[tuple[int, int, int]] = []  # (shard, first block, blocks)
        for k, b in missing:
            if runs and runs[-1][0] == k and runs[-1][1] + runs[-1][2] == b:
                runs[-1] = (k, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((k, b, 1))
        new_indexes = sorted({k for k, _, _ in runs} - set(self._indexes))
        for k in {k for k, _, _ in runs}:
            self._check_sizes(k, index=False)
        sizes = [self.m.shards[k].num_samples for k in range(len(self.m.shards))]
        spans = [(k, b * B, min((b + n) * B, sizes[k])) for k, b, n in runs]  # records
        blobs = self._fetch(
            [self._paths[k] for k, _, _ in spans] + [self._index_paths[k] for k in new_indexes],
            [lo * rb for _, lo, _ in spans] + [0] * len(new_indexes),
            [hi * rb for _, _, hi in spans] + [8 * sizes[k] for k in new_indexes],
            [self.m.shard_url(k) for k, _, _ in spans] + [self.m.index_url(k) for k in new_indexes])
        for k, iblob in zip(new_indexes, blobs[len(spans):]):
            if len(iblob) != 8 * sizes[k]:
                raise CorruptShardError(
                    f"shard index {self.m.shards[k].index_path} of {self.m.url} has {len(iblob)} "
                    f"bytes, the manifest says {8 * sizes[k]}: it is truncated or replaced; "
                    "re-run prepare-data")
            self.index_bytes_read += len(iblob)
            self._indexes[k] = np.frombuffer(iblob, dtype="<u8")
        dtype = np.dtype(self.m.dtype).newbyteorder("<")
        for (k, lo, hi), blob in zip(spans, blobs):
            if len(blob) != (hi - lo) * rb:
                raise self._short_read(k, lo, hi - lo)
            self.data_bytes_read += len(blob)
            rec = np.frombuffer(blob, dtype=dtype).reshape(hi - lo, self.m.record_tokens)
            hashes = self._verify(k, lo, rec, self._indexes[k][lo:hi])
            for start in range(lo, hi, B):
                # A copy per block: a view would keep the run's whole blob alive until the
                # last block of it is evicted, and the cache's bound would not bound its bytes.
                self._blocks[(k, start // B)] = (rec[start - lo:start - lo + B].copy(),
                                                 hashes[start - lo:start - lo + B].copy())
        records = np.empty((len(samples), self.m.record_tokens), dtype)
        hashes = np.empty(len(samples), "<u8")
        for n, (k, s) in enumerate(samples):
            rec, h = self._blocks[(k, s // B)]
            records[n], hashes[n] = rec[s % B], h[s % B]
        for kb in wanted:  # used now: the last to be dropped
            self._blocks.move_to_end(kb)
        while len(self._blocks) > max(self._cache_blocks, len(wanted)):
            self._blocks.popitem(last=False)
        held = {k for k, _ in self._blocks}
        for k in [k for k in self._indexes if k not in held]:
            del self._indexes[k]
        return records, hashes

    def _read_records(self, samples: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Record granularity: each distinct record once, adjacent records in one request, and
        the index entries of exactly the same runs."""
        unique = sorted(set(samples))
        paths, starts, ends, runs = [], [], [], []
        rb = self.m.record_bytes
        i = 0
        while i < len(unique):  # coalesce runs of consecutive records of one shard
            k, s = unique[i]
            j = i + 1
            while j < len(unique) and unique[j] == (k, s + (j - i)):
                j += 1
            paths.append(self._paths[k])
            starts.append(s * rb)
            ends.append((s + j - i) * rb)
            runs.append((k, s, j - i))
            i = j
        for k in {k for k, _, _ in runs}:
            self._check_sizes(k)
        # The index entries of exactly the same runs (8 bytes per record), in the same batch of
        # concurrent requests: reading whole indexes would cost every rank 8 bytes per record
        # of the dataset, a world-size-fold over-read.
        n_runs = len(runs)
        paths += [self._index_paths[k] for k, _, _ in runs]
        starts += [8 * s for _, s, _ in runs]
        ends += [8 * (s + n) for _, s, n in runs]
        blobs = self._fetch(paths, starts, ends,
                            [self.m.shard_url(k) for k, _, _ in runs]
                            + [self.m.index_url(k) for k, _, _ in runs])
        dtype = np.dtype(self.m.dtype).newbyteorder("<")
        parts, hashes = [], []
        for (k, s, n), blob, iblob in zip(runs, blobs[:n_runs], blobs[n_runs:]):
            if len(blob) != n * rb or len(iblob) != 8 * n:
                raise self._short_read(k, s, n)
            self.data_bytes_read += len(blob)
            self.index_bytes_read += len(iblob)
            rec = np.frombuffer(blob, dtype=dtype).reshape(n, self.m.record_tokens)
            parts.append(rec)
            hashes.append(self._verify(k, s, rec, np.frombuffer(iblob, dtype="<u8")))
        if not parts:
            return np.zeros((0, self.m.record_tokens), dtype), np.zeros(0, "<u8")
        allrec, allhash = np.concatenate(parts), np.concatenate(hashes)
        where = {key: n for n, key in enumerate(unique)}
        take = np.fromiter((where[x] for x in samples), dtype=np.int64, count=len(samples))
        return allrec[take], allhash[take]


def rank_samples(order: SampleOrder, batch_split: BatchSplit, rank: int, world_size: int,
                 step: int) -> list[tuple[int, int]]:
    """(shard, record) of every sample rank `rank` trains on at `step`, micro-batch by
    micro-batch: the C1 fixed global batch split of the C2 data order."""
    samples = []
    for j in batch_split.rank_micro_batches(rank, world_size):
        pos = batch_split.micro_batch_positions(step, j)
        samples.extend(order.samples_at(pos.start, pos.stop))
    return samples


def assemble_step(step: int, records: np.ndarray, hashes: np.ndarray, batch_split: BatchSplit,
                  rank: int, world_size: int, pin_memory: bool = False) -> StepBatch:
    """StepBatch from the rank's records (in rank_samples order) and their hashes."""
    n_real = len(batch_split.rank_micro_batches(rank, world_size))
    m = batch_split.micro_batch_size
    wide = torch.from_numpy(np.ascontiguousarray(records, dtype=np.int64))
    if pin_memory:  # page-locked: the copy to the GPU is a real async DMA, not a staged memcpy
        wide = wide.pin_memory()
    real = wide.view(n_real, m, wide.shape[-1])
    tokens = list(real.unbind(0))
    weights = [1.0] * n_real
    for _ in range(batch_split.slots(world_size) - n_real):
        # A zero-weight repeat keeps the collectives in step (C1 fixed global batch).
        tokens.append(tokens[-1])
        weights.append(0.0)
    fingerprint = int(sum(int(h) for h in hashes)) & FINGERPRINT_MASK
    return StepBatch(step=step, tokens=tokens, weights=weights, fingerprint=fingerprint,
                     real_tokens=real)


class StepStream:
    """Iterator of StepBatch for steps start_step, start_step + 1, ... (endless: epochs go on,
    epoch = position // num_samples), produced by a prefetch thread."""

    def __init__(self, manifest, *, batch_split: BatchSplit, rank: int, world_size: int,
                 start_step: int, seed: int, shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
                 prefetch_steps: int = 4, storage_options: dict | None = None,
                 pin_memory: bool = False, read_block_bytes: int = DEFAULT_READ_BLOCK_BYTES,
                 skips: DataSkips = DataSkips()):
        """`manifest`: one dataset's Manifest, or a run's TrainingData (elastic_gpt/data/
        mixture.py: one dataset or a weighted mixture), which brings its own order and reader.
        `read_block_bytes`: the size of a ranged read (see `read_block_records`).
        `skips`: steps of the order the run leaves out (data/skips.py); a batch keeps the run's
        step number."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if batch_split.num_micro_batches < world_size:
            batch_split.check_world_size(world_size)
        self.batch_split, self.rank, self.world_size = batch_split, rank, world_size
        reference = manifest if isinstance(manifest, Manifest) else manifest.manifest
        block = read_block_records(read_block_bytes, reference.record_bytes, world_size)
        if isinstance(manifest, Manifest):
            self.order = SampleOrder(manifest.shard_sizes, seed, shuffle_window)
            self.reader = ShardReader(manifest, storage_options, block, shuffle_window)
        else:
            self.order = manifest.make_order(seed, shuffle_window)
            self.reader = manifest.make_reader(storage_options, block, shuffle_window)
            manifest = manifest.manifest
        self.manifest = manifest
        self.next_step = start_step
        self.pin_memory = pin_memory
        self.skips = skips
        self._stop = threading.Event()
        self._thread = None
        if prefetch_steps > 0:  # 0: build each step in __next__ (debugging, exact byte counts)
            self._queue: queue.Queue = queue.Queue(maxsize=prefetch_steps)
            self._thread = threading.Thread(target=self._produce, args=(start_step,),
                                            daemon=True, name=f"step-stream-r{rank}")
            self._thread.start()

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def build_step(self, step: int) -> StepBatch:
        """Read and assemble one step's batch for this rank (what the thread runs)."""
        samples = rank_samples(self.order, self.batch_split, self.rank, self.world_size,
                               self.skips.data_step(step))
        records, hashes = self.reader.read(samples)
        return assemble_step(step, records, hashes, self.batch_split, self.rank, self.world_size,
                             self.pin_memory)

    def _produce(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = self.build_step(step)
            except BaseException as e:  # handed to the consumer, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            step += 1

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        if self._stop.is_set():
            raise StopIteration
        if self._thread is None:
            item = self.build_step(self.next_step)
            self.next_step += 1
            return item
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data prefetch thread stopped") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.next_step = item.step + 1
        return item

    def close(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def open_step_stream(data_url, *, batch_split: BatchSplit, rank: int, world_size: int,
                     start_step: int, seed: int, shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
                     prefetch_steps: int = 4, storage_options: dict | None = None,
                     pin_memory: bool = False,
                     read_block_bytes: int = DEFAULT_READ_BLOCK_BYTES,
                     skips: DataSkips = DataSkips()) -> StepStream:
    """Open rank `rank`'s stream of step batches from `start_step` on (C1 fixed global batch + C2
    data order).
    data_url: a dataset URL, or a TrainingData (`mixture.open_training_data(cfg.data)`: a
    dataset or a weighted mixture of several).
    The reads are ranged reads in a prefetch thread of this process.
    pin_memory: batches in page-locked memory (CUDA training; pinned while prefetching, off the
    training thread).
    read_block_bytes: bytes per ranged read (0: record reads).
    skips: steps of the order the run leaves out (data/skips.py)."""
    if isinstance(data_url, str):
        manifest = load_manifest(data_url, storage_options)
    elif isinstance(data_url, Manifest) or not data_url.is_mixture:
        manifest = data_url if isinstance(data_url, Manifest) else data_url.manifest
    else:
        return StepStream(data_url, batch_split=batch_split, rank=rank, world_size=world_size,
                          start_step=start_step, seed=seed, shuffle_window=shuffle_window,
                          prefetch_steps=prefetch_steps, storage_options=storage_options,
                          pin_memory=pin_memory, read_block_bytes=read_block_bytes, skips=skips)
    return StepStream(manifest, batch_split=batch_split, rank=rank, world_size=world_size,
                      start_step=start_step, seed=seed, shuffle_window=shuffle_window,
                      prefetch_steps=prefetch_steps, storage_options=storage_options,
                      pin_memory=pin_memory, read_block_bytes=read_block_bytes, skips=skips)


def read_shard_stream(manifest: Manifest, k: int, storage_options: dict | None = None
                      ) -> np.ndarray:
    """Shard k's token stream as written (records overlap by one token), for decoding back."""
    n = manifest.shards[k].num_samples
    reader = ShardReader(manifest, storage_options, block_records=max(1, n), window=n)
    records, _ = reader.read([(k, i) for i in range(n)])
    if not len(records):
        return np.zeros(0, np.int64)
    return np.concatenate([records[0].astype(np.int64)] +
                          [r[1:].astype(np.int64) for r in records[1:]])


def decode_documents(manifest: Manifest, storage_options: dict | None = None) -> list[str]:
    """Every document of the dataset, in input order (trailing padding dropped): the round trip
    of prepare-data for text the tokenizer round-trips."""
    from elastic_gpt.data.tokenizers import get_tokenizer

    tok = get_tokenizer(manifest.tokenizer, base=manifest.url)
    docs = []
    for k, info in enumerate(manifest.shards):
        stream = read_shard_stream(manifest, k, storage_options)
        stream = stream[:len(stream) - info.pad_tokens]  # every document ends with end-of-text
        start = 0
        for c in np.nonzero(stream == manifest.eos_id)[0]:
            docs.append(tok.decode(stream[start:c]))
            start = c + 1
    return docs
