"""bench/gpu.py, the prepared GPU check, runs its code paths on the CPU with tiny shapes (--cpu-smoke), so that the
first time a GPU is lent it runs as one command (docs/benchmarks.md). Here in this process: the apps it runs (train.py,
one-process torchrun jobs, quest.toy) as calls through quest's Python API rather than child interpreters, one timed
step per row, and the compiled rows traced by dynamo and AOTAutograd without inductor's code generation (inductor
compiles every formulation in tests/test_models.py and tests/test_elliptical.py). The budget and the row-by-row
report are checked on a driven clock with parts that only advance it."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.distributed as dist

from bench import gpu
from bench.gpu_numerics import relative_differences
from bench.gpu_recipe import RECIPE_STEPS, steady_intervals
from bench.gpu_report import Budget, Part, Report, run_parts
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
    assert report["failed"] == [] and code == 0, report["failed"]
    # the caller's process as it was: its thread count, and no process group left by the torchrun runs
    assert torch.get_num_threads() == threads and not dist.is_initialized()

    formulations = set(list_attentions())
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
    rows = [(r["part"], r.get("attention") or r.get("step")) for r in _records(tmp_path) if "part" in r
            and "part_status" not in r]
    assert rows == [(name, r.get("attention") or r.get("step")) for name, p in parts.items() for r in p["rows"]]
    assert _records(tmp_path)[-1] == {"end": {"elapsed_s": report["elapsed_s"], "failed": report["failed"]}}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| timm's own |" in md and "the loop's cost (train.py over the recipe's whole step)" in md
    assert "## Numerics: every formulation against float64" in md and "## FSDP, one process" in md


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
    assert "unknown part(s) nope; expected a comma-separated choice of numerics, step_bf16," in capsys.readouterr().err
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
