"""A formulation from outside quest: one QKAttention subclass in the user's own module, named by its import path,
trains and evaluates by config alone; formulations learn their place in the model through one hook, bind()."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from hydra import compose, initialize_config_dir

from quest.evaluation import register_eval_configs, run_evaluation
from quest.models import create_model
from quest.run.checkpoint import load_checkpoint
from quest.train import fit

from ..helpers import CONFIGS, FAST, compose_cfg
from ..reference import l2n
from ..warm import run_app

register_eval_configs()

# A user's formulation: cosine attention with a fixed temperature, nothing of quest edited.
PLUGIN = textwrap.dedent('''
    import torch.nn.functional as F
    from quest.attention import QKAttention

    class CosineAttention(QKAttention):
        """softmax(t * l2n(q) . l2n(k)) with a fixed temperature t (an option)."""

        options = {"temperature": 8.0}
        sites = []  # what bind() was told, for the test

        def transform_qk(self, q, k):
            return F.normalize(q, dim=-1), F.normalize(k, dim=-1), float(self.options["temperature"])

        def bind(self, site):
            type(self).sites.append((site.index, len(site.layers), site.num_tokens, type(site.model).__name__))
''')
PATH = "my_formulations:CosineAttention"


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_formulations.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("my_formulations")
    sys.modules.pop("my_formulations", None)


def test_a_formulation_from_an_import_path_matches_its_explicit_definition(plugin):
    model = create_model("vit_pico_patch4_16", attention=PATH, attention_options={"temperature": 3.0},
                         num_classes=10).double().eval()
    attn = model.blocks[0].attn
    assert isinstance(attn, plugin.CosineAttention) and attn.options["temperature"] == 3.0
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    q, k, v = attn.project_qkv(x)
    probs = torch.softmax(3.0 * l2n(q) @ l2n(k).transpose(-2, -1), dim=-1)  # the definition, written out
    out = attn.proj((probs @ v).transpose(1, 2).reshape(2, 17, 64))
    torch.testing.assert_close(attn(x), out, atol=1e-12, rtol=0)


def test_every_layer_is_told_its_place_once(plugin):
    plugin.CosineAttention.sites.clear()
    create_model("vit_pico_patch4_16", attention=PATH, num_classes=10)
    # 4 blocks; 4 x 4 patches + [CLS] = 17 tokens at 16 px
    assert plugin.CosineAttention.sites == [(i, 4, 17, "VisionTransformer") for i in range(4)]


def test_trained_and_evaluated_by_config_alone(plugin, tmp_path):
    summary = fit(compose_cfg(*FAST, "attention=path", f"attention.name={PATH}", "+attention.options.temperature=5.0"),
                  tmp_path / "run")
    assert summary["status"] == "completed" and summary["attention"] == PATH
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert ckpt["meta"]["attention"] == PATH and ckpt["meta"]["attention_options"] == {"temperature": 5.0}
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("eval", overrides=[f"checkpoint={tmp_path / 'run' / 'checkpoints' / 'last.pt'}", "eval=clean",
                                         "attention=path", f"attention.name={PATH}"])  # named: its code may run
    report = run_evaluation(cfg, tmp_path / "eval")
    assert report["target"]["attention"] == PATH
    assert report["results"]["clean"]["top1"] == pytest.approx(summary["val/top1"])  # the same model, the same data


def test_an_import_path_that_is_not_an_attention_is_a_clear_error(plugin, tmp_path):
    from quest.config.checks import ConfigError

    for path, message in [("my_formulations:Missing", "'Missing' in my_formulations is not found"),
                          ("my_formulations:F", "is a module, not a QKAttention subclass"),
                          ("no_such_package.attention:X", "cannot import 'no_such_package.attention'"),
                          ("my_formulations:", "an import path is 'package.module:ClassName'")]:
        with pytest.raises(ConfigError, match=message):
            fit(compose_cfg(*FAST, "attention=path", f"attention.name={path}"), tmp_path / "run")


def test_cli_trains_a_formulation_of_another_package(plugin, tmp_path):
    env = {"PYTHONPATH": str(tmp_path), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    # attention=<package.module:Class>, as a user types it (train.py turns it into attention=path attention.name=...),
    # in a process of its own forked from the warm zygote, which never imported the user's module: the command's
    # PYTHONPATH is where it comes from, as for a new interpreter
    out = run_app("train.py", *FAST, "trainer.epochs=1", f"attention={PATH}", f"hydra.run.dir={tmp_path / 'cli'}",
                  cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["attention"] == PATH
