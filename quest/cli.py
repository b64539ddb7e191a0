"""Console scripts, each the same app as its ``python ...`` form (pyproject.toml ``[project.scripts]``):

| script | same as | what |
|---|---|---|
| ``quest-train`` | ``python train.py`` | train (Hydra app, configs/train.yaml) |
| ``quest-eval`` | ``python eval.py`` | evaluate a checkpoint or a timm model (configs/eval.yaml) |
| ``quest-toy`` | ``python -m quest.toy`` | the toy study (configs/toy/toy.yaml) |
| ``quest-report`` | ``python -m quest.report`` | tables from sweeps of runs |
| ``quest-plot`` | ``python -m quest.report.plot`` | diagnostics figures |
| ``quest-export`` | ``python -m quest.tools.export`` | a run as a timm / Hugging Face model folder |
| ``quest-data`` | ``python -m quest.tools.data_check`` | ``quest-data check ROOT``: the data pre-flight on its own |

The configs are found as the package ``quest.configs`` (an install ships them; an editable install maps the
checkout's configs/ there), or, in a checkout that is only on sys.path, in its configs/ folder.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from quest.config.files import config_root, hydra_config_path
from quest.run.hydra_job import run_app
from quest.run.sweep_jobs import job_failed, sweep_failure
from quest.runtime.errors import EXIT_BUG, EXIT_ERROR, describe, print_error, program_name, reporting_errors

__all__ = ["train", "evaluate", "toy", "report", "plot", "export", "data", "config_root",
           "rewrite_attention_override"]

_IMPORT_PATH = re.compile(r"^attention=([A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


def rewrite_attention_override(argv: list[str]) -> list[str]:
    """``attention=<package.module:Class>`` (an attention from any package) -> ``attention=path
    attention.name=<package.module:Class>``: Hydra would look for a config file of that name otherwise."""
    out = []
    for arg in argv:
        match = _IMPORT_PATH.match(arg)
        out.extend(["attention=path", f"attention.name={match.group(1)}"] if match else [arg])
    return out


# --- training ------------------------------------------------------------------------------------------------------
def _as_job(work: Callable[[], Any]) -> Any:
    """Run an app's ``work`` (inside its :func:`reporting_errors`). In a multirun, a job whose error was printed
    (its exit code) does not end the sweep: it is recorded (quest.run.sweep_jobs) and the next job runs; the command
    exits with the sweep's failure at the end (:func:`_exit_if_sweep_failed`)."""
    hc = HydraConfig.get()
    try:
        return work()
    except SystemExit as exc:
        if hc.mode == RunMode.MULTIRUN and exc.code in (EXIT_ERROR, EXIT_BUG):
            return job_failed(hc.runtime.output_dir, exc.code)  # returned too: a SLURM job's launcher reads it
        raise


def _exit_if_sweep_failed(app: str) -> None:
    failure = sweep_failure()
    if failure:
        print_error(program_name(app), failure[1], alike=False)  # this process's jobs
        sys.exit(failure[0])


def _train_job(cfg: DictConfig) -> Any:
    return _as_job(lambda: _train(cfg))


_train_app = hydra.main(version_base="1.3", config_path=hydra_config_path(), config_name="train")(_train_job)


def _train(cfg: DictConfig) -> None:
    from quest.train import exit_code, fit

    hc = HydraConfig.get()
    choices = {k: str(v) for k, v in hc.runtime.choices.items() if k in ("model", "attention", "recipe", "data")}
    with reporting_errors(program_name("quest-train")):
        summary = fit(cfg, hc.runtime.output_dir, choices, provenance=_hydra_record(cfg),
                      given=list(hc.overrides.task))
    code = exit_code(summary, multirun=hc.mode == RunMode.MULTIRUN)
    if code:
        sys.exit(code)


def _hydra_record(cfg: DictConfig) -> dict[str, str]:
    """What Hydra writes with output_subdir=.hydra (relative path -> text): quest writes it only once the command
    passed every check (output_subdir is null in its configs), so a refused command leaves an earlier record as it was."""
    hc = HydraConfig.get()
    return {".hydra/config.yaml": OmegaConf.to_yaml(cfg),
            ".hydra/hydra.yaml": OmegaConf.to_yaml(HydraConfig.instance().cfg),
            ".hydra/overrides.yaml": OmegaConf.to_yaml(hc.overrides.task)}


def train() -> None:
    """``quest-train [group=option ...] [key=value ...]``: docs/training.md."""
    from quest.config.hydra_store import register_configs
    from quest.config.overrides import exit_on_bad_overrides
    from quest.config.schema import TrainConfig

    register_configs()
    _exit_after_help("quest-train", TRAIN_USAGE, TrainConfig, "train")
    sys.argv = rewrite_attention_override(sys.argv)
    exit_on_bad_overrides(program_name("quest-train"), sys.argv[1:], TrainConfig, config_root(), "train")
    _register_plugins()
    _composed("quest-train", _train_app, _train_job)
    _exit_if_sweep_failed("quest-train")


