"""The default job (`jobs/configs/mini.yaml`: 2 Ray Train workers under FSDP2) vs a plain
single-process PyTorch loop of the same model and global batch on the same 2 cores, side by side;
with --quality, what the default job learns: held-out bits per byte next to gzip -9 and xz -9 on
the same held-out text, and whether its sample is Python.

    .venv/bin/python bench/bench_default_job.py [--steps 30]
    .venv/bin/python bench/bench_default_job.py --quality

Needs the default job's dataset (`make data`). Throughput: runs the plain loop (2 intra-op
threads), then the job (train.max_steps=--steps, its own checkpoint dir and MLflow store), then
the plain loop again, and reports median steady-state tokens/s of each (the job's from its
per-step `step_time_s`). --quality: runs the job as `make train` does (all of train.max_steps),
evaluates its checkpoint on every record of the dataset's validation split (<data.path>/val:
summed token losses in nats / ln 2 / the UTF-8 bytes of the target tokens), compresses exactly
the text of those documents with gzip -9 and xz -9, samples as `make train` does (prompt "def ",
temperature 0.7, seed 0; and greedy) and reads the sample with Python's own `tokenize`; exit 1
unless the bits per byte are below gzip's and the sample has a `def name(...):` line with an
indented body and more than half its lines accepted by `tokenize`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "jobs/configs/mini.yaml")
PROMPT = "def "  # as `make train` samples (generate heals the trailing space)


def data_path() -> str:
    """The default job's dataset, as `make data` writes it (relative to the repository)."""
    import yaml

    with open(CONFIG) as f:
        return os.path.join(ROOT, yaml.safe_load(f)["data"]["path"])


def plain_loop(cfg, steps: int, threads: int) -> float:
    """Median tokens/s of forward/backward over the global batch in micro-batches, clip, AdamW."""
    import torch

    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.model.gpt import GPT, token_losses
    from elastic_gpt.train.model_config import model_config_for
    from elastic_gpt.train.optimizer import build_optimizer

    torch.set_num_threads(threads)
    gpt_cfg = model_config_for(cfg, load_manifest(cfg.data.path))
    model = GPT(gpt_cfg)
    opt = build_optimizer(model, cfg, fused=True)
    plan = BatchSplit(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    stream = open_step_stream(cfg.data.path, batch_split=plan, rank=0, world_size=1, start_step=0,
                              seed=cfg.data.seed)
    batches = [next(stream) for _ in range(steps)]
    stream.close()
    T, G = gpt_cfg.seq_len, plan.global_batch_size
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        for tokens in batch.tokens:
            (token_losses(model(tokens[:, :T]), tokens[:, 1:T + 1]) / (G * T)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return G * T / statistics.median(times[2:])


def default_job(steps: int, root: str) -> float:
    import mlflow

    from elastic_gpt.config import load_config
    from elastic_gpt.elastic.launcher import run_training

    uri = f"sqlite:///{root}/mlflow.db"
    cfg = load_config(CONFIG, [
        f"train.max_steps={steps}", f"checkpoint.path={root}/ckpt", f"tracking.uri={uri}",
        f"run.storage_path={root}/ray", "tracking.log_model=false",
        f"data.path={data_path()}"])
    summary = run_training(cfg)
    hist = mlflow.MlflowClient(uri).get_metric_history(summary["run_id"], "step_time_s")
    step_times = [m.value for m in sorted(hist, key=lambda m: m.step)][3:]
    from elastic_gpt.data.manifest import load_manifest
    tokens_per_step = cfg.train.global_batch_size * load_manifest(cfg.data.path).seq_len
    return tokens_per_step / statistics.median(step_times)


def held_out(ckpt: str, val_url: str) -> dict:
    """Bits per byte of the checkpoint on every validation record, and gzip -9 / xz -9 on the
    validation documents' text (decoded from the same records, so exactly the same bytes)."""
    import gzip
    import lzma
    import math

    import numpy as np
    import torch

    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.token_bytes import token_byte_lengths
    from elastic_gpt.data.tokenizers import get_tokenizer
    from elastic_gpt.inference.generate import load_model
    from elastic_gpt.model.gpt import token_losses

    model, _ = load_model(ckpt)
    m = load_manifest(val_url)
    tok = get_tokenizer(m.tokenizer, base=m.url)
    nbytes = token_byte_lengths(tok)
    recs = np.concatenate([np.fromfile(m.shard_url(k), dtype=m.dtype).reshape(-1, m.record_tokens)
                           for k in range(len(m.shards))]).astype(np.int64)
    nats, text_bytes = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(recs), 8):
            x = torch.from_numpy(recs[i:i + 8])
            nats += float(token_losses(model(x[:, :-1]), x[:, 1:]))
            text_bytes += int(nbytes[recs[i:i + 8, 1:]].sum())
    stream = np.concatenate([recs[0], *(r[1:] for r in recs[1:])])
    docs = np.split(stream, np.flatnonzero(stream == m.eos_id) + 1)
    text = "".join(tok.decode(d[d != m.eos_id]) for d in docs).encode("utf-8")
    return {"bpb": nats / math.log(2) / text_bytes, "loss": nats / recs[:, 1:].size,
            "bytes": text_bytes, "text_bytes": len(text), "docs": m.stats.get("docs"),
            "gzip": len(gzip.compress(text, 9)) * 8 / len(text),
            "xz": len(lzma.compress(text, preset=9)) * 8 / len(text)}


def python_lines(text: str) -> tuple[int, int]:
    """(lines Python's tokenize accepts, non-blank lines) of a sample. The last line is dropped
    when the sample ends mid-line; a line tokenize rejects counts as bad and tokenizing restarts
    on the line after it; a statement still open at the end (a bracket or string the sample
    was cut inside) costs only its last line."""
    import io
    import tokenize

    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]
    bad, start = set(), 0
    while start < len(lines):
        try:
            for t in tokenize.generate_tokens(io.StringIO("".join(lines[start:])).readline):
                if t.type == tokenize.ERRORTOKEN and not t.string.isspace():
                    bad.add(start + t.start[0] - 1)
            break
        except tokenize.TokenError:
            bad.add(len(lines) - 1)
            break
        except SyntaxError as e:  # IndentationError included
            bad.add(start + (e.lineno or 1) - 1)
            start += e.lineno or 1
    nonblank = [i for i, line in enumerate(lines) if line.strip()]
    return sum(i not in bad for i in nonblank), len(nonblank)


