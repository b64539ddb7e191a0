"""How the toy study's runs are judged and summed up: each run's outcome from its accuracies (this project's rules
and the paper's ranges), success rates with Wilson intervals, the sensitivity table and its stopping rule, and the
labels runs carry in the outputs. Pure functions of stored results: nothing here trains.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from quest.report.markdown import markdown_table

from .config import OutcomeRules, PaperOutcomeRules, StopRule

__all__ = ["OUTCOMES", "PAPER_OUTCOMES", "SENSITIVITY_FIELDS", "classify", "classify_paper", "wilson_interval",
           "success_rates", "sensitivity_table", "stop_size", "summary_table", "variant_spec", "test_key"]

OUTCOMES = ("correct", "biased", "degenerate", "other")


PAPER_OUTCOMES = ("correct", "biased", "degenerate", "unclassified")


def classify(train_acc: float, test_acc: float, rules: OutcomeRules) -> str:
    """This project's outcome of a run from its train and test accuracy (fractions); see :class:`OutcomeRules`."""
    if train_acc >= rules.correct_min and test_acc >= rules.correct_min:
        return "correct"
    if train_acc <= rules.degenerate_train_max and test_acc <= rules.degenerate_test_max:
        return "degenerate"
    if train_acc >= rules.biased_train_min and test_acc <= rules.biased_test_max:
        return "biased"
    return "other"


def classify_paper(train_acc: float, test_acc: float, rules: PaperOutcomeRules) -> str:
    """The paper's outcome of a run, by its own ranges (:class:`PaperOutcomeRules`); "unclassified" where none fits."""
    if train_acc > rules.correct_above and test_acc > rules.correct_above:
        return "correct"
    (tr_lo, tr_hi), (te_lo, te_hi) = rules.biased_train, rules.biased_test
    if tr_lo <= train_acc <= tr_hi and te_lo <= test_acc <= te_hi:
        return "biased"
    if train_acc <= rules.chance_max and test_acc <= rules.chance_max:
        return "degenerate"
    return "unclassified"


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion k / n."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def success_rates(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per formulation: outcome counts and the share of correct runs, overall and per (lr, weight decay) cell; with
    ``paper_outcome`` in the rows also the counts under the paper's ranges."""
    groups: dict[tuple, list] = {}
    for r in rows:
        for key in ((r["attention"], "all", "all"), (r["attention"], r["lr"], r["weight_decay"])):
            groups.setdefault(key, []).append(r)
    out = []
    for (attention, lr, wd), members in groups.items():
        counts = Counter(r["outcome"] for r in members)
        n = len(members)
        row = {"attention": attention, "lr": lr, "weight_decay": wd, "runs": n, **{o: counts[o] for o in OUTCOMES},
               "success_rate": counts["correct"] / n}
        if "paper_outcome" in members[0]:
            paper = Counter(r["paper_outcome"] for r in members)
            row.update({f"paper_{o}": paper[o] for o in PAPER_OUTCOMES})
            row["unclassified_by_both"] = sum(r["outcome"] == "other" and r["paper_outcome"] == "unclassified"
                                              for r in members)
        out.append(row)
    return out


