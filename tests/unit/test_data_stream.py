"""The step stream: C2 data order for any world size, resume at another size, integrity, S3."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from elastic_gpt.data.fingerprint import sample_hash
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.order import BatchSplit, SampleOrder
from elastic_gpt.data.stream import CorruptShardError, ShardReader, open_step_stream
from tests.step_streams import SEED, WINDOW, run_positions


def all_records(url) -> np.ndarray:
    """Every stored record, read with numpy straight from the shard files."""
    m = load_manifest(url)
    return np.concatenate([np.fromfile(f"{url}/{s.path}", dtype="<u2").reshape(-1, 17)
                           for s in m.shards])




def test_world_sizes_1_2_3_4_see_identical_steps(stream_dataset):
    plan = BatchSplit(global_batch_size=12, micro_batch_size=2)  # 6 micro-batches
    ref_rows, ref_fps = run_positions(stream_dataset, plan, 1, steps=8)
    for w in (2, 3, 4):  # 4 does not divide 6: ranks take 1 or 2 micro-batches
        rows, fps = run_positions(stream_dataset, plan, w, steps=8)
        assert fps == ref_fps and rows == ref_rows
    # And it is the C2 data order: position p holds sample SampleOrder(...).samples_at(p).
    m = load_manifest(stream_dataset)
    recs = [np.fromfile(f"{stream_dataset}/{s.path}", dtype="<u2").reshape(-1, 17) for s in m.shards]
    order = SampleOrder(m.shard_sizes, SEED, WINDOW)
    for p, (k, i) in enumerate(order.samples_at(0, 96)):
        assert ref_rows[p] == recs[k][i].tobytes()
    assert ref_fps[0] == sum(sample_hash(recs[k][i]) for k, i in order.samples_at(0, 12)) % 2**52


def test_resume_at_another_world_size_sees_every_sample_of_the_epoch_once(stream_dataset):
    m = load_manifest(stream_dataset)
    plan = BatchSplit(global_batch_size=8, micro_batch_size=2)
    steps = -(-m.num_samples // 8)  # the last step runs into epoch 1
    cut = steps // 3
    before, fps_a = run_positions(stream_dataset, plan, 2, steps=cut)
    after, fps_b = run_positions(stream_dataset, plan, 3, steps=steps - cut, start_step=cut)
    _, fps_ref = run_positions(stream_dataset, plan, 1, steps=steps)
    assert {**fps_a, **fps_b} == fps_ref
    seen = {**before, **after}
    epoch0 = [seen[p] for p in range(m.num_samples)]
    assert Counter(epoch0) == Counter(r.tobytes() for r in all_records(stream_dataset))


def test_next_epoch_is_a_new_shuffle_of_the_same_samples(stream_dataset):
    m = load_manifest(stream_dataset)
    n = m.num_samples
    plan = BatchSplit(global_batch_size=n, micro_batch_size=1)  # one step = one epoch
    rows, _ = run_positions(stream_dataset, plan, 2, steps=2)
    e0 = [rows[p] for p in range(n)]
    e1 = [rows[p] for p in range(n, 2 * n)]
    assert Counter(e0) == Counter(e1) and e0 != e1


def test_uneven_split_pads_with_a_zero_weight_repeat(stream_dataset):
    plan = BatchSplit(global_batch_size=8, micro_batch_size=2)  # 4 micro-batches over 3 ranks
    with open_step_stream(stream_dataset, batch_split=plan, rank=0, world_size=3, start_step=5,
                          seed=SEED) as s:
        b = next(s)
    assert b.step == 5 and b.weights == [1.0, 0.0]
    assert torch.equal(b.tokens[0], b.tokens[1]) and b.tokens[0].dtype == torch.int64
    assert b.tokens[0].shape == (2, 17)
    assert b.fingerprint == sum(sample_hash(r) for r in b.tokens[0]) % 2**52


def test_record_reads_read_only_the_ranks_own_samples(stream_dataset):
    """data.read_block_bytes=0: the fewest bytes (block reads trade bytes for requests:
    tests/integration/test_data_requests.py)."""
    m = load_manifest(stream_dataset)
    plan = BatchSplit(global_batch_size=12, micro_batch_size=2)
    data_bytes = index_bytes = 0
    for rank in range(3):
        with open_step_stream(stream_dataset, batch_split=plan, rank=rank, world_size=3, start_step=0,
                              seed=SEED, prefetch_steps=0, read_block_bytes=0) as s:
            for _ in range(4):
                next(s)
            data_bytes += s.reader.data_bytes_read
            index_bytes += s.reader.index_bytes_read
    assert data_bytes == 4 * 12 * m.record_bytes  # every record once, nothing else
    assert index_bytes == 4 * 12 * 8  # and its 8-byte checksum


def test_sample_hash_ignores_storage_dtype():
    x = [1, 50256, 7, 0]
    assert sample_hash(np.array(x, np.uint16)) == sample_hash(np.array(x, np.uint32)) \
        == sample_hash(torch.tensor(x)) == sample_hash(x) < 2**52


@pytest.mark.parametrize("damage", ["flip", "truncate", "index"])
def test_corrupt_shard_is_detected_and_named(stream_dataset, tmp_path, damage):
    ds = tmp_path / "ds"
    shutil.copytree(stream_dataset, ds)
    target = ds / ("shard-00001.idx" if damage == "index" else "shard-00001.bin")
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    else:
        data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    m = load_manifest(str(ds))
    plan = BatchSplit(global_batch_size=m.num_samples, micro_batch_size=1)  # touches every shard
    expect = {"flip": r"shard shard-00001.bin .*record \d+ .*does not match its checksum",
              "truncate": r"shard file shard-00001.bin .* has \d+ bytes, the manifest says",
              "index": r"shard shard-00001.bin .*record \d+ .*checksum in shard-00001.idx"}[damage]
    with open_step_stream(str(ds), batch_split=plan, rank=0, world_size=1, start_step=0,
                          seed=SEED) as s, pytest.raises(CorruptShardError, match=expect):
        next(s)


def test_manifest_errors_are_one_line(tmp_path, stream_dataset):
    with pytest.raises(ValueError, match="not a prepared dataset: manifest.json is missing"):
        load_manifest(str(tmp_path / "nothing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_manifest(str(tmp_path / "bad"))
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not an elastic-gpt dataset manifest"):
        load_manifest(str(tmp_path / "bad"))
    m = load_manifest(stream_dataset + "/manifest.json")
    with pytest.raises(ValueError, match=r"vocab_size=257, larger than model.vocab_size=100"):
        m.check_model(vocab_size=100)
    with pytest.raises(ValueError, match=r"seq_len=16, longer than model.seq_len=8"):
        m.check_model(vocab_size=50304, block_size=8)


def test_evicted_blocks_are_freed_and_the_cache_holds_what_it_counts(stdlib_dataset):
    """Blocks fetched in one request are held apart: evicting one frees it, whatever became of its
    siblings, so the cache's bound (in blocks) bounds its memory."""
    import gc
    import tracemalloc

    m = load_manifest(stdlib_dataset)
    tracemalloc.start()
    try:
        reader = ShardReader(m, block_records=64, window=64)  # a cache of a few blocks
        reader.read([(0, s) for s in range(m.shards[0].num_samples)])  # one request, many blocks
        reader.read([(1, 0)])  # evicts all but a few blocks of shard 0
        gc.collect()
        held, counted = tracemalloc.get_traced_memory()[0], reader.cached_bytes
        del reader
        gc.collect()
        freed = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    slack = 32 << 10  # the reader's own objects
    assert m.shards[0].num_samples * m.record_bytes - counted > 10 * slack  # evicted: not held
    assert counted <= freed < counted + slack, (counted, freed)


def test_a_failed_index_read_names_the_index(stream_dataset, tmp_path):
    """Record reads fetch records and their index entries together; an index read that fails is
    reported with the index's URL, not its shard's."""
    ds = tmp_path / "ds"
    shutil.copytree(stream_dataset, ds)
    reader = ShardReader(load_manifest(str(ds)), block_records=1)
    reader.read([(1, 0)])  # the shard's files are there when first used
    (ds / "shard-00001.idx").unlink()  # then the index goes (a lifecycle rule, a re-upload)
    with pytest.raises(ValueError, match=r"/shard-00001\.idx does not exist"):
        reader.read([(1, 1)])
