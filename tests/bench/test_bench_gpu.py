"""bench/gpu.py, the prepared GPU check, runs its code paths on the CPU with tiny shapes (--cpu-smoke), so that the
first time a GPU is lent it runs as one command (docs/benchmarks.md). Here in this process: the apps it runs (train.py,
one-process torchrun jobs, quest.toy) as calls through quest's Python API rather than child interpreters, one timed
step per row, and the compiled rows traced by dynamo and AOTAutograd without inductor's code generation (inductor
compiles every formulation in tests/models/test_models.py and tests/attention/test_elliptical.py). The budget, the
row-by-row report and a second call into the same folder are checked with parts that only write rows. The
first-minute rows (the environment, the kernels against float64, the host reads of the loop) are each shown to catch
what they check."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist

from bench import gpu
from bench.gpu_numerics import relative_differences
from bench.gpu_recipe import RECIPE_STEPS, steady_intervals
from bench.gpu_report import Budget, Part, Report, run_parts
from bench.gpu_step import table_order
from quest.attention import list_attentions

PROXY = importlib.util.find_spec("bench.dispatch_proxy") is not None  # quest's CPU proxy of a step's GPU cost


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_part_and_writes_each_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as the command ran in tmp_path: nothing it writes lands in the checkout
    threads = torch.get_num_threads()
    code = gpu.main(["--cpu-smoke", "--out", str(tmp_path), "--steps", "1"], in_process=True,
                    compile_backend="aot_eager")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = report["parts"]
    assert list(parts) == gpu.PART_NAMES and {p["status"] for p in parts.values()} == {"done"}, parts.keys()
    # a one-process FSDP run (torchrun --nproc_per_node=1, gloo here) completes, as every other part does
    fsdp = parts["fsdp"]["rows"][0]
    assert fsdp["backend"] == "gloo" and fsdp["seconds"] > 0
    assert fsdp["returncode"] == 0, fsdp
    # the fp16 runs with a fault at step 3 (NaN gradients with a finite loss; NaN images): the weights, EMA and
    # optimizer state unchanged by it, and between log intervals only DeiT-III's Lamb's one read per step of its
    # skip decision (the stated exception: docs/training.md)
    loop = {r["check"]: r for r in parts["loop"]["rows"]}
    grads, loss = loop["host_syncs fp16_nan_grads"], loop["host_syncs fp16_nan_loss"]
    assert report["failed"] == [] and code == 0, report["failed"]
    for r in (grads, loss):
        assert r["fault_injected"] and all(r["unchanged_by_nan_step"].values()), r
        assert r["syncs"]["in_steps_between_logs"] == r["expected_between_logs"] > 0, r
    assert grads["status"] == "stopped" and grads["steps"] == 8  # the scaler's overflow: the run goes on
    assert loss["status"] == "diverged" and loss["diverged_at_step"] == 3 and "nan" in loss["divergence_reason"]
    # the caller's process as it was: its thread count, and no process group left by the torchrun runs
    assert torch.get_num_threads() == threads and not dist.is_initialized()

    formulations = set(list_attentions())
    # the first minute: the environment, then opcheck on each quest operator: quest registers none (each fused
    # transform is one autograd.Function: quest.attention.fused), which the row says
    environment, *ops = parts["environment"]["rows"]
    assert environment["check"] == "environment" and environment["ok"] and environment["gpu"] is None
    assert [(r["op"], r["ok"]) for r in ops] == [(None, True)] and "no torch.ops.quest" in ops[0]["note"], ops
    kernels = [r for r in parts["kernels"]["rows"] if r["check"] == "kernel"]  # every kernel x dtype, each passing
    assert len(kernels) == 15 and all(r["ok"] and "CPU smoke" in r["note"] for r in kernels), kernels
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert {r["ran"] for r in kernels} == {"triton kernel" if interpreted else "operator's PyTorch code"}
    assert [r["check"] for r in parts["kernels"]["rows"][15:]] in (["check_kernels"], ["check_kernels"] * 3)
    fused = parts["fused_step"]["rows"]  # per formulation; standard attention has no fused operator: equal paths
    assert [r["attention"] for r in fused] == table_order() and all(r["ok"] for r in fused), fused
    assert fused[0]["logits_fused_vs_pytorch"] == 0 and fused[0]["grads_fused_vs_pytorch"] == 0
    assert {r["fused"]["sdpa_backend"] for r in fused} == {"cpu"}
    assert {r["fused_ops_ran"] for r in fused} == {"operator's PyTorch code"}  # the kernels part interprets them
    assert loop["host_syncs bf16_adamw"]["ok"] and loop["host_syncs bf16_adamw"]["steps"] == 8  # the smoke's 8
    # reduce-overhead's CUDA graphs: refused on the CPU by the config check, in its own words
    compiled = loop["compile reduce-overhead accum_steps=2"]
    # refused in one line: under this test's aot_eager backend the modes are inductor's; under inductor, CUDA graphs
    # need a GPU (tests/train/test_compile.py holds each message)
    assert compiled["outcome"] == "refused" and "trainer.compile_mode must be default unless trainer.compile_backend=" \
        "inductor" in compiled["message"]
    assert loop["prefetch on/off, data.pipeline=device"]["bit_equal"] is True
    for part, dtype in (("step_bf16", "bfloat16"), ("step_fp16", "float16")):
        rows = parts[part]["rows"]  # timm's own ViT is the anchor row, then standard, then the rest
        assert [r["attention"] for r in rows[:2]] == ["timm", "standard"]
        assert {r["attention"] for r in rows[1:]} == formulations and len(rows) == len(formulations) + 1
        assert all(r["dtype"] == dtype and not r["compiled"] and r["img_per_s"] > 0 and r["flops_per_step"] > 0
                   and r["sdpa_backend"] != "unknown" for r in rows)
        for r in rows[1:]:  # the proxy beside every formulation: its counts where quest has it, else why not
            proxy = r["proxy"]
            if PROXY:
                assert proxy["launches"] > 0 and proxy["bytes"] > 0, proxy
            else:
                assert proxy["launches"] is None and "No module named 'bench.dispatch_proxy'" in proxy["reason"]
    # the compiled path ran in both dtypes (fp16 adds the GradScaler)
    compiled = [r for part in ("step_compiled", "step_compiled_fp16") for r in parts[part]["rows"]]
    assert {r["dtype"] for r in compiled if r["compiled"]} == {"bfloat16", "float16"}

    numerics = parts["numerics"]["rows"]  # the CPU's float32 against its float64, every formulation
    assert {r["attention"] for r in numerics} == formulations and all(r["ok"] for r in numerics)
    assert all(0 < r["logits_max_rel"] < 1e-5 and 0 < r["grads_max_rel"] < 2e-4 for r in numerics)
    # QKNorm-DS's key bias: every softmax row cancels its shift, so its gradient is zero in exact arithmetic
    ds = next(r for r in numerics if r["attention"] == "qknorm_ds")
    assert ds["grads_zero_in_exact_arithmetic"] and all("k_norm.bias" in k for k in ds["grads_zero_in_exact_arithmetic"])

    recipe = parts["recipe"]["rows"]
    assert [r["step"] for r in recipe] == ["bare (fused AdamW, cross-entropy)", *(s for s, _ in RECIPE_STEPS), "train.py"]
    alone, whole = recipe[1], recipe[-2]  # the parts quest's builders made for recipe=deit
    assert (alone["drop_path"], alone["mixup"], alone["ema"]) == (0.0, False, False)
    assert (whole["drop_path"], whole["mixup"], whole["ema"], whole["loss"]) == (0.1, True, True,
                                                                                 "SoftTargetCrossEntropy")
    assert alone["optimizer"] == whole["optimizer"] == "AdamW" and whole["precision"] == "bf16"
    loop = recipe[-1]
    assert loop["returncode"] == 0 and loop["status"] == "stopped" and loop["steady"]["steady"] == 1
    assert loop["loop_cost"] == pytest.approx(loop["steady"]["step_s"] / whole["step_s"])
    assert loop["recipe_cost"] == pytest.approx(whole["step_s"] / recipe[0]["step_s"])

    apps = parts["apps"]["rows"]
    assert [r["returncode"] for r in apps] == [0, 0] and {r["summary"]["status"] for r in apps} == {"stopped"}
    quick, chunk = parts["toy"]["rows"]  # the quick grid as a user runs it, then one full-grid chunk (150 runs)
    assert quick["quick_grid"]["returncode"] == 0 and chunk["chunk_runs"] == 150 and chunk["run_steps_per_s"] > 0
    assert "| standard |" in quick["quick_grid"]["table"] and "| quest |" in quick["quick_grid"]["table"]
    inputs = parts["input"]["rows"][0]  # the device's share of data.pipeline=split and =device
    assert inputs["rand_augment_equals_cpu"] is True and len(inputs["img_per_s"]) == 2

    # every row is one line of the .jsonl, in the order the rows ended, and the markdown shows them
    rows = [(r["part"], r.get("attention") or r.get("step") or r.get("check")) for r in _records(tmp_path)
            if "part" in r and "part_status" not in r]
    assert rows == [(name, r.get("attention") or r.get("step") or r.get("check")) for name, p in parts.items()
                    for r in p["rows"]]
    assert _records(tmp_path)[-1] == {"end": {"elapsed_s": report["elapsed_s"], "failed": report["failed"]}}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| timm's own |" in md and "the loop's cost (train.py over the recipe's whole step)" in md
    assert "## Numerics: every formulation against float64" in md and "## FSDP, one process" in md
    assert "## Fused kernels against float64" in md and "| layer_norm | bfloat16 |" in md


def test_parts_run_in_priority_order_within_the_budget_and_each_row_is_on_disk_when_it_ends(tmp_path):
    now = [0.0]  # the driven clock: a row takes what its part says, nothing else moves it
    on_disk: list[int] = []

    def rows(n: int, each: float):
        def part(run):
            for i in range(n):
                if run.afford(f"row {i}"):
                    # what the files hold as this row starts: every row of this part before it
                    written = json.loads((tmp_path / "gpu_check.json").read_text())["parts"][run.part.name]["rows"]
                    on_disk.append(len([r for r in written if "skipped" not in r]) - i)
                    now[0] += each
                    run.row({"i": i})
        return part

    def broken(run):
        run.row({"i": 0})
        raise RuntimeError("boom")

    parts = [Part("a", "", rows(2, 10), (10, 10)),
             Part("big", "", rows(1, 100), (100, 100)),  # 100 s of the 40 left: skipped, the next ones still run
             Part("broken", "", broken, (1, 1)),
             Part("capped", "", rows(5, 10), (10, 10), cap_s=25),  # two rows fit in its 25 s
             Part("last", "", rows(3, 10), (10, 10))]  # 20 s left: two rows
    report = Report(tmp_path, {"meta": 1}, lambda r: " ".join(f"{k}:{len(v['rows'])}" for k, v in r.parts.items()))
    run_parts(parts, report, Budget(60, lambda: now[0]), smoke=False)
    report.close()
    assert on_disk == [0] * 6  # every earlier row was in gpu_check.json before the next one started
    status = {name: (p["status"], [r.get("i", r.get("skipped")) for r in p["rows"]]) for name, p in report.parts.items()}
    assert status == {"a": ("done", [0, 1]), "big": ("skipped", []), "broken": ("failed", [0]),
                      "capped": ("ended at the budget", [0, 1, "row 2", "row 3", "row 4"]),
                      "last": ("ended at the budget", [0, 1, "row 2"])}
    assert "RuntimeError: boom" in report.parts["broken"]["reason"]
    assert "needs ~100 s, 40 s left" in report.parts["big"]["reason"]
    assert report.parts["capped"]["rows"][2]["reason"] == "needs ~10 s, 5 s left"  # its cap, not the budget's 30
    # the .jsonl: the meta line, then each row and each part's end in the order they happened; no temporaries left
    records = _records(tmp_path)
    assert records[0] == {"meta": {"meta": 1}} and [r.get("i") for r in records if r.get("part") == "a"] == [0, 1, None]
    assert (tmp_path / "gpu_check.md").read_text() == "a:2 big:0 broken:1 capped:5 last:3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.jsonl", "gpu_check.md"]
    # the last part run has no cap: with nothing after it, it may use what the budget leaves
    now[0] = 0.0
    alone = Report(tmp_path / "alone", {}, lambda r: "")
    run_parts([parts[3]], alone, Budget(60, lambda: now[0]), smoke=False)
    alone.close()
    assert [r["i"] for r in alone.parts["capped"]["rows"]] == [0, 1, 2, 3, 4] and now[0] == 50


def test_parts_option_chooses_parts_and_names_the_valid_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--cpu-smoke", "--out", str(tmp_path), "--parts", "numerics,nope"])
    assert exc.value.code == 2
    assert ("unknown part(s) nope; expected a comma-separated choice of environment, kernels, fused_step, loop, "
            "numerics, step_bf16,") in capsys.readouterr().err
    # chosen parts run in priority order, whatever the order given, and no other part runs
    assert gpu.main(["--cpu-smoke", "--out", str(tmp_path), "--parts", "input,numerics"], in_process=True) == 0
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())["parts"]) == ["numerics", "input"]


def test_train_py_steady_step_leaves_out_the_first_interval_and_compiling_ones(tmp_path):
    rows = [{"train/loss": 6.9}, {"perf/step_s": 0.5, "perf/img_per_s": 100, "perf/data_wait": 0.4},
            {"perf/step_s": 0.10, "perf/img_per_s": 1000, "perf/data_wait": 0.01, "perf/mfu": 0.2},
            {"val/top1": 1.0}, {"perf/step_s": 0.3, "perf/img_per_s": 300, "perf/data_wait": 0.0, "perf/compile_s": 4},
            {"perf/step_s": 0.12, "perf/img_per_s": 900, "perf/data_wait": 0.03, "perf/mfu": 0.18}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steady = steady_intervals(tmp_path / "metrics.jsonl")
    assert steady == {"intervals": 4, "steady": 2, "first_step_s": 0.5, "step_s": pytest.approx(0.11),
                      "step_s_min": 0.10, "step_s_max": 0.12, "img_per_s": 950, "data_wait_max": 0.03,
                      "mfu": pytest.approx(0.19)}


def test_relative_differences_per_tensor_set_exact_zeros_apart():
    reference = {"a": torch.tensor([1.0, -2.0], dtype=torch.float64), "b": torch.tensor([4.0], dtype=torch.float64),
                 "z": torch.tensor([1e-14, 0.0], dtype=torch.float64)}
    test = {"a": torch.tensor([1.0, -2.002]), "b": torch.tensor([4.0001]), "z": torch.tensor([1e-8, 0.0])}
    out = relative_differences(test, reference)
    assert out["worst"] == "a" and out["max"] == pytest.approx(1e-3, rel=1e-4)
    assert list(out["zero_in_exact_arithmetic"]) == ["z"] and out["zero_in_exact_arithmetic"]["z"] == pytest.approx(1e-8)


def _driven_parts(monkeypatch, rows: dict[str, list[dict]]) -> None:
    """bench/gpu.py's parts replaced by ones that only write the given rows (its bookkeeping is what is tested)."""
    def parts(self):
        return [Part(name, "", lambda run, name=name: [run.row(dict(r)) for r in rows.get(name, [])], (1, 1))
                for name in gpu.PART_NAMES]
    monkeypatch.setattr(gpu.Check, "parts", parts)


