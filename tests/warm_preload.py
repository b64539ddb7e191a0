"""Imported once by the warm zygote (tests/warm.py): what every app imports before it does any work. Nothing here
computes, starts a thread or reads the environment in a way a test changes."""
import hydra  # noqa: F401
import timm  # noqa: F401
import torch  # noqa: F401
import torchvision  # noqa: F401

import quest.cli  # noqa: F401
import quest.evaluation  # noqa: F401
import quest.train  # noqa: F401
