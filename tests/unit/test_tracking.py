"""MLflow tracking's pieces that need no store: secrets redacted in lines, params and the
environment, and the metric names table."""

from __future__ import annotations

import pytest

from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.tracking.redaction import MASK, redact, redacted_params, register_secrets_in

# ---------------------------------------------------------------------------- redaction

@pytest.mark.parametrize("text, secret", [
    ("http://alice:hunter2hunter2@mlflow:5000/api", "hunter2hunter2"),
    ("s3://b/k?X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20240101&X-Amz-Signature=deadbeef0123",
     "deadbeef0123"),
    ("https://acct.blob.core.windows.net/c/b?sv=2020-08-04&sig=AbCdEf123%3D&se=x", "AbCdEf123"),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature=0a1b2c3d4e5f", "0a1b2c3d4e5f"),
    ("https://ghp_abcdefghijklmnopqrstuvwxyz0123456789@github.com/o/r.git",
     "ghp_abcdefghijklmnopqrstuvwxyz0123456789"),
    ("aws_secret_access_key = wJalrXUtnFEMIK7MDENG", "wJalrXUtnFEMIK7MDENG"),
    ('{"password": "correct-horse", "user": "bob"}', "correct-horse"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload", "eyJhbGciOiJIUzI1NiJ9"),
    ("key id AKIAIOSFODNN7EXAMPLE in a message", "AKIAIOSFODNN7EXAMPLE"),
    ("https://host/p?access_token=ya29.a0AfH6SMB&x=1", "ya29.a0AfH6SMB"),
])
def test_redact_masks_credentials(text, secret):
    out = redact(text)
    assert secret not in out and MASK in out


def test_redact_leaves_ordinary_text_alone(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    for text in ["[elastic-gpt] step 3/6 | loss 4.1 | 9,155 tok/s | W=2 accum=1",
                 "tokenizer: gpt2, num_tokens=1050985, tokens_per_s 12.5",
                 "file:///work/main/data/stdlib s3://bucket/runs/tiny ssh://git@github.com/o/r",
                 "checkpoint.keep=3 data.num_tokens=100 RAY_AUTH_MODE=disabled"]:
        assert redact(text) == text


def test_secret_environment_values_and_registered_secrets_are_masked(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_API_KEY", "k-7f3a9c2e1b")
    monkeypatch.setenv("SOME_PATH", "k-not-a-secret")
    register_secrets_in({"tracking": {"uri": "https://u:Pa55-w0rd-x@h/"}})
    out = redact("k-7f3a9c2e1b k-not-a-secret decoded: Pa55-w0rd-x")
    assert out == "*** k-not-a-secret decoded: ***"
    params = redacted_params({"tracking.uri": "https://u:Pa55-w0rd-x@h/",
                                       "storage.secret_key": "abc", "data.num_tokens": 7})
    assert params == {"tracking.uri": "https://u:***@h/", "storage.secret_key": "***",
                      "data.num_tokens": 7}


# ---------------------------------------------------------------------------- local store


def test_metric_names_table_orders_the_training_view_first():
    """MLflow draws one chart group per prefix, in code-point order, with `system/` on its own
    tab: the Model metrics page must start with train/ then val/."""
    names = [*mn.STEP_METRICS, *mn.VAL_METRICS, mn.GOODPUT, mn.cluster("nodes"),
             mn.EVENT_RECOVERY_S, mn.source_samples_seen("code")]
    model_page = sorted({n.rsplit("/", 1)[0] for n in names if not n.startswith("system/")})
    assert model_page == ["train", "val"]
    assert len(set(mn.OLD_NAMES.values())) == len(mn.OLD_NAMES)
    assert not any(mn.is_known(old) for old in mn.OLD_NAMES.values())


# ---------------------------------------------------------------------------- bad input (C6 clear
# errors)


# ---------------------------------------------------------------------------- mlflow server


