"""The planner against published runs: each run of runs.py planned with its own settings by the
one-figure (`--efficiency 0.6`) and the calibrated (default) step-time model, beside the
published TFLOP/s per GPU, as a Markdown table; then the ZeRO-3 rows bounded by DeepSpeed
2021's own collectives; then GPT-3 175B on 1024 A100s left to choose its layout, with this
trainer's software, with SC21's kernels, with SC21's software in the layouts Megatron-LM 2021
could run, and in the one its 34 days were measured in (Megatron-LM's GPT-3 example script).
validation/reports/ holds dated records of what it prints.

    .venv/bin/python -m validation.published_runs
"""

from __future__ import annotations

import dataclasses

from elastic_gpt.planner.training_plan import plan_training
from validation.checks import (
    MEGATRON_GPT3_EXAMPLE,
    check,
    gpt3_175b_on_1024,
    zero3_2021_unoverlapped_tflops,
)
from validation.runs import RUNS


def cell(checked) -> str:
    if checked.planned_tflops is None:
        return "refused"
    return f"{checked.planned_tflops:.0f} (x{checked.ratio:.2f})"


def main() -> None:
    print("| source | run | GPUs | layout | published | one figure | calibrated |")
    print("|---|---|---|---|---|---|---|")
    for run in RUNS:
        mb = run.micro_batch or "plan's"
        print(f"| {run.source} | {run.label} | {run.gpus} x {run.gpu} | tp={run.tp} pp={run.pp}, "
              f"micro-batch {mb} | {run.published_tflops:.0f} | "
              f"{cell(check(run, calibrated=False))} | "
              f"{cell(check(run))} |")
    print()
    print("SC21's ZeRO-3 rows with every collective of DeepSpeed 2021's ZeRO-3 after the plan's "
          "compute, none overlapped (deepspeed_zero3_2021.py):")
    for run in RUNS:
        if run.zero3:
            tflops = zero3_2021_unoverlapped_tflops(run)
            print(f"- {run.label} on {run.gpus}: {tflops:.0f} TFLOP/s against "
                  f"{run.published_tflops:.0f} (x{tflops / run.published_tflops:.2f})")
    print()
    print("GPT-3 175B on 1024 A100-80GB, 300B tokens, SC21's network and batch, left to choose "
          "(Megatron-LM: 34 days):")
    megatron = gpt3_175b_on_1024(True, megatron_layouts=True)
    for inputs, software in (
            (gpt3_175b_on_1024(False), "this trainer's kernels"),
            (gpt3_175b_on_1024(True), "SC21's software (Megatron-LM 2021 kernels, recomputation)"),
            (megatron, "SC21's software in Megatron-LM's 2021 layouts (tp=8, its replicas and "
                       "pipelines)"),
            (dataclasses.replace(megatron, **MEGATRON_GPT3_EXAMPLE),
             "not left to choose: the layout of the 34 days (Megatron-LM's GPT-3 example)")):
        plan = plan_training(inputs)
        c = plan.chosen
        print(f"- {software}: {c.mesh.short()}, micro-batch {c.micro_batch}, recomputation "
              f"{'on' if c.activation_checkpointing else 'off'}: "
              f"{plan.time_to_train_s / 86400:.1f} days, MFU {plan.mfu:.1%}")


if __name__ == "__main__":
    main()
