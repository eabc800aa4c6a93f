"""elastic-gpt: elastic, fault-tolerant GPT pretraining on Ray Train with FSDP2 (see README.md)."""

import os

# MLflow's usage telemetry is on by default, and its background thread unsets an environment
# variable while other threads read the environment: a tracking call then fails at random with a
# KeyError. It is off in every process that imports this package (drivers, workers, tests, the
# servers they start) before MLflow is imported; MLFLOW_DISABLE_TELEMETRY=false turns it on.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
