"""The replica groups' Lighthouse's quorum rules (elastic/lighthouse.py), torchft's, on its own
state: a valid quorum waits for healthy stragglers until the join timeout, a silent group is
dropped after the heartbeat timeout, fast quorum and shrink-only follow the previous one."""

from __future__ import annotations

from elastic_gpt.elastic.lighthouse import (
    PB,
    Joined,
    QuorumOptions,
    QuorumState,
    quorum_compute,
)


def _member(replica_id: str, step: int = 1, shrink_only: bool = False, address: str = ""):
    return PB["QuorumMember"](replica_id=replica_id, address=address, step=step, world_size=1,
                              shrink_only=shrink_only)


def _join(state: QuorumState, replica_id: str, now: float, **kw) -> None:
    state.participants[replica_id] = Joined(now, _member(replica_id, **kw))
    state.heartbeats[replica_id] = now


# ---- torchft's rules (its src/lighthouse.rs tests, case by case) -----------------------------


def test_a_valid_quorum_waits_for_healthy_stragglers_until_the_join_timeout():
    opt = QuorumOptions(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
    state, now = QuorumState(), 1000.0
    members, reason = quorum_compute(now, state, opt)
    assert members is None and "need min_replicas 1 [0/0 participants healthy]" in reason
    _join(state, "a", now)
    _join(state, "b", now)
    members, reason = quorum_compute(now, state, opt)
    assert [m.replica_id for m in members] == ["a", "b"], reason
    state.heartbeats["c"] = now  # healthy, not joined: waited for
    members, reason = quorum_compute(now, state, opt)
    assert members is None and "join timeout" in reason
    state.participants["a"].joined = now - 61.0
    members, reason = quorum_compute(now, state, opt)
    assert [m.replica_id for m in members] == ["a", "b"], reason


def test_a_silent_group_is_dropped_after_the_heartbeat_timeout_and_half_is_split_brain():
    opt = QuorumOptions(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
    state, now = QuorumState(), 1000.0
    _join(state, "a", now)
    state.heartbeats["b"] = now - 1.0  # heartbeating, not joined: one of two is not a quorum
    members, reason = quorum_compute(now, state, opt)
    assert members is None and "at least half of 2 healthy" in reason
    state.heartbeats["b"] = now - 5.0
    members, reason = quorum_compute(now, state, opt)
    assert [m.replica_id for m in members] == ["a"], reason
    _join(state, "c", now)
    state.heartbeats["c"] = now - 6.0  # joined, but silent since: not a member
    assert [m.replica_id for m in quorum_compute(now, state, opt)[0]] == ["a"]


def test_fast_quorum_and_shrink_only_follow_the_previous_quorum():
    opt = QuorumOptions(min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
    state, now = QuorumState(), 1000.0
    state.prev_quorum = PB["Quorum"](quorum_id=1, participants=[_member("a"), _member("b")])
    _join(state, "a", now)
    state.heartbeats["c"] = now  # a healthy newcomer does not hold up a fast quorum
    members, reason = quorum_compute(now, state, opt)
    assert members is None  # b has not joined again yet
    _join(state, "b", now)
    members, reason = quorum_compute(now, state, opt)
    assert reason.startswith("Fast quorum") and [m.replica_id for m in members] == ["a", "b"]
    _join(state, "c", now, shrink_only=True)  # shrink only: nobody new comes in
    members, reason = quorum_compute(now, state, opt)
    assert [m.replica_id for m in members] == ["a", "b"], reason


# ---- the server with real torchft managers -----------------------------------------------------


