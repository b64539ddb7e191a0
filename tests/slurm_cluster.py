"""A real single-node Slurm cluster for the tests: munged, slurmctld and slurmd started here, stopped by PID.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (installed by .ci/run). Everything the cluster
writes lives in one temporary directory, and clients find it through the SLURM_CONF environment variable.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

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
        (self.root / "slurm.conf").write_text(f"""\
ClusterName=questci
SlurmctldHost={self.host}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
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
            time.sleep(1)
        raise RuntimeError(f"Slurm did not come up: sinfo says {last!r}; logs in {self.root}")

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check)

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", job_id, check=False).stdout
        for token in out.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
        return "UNKNOWN"

    def wait(self, job_id: str, timeout: float = 600, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) -> str:
        deadline = time.time() + timeout
        state = "UNKNOWN"
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state in done:
                return state
            time.sleep(2)
        raise TimeoutError(f"job {job_id} still {state} after {timeout}s")

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
