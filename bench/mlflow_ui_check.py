"""What a user sees in MLflow's UI, checked in a real browser (headless Chromium).

    .venv/bin/python bench/mlflow_ui_check.py [--keep DIR] [--screenshots DIR]

Trains a tiny model for a few steps (the real `Trainer` in one gloo process, no Ray) into a real
`mlflow server`, through the project's own tracking code: the run set-up (`resolve_run`: the
experiment-kind tag, params, the dataset input), the background `MetricLogger`, the evaluations,
the goodput metrics, the cluster-shape metrics and the end-of-run publishing. Then it opens, each
in a fresh browser profile:

1. the experiment link the driver prints (`runs.training_view_url`): it must land on the
   training view (the runs table, not the GenAI overview);
2. the bare experiment URL, to report which view MLflow picks on its own;
3. the run's "Model metrics" page: its first chart group must be `train`, then `val`;
4. the run's "System metrics" page, to report where the goodput, cluster and debug groups went.

Prints what it found, one line per page, and exits 1 if a check fails. Without a Chromium it
prints `SKIP: <why>` and exits 0 (Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
RUN_NAME = "ui-check"
STEPS = 6


def find_browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


# ---- a run made by a short real training ---------------------------------------------------------

def _train_worker(rank: int, world: int, overrides: list[str], uri: str, run_id: str) -> int:
    from elastic_gpt.config import load_config
    from elastic_gpt.tracking.metric_logger import MetricLogger
    from elastic_gpt.train.trainer import Trainer

    sink = MetricLogger(uri, run_id)
    try:
        Trainer(load_config(None, overrides), rank=rank, world_size=world, mlflow_run_id=run_id,
                metrics=sink).train()
    finally:
        sink.flush(30)
        sink.close()
    return 0


def make_run(work: str, uri: str) -> tuple[str, str]:
    """(experiment id, run id) of a finished tiny run on the server at `uri`."""
    import mlflow
    from mlflow.entities import Metric

    from data_pipelines.tokenize_job import prepare_data
    from elastic_gpt.config import load_config, resolve_paths
    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.testing.gloo import run_gloo
    from elastic_gpt.tracking import metric_names as mn
    from elastic_gpt.tracking.publish import finish_run
    from elastic_gpt.tracking.runs import dataset_descriptions, resolve_run
    from elastic_gpt.train.model_config import model_config_for

    data = os.path.join(work, "stdlib")
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))[:10]
    prepare_data(files, data, tokenizer="bytes", seq_len=32, engine="local", progress=False,
                 max_bytes=80_000, val_fraction=0.2, val_seed=1)
    overrides = ["model.preset=tiny", f"data.path={data}", "train.global_batch_size=4",
                 "train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.warmup_steps=1",
                 "train.log_every=1", f"checkpoint.path={work}/ckpt", "checkpoint.every_steps=3",
                 "eval.every_steps=2", "eval.samples=4", "scaling.max_workers=1",
                 "scaling.min_workers=1", f"tracking.uri={uri}", f"run.name={RUN_NAME}"]
    cfg = resolve_paths(load_config(None, overrides))
    manifest = load_manifest(cfg.data.path)
    gpt_cfg = model_config_for(cfg, manifest)
    run_id = resolve_run(uri, cfg.tracking.experiment, RUN_NAME, None, cfg.flat(),
                         added_params={f"model.resolved.{k}": v
                                       for k, v in gpt_cfg.shape().items()},
                         datasets=dataset_descriptions([manifest]))
    run_gloo(_train_worker, 1, overrides, uri, run_id)
    client = mlflow.MlflowClient(uri)
    # What log_cluster_shape logs at a submission (it asks Ray for the shape; here: this host).
    client.log_batch(run_id, metrics=[Metric(mn.cluster(k), float(v), int(time.time() * 1000), 0)
                                      for k, v in (("nodes", 1), ("cpus", os.cpu_count()),
                                                   ("gpus", 0))])
    from elastic_gpt.checkpoint.store import CheckpointStore
    final = CheckpointStore(cfg.checkpoint.path).latest()
    finish_run(uri, run_id, finished=True, config=cfg.to_dict(), ledger=final.state["ledger"],
               step=final.step)
    return client.get_run(run_id).info.experiment_id, run_id


# ---- the browser -------------------------------------------------------------------------------

def dump_dom(browser: str, url: str, budget_ms: int, screenshot: str | None = None) -> str:
    """The page's DOM after `budget_ms` of virtual time, in a fresh profile (no remembered
    UI state: what a first visit sees)."""
    with tempfile.TemporaryDirectory(prefix="ui-check-profile-") as profile:
        base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                "--window-size=1400,1800", f"--virtual-time-budget={budget_ms}"]
        out = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True,
                             timeout=180)
        if screenshot:
            subprocess.run([*base, f"--screenshot={screenshot}", url], capture_output=True,
                           timeout=180)
    return out.stdout


def page_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dom)).split())


def links(dom: str) -> list[str]:
    return [html.unescape(h) for h in re.findall(r'href="([^"]*)"', dom)]


def chart_groups(text: str) -> list[str]:
    """The chart-group headers of a run's metrics page, in page order ("train (9) Add chart")."""
    start = text.find("Auto-refresh")
    return re.findall(r"((?:Model|System) metrics|\S+) \(\d+\) Add chart",
                      text[start:] if start >= 0 else text)


