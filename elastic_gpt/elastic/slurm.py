"""Slurm allocations as an elastic run's Ray nodes: which node belongs to which Slurm job, Slurm's
warning signal turned into drains of those nodes, and how early that warning must come.

deploy/slurm/ starts one Ray cluster per training job (`elastic-gpt.sbatch`) and lets a second
allocation join it (`grow.sbatch`). `ray-node.sh` gives every Ray node these labels:

    elastic-gpt/slurm-job   the Slurm job whose allocation holds the node
    elastic-gpt/slurm-run   the main job of the run: the one whose head the node joined
    elastic-gpt/node-role   head | worker

Nodes are chosen by label, never by IP: several raylets share a host (the head beside a worker on
the first node; emulated Slurm nodes), and a node's IP says nothing about which job owns it. The
head is never drained: it holds the GCS, the driver and Ray Train's controller and no training
worker, so once its job's workers are drained the run has nowhere to restart, and it stays up
until the job ends.

What a warning costs (docs/slurm.md): the trainer sees the drain within a membership poll, ends
the step in flight, takes its just-in-time checkpoint at that step boundary (C2 data order: the
rerun resumes at that step, nothing is repeated or skipped) and leaves the drained nodes. A
drained raylet does not exit by itself (Ray Train keeps a stopped group's actors until it starts
the next), so `drain` waits for the run's record of that stop instead; then the batch script
requeues the main job, or a grow job ends, and the job's end stops its Ray steps.

The command line the batch scripts call:

    python -m elastic_gpt.elastic.slurm lead (--plan plan.json | --step-s S --checkpoint-s C)
    python -m elastic_gpt.elastic.slurm free-ports N
    python -m elastic_gpt.elastic.slurm wait-nodes --address HEAD:PORT --job J --count N
    python -m elastic_gpt.elastic.slurm drain --address HEAD:PORT (--job J | --run J)

Ray is reached only through `ray_internals` and the drain path of `preemption.py`; importing this
module imports no Ray.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import socket
import subprocess
import sys
import time

from elastic_gpt.arguments import non_negative_float, positive_float, positive_int
from elastic_gpt.console import first_line, say
from elastic_gpt.elastic import preemption, ray_internals
from elastic_gpt.elastic.membership import KV_NAMESPACE, STOP_RECORDS

JOB_LABEL = "elastic-gpt/slurm-job"
RUN_LABEL = "elastic-gpt/slurm-run"
ROLE_LABEL = "elastic-gpt/node-role"

# The parts of the warning's lead that do not scale with the model (seconds; allowances of several
# times what tests/system/test_slurm.py's run takes on two busy cores): the drain helper's start (Python,
# then Ray's GCS client), the run's stop being seen, and the requeue (the driver closing its MLflow
# run, `scontrol requeue`).
HELPER_START_S = 10.0
LEAVE_S = 10.0
REQUEUE_S = 10.0
LEAD_MARGIN = 1.5  # on the step and the checkpoint write, which vary from one to the next


# ---- the lead -----------------------------------------------------------------------------------

def lead_seconds(step_s: float, checkpoint_s: float) -> int:
    """How long before the end of the allocation Slurm's warning must come (`--signal=B:USR1@N`)
    for the just-in-time checkpoint to be committed and the job requeued in time.

    The drain is seen within a membership poll, and rides on the next step's all-reduce: a drain
    seen just after one step's all-reduce lets that step finish and one more run before the
    group stops, so two steps; then the checkpoint is written. Slurm sends the warning up to a
    minute early, never late, so the lead is a lower bound on the time there is."""
    variable = LEAD_MARGIN * (2 * step_s + checkpoint_s)
    return math.ceil(variable + HELPER_START_S + LEAVE_S + REQUEUE_S)


def plan_times(path: str) -> tuple[float, float]:
    """(step_s, ckpt_write_s) of an `elastic-gpt plan --json` output."""
    try:
        with open(path) as f:
            plan = json.load(f)
        return float(plan["step_s"]), float(plan["ckpt_write_s"])
    except FileNotFoundError:
        raise ValueError(f"--plan {path} does not exist; write one with "
                         "`elastic-gpt plan ... --json > plan.json`") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--plan {path} is not an `elastic-gpt plan --json` output ({first_line(e)}); "
                         "write it again, or pass --step-s and --checkpoint-s") from None


# ---- Slurm --------------------------------------------------------------------------------------

def parse_time_left(text: str) -> float | None:
    """Seconds of `squeue -o %L` ("[days-][hours:]minutes:seconds"); None when unlimited or
    unknown."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def time_left_s(job_id: str) -> float | None:
    """What is left of a Slurm job's time, from squeue; None if it has no limit or squeue fails."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_time_left(out.stdout) if out.returncode == 0 else None


# ---- Ray nodes by label ---------------------------------------------------------------------------

def labelled_nodes(address: str, label: str, value: str) -> list[str]:
    """Alive worker nodes whose `label` is `value`, never the head (whatever its labels say)."""
    nodes = ray_internals.alive_node_labels(address)
    return sorted(node for node, (labels, is_head) in nodes.items()
                  if labels.get(label) == value and not is_head
                  and labels.get(ROLE_LABEL, "worker") == "worker")


def drain_nodes(address: str, nodes: list[str], reason: str, deadline_s: float | None) -> list[str]:
    """Drain `nodes` through the spot-notice path (reason PREEMPTION: the raylet cannot refuse
    it, and the trainer's membership watcher reacts as to a cloud notice). Returns those the GCS
    accepted."""
    return [node for node in nodes
            if preemption.drain_node(node, deadline_s, "preemption", reason, address)]


def stop_records(address: str) -> dict[bytes, bytes]:
    """Why each run in this cluster last stopped an attempt (`membership.RunRecords`'
    last_restart and last_failure): rank 0 writes its planned restart once the just-in-time
    checkpoint is committed, the failure policy a failure."""
    return {key: value for key, value in ray_internals.kv_items_at(address, KV_NAMESPACE).items()
            if key.decode(errors="replace").rsplit("/", 1)[-1] in STOP_RECORDS}


def wait_left(address: str, nodes: list[str], before: dict[bytes, bytes], timeout_s: float,
              poll_s: float = 0.5) -> bool:
    """Wait until the run has left the drained `nodes`: an attempt stopped since `before` (its
    checkpoint committed, or it failed), or nothing holds resources on them any more (no group
    was there, or the next one started elsewhere and the old one was released). A drained node
    does not exit by itself: Ray Train keeps a stopped group's actors until it starts the next.
    Returns False if `timeout_s` ran out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stopped = stop_records(address).items() - before.items()
            busy = set(nodes) & ray_internals.nodes_in_use(address)
            if stopped or not busy:
                return True
        except Exception:  # a GCS blip: ask again
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nothing on this host listens on now (held open together, so the OS
    gives distinct ones)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# ---- the command line -----------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m elastic_gpt.elastic.slurm",
                description="Slurm allocations as an elastic run's Ray nodes (deploy/slurm/).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lead = sub.add_parser("lead", help="seconds of warning to ask for: --signal=B:USR1@<lead>")
    lead.add_argument("--plan", help="an `elastic-gpt plan --json` output (its step_s and "
                                     "ckpt_write_s)")
    lead.add_argument("--step-s", type=positive_float, help="seconds per step (a run's "
                                                            "train/step_time_s)")
    lead.add_argument("--checkpoint-s", type=non_negative_float,
                      help="seconds to write a checkpoint (a run's checkpoint commit time)")

    ports = sub.add_parser("free-ports", help="free ports on this host, one per line")
    ports.add_argument("count", type=positive_int)

    wait = sub.add_parser("wait-nodes", help="wait until a Slurm job's worker nodes joined")
    wait.add_argument("--address", required=True, help="the head's GCS, HOST:PORT")
    wait.add_argument("--job", required=True, help="the Slurm job id on the nodes' label")
    wait.add_argument("--count", type=positive_int, required=True)
    wait.add_argument("--timeout-s", type=positive_float, default=300.0)

    drain = sub.add_parser("drain", help="drain a Slurm job's Ray worker nodes and wait until "
                                         "they have left")
    drain.add_argument("--address", required=True, help="the head's GCS, HOST:PORT")
    which = drain.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", help="the nodes of this Slurm job's own allocation (a grow job)")
    which.add_argument("--run", help="every worker node of the run this main job heads, its grow "
                                     "jobs' included")
    drain.add_argument("--reason", default="Slurm warning")
    drain.add_argument("--deadline-s", type=positive_float,
                       help="when the nodes go away (default: the job's time left, from squeue)")
    drain.add_argument("--wait-s", type=non_negative_float,
                       help="wait at most this long for the run to leave them (default: until "
                            f"{REQUEUE_S:.0f} s before the deadline)")
    return p


def _lead(args) -> int:
    if args.plan is not None:
        if args.step_s is not None or args.checkpoint_s is not None:
            raise ValueError("pass --plan or --step-s/--checkpoint-s, not both")
        step_s, checkpoint_s = plan_times(args.plan)
    elif args.step_s is None or args.checkpoint_s is None:
        raise ValueError("pass --plan plan.json, or both --step-s and --checkpoint-s (a run's "
                         "train/step_time_s and its checkpoint commit time)")
    else:
        step_s, checkpoint_s = args.step_s, args.checkpoint_s
    print(lead_seconds(step_s, checkpoint_s))
    return 0


def _wait_nodes(args) -> int:
    deadline = time.monotonic() + args.timeout_s
    joined: list[str] = []
    while time.monotonic() < deadline:
        try:
            joined = labelled_nodes(args.address, JOB_LABEL, args.job)
        except Exception:  # the head's GCS is still starting
            joined = []
        if len(joined) >= args.count:
            say(f"[elastic-gpt] slurm: {len(joined)} Ray worker node(s) of job {args.job} joined")
            return 0
        time.sleep(0.5)
    raise TimeoutError(f"{len(joined)} of {args.count} Ray worker nodes of Slurm job {args.job} "
                       f"joined {args.address} within {args.timeout_s:.0f} s; see the job's "
                       "ray-node logs")


def _drain(args) -> int:
    label, value = (JOB_LABEL, args.job) if args.job else (RUN_LABEL, args.run)
    deadline_s = args.deadline_s
    if deadline_s is None:
        deadline_s = time_left_s(args.job or args.run)
    nodes = labelled_nodes(args.address, label, value)
    before = stop_records(args.address)
    accepted = drain_nodes(args.address, nodes, args.reason, deadline_s)
    when = f"; the allocation ends in {deadline_s:.0f} s" if deadline_s else ""
    say(f"[elastic-gpt] slurm: drained {len(accepted)} of {len(nodes)} Ray worker node(s) with "
        f"{label}={value} ({args.reason}){when}")
    wait_s = args.wait_s
    if wait_s is None:
        wait_s = max(0.0, deadline_s - REQUEUE_S) if deadline_s else 600.0
    t0 = time.monotonic()
    if not wait_left(args.address, accepted, before, wait_s):
        say(f"[elastic-gpt] slurm: the run had not left the drained nodes after {wait_s:.0f} s")
        return 1
    say(f"[elastic-gpt] slurm: the run left the drained nodes after {time.monotonic() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"python -m elastic_gpt.elastic.slurm {args.command}"
    try:
        if args.command == "lead":
            return _lead(args)
        if args.command == "free-ports":
            print("\n".join(map(str, free_ports(args.count))))
            return 0
        if args.command == "wait-nodes":
            return _wait_nodes(args)
        return _drain(args)
    except (ValueError, TimeoutError, ConnectionError) as e:
        print(f"{prog}: error: {first_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the imported module rather than __main__, so names resolve as everywhere else.
    from elastic_gpt.elastic.slurm import main as _main
    sys.exit(_main())
