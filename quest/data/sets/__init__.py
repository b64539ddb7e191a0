"""The built-in data sets, one module each (its settings, checks and builder); importing this package imports every
module in it, and each registers its data sets (quest.data.kinds). A new built-in data set is one module here
and one yaml in configs/data/ (docs/data.md, "Adding a data set").

- ``digits``, ``digits_canvas``: scikit-learn's bundled digits, and each pasted on a canvas with its box;
- ``fake``: random images (torchvision's FakeData's); ``cifar``: cifar10 / cifar100;
- ``folders``: imagenet / imagefolder (class folders); ``shards``: imagenet_wds / wds (WebDataset tar shards).
"""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
