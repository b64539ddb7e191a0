"""The built-in training input pipelines (``data.pipeline``; they register in quest/data/pipelines/kinds.py).

``timm`` is today's transform (quest.data.pipelines.transforms). ``split`` and ``device`` keep images as uint8 tensors until the
device: the crop parameters come from timm's own ``RandomResizedCropAndInterpolation.get_params`` and the flip from
torch's RNG as torchvision's ``RandomHorizontalFlip`` draws it, so both follow timm's distributions draw for draw;
RandAugment runs as :class:`quest.data.pipelines.device_augment.DeviceRandAugment` (timm's policy, per-sample draws, batched
ops) and random erasing is timm's own ``RandomErasing`` on the normalised batch, as timm's ``PrefetchLoader`` does.
Every draw made in the training process comes from its global RNGs, which checkpoints hold, so a run resumes exactly.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image, decode_jpeg, read_file
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from quest.data.folder import CorruptImageError, collate_skipping_bad

from .batch_input import BatchErasing, crop_boxes, resized_crop_batch
from .draft import decode_rgb_pil, draft_first, draft_scale, open_undecoded, reduction, resize_box
from .kinds import TrainInput, jitter_active, register_train_input
from .transforms import build_transforms

__all__ = ["CropFlip", "DraftCropFlip", "DeviceFinish", "EncodedBatch", "decode_rgb", "decode_batch", "collate_bytes",
           "RESAMPLING"]

#: recipe.train_interpolation -> the tensor resize's mode (antialiased, as PIL's resize always is)
RESAMPLING = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR,
              "nearest": InterpolationMode.NEAREST}
_JPEG_MAGIC = b"\xff\xd8"


@contextlib.contextmanager
def _without_decoder_notice() -> Iterator[None]:
    """torchvision 0.29 announces on its decoders that TorchCodec will take them over (docs/data.md); they are what
    these pipelines use until then. Silenced around their calls only: importing quest changes no process-wide
    warning filter."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision are "
                                "deprecated", category=DeprecationWarning)
        yield


