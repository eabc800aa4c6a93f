"""Step and system metrics from rank 0 of the worker group, shipped to MLflow by a background
thread so a slow or absent tracking server never stalls a training step.

`MetricLogger` queues, batches, retries without bound (keeping a bounded backlog) and flushes on
demand; `SystemSampler` reads host metrics under MLflow's own `system/` names. Knows nothing of
the Trainer, Ray Train or the model.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from elastic_gpt.console import first_line
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.tracking.client import bounded_http, mlflow_client
from elastic_gpt.tracking.redaction import redact
from elastic_gpt.tracking.runs import log_params

log = logging.getLogger(__name__)


@dataclass
class _Record:
    """The metrics of one `log` call (or one system sample) at one step, with one timestamp."""

    step: int
    ts: int
    metrics: dict[str, float]
    system: bool = False


def _metrics_of(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}


def _newest(records: list[_Record], max_values: int) -> list[_Record]:
    """The newest records holding at most `max_values` metric values in all."""
    kept, total = len(records), 0
    while kept and total + len(records[kept - 1].metrics) <= max_values:
        kept -= 1
        total += len(records[kept].metrics)
    return records[kept:]


class MetricLogger:
    """Queue step metrics; a daemon thread ships them in batches, with system metrics (CPU %,
    memory) sampled every `system_every_s`. Failures only warn (training must not die because
    the tracking server blinked) and are retried with the next batch.

    Each `log` call is one record and reaches MLflow in one `log_batch` (a batch holds whole
    records), so a store that commits a batch at once (MLflow's SQL store, behind a server too)
    holds a step's record whole or not at all. For replica groups, where the logging group can
    be lost with records it never shipped: `logged_through` says how far everything is stored,
    `stop_sending` makes a logger that hands its lead over ship nothing more, and
    `log_missing` logs what another logger may not have (train/fault_tolerance.LeaderMetrics)."""

    BATCH = 1000  # MLflow's limit of metric values per log_batch

    def __init__(self, uri: str, run_id: str, flush_every_s: float = 2.0,
                 system_every_s: float | None = 5.0):
        self.uri, self.run_id, self.flush_every_s = uri, run_id, flush_every_s
        self.system_every_s = system_every_s
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()  # flush() and close() cut the wait short
        self._last_step = 0
        self._stored_through = 0
        self._sending = threading.Lock()  # held while a batch may be on its way to the store
        self._stopped_sending = False
        self._sampler = SystemSampler() if system_every_s else None
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._last_step = step
        self._q.put(_Record(step, int(time.time() * 1000), _metrics_of(metrics)))

    def log_params(self, params: dict[str, str]) -> None:
        """Params (immutable in MLflow): one the run already holds with another value is dropped
        with a warning, never retried, so it cannot hold back the metrics queued after it."""
        self._q.put(("__params__", dict(params)))
        self._wake.set()

    def log_missing(self, records: list[tuple[int, int, dict[str, float]]]) -> None:
        """(step, timestamp in ms, metrics) records that another logger may or may not have
        stored: each is logged only where its step has no value yet of the record's first
        metric (train/loss for a step's record), so a step stored by the other is not logged
        twice. Asked once, in the background, before the records are sent."""
        self._q.put(("__missing__", [_Record(s, ts, _metrics_of(m)) for s, ts, m in records]))
        self._wake.set()

    def logged_through(self) -> int:
        """The highest step such that every step record logged so far up to it is stored."""
        return self._stored_through

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Block until everything logged so far is stored (True), or `timeout_s` passed (False).
        Call it before committing a checkpoint: a job stopped right after the commit then has
        every step up to the checkpoint in MLflow, not all but the last flush interval's."""
        done = threading.Event()
        self._q.put(("__flush__", done))
        self._wake.set()
        return done.wait(timeout_s)

    def stop_sending(self, timeout_s: float) -> bool:
        """Ship what is logged so far (for up to `timeout_s`), then nothing more: once this
        returns no record of this logger reaches the store, except a batch still in flight when
        the time ran out. True if everything logged was stored. For a replica group that leaves
        the quorum: the group leading after it logs the steps that this one did not store."""
        deadline = time.monotonic() + timeout_s
        stored = self.flush(timeout_s)
        in_flight_done = self._sending.acquire(timeout=max(0.0, deadline - time.monotonic()))
        self._stopped_sending = True
        if in_flight_done:
            self._sending.release()
        return stored

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        client, pending, warned, next_sample, final_tries = None, [], False, 0.0, 0
        params: dict[str, str] = {}
        missing: list[_Record] = []
        while True:
            self._wake.wait(self.flush_every_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            if self._sampler is not None and (time.time() >= next_sample or stopping):
                pending.append(_Record(self._last_step, int(time.time() * 1000),
                                       self._sampler.sample(), system=True))
                next_sample = time.time() + self.system_every_s
            flushes = []
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Record):
                    pending.append(item)
                elif item[0] == "__flush__":
                    flushes.append(item[1])
                elif item[0] == "__params__":
                    params.update(item[1])
                elif item[0] == "__missing__":
                    missing += item[1]
            if self._stopped_sending:
                pending, missing, params = [], [], {}
            if params:
                params = self._send_params(client, params)
            if pending or missing:
                try:
                    client = client or mlflow_client(self.uri)
                    # Our loop retries forever; MLflow's own retries would block it ~4 min.
                    with bounded_http(max_retries=2, timeout_s=30):
                        if missing:
                            pending = self._not_stored(client, missing) + pending
                            missing = []
                        pending = self._send(client, pending)
                    if warned:
                        log.warning("MLflow logging to %s works again", redact(self.uri))
                    warned = False
                except Exception as e:
                    if not warned:
                        log.warning("MLflow logging to %s failed (%s); will retry",
                                    redact(self.uri), redact(first_line(e)))
                        warned = True
                    pending = _newest(pending, 100_000)  # bounded while the server is away
            if not pending:
                for done in flushes:
                    done.set()
            else:  # not stored yet: the waiters time out, or see the next successful round
                for done in flushes:
                    self._q.put(("__flush__", done))
            if stopping:
                final_tries += 1
                if not pending or final_tries >= 2:  # one more try for the last batch
                    if pending:
                        log.warning("MLflow: %d metric values could not be sent to %s",
                                    sum(len(r.metrics) for r in pending), redact(self.uri))
                    return

    def _send(self, client, pending: list[_Record]) -> list[_Record]:
        """Ship `pending` in batches of whole records; what is left (all of it, when this logger
        stopped sending). A failed batch raises, leaving it and the ones after it to retry."""
        from mlflow.entities import Metric

        while pending:
            n, size = 1, len(pending[0].metrics)
            while n < len(pending) and size + len(pending[n].metrics) <= self.BATCH:
                size += len(pending[n].metrics)
                n += 1
            batch = pending[:n]
            metrics = [Metric(k, v, r.ts, r.step) for r in batch for k, v in r.metrics.items()]
            with self._sending:
                if self._stopped_sending:
                    return []
                for i in range(0, len(metrics), self.BATCH):  # a record over the limit alone
                    client.log_batch(self.run_id, metrics=metrics[i:i + self.BATCH])
            pending = pending[n:]
            steps = [r.step for r in batch if not r.system]
            if steps and not any(not r.system for r in pending):
                self._stored_through = max(self._stored_through, *steps)
        return pending

    def _not_stored(self, client, records: list[_Record]) -> list[_Record]:
        """The records whose step has no value of their first metric in the run yet."""
        stored: dict[str, set[int]] = {}
        out = []
        for r in records:
            if not r.metrics:
                continue
            marker = next(iter(r.metrics))
            if marker not in stored:
                stored[marker] = {m.step for m in client.get_metric_history(self.run_id, marker)}
            if r.step not in stored[marker]:
                out.append(r)
        log.info("MLflow: %d of %d step record(s) another logger may have stored were "
                 "missing; logging them", len(out), len(records))
        return out

    def _send_params(self, client, params: dict[str, str]) -> dict[str, str]:
        """What is left to send: nothing once stored or refused, all of it if the server is
        away (retried with the next batch)."""
        from mlflow.exceptions import MlflowException
        try:
            client = client or mlflow_client(self.uri)
            with bounded_http(max_retries=2, timeout_s=30):
                try:
                    log_params(client, self.run_id, params)
                except MlflowException as e:
                    if e.error_code != "INVALID_PARAMETER_VALUE":
                        raise
                    # One param the run holds with another value refuses the whole batch:
                    # one by one, so only that one is dropped.
                    for key, value in params.items():
                        try:
                            log_params(client, self.run_id, {key: value})
                        except MlflowException as one:
                            if one.error_code != "INVALID_PARAMETER_VALUE":
                                raise
                            log.warning("MLflow kept the run's earlier value of %s (%s)", key,
                                        redact(first_line(one)))
            return {}
        except Exception:
            return params


class SystemSampler:
    """Host metrics under MLflow's own `system/` names (CPU %, memory, GPU memory), from psutil
    (bundled with Ray) and torch.cuda; empty if neither is available."""

    def __init__(self):
        try:
            import ray  # noqa: F401  (puts Ray's bundled psutil on sys.path)

            psutil = __import__("psutil")
            self._psutil = psutil
            psutil.cpu_percent(interval=None)  # the first call only primes the counter
            self._proc = psutil.Process()
        except Exception:
            self._psutil = None

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        ps = self._psutil
        if ps is not None:
            mem = ps.virtual_memory()
            out[mn.SYSTEM_CPU_PERCENT] = float(ps.cpu_percent(interval=None))
            out[mn.SYSTEM_MEMORY_MB] = (mem.total - mem.available) / 2**20
            out[mn.SYSTEM_MEMORY_PERCENT] = float(mem.percent)
            out[mn.SYSTEM_PROCESS_RSS_MB] = self._proc.memory_info().rss / 2**20
        try:
            import torch
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    free, total = torch.cuda.mem_get_info(i)
                    out[mn.gpu_memory_mb(i)] = (total - free) / 2**20
        except Exception:
            pass
        return out
