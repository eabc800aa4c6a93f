"""The step stream: C2 data order for any world size, resume at another size, integrity, S3."""

from __future__ import annotations

import pytest

from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.order import BatchSplit
from elastic_gpt.data.stream import CorruptShardError, open_step_stream
from tests.step_streams import SEED, run_positions


def test_stream_from_s3_matches_local_and_detects_corruption(stream_dataset, s3):
    fs = s3.filesystem()
    fs.put(stream_dataset + "/", "corpus/stream-ds/", recursive=True)
    so = s3.storage_options()
    url = "s3://corpus/stream-ds"
    plan = BatchSplit(global_batch_size=12, micro_batch_size=2)
    _, local = run_positions(stream_dataset, plan, 2, steps=5)
    _, remote = run_positions(url, plan, 2, steps=5, storage_options=so)
    assert remote == local
    m = load_manifest(url, so)
    assert m.url == url and m.num_samples == load_manifest(stream_dataset).num_samples
    blob = bytearray(fs.cat_file("corpus/stream-ds/shard-00000.bin"))
    blob[3] ^= 0xFF
    fs.pipe("corpus/stream-ds/shard-00000.bin", bytes(blob))
    plan = BatchSplit(global_batch_size=m.num_samples, micro_batch_size=1)
    with open_step_stream(url, batch_split=plan, rank=0, world_size=1, start_step=0, seed=SEED,
                          storage_options=so) as s, \
            pytest.raises(CorruptShardError, match="shard-00000.bin .*record 0 "):
        next(s)


def test_unreachable_storage_is_one_line():
    so = {"key": "k", "secret": "s", "config_kwargs": {"retries": {"max_attempts": 1}},
          "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}}
    with pytest.raises(ValueError, match="cannot reach the storage behind s3://corpus/ds.*"
                                         "check the endpoint URL"):
        load_manifest("s3://corpus/ds", so)


