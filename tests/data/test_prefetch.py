"""quest.data.pipelines.prefetch.finish_ahead: finishing the next batch before the current one is used changes nothing a run
sees: the same batches, the same random states at every step (so a checkpoint written after any step is the one a
run without it writes, and a resumed run finishes the next batch from it), also when the step itself draws from the
same generators. On the CPU only the order and the draws can be tested; the overlap itself is a GPU's (a side
stream), and the device path's counterpart is tests/data/test_train_input.py's resume test."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from quest.data.pipelines.prefetch import finish_ahead


class FakeStream:
    """A CUDA stream that logs the waits asked of it."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


class FakeCuda:
    """torch.cuda's streams, current stream and Tensor.record_stream replaced by objects that log what is asked of
    them, in order (there is no CUDA here): what quest queues where, on any machine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.log: list[str] = []
        self.recorded: list[tuple[torch.Tensor, str]] = []
        self.main = self.current = FakeStream("main", self.log)
        self.made: list[FakeStream] = []
        monkeypatch.setattr(torch.cuda, "Stream", self._new)
        monkeypatch.setattr(torch.cuda, "stream", self._use)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        fake = self

        def record_stream(tensor: torch.Tensor, stream: FakeStream) -> None:
            fake.recorded.append((tensor, stream.name))
            fake.log.append(f"record on {stream.name}")

        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)

    def _new(self, device=None) -> FakeStream:
        self.made.append(FakeStream(f"stream{len(self.made) + 1}", self.log))
        return self.made[-1]

    @contextlib.contextmanager
    def _use(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


def _finish(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A finish that draws from both generators a pipeline's finish draws from, varying amounts per batch."""
    k = random.randint(1, 3)
    return images + torch.rand(k, 1, 1).sum(0) + random.random()


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Loader batches; an empty one (every image skipped) among them: nothing to finish."""
    return [(torch.full((2, 3), float(i)), torch.arange(0 if i == 2 else 2), 0) for i in range(count)]


def _run(ahead: bool, step_draws: bool, stop_after: int | None = None) -> tuple[list, list]:
    """The batches a training loop gets and the generators' states it sees at each step."""
    random.seed(11), torch.manual_seed(11)
    seen, states = [], []
    for i, (images, targets, skipped) in enumerate(finish_ahead(_batches(6), _finish, torch.device("cpu"),
                                                                ahead=ahead)):
        states.append((random.getstate(), torch.get_rng_state()))
        seen.append((images, targets.tolist(), skipped))
        if step_draws:  # a step on the CPU with dropout, say
            torch.rand(5), random.random()
        if stop_after is not None and i == stop_after:
            break
    states.append((random.getstate(), torch.get_rng_state()))  # after the loop: what a final checkpoint holds
    return seen, states


@pytest.mark.parametrize("step_draws", [False, True], ids=["step_draws_nothing", "step_draws"])
@pytest.mark.parametrize("stop_after", [None, 3], ids=["whole_epoch", "stopped_mid_epoch"])
def test_finishing_ahead_gives_the_same_batches_and_random_states(step_draws, stop_after):
    plain_batches, plain_states = _run(False, step_draws, stop_after)
    ahead_batches, ahead_states = _run(True, step_draws, stop_after)
    assert len(ahead_batches) == len(plain_batches) == (6 if stop_after is None else 4)
    for (a, ta, sa), (b, tb, sb) in zip(ahead_batches, plain_batches):
        assert torch.equal(a, b) and ta == tb and sa == sb
    for (pa, ta), (pb, tb) in zip(ahead_states, plain_states):
        assert pa == pb and torch.equal(ta, tb)
    # the comparison can fail: finishing ahead without putting the states back draws the batches in another order
    random.seed(11), torch.manual_seed(11)
    done = [_finish(images, torch.device("cpu")) for images, _, _ in _batches(6)]
    assert step_draws is False or not all(torch.equal(x, y[0]) for x, y in zip(done, plain_batches))


