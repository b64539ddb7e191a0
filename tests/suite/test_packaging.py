"""quest as an installable library: what the wheel ships (every package, every config), its console scripts, its
dependency ranges against what is installed, and the message of a missing extra. The install itself, from the wheel
into a fresh venv outside the checkout, runs in .ci/run."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import entry_points, version

import pytest
from packaging.requirements import Requirement

from quest.runtime.extras import MissingExtra, require

from ..helpers import FAST, ROOT, compose_cfg

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_and_config_folder_is_shipped():
    declared = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for top in ("quest", "hydra_plugins")
               for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk <= declared, f"add to [tool.setuptools] packages: {sorted(on_disk - declared)}"
    # a namespace shared with the other Hydra plugins: an __init__.py there would hide them
    assert not (ROOT / "hydra_plugins" / "__init__.py").exists()
    assert {"quest.configs", "quest.configs.toy"} <= declared
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"quest.configs": "configs"}


@pytest.mark.process  # pip builds the wheel in an interpreter of its own
def test_the_wheel_holds_every_config_and_the_console_scripts(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools writes build/ beside the sources
    for name in ("quest", "configs", "hydra_plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "quest_cli.py"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("quest-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"quest/configs/{p.relative_to(ROOT / 'configs')}" for p in (ROOT / "configs").rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    assert "quest/configs/train.yaml" in names and "quest/configs/toy/grid/quick.yaml" in names
    assert "quest_cli.py" in names  # the commands' entry module (quest_cli's docstring: why outside the package)
    assert "hydra_plugins/quest_launcher/__init__.py" in names and "hydra_plugins/__init__.py" not in names
    assert not any(n.startswith(("tests/", "configs/", "bench/")) for n in names)  # nothing but the package
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(meta).decode()
    for script in ("quest-train", "quest-eval", "quest-toy", "quest-report", "quest-plot", "quest-export", "quest-data"):
        assert f"{script} = quest_cli:" in scripts, script


def test_console_scripts_are_installed():
    # that each one starts and runs is the wheel smoke's proof (.ci/run runs every quest-* script from the wheel)
    installed = {ep.name: ep.value for ep in entry_points(group="console_scripts") if ep.name.startswith("quest-")}
    assert installed == dict(PYPROJECT["project"]["scripts"])


def test_dependencies_are_ranges_that_admit_the_installed_versions():
    import quest

    assert quest.__version__ == version("quest") == PYPROJECT["project"]["version"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    requirements = [*PYPROJECT["project"]["dependencies"], *(r for k, v in extras.items() if k != "dev" for r in v)]
    for text in requirements:
        req = Requirement(text)
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{text}: a range, not a pin"
        assert req.specifier.contains(version(req.name), prereleases=True), (text, version(req.name))
    # the exact sets CI installs: the newest (constraints.txt) or the floors (constraints-floor.txt)
    sets = [(ROOT / name).read_text() for name in ("constraints.txt", "constraints-floor.txt")]
    assert any(all(f"\n{name}=={version(name)}\n" in text for name in ("torch", "timm", "hydra-core", "torchmetrics"))
               for text in sets), {name: version(name) for name in ("torch", "timm", "hydra-core", "torchmetrics")}


def test_a_missing_extra_names_the_install_command(tmp_path, monkeypatch):
    with pytest.raises(MissingExtra, match=r"thing needs .*'no_such_module_xyz'.*pip install 'quest\[eval\]'"):
        require("no_such_module_xyz", "eval", "thing")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    from quest.train import fit

    with pytest.raises(MissingExtra, match=r"logger=wandb needs .*pip install 'quest\[wandb\]'"):
        fit(compose_cfg(*FAST, "logger=wandb", "trainer.epochs=1"), tmp_path)


def test_configs_are_found_as_the_package_and_in_the_checkout():
    from quest.cli import config_root, rewrite_attention_override

    assert (config_root() / "train.yaml").is_file() and (config_root() / "toy" / "toy.yaml").is_file()
    assert rewrite_attention_override(["x", "attention=my_pkg.attn:Mine", "attention=quest"]) == [
        "x", "attention=path", "attention.name=my_pkg.attn:Mine", "attention=quest"]
