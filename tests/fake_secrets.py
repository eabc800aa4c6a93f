"""Secrets the tests plant in a run's configuration and environment, to check that none of them
reaches MLflow, a log or the console (tracking/redaction.py)."""

PASSWORD = "pw-Zq81xLmT0pSecret"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"
HF_TOKEN = "hf_" + "Ab1" * 12
SECRETS = (PASSWORD, AWS_SECRET, HF_TOKEN)