def view_of(dom: str, experiment_id: str) -> str:
    """Which view an experiment page shows, from its navigation links."""
    hrefs = links(dom)
    if any(f"experiments/{experiment_id}/overview" in h or "workflowType=genai" in h
           for h in hrefs):
        return "GenAI (overview, traces)"
    if any(f"experiments/{experiment_id}/runs" in h and "workflowType=machine_learning" in h
           for h in hrefs):
        return "model training (runs)"
    return "unknown"


def check(browser: str, server: str, experiment_id: str, run_id: str,
          shots: str | None) -> list[tuple[str, bool, str]]:
    from elastic_gpt.tracking.runs import training_view_url

    def dom(url: str, name: str, ready) -> str:
        for budget in (15_000, 30_000, 60_000):  # a slow machine needs more virtual time
            got = dump_dom(browser, url, budget,
                           os.path.join(shots, name + ".png") if shots else None)
            if ready(got):
                break
        return got

    results = []
    url = training_view_url(server, experiment_id)
    d = dom(url, "experiment", lambda d: view_of(d, experiment_id) != "unknown")
    view = view_of(d, experiment_id)
    shows_run = RUN_NAME in page_text(d)
    results.append(("experiment link printed by the driver", view.startswith("model training")
                    and shows_run, f"{url} -> {view}; run {RUN_NAME!r} "
                    f"{'listed' if shows_run else 'NOT listed'}"))

    bare = server.rstrip("/") + f"/#/experiments/{experiment_id}"
    d = dom(bare, "experiment-bare", lambda d: view_of(d, experiment_id) != "unknown")
    # Informational: MLflow 3.17's UI takes the view from a per-browser switch (default GenAI)
    # and not from the experiment's tag, so a first visit without the query lands on GenAI.
    results.append(("bare experiment URL, first visit (information)", True,
                    f"{bare} -> {view_of(d, experiment_id)}"))

    url = training_view_url(server, experiment_id, run_id)
    d = dom(url, "run-model-metrics", lambda d: bool(chart_groups(page_text(d))))
    groups = chart_groups(page_text(d))
    results.append(("run's Model metrics page", groups[:2] == ["train", "val"],
                    f"chart groups in order: {groups}"))

    url = url.replace("/model-metrics?", "/system-metrics?")
    d = dom(url, "run-system-metrics", lambda d: bool(chart_groups(page_text(d))))
    results.append(("run's System metrics page (information)", True,
                    f"chart groups in order: {chart_groups(page_text(d))}"))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", help="make the server's store and the run here, and keep them")
    ap.add_argument("--screenshots", help="save a PNG of each page here")
    args = ap.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print(f"SKIP: no Chromium on PATH (looked for {', '.join(BROWSERS)}); on Debian: "
              "apt-get install chromium")
        return 0
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    from elastic_gpt.testing.mlflow_server import MlflowServer

    work = args.keep or tempfile.mkdtemp(prefix="mlflow-ui-check-")
    os.makedirs(work, exist_ok=True)
    if args.screenshots:
        os.makedirs(args.screenshots, exist_ok=True)
    version = subprocess.run([browser, "--version"], capture_output=True, text=True).stdout
    import mlflow
    print(f"[ui-check] {version.strip()}; MLflow {mlflow.__version__}")
    server = MlflowServer(os.path.join(work, "server"))
    try:
        t0 = time.time()
        experiment_id, run_id = make_run(work, server.uri)
        print(f"[ui-check] run {run_id} ({RUN_NAME!r}, {STEPS} steps) in experiment "
              f"{experiment_id} on {server.uri}, made in {time.time() - t0:.0f}s")
        results = check(browser, server.uri, experiment_id, run_id, args.screenshots)
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for name, ok, detail in results:
        print(f"[ui-check] {'PASS' if ok else 'FAIL'} {name}: {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