def _composed(app: str, hydra_app: Callable[[], Any], job: Callable[[DictConfig], Any]) -> None:
    """Run ``hydra_app`` (quest.run.hydra_job.run_app); a config Hydra cannot compose (a YAML error in a config file,
    an interpolation that fails) is one line naming the file, not Hydra's traceback. Hydra raises it instead of
    printing it only with HYDRA_FULL_ERROR=1, so that is set for Hydra, and the user's own choice of tracebacks is
    kept for quest's error path (quest.runtime.errors.FULL_ERROR_ASKED)."""
    import os

    from quest.runtime.errors import FULL_ERROR_ASKED, full_error_asked

    held = {name: os.environ.get(name) for name in (FULL_ERROR_ASKED, "HYDRA_FULL_ERROR")}
    asked = full_error_asked()
    os.environ.update({FULL_ERROR_ASKED: "1" if asked else "0", "HYDRA_FULL_ERROR": "1"})
    try:
        run_app(hydra_app, job)
    except Exception as exc:  # noqa: BLE001  (a job's own errors were reported by its error path: only Hydra's here)
        if asked:
            raise
        print_error(program_name(app), "the config could not be composed: " + " ".join(describe(exc).split()))
        sys.exit(EXIT_ERROR)
    finally:  # as it was for whatever runs next in this process
        for name, value in held.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _register_plugins() -> None:
    """Hydra finds sweepers and launchers by listing the hydra_plugins namespace, which an editable install (the
    README's ``pip install -e``) maps through an import hook that cannot be listed: registered by hand, quest's
    (``hydra/sweeper=quest`` and ``hydra/launcher=quest``, every app's default; ``hydra/launcher=slurm``) are found
    in a checkout as in a wheel. Without the [slurm] extra there is no SLURM launcher.

    Plugins.instance() comes first: its first call lists the plugin modules and runs each again, Hydra's own
    BasicSweeper's included, even one already imported. A class of quest's made from the BasicSweeper of before
    would fail ``super(BasicSweeper, self)`` in its __init__ (in a checkout the listing ran quest's module again as
    well, which hid it; outside one, an editable install's hook cannot be listed)."""
    from hydra.core.plugins import Plugins

    plugins = Plugins.instance()
    from hydra_plugins.quest_launcher.local import QuestLauncher, QuestSweeper

    for plugin in (QuestSweeper, QuestLauncher):
        plugins.register(plugin)
    try:
        from hydra_plugins.quest_launcher import SlurmLauncher
    except ImportError:
        return
    plugins.register(SlurmLauncher)


TRAIN_USAGE = ("[group=option ...] [key=value ...]  train a timm ViT with the chosen attention (python train.py is the "
               "same; docs/training.md). Overrides are key=value, not --flags: trainer.epochs=3 model=vit_tiny, not "
               "--epochs 3 --model vit_tiny. With no arguments: vit_pico with QUEST attention on the built-in digits, "
               "on CPU.")
EVAL_USAGE = ("checkpoint=<run>/checkpoints/last.pt [eval=<suite>] [key=value ...] | model=<configs/model option or any "
              "timm name> attention=<name> [weights=<state_dict.pt>] ...  evaluate a trained model (python eval.py is "
              "the same; docs/evaluation.md).")
TOY_USAGE = ("[grid=full|quick] [study=grid|sensitivity] [key=value ...]  the spurious-correlation toy study, standard "
             "attention against QUEST and the others (python -m quest.toy is the same; docs/experiments.md).")
_HELP_FLAGS = ("--help", "-h")
_COMPLETION_FLAGS = ("--shell-completion", "-sc")


def _exit_after_help(app: str, usage: str, schema: type | None, primary: str, config_dir: Path | None = None) -> None:
    """``--help``: the app's own config groups and every key with its description (quest.config.help), instead of
    Hydra's page, which lists every config folder (the toy's too) and no key's meaning. ``schema`` None: built here
    (quest-eval's imports its evaluations); ``config_dir``: the app's config folder (the toy's own), else configs/."""
    if not any(a in _HELP_FLAGS for a in sys.argv[1:]):
        return
    from quest.config.help import app_help
    from quest.config.overrides import app_groups

    if schema is None:
        from quest.evaluation.config import eval_config_schema, register_eval_configs

        register_eval_configs()
        schema = eval_config_schema()
    print(app_help(app, usage, app_groups(config_dir or config_root(), primary), schema), end="")
    sys.exit(0)


# --- evaluation ----------------------------------------------------------------------------------------------------
def _eval_job(cfg: DictConfig) -> Any:
    return _as_job(lambda: _evaluate(cfg))


_eval_app = hydra.main(version_base="1.3", config_path=hydra_config_path(), config_name="eval")(_eval_job)


def _evaluate(cfg: DictConfig) -> None:
    from quest.evaluation import run_evaluation

    hc = HydraConfig.get()
    with reporting_errors(program_name("quest-eval")):  # the one error line; eval.log keeps it too (quest.evaluation)
        run_evaluation(cfg, hc.runtime.output_dir, overrides=list(hc.overrides.task))


