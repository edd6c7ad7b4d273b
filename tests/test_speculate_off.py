""""Off" is a calibrated answer: where no drafting is predicted faster than plain decoding by the margin,
distill ships plain decoding for the domain (speculative.json recipe `drafting: "off"`), and says so in the model
card."""
from __future__ import annotations

import json

from tests.conftest import read_spec, run_distill_stage


def speculates(spec: dict) -> dict[str, bool]:
    return {domain: recipe["drafting"] != "off" for domain, recipe in spec["recipes"].items()}


def test_a_draft_as_slow_as_the_target_is_calibrated_off_in_every_domain(setup, distilled, tmp_path):
    from pipeline.measure.cost_profile import read_profile, write_profile

    measured = read_profile(distilled[2] / "draft" / "cost_profile.json")
    slow = json.loads(json.dumps(measured))
    step = measured["target"][str(min(map(int, measured["target"])))]["1"]["ms"]
    slow["draft"]["ms"] = step * 1.5  # c = 1.5: a pass costs more than the 2 tokens it can yield at γ = 1
    write_profile(tmp_path / "slow.json", slow)
    run_distill_stage(setup, tmp_path / "out", f"calibrate.cost.profile={tmp_path / 'slow.json'}")
    spec = read_spec(tmp_path / "out" / "draft")
    assert speculates(spec) and not any(speculates(spec).values()), spec["recipes"]
    assert all(v < 1.0 for v in spec["predicted_speedup"].values())  # the if-on prediction, kept for the record
    card = (tmp_path / "out" / "draft" / "README.md").read_text()
    assert "off (plain decoding)" in card and "without assistant_model" in card
    # the fast device's calibration of the same data speculates where it is predicted to pay by the margin
    fast = read_spec(distilled[2] / "draft")
    assert set(speculates(fast)) == set(speculates(spec))
    predicted = {("default" if d == "overall" else d): v for d, v in fast["predicted_speedup"].items()}
    assert all(on for d, on in speculates(fast).items() if predicted[d] > 1.2)
