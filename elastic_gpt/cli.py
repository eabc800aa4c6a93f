"""The `elastic-gpt` command, and the one error boundary of every subcommand (C6 clear errors).

An error the user can fix (config, paths, permissions, credentials, unreachable services, corrupt
data, bad arguments: `errors.user_error_line` decides) prints one line
`elastic-gpt <cmd>: error: <what>; <how to fix>` and exits 2, with the traceback only under
-v/--verbose. A run that failed more often than its failure budget allows
(`errors.FailureBudgetSpent`) prints `elastic-gpt train: failed: ...` and exits 1. Any other
exception is a bug in elastic-gpt: its traceback is shown, exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from elastic_gpt.arguments import non_negative_float, positive_int
from elastic_gpt.console import first_line, say, setup_logging
from elastic_gpt.errors import FailureBudgetSpent, exit_for_error


def _train(args) -> int:
    from elastic_gpt.config import load_config
    from elastic_gpt.elastic.launcher import run_training

    cfg = load_config(args.config, args.overrides)
    summary = run_training(cfg, config_path=args.config)
    g = summary["goodput"]
    say(f"[elastic-gpt] done: step {summary['step']}, checkpoint {summary['checkpoint']}")
    say(f"[elastic-gpt] goodput {g['goodput']:.1%}: productive {g['productive_s']:.0f}s, "
        f"slow {g.get('slow_s', 0):.0f}s, "
        f"recovery {g['recovery_s']:.0f}s, checkpoint {g['checkpoint_s']:.0f}s, "
        f"evaluation {g.get('eval_s', 0):.0f}s, lost "
        f"{g['lost_s']:.0f}s ({g['lost_steps']} steps re-done), {g['events']} event(s)"
        + (f"; {g['degraded_s']:.0f}s of the productive time with fewer replica groups"
           if g.get("degraded_s") else ""))
    for e in summary["events"]:
        if "from_groups" in e:  # replica groups (C7 all-or-nothing step): the run went on
            say(f"[elastic-gpt]   {e['kind']} at step {e['step']}: {e['detail']}")
            continue
        say(f"[elastic-gpt]   {e['kind']}: W {e['from_world_size']} -> {e['to_world_size']} "
            f"at step {e['resumed_from_step']}, recovered in {e.get('recovery_s', 0):.1f}s, "
            f"{e['lost_steps']} step(s) re-done ({e['detail'][:80]})")
    if summary["run_id"]:
        say(f"[elastic-gpt] MLflow run {summary['run_id']} in {cfg.tracking.uri}")
        say(f"[elastic-gpt] look at it with: mlflow ui --backend-store-uri {cfg.tracking.uri}")
    return 0


def _generate(args) -> int:
    from elastic_gpt.inference.generate import sample_text

    say(sample_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                    seed=args.seed))
    return 0


def _export_hf(args) -> int:
    from elastic_gpt.inference.hf_export import architecture, export_hf

    out = export_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    say(f"[elastic-gpt] wrote {out}/config.json and its safetensors weights (load with "
        f"transformers.{architecture(args.checkpoint)}.from_pretrained)")
    return 0


def _import_hf(args) -> int:
    from elastic_gpt.inference.hf_import import import_hf, training_overrides

    url, cfg = import_hf(args.directory, args.out, seq_len=args.seq_len)
    say(f"[elastic-gpt] wrote {url}: {cfg.describe()}, weights only (the optimizer starts "
        "fresh)")
    keys = training_overrides(cfg)
    say(f"[elastic-gpt] continue pretraining with: elastic-gpt train --config CONFIG "
        f"checkpoint.path={args.out} {keys}" if keys else
        f"[elastic-gpt] continue pretraining with checkpoint.path={args.out} and "
        f"checkpoint.init_from={args.directory} (its shape is the directory's)")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line like every other user error (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elastic-gpt", description="Elastic GPT pretraining on Ray.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from data_pipelines import cli as prepare_cli
    prep = sub.add_parser("prepare-data", help="tokenize a raw corpus into token shards",
                          description="Tokenize text from any fsspec URL or glob into fixed-length "
                                      "token shards plus manifest.json (a Ray Data job).")
    prepare_cli.add_cli_arguments(prep)
    prep.set_defaults(func=prepare_cli.run_from_args)

    tr = sub.add_parser("train", help="train (or resume) a run",
                        description="Train a GPT with FSDP2 on Ray Train workers. Connects to "
                                    "RAY_ADDRESS when set, else starts a local Ray cluster. "
                                    "Resumes from the newest committed checkpoint.")
    tr.add_argument("--config", required=True, help="YAML config, e.g. jobs/configs/mini.yaml")
    tr.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted overrides, e.g. train.max_steps=200 scaling.max_workers=4")
    tr.set_defaults(func=_train)

    gen = sub.add_parser("generate", help="sample text from a checkpoint",
                         description="Sample from a checkpoint (a run's checkpoint root: newest "
                                     "committed step; or one step_<N> directory).")
    gen.add_argument("--checkpoint", required=True, help="checkpoint root or step directory URL")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=positive_int, default=100)
    gen.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)

    ex = sub.add_parser("export-hf", help="export a checkpoint as a Hugging Face model",
                        description="Write config.json + safetensors loadable by the family's "
                                    "transformers class (GPT2LMHeadModel, LlamaForCausalLM) "
                                    "with from_pretrained(DIR); shards and an index when large.")
    ex.add_argument("--checkpoint", required=True, help="checkpoint root or step directory URL")
    ex.add_argument("--out", required=True, help="output directory (new or empty)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace the files of an earlier export in a non-empty --out")
    ex.set_defaults(func=_export_hf)

    im = sub.add_parser("import-hf", help="a Hugging Face model directory as a checkpoint",
                        description="Write a GPT-2 or Llama Hugging Face directory (config.json + "
                                    "safetensors) as the step-0 checkpoint of a new checkpoint "
                                    "root, which `train` with checkpoint.path=OUT resumes at "
                                    "any layout.")
    im.add_argument("directory", metavar="DIR", help="local Hugging Face model directory")
    im.add_argument("--out", required=True, help="new checkpoint root (local path or URL)")
    im.add_argument("--seq-len", type=positive_int, default=None,
                    help="the context the run trains at (a GPT-2's learned positions are cut "
                         "to it; default: the directory's)")
    im.set_defaults(func=_import_hf)

    for name, module, text in [("plan", "elastic_gpt.planner.cli", "capacity plan: memory, speed, cost"),
                               ("dry-run", "elastic_gpt.dry_run.cli",
                                "the trainer's build and step at full scale, on one CPU"),
                               ("tune", "elastic_gpt.planner.tune", "measure candidates on the cluster")]:
        try:
            mod = __import__(module, fromlist=["add_cli_arguments"])
        except ImportError:
            continue
        sp = sub.add_parser(name, help=text, description=(mod.__doc__ or text).strip())
        mod.add_cli_arguments(sp)
        sp.set_defaults(func=mod.run_from_args)
        if name == "plan":
            sp.add_argument("--dry-run", action="store_true",
                            help="then run the trainer's build and one step of the chosen layout "
                                 "for each rank that differs, on fake tensors (elastic-gpt "
                                 "dry-run); exit 2 if a rank does not build or fit")
            sp.set_defaults(func=_plan)
    return p


def _plan(args) -> int:
    """`plan`, and with --dry-run the dry run of the layout it chooses (which imports torch in
    the ranks' processes only; `plan` alone imports none)."""
    if not args.dry_run:
        from elastic_gpt.planner.cli import run_from_args
        return run_from_args(args)
    from elastic_gpt.dry_run.cli import plan_and_dry_run
    return plan_and_dry_run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stdout.isatty():  # no colour codes in a log file or a job's log
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    prog = f"elastic-gpt {args.command}"
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; resume by running the same command again", file=sys.stderr)
        return 130
    except FailureBudgetSpent as e:  # the run stopped as configured: no traceback, not exit 2
        if args.verbose:
            traceback.print_exc()
        print(f"{prog}: failed: {first_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:
        return exit_for_error(prog, e, args.verbose, "elastic-gpt")


if __name__ == "__main__":
    sys.exit(main())
