"""Training health (health/recovery.py, health/silent_corruption.py, health/stragglers.py): what the checks
cost a healthy run, and what each automatic action costs when it fires.

    .venv/bin/python bench/bench_health.py [--steps 60] [--repeats 2] [--parts overhead,...]
                                           [--json out.json]

Parts, each on real gloo processes of this machine:

  overhead   the default job's model and batch at W=2 as HSDP over two "nodes" (every check
             active: the shard checksum and the replicas' comparison before every forward, the
             straggler probe every 10 steps), against the same run with every check off;
             the two alternate, and the median step times are compared
  overhead_fsdp  the same at W=2 as FSDP over one "node": no replicas to compare, but every
             rank's gradients checksummed in each reduce-scatter (parallel/gradient_checksum.py)
  spike      a garbage sample range at a known step: the steps from the first bad batch to the
             detection, the seconds from the detection to the first step after the last
             rollback (rollback, re-run, rollback), the steps re-done
  hardware   the top exponent bit of one rank's parameters flipped: the same figures
  gradient   the top exponent bit of a gradient one rank computes, before the reduce-scatter
             (a faulty backward): the same figures, and the rank named
  sdc        one low mantissa bit of one replica flipped (3 replicas): the steps to detection
             and the seconds the heal took (its step's time against the median step)

The straggler's figures come from the real Ray test that evicts one
(tests/system/test_chaos.py::test_a_straggler_is_evicted_and_the_run_goes_on_in_order prints them).
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
sys.path.insert(0, ROOT)

from elastic_gpt.tracking import metric_names as mn  # noqa: E402
from elastic_gpt.train.collaborators import NullMetricSink  # noqa: E402

SEED, G, BAD_AT = 1234, 8, 40
OFF = ["health.spike_action=off", "health.sdc_every_steps=0", "health.straggler_action=off"]


class TimedSink(NullMetricSink):
    """Each logged step's wall clock and step time, in log order (a re-done step appears
    again)."""

    def __init__(self):
        self.steps: list[tuple[int, float, float]] = []

    def log(self, metrics: dict, step: int) -> None:
        if mn.TRAIN_LOSS in metrics:
            self.steps.append((step, time.time(), metrics[mn.TRAIN_STEP_TIME_S]))


def _run(rank: int, world: int, overrides: list[str], nodes: list[str] | None, faults) -> dict:
    from elastic_gpt.config import load_config
    from elastic_gpt.health.faults import NoFaults
    from elastic_gpt.train.trainer import Trainer

    sink = TimedSink()
    trainer = Trainer(load_config(os.path.join(ROOT, "jobs/configs/mini.yaml"), overrides),
                      rank=rank, world_size=world, mlflow_run_id=None, metrics=sink,
                      rank_nodes=nodes, faults=(faults or NoFaults()).for_rank(rank))
    trainer.train()
    return {"steps": sink.steps, "events": trainer.ledger.events}


def _gloo(world, overrides, nodes=None, faults=None):
    from elastic_gpt.testing.gloo import run_gloo

    return run_gloo(_run, world, overrides, nodes, faults)[0]


def overhead(data: str, tmp: str, steps: int, repeats: int, hsdp: bool = True) -> dict:
    base = [f"data.path={data}", f"train.max_steps={steps}", "tracking.enabled=false",
            "eval.samples=0", "train.log_every=1000", f"parallel.hsdp={'on' if hsdp else 'off'}",
            "checkpoint.every_steps=100000"]
    nodes = ["a", "b"] if hsdp else ["a", "a"]
    ratios, medians = [], {"on": [], "off": []}
    for i in range(repeats):
        pair = {}
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):  # neither always first
            got = _gloo(2, [*base, f"checkpoint.path={tmp}/{mode}{i}", *(OFF if mode == "off"
                                                                          else [])], nodes)
            # past the first steps' warm-up
            pair[mode] = statistics.median(t for _, _, t in got["steps"][5:])
            medians[mode].append(pair[mode])
        ratios.append(pair["on"] / pair["off"])
    return {"step_s_on": medians["on"], "step_s_off": medians["off"],
            "on_over_off_per_pair": ratios, "on_over_off": statistics.median(ratios)}


def _recovery(got: dict) -> dict:
    """From the detection until the run is back at the detected step, on the trajectory it
    keeps (after the last rollback)."""
    events = got["events"]
    detected = next(e for e in events if e["kind"] == "loss spike")
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    back = [t for step, t, _ in got["steps"] if step == detected["step"]
            and t > rollbacks[-1]["at"]]
    median_step = statistics.median(s for _, _, s in got["steps"])
    recovery = back[0] - detected["at"]
    return {"detected_at_step": detected["step"], "recovery_s": recovery,
            "steps_redone": sum(e.get("lost_steps", 0) for e in rollbacks),
            "median_step_s": median_step, "recovery_in_steps": recovery / median_step,
            "kinds": [e["kind"] for e in events]}


def spike(data: str, tmp: str) -> dict:
    from elastic_gpt.testing.faults import corrupt_steps

    bad = f"{tmp}/garbage"
    corrupt_steps(data, bad, range(BAD_AT, BAD_AT + 2), G, SEED, 16384)
    got = _gloo(1, [*_test_job(bad), f"checkpoint.path={tmp}/spike"])
    return {"first_bad_step": BAD_AT + 1, **_recovery(got)}


def hardware(data: str, tmp: str) -> dict:
    from elastic_gpt.testing.hardware_faults import FlippedBit, HardwareFaults

    got = _gloo(2, [*_test_job(data), f"checkpoint.path={tmp}/hw", "scaling.min_workers=1"],
                faults=HardwareFaults(FlippedBit(rank=1, step=BAD_AT)))
    return {"first_bad_step": BAD_AT + 1, **_recovery(got)}


def gradient(data: str, tmp: str) -> dict:
    from elastic_gpt.testing.hardware_faults import FlippedBit, HardwareFaults

    got = _gloo(2, [*_test_job(data), f"checkpoint.path={tmp}/grad", "scaling.min_workers=1"],
                faults=HardwareFaults(FlippedBit(rank=1, step=BAD_AT + 1, in_gradient=True)))
    fault = next(e for e in got["events"] if e["kind"] == "hardware fault")
    return {"first_bad_step": BAD_AT + 1, "ranks_named": fault["ranks"], **_recovery(got)}


def sdc(data: str, tmp: str) -> dict:
    from elastic_gpt.testing.hardware_faults import FlippedBit, HardwareFaults

    got = _gloo(3, [*_test_job(data), f"checkpoint.path={tmp}/sdc", "scaling.min_workers=1",
                    "parallel.hsdp=on", "train.global_batch_size=12", "train.micro_batch_size=2"],
                ["a", "b", "c"], faults=HardwareFaults(FlippedBit(rank=2, step=BAD_AT, bit=3)))
    event = next(e for e in got["events"] if e["kind"] == "silent data corruption")
    step_s = {step: s for step, _, s in got["steps"]}
    median = statistics.median(step_s.values())
    return {"flipped_before_step": BAD_AT + 1, "detected_before_step": event["step"] + 1,
            "healed_step_s": step_s[event["step"] + 1], "median_step_s": median,
            "heal_s": step_s[event["step"] + 1] - median, "kinds": [e["kind"] for e in
                                                                     got["events"]]}


def _test_job(data: str) -> list[str]:
    return ["model.preset=tiny", f"data.path={data}", f"data.seed={SEED}",
            f"train.global_batch_size={G}", "train.micro_batch_size=4", "train.max_steps=56",
            "train.warmup_steps=5", "train.lr=3e-3", "train.dtype=float32",
            "checkpoint.every_steps=10", "checkpoint.keep=3", "tracking.enabled=false",
            "eval.samples=0", "train.log_every=1000", "data.prefetch_steps=2",
            "health.spike_steps=2", "health.spike_window=20", "health.spike_min_history=10",
            "health.straggler_action=off"]


def _dataset(tmp: str) -> str:
    import sysconfig

    from data_pipelines.tokenize_job import prepare_data

    out = f"{tmp}/stdlib"
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))[:40]
    prepare_data(files, out, tokenizer="bytes", seq_len=64, engine="local", progress=False,
                 max_bytes=500_000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", default="overhead,spike,hardware,sdc")
    ap.add_argument("--json")
    args = ap.parse_args()
    parts = {"overhead": lambda data, tmp: overhead(data, tmp, args.steps, args.repeats),
             "overhead_fsdp": lambda data, tmp: overhead(data, tmp, args.steps, args.repeats,
                                                         hsdp=False),
             "spike": spike, "hardware": hardware, "gradient": gradient, "sdc": sdc}
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp:
        data = _dataset(tmp)
        out = {name: parts[name](data, tmp) for name in args.parts.split(",")}
        out["load_average"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
