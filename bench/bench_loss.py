"""The loss from whole logits against the chunked loss, side by side in one process.

    .venv/bin/python bench/bench_loss.py [--preset gpt2-124m] [--seq-len 256] [--micro-batch 4]
        [--rounds 4] [--dtype float32] [--json out.json]

One GPT (GPT-2's 50,304-row vocabulary) and one fused AdamW; each round runs one training step
with each loss, alternating (the same machine noise for both), on the same random token batch:

  whole    `token_losses(model(x), y)`: the (B, T, vocab) logits, their fp32 copy and, in the
           backward, their gradient (the plain cross-entropy)
  chunked  `model(x, targets=y)`: `chunked_token_losses`, the upcast and log-softmax on
           LOSS_CHUNK_LOGITS logits at a time, the logits' gradient kept in the compute dtype
           (the loss the trainer runs without tensor parallelism)

A step: forward and backward under autocast in --dtype (as the trainer runs it), grad-norm clip,
the AdamW step, zero_grad. Per step: wall and process CPU time, and the peak resident memory
above what the process held when the step began (Linux's VmHWM, reset through
/proc/self/clear_refs before each step; glibc is set to map each allocation of 1 MiB or more on
its own, so a freed tensor leaves resident memory and the peak is the step's own). Also the loss
layer alone (the output matmul, the loss and their backward on the last hidden states), each
way: its time and peak. A round 0 warms both up and is dropped; medians over the rest. One
intra-op thread unless --threads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from common import median


def _own_mappings() -> None:
    """glibc serves every allocation of 1 MiB or more with a mapping of its own and returns it to
    the system when freed (its default threshold grows with what was freed, up to 32 MiB, and
    freed heap memory stays resident), so resident memory tracks the live tensors."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 20)
    libc.mallopt(m_trim_threshold, 1 << 20)


def _peak_reset() -> int:
    """Reset the process's peak resident memory to its current one; returns that, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def run(preset: str, seq_len: int, micro_batch: int, rounds: int, dtype_name: str,
        threads: int) -> dict:
    import torch

    from elastic_gpt.config import load_config
    from elastic_gpt.model import gpt
    from elastic_gpt.model.config import preset_config
    from elastic_gpt.model.gpt import GPT, chunked_token_losses, token_losses
    from elastic_gpt.train.optimizer import build_optimizer

    _own_mappings()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = preset_config(preset, seq_len=seq_len)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = GPT(cfg)
    optimizer = build_optimizer(model, load_config(None, ["train.lr=1e-4", "data.path=unused"]), fused=True)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    hidden = torch.randn(micro_batch, seq_len, cfg.n_embd, requires_grad=True)
    autocast = dict(device_type="cpu", dtype=dtype, enabled=dtype != torch.float32)

    def step(chunked: bool) -> float:
        with torch.autocast(**autocast):
            out = model(x, targets=y) if chunked else model(x)
        loss = out if chunked else token_losses(out, y)
        (loss / y.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item() / y.numel()

    def loss_layer(chunked: bool) -> None:
        weight = model.wte.weight
        with torch.autocast(**autocast):
            loss = (chunked_token_losses(hidden, weight, y) if chunked
                    else token_losses(hidden @ weight.t(), y))
        loss.backward()
        hidden.grad = weight.grad = None

    samples: dict[str, dict[str, list[float]]] = {
        name: {"wall_s": [], "cpu_s": [], "peak_mb": [], "loss_layer_s": [],
               "loss_layer_peak_mb": [], "loss": []}
        for name in ("whole", "chunked")}
    for r in range(rounds + 1):
        for name in ("whole", "chunked"):
            chunked = name == "chunked"
            base = _peak_reset()
            w0, c0 = time.perf_counter(), time.process_time()
            loss = step(chunked)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            peak = _status_kib("VmHWM") * 1024 - base
            base = _peak_reset()
            t0 = time.perf_counter()
            loss_layer(chunked)
            layer = time.perf_counter() - t0
            layer_peak = _status_kib("VmHWM") * 1024 - base
            if r:
                s = samples[name]
                s["wall_s"].append(wall)
                s["cpu_s"].append(cpu)
                s["peak_mb"].append(peak / 2**20)
                s["loss_layer_s"].append(layer)
                s["loss_layer_peak_mb"].append(layer_peak / 2**20)
                s["loss"].append(loss)
            print(f"round {r} {name:8s} step {wall:6.2f} s (cpu {cpu:6.2f}) peak +{peak / 2**20:7.0f} "
                  f"MiB | loss layer {layer:5.2f} s, peak +{layer_peak / 2**20:6.0f} MiB | loss {loss:.4f}",
                  flush=True)
    out = {"preset": preset, "seq_len": seq_len, "micro_batch": micro_batch, "dtype": dtype_name,
           "vocab": cfg.vocab_size, "threads": threads, "rounds": rounds,
           "chunk_logits": gpt.LOSS_CHUNK_LOGITS,
           "whole_logits": micro_batch * seq_len * cfg.vocab_size, "samples": samples}
    for name, s in samples.items():
        out[name] = {k: median(v) for k, v in s.items() if k != "loss"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args.preset, args.seq_len, args.micro_batch, args.rounds, args.dtype, args.threads)
    w, c = res["whole"], res["chunked"]
    print(f"\n{args.preset}, {args.micro_batch} x {args.seq_len} tokens, {args.dtype}, "
          f"vocab {res['vocab']}, {args.threads} thread(s), median of {args.rounds} rounds")
    print(f"{'':22s} {'whole':>10s} {'chunked':>10s} {'chunked/whole':>14s}")
    for key, label in (("wall_s", "step, wall s"), ("cpu_s", "step, CPU s"),
                       ("peak_mb", "step peak, MiB"), ("loss_layer_s", "loss layer, wall s"),
                       ("loss_layer_peak_mb", "loss layer peak, MiB")):
        print(f"{label:22s} {w[key]:10.2f} {c[key]:10.2f} {c[key] / w[key]:14.3f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
