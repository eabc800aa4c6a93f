"""The exceptions that cross from a worker to the controller, and the one classification of
failures: which ones a retry can cure, and the one line a user sees for the rest (C6 clear errors).

`FatalTrainingError` and its subclasses are errors that restarting cannot fix: the controller stops
the run at once on these. `ElasticRestart` is the opposite: a planned restart after a just-in-time
checkpoint, retried for free, as is a `PlacementError` (workers placed where the layout cannot
use them). `permanent_failure` decides for any other exception, in the process
that raised it (only there is its chain of causes whole: Ray sends a worker's exception to the
controller by pickling, which keeps neither `__cause__` nor `__context__`). `user_error_line` is
what the CLI prints.

This module imports nothing of Ray or the storage SDKs (their errors are recognised by class
name), so the Trainer can raise and classify without importing Ray, botocore or google-cloud.
"""

from __future__ import annotations

import errno
import sys
import traceback

from elastic_gpt.console import first_line


class FatalTrainingError(Exception):
    """Base of errors no retry can cure (bad config, wrong checkpoint, diverged loss)."""


class NonFiniteLossError(FatalTrainingError):
    pass


class CheckpointMismatchError(FatalTrainingError, ValueError):
    pass


class FailureBudgetSpent(Exception):
    """The run failed more often within an hour than `elastic.max_failures_per_hour` allows, and
    stopped; its newest checkpoint is intact (or `tune` lost workers more often than its
    retries allow). Not bad input and not a bug: the CLI prints this one line and exits 1 (the
    failures' own errors are in the log above it)."""


class ElasticRestart(Exception):
    """Raised by every rank after a just-in-time checkpoint: a planned restart, not a failure."""

    def __init__(self, reason: str, step: int):
        super().__init__(f"planned restart after step {step}: {reason}")
        self.reason, self.step = reason, step

    def __reduce__(self):
        return (ElasticRestart, (self.reason, self.step))


class PlacementError(Exception):
    """Where Ray placed this attempt's workers cannot hold the layout: a node holds part of a
    tensor-parallel group (or, under parallel.hsdp=on, nodes hold unequal counts). Raised by every
    rank before any step. Not the config's fault and not a failure: the controller retries for
    free at a placement of whole groups, no larger than `aligned_workers`."""

    def __init__(self, message: str, per_node: list[int], tp: int):
        super().__init__(message)
        self.per_node, self.tp = list(per_node), tp

    @property
    def aligned_workers(self) -> int:
        """The workers this placement's nodes held in whole tensor-parallel groups."""
        return sum(n // self.tp * self.tp for n in self.per_node)

    def __reduce__(self):
        return (PlacementError, (str(self), self.per_node, self.tp))


def check_checkpoint_shape(state: dict, gpt_cfg, url: str) -> None:
    """A checkpoint of another model shape cannot be loaded: say which fields differ."""
    # A shape without a family is GPT-2's: checkpoints held no family before there were more.
    saved = {"family": "gpt2", **state.get("model_shape", {})}
    want = {"family": gpt_cfg.family, **gpt_cfg.shape()}
    diff = {k: (saved.get(k), v) for k, v in want.items()
            if saved.get(k) != v and k not in gpt_cfg.free_fields}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diff.items())
        raise CheckpointMismatchError(
            f"checkpoint {url} is for another model shape ({detail}); use the matching "
            "model.* settings or a fresh checkpoint.path")


class StorageFullError(FatalTrainingError, OSError):
    """The disk or quota filled up: no retry can write more until space is freed."""


# Storage SDK errors no retry cures, by class name (botocore, google-auth / google-cloud).
_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                      "DefaultCredentialsError", "RefreshError", "Forbidden", "Unauthorized"}
_CREDENTIAL_CODES = ("accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch",
                     "expiredtoken", "invalidtoken", "403 forbidden", "401 unauthorized")
