"""A real single-node Slurm cluster for the tests: munged, slurmctld and slurmd started here, stopped by PID.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (installed by .ci/run). Everything the cluster
writes lives in one temporary directory, and clients find it through the SLURM_CONF environment variable.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

# Seconds a job credential lives, and so how long a requeued job waits before it starts again (slurm.conf(5),
# AuthInfo cred_expire). Not Slurm's minimum of 5: a launch whose credential is older than this when slurmd checks it
# fails, and on a loaded machine the local round trip must keep a wide margin.
CRED_EXPIRE_S = 10
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sacct")


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm cluster tests start munged/slurmctld/slurmd and need root"
    missing = [b for b in BINARIES[:-1] if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}); .ci/run installs slurmctld slurmd slurm-client munge"
    return None


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    root: Path
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def start(self) -> "SlurmCluster":
        (self.root / "state").mkdir(parents=True)
        (self.root / "spool").mkdir()
        self._munge()
        cpus = os.cpu_count() or 2
        # Two delays a real cluster keeps, shortened: a requeued job may not start again before its credential
        # expires (cred_expire, default 120 s, at least 5; the credential only has to reach the local slurmd), and
        # the main scheduling loop, which starts a job whose BeginTime has passed, runs every sched_interval
        # (default 60 s). With the defaults, one requeue cost the preemption tests 150 s of waiting.
        (self.root / "slurm.conf").write_text(f"""\
