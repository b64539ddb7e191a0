"""What became of a sweep's jobs reaches the command that launched them (quest.run.sweep_jobs, hydra_plugins.quest_launcher):
a failed SLURM job makes the sweep fail in one message naming its log, and a job that ended without a result is one
line, not submitit's traceback. In-process, with the plugin's launch replaced by its outcomes: the real cluster
runs in tests/run/test_slurm.py."""
from __future__ import annotations

import pickle

import pytest
from hydra.core.utils import JobReturn, JobStatus
from submitit.core.utils import FailedJobError, UncompletedJobError

from hydra_plugins.quest_launcher import SlurmLauncher
from quest.run import sweep_jobs
from quest.runtime.errors import EXIT_BUG, EXIT_ERROR


@pytest.fixture(autouse=True)
def no_failures_before(monkeypatch):
    monkeypatch.setattr(sweep_jobs, "failed", [])


def _returned(value) -> JobReturn:
    job = JobReturn()
    job.status, job.return_value = JobStatus.COMPLETED, value
    return job


def _launcher(monkeypatch, outcome) -> SlurmLauncher:
    def launch(self, job_overrides, initial_job_idx):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    # the class it derives from (Hydra's plugin scan re-executes the plugin's module, so the module's attribute may
    # be a newer class object than the one quest's launcher was defined on)
    monkeypatch.setattr(SlurmLauncher.__mro__[1], "launch", launch)
    monkeypatch.setattr(sweep_jobs, "slurm_problem", lambda: None)  # a cluster answers (its refusal: a contract row)
    launcher = SlurmLauncher.__new__(SlurmLauncher)  # the plugin's own set-up needs a Hydra context: not the point
    launcher.params = {"submitit_folder": "/sweep/.submitit/%j"}
    return launcher


def test_jobs_that_failed_on_the_cluster_fail_the_sweep_naming_their_logs(monkeypatch):
    refused = sweep_jobs.JobFailed("/sweep/0", EXIT_ERROR, "/sweep/.submitit/42_0/42_0_0_log.err")
    bug = sweep_jobs.JobFailed("/sweep/2", EXIT_BUG, "/sweep/.submitit/42_2/42_2_0_log.err")
    returns = [_returned(pickle.loads(pickle.dumps(refused))), _returned(None), _returned(bug)]  # as a job returns
    assert _launcher(monkeypatch, returns).launch([["a=1"], ["a=2"], ["a=3"]], 0) is returns
    code, message = sweep_jobs.sweep_failure()
    assert code == EXIT_BUG  # a bug anywhere outranks refusals
    assert message == ("2 job(s) of the sweep failed: /sweep/0 (refused; its error is in "
                       "/sweep/.submitit/42_0/42_0_0_log.err), /sweep/2 (a bug in quest; its error is in "
                       "/sweep/.submitit/42_2/42_2_0_log.err)")


def test_a_sweep_whose_jobs_all_finished_has_no_failure(monkeypatch):
    _launcher(monkeypatch, [_returned(None), _returned(None)]).launch([["a=1"], ["a=2"]], 0)
    assert sweep_jobs.sweep_failure() is None


def test_a_job_in_this_process_is_recorded_and_returned(monkeypatch):
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
    failure = sweep_jobs.job_failed("/sweep/1", EXIT_ERROR)
    assert sweep_jobs.failed == [failure] and failure.log is None
    assert sweep_jobs.sweep_failure() == (EXIT_ERROR, "1 job(s) of the sweep failed: /sweep/1 (refused; its error is "
                                                      "above)")


def test_a_submitit_job_names_its_own_error_log(monkeypatch, tmp_path):
    # the variables submitit sets in a SLURM array task (submitit/slurm/slurm.py reads them)
    for key, value in {"SUBMITIT_FOLDER": str(tmp_path / "%j"), "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "43",
                       "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "1", "SLURM_PROCID": "0",
                       "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                       "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1"}.items():
        monkeypatch.setenv(key, value)
    assert sweep_jobs.job_failed("/sweep/1", EXIT_ERROR).log == str(tmp_path / "42_1" / "42_1_0_log.err")


TIMEOUT = UncompletedJobError("\n".join([
    "Job 42_1 (task: 0) with path /sweep/.submitit/42_1/42_1_0_result.pkl",
    "has not produced any output (state: TIMEOUT)",
    "Error stream produced:",
    "-" * 40,
    "[2026-12-03 12:00:00] epoch 3",
    "slurmstepd: error: *** JOB 43 ON node1 CANCELLED AT 2026-12-03T12:00:01 DUE TO TIME LIMIT ***",
]))
CRASHED = FailedJobError("\n".join([
    "Job (task=0) failed during processing with trace:",
    "----------------------",
    "Traceback (most recent call last):",
    '  File "submitit/core/submission.py", line 55, in process_job',
    "omegaconf.errors.InterpolationResolutionError: no node at data.root",
    "----------------------",
    "You can check full logs with 'job.stderr(0)' and 'job.stdout(0)'or at paths:",
    "  - /sweep/.submitit/42_0/42_0_0_log.err",
    "  - /sweep/.submitit/42_0/42_0_0_log.out",
]))


def test_a_sweep_that_could_not_be_submitted_is_one_line(monkeypatch, capsys):
    # submitit raises FailedJobError with sbatch's own output when sbatch fails (here: no Slurm controller found)
    error = FailedJobError("sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
                           "sbatch: fatal: Could not establish a configuration source")
    with pytest.raises(SystemExit) as exit_:
        _launcher(monkeypatch, error).launch([["a=1"]], 0)
    assert exit_.value.code == EXIT_ERROR
    assert capsys.readouterr().err == ("quest-train: error: the sweep's jobs could not be submitted: sbatch: fatal: "
                                       "Could not establish a configuration source\n")


@pytest.mark.parametrize("error, expected", [
    (TIMEOUT, "SLURM job 42_1 (task: 0) ended without a result (state: TIMEOUT); its error stream ends with: "
              "slurmstepd: error: *** JOB 43 ON node1 CANCELLED AT 2026-12-03T12:00:01 DUE TO TIME LIMIT ***; its log "
              "is under /sweep/.submitit/%j"),
    (UncompletedJobError("Job 42_0 (task: 0) with path /r.pkl\nhas not produced any output (state: CANCELLED)\n"
                         "No output/error stream produced ! Check: /o.out"),
     "SLURM job 42_0 (task: 0) ended without a result (state: CANCELLED); its log is under /sweep/.submitit/%j"),
    (CRASHED, "a SLURM job of the sweep failed before its run started (omegaconf.errors.InterpolationResolutionError: "
              "no node at data.root); its log: /sweep/.submitit/42_0/42_0_0_log.err"),
])
def test_a_job_without_a_result_is_one_line(monkeypatch, capsys, error, expected):
    with pytest.raises(SystemExit) as exit_:
        _launcher(monkeypatch, error).launch([["a=1"], ["a=2"]], 0)
    assert exit_.value.code == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err == (f"quest-train: error: {expected}; the sweep's other jobs were not waited for (squeue lists those "
                   "still running, each has its log under /sweep/.submitit/%j)\n")
