"""Train a timm ViT with a chosen attention: ``python train.py [attention=quest] [model=vit_base] [recipe=deit] ...``

With no arguments: a small ViT with QUEST attention on the built-in digits, on CPU, in under a minute.
The same app as the ``quest-train`` console script (quest/cli.py). Exit codes (docs/training.md): 0 finished
(completed, stopped at trainer.max_steps, requeued, or already finished before), 1 error (a bad config value, a
refused resume), 3 diverged (in a multirun a diverged job is reported in its summary and the sweep goes on),
130 / 143 interrupted by SIGINT / SIGTERM after saving.
"""
from quest_cli import train

if __name__ == "__main__":
    train()
