"""Paper-style tables from sweeps of training runs (mean ± std over seeds, Welch p-values, lr sensitivity).

    python -m quest.report SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--metrics PATTERN ...] [--by KEY ...]
                           [--primary METRIC] [--include-stopped] [--num-classes N] [--decimals D]

Prints markdown to stdout; with --out also writes runs.md / runs.csv and, for an lr sweep, lr_sensitivity.md /
lr_sensitivity.csv. Exit status 2 with a message on stderr for unusable input. Columns and grouping: docs/report.md.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from quest.runtime.errors import doc_summary, input_error, parse_arguments, program_name
from quest.store.damage import DamagedFile
from quest.store.output_folder import FolderHeld, FolderUnmakeable, input_path, output_path
from quest.store.tree import OutputExists

from . import DEFAULT_PRIMARY, ReportInputError, build_report, load_runs, lr_markdown, perf_markdown, runs_markdown, write_outputs

#: --decimals' range: a float64 holds about 16 significant digits; more decimals print digits no run measured
MAX_DECIMALS = 12


def _decimals(text: str) -> int:
    """argparse type of ``--decimals``: an integer in 0..MAX_DECIMALS."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..{MAX_DECIMALS}, got {text!r}") from None
    if not 0 <= value <= MAX_DECIMALS:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..{MAX_DECIMALS}, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program_name("quest-report"), description=doc_summary(__doc__))
    parser.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR", type=input_path,
                        help="directories searched recursively for run directories (summary.json)")
    parser.add_argument("--out", type=output_path, help="also write the tables to this directory (.md and .csv)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace tables already in --out (the old ones are kept in --out/.replaced/)")
    parser.add_argument("--metrics", nargs="+", metavar="PATTERN",
                        help="metric names or shell-style patterns, e.g. val/top1 val/loss 'imagenet_c/*' (default: "
                        "val/top1, val_ema/top1 and the top-1 / mCE / mean errors of eval_results.json)")
    parser.add_argument("--by", nargs="+", metavar="KEY",
                        help="the settings that make a row, e.g. attention model recipe.lr (default: attention, model "
                        "and every setting that differs between runs except the seed)")
    parser.add_argument("--primary", default=DEFAULT_PRIMARY,
                        help=f"metric that picks the best row and is t-tested (default: {DEFAULT_PRIMARY}; losses and "
                        "errors: lower is better)")
    parser.add_argument("--include-stopped", action="store_true",
                        help="average runs stopped at trainer.max_steps too (default: excluded and counted in notes)")
    parser.add_argument("--num-classes", type=int,
                        help="classes of the data set, for the lr sensitivity's loss0 = ln(C) (default: "
                        "data.num_classes of .hydra/config.yaml)")
    parser.add_argument("--decimals", type=_decimals, default=2,
                        help=f"decimals of accuracies, 0..{MAX_DECIMALS} (losses get one more; default: 2)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = parse_arguments(_parser(), argv)
    metrics = [m for part in args.metrics for m in part.split(",") if m] if args.metrics else None
    by = [k for part in args.by for k in part.split(",") if k] if args.by else None
    try:
        if args.num_classes is not None and args.num_classes < 2:
            raise ReportInputError(f"--num-classes must be at least 2, got {args.num_classes}")
        report = build_report(load_runs(args.sweep_dirs), metrics=metrics, by=by, primary=args.primary,
                              include_stopped=args.include_stopped, num_classes=args.num_classes,
                              decimals=args.decimals)
        # --out held by another report, or holding tables this one did not write: refused as any input is
        written = write_outputs(report, args.out, args.overwrite) if args.out else []
    # DamagedFile: --out's .replaced; FolderUnmakeable: --out a training run's directory, or under a file
    except (ReportInputError, OutputExists, FolderHeld, FolderUnmakeable, DamagedFile) as err:
        return input_error(program_name("quest-report"), err)
    print(runs_markdown(report))
    if perf := perf_markdown(report):
        print(perf)
    if report.sweeps:
        print(lr_markdown(report))
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # quest's one error path (quest/runtime/errors.py), as the quest-report console script
    from quest.runtime.errors import program_name, reporting_errors

    with reporting_errors(program_name("quest-report")):
        code = main()
    sys.exit(code)
