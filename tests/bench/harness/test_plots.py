"""The harness's plots are readable: a caption that fits the figure, labelled latency axes.

A one-system CDF figure (the narrowest the harness draws) from a small run with a long title:
the caption must lie inside the figure once drawn, and each log-scaled latency axis must label
at least two ticks inside its range, where a spread of under a decade used to show none.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("matplotlib")

from bench.harness.plots import cdf_figure


def _results() -> dict[str, Any]:
    streams = [{"ttfa_s": 0.6 + 0.2 * i, "ttfs_s": 0.7 + 0.2 * i, "rtf": 1.5 + 0.1 * i} for i in range(8)]
    return {
        "machine": {"cpu_model": "AMD EPYC 7B13 64-Core Processor", "cpu_cores": 2, "gpus": []},
        "title": "full-size random-weight ChatTTS dev model, 2-core CPU (shared), a long title",
        "scenarios": [{"system": "server", "label": "c1", "format": "pcm16", "streams": streams}],
    }


def test_the_cdf_caption_fits_and_latency_axes_are_labelled() -> None:
    import matplotlib.pyplot as plt

    fig = cdf_figure(_results())
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        caption = fig.get_suptitle()
        assert "a long title" in caption
        box = fig._suptitle.get_window_extent(renderer)  # the drawn caption, in pixels
        page = fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (box, page)
        for ax in fig.axes:
            low, high = sorted(ax.get_xlim())
            shown = [
                label.get_text()
                for label, loc in zip(ax.get_xticklabels(), ax.get_xticks(), strict=True)
                if low <= loc <= high and label.get_text()
            ]
            assert len(shown) >= 2, (ax.get_xlabel(), shown, (low, high))
    finally:
        plt.close(fig)
