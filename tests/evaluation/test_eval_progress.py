"""Long evaluations log progress lines (batches, samples, elapsed, ETA, running accuracy) at a cadence set by batch
count, and every "done" line shows the evaluation's headline numbers. Time never decides a test: the time rule is
either off (log_every_s=0) or driven by a fake clock."""
from __future__ import annotations

import logging
import re

import pytest
import torch
from torch.utils.data import Dataset

from quest.evaluation.context import ordered_topk
from quest.evaluation.progress import Heartbeat, Inner, Progress, hms
from quest.evaluation.runner import run_evaluations
from quest.evaluation.suites.adversarial import adversarial
from quest.evaluation.suites.classification import clean
from quest.evaluation.suites.corruptions import corruptions
from quest.runtime.distributed import DistContext

from ..eval_helpers import MEAN, STD, class_colour, digits_target, linear_digits_model, make_run, oracle_target, settings
from ..helpers import TickingClock


@pytest.fixture
def lines(caplog):
    """The messages logged on quest.eval so far (a function, read after the work)."""
    caplog.set_level(logging.INFO, logger="quest.eval")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "quest.eval"]


def _steps(messages: list[str], what: str) -> list[int]:
    """The step numbers of the progress lines of ``what`` ('<what>: <unit> i/N, ...')."""
    pattern = re.compile(rf"^{re.escape(what)}: [a-z x]+ (\d+)/\d+,")
    return [int(m.group(1)) for m in map(pattern.match, messages) if m]


class FakeClock:
    def __init__(self, times: list[float]):
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


@pytest.mark.parametrize("every_n, expected", [(0, [1, 10]), (3, [1, 3, 6, 9, 10]), (1, list(range(1, 11)))])
def test_cadence_by_batch_count(lines, every_n, expected):
    progress = Progress("pass", 10, every_n=every_n, every_s=0)
    for _ in range(10):
        progress.update(4)
    assert _steps(lines(), "pass") == expected and progress.lines == len(expected)


def test_a_single_batch_logs_one_line_and_a_nested_pass_none_without_the_time_rule(lines):
    Progress("one", 1, every_s=0).update()
    nested = Progress("inner", 50, every_n=5, every_s=0, nested=True)
    for _ in range(50):
        nested.update()
    assert _steps(lines(), "one") == [1] and _steps(lines(), "inner") == []


def test_the_time_rule_with_a_fake_clock(lines):
    # start at 0; steps end at 10, 20, 35, 40, 70, 71 s: lines at least 30 s apart (nested: by time only)
    progress = Progress("slow", 6, every_s=30, nested=True, clock=FakeClock([0, 10, 20, 35, 40, 70, 71]))
    for _ in range(6):
        progress.update()
    assert _steps(lines(), "slow") == [3, 5]


def test_samples_elapsed_and_eta(lines):
    progress = Progress("clean", 10, samples=320, every_s=0, clock=FakeClock([0.0, 4.0, 100.0]))
    progress.update(32, extra="top-1 50.00%")
    progress.update(32)  # not due
    assert lines() == ["clean: batch 1/10, 32/320 samples, elapsed 4.0 s, ETA 36.0 s, top-1 50.00%"]
    assert hms(5) == "5.0 s" and hms(3725) == "1:02:05" and hms(float("nan")) == "?"


def test_only_the_first_process_logs(lines):
    progress = Progress("pass", 3, every_s=0, enabled=False)
    for _ in range(3):
        progress.update()
    assert lines() == []


@pytest.fixture(scope="module")
def model():
    return linear_digits_model()


def test_clean_pass_over_the_digits(lines, model):
    run = make_run(digits_target(model), settings(batch_size=50, log_every_n=3, log_every_s=0))
    result = clean(run, run.settings.clean)
    assert _steps(lines(), "clean") == [1, 3, 6, 8]  # 360 val digits in batches of 50
    assert lines()[-1].startswith("clean: batch 8/8, 360/360 samples, elapsed ") and result["n"] == 360


