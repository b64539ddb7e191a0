"""Evaluation outputs: eval_results.json (everything), eval_results.csv (every number, one per row) and
eval_results.md (tables for people), plus an optional wandb run in the training run's group."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from quest.report.markdown import markdown_table
from quest.store.files import json_text, plain, write_csv_atomic, write_text_atomic

__all__ = ["write_reports", "flatten_numbers", "flatten_texts", "log_wandb", "headline_numbers",
           "format_headline"]


def flatten_numbers(tree: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """('a/b/c', number) for every int or float leaf (booleans excluded)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flatten_numbers(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield prefix, tree


#: Text leaves written to the CSV beside the numbers (what each adversarial number means: space, labels, ...);
#: the protocol notes themselves stay in the JSON.
CSV_TEXT_KEYS = ("space", "eps_units", "labels", "clipping", "elliptical_estimator", "scoring")


def flatten_texts(tree: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """('a/b/space', 'normalized') for string leaves named in CSV_TEXT_KEYS, outside 'protocol'."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            path = f"{prefix}/{key}" if prefix else str(key)
            if key == "protocol":
                continue
            if key in CSV_TEXT_KEYS and isinstance(value, str):
                yield path, value
            else:
                yield from flatten_texts(value, path)


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.3g}"
    return str(value)


def _per_channel(values: Any) -> str:
    """'0.1170/0.1142/0.1148' for a per-channel dict, one number when the channels agree."""
    if not isinstance(values, dict):
        return _fmt(values)
    numbers = [f"{v:.4g}" for v in values.values()]
    return numbers[0] if len(set(numbers)) == 1 else "/".join(numbers)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return markdown_table(header, [[_fmt(v) for v in row] for row in rows])


_HEADLINE = ("top1", "top5", "nll", "n", "excluded_empty", "mce", "relative_mce", "mean_error", "extra_mean_error",
             "relative_mean_error", "clean_error")


# the numbers of the console's "<evaluation> done" line: top level first, then the headline of each nested result
# (top-1 of an attack budget, an ImageNet-v2 variant or a clean subset; mIoU of an explanation method)
_DONE_LINE = ("top1", "top5", "nll", "mce", "relative_mce", "mean_error", "relative_mean_error", "extra_mean_error")
_NESTED_DONE_LINE = ("top1", "miou")


def _eps_text(eps: float, space: str) -> str:
    """'1/255' for a pixel budget that is a whole number of grey levels, '0.1' for another, '0.1 normalised' in the
    normalised space."""
    if space != "pixel":
        return f"{eps:.4g} normalised"
    levels = eps * 255
    return f"{round(levels)}/255" if round(levels) >= 1 and abs(levels - round(levels)) < 1e-6 else f"{eps:.4g}"


def _nested_label(key: str, value: dict[str, Any]) -> str:
    """How a nested accuracy is named on the done line: with its sample count (a suite's own clean pass or an
    attack may run on fewer samples than the main clean pass) and, for an attack budget, its eps in its units, e.g.
    'clean (200 samples)', 'autoattack eps 1/255 (24 samples)', 'spsa eps 0.1 (16 samples)'."""
    count = value.get("n")
    samples = f" ({count} samples)" if isinstance(count, int) and not isinstance(count, bool) else ""
    if "attack" in value and isinstance(value.get("eps"), (int, float)):
        return f"{value['attack']} eps {_eps_text(float(value['eps']), value.get('space', 'pixel'))}{samples}"
    return key + samples


def headline_numbers(result: dict[str, Any]) -> dict[str, float]:
    """The headline numbers of one evaluation's result, e.g. {'top1': ..} for clean, {'clean (24 samples) top1': ..,
    'pgd eps 1/255 (24 samples) top1': ..} for adversarial, {'matched-frequency (10000 samples) top1': ..} for
    ImageNet-v2, {'agcam miou': ..} for explain."""
    out = {k: float(result[k]) for k in _DONE_LINE if isinstance(result.get(k), (int, float))}
    for key, value in result.items():
        if not isinstance(value, dict) or key == "protocol":
            continue
        for name in _NESTED_DONE_LINE:
            if isinstance(value.get(name), (int, float)):
                label = _nested_label(key, value) if name == "top1" else key  # mIoU: one sample set for all
                out[f"{label} {name}"] = float(value[name])
                break
    return out


def format_headline(name: str, value: float) -> str:
    """One number of the done line: accuracies and errors are percent, NLL in nats and mIoU a fraction."""
    if name.endswith(("nll", "miou")):
        return f"{name} {value:.3f}"
    return f"{name} {value:.2f}%"


def _section(name: str, result: dict[str, Any]) -> list[str]:
    lines = [f"## {name}", ""]
    headline = [[k, result[k]] for k in _HEADLINE if k in result]
    if headline:
        lines += _table(["metric", "value"], headline) + [""]
    variants = [(k, v) for k, v in result.items() if isinstance(v, dict) and "top1" in v and "attack" not in v]
    if variants:
        lines += _table(["set", "top-1 %", "top-5 %", "NLL", "n"],
                        [[k, v.get("top1"), v.get("top5"), v.get("nll"), v.get("n")] for k, v in variants]) + [""]
    attacks = [(k, v) for k, v in result.items() if isinstance(v, dict) and "attack" in v]
    if attacks:
        lines += _table(["attack", "space", "eps", "eps in pixels x 255 (per channel)", "labels", "n", "clean top-1 %",
                         "adv. top-1 %", "clean NLL", "adv. NLL", "max l_inf (space)", "max l_inf (pixels x 255)",
                         "seconds"],
                        [[v["attack"], v.get("space", "pixel"), v["eps"], _per_channel(v.get("eps_pixel_x255")),
                          v.get("labels"), v["n"], v["clean_top1"], v["top1"], v["clean_nll"], v["nll"],
                          v["max_linf"], v.get("max_linf_pixel_x255"), v["seconds"]] for _, v in attacks]) + [""]
        if "elliptical_estimator" in result:
            lines += [f"Elliptical estimator while attacked and scored: {result['elliptical_estimator'] or 'n/a'}", ""]
    if isinstance(result.get("error"), dict):
        error = {c: {int(s): e for s, e in by_s.items()} for c, by_s in result["error"].items()}  # JSON keys: str
        severities = sorted({s for by_s in error.values() for s in by_s})
        rows = [[c, *[by_s.get(s) for s in severities], result["corruption_error"][c],
                 (result.get("ce") or {}).get(c)] for c, by_s in error.items()]
        lines += ["Error (%) per corruption and severity; CE normalised by AlexNet (ImageNet-C only):", ""]
        lines += _table(["corruption", *[f"s{s}" for s in severities], "mean", "CE"], rows) + [""]
    for key in ("subset", "protocol", "note", "transform", "pipeline", "masking", "label", "clean_error_source"):
        if key in result:
            text = json.dumps(plain(result[key])) if isinstance(result[key], dict) else str(result[key])
            lines.append(f"- {key}: {text}")
    return lines + [""]


def write_reports(out_dir: str | Path, report: dict[str, Any]) -> dict[str, Path]:
    """Write the three files, each atomically (quest.store.files); return their paths."""
    out_dir = Path(out_dir)
    report = plain(report)
    paths = {ext: out_dir / f"eval_results.{ext}" for ext in ("json", "csv", "md")}
    rows = [(evaluation, metric, value) for evaluation, result in report["results"].items()
            for flatten in (flatten_numbers, flatten_texts) for metric, value in flatten(result)]
    target = report["target"]
    status = report.get("status", "complete")
    md = [f"# Evaluation: {report['suite']}", "",
          f"- status: {status}" + (f" ({report['error']['evaluation']} failed: {report['error']['message']})"
                                   if status == "partial" and report.get("error") else
                                   " (in progress: the results below are those finished so far)"
                                   if status == "running" else ""),
          f"- model: {target.get('model')} with {target.get('attention')} attention "
          f"({target.get('source')}: {target.get('checkpoint') or target.get('weights')}, weights: "
          f"{target.get('weights') if target.get('source') == 'checkpoint' else 'state_dict'})",
          f"- input: {target.get('img_size')} px, mean {target.get('mean')}, std {target.get('std')}, crop_pct "
          f"{target.get('crop_pct')}, {target.get('interpolation')}",
          f"- processes: {report['world_size']}, device: {report['device']}, wall time: {report['wall_time_s']:.1f} s",
          "- accuracies and errors in percent; NLL in nats", ""]
    for name, result in report["results"].items():
        md += _section(name, result)
    write_text_atomic(paths["json"], json_text(report))
    write_csv_atomic(paths["csv"], [("evaluation", "metric", "value"), *rows])
    write_text_atomic(paths["md"], "\n".join(md))
    return paths


def log_wandb(logger_cfg: Any, report: dict[str, Any], out_dir: Path, group: str | None) -> str | None:
    """One wandb run (job_type 'eval') in the training run's group; offline unless logger.mode says otherwise."""
    if not logger_cfg.wandb:
        return None
    from quest.run.outputs import init_wandb

    target = report["target"]
    name = logger_cfg.name or f"eval-{report['suite']}-{target.get('attention')}"
    then = (f"the results are complete in {out_dir} (eval_results.json); to log them to wandb, rerun with "
            "eval.overwrite=true once wandb's server can be reached")
    run = init_wandb(out_dir, then, project=logger_cfg.project, entity=logger_cfg.entity, mode=logger_cfg.mode,
                     group=logger_cfg.group or group, name=name, job_type="eval", tags=list(logger_cfg.tags),
                     config={"target": plain(target), "settings": report["settings"]}, reinit="finish_previous")
    metrics = {f"eval/{evaluation}/{metric}": value for evaluation, result in report["results"].items()
               for metric, value in flatten_numbers(plain(result))}
    run.log(metrics)
    run.summary.update(metrics)
    run_id = run.id
    run.finish()
    return run_id
