import inspect
import os
import re

# No test may reach the network.
os.environ["WANDB_MODE"] = "offline"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
# Inductor's cache does not key its compiled kernels by ATEN_CPU_CAPABILITY: kernels built for AVX-512 and reused
# under a capped dispatch fail to compile ("'at::vec' has not been declared"). A capped run (CI reruns the numerical
# tests under ATEN_CPU_CAPABILITY=default) gets a cache of its own, for this process and the ones it starts.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


# A test that compares floats against a reference (assert_close, allclose, isclose, pytest.approx) is marked
# `numerics`: CI runs these a second time under another CPU kernel path (ATEN_CPU_CAPABILITY=default), where a
# float32 comparison across batch shapes or summation orders that only held on one machine's kernels fails.
# Marked from the test's own source, so that a new test is covered without anyone remembering to mark it; a test
# that compares through a helper is marked by hand (@pytest.mark.numerics).
_FLOAT_COMPARISON = re.compile(r"assert_close|allclose|isclose|approx\(")


def pytest_collection_modifyitems(config, items):
    sources: dict[object, bool] = {}
    for item in items:
        function = getattr(item, "function", None)
        if function is None or "numerics" in item.keywords:
            continue
        if function not in sources:
            try:
                sources[function] = bool(_FLOAT_COMPARISON.search(inspect.getsource(function)))
            except (OSError, TypeError):
                sources[function] = False
        if sources[function]:
            item.add_marker(pytest.mark.numerics)
