"""A training step without a host read between log intervals (docs/training.md, "The training loop"): the counter of
device-to-host reads, shown to catch each kind of read; the loop's reads per step; every recipe x precision x
strategy x data.bad_images reading nothing between log intervals; a bad step caught on the device (its update and
every later one skipped, the divergence reported with its step) and never saved."""
from __future__ import annotations

import copy

import pytest
import torch

from bench.host_reads import HostReads
from quest.run.checkpoint import load_checkpoint
from quest.runtime.distributed import DistContext
from quest.train import fit
from quest.train.trainer import Diverged, Run

from ..helpers import FAST, compose_cfg


def _reading(action) -> int:
    with HostReads() as reads:
        action()
    return reads.count


@pytest.mark.parametrize("name, action", [
    ("tolist", lambda t: t.tolist()), ("item", lambda t: t.sum().item()), ("bool", lambda t: bool(t.sum() > 0)),
    ("float", lambda t: float(t.sum())), ("int", lambda t: int(t.sum())), ("numpy", lambda t: t.numpy()),
    ("cpu", lambda t: t.cpu()), ("format", lambda t: f"{t.sum():.2f}"),
    ("scalar argument in C++", lambda t: torch._foreach_lerp_([t.clone()], [t], t.sum())),
])
def test_the_counter_catches_every_kind_of_read(name, action):
    assert _reading(lambda: action(torch.ones(3))) == 1, name
    assert _reading(lambda: torch.ones(3).mul_(2).sum().add_(1)) == 0  # device work alone reads nothing


def _run(tmp_path, *overrides: str) -> Run:
    return Run(compose_cfg(*FAST, "recipe.mixup=0.8", "recipe.drop_path=0.1", *overrides), tmp_path, {},
               DistContext())


def _batch(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))]


def test_a_step_reads_the_device_only_when_it_is_logged(tmp_path):
    """EMA, mixup, drop path, clipping and gradient accumulation on: no read at all between log intervals; the
    logged step reads once (the counter catches it: the same step that read once per step before)."""
    run = _run(tmp_path, "recipe.clip_grad=1.0", "trainer.accum_steps=2")
    batches = _batch(0) + _batch(1)
    run.train_step(batches, log=False)  # the first step builds the optimizer's state
    assert _reading(lambda: run.train_step(batches, log=False)) == 0
    assert _reading(lambda: run.train_step(batches, log=True)) == 1


def test_the_loop_reads_once_per_log_interval(tmp_path, monkeypatch):
    """Counted over each optimizer step of a real run, from one step's batches to the next (diagnostics, the step,
    the log row, the checkpoint's due check), the loader's own work left out: a read only at logged steps."""
    counter, windows = HostReads(), []
    batches_of = Run.step_batches

    def counted(self):
        it = batches_of(self)
        while True:
            counter.on = False  # drawing the next batch is the loader's
            try:
                batches = next(it)
            except StopIteration:
                return
            windows.append(counter.count)
            counter.on = True
            yield batches

    monkeypatch.setattr(Run, "step_batches", counted)
    with counter:
        summary = fit(compose_cfg(*FAST, "trainer.log_every_n_steps=3"), tmp_path)
    assert summary["status"] == "completed" and summary["step"] == 8
    per_step = [b - a for a, b in zip(windows, windows[1:])]  # steps 1..7; step 8 runs on into the epoch's end
    assert per_step == [0, 0, 1, 0, 0, 1, 0]