def test_adversarial_lines_per_attack_and_budget_with_the_running_accuracy(lines, model):
    cfg = settings(batch_size=8, log_every_s=0, adversarial__attacks=["fgsm", "pgd", "autoattack"],
                   adversarial__max_samples=24, adversarial__fgsm__eps=[0.0, 0.1], adversarial__pgd__eps=[0.1],
                   adversarial__pgd__steps=2, adversarial__autoattack__eps=[0.3],
                   adversarial__autoattack__max_samples=16)
    result = adversarial(make_run(digits_target(model), cfg), cfg.adversarial)
    messages = lines()
    assert _steps(messages, "adversarial clean") == [1, 3]
    for key, batches in (("fgsm@0", 3), ("fgsm@0.1", 3), ("pgd@0.1", 3), ("autoattack@0.3", 2)):
        assert _steps(messages, f"adversarial {key}") == [1, batches], key  # AutoAttack: one call per batch
        last = [m for m in messages if m.startswith(f"adversarial {key}: batch {batches}/{batches},")][0]
        # on one process the running accuracy at the last batch is the reported one
        assert last.endswith(f"adv. top-1 {result[key]['top1']:.2f}%"), last
        assert f"{result[key]['n']}/{result[key]['n']} samples" in last


def test_corruption_grid_reports_cells_not_the_passes_inside(lines, model):
    cfg = settings(batch_size=4, log_every_s=0, corruptions__corruptions=["fog", "contrast"],
                   corruptions__extra_corruptions=[], corruptions__severities=[1, 5], corruptions__max_samples=8)
    result = corruptions(make_run(digits_target(model), cfg), cfg.corruptions)
    messages = lines()
    assert _steps(messages, "corruptions") == [1, 4]
    assert not any(m.startswith("corruptions fog/") for m in messages)  # nested passes: time rule only
    last = [m for m in messages if m.startswith("corruptions: corruption x severity 4/4")][0]
    assert last.endswith(f"contrast severity 5: error {result['error']['contrast'][5]:.2f}%")
    assert _steps(messages, "corruptions clean") == [1, 2]


class _Coloured(Dataset):
    """Normalised images whose colour encodes their class (the oracle model reads it back)."""

    def __init__(self, classes: list[int]):
        self.classes = classes

    def __len__(self) -> int:
        return len(self.classes)

    def __getitem__(self, i: int):
        rgb = torch.tensor(class_colour(self.classes[i]), dtype=torch.float32) / 255
        image = ((rgb - torch.tensor(MEAN)) / torch.tensor(STD)).view(3, 1, 1).expand(3, 32, 32)
        return image, self.classes[i]


def test_ordered_passes_log_progress_too(lines):
    run = make_run(oracle_target(), settings(batch_size=2, log_every_s=0))
    topk = ordered_topk(run, _Coloured([5, 7, 11, 13, 17]), k=1, what="imagenet_real")
    assert topk.flatten().tolist() == [5, 7, 11, 13, 17]
    assert _steps(lines(), "imagenet_real") == [1, 3]


def test_every_done_line_shows_the_headline_numbers(lines, model):
    # fgsm at 2/255 on 4 of the 8 attacked samples, pgd at 0.01 (not a whole grey level) on all 8; the corruption
    # suite's clean pass runs on 8 samples, the main clean pass on 20
    cfg = settings(run=["clean", "corruptions", "adversarial"], log_every_s=0, clean__max_samples=20,
                   corruptions__corruptions=["fog"], corruptions__extra_corruptions=[], corruptions__severities=[1],
                   corruptions__max_samples=8, adversarial__attacks=["fgsm", "pgd"], adversarial__max_samples=8,
                   adversarial__fgsm__eps=[2 / 255], adversarial__fgsm__max_samples=4, adversarial__pgd__eps=[0.01],
                   adversarial__pgd__steps=1)
    results = run_evaluations(digits_target(model), cfg, DistContext())
    done = {m.split(" done in ")[0]: m.split(": ", 1)[1] for m in lines() if " done in " in m}
    assert set(done) == {"clean", "corruptions", "adversarial"}
    c, adv, corr = results["clean"], results["adversarial"], results["corruptions"]
    assert done["clean"] == f"top1 {c['top1']:.2f}%, top5 {c['top5']:.2f}%, nll {c['nll']:.3f}"
    assert f"mean_error {corr['mean_error']:.2f}%" in done["corruptions"]
    # the corruption suite's own clean top-1 says on how many samples it was measured
    assert corr["clean"]["n"] == 8
    assert done["corruptions"].endswith(f", clean (8 samples) top1 {corr['clean']['top1']:.2f}%")
    # each attack says its eps and its sample count
    assert adv["fgsm@0.00784314"]["n"] == 4 and adv["pgd@0.01"]["n"] == 8
    assert done["adversarial"] == (f"clean (8 samples) top1 {adv['clean']['top1']:.2f}%, "
                                   f"fgsm eps 2/255 (4 samples) top1 {adv['fgsm@0.00784314']['top1']:.2f}%, "
                                   f"pgd eps 0.01 (8 samples) top1 {adv['pgd@0.01']['top1']:.2f}%")


