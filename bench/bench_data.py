"""Data pipeline figures, side by side in one run on this machine.

    .venv/bin/python bench/bench_data.py [--corpus GLOB] [--max-bytes 32MB] [--steps 200]

1. tokenization: the Ray Data job vs the bare tokenizer on the same cores (target >= 70%);
2. reader throughput vs the model's consumption, one rank (target >= 20x);
3. bytes read from storage per byte of tokens trained, W = 1, 2, 3, reading records alone
   (data.read_block_bytes=0; target <= 1.1);
4. data_wait share of step time with the real `mini` model consuming (target < 2%): a simulated
   single-process trainer (forward + backward + AdamW per micro-batch), not the Ray Train loop.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from data_pipelines.cli import parse_size  # noqa: E402
from data_pipelines.sources import list_inputs  # noqa: E402
from data_pipelines.tokenize_job import prepare_data  # noqa: E402
from elastic_gpt.data.manifest import load_manifest  # noqa: E402
from elastic_gpt.data.order import BatchSplit  # noqa: E402
from elastic_gpt.data.stream import open_step_stream  # noqa: E402
from elastic_gpt.data.tokenizers import get_tokenizer  # noqa: E402

CPUS = 2  # this machine; the Ray cluster below gets the same cores


def _encode_files(paths: list[str]) -> int:
    tok = get_tokenizer("gpt2")
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += len(tok.encode(f.read().decode("utf-8", errors="replace")))
    return n


def bench_tokenization(corpus: str, max_bytes: int, out: str) -> dict:
    files = list_inputs(corpus, max_bytes=max_bytes)
    nbytes = sum(f.size for f in files)
    paths = [f.url for f in files]
    chunks = [paths[i::CPUS] for i in range(CPUS)]
    with mp.get_context("spawn").Pool(CPUS) as pool:
        pool.map(_encode_files, [chunks[0][:2]] * CPUS)  # warm: tables built, imports done
        t = time.perf_counter()
        tokens = sum(pool.map(_encode_files, chunks))
        bare_s = time.perf_counter() - t

    import ray

    t = time.perf_counter()
    ray.init(address="local", num_cpus=CPUS, object_store_memory=100 << 20,
             include_dashboard=False,
             log_to_driver=False, _temp_dir=os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"),
                                                         "ray_bench_data"))
    init_s = time.perf_counter() - t
    kw = dict(tokenizer="gpt2", seq_len=256, max_bytes=max_bytes, progress=False)
    cold = prepare_data(corpus, os.path.join(out, "cold"), **kw)  # first Ray Data run
    warm = prepare_data(corpus, os.path.join(out, "warm"), **kw)
    assert warm["tokens"] - warm["docs"] == tokens, "job and bare tokenizer disagree"
    r = {
        "corpus_MB": nbytes / 1e6, "tokens": tokens,
        "bare_MB_s": nbytes / bare_s / 1e6,
        "job_MB_s": nbytes / warm["tokenize_seconds"] / 1e6,
        "job_cold_MB_s": nbytes / cold["tokenize_seconds"] / 1e6,
        "job_end_to_end_s": cold["seconds"] + init_s, "ray_init_s": init_s,
    }
    r["job_vs_bare"] = r["job_MB_s"] / r["bare_MB_s"]
    return r


def _model(manifest):
    from elastic_gpt.model.config import pad_vocab, preset_config
    from elastic_gpt.model.gpt import GPT, token_losses

    cfg = preset_config("mini", seq_len=manifest.seq_len, vocab_size=pad_vocab(manifest.vocab_size))
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(batch):
        opt.zero_grad(set_to_none=True)
        for tokens, w in zip(batch.tokens, batch.weights):
            loss = token_losses(model(tokens[:, :-1]), tokens[:, 1:]) * w / tokens[:, 1:].numel()
            loss.backward()
        opt.step()

    return train_step


def bench_reader(data: str, steps: int, model_steps: int) -> dict:
    m = load_manifest(data)
    torch.set_num_threads(CPUS)
    plan = BatchSplit(global_batch_size=16, micro_batch_size=4)  # the default job's batch
    step_tokens = plan.global_batch_size * m.seq_len
    r = {}

    # Reader alone, one rank of W=1 (it reads the whole global batch), synchronous reads.
    with open_step_stream(data, batch_split=plan, rank=0, world_size=1, start_step=0, seed=1,
                          prefetch_steps=0) as s:
        next(s)
        t = time.perf_counter()
        for _ in range(steps):
            next(s)
        r["reader_tokens_s"] = steps * step_tokens / (time.perf_counter() - t)

    # The model consuming, with a prefetching stream: consumption rate and data_wait share.
    train_step = _model(m)
    with open_step_stream(data, batch_split=plan, rank=0, world_size=1, start_step=0, seed=1,
                          prefetch_steps=4) as s:
        train_step(next(s))  # warm-up step
        wait = total = 0.0
        for _ in range(model_steps):
            t0 = time.perf_counter()
            b = next(s)
            t1 = time.perf_counter()
            train_step(b)
            wait += t1 - t0
            total += time.perf_counter() - t0
    r["model_tokens_s"] = model_steps * step_tokens / total
    r["reader_vs_model"] = r["reader_tokens_s"] / r["model_tokens_s"]
    r["data_wait_share"] = wait / total

    # The same steps read by Ray Data tasks (ray_data_stream.py), start-up of its first chunk
    # included.
    from ray_data_stream import RayDataStepStream
    with RayDataStepStream(load_manifest(data), batch_split=plan, rank=0, world_size=1,
                           start_step=0, seed=1) as s:
        t = time.perf_counter()
        for _ in range(steps):
            next(s)
        r["ray_data_reader_tokens_s"] = steps * step_tokens / (time.perf_counter() - t)

    # From an S3-protocol server on loopback (moto), prefetching as in training.
    from elastic_gpt.testing.s3_server import S3Server

    server = S3Server()
    try:
        server.make_bucket()
        server.filesystem().put(data + "/", "corpus/ds/", recursive=True)
        so = server.storage_options()
        with open_step_stream("s3://corpus/ds", batch_split=plan, rank=0, world_size=1, start_step=0,
                              seed=1, storage_options=so) as s:
            next(s)
            t = time.perf_counter()
            for _ in range(steps // 4):
                next(s)
            r["s3_reader_tokens_s"] = steps // 4 * step_tokens / (time.perf_counter() - t)
    finally:
        server.stop()

    # Bytes read per byte of tokens trained, all ranks together, reading records alone (block
    # reads trade bytes for requests: bench/bench_data_requests.py).
    for w in (1, 2, 3):
        plan_w = BatchSplit(global_batch_size=48, micro_batch_size=4)
        read = 0
        for rank in range(w):
            with open_step_stream(data, batch_split=plan_w, rank=rank, world_size=w, start_step=0,
                                  seed=1, prefetch_steps=0, read_block_bytes=0) as s:
                for _ in range(steps):
                    next(s)
                read += s.bytes_read
        trained = steps * plan_w.global_batch_size * m.record_bytes
        r[f"bytes_per_trained_byte_W{w}"] = read / trained
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=os.path.join(sysconfig.get_paths()["stdlib"], "**/*.py"))
    ap.add_argument("--max-bytes", type=parse_size, default=32 << 20)
    ap.add_argument("--steps", type=int, default=200, help="reader steps per measurement")
    ap.add_argument("--model-steps", type=int, default=6,
                    help="steps of the mini model (seconds each on 2 CPUs)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        tok = bench_tokenization(args.corpus, args.max_bytes, out)
        try:
            rd = bench_reader(os.path.join(out, "warm"), args.steps, args.model_steps)
        finally:
            import ray

            ray.shutdown()
    print(f"corpus: {args.corpus} (first {tok['corpus_MB']:.1f} MB, {tok['tokens']:,} gpt2 "
          f"tokens), {CPUS} CPUs")
    print(f"tokenization  bare tiktoken x{CPUS} procs {tok['bare_MB_s']:6.2f} MB/s | Ray Data job "
          f"{tok['job_MB_s']:6.2f} MB/s (cold first run {tok['job_cold_MB_s']:.2f}) | "
          f"job/bare = {tok['job_vs_bare']:.2f}  (target >= 0.70)")
    print(f"              end to end incl. ray.init {tok['job_end_to_end_s']:.1f} s "
          f"(ray.init {tok['ray_init_s']:.1f} s)")
    print(f"reader        {rd['reader_tokens_s'] / 1e6:6.2f} M tokens/s | mini model consumes "
          f"{rd['model_tokens_s'] / 1e3:.1f} k tokens/s | reader/model = "
          f"{rd['reader_vs_model']:.0f}x  (target >= 20x)")
    print(f"              same reader from loopback S3 (moto) "
          f"{rd['s3_reader_tokens_s'] / 1e6:.2f} M tokens/s; Ray Data engine "
          f"{rd['ray_data_reader_tokens_s'] / 1e6:.2f} M tokens/s")
    print("bytes read per byte of tokens trained, record reads: " + ", ".join(
        f"W={w} {rd[f'bytes_per_trained_byte_W{w}']:.3f}" for w in (1, 2, 3))
        + "  (target <= 1.1)")
    print(f"data_wait     {100 * rd['data_wait_share']:.2f}% of step time, simulated trainer "
          "(mini model, 1 process, prefetch 4)  (target < 2%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**tok, **rd}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