def test_a_resumed_run_finishes_the_next_batch_as_the_straight_run_did():
    """A checkpoint after step 2 holds the states seen there; a run resumed from them at batch 3 gets the straight
    run's batches 3.. exactly."""
    straight, states = _run(True, step_draws=False)
    random.setstate(states[3][0]), torch.set_rng_state(states[3][1])  # the state before batch 3's step...
    # ...is the state after finishing batch 3; a resume restores the checkpoint written after step 2, i.e. before
    _, stopped = _run(True, step_draws=False, stop_after=2)
    random.setstate(stopped[-1][0]), torch.set_rng_state(stopped[-1][1])
    resumed = list(finish_ahead(_batches(6)[3:], _finish, torch.device("cpu"), ahead=True))
    for (a, _, _), (b, _, _) in zip(resumed, straight[3:]):
        assert torch.equal(a, b)


def test_a_run_finishing_ahead_trains_and_resumes_to_the_weights_of_one_that_does_not(tmp_path, monkeypatch):
    """The training loop with finish_ahead forced on (on the CPU it is off): data.pipeline=device on an image folder,
    stopped mid-epoch and resumed, ends with the weights of a straight run without it, bit for bit."""
    from quest.run.checkpoint import load_checkpoint
    from quest.train import fit, trainer

    from ..helpers import compose_cfg
    from .test_train_input import FOLDER, _folder

    args = [*FOLDER, f"data.root={_folder(tmp_path / 'data')}", "data.pipeline=device"]
    fit(compose_cfg(*args), tmp_path / "plain")
    monkeypatch.setattr(trainer, "finish_ahead", lambda *a: finish_ahead(*a, ahead=True))
    fit(compose_cfg(*args, "trainer.max_steps=7"), tmp_path / "ahead")  # stops mid-epoch 2 (5 steps an epoch)
    fit(compose_cfg(*args), tmp_path / "ahead")
    a, b = (load_checkpoint(tmp_path / d / "checkpoints" / "last.pt") for d in ("plain", "ahead"))
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, atol=0, rtol=0, msg=key)


def test_on_cuda_each_finished_batch_is_handed_over_and_an_empty_one_is_not(monkeypatch):
    """The CUDA path with its streams faked: every batch is finished on the side stream, the current stream waits
    for it and records each finished batch as used there; a batch whose every image was skipped (the loader's empty
    CPU tensor, on which record_stream raises) is yielded untouched, never recorded. The batches are those of
    finishing without prefetch, bit for bit."""
    cuda = FakeCuda(monkeypatch)
    empty = torch.empty(0)  # quest.data.folder.collate_skipping_bad's batch when every image was skipped
    batches = [(torch.full((2, 3), float(i)), torch.arange(2), 0) for i in range(4)]
    batches.insert(2, (empty, torch.empty(0, dtype=torch.long), 2))
    streams = []

    def finish(images: torch.Tensor, device: torch.device) -> torch.Tensor:
        streams.append(torch.cuda.current_stream(device).name)
        return _finish(images, device)

    random.seed(2), torch.manual_seed(2)
    plain = list(finish_ahead(batches, finish, torch.device("cuda"), ahead=False))
    assert cuda.log == [] and streams == ["main"] * 4
    streams.clear()
    random.seed(2), torch.manual_seed(2)
    ahead = list(finish_ahead(batches, finish, torch.device("cuda")))  # ahead: CUDA's default
    assert len(cuda.made) == 1 and streams == ["stream1"] * 4
    assert [b[1].tolist() for b in ahead] == [b[1].tolist() for b in plain] and ahead[2][0] is empty
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ahead, plain))
    handed = [b[0] for i, b in enumerate(ahead) if i != 2]
    assert len(cuda.recorded) == 4 and all(t is h and on == "main" for (t, on), h in zip(cuda.recorded, handed))
    assert cuda.log == ["main waits for stream1", "record on main"] * 4
