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
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            from submitit.core.utils import UncompletedJobError

            try:
                returns = super().launch(job_overrides, initial_job_idx)
            except UncompletedJobError as exc:
                message = sweep_jobs.without_result(exc, self.params["submitit_folder"])
                print(f"{program_name('quest-train')}: error: {message}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_ERROR) from None
            sweep_jobs.record_returns(returns)
            return returns
