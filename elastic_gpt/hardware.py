"""The one table of GPUs: peak FLOP/s, memory, interconnect and prices.

The planner reads every field; the trainer reads `peak_flops` for the MFU it logs each step
(`gpu_for_device` maps the name torch reports to a row). Nothing here imports torch.

Figures are datasheet peaks (dense bf16 tensor-core FLOP/s, no 2:4 sparsity) and *typical*
achievable collective bandwidths of the cloud instance named in `instance` (NCCL bus bandwidth,
one direction). Prices are rough public list prices per GPU-hour as of `PRICES_AS_OF`; they move
often and differ by region and provider, so users override them with a YAML/JSON file
(`load_overrides`) or `plan --on-demand-price/--spot-price`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

GiB = 1024**3
GB = 1e9
"""Bandwidths are in GB/s = 1e9 bytes/s; memory is reported in GiB."""
PRICES_AS_OF = "2025-06"


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s (datasheet peak; MFU is measured against this)."""
    memory_gib: float
    """Memory the framework can use: nvidia-smi's total, in GiB (less than the marketing 'GB')."""
    hbm_gbps: float
    """Memory bandwidth in GB/s: bounds the optimizer step, which streams every sharded state."""
    intra_node_gbps: float
    """Typical NCCL bus bandwidth inside one node (NVLink/NVSwitch or PCIe), GB/s per GPU."""
    inter_node_gbps: float
    """Typical NCCL bus bandwidth between nodes: the node's aggregate NIC bandwidth, GB/s."""
    gpus_per_node: int
    on_demand_usd: float
    """$ per GPU-hour, on-demand, as of PRICES_AS_OF."""
    spot_usd: float
    """$ per GPU-hour, spot/preemptible, as of PRICES_AS_OF."""
    instance: str = ""
    """The reference instance the bandwidth and price figures come from."""
    matmul_ceiling: float | None = None
    """The largest fraction of `peak_flops` a bf16 matmul of any shape was measured to reach
    (MAMF_CEILINGS); None: UNMEASURED_MATMUL_CEILING."""
    fp8_peak_flops: float = 0.0
    """Dense float8 tensor-core FLOP/s; 0: no float8 tensor cores (`plan --dtype float8`)."""
    fp8_matmul_ceiling: float | None = None
    """As matmul_ceiling, for float8 matmuls (FP8_MAMF_CEILINGS)."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB


# Peak bf16 dense: NVIDIA datasheets (A100 312, H100/H200 SXM 989, L4 121, L40S 362 TFLOP/s).
# A10G: 70. It is AWS's variant of the A10, not the A10 itself (whose datasheet says 125): same
# memory, about half the tensor throughput. NVIDIA has no public A10G datasheet; 70 is the A10G's
# dense bf16 figure in Baseten's side-by-side of the two cards ("NVIDIA A10 vs A10G for ML model
# inference"), and bf16 GEMMs measured on A10Gs top out just below it (~69 TFLOP/s).
# Bandwidths: NVLink3 600 GB/s bidirectional -> ~230 GB/s NCCL busbw, NVLink4 900 -> ~370; PCIe
# Gen4 x16 -> ~20. Inter-node: EFA 400 Gb/s (p4d/p4de, g6e.48xlarge) = 50 GB/s, 3200 Gb/s
# (p5/p5en) = 400 GB/s, 100 Gb/s (g5/g6.48xlarge) = 12.5 GB/s, times ~0.8 achieved.
# L40S's spot price is not a looked-up figure: the other g-family rows' spot/on-demand ratio.
# Maximum achievable matmul FLOPS, measured: the best bf16 torch.matmul over a scan of large shapes
# (Bekman, "Machine Learning Engineering", compute/accelerator/README.md, the MAMF comparison
# table, mamf-finder.py): A100 SXM 271.2 of 312, H100 SXM 794.5 of 989 ("H200 is the same").
# A GPU without a measurement of its own gets the median of the NVIDIA rows of that table (A100
# SXM 86.9%, GH200 83.8%, A100 PCIe 81.1%, H100 SXM 80.3%, B300 78.6%, B200 77.6%, GB200 72.9%).
MAMF_CEILINGS = {"A100": 271.2 / 312, "H100": 794.5 / 989, "H200": 794.5 / 989}
UNMEASURED_MATMUL_CEILING = 0.803
# The same table's float8 (e4m3) rows: H100 SXM 1402.6 and H200 SXM 1453.4 of 1979; unmeasured
# chips the median of its NVIDIA rows (GH200 77.6%, B200 76.3%, B300 74.5%, H200 73.4%, GB200
# 72.3%, H100 70.9%). Dense float8 peaks: NVIDIA datasheets, half their "with sparsity" figures
# (H100/H200 SXM 3,958, L40S 1,466, L4 485 TFLOP/s).
FP8_PEAKS = {"H100": 1979e12, "H200": 1979e12, "L40S": 733e12, "L4": 242.5e12}
FP8_MAMF_CEILINGS = {"H100": 1402.6 / 1979, "H200": 1453.4 / 1979}
UNMEASURED_FP8_MATMUL_CEILING = 0.74
GPUS: dict[str, GPU] = {
    g.name: dataclasses.replace(
        g, matmul_ceiling=MAMF_CEILINGS.get(g.name.split("-")[0], UNMEASURED_MATMUL_CEILING),
        fp8_peak_flops=FP8_PEAKS.get(g.name, 0.0),
        fp8_matmul_ceiling=FP8_MAMF_CEILINGS.get(g.name, UNMEASURED_FP8_MATMUL_CEILING))
    for g in [
        GPU("A100-40GB", 312e12, 40.0, 1555, 230, 40, 8, 2.75, 1.20, "AWS p4d.24xlarge"),
        GPU("A100-80GB", 312e12, 80.0, 2039, 230, 40, 8, 3.43, 1.60, "AWS p4de.24xlarge"),
        GPU("H100", 989e12, 79.6, 3350, 370, 320, 8, 6.88, 2.50, "AWS p5.48xlarge (SXM)"),
        GPU("H200", 989e12, 140.4, 4800, 370, 320, 8, 7.91, 3.00, "AWS p5en.48xlarge"),
        GPU("L4", 121e12, 22.5, 300, 20, 10, 8, 0.80, 0.35, "AWS g6.48xlarge"),
        GPU("A10G", 70e12, 22.5, 600, 20, 10, 8, 1.01, 0.45, "AWS g5.48xlarge"),
        GPU("L40S", 362e12, 45.0, 864, 20, 40, 8, 3.77, 1.70, "AWS g6e.48xlarge"),
    ]
}
# Chips whose dense bf16 peak differs from their family's row, or that have no row, by the
# words torch.cuda.get_device_name reports for them. MFU is measured against these; the planner
# has no row for them (bandwidths and prices differ by where one rents them), add one with
# --hardware-file. NVIDIA datasheets give bf16 "with sparsity", twice the dense figure:
# - H100 PCIe 1,513 and H100 NVL 1,671 TFLOP/s (the H100 datasheet's PCIe and NVL columns);
# - H200 NVL 1,671 (H200 datasheet, NVL column);
# - GH200: its Hopper GPU is the H100 SXM's, 1,979 (GH200 Grace Hopper Superchip datasheet);
# - H800 SXM: the H100 SXM's compute, 1,979, with NVLink cut to 400 GB/s (H800 datasheet);
# - B200: 4.5 PFLOP/s per GPU (HGX B200 datasheet: 36 PFLOP/s for 8 GPUs).
PEAK_VARIANTS: tuple[tuple[frozenset[str], float], ...] = (
    (frozenset({"H100", "PCIE"}), 756e12),
    (frozenset({"H100", "NVL"}), 835e12),
    (frozenset({"H200", "NVL"}), 835e12),
    (frozenset({"GH200"}), 989e12),
    (frozenset({"H800"}), 989e12),
    (frozenset({"B200"}), 2250e12),
)


def device_words(device_name: str) -> set[str]:
    """The upper-case words of a device name: "NVIDIA H100 PCIe" -> {NVIDIA, H100, PCIE}."""
    return set(re.split(r"[^0-9A-Z]+", device_name.upper())) - {""}


def variant_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a chip in PEAK_VARIANTS, or None."""
    words = device_words(device_name)
    return next((peak for need, peak in PEAK_VARIANTS if need <= words), None)


