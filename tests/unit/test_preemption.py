"""The spot-notice watcher's command line on its own: the `none` provider only listens for
SIGTERM, and a bad node id or reason is a ValueError."""

from __future__ import annotations

import pytest

from elastic_gpt.elastic import preemption

# ----------------------------------------------------------------- endpoint protocol, no Ray


def test_provider_none_only_listens_for_sigterm():
    source = preemption.make_notice_source("none")
    assert source.poll() is None
    with pytest.raises(ValueError, match="provider='azure'"):
        preemption.make_notice_source("azure")


def test_bad_node_id_and_reason_are_value_errors():
    with pytest.raises(ValueError, match="node_id='nope'"):
        preemption.drain_node("nope", 30)
    with pytest.raises(ValueError, match="reason='bored'"):
        preemption.drain_node("ab" * 28, 30, reason="bored")


# ----------------------------------------------------------------- real Ray cluster


