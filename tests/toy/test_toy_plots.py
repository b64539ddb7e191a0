"""key_norms.png: the panels share one y-scale and the legend lies outside every panel (never over the data)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

from quest.toy.plots import key_norms_figure, plot_key_norms  # noqa: E402


def _study():
    # standard: 2 biased runs with large norms; quest: 1 biased, 1 correct run with small norms; the scales differ
    # by 100x, so panels with their own y-scales would look alike
    g = torch.Generator().manual_seed(0)
    norms = {"standard": 50 + 50 * torch.rand(2, 4, 3, generator=g, dtype=torch.float64),
             "quest": 0.5 + torch.rand(2, 4, 3, generator=g, dtype=torch.float64)}
    rows = [{"attention": "standard", "outcome": "biased"}, {"attention": "standard", "outcome": "biased"},
            {"attention": "quest", "outcome": "biased"}, {"attention": "quest", "outcome": "correct"}]
    return rows, norms


def test_panels_share_one_y_scale_and_the_legend_is_outside_them():
    import matplotlib.pyplot as plt

    rows, norms = _study()
    fig, axes = key_norms_figure(rows, norms, {"quest": "QUEST"})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert len(axes) == 2 and axes[0].get_ylim() == axes[1].get_ylim()
    low, high = axes[0].get_ylim()
    # both formulations' curves lie inside the one scale: quest's (one run per outcome: its values are the curves)
    # and standard's (the median of two runs, their mean)
    assert low <= norms["quest"].min().item() and high >= norms["standard"].mean(dim=0).max().item()
    assert all(ax.get_legend() is None for ax in axes) and len(fig.legends) == 1
    legend = fig.legends[0].get_window_extent(renderer)
    for ax in axes:
        assert not legend.overlaps(ax.get_window_extent(renderer))
    entries = [t.get_text() for t in fig.legends[0].get_texts()]
    assert entries == ["biased answer tokens", "unbiased answer tokens", "other tokens", "biased runs (median)",
                       "correct runs (median)"]
    assert [ax.get_title() for ax in axes] == ["standard (biased n=2, correct n=0)", "QUEST (biased n=1, correct n=1)"]
    plt.close(fig)


def test_the_saved_image_takes_in_the_legend(tmp_path):
    from PIL import Image

    rows, norms = _study()
    plot_key_norms(rows, norms, tmp_path / "key_norms.png")
    width, height = Image.open(tmp_path / "key_norms.png").size
    # two 4 x 3.6 inch panels at 130 dpi, plus the legend below: taller than the panels alone
    assert height > 3.6 * 130 and width > 2 * 3.5 * 130
