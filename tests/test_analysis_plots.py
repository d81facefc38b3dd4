"""Every figure function draws its data (read back from the figure, not its pixels) and writes a PNG."""

import pytest
import torch

from hf_partial_attention.analysis import plots
from hf_partial_attention.analysis.spectra import LayerProjection


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plots save, kept open for inspection (their data, not their pixels)."""
    import matplotlib.figure

    figures, save = [], matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def _lines(ax):
    return [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


def test_every_figure_draws_its_data(tmp_path, drawn):
    curve = torch.linspace(0.1, 1, 10)
    ks = list(range(1, 11))
    values = [float(v) for v in curve]
    plots.plot_layer_projection(curve, [LayerProjection(0, curve, curve * 0.9), LayerProjection(3, curve, curve)],
                                tmp_path / "a.png")
    plots.plot_overlap({"x": curve}, tmp_path / "b.png")
    images = torch.randn(3, 4, 4)
    plots.plot_images(images, tmp_path / "c.png", ["1", "2", "3"])
    vals = torch.rand(6, 6).sort(-1, descending=True).values
    share = torch.rand(6)
    plots.plot_per_query_spectra(vals, share, tmp_path / "d.png", rows=[0, 5])
    mask = torch.eye(4, dtype=torch.bool)
    plots.plot_patterns([("k=2", mask)], tmp_path / "e.png")
    plots.plot_error_curves([{"scope": "per_query", "seq_len": 4, "k_bar": [4, 8], "greedy": [0.5, 0.2],
                              "eigen": [0.3, 0.1], "relative_cost": [0.5, 1.0]}], tmp_path / "f.png")
    plots.plot_baselines({"m": [(1.0, 0.1), (0.5, 0.2)]}, tmp_path / "g.png")
    assert len(drawn) == 7 and all(f.read(8) == b"\x89PNG\r\n\x1a\n"
                                   for f in (open(tmp_path / f"{c}.png", "rb") for c in "abcdefg"))
    layer, overlap, imgs, spectra, patterns, errors, baselines = drawn
    # Fig. 3: per layer, its own curve and its curve on the global eigenspace, against k = 1..K
    a0, a3 = layer.axes[0], layer.axes[1]
    assert a0.get_title() == "layer 0" and a3.get_title() == "layer 3"
    assert [ys for _, _, ys in _lines(a0)] == [values, [float(v) for v in curve * 0.9]]
    assert _lines(a0)[0][1] == ks
    assert _lines(overlap.axes[0]) == [("x", ks, values)]
    # eigenvector images: each panel is its image, on a colour scale symmetric about 0
    for ax, img in zip(imgs.axes, images):
        shown = ax.get_images()[0]
        assert torch.equal(torch.as_tensor(shown.get_array().data), img)
        assert shown.get_clim() == (-float(img.abs().max()), float(img.abs().max()))
    # Fig. 6: (a) the chosen rows' normalised eigenvalues, (b) the top share per row
    a, b = spectra.axes[:2]
    assert [label for label, _, _ in _lines(a)] == ["row 0", "row 5"]
    torch.testing.assert_close(torch.tensor(_lines(a)[1][2]), vals[5] / vals[5].sum())
    assert _lines(b)[0][2] == [float(v) for v in share]
    assert torch.equal(torch.as_tensor(patterns.axes[0].get_images()[0].get_array().data), mask)
    a, b = errors.axes[:2]
    assert [(xs, ys) for _, xs, ys in _lines(a)] == [([4, 8], [0.5, 0.2]), ([4, 8], [0.3, 0.1])]
    assert [(xs, ys) for _, xs, ys in _lines(b)][0] == ([0.5, 1.0], [0.5, 0.2])
    assert _lines(baselines.axes[0])[0] == ("m", [0.5, 1.0], [0.2, 0.1])  # sorted by cost