def decode_rgb(encoded: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """An encoded image (a 1-d uint8 tensor of the file's bytes) as a uint8 RGB tensor (3, H, W) on ``device``:
    torchvision's decoders (libjpeg-turbo on the CPU, nvJPEG for a JPEG on CUDA), PIL for what they cannot read
    (PIL is what the ``timm`` pipeline reads every image with). A CorruptImageError when neither can."""
    with _without_decoder_notice():
        return _decode_rgb(encoded, torch.device(device))


def _read_bytes(path: str) -> torch.Tensor:
    with _without_decoder_notice():
        return read_file(path)


def _decode_rgb(encoded: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and bytes(encoded[:2].tolist()) == _JPEG_MAGIC:
        try:
            return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            pass  # nvJPEG refuses some files libjpeg reads (progressive, arithmetic coding): the CPU's turn
    try:
        image = decode_image(encoded, mode=ImageReadMode.RGB)
    except RuntimeError:
        import io

        try:
            with Image.open(io.BytesIO(encoded.numpy().tobytes())) as img:
                image = F.pil_to_tensor(img.convert("RGB"))
        except Exception as exc:
            raise CorruptImageError(f"cannot decode an image of {encoded.numel()} bytes: {exc}") from exc
    return image.to(device, non_blocking=True)


def decode_batch(encoded: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Encoded images (1-d uint8 CPU tensors) -> uint8 RGB tensors (3, H, W) on ``device``: every JPEG in one
    ``decode_jpeg`` call (one batched nvJPEG call on CUDA; torchvision decodes a list one by one on the CPU), what it
    refuses and other formats through :func:`decode_rgb` one at a time (rare: nvJPEG refuses
    progressive and arithmetic-coded files; ImageNet holds a few PNG and CMYK files). On CUDA the images are
    allocated on a stream of the decoder's own and are ready for the caller's current stream (:func:`_on_own_stream`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _decode_batch(encoded, device)
    return _on_own_stream(encoded, device)


#: per CUDA device, the stream the decoded images are allocated on (nothing else is)
_DECODE_STREAMS: dict[str, Any] = {}


def _on_own_stream(encoded: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """:func:`_decode_batch` on CUDA without overwriting memory queued work still reads.

    torchvision's CUDA decoder allocates its outputs on the caller's current stream and writes them on a private
    stream that waits for nothing (pytorch/vision issue 9606). The caching allocator gives a block freed on a stream
    to that stream's next allocation at once, which is safe for work ordered on that stream only: the decoder could
    be handed a block that kernels queued on the current stream (the previous batch's augmentation on the prefetch
    side stream, a step on the main stream) have yet to read, and overwrite it before they run. A device-side wait
    (an event, ``wait_stream``) cannot order the decoder's private stream, which is not ours to name; a host wait on
    the current stream would hold the host until that queued work has run (on the main stream, the whole step).
    So the decoder allocates on a stream of its own, on which nothing but decoded images is ever freed, each marked
    with ``record_stream`` as used by the caller's stream: the allocator hands such a block out again only once the
    caller's work queued before it was freed has run. The caller's stream then waits for this one, which
    torchvision made wait for its decode."""
    caller = torch.cuda.current_stream(device)
    own = _DECODE_STREAMS.get(str(device))
    if own is None:
        own = _DECODE_STREAMS[str(device)] = torch.cuda.Stream(device)
    with torch.cuda.stream(own):
        images = _decode_batch(encoded, device)
    caller.wait_stream(own)
    for image in images:
        image.record_stream(caller)  # freed by the caller's work: reused once that work has run
    return images


def _decode_batch(encoded: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(encoded)
    jpegs = [i for i, e in enumerate(encoded) if e.numpy()[:2].tobytes() == _JPEG_MAGIC]
    if jpegs and device.type == "cuda":
        try:
            with _without_decoder_notice():
                decoded = decode_jpeg([encoded[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
            for i, image in zip(jpegs, decoded):
                out[i] = image
        except RuntimeError:
            pass  # one file nvJPEG refuses fails the call: each then goes its own way below
    for i, e in enumerate(encoded):
        if out[i] is None:
            out[i] = decode_rgb(e, device)
    return out  # type: ignore[return-value]


def _read_rgb(path: str) -> torch.Tensor:
    return decode_rgb(_read_bytes(path))


class CropFlip:
    """RandomResizedCrop + horizontal flip on a uint8 tensor (3, H, W) on any device: timm's crop draw
    (``get_params``: python's ``random``), torchvision's flip draw (``torch.rand(1) < p``), the crop resized with the
    antialiased kernel PIL's resize uses. A PIL image is converted to a tensor first (data.pipeline=split has a data
    set that reads image files decode them with torchvision instead, :func:`decode_rgb`)."""

    def __init__(self, size: int, scale: Sequence[float], ratio: Sequence[float], interpolation: str, hflip: float):
        from timm.data.transforms import RandomResizedCropAndInterpolation

        self.size, self.scale, self.ratio, self.hflip = size, tuple(scale), tuple(ratio), float(hflip)
        self.interpolation, self.mode = interpolation, RESAMPLING[interpolation]
        self.get_params = RandomResizedCropAndInterpolation.get_params

    def __call__(self, img: Any) -> torch.Tensor:
        if isinstance(img, Image.Image):
            img = F.pil_to_tensor(img.convert("RGB"))
        return self._flip(self._resized_crop(img, self.get_params(img, self.scale, self.ratio)))

    def _resized_crop(self, img: torch.Tensor, box: tuple[int, int, int, int]) -> torch.Tensor:
        return F.resized_crop(img, *box, [self.size, self.size], interpolation=self.mode,
                              antialias=self.mode != InterpolationMode.NEAREST)

    def _flip(self, out: torch.Tensor) -> torch.Tensor:
        if self.hflip > 0 and torch.rand(1) < self.hflip:
            out = out.flip(-1)
        return out

    def batch(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """The same draws for a list of decoded images (3, H_i, W_i) on one device, and the same pixels up to the
        resampling (docs/data.md): every crop box from timm's ``get_params`` in turn, the flips as one
        ``torch.rand(n)`` (the values n calls of ``torch.rand(1)`` give), then one batched resized crop
        (quest.data.pipelines.batch_input.resized_crop_batch). (N, 3, size, size) uint8."""
        boxes = crop_boxes(images, self.scale, self.ratio)
        flips = torch.rand(len(images)) < self.hflip if self.hflip > 0 else torch.zeros(len(images), dtype=torch.bool)
        return resized_crop_batch(images, boxes, flips, self.size, self.interpolation)


class DraftCropFlip(CropFlip):
    """:class:`CropFlip` on an image opened undecoded (``data.draft_decode``, quest.data.pipelines.draft): the same draws in
    the same order (the box from the header's size, then the flip), the decode at the reduction the box allows, the
    reduced crop resampled by PIL (fractional box edges) to uint8. Unreduced, today's ``split`` step exactly: the
    file decoded by torchvision, cropped by the tensor resize."""

    def __call__(self, img: Any) -> torch.Tensor:
        if not isinstance(img, Image.Image):
            return super().__call__(img)
        box = self.get_params(img, self.scale, self.ratio)  # the header's size
        scale = draft_scale(img, reduction(box[2], box[3], self.size, self.size))
        if scale > 1:
            rgb = resize_box(decode_rgb_pil(img), box, scale, (self.size, self.size),
                             Image.Resampling[self.interpolation.upper()])
            return self._flip(F.pil_to_tensor(rgb))
        path = getattr(img, "filename", "")
        if path:  # today's decode of the file (torchvision); the header PIL read is let go
            img.close()
            try:
                full = _read_rgb(path)
            except CorruptImageError as exc:  # in the transform, not the loader: the file is named here
                raise CorruptImageError(f"cannot read image {path}: {exc}") from exc
        else:
            full = F.pil_to_tensor(decode_rgb_pil(img))
        return self._flip(self._resized_crop(full, box))


class DeviceFinish:
    """A uint8 batch (N, 3, S, S) -> the model's float input on the device: RandAugment (when the recipe has it),
    normalisation, random erasing (timm's RandomErasing on the batch, as timm's PrefetchLoader does it)."""

    def __init__(self, recipe: Any, data: Any, img_size: int, crop: CropFlip | None = None):
        self.rand_augment, self.policy = None, recipe.get("auto_augment")
        if self.policy:
            from .device_augment import DeviceRandAugment

            self.rand_augment = DeviceRandAugment(recipe.auto_augment, img_size, tuple(data.mean),
                                                  interpolation=recipe.train_interpolation)
        self.mean, self.std = tuple(data.mean), tuple(data.std)
        self.reprob, self.remode, self.recount = float(recipe.reprob), recipe.remode, int(recipe.recount)
        self.crop = crop  # data.pipeline=device: the crop and flip happen here too, on the batch
        self._erasing = BatchErasing(self.reprob, self.remode, self.recount) if self.reprob > 0 else None
        self._moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (mean, std) per device, made once

    def describe(self) -> str:
        steps = ["decode (nvJPEG on CUDA, libjpeg-turbo otherwise)", "crop + flip"] if self.crop is not None else []
        if self.rand_augment is not None:
            steps.append(f"RandAugment {self.policy} (quest DeviceRandAugment)")
        steps.append("normalise")
        if self.reprob > 0:
            steps.append(f"RandomErasing p={self.reprob:g} mode={self.remode} (timm's draws, batched)")
        return ", ".join(steps)

    def __call__(self, images: Any, device: torch.device) -> torch.Tensor:
        if self.crop is not None:  # encoded images: an EncodedBatch from the loader, or a list of byte tensors
            files = images.files() if isinstance(images, EncodedBatch) else images
            try:
                images = self.crop.batch(decode_batch(files, device))
            except CorruptImageError as exc:
                raise CorruptImageError(f"data.pipeline=device: {exc}; data.preflight=true (the default) finds such "
                                        "files before training, and data.bad_images=skip leaves them out") from exc
        images = images.to(device, non_blocking=True)
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"expected a uint8 batch (N, 3, H, W), got {tuple(images.shape)} {images.dtype}")
        if self.rand_augment is not None:
            images = self.rand_augment(images)
        key = str(images.device)
        if key not in self._moments:  # not a host-to-device copy per batch
            self._moments[key] = tuple(torch.tensor(v, device=images.device).view(1, 3, 1, 1)
                                       for v in (self.mean, self.std))
        mean, std = self._moments[key]
        out = (images.float() / 255).sub_(mean).div_(std)  # timm: ToTensor (x / 255), then Normalize
        if self._erasing is not None:
            self._erasing(out)
        return out


@dataclass(frozen=True)
class EncodedBatch:
    """A batch of encoded image files in one buffer: every file's bytes end to end (``data``, 1-d uint8) and each
    file's length. One ordinary CPU storage per batch, whatever its size, is what a loader worker can send: the
    tensors torchvision's ``read_file`` returns map the file (``UntypedStorage.from_file``, its descriptor closed),
    which torch's sharing takes for shared memory and fails to pass on ("Bad file descriptor", the worker's batch
    lost and the loader waiting for it), and a tensor per file would hold a file descriptor per image in the
    training process (torch's ``file_descriptor`` sharing strategy, Linux's default)."""

    data: torch.Tensor
    lengths: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.lengths)

    def files(self) -> list[torch.Tensor]:
        """Each file's bytes: views of ``data``, contiguous (what nvJPEG takes), nothing copied."""
        return list(torch.split(self.data, list(self.lengths))) if self.lengths else []

    def pin_memory(self) -> EncodedBatch:
        """The DataLoader's pin_memory thread calls this: one pinned buffer per batch."""
        return EncodedBatch(self.data.pin_memory(), self.lengths)


def collate_bytes(batch: list) -> tuple[EncodedBatch, torch.Tensor, int]:
    """A batch of encoded images (their lengths differ): the files' bytes copied into one :class:`EncodedBatch`, the
    targets, the skipped count."""
    good = [b for b in batch if b is not None]
    files = [b[0].reshape(-1) for b in good]
    data = torch.cat(files) if files else torch.empty(0, dtype=torch.uint8)
    return (EncodedBatch(data, tuple(int(f.numel()) for f in files)),
            torch.tensor([b[1] for b in good], dtype=torch.long), len(batch) - len(good))


def _crop(recipe: Any, img_size: int) -> CropFlip:
    return CropFlip(img_size, recipe.scale, recipe.ratio, recipe.train_interpolation, recipe.hflip)


def _check_uint8(c: Any) -> None:
    """The recipe steps a uint8 pipeline reproduces: timm's RandomResizedCrop, flip, a RandAugment policy
    (``rand-...``) and random erasing; not colour jitter, 3-Augment, AutoAugment or AugMix, nor random resampling."""
    name = c.value("data.pipeline")
    policy, interpolation = c.value("recipe.auto_augment"), c.value("recipe.train_interpolation")
    if policy and not str(policy).startswith("rand"):
        c.fail("recipe.auto_augment", f"must be a RandAugment policy (rand-...) or null with data.pipeline={name} "
               "(its device stage runs timm's RandAugment only; data.pipeline=timm runs every policy)")
    elif policy and interpolation in ("bicubic", "bilinear"):
        from .device_augment import DeviceRandAugment

        try:  # timm parses the policy; what has no batched op (GaussianBlur, a typo timm ignores) is named
            DeviceRandAugment(str(policy), 224, (0.5, 0.5, 0.5), interpolation=interpolation)
        except ValueError as exc:
            c.fail("recipe.auto_augment", f"must be a policy the device can run with data.pipeline={name} ({exc})")
    elif policy and interpolation == "nearest":
        c.fail("recipe.train_interpolation", f"must be bicubic or bilinear with RandAugment on the device "
               f"(data.pipeline={name}), as timm's RandAugment resamples")
    recipe = c.value("recipe")
    if recipe is not None and jitter_active(recipe):
        c.fail("recipe.color_jitter", f"must be null (or off under RandAugment, as timm does) with "
               f"data.pipeline={name} (no colour jitter on uint8 batches; data.pipeline=timm has it)")
    c.one_of("recipe.train_interpolation", RESAMPLING)


#: how a label says data.draft_decode is on
_DRAFT = "decode at 1/2, 1/4 or 1/8 where the crop allows (data.draft_decode: PIL draft, libjpeg DCT scaling)"


@register_train_input("timm", "timm create_transform on PIL images in the loader workers, float tensors out",
                      draft_decode=True)
def _timm(recipe: Any, data: Any, img_size: int) -> TrainInput:
    transform = build_transforms(recipe, data, img_size)[0]
    if not data.get("draft_decode", False):
        return TrainInput(transform, collate_skipping_bad, None,
                          "timm: PIL decode + timm create_transform in the loader workers")
    return TrainInput(draft_first(transform), collate_skipping_bad, None,
                      f"timm: PIL {_DRAFT} + timm create_transform in the loader workers", read_file=open_undecoded)


@register_train_input("split", "workers: decode (torchvision) + crop + flip to uint8; device: RandAugment, "
                      "normalise, random erasing on batches", check=_check_uint8, draft_decode=True)
def _split(recipe: Any, data: Any, img_size: int) -> TrainInput:
    finish = DeviceFinish(recipe, data, img_size)
    if data.get("draft_decode", False):
        crop = DraftCropFlip(img_size, recipe.scale, recipe.ratio, recipe.train_interpolation, recipe.hflip)
        return TrainInput(crop, collate_skipping_bad, finish, f"split: workers: {_DRAFT}, else decode "
                          "(torchvision, PIL for other formats) + timm RandomResizedCrop draw + flip to uint8; "
                          f"device: {finish.describe()}", read_file=open_undecoded)
    return TrainInput(_crop(recipe, img_size), collate_skipping_bad, finish,
                      "split: workers: decode (torchvision, PIL for other formats) + timm RandomResizedCrop draw + "
                      f"flip to uint8; device: {finish.describe()}", read_file=_read_rgb)


class _Bytes:
    """data.pipeline=device's per-sample step: the file's bytes, untouched (its TrainInput's ``read_file`` reads
    them)."""

    def __call__(self, encoded: Any) -> Any:
        if not isinstance(encoded, torch.Tensor):
            raise TypeError("data.pipeline=device needs a data set that reads image files (its samples were "
                            f"{type(encoded).__name__}, not the file's bytes)")
        return encoded


@register_train_input("device", "workers: read the file's bytes; device: decode (nvJPEG on CUDA), crop, flip, "
                      "RandAugment, normalise, random erasing", check=_check_uint8, reads_files=True)
def _device(recipe: Any, data: Any, img_size: int) -> TrainInput:
    finish = DeviceFinish(recipe, data, img_size, crop=_crop(recipe, img_size))
    return TrainInput(_Bytes(), collate_bytes, finish, f"device: workers: the file's bytes; device: {finish.describe()}",
                      read_file=_read_bytes)
