"""bench/data.py, the input-pipeline comparison (docs/benchmarks.md, "Input pipeline"), runs and ends with the best
candidate's ratio to today's DeiT transform, consistent with the table it printed; and bench/train_input_equivalence.py
trains every pipeline on both data sets. Both run in this process (their main with the command's arguments), each
row timed once. Timing values themselves are not asserted (they depend on load)."""
from __future__ import annotations

import re

import pytest
import torch

from bench import data as data_bench
from bench import train_input_equivalence


@pytest.mark.slow
def test_data_bench_quick_prints_every_candidate_and_ends_with_the_best_ratio(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    # --quick's 16 images (a row's timing window as long as the command's), one round instead of its 3
    data_bench.main(["--images", "16", "--rounds", "1", "--no-dali", "--gpu-rates", "vit_ti=2000,vit_b=400"])
    assert torch.get_num_threads() == threads  # its one thread was the bench's, not the caller's
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[3].isdigit():  # candidate, what, output, img/s, x today, CPU/wall, 2 worker counts
            rows[cells[0]] = cells
    expected = {"today", "a_tv2_uint8", "b_draft_crop", "b'_cap256", "b'_cap320", "d_pil_crop_uint8",
                "d_tv2_crop_uint8", "d_cap256_uint8", "d_tv2_cap256_uint8",
                "d_tv2_cap320_uint8", "e_bytes_only", "pipeline_split", "pipeline_device",
                "pipeline_split_cap256"}
    assert set(rows) == expected
    assert "skipped the DALI rows (c): --no-dali" in lines
    today = float(rows["today"][3])
    for cells in rows.values():  # the ratio and the workers follow from the rates printed (rounded to integers)
        rate = float(cells[3])
        assert float(cells[4]) == pytest.approx(rate / today, abs=0.006 + 0.5 / today + 0.5 * rate / today ** 2)
        assert 0 < float(cells[5]) < 1.5  # one process, one thread: CPU seconds per wall second near 1, never 2
        assert float(cells[6]) == pytest.approx(2000 / rate, abs=0.05 + 1000 / rate ** 2)
        assert float(cells[7]) == pytest.approx(400 / rate, abs=0.05 + 200 / rate ** 2)
    last = re.fullmatch(r"best candidate that decodes on the CPU: (\S+) \((.+)\) (\d+) images/s per core "
                        r"vs today's (\d+): ratio (\d+\.\d+)", lines[-2])
    assert last, lines[-2]
    best, output, best_rate, today_rate, ratio = last.groups()
    assert best != "today" and rows[best][2] == output and rows[best][3] == best_rate and today_rate == rows["today"][3]
    assert float(best_rate) == max(float(c[3]) for n, c in rows.items()
                                   if n not in ("today", "e_bytes_only", "pipeline_device"))
    fast, slow = float(best_rate), float(today_rate)
    assert float(ratio) == pytest.approx(fast / slow, abs=0.006 + 0.5 / slow + 0.5 * fast / slow ** 2)
    # the last line: today's and quest's two new pipelines side by side, each with its ratio
    pipelines = re.fullmatch(r"per core, today's \(data.pipeline=timm\) (\d+) images/s; data.pipeline=split (\d+): "
                             r"ratio (\d+\.\d+); data.pipeline=device (\d+): ratio (\d+\.\d+); data.pipeline=split "
                             r"on a copy capped at 256 (\d+): ratio (\d+\.\d+)", lines[-1])
    assert pipelines, lines[-1]
    today_rate, split, split_ratio, device, device_ratio, capped, capped_ratio = pipelines.groups()
    assert today_rate == rows["today"][3] and split == rows["pipeline_split"][3] and device == rows["pipeline_device"][3]
    assert capped == rows["pipeline_split_cap256"][3]
    for rate, ratio in ((split, split_ratio), (device, device_ratio), (capped, capped_ratio)):
        fast = float(rate)
        assert float(ratio) == pytest.approx(fast / slow, abs=0.006 + 0.5 / slow + 0.5 * fast / slow ** 2)


@pytest.mark.slow
# after one step the seeds' accuracies may be equal: Welch's test on zero spread warns (and its p is nan)
@pytest.mark.filterwarnings("ignore:Precision loss occurred in moment calculation:RuntimeWarning")
def test_the_training_comparison_runs_every_pipeline_on_both_data_sets(tmp_path, monkeypatch, capsys):
    """bench/train_input_equivalence.py with 2 seeds, one step per run and a small ImageFolder: one row per data set
    and pipeline, each with its seeds' accuracies, their mean, spread and Welch p against timm (the full run's table
    is in docs/benchmarks.md)."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    # the ImageFolder at 7 digits per class and split: one batch of 64 to train on, 70 images to validate
    train_input_equivalence.main(["--seeds", "2", "--epochs", "1", "--max-steps", "1", "--per-class", "7"],
                                 in_process=True)
    assert torch.get_num_threads() == threads
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| digits") or line.startswith("| imagefolder")]
    assert [(r[0], r[1]) for r in rows] == [("digits", "timm"), ("digits", "split"), ("imagefolder", "timm"),
                                            ("imagefolder", "split"), ("imagefolder", "device")]
    for data, pipeline, seeds, mean, std, p in rows:
        values = [float(v) for v in seeds.split(", ")]
        assert len(values) == 2 and float(mean) == pytest.approx(sum(values) / 2, abs=0.006)
        assert float(std) >= 0 and (p == "" if pipeline == "timm" else 0 <= float(p) <= 1 or p == "nan")


@pytest.mark.slow
def test_the_draft_decode_bench_prints_a_row_per_image_kind_and_pipeline(capsys):
    """bench/data.py --draft-decode (bench/data_draft.py), one image and one round: a row per image kind and pipeline
    whose ratio follows from its rates, and the shares of reduced crops (no crop of a 500 x 375 image reduces)."""
    from bench.data_draft import IMAGES, PIPELINES

    threads = torch.get_num_threads()
    data_bench.main(["--draft-decode", "--images", "1", "--rounds", "1"])
    assert torch.get_num_threads() == threads
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| \d+ x \d+ \|", line)]
    assert [(r[0], r[2]) for r in rows] == [(f"{w} x {h}", p) for w, h, _ in IMAGES for p in PIPELINES]
    for cells in rows:
        off, on = float(cells[3]), float(cells[4])
        assert float(cells[5]) == pytest.approx(on / off, abs=0.006 + 0.5 / off + 0.5 * on / off ** 2)
        assert float(cells[5]) == pytest.approx(float(cells[6]), abs=0.011)  # one round: the same ratio
    assert rows[0][7] == "0%, 0%, 0%" and rows[-1][7] != "0%, 0%, 0%"
