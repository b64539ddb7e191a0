"""The explanation grid says how to read its row labels ('1->9') in one line under the grid."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

from quest.explain.figures import explanation_grid, grid_figure  # noqa: E402


def _grid(row_key):
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    maps = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(1))
    return grid_figure(images, [("agcam", maps)], None, ["#0 1->9", "#5 3->3"], "quest (last)", row_key)


def test_the_row_key_is_drawn_under_every_axis_inside_the_figure():
    key = "row label: #sample index, true class -> predicted class"
    fig = _grid(key)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.texts if t.get_text() == key]
    assert len(texts) == 1 and texts[0].get_visible()
    box, page = texts[0].get_window_extent(renderer), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
    assert all(box.y1 <= ax.get_window_extent(renderer).y0 + 1e-6 for ax in fig.axes)  # below the grid, no overlap


def test_no_key_without_row_labels_or_a_key(tmp_path):
    assert not [t for t in _grid(None).texts if t.get_text().startswith("row label")]
    out = explanation_grid(torch.rand(1, 3, 8, 8), [("rollout", torch.rand(1, 8, 8))], tmp_path / "g.png",
                           row_key="row label: x")  # no row labels: nothing to explain
    assert out.stat().st_size > 0