ALIASES = {"a100": "A100-80GB", "a100-40g": "A100-40GB", "a100-80g": "A100-80GB",
           "h100-sxm": "H100", "h100-80gb": "H100", "h200-141gb": "H200", "a10": "A10G"}


def get_gpu(name: str, table: dict[str, GPU] | None = None) -> GPU:
    """Case-insensitive lookup; a ValueError lists the known names for an unknown one."""
    table = GPUS if table is None else table
    by_lower = {k.lower(): k for k in table}
    key = by_lower.get(name.lower()) or ALIASES.get(name.lower())
    if key is None or key not in table:
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(table)} (add your own "
                         "with --hardware-file FILE)")
    return table[key]


def gpu_for_device(device_name: str, table: dict[str, GPU] | None = None) -> GPU | None:
    """The row for the name torch reports (e.g. "NVIDIA A100-SXM4-80GB" -> an A100 row), or None.

    A row matches when its family (the name before any "-": "A100" of "A100-40GB") is a whole word
    of the device name, so "NVIDIA L40S" is not taken for an L4 and "NVIDIA A10" not for an A10G.
    Variants of one family share its row (an "H100 PCIe" gets the SXM row's memory and
    bandwidths); their own peaks are in PEAK_VARIANTS."""
    table = GPUS if table is None else table
    words = device_words(device_name)
    for gpu in table.values():
        if gpu.name.split("-")[0].upper() in words:
            return gpu
    return None


