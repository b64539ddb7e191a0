import os

# No test may reach the network.
os.environ["WANDB_MODE"] = "offline"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
