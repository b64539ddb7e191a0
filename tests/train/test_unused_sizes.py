"""An input-size key that another overrules is refused, not recorded as set and then not used (docs/training.md,
"Input size"): recipe.img_size, then model.img_size, then data.img_size decide the size a run trains at."""
from __future__ import annotations

import pytest

from quest.config.checks import ConfigError
from quest.train import fit
from quest.train.builders import resolve_img_size, unused_size_keys

from ..helpers import FAST, compose_cfg


@pytest.mark.parametrize("overrides, refused", [
    (("model=vit_pico", "data.img_size=32"), "data.img_size=32 is not the size this run trains at: model.img_size=16"),
    (("model=vit_base", "recipe=deit3", "model.img_size=224"),
     "model.img_size=224 is not the size this run trains at: recipe.img_size=192"),
    (("model=vit_pico", "model.img_size=32", "data.img_size=32"), None),  # the size it trains at: said twice, used
    (("model=vit_pico", "data.img_size=16"), None),
])
def test_an_overruled_size_key_is_named_with_the_key_that_decides(overrides, refused):
    cfg = compose_cfg("data=fake", *overrides)
    problems = unused_size_keys(cfg, list(overrides))
    assert len(problems) == (refused is not None), problems
    if refused is not None:
        assert problems[0].startswith(refused), problems
    else:
        assert all(resolve_img_size(cfg) == int(o.split("=")[1]) for o in overrides if "img_size" in o)


def test_fit_refuses_it_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.img_size=32 is not the size this run trains at"):
        fit(compose_cfg(*FAST, "data.img_size=32"), tmp_path / "run", given=["data.img_size=32"])
    assert not (tmp_path / "run").exists()
