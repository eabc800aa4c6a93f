"""Two checks of bench/gpu_mfu.py beyond its rates: where one training step's time goes, and the
tensor-parallel path compiled on a one-rank mesh.

`step_breakdown(step, device)` profiles one step (torch.profiler) and sums the device time of
the kernels each op launched (each op's own CPU time in a CPU dry run) into the parts of a step:
GEMMs, attention, the loss, the optimizer, FSDP's copies and collectives, the rest; with the
step's wall time beside their total, so time the GPU sat idle (launch-bound steps, host syncs)
shows too. An op is placed by its name (cuBLAS/CUTLASS GEMMs, flash attention, NCCL, FSDP2's
copy-in/copy-out), else by the scope it ran in: the optimizer's step, FSDP's hooks, the model's
loss (`elastic_gpt::loss`, model/gpt.py).

`tp_compile_smoke(device, compile)` builds a small GPT with the trainer's tensor-parallel plan
(tensor.py: sequence parallelism, vocab-parallel embedding and loss) on a mesh of one rank, FSDP2
around it, compiled as the trainer compiles, and checks that its loss and gradient norm over a
few steps equal the plain model's: DTensor's compiled path, which a multi-GPU run takes, without
needing a second GPU.
"""

from __future__ import annotations

import re
import time

import torch

from elastic_gpt.model.gpt import LOSS_SCOPE

# What an op's own name says, first match wins: a collective or FSDP's copy before anything
# else, attention before GEMM (flash kernels' names contain "gemm" in some builds).
OWN_NAME = (
    ("fsdp_copies_and_collectives",
     r"nccl|all_gather|allgather|reduce_scatter|reducescatter|all_reduce|allreduce|chunk_cat|"
     r"split_with_sizes_copy|foreach_copy"),
    ("attention", r"flash|fmha|attention|scaled_dot_product"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|\baten::(mm|addmm|bmm|linear|matmul)\b"),
    ("optimizer", r"adam"),
    ("loss", r"log_softmax|cross_entropy|nll_loss"),
)
# Otherwise the scope it ran in: the optimizer's step, FSDP's hooks, the model's loss.
SCOPE = (
    ("optimizer", r"^optimizer\.step"),
    ("fsdp_copies_and_collectives", r"^fsdp::"),
    ("loss", "^" + re.escape(LOSS_SCOPE)),
)


def categorise(names: list[str], scopes: list[str] = ()) -> str:
    """The part of a step an op belongs to: by its `names` (the op's, the kernel's), else by the
    `scopes` it ran in, innermost first."""
    lowered = [n.lower() for n in names]
    for category, pattern in OWN_NAME:
        if any(re.search(pattern, n) for n in lowered):
            return category
    for scope in scopes:
        for category, pattern in SCOPE:
            if re.search(pattern, scope.lower()):
                return category
    return "other"


def step_breakdown(step, device: torch.device) -> dict:
    """Profile one call of `step()` (already warmed up); its time by part of the step: each op's
    own device time (the kernels it launched; on the CPU its own CPU time, aten ops only, so no
    wrapper is counted twice), by its name, else by the scopes around it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall_s = time.perf_counter() - t0
    seconds: dict[str, float] = {}

    def add(category: str, us: float) -> None:
        seconds[category] = seconds.get(category, 0.0) + us / 1e6

    for event in prof.events():
        scopes, parent = [], event.cpu_parent
        while parent is not None:
            scopes.append(parent.name)
            parent = parent.cpu_parent
        if cuda:
            # A kernel may hang off its launch call (cudaLaunchKernel): the op is its parent.
            op = scopes[:1] if event.name.startswith("cuda") else []
            for kernel in event.kernels:
                add(categorise([event.name, kernel.name, *op], scopes), kernel.duration)
        elif event.name.startswith("aten::") and event.self_cpu_time_total:
            add(categorise([event.name], scopes), event.self_cpu_time_total)
    busy = sum(seconds.values())
    return {"wall_s": wall_s, "busy_s": busy,
            "busy_of_wall": busy / wall_s if wall_s else 0.0,
            "seconds": {k: round(v, 6) for k, v in sorted(seconds.items())},
            "share": {k: v / busy for k, v in sorted(seconds.items())} if busy else {}}


def tp_compile_smoke(device: torch.device, compile: bool, steps: int = 3) -> dict:
    """The tensor-parallel model on a one-rank mesh against the plain one: equal losses and
    gradient norms step by step (within bf16's rounding on a GPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.model.config import GPTConfig
    from elastic_gpt.model.gpt import GPT
    from elastic_gpt.parallel.fsdp import init_sharded_weights, parallelize
    from elastic_gpt.parallel.tensor import summed_token_loss
    from elastic_gpt.torch_internals import flatten_mesh

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, seq_len=64, vocab_size=512)

    def build(tp: bool):
        torch.compiler.reset()
        with torch.device("meta"):
            model = GPT(cfg)
        mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp_shard", "tp"))
        flatten_mesh(mesh["dp_shard", "tp"], "dp_shard_tp")  # as ParallelDims.build_mesh does
        parallelize(model, mesh["dp_shard"], compute_dtype=dtype, compile=compile,
                    tp_mesh=mesh["tp"] if tp else None)
        model.to_empty(device=device)
        init_sharded_weights(model, seed=0)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (steps, 4, cfg.seq_len + 1), device=device,
                         generator=gen)
    runs = {}
    for tp in (False, True):
        model, opt = build(tp)
        losses, norms = [], []
        t0 = time.perf_counter()
        for i in range(steps):
            x, y = data[i, :, :-1], data[i, :, 1:]
            with summed_token_loss(model, x, y, compute_dtype=dtype, vocab_sharded=tp) as loss:
                loss = loss / y.numel()
                loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            full = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)
            losses.append(float(full(loss.detach())))
            norms.append(float(full(norm)))
        runs["tp" if tp else "plain"] = {"losses": losses, "grad_norms": norms,
                                         "seconds": time.perf_counter() - t0}
    tol = 2e-2 if cuda else 1e-4
    close = all(abs(a - b) <= tol * max(1.0, abs(b))
                for key in ("losses", "grad_norms")
                for a, b in zip(runs["tp"][key], runs["plain"][key]))
    return {"compile": compile, "tolerance": tol, "equal": close, **runs}
