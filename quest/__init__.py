"""quest: train and evaluate timm Vision Transformers with swappable attention (standard, QNorm, QKNorm, QUEST,
Elliptical, or your own), to reproduce and extend the QUEST paper. Sub-packages: attention, models, data, engine,
diagnostics, evaluation, explain, toy, report; console scripts in quest.cli."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("quest")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

# timm learns quest's formulations as attn_layer names (quest.attention) and the quest_vit model that exported
# folders name (quest.models.timm_model), so timm.create_model("local-dir:...") works in any process that imported quest.
from . import attention, models  # noqa: E402,F401

__all__ = ["__version__"]