def test_the_done_line_names_an_attack_eps_in_normalised_units():
    from quest.evaluation.report import headline_numbers

    result = {"clean": {"top1": 90.0, "n": 24},
              "spsa@0.1": {"attack": "spsa", "space": "normalized", "eps": 0.1, "n": 16, "top1": 50.0},
              "autoattack@0.00392157": {"attack": "autoattack", "space": "pixel", "eps": 1 / 255, "n": 24,
                                        "top1": 40.0}}
    assert headline_numbers(result) == {"clean (24 samples) top1": 90.0,
                                        "spsa eps 0.1 normalised (16 samples) top1": 50.0,
                                        "autoattack eps 1/255 (24 samples) top1": 40.0}


def test_within_a_step_lines_come_by_time_with_the_fraction_of_the_step_in_the_eta(lines):
    # start 0; iterations 1-3 of batch 1 read 4, 12, 13; the batch ends at 20; batch 2 counts forwards (no total)
    progress = Progress("spsa", 2, every_s=10, clock=FakeClock([0, 4, 12, 13, 20, 22, 24, 26, 28, 31]))
    for done in (1, 2, 3):
        progress.within(done, 4)
    progress.update()
    forwards = Inner(progress, "forward")
    for _ in range(5):
        forwards.count("apgd-ce, attack 1/4")
    assert lines() == [
        "spsa: batch 1/2, iteration 2/4, elapsed 12.0 s, ETA 36.0 s",  # half a batch in 12 s: 1.5 batches left
        "spsa: batch 1/2, elapsed 20.0 s, ETA 20.0 s",  # the step's own line (the first step) still comes
        # no total: 20 s a batch, 11 s of the second already spent
        "spsa: batch 2/2, forward 5, apgd-ce, attack 1/4, elapsed 31.0 s, ETA 9.0 s"]


def test_within_logs_nothing_without_the_time_rule_or_off_the_first_process(lines):
    for progress in (Progress("off", 2, every_s=0, clock=TickingClock()),
                     Progress("rank1", 2, every_s=1, enabled=False, clock=TickingClock())):
        for done in range(1, 50):
            progress.within(done, 50)
    Inner(None).count("nothing to report to")
    assert lines() == []


def _within_lines(messages: list[str], what: str) -> list[tuple[int, int, int]]:
    """(batch, iteration, iterations) of the lines of ``what`` logged inside a batch ('... batch b/B, iteration
    i/I, ...')."""
    pattern = re.compile(rf"^{re.escape(what)}: batch (\d+)/\d+, iteration (\d+)/(\d+), elapsed ")
    return [tuple(map(int, m.groups())) for m in map(pattern.match, messages) if m]


