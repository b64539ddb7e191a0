"""The GPU proxy per formulation (bench/dispatch_proxy.py): the kernels one training step launches and the bytes its
non-matmul kernels move, counted on the CPU under bf16 autocast with CUDA's rules, on the PyTorch path (what ran on
the GPU before the fused operators) and on the fused path (quest.attention.fused), each against standard attention.

    python bench/gpu_proxy.py --batch 32 --depth 2     # ViT-B/16 at 224 px (the H200 table's model), 2 of its blocks
    python bench/gpu_proxy.py --model vit_tiny_patch16_224 --batch 2

A formulation's extra work is per block, so two blocks give each block's ratios at a fraction of the CPU time; the
batch matters: at batch 1 autocast's per-step casts of the weights are a third of standard attention's bytes (at
the H200's batch 128, about 4%), so a small batch understates every ratio.

No timing: the counts are exact and the same on every machine (docs/benchmarks.md, "GPU proxy").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.dispatch_proxy import step_cost  # noqa: E402
from quest.attention import list_attentions  # noqa: E402


def table(model: str, batch: int, img_size: int, dtype: torch.dtype | None, depth: int | None) -> list[list[str]]:
    names = ["standard"] + [a for a in list_attentions() if a != "standard"]
    blocks = {"depth": depth} if depth else {}
    costs = {(a, gpu): step_cost(a, model=model, batch=batch, img_size=img_size, dtype=dtype, gpu_path=gpu, **blocks)
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
    parser.add_argument("--depth", type=int, default=None, help="blocks (default: the model's own)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    rows = table(args.model, args.batch, args.img_size, dtype, args.depth)
    print(f"{args.model}{f' ({args.depth} blocks)' if args.depth else ''}, {args.img_size} px, batch {args.batch}, "
          f"{args.dtype}; (x standard)")
    head = ["attention", "launches, PyTorch path", "over 64 KiB", "non-matmul MiB", "launches, fused path",
            "over 64 KiB", "non-matmul MiB"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