def evaluate() -> None:
    """``quest-eval checkpoint=<run>/checkpoints/last.pt eval=<suite>``: docs/evaluation.md."""
    if any(a.split("=", 1)[0] in _COMPLETION_FLAGS for a in sys.argv[1:]):
        # a TAB: the config without the evaluation modules (each imports torch); the suite files still complete
        from quest.evaluation.config import register_completion_config

        register_completion_config()
        _eval_app()
        return
    _exit_after_help("quest-eval", EVAL_USAGE, None, "eval")
    from quest.config.overrides import exit_on_bad_overrides
    from quest.evaluation import register_eval_configs, rewrite_model_override
    from quest.evaluation.config import eval_config_schema

    register_eval_configs()
    # model=<any timm name> as well as model=<configs/model option>; attention=<package.module:Class>
    sys.argv = rewrite_attention_override(rewrite_model_override(sys.argv))
    exit_on_bad_overrides(program_name("quest-eval"), sys.argv[1:], eval_config_schema(), config_root(), "eval")
    _exit_if_nothing_to_evaluate(sys.argv[1:])
    _register_plugins()
    _composed("quest-eval", _eval_app, _eval_job)
    _exit_if_sweep_failed("quest-eval")


_TARGET_KEYS = re.compile(r"^\+{0,2}(checkpoint|model|model\.name)=")


def _exit_if_nothing_to_evaluate(args: list[str]) -> None:
    """Without checkpoint= or model= there is nothing to evaluate: say so before Hydra makes an output directory
    (unless a flag asks Hydra for something else, or another primary config may set them)."""
    if any(_TARGET_KEYS.match(a) for a in args) or any(a.startswith("-") for a in args):
        return
    print_error(program_name('quest-eval'), "nothing to evaluate: pass checkpoint=<run>/checkpoints/last.pt, or "
                "model=<timm name> attention=<name> [weights=<state_dict.pt>] (quest-eval --help lists the rest)")
    sys.exit(1)


# --- toy study -----------------------------------------------------------------------------------------------------
def _toy_job(cfg: DictConfig) -> Any:
    return _as_job(lambda: _toy(cfg))


_toy_app = hydra.main(version_base="1.3", config_path=hydra_config_path("toy"), config_name="toy")(_toy_job)


def _toy(cfg: DictConfig) -> None:
    import logging
    import time

    from quest.run.outputs import start_log_file, stop_log_file
    from quest.store.files import write_text_atomic
    from quest.toy.outcomes import summary_table
    from quest.toy.study import check_study, run_study

    hc = HydraConfig.get()
    out_dir = cfg.out_dir or hc.runtime.output_dir
    start = time.perf_counter()
    handler: list[logging.Handler] = []

    def accepted() -> None:
        """Every check passed (the study's folder's too): Hydra's record and the log file (<run dir>/toy.log),
        which Hydra would have written before the checks."""
        for name, text in _hydra_record(cfg).items():
            write_text_atomic(Path(hc.runtime.output_dir) / name, text)
        handler.append(start_log_file(Path(hc.runtime.output_dir) / f"{hc.job.name}.log"))

    with reporting_errors(program_name("quest-toy")):
        study = OmegaConf.to_container(cfg, resolve=True)
        try:
            check_study(study)
            result = run_study(study, out_dir, accepted)
            print(summary_table(result["success_rates"]))
            logging.getLogger("quest.toy").info("toy study (%s grid) written to %s in %.0f s", cfg.grid.name,
                                                out_dir, time.perf_counter() - start)
        finally:
            stop_log_file(handler[0] if handler else None)


def toy() -> None:
    """``quest-toy [grid=full|quick] [attentions=[...]] [data.train_size=...]``: docs/experiments.md."""
    from quest.config.overrides import exit_on_bad_overrides
    from quest.toy.config import ToyConfig, register_toy_config

    register_toy_config()
    _exit_after_help("quest-toy", TOY_USAGE, ToyConfig, "toy", config_root() / "toy")
    exit_on_bad_overrides(program_name("quest-toy"), sys.argv[1:], ToyConfig, config_root() / "toy", "toy")
    _register_plugins()
    _composed("quest-toy", _toy_app, _toy_job)
    _exit_if_sweep_failed("quest-toy")


# --- reports -------------------------------------------------------------------------------------------------------
def report() -> None:
    """``quest-report SWEEP_DIR ...``: docs/report.md."""
    from quest.report.__main__ import main

    with reporting_errors(program_name("quest-report")):
        code = main()
    sys.exit(code)


def plot() -> None:
    """``quest-plot diagnostics RUN_DIR ... --out FILE.png``: docs/diagnostics.md."""
    from quest.report.plot import main

    with reporting_errors(program_name("quest-plot")):
        code = main()
    sys.exit(code)


def export() -> None:
    """``quest-export RUN_DIR|CHECKPOINT --out DIR [--weights model|ema]``: docs/interop.md."""
    from quest.tools.export import main

    with reporting_errors(program_name("quest-export")):
        code = main()
    sys.exit(code)


# --- data ----------------------------------------------------------------------------------------------------------
def data() -> None:
    """``quest-data check ROOT``: docs/data.md."""
    from quest.tools.data_check import main

    with reporting_errors(program_name("quest-data")):
        code = main()
    sys.exit(code)
