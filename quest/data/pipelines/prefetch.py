"""The device's share of the training input one batch ahead (data.pipeline=split and device on CUDA).

:func:`finish_ahead` hands the training loop its batches with the pipeline's ``finish`` applied, and on CUDA fetches
and finishes the next batch before handing over the current one: its copy to the device and its device work go on a
side stream, queued while the current step's kernels are, so the GPU runs them beside the step instead of between
steps.

The random draws stay exactly those of finishing each batch just before its step. Finishing draws from python's
``random`` and torch's CPU generator only (the erasing noise comes from a generator seeded from the latter); the
states of both are taken before the next batch's draws and put back until that batch is used, so the step and a
checkpoint written after it see the states they saw before (a resumed run finishes the next batch from them), and
the states after its draws are restored when it is used. Should anything else draw from those two generators in
between (a step on the CPU, a model of one's own), the batch is finished again from the state found: the draws
remain in order (only the draws a loader without workers made for it, in the main process, came before that other
draw instead of after it).

data.pipeline=device decodes on the side stream too: torchvision's CUDA decoder writes on a stream of its own that
waits for nothing, so quest.data.pipelines.tensor_input.decode_batch has it allocate on a third stream on which only decoded
images are freed, never memory the side stream's queued work (the previous batch's augmentation) still reads.
"""
from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["finish_ahead"]


def _states() -> tuple[Any, torch.Tensor]:
    return random.getstate(), torch.get_rng_state()


def _same(a: tuple[Any, torch.Tensor], b: tuple[Any, torch.Tensor]) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


def _restore(states: tuple[Any, torch.Tensor]) -> None:
    random.setstate(states[0])
    torch.set_rng_state(states[1])


def finish_ahead(batches: Iterable[tuple[Any, Any, int]], finish: Callable[[Any, torch.device], Any] | None,
                 device: torch.device, ahead: bool | None = None) -> Iterator[tuple[Any, Any, int]]:
    """``(images, targets, n_skipped)`` from ``batches`` with ``finish(images, device)`` applied to every batch that
    has images. ``ahead`` (default: on CUDA) finishes the next batch before yielding the current one, with the
    draws as above; on CUDA its work goes on a side stream the current stream waits for."""
    ahead = device.type == "cuda" if ahead is None else ahead
    if finish is None or not ahead:
        for images, targets, skipped in batches:
            yield (finish(images, device) if finish is not None and len(targets) else images), targets, skipped
        return
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(raw: tuple[Any, Any, int]) -> tuple[Any, Any, int]:
        images, targets, skipped = raw
        if not len(targets):
            return raw
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            return finish(images, device), targets, skipped

    def hand_over(done: tuple[Any, Any, int]) -> tuple[Any, Any, int]:
        # a batch whose every image was skipped is not finished: its images are the loader's empty CPU tensor, on
        # which record_stream raises, and nothing of it is on the device
        if side is not None and len(done[1]) and isinstance(done[0], torch.Tensor):
            current = torch.cuda.current_stream(device)
            current.wait_stream(side)
            done[0].record_stream(current)  # made on the side stream, used on this one: kept until it is done
        return done

    it = iter(batches)
    raw = next(it, None)
    done = run(raw) if raw is not None else None
    while done is not None:
        before = _states()
        raw = next(it, None)
        if raw is None:
            yield hand_over(done)
            return
        following = run(raw)
        after = _states()
        _restore(before)  # the step, and a checkpoint after it, see the states as if the next batch were not drawn
        yield hand_over(done)
        if _same(_states(), before):
            _restore(after)
        else:  # something drew in between: its draws came first, as they would have without finishing ahead
            following = run(raw)
        done = following
