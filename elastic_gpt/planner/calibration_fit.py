"""Measured runs and the calibration fitted to them: each run planned in the layout it ran, the
plan's throughput set beside the measured one, and the terms (cost_model/calibration.py) that
bring them together.

A `MeasuredRun` keeps the model as it ran (`ModelSpec`: width, depth, heads, key/value heads,
MLP width and kind, vocabulary, sequence), its GPUs, its layout and the tokens per second per GPU
it reached. The planner plans the GPT of the same width, depth and heads (`ModelSpec.config`);
the two are compared in model FLOP/s, each model's throughput times its own FLOPs per token, so
that a model family the planner cannot build yet (Llama's grouped-query attention and SwiGLU MLP)
is compared on the work it did. When the planner builds that family, `config` is the one place
to change.

The fit: the terms that minimise the sum of squared log ratios of planned to measured
throughput over the runs given, found by a golden-section search (each ratio moves one way with
each term, so the sum has one minimum on the interval searched).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from elastic_gpt.cost_model.calibration import (
    Calibration,
    ComputeTerms,
    FamilyCalibration,
    gpu_family,
)
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.pipeline import pipelined_step_time
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.cost_model.step_time import step_time
from elastic_gpt.hardware import GPU, get_gpu
from elastic_gpt.model.config import GPTConfig


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape as its run published it."""

    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    vocab_size: int
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None: n_head."""
    ffn_dim: int | None = None
    """The MLP's hidden width; None: 4 x n_embd."""
    mlp: str = "gelu"
    """gelu: two matrices (GPT); swiglu: three (Llama)."""

    def config(self) -> GPTConfig:
        """What the planner plans: the GPT of this width, depth, heads, vocabulary and
        sequence."""
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         seq_len=self.seq_len, vocab_size=self.vocab_size)

    def flops_per_token(self) -> float:
        """Training FLOPs per token of this model as it ran: 6 x its matmul parameters (the
        output layer's included, the embedding lookup not) + 12 L h T for attention (PaLM's
        count, model/config.py's for a GPT)."""
        h, kv = self.n_embd, self.n_kv_head or self.n_head
        ffn = self.ffn_dim or 4 * h
        attention = 2 * h * h + 2 * h * kv * (h // self.n_head)
        mlp = (3 if self.mlp == "swiglu" else 2) * h * ffn
        matmul_params = self.n_layer * (attention + mlp) + h * self.vocab_size
        return 6 * matmul_params + 12 * self.n_layer * h * self.seq_len


@dataclass(frozen=True)
class MeasuredRun:
    """One measured training run: what ran, where, and how fast."""

    label: str
    model: ModelSpec
    gpu: str
    """A GPU row's name (hardware.py, or a --hardware-file's)."""
    gpus: int
    micro_batch: int
    tokens_per_s_per_gpu: float
    micro_batches_per_rank: int = 1
    tp: int = 1
    pp: int = 1
    pp_stages_per_rank: int = 1
    hsdp: bool = False
    recompute: float = 0.0
    """The fraction of a block's forward recomputed in backward: 0 none, 1 every block
    (`train.activation_checkpointing`), between for a selective policy (the step is planned
    that far from the one without recomputation to the one with it)."""
    dtype: str = "bfloat16"
    eager: bool = False
    """The blocks ran eager, each elementwise op its own kernel; False: compiled, or a stack's
    own fused kernels."""
    reshard_after_forward: bool = True
    grad_sync: str = "microbatch"
    network: tuple[int, float, float] | None = None
    """(GPUs per node, intra-node GB/s, inter-node GB/s per node); None: the GPU row's."""
    source: str = ""
    """Where the figure was published or measured."""

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def tokens_per_step(self) -> int:
        return (self.micro_batch * self.micro_batches_per_rank * self.model.seq_len
                * self.data_parallel)


def planned_step_s(run: MeasuredRun, gpu: GPU, terms: ComputeTerms) -> float:
    """The step `run` ran, as the cost model plans it with `terms`."""
    shape = model_shape(run.model.config())
    per_node, intra, inter = run.network or (gpu.gpus_per_node, gpu.intra_node_gbps,
                                             gpu.inter_node_gbps)
    net = Network(per_node, intra, inter)
    kw = dict(dtype=run.dtype, calibration=terms, compiled=not run.eager)

    def step(recompute: bool) -> float:
        if run.pp == 1:
            return step_time(shape, gpu, net, run.gpus, run.micro_batch,
                             run.micro_batches_per_rank, activation_checkpointing=recompute,
                             grad_sync=run.grad_sync,
                             reshard_after_forward=run.reshard_after_forward, tp=run.tp,
                             hsdp=run.hsdp, **kw).step_s
        mesh = make_mesh(run.gpus, run.tp, run.hsdp, per_node, run.pp, run.pp_stages_per_rank)
        return pipelined_step_time(shape, gpu, net, mesh, run.micro_batch,
                                   run.micro_batches_per_rank, activation_checkpointing=recompute,
                                   **kw).step_s

    if run.recompute in (0.0, 1.0):
        return step(bool(run.recompute))
    without = step(False)
    return without + run.recompute * (step(True) - without)


def planned_over_measured(run: MeasuredRun, hardware: dict[str, GPU],
                          terms: ComputeTerms) -> float:
    """The plan's model FLOP/s over the run's: above 1, planned faster than it ran."""
    gpu = get_gpu(run.gpu, hardware)
    planned_tokens_per_s = run.tokens_per_step() / planned_step_s(run, gpu, terms) / run.gpus
    planned = planned_tokens_per_s * model_shape(run.model.config()).model_flops_per_token
    return planned / (run.tokens_per_s_per_gpu * run.model.flops_per_token())


TERM_BOUNDS = {"backward": (0.2, 1.5), "eager_elementwise": (0.02, 1.5)}
"""Where the fit looks for each term (fractions of the kernel model's speed)."""


def fit_terms(runs: list[MeasuredRun], hardware: dict[str, GPU], start: ComputeTerms,
              free: tuple[str, ...] = ("backward",), tolerance: float = 1e-4) -> ComputeTerms:
    """The terms that minimise the sum of squared log(planned / measured) over `runs`: those
    named in `free` fitted, the others kept from `start`. With two free terms, the second is
    searched and the first fitted for each of its values."""

    def loss(terms: ComputeTerms) -> float:
        return sum(math.log(planned_over_measured(r, hardware, terms)) ** 2 for r in runs)

    def best(terms: ComputeTerms, names: tuple[str, ...]) -> tuple[ComputeTerms, float]:
        name, rest = names[-1], names[:-1]

        def at(value: float) -> tuple[ComputeTerms, float]:
            t = dataclasses.replace(terms, **{name: value})
            return best(t, rest) if rest else (t, loss(t))

        lo, hi = (math.log(b) for b in TERM_BOUNDS[name])
        return at(math.exp(golden_min(lambda x: at(math.exp(x))[1], lo, hi, tolerance)))

    return best(start, free)[0]


def golden_min(f, lo: float, hi: float, tolerance: float) -> float:
    """The x in [lo, hi] where the unimodal f is least."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tolerance:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def spread(runs: list[MeasuredRun], hardware: dict[str, GPU],
           calibration: Calibration) -> tuple[float, float]:
    """(least, most) measured over planned throughput over `runs`, each planned with its GPU
    family's terms."""
    ratios = [1 / planned_over_measured(r, hardware,
                                        calibration.for_gpu(get_gpu(r.gpu, hardware)).terms)
              for r in runs]
    return min(ratios), max(ratios)


def fit_family(runs: list[MeasuredRun], hardware: dict[str, GPU], start: ComputeTerms,
               evidence: str, free: tuple[str, ...] = ("backward",)) -> FamilyCalibration:
    """One family's terms fitted on `runs`, all of one GPU family."""
    families = {gpu_family(get_gpu(r.gpu, hardware).name) for r in runs}
    if len(families) != 1:
        raise ValueError(f"a family's calibration takes runs of one GPU family, not "
                         f"{', '.join(sorted(families))}")
    return FamilyCalibration(families.pop(), fit_terms(runs, hardware, start, free), evidence)
