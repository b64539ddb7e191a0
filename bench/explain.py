"""Cost of an explanation per image against a plain eval forward (issue: explainability).

For each model, rounds alternate a plain ``model(images)`` under no_grad with each method of quest.explain on the
same batch (attention maps and rollout: one forward with explicit attention; AG-CAM: that forward plus a backward
to the attention probabilities); medians over rounds, and each method's ratio to the plain forward. Training never
runs any of it: the explicit attention exists only inside ``explicit_attention``.

    python bench/explain.py [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quest.explain import agcam, attention_rollout, cls_attention  # noqa: E402
from quest.models import create_model  # noqa: E402

MODELS = {  # name -> (timm name, input size, batch)
    "vit_pico@32 (digits_canvas)": ("vit_pico_patch4_16", 32, 64),
    "ViT-Ti/16 @224": ("vit_tiny_patch16_224", 224, 8),
}


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for label, (name, size, batch) in MODELS.items():
        for attention in ("standard", "quest"):
            model = create_model(name, attention=attention, num_classes=10, img_size=size).eval()
            images = torch.randn(batch, 3, size, size)

            def plain(x):
                with torch.no_grad():
                    model(x)

            methods = {"forward": plain, "attention": lambda x: cls_attention(model, x),
                       "rollout": lambda x: attention_rollout(model, x), "agcam": lambda x: agcam(model, x)}
            for fn in methods.values():  # warm-up
                fn(images)
            times = {k: [] for k in methods}
            for _ in range(args.rounds):
                for k, fn in methods.items():
                    times[k].append(timed(fn, images))
            base = statistics.median(times["forward"])
            cells = [f"{k} {1e3 * statistics.median(v) / batch:.2f} ms/img ({statistics.median(v) / base:.2f}x)"
                     for k, v in times.items()]
            print(f"{label:28s} {attention:8s} batch {batch}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
