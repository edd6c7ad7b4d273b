"""The report's pictures say what its table says: a domain calibrated off is drawn as "off", never as acceptance
0.00; the held-out acceptance the calibration measured stands beside eval's; labels of coincident points do not
pile up. Reads the plotted data back from the figures."""
from __future__ import annotations

import pytest

from eval import plots

METRICS = {
    "temperature": 0.7,
    "domains": {
        "code": {"speculative": {"acceptance_rate": 0.41, "speedup": 1.12, "speedup_ci95": [1.05, 1.19]},
                 "speculative_init": {"off": True, "acceptance_rate": 0.0, "speedup": 1.0}},
        "chat": {"speculative": {"off": True, "acceptance_rate": 0.0, "speedup": 1.0, "speedup_ci95": [1.0, 1.0]},
                 "speculative_init": {"off": True, "acceptance_rate": 0.0, "speedup": 1.0}},
        "qa": {"speculative": {"off": True, "acceptance_rate": 0.0, "speedup": 1.0, "speedup_ci95": [1.0, 1.0]},
               "speculative_init": {"acceptance_rate": 0.08, "speedup": 0.97}},
    },
    "heldout_acceptance": {"speculative": {"code": 0.38, "chat": 0.22, "qa": 0.25},
                           "speculative_init": {"code": 0.06, "chat": 0.05, "qa": 0.07}},
    "predicted": {"code": {"speedup": 1.10, "speculate": True}, "chat": {"speedup": 1.0, "speculate": False},
                  "qa": {"speedup": 1.0, "speculate": False}},
}


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots draw, kept open for reading."""
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path.name)
    return drawn


def test_off_domains_draw_no_bar_but_the_word_off(tmp_path, figures):
    plots.acceptance_by_domain(METRICS, tmp_path / "a.png")
    ax = figures[0].axes[0]
    # the two domains that drafted, and no domain calibrated off drawn as acceptance 0.00
    assert sorted(round(p.get_height(), 3) for p in ax.patches) == [0.08, 0.41]
    offs = [t for t in ax.texts if t.get_text() == "off"]
    assert len(offs) == 4  # tuned: chat, qa; undistilled: code, chat — as the table's "off"


def test_the_calibrations_heldout_acceptance_stands_beside_evals(tmp_path, figures):
    plots.acceptance_by_domain(METRICS, tmp_path / "a.png")
    lines = {line.get_label(): sorted(round(v, 3) for v in line.get_ydata()) for line in figures[0].axes[0].lines}
    assert lines["evaluated draft (held-out, calibration)"] == [0.22, 0.25, 0.38]
    assert lines["undistilled draft (held-out, calibration)"] == [0.05, 0.06, 0.07]


def test_coincident_points_share_one_label(tmp_path, figures):
    plots.predicted_vs_measured(METRICS, tmp_path / "p.png")
    labels = [t.get_text() for t in figures[0].axes[0].texts]
    assert sorted(labels) == ["chat (off), qa (off)", "code"]