def variant_spec(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """attention / variant name -> {attention, param_init, frozen, label}."""
    variants = cfg.get("variants") or {}
    if name in variants:
        v = dict(variants[name])
        return {"attention": v["attention"], "param_init": dict(v.get("param_init") or {}),
                "frozen": list(v.get("frozen") or []), "label": v.get("label") or name}
    return {"attention": name, "param_init": {}, "frozen": [], "label": name}


def test_key(fraction: float) -> str:
    return f"test_acc_b{fraction:g}"


def _group(rows: list[dict], test_key: str, rules: OutcomeRules, paper: PaperOutcomeRules) -> dict[str, Any]:
    n = len(rows)
    mine = Counter(classify(r["train_acc"], r[test_key], rules) for r in rows)
    theirs = Counter(classify_paper(r["train_acc"], r[test_key], paper) for r in rows)
    neither = sum(classify(r["train_acc"], r[test_key], rules) == "other"
                  and classify_paper(r["train_acc"], r[test_key], paper) == "unclassified" for r in rows)
    return {"runs": n, "mine": mine, "paper": theirs, "neither": neither}


def _row(axis: str, value: Any, name: str, size: int, fraction: float, rule_set: str, g: dict) -> dict[str, Any]:
    counts = g["mine"] if rule_set == "project" else g["paper"]
    names = OUTCOMES if rule_set == "project" else PAPER_OUTCOMES
    k, n = counts["correct"], g["runs"]
    lo, hi = wilson_interval(k, n)
    return {"axis": axis, "value": value, "attention": name, "train_size": size, "test_biased_fraction": fraction,
            "rules": rule_set, "runs": n, **{o: counts[o] for o in names if o != "unclassified"},
            "other": counts["other"] if rule_set == "project" else counts["unclassified"],
            "success_rate": round(k / n, 6), "ci_low": round(lo, 6), "ci_high": round(hi, 6),
            "unclassified_by_both": g["neither"]}


SENSITIVITY_FIELDS = ["axis", "value", "attention", "train_size", "test_biased_fraction", "rules", "runs", "correct",
                      "biased", "degenerate", "other", "success_rate", "ci_low", "ci_high", "unclassified_by_both"]


def sensitivity_table(rows: list[dict], cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The sensitivity CSV: success rate (with its 95% Wilson interval) and outcome counts per choice and formulation.

    axis ``train_size``: every formulation and variant, the default test set, this project's rules; ``qknorm_scale``:
    the scale variants; ``test_biased_fraction``: the formulations on each test set; ``outcome_rules``: the
    formulations under this project's partition and the paper's ranges ("other" = not classified by that set;
    ``unclassified_by_both`` = classified by neither)."""
    st = cfg["study"]
    rules, paper = OutcomeRules(**cfg["outcome"]), PaperOutcomeRules(**cfg["paper_outcome"])
    default_fraction = float(cfg["data"]["test_biased_fraction"])
    by = {}
    for r in rows:
        by.setdefault((r["attention"], r["train_size"]), []).append(r)
    names = list(dict.fromkeys(list(cfg["attentions"]) + list(st["scale_variants"])))
    out = []
    for name in names:
        for size in st["train_sizes"]:
            out.append(_row("train_size", size, name, size, default_fraction, "project",
                            _group(by[(name, size)], "test_acc", rules, paper)))
    for name in st["scale_variants"]:
        for size in st["train_sizes"]:
            out.append(_row("qknorm_scale", variant_spec(cfg, name)["label"], name, size, default_fraction, "project",
                            _group(by[(name, size)], "test_acc", rules, paper)))
    for name in cfg["attentions"]:
        for size in st["train_sizes"]:
            for fraction in st["test_biased_fractions"]:
                out.append(_row("test_biased_fraction", fraction, name, size, float(fraction), "project",
                                _group(by[(name, size)], test_key(fraction), rules, paper)))
            g = _group(by[(name, size)], "test_acc", rules, paper)
            for rule_set in ("project", "paper"):
                out.append(_row("outcome_rules", rule_set, name, size, default_fraction, rule_set, g))
    return out


def stop_size(table: list[dict], attentions: Sequence[str], sizes: Sequence[int], rule: StopRule) -> dict[str, Any]:
    """The smallest training-set size beyond which no formulation's success rate changes (:class:`StopRule`)."""
    rate = {(r["attention"], r["train_size"]): r for r in table if r["axis"] == "train_size"}
    sizes = sorted(int(s) for s in sizes)
    steps = []
    for n, nxt in zip(sizes, sizes[1:]):
        checks = []
        for a in attentions:
            r0, r1 = rate[(a, n)], rate[(a, nxt)]
            k0, k1, n0, n1 = r0["correct"], r1["correct"], r0["runs"], r1["runs"]
            p0, p1, pooled = k0 / n0, k1 / n1, (k0 + k1) / (n0 + n1)
            se = math.sqrt(pooled * (1 - pooled) * (1 / n0 + 1 / n1))
            allowed = max(rule.min_points / 100, rule.z * se)
            checks.append({"attention": a, "from": round(p0, 4), "to": round(p1, 4), "change": round(p1 - p0, 4),
                           "allowed": round(allowed, 4), "stable": abs(p1 - p0) <= allowed + 1e-12})
        steps.append({"size": n, "next": nxt, "stable": all(c["stable"] for c in checks), "checks": checks})
    chosen = next((s["size"] for s in steps if s["stable"]), sizes[-1])
    return {"rule": dataclasses.asdict(rule), "size": chosen,
            "converged": any(s["stable"] for s in steps), "steps": steps}


def summary_table(rates: Iterable[Mapping[str, Any]]) -> str:
    """Markdown: per formulation, the overall success rate and outcome shares."""
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    rows = [(r["attention"], r["runs"], pct(r["success_rate"]), pct(r["biased"] / r["runs"]),
             pct(r["degenerate"] / r["runs"]), pct(r["other"] / r["runs"])) for r in rates if r["lr"] == "all"]
    return "\n".join(markdown_table(["attention", "runs", "correct (success rate)", "biased", "degenerate", "other"],
                                     rows))