ClusterName=questci
SlurmctldHost={self.host}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
SchedulerParameters=sched_interval=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SlurmUser=root
SlurmdUser=root
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
NodeName={self.host} CPUs={cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        conf = str(self.root / "slurm.conf")
        for cmd in ([_bin("slurmctld"), "-D", "-i", "-f", conf], [_bin("slurmd"), "-D", "-f", conf]):
            log = open(self.root / f"{Path(cmd[0]).name}.stdout", "w")
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        self._wait_idle()
        return self

    def _munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        self.munge_socket = self.root / "munge.socket"
        self.munged_pidfile = self.root / "munged.pid"
        # our own socket and pid file: this instance is ours alone, and stopped by its PID
        subprocess.run([_bin("munged"), "--force", f"--socket={self.munge_socket}",
                        f"--pid-file={self.munged_pidfile}"], check=True)

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        last = ""
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            last = out.stdout.strip() + out.stderr.strip()
            if out.returncode == 0 and last in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm did not come up: sinfo says {last!r}; logs in {self.root}")

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check)

    def show(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s Key=Value fields (JobState, Restarts, ...); empty once the job is forgotten."""
        out = self.run("scontrol", "show", "job", job_id, check=False).stdout
        return dict(token.split("=", 1) for token in out.split() if "=" in token)

    def job_state(self, job_id: str) -> str:
        return self.show(job_id).get("JobState", "UNKNOWN")

    def wait(self, job_id: str, timeout: float = 600, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) -> str:
        deadline = time.time() + timeout
        state = "UNKNOWN"
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state in done:
                return state
            time.sleep(0.5)  # scontrol asks slurmctld, a local RPC: cheap
        raise TimeoutError(f"job {job_id} still {state} after {timeout}s")

    def preempt_mid_training(self, job_id: str, metrics: Path, after: int, timeout: float = 600) -> int:
        """Send the job's tasks SLURM's pre-timeout signal (USR1, ``scancel --signal``) while its training is
        provably mid-run, and return the number of steps it had logged. Once ``metrics`` holds ``after`` training
        rows, the job's Python task is stopped (SIGSTOP, which takes effect at once, where the signal travels
        through slurmctld, slurmd and slurmstepd), the signal is sent, and the task continues only once the signal
        is pending in it: however fast the machine trains, the job cannot finish before the signal arrives, so a
        short run proves the preemption as well as a long one, and the test never races the signal."""
        deadline, pid, looked = time.time() + timeout, None, 0.0
        while time.time() < deadline:
            if pid is None and time.time() - looked > 0.5:  # /proc twice a second, the file 50 times a second
                pid, looked = self.task_pid(job_id), time.time()
            if pid is not None and _rows(metrics) >= after:
                break
            time.sleep(0.02)
        else:
            raise TimeoutError(f"job {job_id} did not log {after} steps in {timeout}s (task {pid}); logs in {self.root}")
        os.kill(pid, signal.SIGSTOP)
        _until(lambda: _proc_status(pid, "State").startswith("T"), f"task {pid} of job {job_id} to stop")
        steps = _rows(metrics)  # stopped: nothing more is written
        self.run("scancel", "--signal=USR1", job_id)
        bit = 1 << (signal.SIGUSR1 - 1)
        _until(lambda: (int(_proc_status(pid, "ShdPnd") or "0", 16) | int(_proc_status(pid, "SigPnd") or "0", 16))
               & bit, f"USR1 to reach task {pid} of job {job_id}")
        os.kill(pid, signal.SIGCONT)
        return steps

    def task_pid(self, job_id: str) -> int | None:
        """The PID of the job's Python task (started by slurmstepd: srun's step, or submitit's), found by the job
        id in its environment; ``job_id`` may name an array task, ``<array job>_<task>``. None while it has none.
        The job inherits SLURM_CONF from its submitter: a job of another cluster on this machine is never taken."""
        array, _, task = job_id.partition("_")
        want = {f"SLURM_ARRAY_JOB_ID={array}", f"SLURM_ARRAY_TASK_ID={task}"} if task else {f"SLURM_JOB_ID={job_id}"}
        want.add(f"SLURM_CONF={self.root / 'slurm.conf'}")
        for proc in Path("/proc").iterdir():
            try:
                if not proc.name.isdigit() or not Path(os.readlink(proc / "exe")).name.startswith("python"):
                    continue
                ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
                if not Path(os.readlink(f"/proc/{ppid}/exe")).name.startswith("slurmstepd"):
                    continue  # a data-loader worker, or srun's own
                if want <= set((proc / "environ").read_bytes().decode(errors="replace").split("\0")):
                    return int(proc.name)
            except (OSError, IndexError):
                continue
        return None

    def stop(self) -> None:
        """Cancel every job (a requeued one may still run its steps), stop the daemons, then end whatever a job
        left: job steps outlive slurmd (slurmstepd is re-parented to init) and would wait forever on a dead
        controller."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
            deadline = time.time() + 30
            while time.time() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(1)
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if getattr(self, "munged_pidfile", None) and self.munged_pidfile.exists():
            pid = int(self.munged_pidfile.read_text().strip())
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass
        for pid in self._leftover_job_processes():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def _leftover_job_processes(self) -> list[int]:
        """Every process but this one whose command line or open files lie under the cluster's root (job scripts,
        slurmstepd, which keeps slurmd.log open), and their descendants (srun, the job's Python)."""
        root, parent, found = f"{self.root}/", {}, set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            pid = int(proc.name)
            try:
                parent[pid] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                paths = [(proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")]
                paths += [os.readlink(fd) for fd in (proc / "fd").iterdir()]
            except (OSError, ValueError, IndexError):
                continue
            if any(root in text for text in paths):
                found.add(pid)
        grown = True
        while grown:  # and every descendant of what was found
            more = {pid for pid, ppid in parent.items() if ppid in found} - found
            grown, found = bool(more), found | more
        return sorted(found)


def _rows(metrics: Path) -> int:
    """Training rows in a run's metrics.jsonl (0 before it exists)."""
    try:
        return sum('"train/loss"' in line for line in metrics.read_text().splitlines())
    except FileNotFoundError:
        return 0


def _proc_status(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return line.split(":", 1)[1].strip()
    return ""


def _until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout}s for {what}")
        time.sleep(0.01)
