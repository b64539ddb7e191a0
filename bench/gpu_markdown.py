"""bench/gpu.py's gpu_check.md: the report's rows so far as markdown, part by part (rewritten after every row)."""
from __future__ import annotations

from typing import Any

from bench.gpu_step import TIMM

__all__ = ["render"]

STEP_TITLES = {"step_bf16": "Training step, eager, bf16 autocast", "step_compiled": "Training step, compiled, bf16",
               "step_fp16": "Training step, eager, fp16 autocast (GradScaler)",
               "step_compiled_fp16": "Training step, compiled, fp16 (GradScaler)"}


def _x(value: float | None, ref: float | None, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    if value is None:
        return "n/a"
    text = fmt.format(value * scale)
    return f"{text} ({value / ref:.3f})" if ref else text


def _skipped(rows: list[dict[str, Any]], label: str = "skipped") -> list[str]:
    return [f"- {label}: {r['skipped']} ({r['reason']})" for r in rows if "skipped" in r]


def _step_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    done = [r for r in rows if "skipped" not in r]
    std = next((r for r in done if r["attention"] == "standard"), None)
    std_proxy = (std or {}).get("proxy") or {}
    depth = f" at depth {meta['depth']}" if meta.get("depth") else ""
    counted = next((p["model"] for r in done if (p := r.get("proxy") or {}).get("model")), "ViT-Ti")
    lines = [f"{meta['model']}{depth}, {meta['img_size']} px, batch {meta['batch']}, median of {meta['steps']} steps; "
             "(x std): over quest's standard in this table; proxy: bench.dispatch_proxy's count of one eager "
             f"training step of {counted} (batch 2, the GPU path) on the CPU under CUDA's autocast rules", "",
             "| attention | ms (x std) | img/s | MFU | SDPA | peak GiB (x std) | first step s | proxy launches (x std) "
             "| proxy MB moved (x std) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in done:
        proxy = r.get("proxy") or {}
        name = "timm's own" if r["attention"] == TIMM else r["attention"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        mem = _x(r.get("peak_memory_gib"), std and std.get("peak_memory_gib"), "{:.2f}")
        launches = _x(proxy.get("launches"), std_proxy.get("launches"), "{:.0f}")
        moved = _x(proxy.get("bytes"), std_proxy.get("bytes"), "{:.1f}", 1e-6)
        lines.append(f"| {name} | {_x(r['step_s'], std and std['step_s'], scale=1e3)} | {r['img_per_s']:.0f} | {mfu} "
                     f"| {r['sdpa_backend']} | {mem} | {r['first_step_s']:.1f} | {launches} | {moved} |")
    reasons = sorted({p["reason"] for r in done if (p := r.get("proxy")) and p.get("reason")
                      and r["attention"] != TIMM})
    return lines + [f"- proxy not counted: {reason}" for reason in reasons] + _skipped(rows)


def _numerics(rows: list[dict[str, Any]]) -> list[str]:
    done = [r for r in rows if "skipped" not in r]
    if not done:
        return _skipped(rows)
    first = done[0]
    lines = [f"{first['model']} at {first['img_size']} px, batch {first['batch']}: {first['device']} against "
             f"{first['reference']}, max |a - b| / max |b| per tensor", "",
             "| attention | logits | gradients (worst tensor) | zero in exact arithmetic (abs) | agrees |",
             "|---|---|---|---|---|"]
    for r in done:
        zero = ", ".join(f"{k} {v:.1e}" for k, v in r["grads_zero_in_exact_arithmetic"].items()) or "-"
        lines.append(f"| {r['attention']} | {r['logits_max_rel']:.1e} | {r['grads_max_rel']:.1e} ({r['grads_worst']}) "
                     f"| {zero} | {r['ok']} |")
    return lines + _skipped(rows)


def _run_line(label: str, r: dict[str, Any]) -> str:
    status = (r.get("summary") or {}).get("status") if "summary" in r else r.get("status")
    error = r.get("error_line") if r["returncode"] else ""
    return (f"- {label}: exit {r['returncode']}{' (' + r['ended'] + ')' if r.get('ended') else ''}, "
            f"{r['seconds']:.1f} s" + (f", status {status}" if status else "") + (f"; error: `{error}`" if error else ""))


def _recipe(rows: list[dict[str, Any]]) -> list[str]:
    steps = [r for r in rows if "step_s" in r]
    bare = steps[0]["step_s"] if steps else None
    lines = ["| step | ms (x bare) | img/s | peak GiB |", "|---|---|---|---|"]
    for r in steps:
        mem = r.get("peak_memory_gib")
        lines.append(f"| {r['step']} | {_x(r['step_s'], bare, scale=1e3)} | {r['img_per_s']:.0f} | "
                     f"{f'{mem:.2f}' if mem is not None else 'n/a'} |")
    for r in (r for r in rows if r.get("step") == "train.py"):
        s = r["steady"]
        lines += ["", _run_line("train.py", r)]
        if s.get("step_s"):
            lines.append(f"- train.py's steady step ({s['steady']} of {s['intervals']} log intervals): "
                         f"{1e3 * s['step_s']:.1f} ms median ({1e3 * s['step_s_min']:.1f}-{1e3 * s['step_s_max']:.1f}"
                         f"), {s['img_per_s']:.0f} img/s, data wait at most {100 * s['data_wait_max']:.1f}%"
                         + (f", MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else ""))
        for key, text in (("vs_bare", "train.py over the bare step"),
                          ("recipe_cost", "the recipe's cost (its whole step over the bare step)"),
                          ("loop_cost", "the loop's cost (train.py over the recipe's whole step)")):
            if key in r:
                lines.append(f"- {text}: {r[key]:.3f}x")
    return lines + _skipped(rows)


def _toy(rows: list[dict[str, Any]], device: str) -> list[str]:
    lines: list[str] = []
    for r in rows:
        if "quick_grid" in r:
            q = r["quick_grid"]
            lines += [_run_line(f"`python -m quest.toy grid=quick device={device}`", q), "", q.get("table", ""), ""]
        elif "chunk_runs" in r:
            lines.append(f"- one full-grid chunk (QUEST, {r['chunk_runs']} runs, {r['train_size']} samples, "
                         f"{r['epochs']} epochs, compilation included): {r['chunk_seconds']:.1f} s, "
                         f"{r['run_steps_per_s']:.0f} run-steps/s; the full grid (30 such chunks) estimated at "
                         f"{r['full_grid_estimate_s'] / 60:.1f} min")
    return lines + _skipped(rows)


def _input(rows: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for r in (r for r in rows if "img_per_s" in r):
        lines += [f"batch {r['batch']} at {r['img_size']} px; RandAugment on the device gives the CPU's pixels for "
                  f"the same draws: {r['rand_augment_equals_cpu']}", "", "| stage | img/s |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in r["img_per_s"].items()]
    return lines + _skipped(rows)


def _sci(value: Any) -> str:
    return f"{value:.1e}" if isinstance(value, (int, float)) else "n/a"


def _environment(rows: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for r in (r for r in rows if r.get("check") == "environment"):
        cc, headers, cache = r["c_compiler"], r["python_headers"], r["triton_cache"]
        gpu = (f"{r['gpu']}, {r['gpu_memory_gib']:.0f} GiB, compute capability {r['compute_capability']}"
               if r.get("gpu") else "no GPU")
        lines += [f"- torch {r['torch']}, CUDA {r['cuda']}, Triton {r['triton']}, Python {r['python']}; {gpu}",
                  f"- C compiler ({cc['from']}): {cc['cc'] or 'none found'}; Python.h: "
                  f"{'found' if headers['found'] else 'missing'} in {headers['include']}; Triton cache {cache['dir']}: "
                  f"{'writable' if cache['writable'] else 'NOT writable: ' + cache.get('error', '')}"
                  + ("; TRITON_INTERPRET=1" if r.get("triton_interpret") else "") + f"; ok: {r['ok']}"]
    ops = [r for r in rows if r.get("check") == "opcheck"]
    for r in ops:
        what = r.get("op") or "no operator"
        detail = r.get("note") or "; ".join(r.get("failures", [])) or f"{r.get('samples')} sample(s)"
        lines.append(f"- torch.library.opcheck {what}: {r['ok']} ({detail[:300]})")
    return lines + _skipped(rows)


def _kernels(rows: list[dict[str, Any]]) -> list[str]:
    done = [r for r in rows if r.get("check") == "kernel"]
    lines: list[str] = []
    if done:
        first = done[0]
        lines += [f"batch {first['batch']}, {first['heads']} heads, {first['tokens']} tokens, head widths "
                  f"{', '.join(map(str, first['widths']))}, contiguous and qkv-view inputs; worst max |a - b| / max |b| "
                  f"against {first['reference']}" + (f" ({first['note']})" if first.get("note") else ""), "",
                  "| kernel | dtype | values | gradients (worst) | worst at | tolerance | ran | ok |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in done:
        rel = r.get("max_rel") or {}
        grads = {k: v for k, v in rel.items() if k.startswith("grad")}
        worst = max(grads, key=grads.__getitem__) if grads else None
        lines.append(f"| {r['kernel']} | {r['dtype']} | {_sci(rel.get('values'))} | "
                     f"{_sci(grads[worst]) + ' (' + worst + ')' if worst else '-'} | "
                     f"{(r.get('worst_at') or {}).get('values', '')} | {r['tolerance']:.0e} | {r.get('ran', '')} | "
                     f"{r['ok']}{' ' + r['error'] if r.get('error') else ''} |")
    for r in (r for r in rows if r.get("check") == "check_kernels"):
        lines.append(f"- check_kernels{' ' + r['dtype'] if r.get('dtype') else ''}: {r['ok']} "
                     f"({r.get('note') or '; '.join(r.get('errors', [])) or 'every width'})")
    return lines + _skipped(rows)


def _fused(rows: list[dict[str, Any]]) -> list[str]:
    done = [r for r in rows if r.get("check") == "fused step"]
    lines: list[str] = []
    if done:
        lines += [f"{done[0]['model']}, {done[0]['img_size']} px, batch {done[0]['batch']}, bf16 autocast: the fused "
                  "operators on and off; differences max |a - b| / max |b| per tensor (fp32: the same step in float32)",
                  "", "| attention | logits fused vs PyTorch | grads fused vs PyTorch | grads vs fp32, fused / PyTorch "
                  "| ms fused / PyTorch (x) | peak GiB fused / PyTorch | SDPA | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in done:
        if "fused" not in r:
            lines.append(f"| {r['attention']} | {r.get('note') or r.get('error', '')} | | | | | | {r['ok']} |")
            continue
        f, p = r["fused"], r["pytorch"]
        mem = (f"{f['peak_memory_gib']:.2f} / {p['peak_memory_gib']:.2f}" if f.get("peak_memory_gib") is not None
               else "n/a")
        lines.append(f"| {r['attention']} | {_sci(r['logits_fused_vs_pytorch'])} | {_sci(r['grads_fused_vs_pytorch'])} "
                     f"| {_sci(f['grads_vs_fp32'])} / {_sci(p['grads_vs_fp32'])} | {1e3 * f['step_s']:.1f} / "
                     f"{1e3 * p['step_s']:.1f} ({r['step_ratio']:.3f}) | {mem} | {f['sdpa_backend']} | {r['ok']} |")
    return lines + _skipped(rows)


def _loop(rows: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for r in (r for r in rows if "check" in r):
        if r.get("error"):
            lines.append(f"- {r['check']}: ok {r['ok']}; error: `{r['error'][:300]}`")
        elif "syncs" in r:
            s = r["syncs"]
            nan = r.get("unchanged_by_nan_step")
            lines.append(f"- {r['check']} ({r['counter']}): {s['in_steps_between_logs']} in the steps between log "
                         f"intervals, {s['between_steps']} between those steps, {s['at_log_steps']} at log steps, "
                         f"{s['before_first_step']} before the first step, {s['after_last_step']} after the last; "
                         f"{r['steps']} steps, status {r['status']}"
                         + (f"; after the NaN step {r['nan_step']} unchanged: {nan}" if nan else "")
                         + ("; the fault was NOT injected" if r.get("fault_injected") is False else "")
                         + (f" (diverged at step {r['diverged_at_step']}: {r['divergence_reason']})"
                            if r.get("diverged_at_step") is not None else "") + f"; ok {r['ok']}")
        elif "outcome" in r:
            lines.append(f"- {r['check']}: {r['outcome']}" + (f", status {r['status']}" if r.get("status") else "")
                         + (f": `{' '.join(r['message'].split())[:400]}`" if r.get("message") else "") + f"; ok {r['ok']}")
        elif "bit_equal" in r:
            lines.append(f"- {r['check']}: bit-equal weights {r['bit_equal']}; ok {r['ok']}")
        else:
            lines.append(f"- {r['check']}: {r.get('note', '')}; ok {r['ok']}")
    return lines + _skipped(rows)


FIRST_MINUTE = {"environment": ("Environment and opcheck", _environment),
                "kernels": ("Fused kernels against float64", _kernels),
                "fused_step": ("One step per formulation, fused and unfused", _fused),
                "loop": ("The loop: host syncs, a NaN step, compile, prefetch", _loop)}


def render(report: Any) -> str:
    """The whole markdown of ``report`` (a bench.gpu_report.Report) as it stands."""
    m = report.meta
    lines = [f"# GPU check: {m['device']} (torch {m['torch']}, timm {m['timm']})"
             f"{' — CPU smoke, not a measurement' if m['smoke'] else ''}", "",
             f"`{m['command']}`; budget {m['budget_s']:.0f} s; commit {m.get('commit') or 'unknown'}; "
             f"started {m['started']}", ""]
    earlier = getattr(report, "earlier", [])
    if earlier:  # the folder's earlier calls: their rows are kept below, marked with their call's number
        lines += ["Earlier calls into this folder: " + "; ".join(
            f"{i}: `{e.get('command')}` started {e.get('started')}" + ("" if "end" in e else " (cut short)")
            for i, e in enumerate(earlier)) + f"; this call: {len(earlier)}.", ""]
    lines += ["| part | call | status | s | note |", "|---|---|---|---|---|"]
    for name, entry in report.parts.items():
        note = (entry.get("reason") or "").strip().splitlines()
        failed = [r for r in entry["rows"] if r.get("ok") is False and r.get("call") == entry.get("call")]
        status = entry["status"] + (f"; {len(failed)} row(s) failed a check" if failed else "")
        lines.append(f"| {name} | {entry.get('call', '')} | {status} | {entry.get('seconds', 0):.0f} | "
                     f"{note[-1][:200] if note else ''} |")
    for name, entry in report.parts.items():
        rows = entry["rows"]
        if not rows:
            continue
        if name in FIRST_MINUTE:
            title, lines_of = FIRST_MINUTE[name]
            lines += ["", f"## {title}", "", *lines_of(rows)]
        elif name in STEP_TITLES:
            lines += ["", f"## {STEP_TITLES[name]}", "", *_step_table(rows, m)]
        elif name == "numerics":
            lines += ["", "## Numerics: every formulation against float64", "", *_numerics(rows)]
        elif name == "recipe":
            lines += ["", "## train.py against the bare step", "", *_recipe(rows)]
        elif name == "fsdp":
            lines += ["", "## FSDP, one process", ""] + [_run_line(
                f"`torchrun --nproc_per_node=1 train.py trainer.strategy=fsdp` ({r['backend']})", r)
                for r in rows if "returncode" in r] + _skipped(rows)
        elif name == "apps":
            lines += ["", "## Applications", ""] + [_run_line(r["run"], r) for r in rows if "run" in r] + _skipped(rows)
        elif name == "toy":
            lines += ["", "## Toy study on the device", "", *_toy(rows, m["device_type"])]
        elif name == "input":
            lines += ["", "## Training input on the device", "", *_input(rows)]
    return "\n".join(lines) + "\n"
