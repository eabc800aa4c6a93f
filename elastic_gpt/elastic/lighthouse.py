"""The replica groups' Lighthouse (C7 all-or-nothing step): torchft's quorum service, told when a
group is gone.

torchft's `Manager` (one per process; the Rust `ManagerServer` of each group's rank 0) speaks to a
Lighthouse over gRPC (`torchft.LighthouseService`: `Quorum`, a long poll that returns the next
quorum this group is part of, and `Heartbeat`). This module serves that protocol with torchft's own
quorum rules (`quorum_compute`, ported from torchft's `src/lighthouse.rs`: fast quorum, minimum
size, split-brain refusal, the join timeout for stragglers, the quorum id bumped on a membership
change or a commit failure). torchft's Manager, process groups and healing are used as they are.

What torchft 0.2.0's Lighthouse cannot do is learn that a group is gone before its heartbeats have
been silent for the whole timeout: it has no "leave" request, and while the silent group still
counts as healthy it refuses the survivors' quorum (one of two is not more than half) or waits the
join timeout for it. That wait is the survivors' stall for every lost group, and for a drained
group that left cleanly. Two additions end it:

- **Leave.** A group's rank 0 says `Leave` (a method of this server's own `elastic_gpt.Lighthouse`
  service; the training side's half, `LighthouseClient`, is `parallel/lighthouse_client.py`) when
  it takes part in no more steps: after a drain's last commit, at the end, or on its way out after
  an error. The group is forgotten at once; heartbeats still on the wire from it are ignored until
  it asks for a quorum again (a new process).
- **Probe.** While a quorum waits for a healthy group that has not joined, the Lighthouse tries a
  TCP connection to that group's manager (the address in its last quorum request). A refused
  connection means the process that serves it is gone (killed, crashed, its node's processes
  killed): the group is forgotten at once. Only an address that accepted a probe before counts,
  so a firewall that rejects the probe never evicts a healthy group. A process that is alive but
  stuck (accepts, never answers) or a node that vanished from the network (no answer at all) is
  left to the heartbeat timeout, as in torchft.

Forgetting a group is what the heartbeat timeout does, only sooner: a group that was wrongly
forgotten asks for its next quorum like any late group, is behind, and heals from a live peer.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from elastic_gpt.parallel import lighthouse_client as leave_protocol

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5
"""A probe that neither connects nor is refused by then is no verdict (the heartbeat decides)."""


def _messages() -> dict:
    """torchft.proto's Lighthouse messages (field numbers as torchft's), built at import time
    from a descriptor: no generated code to keep in step with the protobuf runtime. Fields a
    newer torchft adds are kept as unknown fields and sent back unchanged."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="elastic_gpt_torchft_lighthouse.proto",
                                              package="torchft", syntax="proto3",
                                              dependency=["google/protobuf/timestamp.proto"])

    def message(name: str, *fields: tuple) -> None:
        m = file.message_type.add(name=name)
        for fname, number, ftype, *rest in fields:
            field_proto = m.field.add(name=fname, number=number, type=ftype,
                                      label=f.LABEL_REPEATED if "repeated" in rest
                                      else f.LABEL_OPTIONAL)
            if ftype == f.TYPE_MESSAGE:
                field_proto.type_name = rest[0]

    message("QuorumMember", ("replica_id", 1, f.TYPE_STRING), ("address", 2, f.TYPE_STRING),
            ("store_address", 3, f.TYPE_STRING), ("step", 4, f.TYPE_INT64),
            ("world_size", 5, f.TYPE_UINT64), ("shrink_only", 6, f.TYPE_BOOL),
            ("data", 7, f.TYPE_STRING), ("commit_failures", 8, f.TYPE_INT64))
    message("Quorum", ("quorum_id", 1, f.TYPE_INT64),
            ("participants", 2, f.TYPE_MESSAGE, ".torchft.QuorumMember", "repeated"),
            ("created", 3, f.TYPE_MESSAGE, ".google.protobuf.Timestamp"))
    message("LighthouseQuorumRequest", ("requester", 1, f.TYPE_MESSAGE, ".torchft.QuorumMember"))
    message("LighthouseQuorumResponse", ("quorum", 1, f.TYPE_MESSAGE, ".torchft.Quorum"))
    message("LighthouseHeartbeatRequest", ("replica_id", 1, f.TYPE_STRING))
    message("LighthouseHeartbeatResponse")

    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(
        timestamp_pb2.DESCRIPTOR.serialized_pb))
    pool.Add(file)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"torchft.{m.name}"))
            for m in file.message_type}