def def_with_body(text: str) -> bool:
    """A `def name(...):` line whose next non-blank line is indented deeper."""
    import re

    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)def \w+\(.*\)\s*(->.*)?:\s*(#.*)?$", line)
        nxt = next((n for n in lines[i + 1:] if n.strip()), None)
        if m and nxt is not None and len(nxt) - len(nxt.lstrip()) > len(m.group(1)):
            return True
    return False


def quality(root: str) -> int:
    from elastic_gpt.config import load_config
    from elastic_gpt.data.manifest import load_manifest, validation_url
    from elastic_gpt.elastic.launcher import run_training
    from elastic_gpt.inference.generate import sample_text

    data = data_path()
    val = validation_url(data)
    load_manifest(val)  # says what to run when the split is missing
    cfg = load_config(CONFIG, [
        f"checkpoint.path={root}/ckpt", f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"run.storage_path={root}/ray", "tracking.log_model=false", f"data.path={data}"])
    t0 = time.perf_counter()
    summary = run_training(cfg)
    seconds = time.perf_counter() - t0
    tokens = cfg.train.max_steps * cfg.train.global_batch_size * load_manifest(data).seq_len
    r = held_out(f"{root}/ckpt", val)
    print(f"\ndefault job: {cfg.train.max_steps} steps, {tokens:,} tokens in {seconds:.0f} s "
          f"(run {summary.get('run_id')})")
    print(f"held-out: {r['bytes']:,} bytes of {val}")
    print(f"  bits per byte: model {r['bpb']:.3f} | gzip -9 {r['gzip']:.3f} | xz -9 {r['xz']:.3f}"
          f"  (model loss {r['loss']:.3f} nats/token)")
    ok = r["bpb"] < r["gzip"]
    for temperature in (0.7, 0.0):
        text = sample_text(f"{root}/ckpt", PROMPT, max_new_tokens=100, temperature=temperature,
                           seed=0)
        good, total = python_lines(text)
        body = def_with_body(text)
        print(f"---- sample, temperature {temperature}: {good}/{total} lines accepted by "
              f"tokenize, def with an indented body: {'yes' if body else 'no'}\n{text}\n----")
        if temperature:
            ok = ok and body and 2 * good > total
    print("PASS: below gzip -9, and the sample is Python" if ok else
          "FAIL: see the figures above")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quality", action="store_true",
                   help="train the default job to the end and measure what it learnt")
    args = p.parse_args()
    from elastic_gpt.config import load_config

    if args.quality:
        with tempfile.TemporaryDirectory() as root:
            return quality(root)
    cfg = load_config(CONFIG, [f"data.path={data_path()}"])
    before = plain_loop(cfg, 12, threads=2)
    with tempfile.TemporaryDirectory() as root:
        job = default_job(args.steps, root)
    after = plain_loop(cfg, 12, threads=2)
    plain = statistics.mean([before, after])
    print(f"\nplain single-process loop (2 threads): {before:,.0f} / {after:,.0f} tok/s "
          f"(before / after)")
    print(f"default job, 2 workers x 1 thread, FSDP2 on Ray Train: {job:,.0f} tok/s")
    print(f"ratio default job / plain loop: {job / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
