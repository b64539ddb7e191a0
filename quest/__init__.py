"""quest: train and evaluate timm Vision Transformers with swappable attention (standard, QNorm, QKNorm, QUEST,
Elliptical, or your own), to reproduce and extend the QUEST paper. Sub-packages: attention, models, data, engine,
diagnostics, evaluation, toy, report; console scripts in quest.cli."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("quest")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["__version__"]
