"""The checkpoint store: step directories on any fsspec storage, committed atomically (C4 atomic
commit).

Layout under the checkpoint root (file://, s3://, gs://, ...):

    run.json                  MLflow run id of this experiment, written before the first step
                              (C5 one MLflow run)
    step_00000100/
        __0_0.distcp ...      DCP shards, checkpoint.write_streams files per rank (any world size
                              can load them: resharding)
        .metadata             DCP's index of the shards
        trainer_state.json    step, samples seen, world size, model shape, MLflow run id, ledger
        COMMITTED.json        written last, by rank 0, after every rank's shard is durable;
                              lists every file with its size so a torn step is detected on load

A step directory without a valid COMMITTED.json does not exist as far as resume is concerned.
This module owns the layout: naming, listing, verifying, committing and deleting step directories,
and the run's identity file. It never reads or writes a shard's contents (sharded.py does) and
does not decide when to save (checkpointer.py does).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from dataclasses import dataclass

import fsspec

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED.json"
TRAINER_STATE = "trainer_state.json"
RUN_INFO = "run.json"
_STEP_RE = re.compile(r"step_(\d{8,})$")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class CommittedCheckpoint:
    step: int
    url: str
    state: dict


class CheckpointStore:
    """Step directories under one root URL; all listing decisions are made from live storage."""

    def __init__(self, root_url: str, storage_options: dict | None = None):
        self.root_url = root_url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.root_url, **(storage_options or {}))
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    def url(self, *parts: str) -> str:
        return "/".join([self.root_url, *parts])

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # ---- discovery -------------------------------------------------------------------------

    def step_dirs(self) -> dict[int, str]:
        """Every step_<N> directory, committed or not."""
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True) if self._refreshable() \
                else self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}
        out = {}
        for entry in entries:
            m = _STEP_RE.search(entry.rstrip("/"))
            if m:
                out[int(m.group(1))] = entry.rstrip("/")
        return out

    def latest(self, before: int | None = None) -> CommittedCheckpoint | None:
        """Newest committed and intact step (< before if given); torn ones are skipped loudly."""
        for step in sorted(self.step_dirs(), reverse=True):
            if before is not None and step >= before:
                continue
            problem = self.verify(step)
            if problem is None:
                return CommittedCheckpoint(step, self.url(step_dirname(step)), self.read_state(step))
            if problem != "not committed":
                log.warning("skipping checkpoint %s: %s; falling back to the previous one",
                            self.url(step_dirname(step)), problem)
        return None

    def verify(self, step: int) -> str | None:
        """None if the step is committed and every file has its committed size, else why not."""
        d = self.path(step_dirname(step))
        try:
            marker = json.loads(self.fs.cat_file(f"{d}/{COMMIT_MARKER}"))
        except FileNotFoundError:
            return "not committed"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "commit marker is corrupt"
        try:
            sizes = {os.path.basename(e["name"].rstrip("/")): e["size"]
                     for e in self.fs.ls(d, detail=True)}
        except FileNotFoundError:
            return "directory vanished"
        for name, size in marker.get("files", {}).items():
            if name not in sizes:
                return f"file {name} is missing"
            if sizes[name] != size:
                return f"file {name} has {sizes[name]} bytes, {size} were committed (torn write)"
        return None

    def read_state(self, step: int) -> dict:
        return json.loads(self.fs.cat_file(self.path(step_dirname(step), TRAINER_STATE)))

    # ---- run identity (C5 one MLflow run) --------------------------------------------------

    def read_run_info(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path(RUN_INFO)))
        except FileNotFoundError:
            return None

    def write_run_info(self, info: dict) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        self._atomic_write(self.path(RUN_INFO), json.dumps(info, indent=1).encode())

    def check_writable(self) -> None:
        """Write and delete one tiny object under the root, so a path or credentials that cannot
        take a checkpoint fail before training instead of at the first save. Folders this made
        for the probe on a local disk are removed again: a refused run leaves nothing behind."""
        probe = self.path(f".write-probe-{os.getpid()}-{time.time_ns()}")
        made = []
        if self.protocol in ("file", "local"):
            d = self.root
            while d and not os.path.exists(d):
                made.append(d)
                d = os.path.dirname(d)
            if d and not os.path.isdir(d):
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", d)
            self.fs.makedirs(self.root, exist_ok=True)
        try:
            self.fs.pipe_file(probe, b"probe")
            self.fs.rm_file(probe)
        finally:
            for d in made:  # innermost first
                try:
                    os.rmdir(d)
                except OSError:
                    pass

    def free_bytes(self) -> int | None:
        """Free space for the root on a local disk; None for object stores, which have none."""
        if self.protocol not in ("file", "local"):
            return None
        d = self.root
        while d and not os.path.exists(d):
            d = os.path.dirname(d)
        st = os.statvfs(d or "/")
        return st.f_bavail * st.f_frsize

    def committed_bytes(self, step: int) -> int:
        """Bytes of a committed step's files, from its marker (0 if it cannot be read)."""
        try:
            marker = json.loads(self.fs.cat_file(self.path(step_dirname(step), COMMIT_MARKER)))
            return int(sum(marker.get("files", {}).values()))
        except Exception:
            return 0

    # ---- commit and retention (rank 0 only) ------------------------------------------------

    def commit(self, step: int, state: dict) -> None:
        """Write trainer state, then the marker listing every file: the step becomes visible."""
        d = self.path(step_dirname(step))
        self._atomic_write(f"{d}/{TRAINER_STATE}", json.dumps(state, indent=1).encode())
        files = {os.path.basename(e["name"].rstrip("/")): e["size"]
                 for e in self.fs.ls(d, detail=True, **self._ls_kwargs())}
        files.pop(COMMIT_MARKER, None)
        marker = {"step": step, "committed_at": time.time(), "files": files}
        self._atomic_write(f"{d}/{COMMIT_MARKER}", json.dumps(marker, indent=1).encode())

    def prepare_step_dir(self, step: int) -> None:
        """Remove a leftover of an interrupted save of the same step before writing it again."""
        d = self.path(step_dirname(step))
        if self.fs.exists(d):
            self.fs.rm(d, recursive=True)
        if self.protocol in ("file", "local"):
            self.fs.makedirs(d, exist_ok=True)

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed steps, and uncommitted leftovers older than the
        newest committed one (a newer uncommitted one may be an in-flight async save)."""
        dirs = self.step_dirs()
        committed = [s for s in sorted(dirs) if self.verify(s) is None]
        if not committed:
            return []
        doomed = set(committed[:-max(keep, 1)])
        doomed |= {s for s in dirs if s < committed[-1] and s not in committed}
        for s in sorted(doomed):
            try:
                self.fs.rm(dirs[s], recursive=True)
            except FileNotFoundError:
                pass
        return sorted(doomed)

    def discard_after(self, step: int) -> list[int]:
        """Delete every step newer than `step`, committed or not: a rollback abandoned the
        trajectory they hold (health/recovery.py), and a restart must not resume from it."""
        doomed = sorted(s for s in self.step_dirs() if s > step)
        for s in doomed:
            try:
                self.fs.rm(self.path(step_dirname(s)), recursive=True)
            except FileNotFoundError:
                pass
        return doomed

    def remove_uncommitted(self) -> list[int]:
        """At (re)start nothing is in flight: every uncommitted step dir is a leftover (C4 atomic
        commit)."""
        removed = []
        for s, d in self.step_dirs().items():
            if self.verify(s) is not None:
                self.fs.rm(d, recursive=True)
                removed.append(s)
        return removed

    def _atomic_write(self, path: str, data: bytes) -> None:
        if self.protocol in ("file", "local"):
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:  # one PUT of an object store is atomic: readers see all of it or nothing
            self.fs.pipe_file(path, data)

    def _refreshable(self) -> bool:
        return self.protocol not in ("file", "local")

    def _ls_kwargs(self) -> dict:
        return {"refresh": True} if self._refreshable() else {}