PB = _messages()


# ---- torchft's quorum rules --------------------------------------------------------------------


@dataclass
class QuorumOptions:
    min_replicas: int = 1
    join_timeout_ms: int = 60_000
    """How long a valid quorum waits for healthy groups that have not asked to join."""
    heartbeat_timeout_ms: int = 5_000
    """A group silent this long is no longer healthy."""


@dataclass
class Joined:
    """A group waiting in a `Quorum` call: when it asked, and what it sent."""
    joined: float
    member: object  # PB["QuorumMember"]


@dataclass
class QuorumState:
    participants: dict[str, Joined] = field(default_factory=dict)
    heartbeats: dict[str, float] = field(default_factory=dict)
    """replica id -> time of its last heartbeat (a quorum request is one too)."""
    prev_quorum: object | None = None  # PB["Quorum"]
    quorum_id: int = 0


def quorum_compute(now: float, state: QuorumState, opt: QuorumOptions) -> tuple[list | None, str]:
    """The members of the quorum to issue now (sorted by replica id), or None and why not: the
    rules of torchft's `quorum_compute`, in its order."""
    healthy = {r for r, t in state.heartbeats.items()
               if now - t < opt.heartbeat_timeout_ms / 1000}
    joined = {r: d for r, d in state.participants.items() if r in healthy}
    candidates = sorted((d.member for d in joined.values()), key=lambda m: m.replica_id)
    shrink_only = any(d.member.shrink_only for d in joined.values())
    meta = (f"[{len(joined)}/{len(state.participants)} participants healthy]"
            f"[{len(healthy)} heartbeating][shrink_only={str(shrink_only).lower()}]")
    if state.prev_quorum is not None:
        prev_ids = {p.replica_id for p in state.prev_quorum.participants}
        if shrink_only:
            candidates = [m for m in candidates if m.replica_id in prev_ids]
        # Fast quorum: every member of the previous quorum has joined again.
        if all(p in joined for p in prev_ids):
            return candidates, f"Fast quorum found! {meta}"
    if len(joined) < opt.min_replicas:
        return None, (f"New quorum not ready, only have {len(joined)} participants, need "
                      f"min_replicas {opt.min_replicas} {meta}")
    # Split brain: a quorum needs more than half of the groups that are heartbeating.
    if len(joined) <= len(healthy) // 2:
        return None, (f"New quorum not ready, only have {len(joined)} participants, need at "
                      f"least half of {len(healthy)} healthy workers {meta}")
    first_joined = min((d.joined for d in joined.values()), default=now)
    if len(joined) != len(healthy) and now - first_joined < opt.join_timeout_ms / 1000:
        return None, (f"Valid quorum with {len(joined)} participants, waiting for "
                      f"{len(healthy) - len(joined)} healthy but not participating stragglers "
                      f"due to join timeout {meta}")
    return candidates, f"Valid quorum found {meta}"


def _ids(members) -> list[str]:
    return [m.replica_id for m in members]


# ---- the server --------------------------------------------------------------------------------


@dataclass
class Departure:
    """A member of a quorum that is not in the next one, and why."""
    at: float
    replica_id: str
    why: str
    """"left", "probe refused" (forgotten at once), "heartbeat timeout" (silent for the whole
    timeout) or "join timeout" (healthy, but late for the join timeout)."""
    waited_s: float | None = None
    """How long the longest-waiting group had been in its quorum call when this one was dropped
    (None: nobody was waiting): the Lighthouse's own share of the survivors' stall."""


class LighthouseServer:
    """Serves torchft's `LighthouseService` (and `Leave`) on `bind_host`, a free port. The
    options are torchft's `LighthouseServer`'s; `address()` is what `torchft.Manager` takes."""

    ISSUED_KEPT = 16
    """Quorums kept for callers that have not looked yet (torchft's broadcast channel holds 16)."""

    def __init__(self, *, min_replicas: int = 1, join_timeout_ms: int = 60_000,
                 quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5_000,
                 probe_interval_ms: int = 20, bind_host: str = "[::]", max_workers: int = 64,
                 on_departure=None):
        """`on_departure(Departure)` is called (with the lock held: keep it short) for each
        group that drops out of the quorum, once, with how the Lighthouse learnt of it."""
        import grpc

        self._grpc = grpc
        self.opt = QuorumOptions(min_replicas, join_timeout_ms, heartbeat_timeout_ms)
        self.tick_s, self.probe_interval_s = quorum_tick_ms / 1000, probe_interval_ms / 1000
        self.state = QuorumState()
        self.on_departure = on_departure or (lambda departure: None)
        self._cond = threading.Condition()
        self._issued: deque = deque(maxlen=self.ISSUED_KEPT)  # (sequence number, quorum)
        self._seq = 0
        self._addresses: dict[str, str] = {}  # replica id -> its manager, from its last request
        self._reachable: dict[str, str] = {}  # replica id -> that address, once a probe got in
        self._left: set[str] = set()  # forgotten; heartbeats ignored until its next request
        self._probing: set[str] = set()
        self._last_probe: dict[str, float] = {}
        self._reason = ""
        self._stop = threading.Event()

        def unary(handler, request, response):
            return grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=request.FromString,
                response_serializer=response.SerializeToString)

        self._server = grpc.server(ThreadPoolExecutor(max_workers=max_workers,
                                                      thread_name_prefix="lighthouse"))
        self._server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("torchft.LighthouseService", {
                "Quorum": unary(self._quorum, PB["LighthouseQuorumRequest"],
                                PB["LighthouseQuorumResponse"]),
                "Heartbeat": unary(self._heartbeat, PB["LighthouseHeartbeatRequest"],
                                   PB["LighthouseHeartbeatResponse"])}),
            grpc.method_handlers_generic_handler(leave_protocol.LEAVE_SERVICE, {
                leave_protocol.LEAVE: grpc.unary_unary_rpc_method_handler(
                    self._leave, request_deserializer=leave_protocol.decode,
                    response_serializer=leave_protocol.encode)}),
        ))
        self.port = self._server.add_insecure_port(f"{bind_host}:0")
        self._server.start()
        self._ticker = threading.Thread(target=self._run_ticks, name="lighthouse-tick",
                                        daemon=True)
        self._ticker.start()

    def address(self) -> str:
        return f"http://{socket.gethostname()}:{self.port}"

    def shutdown(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._server.stop(grace=None)

    # ---- gRPC handlers -----------------------------------------------------------------------

    def _quorum(self, request, context):
        member = request.requester
        rid = member.replica_id
        with self._cond:
            now = time.monotonic()
            self._left.discard(rid)
            self.state.heartbeats[rid] = now  # a request is a heartbeat
            if self._addresses.get(rid) != member.address:
                self._addresses[rid] = member.address
                self._reachable.pop(rid, None)
                self._start_probe(rid, member.address)  # can this address be probed at all?
            self.state.participants[rid] = Joined(now, member)
            seen = self._seq
            self._tick()
            while True:
                while self._seq == seen:
                    remaining = context.time_remaining()
                    if self._stop.is_set() or not context.is_active() or (
                            remaining is not None and remaining <= 0):
                        context.abort(self._grpc.StatusCode.DEADLINE_EXCEEDED
                                      if not self._stop.is_set() else
                                      self._grpc.StatusCode.UNAVAILABLE,
                                      f"no quorum for {rid}: {self._reason}")
                    self._cond.wait(min(remaining if remaining is not None else 1.0, 1.0))
                for seq, quorum in self._issued:
                    if seq > seen and rid in _ids(quorum.participants):
                        return PB["LighthouseQuorumResponse"](quorum=quorum)
                # Issued without this group (it joined too late for it): wait for the next.
                seen = self._seq
                self.state.participants[rid] = Joined(time.monotonic(), member)

    def _heartbeat(self, request, context):
        with self._cond:
            if request.replica_id not in self._left:
                self.state.heartbeats[request.replica_id] = time.monotonic()
        return PB["LighthouseHeartbeatResponse"]()

    def _leave(self, request: dict, context) -> dict:
        with self._cond:
            known = request["replica_id"] in self.state.heartbeats
            self._forget(request["replica_id"], "left")
            self._tick()
        return {"forgotten": known}

    # ---- quorum ------------------------------------------------------------------------------

    def _run_ticks(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._cond:
                self._tick()

    def _tick(self) -> None:
        """With the lock held: issue a quorum if one is met, else probe the groups it waits for."""
        now = time.monotonic()
        members, reason = quorum_compute(now, self.state, self.opt)
        if reason != self._reason:  # flips every step (waiting, then met): not for the INFO log
            log.debug("Quorum status: %s", reason)
            self._reason = reason
        if members is None:
            self._probe_stragglers(now)
            return
        st = self.state
        self._note_dropped(now, members)
        changed = st.prev_quorum is None or _ids(members) != _ids(st.prev_quorum.participants)
        if changed or any(m.commit_failures > 0 for m in members):
            st.quorum_id += 1
        if changed:
            log.info("quorum %d: %s", st.quorum_id, _ids(members))
        quorum = PB["Quorum"](quorum_id=st.quorum_id, participants=members)
        quorum.created.GetCurrentTime()
        st.prev_quorum = quorum
        st.participants.clear()
        self._seq += 1
        self._issued.append((self._seq, quorum))
        self._cond.notify_all()

    def _note_dropped(self, now: float, members: list) -> None:
        """A member of the previous quorum left out of this one without a word (not forgotten
        by `_forget`): its heartbeat timed out, or it was healthy but missed the join timeout."""
        if self.state.prev_quorum is None:
            return
        kept = set(_ids(members))
        for p in self.state.prev_quorum.participants:
            rid = p.replica_id
            if rid in kept or rid in self._left:
                continue
            beat = self.state.heartbeats.get(rid)
            silent = beat is None or now - beat >= self.opt.heartbeat_timeout_ms / 1000
            self.on_departure(Departure(time.time(), rid,
                                        "heartbeat timeout" if silent else "join timeout",
                                        self._longest_wait(now)))

    def _longest_wait(self, now: float) -> float | None:
        joined = [d.joined for d in self.state.participants.values()]
        return round(now - min(joined), 4) if joined else None

    def _forget(self, rid: str, why: str) -> None:
        """With the lock held: as if `rid`'s heartbeat had timed out, now."""
        if rid in self.state.heartbeats or rid in self.state.participants:
            self.on_departure(Departure(time.time(), rid, why,
                                        self._longest_wait(time.monotonic())))
            log.info("replica %s forgotten before its heartbeat timed out: %s", rid, why)
        self.state.heartbeats.pop(rid, None)
        self.state.participants.pop(rid, None)
        self._left.add(rid)

    # ---- probes ------------------------------------------------------------------------------

    def _probe_stragglers(self, now: float) -> None:
        """Only while a group waits, and not for the usual few milliseconds between the groups'
        requests of a step: then every healthy group that has not joined."""
        waiting = [d.joined for d in self.state.participants.values()]
        if not waiting or now - min(waiting) < self.probe_interval_s:
            return
        timeout_s = self.opt.heartbeat_timeout_ms / 1000
        for rid, beat in self.state.heartbeats.items():
            if rid in self.state.participants or now - beat >= timeout_s:
                continue
            if rid in self._probing or now - self._last_probe.get(rid, -1e9) < self.probe_interval_s:
                continue
            address = self._reachable.get(rid)
            if address is not None and address == self._addresses.get(rid):
                self._start_probe(rid, address)

    def _start_probe(self, rid: str, address: str) -> None:
        self._probing.add(rid)
        self._last_probe[rid] = time.monotonic()
        threading.Thread(target=self._probe, args=(rid, address), name="lighthouse-probe",
                         daemon=True).start()

    def _probe(self, rid: str, address: str) -> None:
        alive = probe(address)
        with self._cond:
            self._probing.discard(rid)
            if self._addresses.get(rid) != address:
                return  # a newer process of this group asked since: this verdict is stale
            if alive:
                self._reachable[rid] = address
            elif alive is False and self._reachable.get(rid) == address:
                self._forget(rid, "probe refused")
                self._tick()


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """True if something accepts a TCP connection at `address` ("http://host:port"), False if
    the host refused it (nothing listens there), None if there was no verdict in time."""
    url = urlsplit(address if "//" in address else f"//{address}")
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout_s).close()
        return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None