# ...and the ones that mean "try again" (a lost node, a storage endpoint briefly away).
_TRANSIENT_ERRORS = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                     "ConnectionClosedError", "ServiceUnavailable", "TooManyRequests",
                     "InternalServerError", "SlowDown", "ActorDiedError", "ActorUnavailableError",
                     "NodeDiedError", "WorkerCrashedError", "RaySystemError"}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def _chain(exc: BaseException):
    """exc, then its causes and contexts (raise ... from None still keeps __context__), then the
    per-rank failures a DCP CheckpointException carries."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP: {rank: (exception, stack summary)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()
                     if isinstance(f, (tuple, BaseException))]


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def _is_full(e: BaseException) -> bool:
    text = str(e)
    return (isinstance(e, OSError) and e.errno in _FULL_ERRNOS) or \
        "No space left on device" in text or "Disk quota exceeded" in text


def _is_credentials(e: BaseException) -> bool:
    if isinstance(e, PermissionError) or _names(e) & _CREDENTIAL_ERRORS:
        return True
    code = str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) \
        if isinstance(getattr(e, "response", None), dict) else ""
    low = (code + " " + str(e)).lower().replace(" ", "")
    return any(c.replace(" ", "") in low for c in _CREDENTIAL_CODES)


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (ElasticRestart, PlacementError)) or _names(e) & _TRANSIENT_ERRORS:
        return True
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno in (errno.ETIMEDOUT, errno.ECONNRESET,
                                              errno.ECONNREFUSED, errno.EHOSTUNREACH):
        return True
    return False


def permanent_failure(exc: BaseException, *, checkpoint_hint: str = "") -> FatalTrainingError | None:
    """The FatalTrainingError to stop the run with, or None if a retry may cure `exc`.

    Permanent: FatalTrainingError itself (corrupt shards, checkpoint of another shape, bad layout,
    diverged loss), a full disk or quota, refused permissions or credentials on storage, and the
    ValueErrors our own checks raise on input (a dataset or checkpoint that is not what the config
    says). Transient: lost nodes and actors, collectives broken by a dead peer, storage timeouts
    and refused connections, and anything else unknown (the failure budget bounds those).
    `checkpoint_hint` says which checkpoint is still usable, for the disk-full line."""
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, FatalTrainingError):
            return e
    for e in chain:
        if _is_full(e):
            return StorageFullError(
                f"storage is full ({first_line(e)}); nothing was committed for the step being "
                f"written{checkpoint_hint}; free space (or raise the quota) and run the same "
                "command again to resume")
    if any(_is_transient(e) for e in chain):
        return None
    for e in chain:
        if _is_credentials(e):
            return FatalTrainingError(
                f"storage refused access ({first_line(e)}); check the storage credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the instance role, "
                "GOOGLE_APPLICATION_CREDENTIALS) and the bucket policy")
    if isinstance(exc, ValueError):  # our input checks: the same input fails the same way
        return FatalTrainingError(first_line(exc))
    return None


def user_error_line(exc: BaseException) -> str | None:
    """The one line to show a user for an error they can fix, or None for a bug (an exception
    no check of ours raised: the CLI then shows the traceback)."""
    if isinstance(exc, (ValueError, FatalTrainingError)):
        return first_line(exc)
    for e in _chain(exc):
        if _is_full(e):
            return f"storage is full ({first_line(e)}); free space or raise the quota"
        if _is_credentials(e):
            where = f" on {e.filename}" if getattr(e, "filename", None) else ""
            return (f"permission or credentials refused{where} ({first_line(e)}); fix the "
                    "path's permissions or the storage credentials")
        if isinstance(e, FileNotFoundError):
            return f"{e.filename or first_line(e)} does not exist; check the path"
        if isinstance(e, NotADirectoryError):
            return f"{e.filename or first_line(e)} is not a folder; check the path"
        if isinstance(e, (ConnectionError, TimeoutError)):
            return f"a service did not answer ({first_line(e)}); check the address and the network"
    return None


def exit_for_error(prog: str, exc: BaseException, verbose: bool, project: str) -> int:
    """Print what a command-line user sees for `exc` and return the exit code: one line and 2
    for an error they can fix (the traceback too with --verbose), the traceback and 1 for a bug
    (`project` names who to report it to)."""
    line = user_error_line(exc)
    if line is None:  # not an error any check of ours names: a bug, so show where it is
        traceback.print_exception(exc)
        print(f"{prog}: internal error ({type(exc).__name__}); this is a bug in {project}, "
              "please report it with the traceback above", file=sys.stderr)
        return 1
    if verbose:
        traceback.print_exception(exc)
    print(f"{prog}: error: {line}", file=sys.stderr)
    return 2
