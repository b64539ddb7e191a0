"""What became of a multirun's jobs, told to the command that launched them wherever the jobs ran.

A job that is refused (a user error, its one line printed) or hits a bug (its traceback printed) does not stop the
sweep: it returns a :class:`JobFailed` instead of raising. Hydra's local launcher runs jobs in the launching
process, so :func:`job_failed` records them in :data:`failed` directly; a SLURM job runs in another process on
another machine, so quest's SLURM launcher (``hydra_plugins/quest_launcher``, ``hydra/launcher=slurm``) reads the
JobFailed each job returns (:func:`record_returns`) and records it there. Before this, a refused SLURM job returned
normally and the sweep exited 0; a job that ended without a result (cancelled, killed for memory, out of time) was
submitit's traceback, now it is one line (:func:`without_result`).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from quest.runtime.errors import EXIT_BUG, EXIT_ERROR

__all__ = ["JobFailed", "failed", "job_failed", "sweep_failure", "record_returns", "without_result", "slurm_problem"]


@dataclass(frozen=True)
class JobFailed:
    """A job of the sweep that ended with an error; picklable, so a SLURM job can return it."""

    run_dir: str
    code: int  # EXIT_ERROR: refused, its one line printed; EXIT_BUG: a bug in quest, its traceback printed
    log: str | None = None  # where that was printed, when the job ran under submitit (its stderr file)

    def describe(self) -> str:
        what = "refused" if self.code == EXIT_ERROR else "a bug in quest"
        where = f"in {self.log}" if self.log else "above"
        return f"{self.run_dir} ({what}; its error is {where})"


#: the sweep's failed jobs, in the launching process
failed: list[JobFailed] = []


def job_failed(run_dir: str, code: int) -> JobFailed:
    """Called in the job: record the failure (for a launcher that runs jobs in this process) and return it (for one
    whose jobs run elsewhere)."""
    failure = JobFailed(run_dir, code, _submitit_log())
    failed.append(failure)
    return failure


def sweep_failure() -> tuple[int, str] | None:
    """(exit code, message) when jobs of the sweep failed: EXIT_BUG if any job hit a bug, else EXIT_ERROR."""
    if not failed:
        return None
    code = EXIT_BUG if any(f.code == EXIT_BUG for f in failed) else EXIT_ERROR
    return code, f"{len(failed)} job(s) of the sweep failed: " + ", ".join(f.describe() for f in failed)


def record_returns(returns: Iterable[Any]) -> None:
    """In the launching process: record the JobFailed among the Hydra ``JobReturn`` values of jobs run elsewhere."""
    from hydra.core.utils import JobStatus

    for job in returns:
        if job.status == JobStatus.COMPLETED and isinstance(job.return_value, JobFailed):
            failed.append(job.return_value)


def without_result(exc: BaseException, folder: Any) -> str:
    """One line for submitit's error about a job that gave no result. Its text (submitit/core/core.py) is either
    "Job <id> (task: <t>) with path <result>" / "has not produced any output (state: <state>)" and the job's error
    stream, or, for an exception outside the run (FailedJobError), "Job (task=<t>) failed during processing with
    trace:", the trace, and the log paths; when sbatch itself failed, it is sbatch's error output (submitit raises
    the same FailedJobError for it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and set(line.strip()) != {"-"}]
    first = lines[0] if lines else ""
    if not first.startswith("Job "):  # no job was submitted: Slurm unreachable, a bad partition or account, ...
        return f"the sweep's jobs could not be submitted: {lines[-1] if lines else 'sbatch failed'}"
    if first.startswith("Job (task=") and "failed during processing" in first:
        trace = [line for line in lines[1:] if not line.startswith("You can check full logs") and
                 not line.startswith("- ")]
        logs = [line[2:] for line in lines if line.startswith("- ")]
        what = f"a SLURM job of the sweep failed before its run started ({trace[-1] if trace else 'no trace'})"
        where = f"its log: {logs[0]}" if logs else f"its log is under {folder}"
    else:
        job = first.split(" with path ")[0]  # "Job 42_0 (task: 0)"
        status = next((line for line in lines if "has not produced any output" in line), "")
        state = status[status.find("(") + 1:status.rfind(")")] if "(" in status else "state unknown"
        after = lines[lines.index(status) + 1:] if status in lines else []
        tail = after[1:] if after and after[0] == "Error stream produced:" else []
        what = f"SLURM {job[0].lower() + job[1:]} ended without a result ({state})" + (
            f"; its error stream ends with: {tail[-1]}" if tail else "")
        where = f"its log is under {folder}"
    return (f"{what}; {where}; the sweep's other jobs were not waited for (squeue lists those still running, each "
            f"has its log under {folder})")


def _submitit_log() -> str | None:
    if "SUBMITIT_FOLDER" not in os.environ:  # not a submitit job
        return None
    import submitit

    return str(submitit.JobEnvironment().paths.stderr)


def slurm_problem(timeout_s: float = 30.0) -> str | None:
    """Why SLURM cannot take a sweep's jobs from this machine, in words, or None: no ``sbatch`` on PATH, or its
    controller not reachable (``scontrol ping``: no configuration, a name that does not resolve, the controller
    down). Asked before the launcher makes the sweep's folder or submits anything, so that a sweep started where no
    cluster is gets one line and leaves nothing behind."""
    import shutil
    import subprocess

    here = "run the sweep on the cluster's login node, or leave out hydra/launcher=slurm to run its jobs here"
    if shutil.which("sbatch") is None:
        return f"no `sbatch` on PATH: hydra/launcher=slurm submits each job with SLURM's sbatch; {here}"
    if shutil.which("scontrol") is None:  # nothing to ask: sbatch says what is wrong
        return None
    try:
        done = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"SLURM's controller did not answer `scontrol ping` within {timeout_s:.0f} s; {here}"
    if done.returncode == 0:
        return None
    said = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return (f"SLURM's controller cannot be reached from this machine (`scontrol ping`: "
            f"{said[-1] if said else f'exit {done.returncode}'}); {here}")
