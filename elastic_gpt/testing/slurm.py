"""A real Slurm on this machine for the tests of deploy/slurm/: munged, slurmctld and one slurmd
per emulated node, from a config in a temporary folder (nothing in /etc is read or written).

Debian's Slurm is built to run several slurmd on one host, so nodes n1..nN share 127.0.0.1, each
slurmd on a port of its own (`slurmd -N n1`). munged runs with a key and a socket of its own in
the folder. Every daemon runs in the foreground as our child and is stopped by its pid; the
processes our jobs leave behind are found by the config path in their environment, never by name.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

from elastic_gpt.testing.ports import free_port

# Debian's package of each command the tests run.
PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
            "munged": "munge", "shellcheck": "shellcheck"}

# Job states after which a job runs no process (`scontrol show job`'s JobState).
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE")


def ensure_installed(commands=tuple(PACKAGES)) -> None:
    """Install Debian's packages for the commands that are missing (as root, through apt), the way
    the suite provides its other real servers. Raises with the command to run where it cannot."""
    missing = sorted({PACKAGES[c] for c in commands if shutil.which(c) is None})
    if not missing:
        return
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"{' '.join(missing)} missing; install them: sudo {' '.join(install)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # The package lists may be absent on a fresh image: fetch them once, then install.
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        out = subprocess.run(install, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(install)} failed: {out.stderr[-2000:]}")


class SlurmCluster:
    """munged + slurmctld + `nodes` slurmd, all on loopback, configured under `root`.

    `cpus_per_node` is what Slurm believes each node has (config_overrides: the host is not
    checked). `cred_expire_s` bounds how long a requeued job waits before it may start again (its
    credentials must have expired); `kill_wait_s` is the grace between SIGTERM and SIGKILL when a
    job or step ends."""

    def __init__(self, root: str, nodes: int = 2, cpus_per_node: int = 2,
                 cred_expire_s: int = 10, kill_wait_s: int = 5):
        ensure_installed(("slurmctld", "slurmd", "sbatch", "munged"))
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        os.chmod(self.root, 0o700)  # munged refuses a key or socket others could reach
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs = []
        try:
            self._start_munge()
            self._write_conf(cpus_per_node, cred_expire_s, kill_wait_s)
            self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
            for node in self.nodes:
                self._start(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", self.conf])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise

    # ---- start ---------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self._path(f"{name}.out"), "w")
        self._logs.append(log)
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def _start_munge(self) -> None:
        key = self._path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = self._path("munge.sock")
        self._start("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self._path('munged.pid')}",
                               f"--log-file={self._path('munged.log')}",
                               f"--seed-file={self._path('munged.seed')}"])
        deadline = time.time() + 30
        while not os.path.exists(self.munge_socket):
            if self.procs["munged"].poll() is not None or time.time() > deadline:
                raise RuntimeError("munged did not start:\n" + self._tail("munged.out"))
            time.sleep(0.05)

    def _write_conf(self, cpus: int, cred_expire_s: int, kill_wait_s: int) -> None:
        os.makedirs(self._path("state"), exist_ok=True)
        os.makedirs(self._path("spool"), exist_ok=True)
        ports = {node: free_port() for node in self.nodes}
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} RealMemory=4000"
                          for n, p in ports.items())
        root = self.root
        text = f"""\
ClusterName=egpt{os.getpid()}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={cred_expire_s}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
# No cgroups here: a step's processes are its process group.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# The main loop's pass over pending jobs (60 s by default): a requeued job starts once eligible.
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PlugStackConfig=/dev/null
KillWait={kill_wait_s}
JobRequeue=0
MinJobAge=3600
{nodes}
# Whole nodes per job, as GPU partitions allocate them: a second job gets other nodes.
PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
"""
        with open(self.conf, "w") as f:
            f.write(text)

    def _wait_idle(self, timeout_s: float = 60) -> None:
        """Until every node reports idle to the controller."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n"
                                       + self._tail(f"{name}.out"))
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if out.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError("the Slurm nodes did not come up idle:\n"
                           + self._tail("slurmctld.log"))

    def _tail(self, name: str, chars: int = 3000) -> str:
        try:
            with open(self._path(name), errors="replace") as f:
                return f.read()[-chars:]
        except FileNotFoundError:
            return f"({name} missing)"

    # ---- use -----------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, env: dict | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, scontrol, scancel, squeue, ...) against this cluster."""
        out = subprocess.run(list(argv), env={**self.env, **(env or {})}, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    def sbatch(self, *argv: str, env: dict | None = None, cwd: str | None = None) -> str:
        """Submit a batch job (sbatch's arguments, the script and its own); returns its id."""
        out = subprocess.run(["sbatch", "--parsable", *argv], env={**self.env, **(env or {})},
                             capture_output=True, text=True, timeout=60, cwd=cwd)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields of one job (JobState, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id)
        fields = {}
        for token in out.stdout.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def steps(self, job_id: str) -> dict[str, str]:
        """The running steps of a job: step id (`JOB.N`) -> its node list."""
        out = self.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %N", check=False)
        return dict(line.split(maxsplit=1) for line in out.stdout.splitlines()
                    if len(line.split()) == 2)

    def wait_for_state(self, job_id: str, states: tuple[str, ...],
                       timeout_s: float = 300) -> dict[str, str]:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} within {timeout_s:.0f} s: "
                           f"{self.job(job_id).get('JobState')}")

    # ---- stop ----------------------------------------------------------------------------------

    def cancel_all(self, timeout_s: float = 60) -> None:
        """Cancel every job and wait until none runs a process."""
        out = self.run("squeue", "-h", "-o", "%i", check=False)
        jobs = out.stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        deadline = time.time() + timeout_s
        while jobs and time.time() < deadline:
            states = [self.job(j).get("JobState") for j in jobs]
            if all(s in ENDED for s in states):
                break
            time.sleep(0.5)

    def stop(self) -> None:
        """Jobs first (their processes run under the slurmd's stepd), then the daemons by pid,
        then anything our jobs left behind."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.cancel_all()
            except Exception:
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for log in self._logs:
            log.close()

    def leftover_pids(self) -> list[int]:
        """Processes that carry this cluster's config in their environment: every job step and
        what it started (a Ray node that outlived its step, say), and nothing else."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
        return found


class BatchJob:
    """A batch job as a test follows it: its id, its output file (appended across reruns, as the
    batch scripts ask), and waits on lines in it."""

    def __init__(self, cluster: SlurmCluster, output: str, *argv: str, env: dict | None = None,
                 cwd: str | None = None):
        self.cluster, self.output = cluster, output
        self.id = cluster.sbatch(f"--output={output}", *argv, env=env, cwd=cwd)

    def text(self) -> str:
        try:
            with open(self.output, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_for(self, pattern: str, timeout_s: float = 240, after: int = 0) -> re.Match:
        """The first match of `pattern` in the output past character `after`; fails with the
        output's tail (and the job's state) when it does not come."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            m = re.compile(pattern).search(self.text(), after)
            if m:
                return m
            if self.cluster.job(self.id).get("JobState") in ENDED:
                break
            time.sleep(0.2)
        m = re.compile(pattern).search(self.text(), after)
        if m:
            return m
        raise AssertionError(f"job {self.id} ({self.cluster.job(self.id).get('JobState')}): no "
                             f"{pattern!r} within {timeout_s:.0f} s; output ends:\n"
                             + self.text()[-4000:])

    def state(self) -> dict[str, str]:
        return self.cluster.job(self.id)
