"""The planner (elastic_gpt/planner/) checked against measurements on this machine.

    .venv/bin/python bench/bench_planner.py [--only memory,comm,tp,goodput] [--goodput-s 200]

Prints predicted / measured ratios for:
  memory   peak memory per worker, presets `tiny` and `small`, fp32 on CPU, 2 FSDP2 ranks (gloo):
           memory.memory_per_gpu(dtype="float32", context_bytes=0, fragmentation=0, grad_sync="step",
           reshard_after_forward=what the Trainer resolved) vs the peak
           resident set of the worker process above its baseline, measured the way `elastic-gpt
           tune` measures it (planner.tune_worker.PeakMemory: the kernel's VmHWM after /proc/self/clear_refs);
           train.reshard_after_forward auto (never, for these small models) and always
  comm     bytes each rank sends per step in FSDP2's all-gathers and reduce-scatters: the planner's
           step_time(...).all_gather_bytes / .reduce_scatter_bytes (grad_sync="step": the trainer
           reduce-scatters once per step; the resharding the Trainer resolved) vs the sum over the
           collectives actually issued, counted
           by wrapping torch.distributed.all_gather_single / reduce_scatter_single, each call
           counted as (N-1)/N x the full (gathered / pre-reduction) tensor, the ring formula the
           planner uses
  tp       tensor parallelism and HSDP: bytes each rank sends per step, the planner's
           step_time(..., tp, hsdp) (.tp_bytes, .all_gather_bytes, .reduce_scatter_bytes,
           .all_reduce_bytes) vs the collectives the trainer issues at tp=2 (W=2), dp=2 x tp=2
           (W=4) and HSDP 2 x 2 (two "nodes" named by rank_nodes): FSDP2's through the
           torch.distributed wrappers above, DTensor's (functional collectives, issued inside
           DTensor's dispatch) by a dispatch mode that lets DTensor run first, as CommDebugMode
           does, and sees the functional collectives it issues
  goodput  a chaos run (bench/bench_recovery.py's: tiny model, 2 one-CPU Ray nodes, a node killed
           every 60 s and replaced 20 s later): measured goodput vs reliability.goodput(...) fed the
           measured recovery time, checkpoint interval and checkpoint write time
Takes ~6 min (the chaos run is most of it). Each part runs in its own processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
os.environ.setdefault("RAY_TMPDIR", "/tmp/ray_bench_planner")
os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)


def stdlib_data(root: str, seq_len: int, max_bytes: int = 500_000) -> str:
    import sysconfig

    from data_pipelines.tokenize_job import prepare_data
    out = os.path.join(root, f"stdlib-{seq_len}")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        stdlib = sysconfig.get_paths()["stdlib"]
        files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))
        prepare_data(files[:80], out, tokenizer="bytes", seq_len=seq_len, engine="local",
                     progress=False, max_bytes=max_bytes)
    return out


# ---- memory and communication: 2 FSDP2 ranks over gloo, the trainer's own step ------------------

MEM_CASES = [  # (preset, seq_len = the preset's, global batch, micro-batch, checkpointing,
    #            train.reshard_after_forward: auto keeps these small models gathered)
    ("tiny", 128, 8, 4, False, "auto"), ("tiny", 128, 8, 1, False, "auto"),
    ("small", 256, 8, 4, False, "auto"), ("small", 256, 8, 4, True, "auto"),
    ("small", 256, 8, 2, False, "auto"), ("small", 256, 8, 1, True, "auto"),
    ("small", 256, 8, 4, False, "always"), ("small", 256, 8, 1, True, "always"),
]
WORLD = 2


class CollectiveCounter:
    """Wraps the torch.distributed collectives FSDP2 issues; bytes each rank sends by the ring
    formula: (N-1)/N x the gathered tensor (all-gather) or the pre-reduction tensor (RS)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.bytes = dist, {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.calls = dict.fromkeys(self.bytes, 0)
        self.by_group: dict[tuple[str, int], float] = {}
        """Bytes by (kind, group size): HSDP's all-reduce is the one over dp_replicate ranks."""
        self._orig = {}
        for name, kind, pick in [("all_gather_single", "all_gather", lambda a, k: a[0]),
                                 ("all_gather_into_tensor", "all_gather", lambda a, k: a[0]),
                                 ("reduce_scatter_single", "reduce_scatter",
                                  lambda a, k: k.get("input", a[1] if len(a) > 1 else None)),
                                 ("reduce_scatter_tensor", "reduce_scatter",
                                  lambda a, k: k.get("input", a[1] if len(a) > 1 else None)),
                                 ("all_reduce", "all_reduce", lambda a, k: a[0])]:
            self._wrap(name, kind, pick)

    def _wrap(self, name, kind, pick):
        orig = getattr(self.dist, name)
        self._orig[name] = orig

        def wrapped(*args, **kwargs):
            t = pick(args, kwargs)
            n = self.dist.get_world_size(kwargs.get("group"))
            ring = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
            self.bytes[kind] += ring * t.numel() * t.element_size()
            self.calls[kind] += 1
            key = (kind, n)
            self.by_group[key] = self.by_group.get(key, 0.0) + ring * t.numel() * t.element_size()
            return orig(*args, **kwargs)
        setattr(self.dist, name, wrapped)

    def reset(self):
        for k in self.bytes:
            self.bytes[k], self.calls[k] = 0, 0
        self.by_group.clear()


def _mem_worker(rank: int, world: int, cases: list, data: dict, steps: int) -> list[dict]:
    import copy

    import torch.distributed as dist

    from elastic_gpt.config import load_config
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.planner.tune_candidates import TrainSettings
    from elastic_gpt.planner.tune_worker import measure, warm_up_process
    from elastic_gpt.train.trainer import Trainer

    counter = CollectiveCounter()
    results = []
    first = True
    for preset, seq, G, mb, ckpt, policy in cases:
        cfg = load_config("jobs/configs/mini.yaml", [
            f"model.preset={preset}", f"data.path={data[seq]}", f"train.global_batch_size={G}",
            f"train.micro_batch_size={mb}", f"scaling.max_workers={WORLD}",
            "scaling.min_workers=1", "checkpoint.path=/tmp/unused-bench-planner",
            "tracking.enabled=false", "train.threads_per_worker=1",
            f"train.reshard_after_forward={policy}"])
        if first:  # as tune does: one-time allocations of the process are not a candidate's
            warm_up_process(cfg, TrainSettings(1, False, False), rank=rank, world=world)
            first = False
        row = measure(cfg, TrainSettings(mb, ckpt, False), rank=rank, world=world, steps=steps)
        # Communication: a fresh trainer, one warm-up step, then count `steps` steps.
        c = copy.deepcopy(cfg)
        c.train.activation_checkpointing = ckpt
        trainer = Trainer(c, rank=rank, world_size=WORLD, mlflow_run_id=None)
        stream = open_step_stream(c.data.path, batch_split=BatchSplit(G, mb), rank=rank,
                                  world_size=WORLD, start_step=0, seed=c.data.seed)
        trainer.train_step(next(stream))
        resharded = trainer.layout.memory.reshard_after_forward
        assert resharded == row["reshard_after_forward"], (resharded, row)
        counter.reset()
        for _ in range(steps):
            trainer.train_step(next(stream))
        stream.close()
        del trainer
        peaks = [None] * WORLD
        dist.all_gather_object(peaks, row["peak_bytes"])
        results.append({"case": [preset, seq, G, mb, ckpt, policy],
                        "reshard_after_forward": resharded,
                        "grad_sync": c.train.grad_sync, "peak_bytes": max(peaks),
                        "step_s": row["step_s"],
                        "bytes_per_step": {k: v / steps for k, v in counter.bytes.items()},
                        "calls_per_step": {k: v / steps for k, v in counter.calls.items()}})
    return results


def measure_memory_comm(root: str, steps: int = 2) -> list[dict]:
    from elastic_gpt.testing.gloo import run_gloo
    data = {seq: stdlib_data(root, seq) for seq in sorted({c[1] for c in MEM_CASES})}
    # As `elastic-gpt tune` runs its workers: freed tensors return to the kernel (honest baseline).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
    return run_gloo(_mem_worker, WORLD, MEM_CASES, data, steps)[0]


def predict_memory_comm(row: dict) -> dict:
    from elastic_gpt.cost_model.memory import memory_per_gpu
    from elastic_gpt.cost_model.network import Network
    from elastic_gpt.cost_model.shape import model_shape
    from elastic_gpt.cost_model.step_time import step_time
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.hardware import GPUS
    from elastic_gpt.model.config import pad_vocab, preset_config

    preset, seq, G, mb, ckpt, _ = row["case"]
    # The byte tokenizer's 257 ids (256 bytes + EOS), padded to 320 as the trainer does.
    cfg = preset_config(preset, seq_len=seq, vocab_size=pad_vocab(257))
    shape = model_shape(cfg)
    k = BatchSplit(G, mb).slots(WORLD)
    # What the trainer ran: its grad sync and the resharding its Trainer resolved.
    ran = dict(grad_sync=row["grad_sync"], reshard_after_forward=row["reshard_after_forward"])
    mem = memory_per_gpu(shape, WORLD, mb, activation_checkpointing=ckpt, dtype="float32",
                         micro_batches_per_rank=k, context_bytes=0, fragmentation=0, **ran)
    net = Network(gpus_per_node=8, intra_node_gbps=10, inter_node_gbps=10)
    st = step_time(shape, GPUS["H100"], net, WORLD, mb, k, activation_checkpointing=ckpt,
                   dtype="float32", **ran)
    return {"memory": mem, "all_gather_bytes": st.all_gather_bytes,
            "reduce_scatter_bytes": st.reduce_scatter_bytes}


def report_memory_comm(rows: list[dict]) -> list[dict]:
    MiB = 1 << 20
    out = []
    print("\nmemory per worker (fp32, CPU, W=2): planner memory_per_gpu(context 0, fragmentation 0)"
          " vs measured peak RSS above the pre-candidate baseline")
    print(f"{'case':<36}{'predicted MiB':>14}{'measured MiB':>14}{'pred/meas':>11}   "
          "predicted parts (state/gathered/accum/acts/logits MiB)")
    for r in rows:
        p = predict_memory_comm(r)
        m = p["memory"]
        preset, seq, G, mb, ckpt, _ = r["case"]
        name = (f"{preset} T={seq} mb={mb} ckpt={'on' if ckpt else 'off'} "
                f"{'always' if r['reshard_after_forward'] else 'never'}")
        ratio = m.total / r["peak_bytes"]
        parts = "/".join(f"{x / MiB:.1f}" for x in (m.sharded_state, m.gathered_params,
                                                     m.accumulated_grads, m.activations,
                                                     m.logits))
        print(f"{name:<36}{m.total / MiB:>14.1f}{r['peak_bytes'] / MiB:>14.1f}{ratio:>11.2f}   "
              f"{parts}")
        out.append({**r, "case": name, "predicted_bytes": m.total,
                    "measured_bytes": r["peak_bytes"], "ratio": ratio,
                    "predicted_ag": p["all_gather_bytes"],
                    "predicted_rs": p["reduce_scatter_bytes"]})
    print("\nbytes sent per rank per step (ring formula), W=2: planner step_time(grad_sync='step')"
          " vs counted collectives")
    print(f"{'case':<36}{'AG pred MB':>11}{'AG count':>10}{'ratio':>7}{'RS pred MB':>11}"
          f"{'RS count':>10}{'ratio':>7}{'AG/RS calls':>13}{'all-reduce MB':>14}")
    for o in out:
        b, c = o["bytes_per_step"], o["calls_per_step"]
        print(f"{o['case']:<36}{o['predicted_ag'] / 1e6:>11.3f}{b['all_gather'] / 1e6:>10.3f}"
              f"{o['predicted_ag'] / b['all_gather']:>7.3f}{o['predicted_rs'] / 1e6:>11.3f}"
              f"{b['reduce_scatter'] / 1e6:>10.3f}{o['predicted_rs'] / b['reduce_scatter']:>7.3f}"
              f"{c['all_gather']:>7.0f}/{c['reduce_scatter']:<5.0f}{b['all_reduce'] / 1e6:>14.4f}")
    return out


# ---- tensor parallelism and HSDP: counted collective bytes ---------------------------------------

TP_CASES = [  # (preset, seq_len, global batch, micro-batch, checkpointing, parallel.tp,
    #            parallel.hsdp, world size, nodes named by rank_nodes)
    ("tiny", 128, 8, 4, False, 2, "off", 2, 1), ("tiny", 128, 8, 2, True, 2, "off", 2, 1),
    ("small", 256, 8, 4, False, 2, "off", 2, 1), ("small", 256, 8, 2, True, 2, "off", 2, 1),
    ("tiny", 128, 8, 2, False, 2, "off", 4, 1), ("tiny", 128, 8, 2, True, 2, "off", 4, 1),
    ("tiny", 128, 8, 2, False, 1, "on", 4, 2), ("small", 256, 8, 2, False, 1, "on", 4, 2),
]


def functional_collective_counter(group_sizes: dict[str, tuple[str, int]]):
    """A TorchDispatchMode counting the functional collectives DTensor issues, bytes per rank by
    the ring formula, keyed by (op, mesh dim). Returning NotImplemented for DTensor arguments lets
    DTensor's own dispatch run first (its redistributions, loss_parallel's reductions), so the
    collectives it issues on local tensors come back through this mode, as in CommDebugMode.
    `group_sizes` maps a process group's name to (mesh dim, size)."""
    from torch.distributed.tensor import DTensor

    from elastic_gpt.torch_internals import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes: dict[tuple[str, str], float] = {}
            self.calls: dict[tuple[str, str], int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            packet = func._overloadpacket
            if getattr(packet, "_qualified_op_name", "").startswith("_c10d_functional::"):
                name = packet.__name__
                if name.startswith(("all_gather_into_tensor", "reduce_scatter_tensor",
                                    "all_reduce")):
                    self._record(name, args)
            return out

        def _record(self, name: str, args: tuple):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            group = args[-1]
            dim, n = group_sizes.get(group, ("other", 0))
            if name.startswith("all_gather"):  # the inputs are the shards
                n = n or args[-2]
                full = sum(t.numel() * t.element_size() for t in tensors) * n
                kind, moved = "all_gather", (n - 1) / n * full
            elif name.startswith("reduce_scatter"):  # the inputs are the whole tensors
                n = n or args[-2]
                kind = "reduce_scatter"
                moved = (n - 1) / n * sum(t.numel() * t.element_size() for t in tensors)
            else:
                kind = "all_reduce"
                moved = 2 * (n - 1) / n * sum(t.numel() * t.element_size() for t in tensors) \
                    if n else 0.0
            key = (kind, dim)
            self.bytes[key] = self.bytes.get(key, 0.0) + moved
            self.calls[key] = self.calls.get(key, 0) + 1

        def reset(self):
            self.bytes.clear()
            self.calls.clear()

    return Counter()


def _tp_worker(rank: int, world: int, case: tuple, data: str, steps: int) -> dict:
    import torch.distributed as dist

    from elastic_gpt.config import load_config
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.train.trainer import Trainer

    preset, seq, G, mb, ckpt, tp, hsdp, _, nodes = case
    cfg = load_config("jobs/configs/mini.yaml", [
        f"model.preset={preset}", f"data.path={data}", f"train.global_batch_size={G}",
        f"train.micro_batch_size={mb}", f"scaling.max_workers={world}",
        f"scaling.min_workers={world}", "checkpoint.path=/tmp/unused-bench-planner",
        "tracking.enabled=false", "train.threads_per_worker=1",
        f"train.activation_checkpointing={str(ckpt).lower()}", f"parallel.tp={tp}",
        f"parallel.hsdp={hsdp}"])
    per_node = world // nodes
    rank_nodes = [f"node-{r // per_node}" for r in range(world)]
    fsdp = CollectiveCounter()
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None, rank_nodes=rank_nodes)
    mesh = trainer.dims.mesh
    groups = {mesh.get_group(d).group_name: (d, mesh.get_group(d).size())
              for d in mesh.mesh_dim_names}
    dp = trainer.dims.dp_degree
    stream = open_step_stream(cfg.data.path, batch_split=BatchSplit(G, mb), rank=trainer.dp_rank,
                              world_size=dp, start_step=0, seed=cfg.data.seed)
    trainer.train_step(next(stream))  # warm-up: lazy init and first-step allocations
    tpc = functional_collective_counter(groups)
    fsdp.reset()
    with tpc:
        for _ in range(steps):
            trainer.train_step(next(stream))
    stream.close()
    row = {"case": list(case), "grad_sync": cfg.train.grad_sync,
           "reshard_after_forward": trainer.layout.memory.reshard_after_forward,
           "dims": trainer.dims.describe(),
           "fsdp_bytes": {k: v / steps for k, v in fsdp.bytes.items()},
           "fsdp_by_group": {f"{k}/{n}": v / steps for (k, n), v in fsdp.by_group.items()},
           "fsdp_calls": {k: v / steps for k, v in fsdp.calls.items()},
           "funcol_bytes": {f"{k}/{d}": v / steps for (k, d), v in tpc.bytes.items()},
           "funcol_calls": {f"{k}/{d}": v / steps for (k, d), v in tpc.calls.items()}}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    return rows


def measure_tp(root: str, steps: int = 2) -> list[dict]:
    from elastic_gpt.testing.gloo import run_gloo
    out = []
    for case in TP_CASES:
        data = stdlib_data(root, case[1])
        rows = run_gloo(_tp_worker, case[7], case, data, steps)[0]
        out.append(rows)
        print(f"  counted {case} on {rows[0]['dims']}", flush=True)
    return out


def predict_tp(row: dict) -> dict:
    from elastic_gpt.cost_model.mesh import make_mesh
    from elastic_gpt.cost_model.network import Network
    from elastic_gpt.cost_model.shape import model_shape
    from elastic_gpt.cost_model.step_time import step_time
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.hardware import GPUS
    from elastic_gpt.model.config import pad_vocab, preset_config

    preset, seq, G, mb, ckpt, tp, hsdp, world, nodes = row["case"]
    cfg = preset_config(preset, seq_len=seq, vocab_size=pad_vocab(257))
    shape = model_shape(cfg)
    net = Network(gpus_per_node=world // nodes, intra_node_gbps=10, inter_node_gbps=10)
    mesh = make_mesh(world, tp, hsdp == "on", net.gpus_per_node)
    k = BatchSplit(G, mb).slots(mesh.dp)
    st = step_time(shape, GPUS["H100"], net, world, mb, k, activation_checkpointing=ckpt,
                   dtype="float32", grad_sync=row["grad_sync"],
                   reshard_after_forward=row["reshard_after_forward"], tp=tp, hsdp=mesh.hsdp)
    return {"tp": st.tp_bytes, "all_gather": st.all_gather_bytes,
            "reduce_scatter": st.reduce_scatter_bytes, "all_reduce": st.all_reduce_bytes}


def report_tp(results: list[list[dict]]) -> list[dict]:
    print("\nbytes sent per rank per step (ring formula), fp32 on CPU: planner step_time(tp, hsdp)"
          " vs counted (TP: DTensor's functional collectives on the tp mesh dim; FSDP: FSDP2's)")
    print(f"{'case':<40}{'what':<24}{'pred MB':>10}{'counted MB':>12}{'ratio':>7}{'calls':>7}")
    out = []
    for rows in results:
        r = rows[0]  # every rank sends the same bytes; rank 0 speaks for them
        preset, seq, G, mb, ckpt, tp, hsdp, world, nodes = r["case"]
        name = (f"{preset} mb={mb} ckpt={'on' if ckpt else 'off'} W={world} {r['dims']}")
        pred = predict_tp(r)
        fb, fg, fc = r["fsdp_bytes"], r["fsdp_by_group"], r["fsdp_calls"]
        tpb = sum(v for key, v in r["funcol_bytes"].items() if key.endswith("/tp"))
        tpc = sum(v for key, v in r["funcol_calls"].items() if key.endswith("/tp"))
        replicas = world // (tp * (world // nodes // tp)) if hsdp == "on" else 0
        counted = {"tp": tpb, "all_gather": fb["all_gather"],
                   "reduce_scatter": fb["reduce_scatter"],
                   "all_reduce": fg.get(f"all_reduce/{replicas}", 0.0) if replicas > 1 else 0.0}
        calls = {"tp": tpc, "all_gather": fc["all_gather"], "reduce_scatter": fc["reduce_scatter"],
                 "all_reduce": fc["all_reduce"]}
        for what in ("tp", "all_gather", "reduce_scatter", "all_reduce"):
            if not pred[what] and not counted[what]:
                continue
            ratio = pred[what] / counted[what] if counted[what] else float("nan")
            print(f"{name:<40}{what:<24}{pred[what] / 1e6:>10.3f}{counted[what] / 1e6:>12.3f}"
                  f"{ratio:>7.3f}{calls[what]:>7.0f}")
            name = ""
        out.append({**r, "predicted": pred, "counted": counted})
    return out


# ---- goodput of a chaos run ---------------------------------------------------------------------


def measure_goodput(root: str, duration_s: float, n_trials: int, every_s: float = 60.0) -> dict:
    """bench_recovery's chaos run, plus what the goodput model needs: the recovery time (node
    kill -> first step at the smaller size), the scale-up restart, the step time and the blocking
    checkpoint time (the extra gap after every checkpointed step)."""
    from bench_recovery import ElasticGPTRun, goodput, trials

    from elastic_gpt.testing.cluster import LocalCluster, training_workers, wait_for

    class Run(ElasticGPTRun):
        def steps(self):
            try:
                return super().steps()
            except AttributeError:  # the driver has not created the MLflow experiment yet
                return []

    data = stdlib_data(root, 64)
    cluster = LocalCluster(workers=2)
    try:
        run = Run(cluster, data, root, "trials")
        print(f"goodput: {n_trials} trial(s) of node kill + node add", flush=True)
        tr = trials(cluster, run, n_trials)
        run.stop()
        wait_for(lambda: not training_workers(), timeout_s=60)
        print(f"goodput: a node lost every {every_s:.0f} s for {duration_s:.0f} s", flush=True)
        run = Run(cluster, data, root, "goodput")
        g = goodput(cluster, run, duration_s, every_s=every_s)
        steps = run.steps()
        run.stop()
    finally:
        cluster.shutdown()
    # Gaps between consecutive step records at full size: a checkpoint (every 10 steps) is written
    # after step 10k's record and before step 10k+1's, so its gap is longer by the write time.
    by_step = {}
    for t, s, w in steps:
        by_step[s] = (t, w)
    plain, after_ckpt, w1 = [], [], []
    for s in sorted(by_step):
        if s - 1 in by_step and by_step[s][1] == by_step[s - 1][1]:
            gap = by_step[s][0] - by_step[s - 1][0]
            if gap > 5:
                continue  # a restart in between
            if by_step[s][1] == 1:
                w1.append(gap)
            elif (s - 1 + 1) % 10 == 0:  # step index s-1 completed the 10k-th step: checkpointed
                after_ckpt.append(gap)
            else:
                plain.append(gap)
    step_s = statistics.median(plain)
    ckpt_s = max(0.0, statistics.median(after_ckpt) - step_s) if after_ckpt else 0.0
    step_w1 = statistics.median(w1) if w1 else float("nan")
    return {"trials": tr, "chaos": g, "step_s": step_s, "step_w1_s": step_w1,
            "ckpt_write_s": ckpt_s, "ckpt_every_steps": 10, "every_s": every_s}


def predict_goodput(m: dict, every_s: float = 60.0) -> dict:
    from elastic_gpt.planner.reliability import goodput

    R = m["trials"]["recovery_s"]["median"]
    interval = m["ckpt_every_steps"] * m["step_s"]
    out = {"recovery_s": R, "interval_s": interval, "ckpt_write_s": m["ckpt_write_s"],
           "mtbf_s": every_s,
           "planner": goodput(interval, m["ckpt_write_s"], R, every_s)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--only", default="memory,comm,tp,goodput")
    ap.add_argument("--goodput-s", type=float, default=200.0)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--every-s", type=float, default=60.0, help="seconds between node kills")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    root = tempfile.mkdtemp(prefix="bench_planner_")
    results: dict = {}
    if parts & {"memory", "comm"}:
        results["memory_comm"] = report_memory_comm(measure_memory_comm(root))
    if "tp" in parts:
        results["tp"] = report_tp(measure_tp(root))
    if "goodput" in parts:
        m = measure_goodput(root, args.goodput_s, args.trials, args.every_s)
        p = predict_goodput(m, args.every_s)
        results["goodput"] = {"measured": m, "predicted": p}
        meas = m["chaos"]["goodput"]
        print(f"\ngoodput (node lost every {args.every_s:.0f} s, replaced 20 s later): "
              f"measured {meas:.3f}; "
              f"recovery {p['recovery_s']:.1f} s, scale-up {m['trials']['scale_up_s']['median']}"
              f" s, checkpoint every {p['interval_s']:.2f} s, write {p['ckpt_write_s']:.3f} s, "
              f"step {m['step_s']:.3f} s (W=1: {m['step_w1_s']:.3f} s)")
        print(f"  reliability.goodput(interval, write, recovery, MTBF={args.every_s:.0f} s) = "
              f"{p['planner']:.3f}; "
              f"predicted/measured {p['planner'] / meas if meas else float('nan'):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(rc)