def test_a_bad_step_is_skipped_on_the_device_and_reported_with_its_step(tmp_path):
    run = _run(tmp_path, "recipe.ema=false")
    run.train_step(_batch(0), log=False)
    good = copy.deepcopy(run.model.state_dict())
    moments = copy.deepcopy(run.parts.optimizer.state_dict()["state"])
    images, targets = _batch(1)[0]
    run.train_step([(images * float("nan"), targets)], log=False)  # step 2 goes bad
    for seed in (2, 3):
        run.train_step(_batch(seed), log=False)  # healthy batches, but after a bad step: skipped too
    for key, value in run.model.state_dict().items():
        torch.testing.assert_close(value, good[key], atol=0, rtol=0, msg=key)
    for index, state in run.parts.optimizer.state_dict()["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(value, moments[index][name], atol=0, rtol=0, msg=f"{index}.{name}")
    with pytest.raises(Diverged, match=r"^diverged at step 2: loss nan is not finite$"):
        run.check_diverged()
    with pytest.raises(Diverged, match=r"^diverged at step 2: loss nan is not finite$"):
        run.train_step(_batch(4), log=True)  # every later read says the same


class Scaled(torch.nn.Module):
    def __init__(self, loss: torch.nn.Module):
        super().__init__()
        self.loss = loss

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return 100 * self.loss(logits, targets)


def test_a_loss_above_the_bound_is_reported_at_its_step(tmp_path):
    run = _run(tmp_path, "recipe.ema=false", "trainer.max_loss=50")
    run.train_step(_batch(0), log=False)
    loss = run.train_model.loss
    run.train_model.loss = Scaled(loss)  # step 2's loss x 100: finite, far above the bound
    run.train_step(_batch(1), log=False)
    run.train_model.loss = loss
    run.train_step(_batch(2), log=False)
    with pytest.raises(Diverged, match=r"^diverged at step 2: loss \S+ above 50$"):
        run.check_diverged()


def test_the_checkpoint_after_a_bad_step_holds_the_weights_from_before_it(tmp_path, monkeypatch):
    """Saved every 2 steps, logged every 10: step 3 goes bad between reads. The save after it reads
    the check first: the run ends diverged at step 3, and last.pt holds the weights of step 2, those of a run
    stopped there."""
    common = [*FAST, "trainer.log_every_n_steps=10", "trainer.epochs=1"]
    fit(compose_cfg(*common, "trainer.max_steps=2"), tmp_path / "reference")
    step = Run.train_step

    def poisoned(self, batches, **kw):
        if self.state.step == 2:
            batches = [(images * float("nan"), targets) for images, targets in batches]
        return step(self, batches, **kw)

    monkeypatch.setattr(Run, "train_step", poisoned)
    summary = fit(compose_cfg(*common, "trainer.checkpoint_every_n_steps=2"), tmp_path / "diverged")
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 3
    assert summary["divergence_reason"] == "loss nan is not finite"
    saved, reference = (load_checkpoint(tmp_path / run / "checkpoints" / "last.pt") for run in ("diverged", "reference"))
    assert saved["state"]["step"] == 2
    for part in ("model", "ema"):
        for key, value in reference[part].items():
            torch.testing.assert_close(saved[part][key], value, atol=0, rtol=0, msg=f"{part}.{key}")


def test_under_ddp_the_stop_request_is_read_a_step_later_or_with_the_log(monkeypatch):
    """The guard's stop path with a real collective (gloo, one process): between log intervals the request reduced in
    step k is read at the end of step k + 1, without a device read; a logged step reads its own with the log."""
    import torch.distributed as dist

    from quest.train.update import StepGuard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        guard = StepGuard(torch.device("cpu"), max_loss=10.0, scaler=False, distributed=True)
        fine, norm = torch.tensor(1.0), torch.tensor(2.0)
        seen = []
        for request in (0.0, 1.0, 0.0, 2.0):  # 1 requeue in step 1, 2 interrupt in step 3
            guard.step(fine, norm, request)
            seen.append(guard.previous_stop())
        assert seen == [0.0, 0.0, 1.0, 0.0]  # step 3's interrupt not yet: it is read after step 4
        guard.step(fine, norm, 0.0)
        # a logged step: its own reduced request with the one before, not read yet
        assert guard.read(5, norm, stop=True) == [2.0, 2.0]
        guard.step(fine, norm, 0.0)
        assert guard.previous_stop() == 0.0  # and neither is read again
    finally:
        dist.destroy_process_group()


#: each recipe at the tiniest size: DeiT-III's per-size values have no row for the 4-layer preset
_RECIPES = {"deit": ["recipe=deit"], "light": ["recipe=light"],
            "deit3": ["recipe=deit3", "recipe.lr=1e-3", "recipe.drop_path=0.05", "recipe.img_size=16"]}


@pytest.fixture
def one_rank_group():
    """A gloo process group of one process, in this process: DDP's wrapper, the guard's collective and the skip
    counts' reduction run for real (a rank's reads are its own: a second rank would only repeat them), without
    starting interpreters (tests/train/test_distributed.py runs two real ranks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _host_resident(monkeypatch) -> list[torch.Tensor]:
    """The guard's copies of the reduced stop requests, from now on: in pinned host memory on CUDA, so reading them
    is no device synchronisation (on the CPU the copy is the tensor itself). The other tensors that live in host
    memory on every device: timm's Lamb's step count, a CPU tensor read with .item() each step. Held, not their ids:
    a freed tensor's id is given to a new one, whose read would then go uncounted."""
    from quest.train.update import StepGuard

    resident: list[torch.Tensor] = []
    send = StepGuard._send_stop

    def sent(self, reduced):
        send(self, reduced)
        resident.append(self._stops[-1][1])

    monkeypatch.setattr(StepGuard, "_send_stop", sent)
    return resident


@pytest.mark.parametrize("bad_images", ["error", "skip"])
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("recipe", sorted(_RECIPES))
def test_no_recipe_precision_or_strategy_reads_between_log_intervals(tmp_path, monkeypatch, recipe, precision,
                                                                    processes, bad_images, request):
    """Every recipe (deit: fused AdamW; deit3: Lamb, BCE; light) at every precision (fp16 through the GradScaler,
    which works on the CPU), one process and DDP, unreadable images raised or skipped: a step between log intervals
    reads nothing from the device (but deit3's Lamb under fp16: its skip decision, below); the logged step reads
    once (twice under DDP with data.bad_images=skip: the image counts, reduced where the log needs them)."""
    if processes == 2:
        request.getfixturevalue("one_rank_group")
        # the construction's check that every rank sees the same data gathers from the world size the context names
        monkeypatch.setattr("quest.train.builders.agree_on_sample_counts", lambda counts, ctx: None)
    ctx = DistContext(rank=0, world_size=processes)
    cfg = compose_cfg(*FAST, *_RECIPES[recipe], f"trainer.precision={precision}", f"data.bad_images={bad_images}",
                      "data.batch_size=4", "data.fake_train_size=32")
    run = Run(cfg, tmp_path, {}, ctx)
    resident = _host_resident(monkeypatch)
    batches = next(run.step_batches())
    run.train_step(batches, log=False)  # the first step builds the optimizer's state (Lamb's step count too)
    resident += [group["step"] for group in run.parts.optimizer.param_groups
                 if isinstance(group.get("step"), torch.Tensor) and group["step"].device.type == "cpu"]
    counter = HostReads(skip=lambda tensor: any(tensor is held for held in resident))
    # the one exception, stated in docs/training.md: under fp16 an optimizer that counts its steps on the host
    # (deit3's Lamb) reads the skip decision each step, as torch's GradScaler.step does, so that an overflow's
    # skipped step is never counted (tests/train/test_skipped_update.py)
    decided_on_host = int(recipe == "deit3" and precision == "fp16")
    with counter:
        run.train_step(batches, log=False)
    assert counter.count == decided_on_host
    counter.count = 0
    with counter:
        run.train_step(batches, log=True)
    assert counter.count == 1 + (processes == 2 and bad_images == "skip") + decided_on_host


def test_under_ddp_skipped_image_counts_wait_on_the_host_until_the_log(tmp_path, monkeypatch, one_rank_group):
    """DDP with data.bad_images=skip: the images a step drew reach the run's state (summed over the ranks: here the
    one real rank) at the logged step, not before; a save brings them in too (Run.sync_counts)."""
    monkeypatch.setattr("quest.train.builders.agree_on_sample_counts", lambda counts, ctx: None)
    cfg = compose_cfg(*FAST, "data.bad_images=skip", "data.batch_size=4", "data.fake_train_size=64")
    run = Run(cfg, tmp_path, {}, DistContext(rank=0, world_size=2))
    steps = run.step_batches()
    drawn = []
    for log in (False, False, True, False):
        run.train_step(next(steps), log=log)
        drawn.append(run.state.train_drawn)
    assert drawn == [0, 0, 12, 12]
    run.sync_counts()
    assert (run.state.train_drawn, run.state.train_skipped) == (16, 0)
