"""``python -m quest.toy [grid=full|quick] [attentions=[standard,quest]] [data.train_size=...] [out_dir=...]``,
the same app as the ``quest-toy`` console script (quest/cli.py)."""
from quest.cli import toy

if __name__ == "__main__":
    toy()
