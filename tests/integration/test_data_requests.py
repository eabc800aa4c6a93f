"""Data reads in few requests, counted by a real S3-protocol server on loopback (moto): block reads
cut a streamed run's requests per sample at least tenfold, and a tensor-parallel group reads its
batches once, with every batch and fingerprint the same as record-by-record reads."""

from __future__ import annotations

import random

import pytest
import torch

from data_pipelines.tokenize_job import prepare_data
from elastic_gpt.data.order import BatchSplit
from elastic_gpt.data.stream import open_step_stream
from elastic_gpt.testing.gloo import run_gloo

SEED, WINDOW, STEPS = 3, 256, 60
SPLIT = BatchSplit(global_batch_size=16, micro_batch_size=2)
BLOCK_BYTES = 16 << 10  # 126 records of 65 uint16 tokens: each holds many of a rank's samples
URL = "s3://corpus/requests"


@pytest.fixture(scope="module")
def dataset(s3, tmp_path_factory):
    """~4,000 records in a dozen shards, on the loopback server: several shuffle windows."""
    root = tmp_path_factory.mktemp("requests")
    rng = random.Random(0)
    (root / "raw").mkdir()
    for i in range(12):
        (root / "raw" / f"{i:02d}.txt").write_text(
            "".join(rng.choice("abcdefgh \n") for _ in range(22_000)))
    prepare_data(str(root / "raw"), str(root / "ds"), "bytes", 64, engine="local",
                 progress=False, part_bytes=25_000)
    s3.filesystem().put(str(root / "ds") + "/", URL.removeprefix("s3://") + "/", recursive=True)
    return URL


def _batches(url: str, options: dict, rank: int, world: int, block_bytes: int) -> list:
    with open_step_stream(url, batch_split=SPLIT, rank=rank, world_size=world, start_step=0,
                          seed=SEED, shuffle_window=WINDOW, prefetch_steps=0,
                          storage_options=options, read_block_bytes=block_bytes) as stream:
        return [(b.step, b.fingerprint, torch.stack(b.tokens), b.weights)
                for b in (next(stream) for _ in range(STEPS))]


def test_block_reads_cut_requests_per_sample_tenfold_with_the_same_batches(s3, dataset):
    options = s3.storage_options()
    for world in (1, 2):
        counted = {}
        for block_bytes in (0, BLOCK_BYTES):
            s3.reset_requests()
            got = [_batches(dataset, options, rank, world, block_bytes) for rank in range(world)]
            counted[block_bytes] = (sum(s3.requests().values()), got)
        (records_n, by_record), (blocks_n, by_block) = counted[0], counted[BLOCK_BYTES]
        for a, b in zip(by_record, by_block):  # every rank, every step: the same batch
            assert [(s, f, w) for s, f, _, w in a] == [(s, f, w) for s, f, _, w in b]
            assert all(torch.equal(x[2], y[2]) for x, y in zip(a, b))
        samples = STEPS * SPLIT.global_batch_size
        print(f"[data requests] W={world}: {records_n / samples:.3f} requests per sample by "
              f"record, {blocks_n / samples:.3f} by block")
        assert records_n >= 10 * blocks_n, (records_n, blocks_n)


def _group_worker(rank: int, world: int, url: str, options: dict) -> list:
    """dp=2 x tp=2: each tensor-parallel group's first rank reads, the other receives."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.train.group_batches import GroupBroadcastBatches

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    source = None
    if tp_rank == 0:
        source = open_step_stream(url, batch_split=SPLIT, rank=dp_rank, world_size=2,
                                  start_step=0, seed=SEED, shuffle_window=WINDOW,
                                  prefetch_steps=0, storage_options=options,
                                  read_block_bytes=BLOCK_BYTES)
    with GroupBroadcastBatches(source, group=mesh["tp"].get_group(), batch_split=SPLIT,
                               batch_rank=dp_rank, batch_degree=2, record_tokens=65,
                               start_step=0, device=torch.device("cpu")) as batches:
        return [(b.step, b.fingerprint, torch.stack(b.tokens), b.weights)
                for b in (next(batches) for _ in range(STEPS))]


def test_a_tensor_parallel_group_reads_its_batches_once(s3, dataset):
    options = s3.storage_options()
    s3.reset_requests()
    direct = [_batches(dataset, options, dp, 2, BLOCK_BYTES) for dp in range(2)]
    one_reader_each = sum(s3.requests().values())
    s3.reset_requests()
    got = run_gloo(_group_worker, 4, dataset, options)
    # Global rank = dp * 2 + tp. Both ranks of a group have the reader's batches; the fingerprint
    # is counted by the reader alone (the trainer's metrics all-reduce sums it over ranks).
    for rank, batches in enumerate(got):
        want = direct[rank // 2]
        assert [s for s, *_ in batches] == [s for s, *_ in want]
        assert all(torch.equal(x[2], y[2]) and x[3] == y[3] for x, y in zip(batches, want))
        assert [f for _, f, *_ in batches] == ([f for _, f, *_ in want] if rank % 2 == 0
                                                else [0] * STEPS)
    assert sum(s3.requests().values()) == one_reader_each  # two readers for four ranks


class _Recorded:
    """A step stream that keeps the batches it hands out, to compare with what is trained on."""

    def __init__(self, stream):
        self.stream, self.batches = stream, []

    def __next__(self):
        self.batches.append(next(self.stream))
        return self.batches[-1]

    def close(self) -> None:
        self.stream.close()


def test_a_group_reader_sends_its_batch_from_where_it_was_assembled(stdlib_dataset):
    """No host copy per step: the reading rank's batch reaches the device and the broadcast from
    the memory the stream assembled it in (page-locked on a GPU run, where a copy would be
    pageable and its transfer synchronous), padding slots included."""
    import numpy as np

    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.train.group_batches import GroupBroadcastBatches

    split = BatchSplit(global_batch_size=6, micro_batch_size=2)  # rank 1 of 2: one real, one pad
    with gloo_group():
        source = _Recorded(open_step_stream(stdlib_dataset, batch_split=split, rank=1,
                                            world_size=2, start_step=0, seed=SEED,
                                            prefetch_steps=0))
        with GroupBroadcastBatches(source, group=torch.distributed.group.WORLD, batch_split=split,
                                   batch_rank=1, batch_degree=2, record_tokens=65, start_step=0,
                                   device=torch.device("cpu")) as batches:
            got = [next(batches) for _ in range(3)]
    for b, read in zip(got, source.batches):
        assert (b.step, b.weights, b.fingerprint) == (read.step, read.weights, read.fingerprint)
        assert len(b.tokens) == len(read.tokens) == 2
        for mine, theirs in zip(b.tokens, read.tokens):
            assert torch.equal(mine, theirs)
            assert np.shares_memory(mine.numpy(), theirs.numpy()), "a copy of the batch"
