"""quest's sweeper and local launcher for Hydra (``hydra/sweeper=quest``, ``hydra/launcher=quest``: each app's
default, configs/hydra/sweeper/quest.yaml and configs/hydra/launcher/quest.yaml).

Hydra's basic ones, with each job's checks before any directory of the sweep is made: the sweeper does not make the
sweep directory or write ``multirun.yaml`` before the first job, and the launcher runs each job as
quest.run.hydra_job runs a single run (before ``run_job``, which would make the job's directory first), in the
directory a single run of its command line would use (its ``hydra.run.dir``: runs and sweeps laid out by one rule,
``hydra.sweep.dir`` holding only the sweep's record). The sweep's
``multirun.yaml`` is written with the first change of the first job whose checks pass; a refused job's directory is
never made. Here, not in quest, because Hydra takes sweepers and launchers only from the ``hydra_plugins`` namespace;
Hydra imports this module whenever it starts, so it imports quest only when a sweep runs.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)


def _write_sweep_record(config: Any) -> None:
    """Hydra's order: the sweep directory and its ``multirun.yaml`` before the first job."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, sweep_dir / "multirun.yaml")


def _exit_if_jobs_share_a_directory(config: Any, loader: Any, batches: Sequence[Sequence[Sequence[str]]]) -> None:
    """Each job of a sweep runs in the directory a single run of its command line would use (``hydra.run.dir``), so
    two jobs that differ only in what names no run (an operational key such as ``trainer.device``, or a
    ``hydra.run.dir=`` for them all) would share one and the second would resume the first: one line and exit 1,
    before any job runs."""
    from hydra.core.hydra_config import HydraConfig

    from quest.run.hydra_job import JOB_DIR
    from quest.runtime.errors import EXIT_ERROR, print_error, program_name

    hydra_config = HydraConfig.instance()
    held = hydra_config.cfg
    seen: dict[str, list[list[str]]] = {}
    try:
        for overrides in (job for batch in batches for job in batch):
            job_config = loader.load_sweep_config(config, list(overrides))
            hydra_config.set_config(job_config)  # what the directory's ${hydra:...} read
            seen.setdefault(str(OmegaConf.select(job_config, JOB_DIR)), []).append(list(overrides))
    finally:
        hydra_config.cfg = held
    for run_dir, jobs in seen.items():
        if len(jobs) > 1:
            common = set.intersection(*map(set, jobs))  # shown: what tells the jobs apart
            differ = " | ".join(" ".join(o for o in job if o not in common) or "(the same)" for job in jobs)
            print_error(program_name(f"quest-{config.hydra.job.name}"),
                        f"{len(jobs)} jobs of the sweep would run in one directory, {run_dir} ({differ}): "
                        f"each job runs where the single run of its command line would, and that directory's name "
                        f"leaves out what tells these apart (an operational key, or one hydra.run.dir= for every "
                        f"job); sweep what changes the result, or run them one by one")
            raise SystemExit(EXIT_ERROR)


class QuestSweeper(BasicSweeper):
    """Hydra's basic sweeper (the same ``params`` and ``max_batch_size``), leaving the sweep directory and its
    ``multirun.yaml`` to quest's launcher's jobs (module docstring). With another launcher (``hydra/launcher=slurm``:
    the jobs run elsewhere, later) they are written before the first job, as Hydra's sweeper writes them."""

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        params = [f"{key}={value}" for key, value in self.params.items()]
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides([*params, *arguments]), self.max_batch_size)
        _exit_if_jobs_share_a_directory(self.config, self.hydra_context.config_loader, self.overrides)
        if not isinstance(self.launcher, QuestLauncher):
            check = getattr(self.launcher, "check_before_sweep", None)  # quest's SLURM launcher: a cluster to submit to
            if check is not None:
                check()
            _write_sweep_record(self.config)
        returns: list[Sequence[JobReturn]] = []
        initial_job_idx = 0
        while not self.is_done():
            batch = self.get_job_batch()
            tic = time.perf_counter()
            self.validate_batch_is_legal(batch)  # every job's config composes, before the first job runs
            log.debug("validated configs of %d jobs in %.2f s", len(batch), time.perf_counter() - tic)
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for result in results:
                _ = result.return_value  # as Hydra's: a job that raised raises here
            initial_job_idx += len(batch)
            returns.append(results)
        return returns


class QuestLauncher(BasicLauncher):
    """Hydra's basic launcher (the jobs one after another in this process), each job run before Hydra would make its
    directory (quest.run.hydra_job.run_job_first)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from quest.run import hydra_job
        from quest.runtime.phase import after_checks, command_phases

        setup_globals()
        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        work = hydra_job.task()
        if getattr(self, "_record", None) is None:  # one per sweep, whose batches each come here
            self._record = hydra_job.sweep_record_after_checks(self.config)
        log.info("Launching %d jobs locally", len(job_overrides))
        runs: list[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            if work is None:  # the app called some other way than through run_app: Hydra's order
                if idx == 0:
                    _write_sweep_record(self.config)
                runs.append(run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                                    config=sweep_config, job_dir_key="hydra.run.dir", job_subdir_key=None))
            else:
                with command_phases(f"quest-{sweep_config.hydra.job.name}"):  # the job's phases, entered here
                    after_checks(self._record)  # so that the sweep's record is its first change
                    runs.append(hydra_job.run_job_first(work, sweep_config, hydra_job.JOB_DIR))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs
