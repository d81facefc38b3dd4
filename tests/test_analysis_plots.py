"""Every figure function writes a PNG."""

import torch

from hf_partial_attention.analysis import plots
from hf_partial_attention.analysis.spectra import LayerProjection


def test_all_figures(tmp_path):
    curve = torch.linspace(0.1, 1, 10)
    made = [
        plots.plot_layer_projection(curve, [LayerProjection(0, curve, curve * 0.9)] * 2, tmp_path / "a.png"),
        plots.plot_overlap({"x": curve}, tmp_path / "b.png"),
        plots.plot_images(torch.randn(3, 4, 4), tmp_path / "c.png", ["1", "2", "3"]),
        plots.plot_per_query_spectra(torch.rand(6, 6).sort(-1, descending=True).values, torch.rand(6),
                                     tmp_path / "d.png"),
        plots.plot_patterns([("k=2", torch.eye(4, dtype=torch.bool))], tmp_path / "e.png"),
        plots.plot_error_curves([{"scope": "per_query", "seq_len": 4, "k_bar": [4, 8], "greedy": [0.5, 0.2],
                                  "eigen": [0.3, 0.1], "relative_cost": [0.5, 1.0]}], tmp_path / "f.png"),
        plots.plot_baselines({"m": [(0.5, 0.2), (1.0, 0.1)]}, tmp_path / "g.png"),
    ]
    for path in made:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
