"""Replica groups: torchft as the fault-tolerant replicate dimension of HSDP (C7 all-or-nothing
step).

Each replica group is a complete FSDP2 (and tensor-parallel) group of its own that holds the whole
sharded model; a torchft `Manager` per process joins the groups through a shared Lighthouse.
Every step starts with a synchronous quorum (`use_async_quorum=False`: torchft's asynchronous
default reads the state dict on its quorum thread while the forward runs, which crashed the rank
serving a peer's recovery under FSDP2), which says which groups take part and, for a group that
is behind (a replacement), copies a live peer's state to it shard by shard before the step. Each
FSDP module's gradient, once reduce-scattered (and all-reduced over in-group HSDP replicas), is
averaged over the live groups through torchft's `ManagedProcessGroup` (on CPU all of them in one
call after the backward); `should_commit()` then decides for every group at once whether the
optimizer steps, or the step is re-done.

C1 fixed global batch across groups: the step's micro-batches are split over (live groups x
data-parallel ranks of a group); group g of n takes data-parallel ranks g*D .. g*D + D-1 of n*D. The
Trainer scales each rank's loss by that degree, so FSDP's in-group mean and the cross-group mean
together give the sum over exactly G sequences (the token weighting of an uneven split is kept, not
a mean of groups).

`ReplicaGroup` is this process's part in that, and knows nothing of the Trainer: the Trainer's loop
drives it through `train/fault_tolerance.py` (`ReplicaGroupPath`, one of the two fault-tolerance
modes; the other, the restart path, needs nothing from here). Nothing here imports Ray, and torchft
is imported only when a `ReplicaGroup` is built.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

FT_MISSING = ("elastic.replica_groups needs torchft, which is not installed; pip install "
              "'elastic-gpt[ft]'")


# torchft's Python loggers: its modules' (torchft.manager, torchft.process_group, ...) and the
# structured records it writes per quorum, commit and error (an empty message with fields).
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
_RECORD_FIELDS = ("replica_id", "rank", "quorum_id", "step", "commit_result")
# A long run's detail at about ten lines a step: a few of these per worker, the oldest dropped.
DETAIL_FILE_BYTES = 64 << 20
DETAIL_FILE_BACKUPS = 2
# The groups' copies of each shard are compared by an exact checksum carried in the step's stats
# (float64): its residue below 2**52, which a float64 holds exactly.
CHECKSUM_MODULUS = 1 << 52
COPIES_AGREE, COPIES_MAJORITY, COPIES_MINORITY, COPIES_UNDECIDED = range(4)
"""What a rank saw of its shard's copies over the live groups, worst last: all equal; another
group's differed from the majority this group is in; this group's did; no majority."""


def detail_log_path(log_dir: str, group: int | str, rank: int | str) -> str:
    """One file per worker of a group, appended to across its restarts."""
    return os.path.join(log_dir, f"torchft-g{group}-r{rank}.log")


def keep_torchft_detail(path: str) -> None:
    """torchft's detail into `path`, at debug level, and only its warnings and errors to the
    console, so a replica-group run prints what the restart path prints. Call before torchft is
    first imported in the process.

    torchft logs every step's quorum, process-group reconfiguration and commit vote at INFO,
    twice: from Python (the loggers above) and from its Rust core (manager and Lighthouse client,
    written straight to stderr at the level RUST_LOG names when torchft is first imported). The
    Python records go to the file, with the fields of its structured records; the Rust core
    gets RUST_LOG=warn unless the environment sets RUST_LOG (then its lines are on stderr as
    torchft writes them: `RUST_LOG=info` brings the detail back, docs/operations.md). Python
    warnings raised inside torchft are not shown."""
    import warnings
    from logging.handlers import RotatingFileHandler

    os.environ.setdefault("RUST_LOG", "warn")
    # Python warnings about torchft's own internals (a heal's non-writable buffer, a deprecated
    # pytree check): nothing a user can act on.
    warnings.filterwarnings("ignore", module=r"torchft(\.|$)")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    detail = RotatingFileHandler(path, maxBytes=DETAIL_FILE_BYTES, backupCount=DETAIL_FILE_BACKUPS)
    detail.setFormatter(_DetailFormatter())
    console = _ToConsole(logging.WARNING)
    for name in TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # the root's handlers print INFO (Ray's worker setup)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.addHandler(detail)
        logger.addHandler(console)
    logging.getLogger("torchft").debug("pid %d: torchft's detail from here on", os.getpid())


class _DetailFormatter(logging.Formatter):
    """The time, level and logger of each line, and the fields of torchft's structured records
    (their message is empty)."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={getattr(record, k)}" for k in _RECORD_FIELDS
                          if hasattr(record, k))
        line = super().format(record)
        return f"{line.rstrip()} {fields}" if fields else line


