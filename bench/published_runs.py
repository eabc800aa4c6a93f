"""The planner against published runs: each run of planner/published_runs.py planned with its
own settings by the one-figure (`--efficiency 0.6`) and the calibrated (default) step-time
model, beside the published TFLOP/s
per GPU, as the Markdown table docs/planner.md shows.

    .venv/bin/python bench/published_runs.py
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repository on sys.path)

from elastic_gpt.planner.published_runs import RUNS, check


def cell(checked) -> str:
    if checked.planned_tflops is None:
        return "refused"
    return f"{checked.planned_tflops:.0f} (x{checked.ratio:.2f})"


def main() -> None:
    print("| source | run | GPUs | layout | published | one figure | calibrated |")
    print("|---|---|---|---|---|---|---|")
    for run in RUNS:
        mb = run.micro_batch or "plan's"
        print(f"| {run.source} | {run.label} | {run.gpus} x {run.gpu} | tp={run.tp} pp={run.pp}, micro-batch "
              f"{mb} | {run.published_tflops:.0f} | {cell(check(run, calibrated=False))} | "
              f"{cell(check(run))} |")


if __name__ == "__main__":
    main()