@pytest.mark.parametrize("attack", ["spsa", "pgd"])
def test_attack_iterations_report_inside_a_batch_and_change_no_number(lines, model, monkeypatch, attack):
    def run(every_s: float) -> dict:
        cfg = settings(batch_size=2, log_every_s=every_s, adversarial__attacks=[attack], adversarial__max_samples=4,
                       **{f"adversarial__{attack}__eps": [0.1]},
                       # 6 iterations a batch: SPSA's 3 for each of 2 samples, PGD's 6 steps
                       **({"adversarial__spsa__nb_iter": 3, "adversarial__spsa__nb_sample": 2} if attack == "spsa"
                          else {"adversarial__pgd__steps": 6}))
        return adversarial(make_run(digits_target(model), cfg), cfg.adversarial)

    quiet = run(0)
    monkeypatch.setattr("quest.evaluation.progress.monotonic", TickingClock())
    followed = run(5)
    assert followed[f"{attack}@0.1"]["top1"] == quiet[f"{attack}@0.1"]["top1"]
    # a reading when the pass starts, one per iteration and one at the batch's end (its own line): 5 s after each
    # line is the 5th iteration of the batch under way
    assert _within_lines(lines(), f"adversarial {attack}@0.1") == [(1, 5, 6), (2, 5, 6)]
    # the ETA counts 5/6 of a batch done in 5 s: 7/6 batches left
    assert f"adversarial {attack}@0.1: batch 1/2, iteration 5/6, elapsed 5.0 s, ETA 7.0 s" in lines()


def test_autoattack_tells_each_forward_naming_the_attack_under_way_and_leaves_no_hook(model):
    from quest.evaluation import attacks

    torch.manual_seed(0)
    x, y = torch.rand(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    details: list[str] = []
    quiet, _ = attacks.autoattack(model, x, y, 0.3, "standard", "Linf", 0, 4)
    followed, settings_used = attacks.autoattack(model, x, y, 0.3, "standard", "Linf", 0, 4, details.append)
    assert torch.equal(followed, quiet) and not model._forward_pre_hooks
    planned = settings_used["attacks"]
    names = [d.split(",")[0] for d in details]
    # the library's own checks run the model first; then the attacks in their order, each named with its place (at
    # eps 0.3 the linear model's 4 samples all fall to the first two: AutoAttack stops when none is left)
    assert planned == ["apgd-ce", "apgd-t", "fab-t", "square"]
    assert list(dict.fromkeys(names)) == ["checks", "apgd-ce", "apgd-t"]
    assert all(d == f"{n}, attack {planned.index(n) + 1}/{len(planned)}" for d, n in zip(details, names)
               if n != "checks")


def test_an_autoattack_batch_reports_its_forwards_by_time(lines, model, monkeypatch):
    monkeypatch.setattr("quest.evaluation.progress.monotonic", TickingClock())
    cfg = settings(batch_size=4, log_every_s=50, adversarial__attacks=["autoattack"], adversarial__max_samples=4,
                   adversarial__autoattack__eps=[0.3])
    adversarial(make_run(digits_target(model), cfg), cfg.adversarial)
    inside = [m for m in lines() if m.startswith("adversarial autoattack@0.3: batch 1/1, forward ")]
    # a reading per forward: every 50th forward logs; the library's 8 checking forwards come first, and before
    # the first batch ends there is no ETA to give
    assert inside and inside[0] == "adversarial autoattack@0.3: batch 1/1, forward 50, apgd-ce, attack 1/4, " \
                                   "elapsed 50.0 s, ETA ?"
    assert [int(m.split("forward ")[1].split(",")[0]) for m in inside] == [50 * (k + 1) for k in range(len(inside))]


def test_a_heartbeat_says_a_call_still_runs_until_it_is_left():
    lines: list[str] = []
    # the thread's wait times out twice (10 s each on the fake clock), then the call ends (the stop event is set)
    waits = iter([False, False, True])
    beat = Heartbeat("exporting model.onnx", lines.append, every_s=10, clock=FakeClock([0.0, 10.0, 20.5]),
                     wait=lambda seconds: next(waits))
    beat.beat()
    assert lines == ["exporting model.onnx: still running, elapsed 10.0 s",
                     "exporting model.onnx: still running, elapsed 20.5 s"]


def test_a_heartbeat_left_before_its_first_interval_says_nothing():
    lines: list[str] = []
    with Heartbeat("quick", lines.append, every_s=3600) as beat:
        pass
    assert lines == [] and beat.thread is not None and not beat.thread.is_alive()
