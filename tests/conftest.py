"""Shared fixtures: a small real dataset, a real local Ray cluster, and a way to run training."""

from __future__ import annotations

import os
import random
import sysconfig

import pytest

os.environ.setdefault("RAY_TMPDIR", "/tmp/elastic_gpt_ray")
os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
# Credentials of the loopback S3 server (moto). Set before any Ray node starts, so workers of a
# local cluster inherit them the way real workers get theirs from the node.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def stdlib_dataset(tmp_path_factory) -> str:
    """~0.5 MB of the Python standard library's own source, byte-tokenized, 64-token samples."""
    from data_pipelines.tokenize_job import prepare_data

    out = str(tmp_path_factory.mktemp("data") / "stdlib")
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))[:40]
    prepare_data(files, out, tokenizer="bytes", seq_len=64, engine="local", progress=False,
                 max_bytes=500_000)
    return out


@pytest.fixture(scope="module")
def s3():
    """A real S3-protocol server on loopback (moto) with one bucket, for a test module."""
    from elastic_gpt.testing.s3_server import S3Server

    server = S3Server()
    server.make_bucket()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ray_local():
    """A small local Ray instance for a data test module, stopped at the module's end (only if
    this fixture started it): other modules start clusters of other shapes."""
    import ray

    if ray.is_initialized():
        yield None
        return
    tmp = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray_data_tests")
    ray.init(address="local", num_cpus=2, object_store_memory=100 << 20, include_dashboard=False,
             _temp_dir=tmp, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for a module's training tests (4 logical CPUs: W=3 fits on 2 cores)."""
    import ray

    if ray.is_initialized():
        if ray.cluster_resources().get("CPU", 0) >= 4:
            yield ray
            return
        ray.shutdown()  # a smaller cluster left by another module: W=3 would never fit
    ray.init(address="local", num_cpus=4, object_store_memory=120 << 20, include_dashboard=False,
             _temp_dir=os.path.join(os.environ["RAY_TMPDIR"], "train_tests"), log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def stream_dataset(tmp_path_factory):
    """A byte dataset of 12 small files in several shards, for the step-stream tests."""
    from data_pipelines.tokenize_job import prepare_data

    root = tmp_path_factory.mktemp("stream")
    rng = random.Random(0)
    (root / "raw").mkdir()
    for i in range(12):
        words = [rng.choice(["alpha", "beta", "gamma", "δέλτα", "\n", "x" * rng.randint(1, 9)])
                 for _ in range(rng.randint(50, 400))]
        (root / "raw" / f"{i:02d}.txt").write_text(" ".join(words))
    prepare_data(str(root / "raw"), str(root / "ds"), "bytes", 16, engine="local",
                 progress=False, part_bytes=2000)
    return str(root / "ds")


@pytest.fixture(scope="session")
def dataset_with_val(tmp_path_factory) -> str:
    """30 standard-library modules, byte-tokenized, with 20% held out for evaluation."""
    from data_pipelines.tokenize_job import prepare_data

    out = str(tmp_path_factory.mktemp("evaldata") / "ds")
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))[:30]
    prepare_data(files, out, tokenizer="bytes", seq_len=32, engine="local", progress=False,
                 max_bytes=300_000, val_fraction=0.2, val_seed=1)
    return out
