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

from elastic_gpt.console import first_line
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.tracking.client import bounded_http, mlflow_client
from elastic_gpt.tracking.redaction import redact
from elastic_gpt.tracking.runs import log_params

log = logging.getLogger(__name__)


class MetricLogger:
    """Queue step metrics; a daemon thread ships them in batches, with system metrics (CPU %,
    memory) sampled every `system_every_s`. Failures only warn (training must not die because
    the tracking server blinked) and are retried with the next batch."""

    def __init__(self, uri: str, run_id: str, flush_every_s: float = 2.0,
                 system_every_s: float | None = 5.0):
        self.uri, self.run_id, self.flush_every_s = uri, run_id, flush_every_s
        self.system_every_s = system_every_s
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()  # flush() and close() cut the wait short
        self._last_step = 0
        self._sampler = SystemSampler() if system_every_s else None
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self._last_step = step
        for k, v in metrics.items():
            self._q.put((k, float(v), ts, step))

    def log_params(self, params: dict[str, str]) -> None:
        """Params (immutable in MLflow): one the run already holds with another value is dropped
        with a warning, never retried, so it cannot hold back the metrics queued after it."""
        self._q.put(("__params__", dict(params)))
        self._wake.set()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Block until everything logged so far is stored (True), or `timeout_s` passed (False).
        Call it before committing a checkpoint: a job stopped right after the commit then has
        every step up to the checkpoint in MLflow, not all but the last flush interval's."""
        done = threading.Event()
        self._q.put(("__flush__", done))
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _sample_system(self) -> None:
        if self._sampler is None:
            return
        ts = int(time.time() * 1000)
        for k, v in self._sampler.sample().items():
            self._q.put((k, v, ts, self._last_step))

    def _run(self) -> None:
        from mlflow.entities import Metric
        client, pending, warned, next_sample, final_tries = None, [], False, 0.0, 0
        params: dict[str, str] = {}
        while True:
            self._wake.wait(self.flush_every_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            if self._sampler is not None and (time.time() >= next_sample or stopping):
                self._sample_system()
                next_sample = time.time() + self.system_every_s
            flushes = []
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "__flush__":
                    flushes.append(item[1])
                elif item[0] == "__params__":
                    params.update(item[1])
                else:
                    pending.append(item)
            if params:
                params = self._send_params(client, params)
            if pending:
                try:
                    client = client or mlflow_client(self.uri)
                    # Our loop retries forever; MLflow's own retries would block it ~4 min.
                    with bounded_http(max_retries=2, timeout_s=30):
                        for i in range(0, len(pending), 1000):
                            client.log_batch(self.run_id, metrics=[Metric(*m) for m in
                                                                   pending[i:i + 1000]])
                    if warned:
                        log.warning("MLflow logging to %s works again", redact(self.uri))
                    pending, warned = [], False
                except Exception as e:
                    if not warned:
                        log.warning("MLflow logging to %s failed (%s); will retry",
                                    redact(self.uri), redact(first_line(e)))
                        warned = True
                    pending = pending[-100_000:]  # bounded memory while the server is away
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
                                    len(pending), redact(self.uri))
                    return


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
