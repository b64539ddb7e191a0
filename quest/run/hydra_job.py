"""A quest command's Hydra job runs before Hydra makes any directory for it, so its checks come first.

Hydra makes a job's output directory with every missing parent (``hydra.core.utils.run_job``: ``hydra.run.dir``, or
``hydra.sweep.dir/<hydra.sweep.subdir>``) before it calls the app, and its basic sweeper and launcher make the sweep
directory, with ``multirun.yaml`` in it, before the first job. quest's checks run in the app (quest.runtime.phase),
and a command they refuse must leave the file system as it was. So quest runs each job itself, from the point where
its config is composed and nothing is made, and the directories become the job's own changes:

- a single run: :class:`JobFirst` (``hydra.callbacks.quest_job`` in each app's config) runs the job in
  ``on_run_start`` the way ``run_job`` runs it (:func:`run_job_first`), then ends Hydra's run (:class:`JobRan`):
  ``run_job`` is never reached;
- a sweep on this machine: quest's sweeper and launcher (``hydra/sweeper=quest``, ``hydra/launcher=quest``, each
  app's default: hydra_plugins/quest_launcher/local.py) run each job the same way, in the directory a single run of
  its command line would use (:data:`JOB_DIR`), and the sweep's ``multirun.yaml`` is written into
  ``hydra.sweep.dir`` with the first change of the first job whose checks pass (:func:`sweep_record_after_checks`).

The run directory is then made by the job's first write into it, or by its lock, which a command takes before its
checks and which a refusal puts back with the folders it made (quest.store.owned_dir): nothing is made that a
refusal would have to find and undo. quest's SLURM launcher (``hydra/launcher=slurm``) runs each job the same way in
the job's process on its node; the sweep's record folder, where the jobs' logs go, is made when they are submitted.
"""
from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobRuntime, JobStatus, configure_log, env_override
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

__all__ = ["JOB_DIR", "JobFirst", "JobRan", "run_app", "run_job_first", "sweep_record_after_checks", "task"]

SWEEP_RECORD = "multirun.yaml"  # Hydra's record of a sweep, in its sweep directory
#: where every job runs, alone or in a sweep: a sweep's job in the directory a single run of its command line would
#: use (so the same command line resumes there, swept or not); ``hydra.sweep.dir`` holds only the sweep's record
JOB_DIR = "hydra.run.dir"

# the app's work for a job, set by run_app while its Hydra app runs in this process
_task: Callable[[DictConfig], Any] | None = None


class JobRan(BaseException):
    """Ends Hydra's single run once quest has run its job (``job``: its JobReturn), before ``run_job``. A
    BaseException, like the SystemExit a refusal raises, so that Hydra's error report passes it on to :func:`run_app`."""

    def __init__(self, job: JobReturn):
        super().__init__("the job ran before Hydra's run_job")
        self.job = job


def task() -> Callable[[DictConfig], Any] | None:
    """The app's work for a job, while :func:`run_app` runs its app (None otherwise)."""
    return _task


def run_app(app: Callable[[], Any], work: Callable[[DictConfig], Any]) -> Any:
    """Run the ``hydra.main`` function ``app`` whose job is ``work`` (the function it decorates): each job runs before
    Hydra would make its directory (module docstring). Returns the job's return in a single run."""
    global _task
    held, _task = _task, work
    try:
        return app()
    except JobRan as ran:
        return ran.job.return_value  # as Hydra's run reads it: a job that raised raises here
    finally:
        _task = held


def _exit_if_unmakeable(config: DictConfig, key: str, path: str) -> None:
    """A directory that cannot be made (a part of it is a file, a name too long, a leading ``~``): one line and exit
    1, before the job; the command line's own ``hydra.run.dir=`` was checked before Hydra ran (quest.config.overrides),
    this is the configured one (``runs/...``, ``runs/.sweeps/...``)."""
    from quest.runtime.errors import EXIT_ERROR, print_error, program_name
    from quest.store.made_dirs import output_dir_problem

    problem = output_dir_problem(path)
    if problem is None and config.hydra.job.chdir:
        problem = ("hydra.job.chdir=true: quest's commands run in the directory they were started from (their paths "
                   "are read from there) and write into this one by its path; leave hydra.job.chdir=false")
    if problem:
        print_error(program_name("quest-" + str(config.hydra.job.name)), f"{key}={path}: {problem}")
        sys.exit(EXIT_ERROR)


def run_job_first(work: Callable[[DictConfig], Any], config: DictConfig, dir_key: str = JOB_DIR) -> JobReturn:
    """Run ``work`` on the job's ``config`` as ``hydra.core.utils.run_job`` runs a task (``hydra.runtime.output_dir``
    resolved and set, HydraConfig holding the job's config, the job's logging and ``hydra.job.env_set``), without
    making the output directory or writing into it: the job's own changes do, once its checks have passed."""
    hydra_config = HydraConfig.instance()
    held = hydra_config.cfg
    try:
        hydra_config.set_config(config)  # what the directory's ${hydra:...} read
        out = str(OmegaConf.select(config, dir_key))
        _exit_if_unmakeable(config, dir_key, os.path.abspath(out))
        with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
            config.hydra.runtime.output_dir = os.path.abspath(out)
        hydra_config.set_config(config)
        job = JobReturn()
        job.cfg = copy.deepcopy(config)
        with read_write(job.cfg), open_dict(job.cfg):
            del job.cfg["hydra"]
        job.hydra_cfg = copy.deepcopy(hydra_config.cfg)
        job.overrides = OmegaConf.to_container(config.hydra.overrides.task)
        job.working_dir = os.getcwd()
        configure_log(config.hydra.job_logging, config.hydra.verbose)
        with env_override(job.hydra_cfg.hydra.job.env_set):
            try:
                job.return_value, job.status = work(job.cfg), JobStatus.COMPLETED
            except Exception as exc:  # as run_job keeps it: raised where the return is read
                job.return_value, job.status = exc, JobStatus.FAILED
        job.task_name = JobRuntime.instance().get("name")
        return job
    finally:
        hydra_config.cfg = held


def sweep_record_after_checks(config: DictConfig) -> Callable[[], None]:
    """The write of the sweep's ``multirun.yaml`` (Hydra's record of the sweep's config) into ``hydra.sweep.dir``, for
    the first job whose checks pass (quest.runtime.phase.after_checks): a sweep whose every job is refused writes
    nothing. Written once per sweep."""
    from quest.store.files import write_text_atomic

    written: list[bool] = []

    def write() -> None:
        if not written:
            write_text_atomic(Path(str(config.hydra.sweep.dir)) / SWEEP_RECORD, OmegaConf.to_yaml(config))
            written.append(True)
    return write


class JobFirst(Callback):
    """Hydra callback of quest's apps: a single run's job runs here, before ``run_job`` (module docstring); a
    sweep's directory that cannot be made is refused before its sweeper starts."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        work = task()
        if work is None:  # the app called some other way than through run_app: Hydra's order
            return
        raise JobRan(run_job_first(work, config))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        hydra_config = HydraConfig.instance()
        held = hydra_config.cfg
        try:
            hydra_config.set_config(config)
            _exit_if_unmakeable(config, "hydra.sweep.dir",
                                os.path.abspath(str(OmegaConf.select(config, "hydra.sweep.dir"))))
        finally:
            hydra_config.cfg = held
