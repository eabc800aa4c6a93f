"""The trained model into its MLflow run, twice: a Hugging Face directory (`model_hf/`) and an
mlflow.pytorch model (`model`). The driver passes `log_final_model` to
`elastic_gpt.tracking.publish.finish_run`, which keeps tracking itself free of model code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

from elastic_gpt.tracking.client import mlflow_client


def log_final_model(uri: str, run_id: str, checkpoint_url: str, step: int = 0) -> str:
    """Log the trained model twice: `model_hf/` (config.json + safetensors for the family's
    transformers class, GPT2LMHeadModel or LlamaForCausalLM) and an mlflow.pytorch model named
    `model`; returns the
    latter's URI (also in the run's `elastic_gpt.model_uri` tag). Leaves the run FINISHED."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from elastic_gpt.inference.generate import load_model
    from elastic_gpt.inference.hf_export import export_hf

    client = mlflow_client(uri)
    with tempfile.TemporaryDirectory() as tmp:
        client.log_artifacts(run_id, export_hf(checkpoint_url, os.path.join(tmp, "hf")),
                             artifact_path="model_hf")
    model, _ = load_model(checkpoint_url)
    signature = ModelSignature(  # token ids (B, T) -> logits (B, T, vocab)
        inputs=Schema([TensorSpec(np.dtype(np.int64), (-1, -1))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1, model.cfg.vocab_size))]))
    import elastic_gpt
    package_dir = os.path.dirname(os.path.abspath(elastic_gpt.__file__))
    # Inside the run, so MLflow files the logged model under the run's experiment (otherwise:
    # the default experiment 0, whose artifacts a sqlite store puts in ./mlruns of the cwd).
    with _tracking_uri(uri), _quiet("mlflow"), mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model, name="model", run_id=run_id, step=step, signature=signature,
            serialization_format="pickle",
            code_paths=[package_dir],  # loads where elastic_gpt is not installed
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    client.set_tag(run_id, "elastic_gpt.model_uri", info.model_uri)
    return info.model_uri


@contextlib.contextmanager
def _tracking_uri(uri: str):
    """mlflow.<flavor>.log_model logs to the global tracking URI: point it at ours meanwhile,
    then restore both the global and the MLFLOW_TRACKING_URI variable (set_tracking_uri sets it)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils
    old_global, old_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old_global)
        if old_env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


@contextlib.contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)

