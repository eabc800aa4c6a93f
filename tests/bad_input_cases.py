"""Bad input, as a new user makes it, across every subcommand (C6 clear errors): the cases, the
world of files they point at, and how one is run. Each case must exit 2 with one
`elastic-gpt <cmd>: error: <what>; <fix>` line, no traceback, and leave every dataset, checkpoint
and MLflow store byte-for-byte as it was (tests/unit/test_bad_input.py runs the cases that start
nothing, tests/integration/test_bad_input.py those that need a server or a mount,
tests/system/test_bad_input.py those that reach Ray).

The cases are one table (CASES). docs/operations.md's failure table is rendered from it and a unit
test checks the copy there is current; after changing a case run
`.venv/bin/python -m tests.bad_input_cases --write-docs`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.file_trees import tree_digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs", "operations.md")
TABLE_START = "<!-- bad-input table: generated from tests/bad_input_cases.py, do not edit -->"
TABLE_END = "<!-- end of bad-input table -->"
# What a case reaches beyond this process: a socket of a server the world starts (S3), a mount,
# or Ray. The unit tests run the others.
NEEDS_SERVER = ("s3", "s3-auth", "mount", "socket")
NEEDS_RAY = "ray"


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]        # after `elastic-gpt`; {w.name} fields come from the World
    says: str                    # a fragment of the one error line
    what: str                    # the bad input, in words, for the docs table
    env: tuple[tuple[str, str | None], ...] = ()  # None unsets
    needs: str = ""              # NEEDS_SERVER or NEEDS_RAY: where the case runs

    @property
    def command(self) -> str:
        return self.argv[0]


def train(*overrides: str) -> tuple[str, ...]:
    return ("train", "--config", "jobs/configs/mini.yaml", "model.preset=tiny",
            "data.path={w.data}", "checkpoint.path={w.ckpt}", "tracking.uri={w.mlflow}",
            "train.max_steps=8", *overrides)


NO_AWS_CREDENTIALS = (("AWS_ACCESS_KEY_ID", None), ("AWS_SECRET_ACCESS_KEY", None),
                      ("AWS_SESSION_TOKEN", None), ("AWS_EC2_METADATA_DISABLED", "true"),
                      ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"),
                      ("AWS_CONFIG_FILE", "/nonexistent"), ("AWS_ENDPOINT_URL", "{w.s3}"))
REFUSED_ENDPOINT = (("AWS_ENDPOINT_URL", "http://127.0.0.1:{w.closed_port}"),
                    ("AWS_MAX_ATTEMPTS", "1"), ("AWS_RETRY_MODE", "standard"))

CASES = [
    # ---- train: the config file and overrides
    Case("config-missing", ("train", "--config", "missing.yaml"),
         "config file missing.yaml does not exist", "--config names no file"),
    Case("config-is-folder", ("train", "--config", "{w.root}"), "is a folder",
         "--config names a folder"),
    Case("config-bad-yaml", ("train", "--config", "{w.bad_yaml}"),
         "is not valid YAML at line 4, column 1: expected ',' or ']', but got '<stream end>' (while "
         "parsing a flow sequence at line 3, column 14)", "a YAML syntax error"),
    Case("config-empty", ("train", "--config", "{w.empty_yaml}"), "data.path is empty",
         "an empty config file"),
    Case("config-a-list", ("train", "--config", "{w.list_yaml}"), "must be a mapping of sections",
         "a config that is a YAML list"),
    Case("config-binary", ("train", "--config", "{w.binary_yaml}"), "cannot be read",
         "a config file that is not text"),
    Case("unknown-key", train("train.lrr=1"), "unknown config key 'train.lrr'",
         "a misspelt key"),
    Case("unknown-section", train("trian.lr=1"), "unknown config key 'trian.lr'",
         "a misspelt section"),
    Case("override-without-equals", train("train.lr"), "must look like section.key=value",
         "an override without `=`"),
    Case("lr-nan", train("train.lr=.nan"), "train.lr=nan must be a finite number",
         "`train.lr=.nan`"),
    Case("grad-clip-inf", train("train.grad_clip=.inf"), "must be a finite number",
         "`train.grad_clip=.inf`"),
    Case("lr-negative", train("train.lr=-1"), "train.lr=-1.0 must be > 0", "a negative lr"),
    Case("max-steps-zero", train("train.max_steps=0"), "train.max_steps=0 must be at least 1",
         "`train.max_steps=0`"),
    Case("warmup-negative", train("train.warmup_steps=-1"), "must be at least 0",
         "a negative warm-up"),
    Case("batch-not-multiple", train("train.global_batch_size=10"),
         "is not a multiple of train.micro_batch_size=4", "a global batch the micro-batch does "
         "not divide"),
    Case("workers-inverted", train("scaling.max_workers=1"), "is below scaling.min_workers",
         "max_workers below min_workers"),
    Case("preset-unknown", train("model.preset=huge"), "model.preset='huge' is unknown",
         "an unknown model preset"),
    Case("dropout-out-of-range", train("model.dropout=1.5"), "must be in [0, 1)",
         "dropout of 1.5"),
    Case("dtype-unknown", train("train.dtype=float16"), "must be auto, float32 or bfloat16",
         "an unsupported dtype"),
    Case("tp-not-dividing-workers", train("parallel.tp=3"), "must be multiples of parallel.tp=3",
         "tp that does not divide the workers"),
    Case("tp-not-dividing-heads", train("parallel.tp=4", "scaling.min_workers=4",
                                        "scaling.max_workers=4"),
         "does not divide model.n_head=2", "tp that does not divide the heads"),
    Case("tp-not-dividing-kv-heads", train("model.preset=llama3-tiny", "model.n_kv_head=1",
                                           "parallel.tp=2"),
         "parallel.tp=2 does not divide model.n_kv_head=1 (each tensor-parallel rank needs whole "
         "key/value heads", "tp that does not divide a Llama's key/value heads"),
    Case("llama-key-on-gpt2", train("model.n_kv_head=2"),
         "model.n_kv_head is not a setting of the gpt2 family", "a Llama key on a GPT-2 model"),
    Case("init-from-nothing", train("checkpoint.init_from={w.root}/no-hf-dir"),
         "no-hf-dir is not a directory", "checkpoint.init_from names nothing"),
    Case("init-from-no-config", train("checkpoint.init_from={w.root}"), "has no config.json",
         "checkpoint.init_from a folder without config.json"),
    Case("pp-not-whole-pipelines", train("parallel.pp=2", "scaling.min_workers=2",
                                         "scaling.max_workers=3"),
         "must be multiples of parallel.tp x parallel.pp=2 (workers come in whole pipelines)",
         "workers that are not whole pipelines"),
    Case("pp-more-stages-than-blocks", train("parallel.pp=2", "parallel.pp_stages_per_rank=2",
                                             "parallel.pp_schedule=interleaved_1f1b"),
         "stages need at least one block each, and the model has 2",
         "more pipeline stages than blocks"),
    Case("pp-step-below-stages", train("parallel.pp=2", "train.global_batch_size=2",
                                       "train.micro_batch_size=2"),
         "fewer than its parallel.pp=2 stages", "a step too small to fill the pipeline"),
    Case("sources-empty", train("data.path=", "data.sources=[]"), "data.sources is an empty list",
         "an empty mixture"),
    Case("sources-zero-weight", train("data.path=", "data.sources=[{{path: x, weight: 0}}]"),
         "weight=0 must be a finite number > 0", "a mixture weight of 0"),
    Case("eval-samples-negative", train("eval.samples=-1"), "eval.samples=-1 must be at least 0",
         "negative eval samples"),
    # ---- train: the dataset
    Case("data-missing", train("data.path={w.root}/no-such-dataset"), "is not a prepared dataset",
         "data.path names nothing"),
    Case("data-is-file", train("data.path={w.a_file}"), "is a file, not a dataset folder",
         "data.path names a file"),
    Case("data-bad-manifest", train("data.path={w.bad_manifest}"), "is not valid JSON",
         "a manifest.json that is not JSON"),
    Case("data-truncated-shard", train("data.path={w.truncated}"),
         "shard-00000.bin has", "a shard cut short after prepare-data"),
    Case("data-missing-shard", train("data.path={w.missing_shard}"), "shard-00000.bin is missing",
         "a shard deleted after prepare-data"),
    Case("data-missing-index", train("data.path={w.missing_index}"), "shard-00000.idx is missing",
         "a shard's index deleted"),
    Case("data-other-tokenizer", train("data.path={w.gpt2_data}"),
         "is for another model shape", "a dataset of another tokenizer than the checkpoint's"),
    Case("sources-other-tokenizer", train("data.path=", "data.sources=[{{path: '{w.data}'}}, "
                                                        "{{path: '{w.gpt2_data}'}}]"),
         "data.sources[1]", "a mixture of datasets of two tokenizers"),
    Case("eval-path-missing", train("eval.path={w.root}/no-such-val"),
         "no-such-val", "eval.path names nothing"),
    # ---- train: the checkpoint
    Case("checkpoint-other-shape", train("checkpoint.path={w.other_shape}"),
         "is for another model shape (n_layer: checkpoint 3 vs config 2",
         "a checkpoint of another run's model shape"),
    Case("checkpoint-other-batch", train("train.global_batch_size=8"),
         "was trained with train.global_batch_size=16", "a changed global batch on resume"),
    Case("checkpoint-under-proc", train("checkpoint.path=/proc/elastic-gpt/ckpt"),
         "checkpoint.path file:///proc/elastic-gpt/ckpt", "checkpoint.path under /proc"),
    Case("checkpoint-under-file", train("checkpoint.path={w.a_file}/ckpt"),
         "is under a file, not a folder", "checkpoint.path under a regular file"),
    Case("checkpoint-read-only", train("checkpoint.path={w.read_only}/ckpt"),
         "cannot be written", "a read-only checkpoint folder", needs="mount"),
    Case("checkpoint-s3-no-credentials", train("checkpoint.path=s3://ckpts/run"),
         "refused access", "an s3:// checkpoint path without credentials",
         env=NO_AWS_CREDENTIALS, needs="s3"),
    Case("checkpoint-s3-wrong-credentials", train("checkpoint.path=s3://ckpts/run"),
         "refused access", "an s3:// checkpoint path with unknown credentials",
         env=(("AWS_ACCESS_KEY_ID", "nobody"), ("AWS_SECRET_ACCESS_KEY", "wrong"),
              ("AWS_ENDPOINT_URL", "{w.s3}")), needs="s3-auth"),
    Case("checkpoint-s3-refused", train("checkpoint.path=s3://ckpts/run"), "is unreachable",
         "an S3 endpoint that refuses connections", env=REFUSED_ENDPOINT, needs="s3"),
    # ---- train: tracking and Ray
    Case("tracking-folder-missing", train("tracking.uri=sqlite:///{w.root}/no/such/mlflow.db"),
         "/no/such does not exist", "a sqlite tracking store in a missing folder"),
    Case("tracking-under-file", train("tracking.uri=sqlite:///{w.a_file}/mlflow.db"),
         "is a file, not a folder", "a sqlite store under a regular file"),
    Case("tracking-is-folder", train("tracking.uri=sqlite:///{w.root}"), "names a folder",
         "a sqlite store that is a folder"),
    Case("replica-groups-uneven", train("elastic.replica_groups=3", "scaling.max_workers=4"),
         "elastic.replica_groups=3 must divide scaling.max_workers=4 into groups",
         "replica groups that do not divide the workers"),
    Case("ray-address-not-a-host", train(), "RAY_ADDRESS=notahost",
         "`RAY_ADDRESS=notahost`", env=(("RAY_ADDRESS", "notahost"),), needs="ray"),
    Case("ray-address-closed-port", train(), "cannot reach the Ray cluster at RAY_ADDRESS",
         "RAY_ADDRESS at a port nothing listens on",
         env=(("RAY_ADDRESS", "127.0.0.1:{w.closed_port}"),), needs="socket"),
    # ---- generate
    Case("generate-negative-temperature", ("generate", "--checkpoint", "{w.ckpt}", "--prompt",
                                           "def", "--temperature", "-1"),
         "argument --temperature: -1 is not a number >= 0", "`--temperature -1`"),
    Case("generate-negative-tokens", ("generate", "--checkpoint", "{w.ckpt}", "--prompt", "def",
                                      "--max-new-tokens", "-5"),
         "argument --max-new-tokens: -5 is not a positive integer", "`--max-new-tokens -5`"),
    Case("generate-zero-tokens", ("generate", "--checkpoint", "{w.ckpt}", "--prompt", "def",
                                  "--max-new-tokens", "0"),
         "0 is not a positive integer", "`--max-new-tokens 0`"),
    Case("generate-no-prompt", ("generate", "--checkpoint", "{w.ckpt}"),
         "the following arguments are required: --prompt", "no --prompt"),
    Case("generate-no-checkpoint", ("generate", "--checkpoint", "{w.root}/none", "--prompt", "x"),
         "no committed checkpoint under", "--checkpoint names nothing"),
    Case("generate-empty-folder", ("generate", "--checkpoint", "{w.empty}", "--prompt", "x"),
         "no committed checkpoint under", "--checkpoint an empty folder"),
    Case("generate-torn-step", ("generate", "--checkpoint", "{w.torn}", "--prompt", "x"),
         "is not usable", "--checkpoint a step folder with a shard missing"),
    Case("generate-s3-no-credentials", ("generate", "--checkpoint", "s3://ckpts/run", "--prompt",
                                        "x"),
         "refused", "--checkpoint s3:// without credentials", env=NO_AWS_CREDENTIALS, needs="s3"),
    # ---- export-hf
    Case("export-out-is-file", ("export-hf", "--checkpoint", "{w.ckpt}", "--out", "{w.a_file}"),
         "is a file, not a folder", "--out names a file"),
    Case("export-out-under-proc", ("export-hf", "--checkpoint", "{w.ckpt}", "--out",
                                   "/proc/elastic-gpt/hf"),
         "--out /proc/elastic-gpt/hf cannot be written", "--out under /proc"),
    Case("export-out-not-empty", ("export-hf", "--checkpoint", "{w.ckpt}", "--out",
                                  "{w.nonempty}"),
         "is not empty (config.json); name a new folder, or pass --overwrite",
         "--out a folder with an earlier export"),
    Case("export-no-checkpoint", ("export-hf", "--checkpoint", "{w.root}/none", "--out",
                                  "{w.root}/hf-new"),
         "no committed checkpoint under", "--checkpoint names nothing"),
    Case("export-s3-no-credentials", ("export-hf", "--checkpoint", "s3://ckpts/run", "--out",
                                      "{w.root}/hf-s3"),
         "refused", "--checkpoint s3:// without credentials", env=NO_AWS_CREDENTIALS, needs="s3"),
    # ---- import-hf
    Case("import-no-directory", ("import-hf", "{w.root}/no-hf-dir", "--out", "{w.root}/imported"),
         "no-hf-dir is not a directory", "DIR names nothing"),
    Case("import-no-config", ("import-hf", "{w.root}", "--out", "{w.root}/imported"),
         "has no config.json", "DIR without config.json"),
    Case("import-no-out", ("import-hf", "{w.root}"), "the following arguments are required: --out",
         "no --out"),
    # ---- plan
    Case("plan-zero-batch", ("plan", "--global-batch-size", "0"),
         "argument --global-batch-size: 0 is not a positive integer", "`--global-batch-size 0`"),
    Case("plan-negative-gpus", ("plan", "--gpus", "-8"), "-8 is not a positive integer",
         "`--gpus -8`"),
    Case("plan-zero-gpus", ("plan", "--gpus", "0"), "0 is not a positive integer", "`--gpus 0`"),
    Case("plan-zero-efficiency", ("plan", "--efficiency", "0"), "0 is not a number in (0, 1]",
         "`--efficiency 0`"),
    Case("plan-negative-tokens", ("plan", "--tokens=-5B"), "is not a positive count",
         "`--tokens -5B`"),
    Case("plan-nan-bandwidth", ("plan", "--inter-node-bw", "nan"), "nan is not a number > 0",
         "`--inter-node-bw nan`"),
    Case("plan-unknown-gpu", ("plan", "--gpu", "B300"), "unknown GPU 'B300'", "an unknown GPU"),
    Case("plan-bad-tp", ("plan", "--model", "gpt3-1.3b", "--tp", "3"), "--tp=3 must be one of",
         "`--tp 3`"),
    Case("plan-pp-stages-beyond-blocks", ("plan", "--model", "gpt2-124m", "--gpus", "8", "--pp",
                                          "4", "--pp-stages-per-rank", "4"),
         "--pp-stages-per-rank=4 x --pp=4 stages need at least one block each",
         "more pipeline stages than blocks"),
    Case("plan-float8-without-fp8-cores", ("plan", "--gpu", "A100-80GB", "--dtype", "float8"),
         "--dtype float8 needs float8 tensor cores", "`--dtype float8` on an A100"),
    Case("plan-write-config-under-proc", ("plan", "--write-config", "/proc/elastic-gpt/p.yaml"),
         "--write-config /proc/elastic-gpt/p.yaml cannot be written",
         "--write-config under /proc"),
    Case("plan-write-config-folder", ("plan", "--write-config", "{w.root}"), "is a folder",
         "--write-config names a folder"),
    # ---- dry-run
    Case("dry-run-float8", ("dry-run", "--gpu", "H100-80GB", "--dtype", "float8"),
         "the dry run runs bf16 linears", "`--dtype float8` (torchao needs a GPU to trace)"),
    Case("dry-run-config-missing", ("dry-run", "--config", "missing.yaml"),
         "config file missing.yaml does not exist", "--config names no file"),
    Case("dry-run-rank-beyond-world", ("dry-run", "--model", "gpt2-124m", "--gpus", "8",
                                       "--ranks", "0,8"),
         "--ranks 0,8 must be comma-separated ranks in [0, 8)", "a rank past the world"),
    Case("dry-run-ranks-not-numbers", ("dry-run", "--ranks", "first"),
         "--ranks first must be comma-separated ranks", "`--ranks first`"),
    # ---- prepare-data
    Case("prepare-no-input", ("prepare-data", "--input", "{w.root}/nothing-*.txt", "--output",
                              "{w.root}/out"),
         "matched no files", "--input matches no file"),
    Case("prepare-bad-tokenizer", ("prepare-data", "--input", "{w.a_file}", "--output",
                                   "{w.root}/out", "--tokenizer", "no-such-tokenizer"),
         "no-such-tokenizer", "an unknown tokenizer"),
    Case("prepare-binary-input", ("prepare-data", "--input", "{w.binary_yaml}", "--output",
                                  "{w.root}/out"),
         "looks binary", "a binary file as input"),
    Case("prepare-output-under-proc", ("prepare-data", "--input", "{w.a_file}", "--output",
                                       "/proc/elastic-gpt/data"),
         "output directory /proc/elastic-gpt/data", "--output under /proc"),
    Case("prepare-output-is-file", ("prepare-data", "--input", "{w.a_file}", "--output",
                                    "{w.a_file}"),
         "is an existing file, not a directory", "--output names a file"),
    Case("prepare-zero-seq-len", ("prepare-data", "--input", "{w.a_file}", "--output",
                                  "{w.root}/out", "--seq-len", "0"),
         "--seq-len must be positive", "`--seq-len 0`"),
    Case("prepare-val-fraction-too-big", ("prepare-data", "--input", "{w.a_file}", "--output",
                                          "{w.root}/out", "--val-fraction", "1.5"),
         "--val-fraction must be in [0, 1)", "`--val-fraction 1.5`"),
    # ---- tune
    Case("tune-config-missing", ("tune", "--config", "missing.yaml"),
         "config file missing.yaml does not exist", "--config names no file"),
    Case("tune-pp-not-whole-pipelines", ("tune", "--config", "jobs/configs/mini.yaml",
                                         "model.preset=tiny", "data.path={w.data}", "--pp", "1,3"),
         "are not whole pipelines of --pp=3 x --tp=1/2 ranks; use --pp in",
         "`--pp 1,3` on 2 workers"),
    Case("tune-pp-more-stages-than-blocks", ("tune", "--config", "jobs/configs/mini.yaml",
                                             "model.preset=tiny", "data.path={w.data}", "--pp",
                                             "2", "--pp-stages-per-rank", "2"),
         "--pp=2 x --pp-stages-per-rank=2 stages need at least one block each, and "
         "model.n_layer=2", "`--pp 2 --pp-stages-per-rank 2` for a model of 2 blocks"),
]


# ----------------------------------------------------------------------------- the world


class World:
    """Everything a case may point at, under one folder whose digest must not change."""

    def __init__(self, root: str, dataset: str):
        from data_pipelines.tokenize_job import prepare_data
        from elastic_gpt.checkpoint.sharded import save_sharded
        from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname
        from elastic_gpt.config import load_config, resolve_paths
        from elastic_gpt.data.manifest import load_manifest
        from elastic_gpt.model.config import GPTConfig
        from elastic_gpt.model.gpt import GPT
        from elastic_gpt.tracking.runs import resolve_run
        from elastic_gpt.train.model_config import model_config_for

        self.root = root
        j = lambda *p: os.path.join(root, *p)  # noqa: E731
        self.data = j("data", "good")
        shutil.copytree(dataset, self.data)
        for name in ("truncated", "missing_shard", "missing_index", "bad_manifest"):
            shutil.copytree(dataset, j("data", name))
            setattr(self, name, j("data", name))
        with open(j("data", "truncated", "shard-00000.bin"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
        os.remove(j("data", "missing_shard", "shard-00000.bin"))
        os.remove(j("data", "missing_index", "shard-00000.idx"))
        with open(j("data", "bad_manifest", "manifest.json"), "w") as f:
            f.write("{not json")
        self.gpt2_data = j("data", "gpt2")
        sample = j("sample.py")
        with open(sample, "w") as f:
            f.write("def add(a, b):\n    return a + b\n" * 200)
        prepare_data([sample], self.gpt2_data, tokenizer="gpt2", seq_len=64, engine="local",
                     progress=False)
        self.a_file = sample

        os.makedirs(j("configs", "adir"))
        self.bad_yaml, self.empty_yaml, self.list_yaml, self.binary_yaml = (
            j("configs", n) for n in ("bad.yaml", "empty.yaml", "list.yaml", "binary.yaml"))
        with open(self.bad_yaml, "w") as f:
            f.write("train:\n  lr: 3e-4\n  max_steps: [1, 2\n")
        open(self.empty_yaml, "w").close()
        with open(self.list_yaml, "w") as f:
            f.write("- train\n- lr\n")
        with open(self.binary_yaml, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00" * 64)

        # A finished run: a committed checkpoint of the config the train cases use, and its
        # MLflow run, FINISHED, in the store they point at.
        self.ckpt = j("ckpt", "run")
        self.mlflow = f"sqlite:///{j('mlflow', 'mlflow.db')}"
        os.makedirs(j("mlflow"))
        cfg = resolve_paths(load_config("jobs/configs/mini.yaml", [
            "model.preset=tiny", f"data.path={self.data}", f"checkpoint.path={self.ckpt}",
            f"tracking.uri={self.mlflow}"]))
        gpt_cfg = model_config_for(cfg, load_manifest(cfg.data.path))
        run_id = resolve_run(self.mlflow, "elastic-gpt", "mini", None, {"train.lr": 1})
        import mlflow
        mlflow.MlflowClient(self.mlflow).set_terminated(run_id, "FINISHED")
        self._commit(CheckpointStore(cfg.checkpoint.path), gpt_cfg, 4, cfg.data.path, run_id,
                     GPT, save_sharded, step_dirname)
        self.other_shape = j("ckpt", "other_shape")
        other = GPTConfig(**{**gpt_cfg.shape(), "n_layer": 3})
        self._commit(CheckpointStore(self.other_shape), other, 2, cfg.data.path, None, GPT,
                     save_sharded, step_dirname)
        self.torn = j("ckpt", "torn", step_dirname(4))
        shutil.copytree(os.path.join(self.ckpt, step_dirname(4)), self.torn)
        os.remove(next(os.path.join(self.torn, f) for f in os.listdir(self.torn)
                       if f.endswith(".distcp")))
        self.empty = j("ckpt", "empty")
        os.makedirs(self.empty)
        self.nonempty = j("export", "earlier")
        os.makedirs(self.nonempty)
        with open(os.path.join(self.nonempty, "config.json"), "w") as f:
            f.write("{}")
        self.read_only = j("read_only")
        self.s3 = ""
        self.closed_port = 0  # with servers: a port nothing listens on

    @staticmethod
    def _commit(store, gpt_cfg, step, data_url, run_id, GPT, save_sharded, step_dirname):
        store.prepare_step_dir(step)
        save_sharded(store.url(step_dirname(step)), GPT(gpt_cfg), None)
        store.commit(step, {"step": step, "samples_seen": step * 16, "model_shape": gpt_cfg.shape(),
                            "global_batch_size": 16, "mlflow_run_id": run_id,
                            "data": {"url": "file://" + data_url}})
        if run_id:
            store.write_run_info({"mlflow_run_id": run_id, "run_name": "mini"})

    def digest(self) -> str:
        """Every folder and file (path and bytes) under the world."""
        return tree_digest(self.root)

    def runs(self) -> list[tuple]:
        import mlflow
        client = mlflow.MlflowClient(self.mlflow)
        out = []
        for exp in client.search_experiments():
            for r in client.search_runs([exp.experiment_id]):
                out.append((r.info.run_id, r.info.status, r.info.end_time,
                            tuple(sorted(r.data.tags.items())), tuple(sorted(r.data.params))))
        return out


def _can_mount() -> bool:
    probe = "/tmp/elastic_gpt_mount_probe"
    os.makedirs(probe, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", probe], capture_output=True)
    return ok


def make_world(root: str, dataset: str, servers: bool):
    """The world; with `servers`, also a read-only mount (where root may mount) and a loopback S3
    server with a bucket. A generator: the fixtures yield what it yields."""
    w = World(root, dataset)
    mounted = []
    if servers and _can_mount():
        os.makedirs(w.read_only)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", w.read_only],
                       check=True)
        mounted.append(w.read_only)
    server = None
    if servers:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            w.closed_port = probe.getsockname()[1]
        from elastic_gpt.testing.s3_server import S3Server
        server = S3Server()
        server.make_bucket("ckpts")
        w.s3 = server.endpoint
    w.server = server
    yield w
    if server:
        server.stop()
    for m in mounted:
        subprocess.run(["umount", m], capture_output=True)


def _fill(text: str, w: World) -> str:
    return text.format(w=w)


def run_case(case: Case, w: World, monkeypatch, capsys) -> tuple[int, str]:
    from elastic_gpt.cli import main

    if case.needs == "mount" and not os.path.ismount(w.read_only):
        pytest.skip("mounting a read-only tmpfs needs root with CAP_SYS_ADMIN")
    if case.needs.startswith("s3") and not w.s3:
        pytest.skip("moto is not installed")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in case.env:
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, _fill(v, w))
    argv = [_fill(a, w) for a in case.argv]
    capsys.readouterr()
    # s3fs keeps one filesystem per set of arguments, with the credentials it found when it was
    # made: none is reused from before this case's environment, or after it (a case without
    # credentials would leave the next test of the process one that has none).
    _forget_s3_filesystems()
    try:
        if case.needs == "s3-auth":
            with w.server.enforce_credentials():
                code = _exit_code(main, argv)
        else:
            code = _exit_code(main, argv)
    finally:
        _forget_s3_filesystems()
    out = capsys.readouterr()
    return code, out.out + out.err


def _forget_s3_filesystems() -> None:
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()


def _exit_code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return int(e.code or 0)


def assert_one_line_exit_2_and_nothing_changed(case: Case, world: World, monkeypatch,
                                               capsys) -> None:
    before, runs_before = world.digest(), world.runs()
    code, output = run_case(case, world, monkeypatch, capsys)
    lines = [ln for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert code == 2, output
    assert len(errors) == 1 and errors[0] == lines[-1], output
    assert errors[0].startswith(f"elastic-gpt {case.command}: error: "), output
    assert _fill(case.says, world) in errors[0], output
    assert "Traceback" not in output, output
    assert world.runs() == runs_before
    assert world.digest() == before, "the case changed a file of the world"


# ----------------------------------------------------------------------------- the docs table


def render_table() -> str:
    rows = ["| command | bad input | the one line says (exit 2) |", "|---|---|---|"]
    for c in CASES:
        says = c.says.replace("|", "\\|").replace("{w.", "{")
        rows.append(f"| `{c.command}` | {c.what} | `{says}` |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


def write_docs() -> None:
    with open(DOCS) as f:
        text = f.read()
    if TABLE_START in text:
        text = text[:text.index(TABLE_START)] + render_table() + \
            text[text.index(TABLE_END) + len(TABLE_END):]
    else:
        text = text.rstrip("\n") + "\n\n" + render_table() + "\n"
    with open(DOCS, "w") as f:
        f.write(text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        write_docs()
    else:
        print(json.dumps([dataclasses.asdict(c) for c in CASES], indent=1))