def test_a_second_call_into_the_same_out_keeps_every_row_of_the_first(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _driven_parts(monkeypatch, {"environment": [{"x": 1}], "kernels": [{"x": 2, "ok": False}]})
    assert gpu.main(["--cpu-smoke", "--out", str(out), "--parts", "environment,kernels"], in_process=True) == 1
    first = (out / "gpu_check.jsonl").read_text()
    with open(out / "gpu_check.jsonl", "a") as f:  # a call killed mid-line: its half-written line is cut off
        f.write('{"part": "kernels", "x": ')
    _driven_parts(monkeypatch, {"kernels": [{"x": 3}], "loop": [{"x": 4}]})
    # this call's rows pass: the first call's failed kernel row is the first call's, not this one's
    assert gpu.main(["--cpu-smoke", "--out", str(out), "--parts", "kernels,loop"], in_process=True) == 0
    text = (out / "gpu_check.jsonl").read_text()
    assert text.startswith(first) and len(text) > len(first)  # appended, never truncated
    records = _records(out)
    assert [r["meta"]["command"].split("--parts ")[1] for r in records if "meta" in r] == ["environment,kernels",
                                                                                         "kernels,loop"]
    report = json.loads((out / "gpu_check.json").read_text())  # rebuilt from both calls' rows
    rows = {name: [(r["call"], r["x"]) for r in p["rows"]] for name, p in report["parts"].items()}
    assert rows == {"environment": [(0, 1)], "kernels": [(0, 2), (1, 3)], "loop": [(1, 4)]}
    assert {name: (p["status"], p["call"]) for name, p in report["parts"].items()} == {
        "environment": ("done", 0), "kernels": ("done", 1), "loop": ("done", 1)}
    assert report["failed"] == [] and [e["end"]["failed"] for e in report["earlier_calls"]] == [["kernels"]]
    md = (out / "gpu_check.md").read_text()
    assert "Earlier calls into this folder: 0: `python bench/gpu.py --cpu-smoke" in md and "this call: 1." in md
    assert "| environment | 0 | done |" in md and "| loop | 1 | done |" in md


def test_an_out_that_is_a_file_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    target = tmp_path / "results.md"
    target.write_text("kept\n")
    monkeypatch.setattr(gpu, "run_parts", lambda *a: pytest.fail("a part ran"))
    assert gpu.main(["--cpu-smoke", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == f"bench/gpu.py: error: --out {target} is a file; expected a folder (new, or one an earlier call " \
                  "wrote into: its rows are kept)\n"
    assert target.read_text() == "kept\n" and [p.name for p in tmp_path.iterdir()] == ["results.md"]


def test_the_environment_row_says_what_triton_lacks(tmp_path, monkeypatch):
    from bench.gpu_env import environment_row

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    row = environment_row(torch.device("cpu"))
    assert row["c_compiler"] == {"cc": str(tmp_path / "no-such-cc"), "from": "CC", "found": False}
    assert row["triton_cache"]["writable"] is False and "FileExistsError" in row["triton_cache"]["error"]
    assert row["ok"] is False and row["torch"] == torch.__version__
    monkeypatch.delenv("CC")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "made"))
    row = environment_row(torch.device("cpu"))
    assert row["ok"] is True and row["c_compiler"]["from"] == "PATH" and (tmp_path / "made").is_dir()
    assert list((tmp_path / "made").iterdir()) == []  # the probe leaves nothing behind


def test_opcheck_rows_say_when_no_quest_operator_is_registered(monkeypatch):
    from bench import gpu_env

    monkeypatch.setattr(gpu_env, "quest_ops", lambda: [])
    assert gpu_env.opcheck_rows(torch.device("cpu")) == [
        {"check": "opcheck", "op": None, "ok": True, "note": "no torch.ops.quest.* operator is registered: nothing to check"}]


def test_the_kernel_rows_catch_a_layer_norm_that_mixes_up_gain_and_bias(monkeypatch):
    from bench.gpu_kernels import kernel_rows
    from quest.attention import fused

    right = kernel_rows(torch.device("cpu"), True, dtypes=(torch.float32,), kernels=("layer_norm",))
    assert [r["ok"] for r in right] == [True] and set(right[0]["max_rel"]) == {"values", "grad_x", "grad_weight",
                                                                               "grad_bias"}
    assert right[0]["max_rel"]["values"] < 1e-5 and right[0]["widths"] == [16, 40]
    swapped = lambda x, norm: torch.nn.functional.layer_norm(x, norm.normalized_shape, norm.bias, norm.weight, norm.eps)
    monkeypatch.setattr(fused, "layer_norm_fused", swapped)
    wrong = kernel_rows(torch.device("cpu"), True, dtypes=(torch.float32,), kernels=("layer_norm",))
    assert [r["ok"] for r in wrong] == [False] and wrong[0]["max_rel"]["values"] > 0.1


def test_the_loop_row_counts_a_host_read_added_to_every_step(monkeypatch):
    """The bf16 loop row on the CPU's counter: quest's steps read nothing between log intervals; a read added to
    every optimizer step is counted in each of the 18 steps that log nothing, and fails the row."""
    from bench.gpu_loop import LOOP_STEPS, sync_row
    from quest.train.update import Update

    clean = sync_row(torch.device("cpu"), "bf16_adamw")
    assert clean["ok"] and clean["steps"] == LOOP_STEPS and clean["syncs"]["in_steps_between_logs"] == 0, clean
    update = Update.__call__

    def reading_update(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        grad_norm, scale = update(self, *args, **kwargs)
        grad_norm.item()
        return grad_norm, scale

    monkeypatch.setattr(Update, "__call__", reading_update)
    reading = sync_row(torch.device("cpu"), "bf16_adamw")
    assert reading["syncs"]["in_steps_between_logs"] == 18 and reading["ok"] is False
    assert reading["syncs"]["at_log_steps"] == clean["syncs"]["at_log_steps"] + 2
