"""quest's SLURM launcher for Hydra (``hydra/launcher=slurm``, ``slurm_cpu``: configs/hydra/launcher).

hydra-submitit-launcher's, telling quest-train what became of each job: the jobs that failed inside are recorded
(quest.run.sweep_jobs) so the sweep exits with an error naming their logs, and a job that ended without a result is one
line instead of submitit's traceback at the first such job. Here, not in quest, because Hydra takes launchers only
from the ``hydra_plugins`` namespace; Hydra imports this module whenever it starts, so it imports nothing heavy, and
nothing at all without the ``[slurm]`` extra.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _PluginSlurmLauncher
except ImportError:  # the [slurm] extra is not installed: no launcher (quest-train names the extra when asked for it)
    _PluginSlurmLauncher = None

if _PluginSlurmLauncher is not None:
    from hydra.core.utils import JobReturn

    from quest.run import sweep_jobs
    from quest.runtime.errors import EXIT_ERROR, program_name

    class SlurmLauncher(_PluginSlurmLauncher):
        _checked = False

        def check_before_sweep(self) -> None:
            """A sweep where no SLURM cluster can take its jobs is one line (quest.run.sweep_jobs.slurm_problem),
            before the sweep's folder is made or anything submitted."""
            if self._checked:
                return
            problem = sweep_jobs.slurm_problem()
            if problem:
                print(f"{program_name('quest-train')}: error: {problem}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_ERROR)
            self._checked = True

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            from submitit.core.utils import UncompletedJobError

            self.check_before_sweep()  # once (quest's sweeper asks before it writes the sweep's folder)
            try:
                returns = super().launch(job_overrides, initial_job_idx)
            except UncompletedJobError as exc:
                message = sweep_jobs.without_result(exc, self.params["submitit_folder"])
                print(f"{program_name('quest-train')}: error: {message}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_ERROR) from None
            sweep_jobs.record_returns(returns)
            return returns

        def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                     singleton_state: dict) -> JobReturn:
            """In the SLURM job's process: the plugin's job, composed as the plugin composes it, run before Hydra's
            run_job would make its directory (quest.run.hydra_job.run_job_first), in the directory a single run of
            its command line would use (``hydra.run.dir``, not the plugin's ``job_dir_key``, the sweep's record
            folder): a job refused on the cluster leaves no directory of its own. Its resubmission after a preemption
            comes here again, and resumes in that directory."""
            import submitit
            from hydra.core.singleton import Singleton
            from hydra.core.utils import setup_globals
            from omegaconf import open_dict

            from quest.run.hydra_job import JOB_DIR, run_job_first
            from quest.runtime.phase import command_phases

            assert self.hydra_context is not None and self.config is not None and self.task_function is not None
            Singleton.set_state(singleton_state)
            setup_globals()
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
            with open_dict(sweep_config.hydra.job) as job:
                job.id = submitit.JobEnvironment().job_id
                sweep_config.hydra.job.num = job_num
            with command_phases(f"quest-{sweep_config.hydra.job.name}"):
                return run_job_first(self.task_function, sweep_config, JOB_DIR)