class _ToConsole(logging.Handler):
    """A torchft warning or error on to the process's console handlers (the root logger's), in
    their format. Not torchft's warning at every reconfiguration that a CPU build of torch has no
    NCCL flight recorder to reset: nothing a user can act on (it stays in the file)."""

    def emit(self, record: logging.LogRecord) -> None:
        if "flight recorder" not in record.getMessage():
            logging.getLogger().handle(record)


def import_torchft():
    """torchft, or the one-line error that says how to get it (C6 clear errors)."""
    try:
        import torchft
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ManagedProcessGroup
    except ImportError:
        raise ValueError(FT_MISSING) from None
    return torchft, ManagedProcessGroup, PGTransport


class ReplicaGroup:
    """This process's place in replica group `group` (0..N-1) of a run whose groups meet at the
    Lighthouse `lighthouse`. `group_rank`/`group_size` are the rank inside the group (the default
    process group is the group's own). `record_dir`: each rank appends one JSON line per step
    attempt (quorum time, whether it healed, the outcome, and with `state_hash` a hash of its
    shards of the parameters and optimizer state) - what the tests and the benchmark read.

    What each step's quorum said, for the Trainer's loop (`train/fault_tolerance.py`):"""

    leads: bool
    """This group leads this step's quorum (replica rank 0): it writes the checkpoint and logs the
    metrics (C5 one MLflow run)."""
    groups: int
    """Groups the run was configured with; fewer live is "degraded" time in the ledger."""
    live_groups: int
    """Groups in this step's quorum."""
    quorum_s: float
    """How long this step's quorum took: with a quorum change, the survivors' wait for it."""

    def __init__(self, *, lighthouse: str, group: int, group_rank: int, group_size: int,
                 groups: int, timeout_s: float = 30.0, collective_timeout_s: float | None = None,
                 record_dir: str | None = None, state_hash: bool = False,
                 log_path: str | None = None):
        if log_path:
            keep_torchft_detail(log_path)
        self.torchft, self._managed_pg, self._transport = import_torchft()
        self.lighthouse, self.group = lighthouse, group
        self.group_rank, self.group_size = group_rank, group_size
        self.timeout = timedelta(seconds=timeout_s)
        self.collective_timeout = timedelta(seconds=collective_timeout_s or timeout_s)
        self.record_dir, self.state_hash = record_dir, state_hash
        self.manager = None
        self.replica_id: str | None = None
        self._left = False
        self.leads = group == 0
        self.groups = groups
        self.live_groups = 1
        self._change: tuple[int, int] | None = None
        self._run_state = None
        self._record = None
        self._healed_at: int | None = None
        self._first = True
        self.quorum_s = 0.0
        self._begun = time.perf_counter()
        self._ended = self._begun  # the previous attempt's commit vote
        self._gap = 0.0
        self._phases: dict[str, float] = {}
        self._cross_s = 0.0
        self.logged_through: Callable[[], int] = lambda: 0
        """The step through which this rank has stored every step's metrics it was given (its
        metric sink's; 0 where it logs none): the leading group's rank 0 tells the others with
        each step's stats (`leader_logged_through`)."""
        self._leader_logged = torch.zeros(1, dtype=torch.float64)
        self._checksum: torch.Tensor | None = None
        self._copies: torch.Tensor | None = None
        self.copies_seen = COPIES_AGREE
        """This rank's comparison of its shard's copies in the last attempt (`COPIES_*`)."""
        self.copies_differed: list[int] = []
        """The groups whose copy of this rank's shard differed from the majority's."""
        self.copies_differed_anywhere: list[int] = []
        """The same over every shard of the group (`settle_copies`)."""

    # ---- set-up ------------------------------------------------------------------------------

    def attach(self, model, optimizer, device: torch.device, run_state=None) -> None:
        """Make the Manager and route every FSDP module's gradient through the managed group.
        `run_state`: (get, set) of state that belongs to the run, not to a group (the goodput
        ledger, the health state): a healed group adopts its peer's."""
        from torch.distributed.fsdp import FSDPModule

        torchft = self.torchft
        self.model, self.optimizer, self._run_state = model, optimizer, run_state
        self._device = device
        backend = torchft.ProcessGroupNCCL if device.type == "cuda" else torchft.ProcessGroupGloo
        # Each operation on the cross-group process group gives up after the collective timeout:
        # a group whose node vanished (no connection refused, heartbeats just stop) is dropped
        # by the Lighthouse after its heartbeat, and the survivors' step in flight with it must
        # fail as soon, not after the hang timeout. The quorum and a heal as a whole keep that.
        pg = backend(timeout=self.collective_timeout)
        self.manager = torchft.Manager(
            pg=pg, min_replica_size=1, use_async_quorum=False,
            load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            replica_id=f"replica_group_{self.group}", rank=self.group_rank,
            world_size=self.group_size, lighthouse_addr=self.lighthouse, timeout=self.timeout,
            # A quorum waits for the other groups: a hung one leaves only when its own collective
            # gives up (the hang timeout), so this group's quorum outlasts that; one whose rank
            # hangs outside a collective is outlasted by asking again (`_quorum`).
            quorum_timeout=2 * self.timeout,
            # Every group initialises the same weights from the seed (init_sharded_weights) or
            # restores the same checkpoint: no step-0 copy is needed.
            init_sync=False,
            # A step that fails this many times in a row (a quorum that never works) fails the
            # group; Ray restarts its run.
            max_retries=10,
            checkpoint_transport=self._transport(pg, timeout=self.timeout, device=device))
        # The id the Lighthouse knows this group by: torchft adds a fresh suffix per process,
        # so a restarted group is a new member, and a late word from this one cannot touch it.
        if self.group_rank == 0:
            from elastic_gpt.parallel.lighthouse_client import LighthouseClient
            self.replica_id = self.manager._store.get(self.torchft.manager.REPLICA_ID_KEY).decode()
            self._lighthouse_client = LighthouseClient(self.lighthouse)
        replicate = self._managed_pg(self.manager)
        replicate.register(f"replica_groups_{self.group}")
        self._replicate = replicate

        def average_over_groups(grad: torch.Tensor) -> None:
            t0 = time.perf_counter()
            self._phases.setdefault("first_grad", t0)
            dist.all_reduce(grad, group=replicate, op=dist.ReduceOp.AVG)
            self._cross_s += time.perf_counter() - t0

        # On CUDA each FSDP module's gradient is averaged as soon as it is reduce-scattered, so
        # the transfer overlaps the rest of the backward. On CPU nothing overlaps, and each
        # managed collective has a fixed cost (torchft's error handling around a gloo call): one
        # call per dtype after the backward (`reduce_gradients`) does the same sums.
        self._bucketed = device.type != "cuda"
        if not self._bucketed:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(average_over_groups)
        if self.record_dir:
            os.makedirs(self.record_dir, exist_ok=True)
            path = os.path.join(self.record_dir, f"g{self.group}_r{self.group_rank}.jsonl")
            self._record = open(path, "a", buffering=1)  # noqa: SIM115 (closed in shutdown)
            self._write(event="start", pid=os.getpid())

    def _state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        if self._run_state is not None:
            state["run"] = self._run_state[0]()
        return state

    def _load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        if self._run_state is not None and "run" in state:
            self._run_state[1](state["run"])

    # ---- the step ----------------------------------------------------------------------------

    QUORUM_ROUNDS = 3
    """Quorum calls of one step that may time out before the group fails. A group one of whose
    ranks hangs between steps keeps heartbeating (its Manager lives in its rank 0) without ever
    asking, and the Lighthouse keeps the others waiting for it until it fails: its rank 0 gives
    up on the quorum when they do, and fails only after the hang timeout of its own barrier
    (`_own_ranks_answer`). A second round outlasts that; the third is margin for a loaded host."""

    def _quorum(self) -> None:
        before = self.manager.current_step()
        t0 = time.perf_counter()
        for round_ in range(1, self.QUORUM_ROUNDS + 1):
            try:
                self.manager.start_quorum()
                break
            except TimeoutError:
                # Whose wait was it? A rank of this group that never asked hangs: the barrier
                # fails after the hang timeout, and so does this group (Ray restarts it). Every
                # rank answering means another group held the quorum back: ask again.
                self._own_ranks_answer()
                if round_ == self.QUORUM_ROUNDS:
                    raise
                log.warning("replica group %d: no quorum in %.0f s (another group holds it "
                            "back); asking again", self.group, time.perf_counter() - t0)
                # torchft re-raises the last quorum's error at the start of the next one.
                self.manager._quorum_future = None
        self.quorum_s = time.perf_counter() - t0
        self._phases["quorum"] = time.perf_counter()
        if self.manager.current_step() != before:
            self._healed_at = self.manager.current_step()
            log.info("replica group %d healed from a live peer to step %d in %.2f s", self.group,
                     self._healed_at, self.quorum_s)
        # A quorum that failed (a peer vanished while the process group was reconfigured)
        # leaves the manager errored: this step's collectives do nothing and should_commit says
        # no, so the step is re-done at the next quorum.

    def _own_ranks_answer(self) -> None:
        """Every rank of this group reaches this barrier, or it raises after the group's
        collective timeout (the hang timeout once the group steps)."""
        probe = torch.zeros(1, device=self._device)
        dist.all_reduce(probe)
        probe.item()  # on CUDA the collective runs on a stream: wait for it here

    def set_step(self, step: int) -> None:
        """After a restore from a checkpoint: the quorum's step is the checkpoint's."""
        state = self.manager.state_dict()
        self.manager.load_state_dict({"step": step,
                                      "batches_committed": state["batches_committed"]})

    def begin_step(self, dp_rank: int, dp_degree: int) -> tuple[int, int, int]:
        """Quorum for the next step: (the step every live group is at, this rank's data-parallel
        rank and the degree over all live groups)."""
        # Each step's quorum is the first thing every group does for it: a group that joins
        # forms its first quorum with the others' quorum of their next step, and is healed in it.
        self._healed_at = None
        self._begun = time.perf_counter()
        self._gap = self._begun - self._ended
        self._phases = {}
        self._cross_s = 0.0
        first = self._first
        self._first = False
        self._quorum()
        if first:
            self._write(event="join", step=self.manager.current_step(), quorum_s=self.quorum_s,
                        healed=self._healed_at is not None)
        replica_rank = self.manager.participating_rank()
        before, self.live_groups = self.live_groups, self.manager.num_participants()
        if first:
            # A group healed at its first quorum has joined the others (it adopted their
            # ledger as it was before they noted it); one that started with them has not.
            joined = self._healed_at is not None and self.live_groups > 1
            self._change = (self.live_groups - 1, self.live_groups) if joined else None
        else:
            self._change = None if before == self.live_groups else (before, self.live_groups)
        if replica_rank is None:  # only in torchft's FIXED_WITH_SPARES mode, which is not used
            raise RuntimeError(f"replica group {self.group} is not in the quorum it formed")
        self.leads = replica_rank == 0
        step = self.manager.current_step()
        if self.record_dir and self.state_hash:
            self._write(event="state", step=step, hash=self.local_state_hash())
        return step, replica_rank * dp_degree + dp_rank, self.live_groups * dp_degree

    def quorum_change(self) -> tuple[int, int] | None:
        """(live groups before, after) when this step's quorum changed them."""
        return self._change

    def reduce_gradients(self) -> None:
        """The live groups' mean of every gradient shard, one flat collective per dtype (the
        CPU path; on CUDA the per-module hooks have done it during the backward)."""
        if not self._bucketed:
            return
        t0 = time.perf_counter()
        self._phases.setdefault("first_grad", t0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.model.parameters():
            if p.grad is not None:
                # a DTensor's local shard is a view of its storage: written back in place
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                by_dtype.setdefault(local.dtype, []).append(local)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._replicate, op=dist.ReduceOp.AVG)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._cross_s += time.perf_counter() - t0

    def reduce_stats(self, stats: torch.Tensor) -> None:
        """Sum the step's loss and data fingerprint over the live groups; each group's are
        already summed over its ranks. The flags after them stay the group's own: a drain
        makes only the drained group leave. In the same call the leading group tells the
        others how far its metrics are stored (the others add 0)."""
        self._phases["backward"] = time.perf_counter()
        stored = float(self.logged_through()) if self.leads else 0.0
        # Each group's checksum of this rank's shard in its own pair of slots (present, value):
        # the sum is every live group's (a group that heals in this step adds zeros).
        copies = stats.new_zeros(2 * self.groups)
        compared = self._checksum is not None
        if compared:
            copies[2 * self.group] = 1.0
            copies[2 * self.group + 1] = (self._checksum.to(stats.device) % CHECKSUM_MODULUS
                                          ).to(stats.dtype)
            self._checksum = None
        shared = torch.cat([stats[:3], stats.new_tensor([stored]), copies])
        self.manager.allreduce(shared, reduce_op=dist.ReduceOp.SUM).wait()
        stats[:3] = shared[:3]
        self._leader_logged = shared[3:4]
        # Read to the host only at a check (every group checks at the same steps): a rank that
        # gave no checksum has no copy to compare.
        self._copies = shared[4:] if compared else None
        self._phases["stats"] = time.perf_counter()

    def note_state_checksum(self, checksum: torch.Tensor) -> None:
        """The exact checksum of this rank's shard of the state the coming step starts from
        (`health/attribution.shard_checksum`): the step's stats compare it over the live groups, whose
        copies must be equal bit for bit (each applies the same averaged gradient)."""
        self._checksum = checksum

    def _compare_copies(self) -> int:
        """`COPIES_*` for this rank's shard from the step's stats."""
        copies, self._copies = self._copies, None
        self.copies_differed = []
        if copies is None:
            return COPIES_AGREE
        pairs = copies.tolist()
        values = {g: pairs[2 * g + 1] for g in range(self.groups) if pairs[2 * g]}
        if self.group not in values or len(set(values.values())) <= 1:
            return COPIES_AGREE
        value, count = collections.Counter(values.values()).most_common(1)[0]
        if 2 * count <= len(values):
            self.copies_differed = sorted(values)
            return COPIES_UNDECIDED
        self.copies_differed = sorted(g for g, v in values.items() if v != value)
        return COPIES_MINORITY if self.group in self.copies_differed else COPIES_MAJORITY

    def settle_copies(self) -> int:
        """Collective over this group's ranks, after an attempt no group committed: the worst
        `COPIES_*` any of them saw. A group whose copy differed from the majority's is set a step
        behind, so the next quorum heals it from a live peer (torchft's recovery, as for a group
        that joins late)."""
        seen = torch.zeros(1 + self.groups, dtype=torch.int64, device=self._device)
        seen[0] = self.copies_seen
        seen[1:][self.copies_differed] = 1
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        worst, *differed = seen.tolist()
        self.copies_differed_anywhere = [g for g, d in enumerate(differed) if d]
        if worst == COPIES_MINORITY:
            self.set_step(self.manager.current_step() - 1)
        return worst

    @property
    def leader_logged_through(self) -> int:
        """The step through which the group leading the last step's quorum had stored every
        step's metrics, as it said in that step's stats (read after the commit: no extra sync)."""
        return int(self._leader_logged.item())

    def should_commit(self, step: int, stats: torch.Tensor) -> bool:
        self.copies_seen = self._compare_copies()
        if self.copies_seen != COPIES_AGREE:
            # Every group has a rank holding this shard, so every group votes no: the step is
            # applied nowhere, and re-done once the differing copy is healed.
            self.manager.report_error(RuntimeError(
                f"replica groups {self.copies_differed} hold a copy of rank {self.group_rank}'s "
                "shard that differs from the others' (silent data corruption)"))
        ok = self.manager.should_commit()
        self._phases["commit"] = self._ended = time.perf_counter()
        if self._record is not None:
            loss_sum, lo, hi = stats[:3].tolist()
            self._write(event="step", step=step, committed=ok, groups=self.live_groups,
                        leads=self.leads, quorum_s=round(self.quorum_s, 4),
                        attempt_s=round(time.perf_counter() - self._begun, 4),
                        # from the previous attempt's vote to this one's quorum: the loop between
                        gap_s=round(self._gap, 4),
                        phases={k: round(v - self._begun, 4) for k, v in self._phases.items()},
                        cross_s=round(self._cross_s, 4),
                        healed=self._healed_at is not None, loss_sum=loss_sum, fp=[lo, hi])
        return ok

    def local_state_hash(self) -> str:
        """sha1 of this rank's shards of every parameter and optimizer tensor, in a fixed order:
        equal across groups of the same size iff their full states are equal."""
        h = hashlib.sha1()
        tensors = [("p." + n, p) for n, p in self.model.named_parameters()]
        names = {id(p): n for n, p in self.model.named_parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                tensors += [(f"o.{names[id(p)]}.{k}", v) for k, v in sorted(state.items())]
        for name, t in tensors:
            if hasattr(t, "to_local"):
                t = t.to_local()
            h.update(name.encode())
            if isinstance(t, torch.Tensor):
                h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(t).encode())
        return h.hexdigest()

    def _write(self, **record) -> None:
        if self._record is not None:
            self._record.write(json.dumps({"t": round(time.time(), 4), "group": self.group,
                                           "rank": self.group_rank, **record}) + "\n")

    def leave(self) -> None:
        """Rank 0 tells the Lighthouse that the group is gone, so the others' next quorum forms
        without waiting for its heartbeat to time out (the other ranks have nothing to say)."""
        if self.replica_id is None or self._left:
            return
        self._left = True
        t0 = time.perf_counter()
        told = self._lighthouse_client.leave(self.replica_id, timeout_s=1.0)
        self._lighthouse_client.close()
        self._write(event="leave", told=told, s=round(time.perf_counter() - t0, 4))

    def shutdown(self) -> None:
        """Also on the way out after an error: the group leaves the quorum first, then stops."""
        if self.manager is not None:
            self.leave()
            self.manager.shutdown(wait=False)
        if self._record is not None:
            self._record.close()