def load_overrides(path: str, table: dict[str, GPU] | None = None) -> dict[str, GPU]:
    """Apply a YAML/JSON file of per-GPU field overrides; a new name with every field adds a GPU.

        H100: {on_demand_usd: 2.49, spot_usd: 1.60}
        MI300X: {peak_flops: 1.307e15, memory_gib: 192, hbm_gbps: 5300, intra_node_gbps: 350,
                 inter_node_gbps: 320, gpus_per_node: 8, on_demand_usd: 4.0, spot_usd: 2.0}
    """
    table = dict(GPUS if table is None else table)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"hardware file {path} does not exist")
    text = p.read_text()
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"hardware file {path} is not valid YAML/JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"hardware file {path} must map GPU names to fields")
    names = {f.name for f in dataclasses.fields(GPU)} - {"name"}
    for gpu_name, fields in raw.items():
        if not isinstance(fields, dict):
            raise ValueError(f"hardware file {path}: {gpu_name} must map to a mapping of fields")
        unknown = set(fields) - names
        if unknown:
            raise ValueError(f"hardware file {path}: unknown field(s) {sorted(unknown)} for "
                             f"{gpu_name}; fields are {', '.join(sorted(names))}")
        try:
            existing = get_gpu(str(gpu_name), table)
        except ValueError:
            existing = None
        if existing is not None:
            table[existing.name] = dataclasses.replace(existing, **fields)
            continue
        missing = names - set(fields) - {"instance", "matmul_ceiling", "fp8_peak_flops",
                                         "fp8_matmul_ceiling"}
        if missing:
            raise ValueError(f"hardware file {path}: new GPU {gpu_name} lacks {sorted(missing)}")
        table[str(gpu_name)] = GPU(name=str(gpu_name), **fields)
    return table
