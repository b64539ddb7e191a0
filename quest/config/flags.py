"""A timm or DeiT user's first try, ``python train.py --model vit_tiny --epochs 3``: flags, where quest takes Hydra's
``key=value`` overrides. Each such flag is answered in one line with the quest key it means (``trainer.epochs=3``),
instead of Hydra's "unrecognized arguments"."""
from __future__ import annotations

__all__ = ["HYDRA_FLAGS", "KEY_OF_FLAG", "flag_problems"]

#: Hydra's own command-line flags (``python train.py --help`` lists them): passed on as they are
HYDRA_FLAGS = frozenset({
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--run", "-r",
    "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
    "-cd", "--experimental-rerun", "--info", "-i",
})

#: the flags of timm's train.py and DeiT's main.py a user is most likely to type, and the quest key each means
#: (``{}`` where the flag's value goes; every key is one of quest's, tests/config/test_flags.py checks)
KEY_OF_FLAG = {
    "--model": "model={}", "--epochs": "trainer.epochs={}", "--data-dir": "data.root={}", "--data-path": "data.root={}",
    "--data_dir": "data.root={}", "--data": "data={}", "--dataset": "data={}", "--batch-size": "data.batch_size={}",
    "-b": "data.batch_size={}", "--lr": "recipe.lr={}", "--weight-decay": "recipe.weight_decay={}",
    "--opt": "recipe.opt={}", "--sched": "recipe.sched={}", "--warmup-epochs": "recipe.warmup_epochs={}",
    "--min-lr": "recipe.min_lr={}", "--drop-path": "recipe.drop_path={}", "--smoothing": "recipe.smoothing={}",
    "--mixup": "recipe.mixup={}", "--cutmix": "recipe.cutmix={}", "--reprob": "recipe.reprob={}",
    "--aa": "recipe.auto_augment={}", "--clip-grad": "recipe.clip_grad={}", "--input-size": "data.img_size={}",
    "--img-size": "data.img_size={}", "--num-classes": "data.num_classes={}", "--nb_classes": "data.num_classes={}",
    "--workers": "data.num_workers={}", "-j": "data.num_workers={}", "--num_workers": "data.num_workers={}",
    "--seed": "trainer.seed={}", "--device": "trainer.device={}", "--output": "hydra.run.dir={}",
    "--output_dir": "hydra.run.dir={}", "--output-dir": "hydra.run.dir={}",
    "--resume": "hydra.run.dir=<the run's directory> (a run resumes from its own checkpoints/last.pt)",
    "--initial-checkpoint": "trainer.init_from={}", "--finetune": "trainer.init_from={}",
    "--model-ema": "recipe.ema=true", "--amp": "trainer.precision=fp16", "--pretrained": "model.pretrained=timm",
    "--attention": "attention={}",
}


def flag_problems(args: list[str], program: str) -> list[str]:
    """One line per argument that is a flag Hydra does not know (``--epochs 3``, ``--epochs=3``), naming the quest
    override it means, or saying that quest takes ``key=value`` overrides when it has no counterpart; the value
    after a flag is read with it."""
    problems, i = [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        flag, eq, value = arg.partition("=")
        if not flag.startswith("-") or flag in HYDRA_FLAGS or flag.lstrip("-").replace(".", "").isdigit():
            continue
        key = KEY_OF_FLAG.get(flag)
        takes_value = key is None or "{}" in key
        if not eq and takes_value and i < len(args) and not args[i].startswith("-") and "=" not in args[i]:
            value, i = args[i], i + 1
        typed = f"{flag} {value}".strip() if not eq else arg
        if key is not None:
            problems.append(f"{typed}: quest takes key=value overrides, not flags: write {key.format(value or '<value>')} "
                            f"({program} --help lists every key)")
        else:
            problems.append(f"{typed}: not a flag quest knows; quest takes key=value overrides such as "
                            f"trainer.epochs=3 ({program} --help lists every key)")
    return problems
