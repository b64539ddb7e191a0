"""How close healthy runs come to the default divergence guard (trainer.max_loss_factor x the chance loss).

Trains each case below with the guard off and every step logged, then prints the largest training loss of any step
divided by the chance loss (ln C; ln 2 under recipe.bce_loss), and where the run ended; then the recipe.lr=10 run on
the digits, which the guard must stop. docs/training.md ("Divergence") quotes its output.

    python bench/divergence_margin.py [--only light-digits,...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hydra import compose, initialize_config_dir  # noqa: E402

from quest.config.hydra_store import register_configs  # noqa: E402
from quest.train import fit  # noqa: E402
from quest.train.update import chance_loss  # noqa: E402

_DEIT3_CPU = ["recipe.lr=4e-3", "recipe.drop_path=0.05", "recipe.img_size=null", "recipe.repeated_aug=0"]
CASES = {
    # name: overrides (the guard is switched off for the measurement)
    "light-digits (25 epochs, the default run)": ["data=digits", "model=vit_pico", "recipe=light"],
    "light-digits standard attention lr 3.2e-2 (Table A3 CPU's largest)":
        ["data=digits", "model=vit_pico", "recipe=light", "attention=standard", "recipe.lr=3.2e-2"],
    "light-digits QUEST lr 3.2e-2 (Table A3 CPU's largest)":
        ["data=digits", "model=vit_pico", "recipe=light", "recipe.lr=3.2e-2"],
    "deit-digits (10 epochs)": ["data=digits", "model=vit_pico", "recipe=deit", "trainer.epochs=10"],
    "deit-fake (10 epochs)": ["data=fake", "data.img_size=16", "model=vit_pico", "recipe=deit", "trainer.epochs=10"],
    "deit3-digits (10 epochs, lr 4e-3)": ["data=digits", "model=vit_pico", "recipe=deit3", "trainer.epochs=10",
                                          *_DEIT3_CPU],
    "deit3-fake (10 epochs, lr 4e-3)": ["data=fake", "data.img_size=16", "model=vit_pico", "recipe=deit3",
                                        "trainer.epochs=10", *_DEIT3_CPU],
}
DIVERGING = ["data=digits", "model=vit_pico", "recipe=light", "recipe.lr=10", "trainer.epochs=3"]


def run(overrides: list[str], out: Path) -> tuple[dict, list[float]]:
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "trainer.log_every_n_steps=1", "trainer.device=cpu"])
    summary = fit(cfg, out)
    losses = [r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    return summary, losses, cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case-name prefixes")
    args = parser.parse_args()
    register_configs()
    wanted = [c for c in CASES if not args.only or any(c.startswith(p) for p in args.only.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(wanted):
            summary, losses, cfg = run([*CASES[name], "trainer.max_loss_factor=null"], Path(tmp) / str(i))
            chance = chance_loss(cfg.data.num_classes, bool(cfg.recipe.bce_loss))
            worst = max(losses)
            print(f"{name}: {len(losses)} steps, max loss {worst:.3f} = {worst / chance:.2f} x chance "
                  f"({chance:.3f}) at step {losses.index(worst) + 1}, last {losses[-1]:.3f}, status "
                  f"{summary['status']}, val top-1 {summary.get('val/top1')}", flush=True)
        if not args.only:
            summary, losses, cfg = run(DIVERGING, Path(tmp) / "diverging")
            print(f"recipe.lr=10 on the digits with the default guard: {summary['status']} at step "
                  f"{summary['diverged_at_step']} ({summary['divergence_reason']}); losses before it "
                  f"{[round(v, 2) for v in losses]}", flush=True)


if __name__ == "__main__":
    main()
