"""The GPU proxy per formulation (quest.attention.proxy): the kernels one training step launches and the bytes its
non-matmul kernels move, counted on the CPU under bf16 autocast with CUDA's rules, on the PyTorch path (what ran on
the GPU before the fused operators) and on the fused path (quest.attention.fused), each against standard attention.

    python bench/gpu_proxy.py                                   # ViT-B/16, 224 px, batch 1 (the H200 table's model)
    python bench/gpu_proxy.py --model vit_tiny_patch16_224 --batch 2

No timing: the counts are exact and the same on every machine (docs/benchmarks.md, "GPU proxy").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quest.attention import list_attentions  # noqa: E402
from quest.attention.proxy import step_cost  # noqa: E402


def table(model: str, batch: int, img_size: int, dtype: torch.dtype | None) -> list[list[str]]:
    names = ["standard"] + [a for a in list_attentions() if a != "standard"]
    costs = {(a, gpu): step_cost(a, model=model, batch=batch, img_size=img_size, dtype=dtype, gpu_path=gpu)
             for gpu in (False, True) for a in names}
    rows = []
    for a in names:
        cells = [a]
        for gpu in (False, True):
            cost, std = costs[(a, gpu)], costs[("standard", gpu)]
            big, std_big = (c["launches"] - c["small_launches"] for c in (cost, std))
            cells += [f"{cost['launches']} ({cost['launches'] / std['launches']:.3f})",
                      f"{big} ({big / std_big:.3f})", f"{cost['bytes'] / 2**20:.0f} ({cost['bytes'] / std['bytes']:.3f})"]
        rows.append(cells)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    rows = table(args.model, args.batch, args.img_size, dtype)
    print(f"{args.model}, {args.img_size} px, batch {args.batch}, {args.dtype}; (x standard)")
    head = ["attention", "launches, PyTorch path", "over 64 KiB", "non-matmul MiB", "launches, fused path",
            "over 64 KiB", "non-matmul MiB"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
