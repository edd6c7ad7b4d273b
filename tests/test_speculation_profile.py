"""speculation_profile.json (pipeline/measure/speculation_profile.py): calibrate's per-position rates are the held-out
simulator's own (distill/simulator.py), eval's are its decoder's counts, both in one shape; the file round-trips;
its marginals reproduce the mean accepted length the report gives within their interval, and conditional rates
read as marginals do not; docs/architecture.md names exactly the fields the builder writes."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from distill import simulator as sim
from distill.calibrate_stage import profile_sections
from eval import metrics as M
from pipeline.measure import speculation_profile as sp
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from tests.conftest import REPO

GAMMA, K = 4, 8


def heldout(rows_per_domain: int = 40, length: int = 30, seed: int = 0) -> tuple[sim.HeldOut, torch.Tensor]:
    """Held-out rows of two domains with per-position α (chat easier than code) and bursts of easy stretches."""
    g = torch.Generator().manual_seed(seed)
    domains = ["chat"] * rows_per_domain + ["code"] * rows_per_domain
    row_of = torch.arange(len(domains)).repeat_interleave(length)
    level = torch.tensor([0.8 if d == "chat" else 0.5 for d in domains])[row_of]
    alpha = (level + 0.3 * (torch.rand(len(row_of), generator=g) - 0.5)).clamp(0, 1)
    n = len(row_of)
    held = sim.HeldOut([{}] * len(domains), domains, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1),
                       torch.zeros(n), row_of, Sampling(), 1, 0)
    return held, alpha


def profile_of(held: sim.HeldOut, alpha: torch.Tensor) -> tuple[dict, dict]:
    """(the profile calibrate writes, the evidence's mean_accepted_length) for the same rows."""
    summary = sim.summarize(alpha, held, GAMMA, K)
    reported = {"gamma": GAMMA, **{d: s["mean_accepted_length"] for d, s in summary.items()}}
    profile = sp.build(profile_sections(alpha, held, K), sim.OVERALL, {"source": sp.HELDOUT},
                       target={"name": "t"}, draft={"name": "d"}, reported=reported)
    return profile, reported


def sections_of(profile: dict) -> dict[str, dict]:
    return {sim.OVERALL: profile, **profile["per_category"]}


def test_the_marginals_are_calibrates_per_position_acceptance():
    held, alpha = heldout()
    summary = sim.summarize(alpha, held, GAMMA, K)
    for name, rates in sections_of(profile_of(held, alpha)[0]).items():
        assert rates["marginal_accept_rates"] == pytest.approx(summary[name]["per_position_acceptance"], abs=1e-6)
        assert rates["num_speculative_tokens"] == K and rates["n_units"] == (80 if name == sim.OVERALL else 40)


def test_a_constant_acceptance_gives_its_powers_as_marginals_and_itself_as_every_conditional():
    held, alpha = heldout()
    rates = profile_sections(torch.full_like(alpha, 0.6), held, K)[sim.OVERALL]
    assert rates["marginal_accept_rates"] == pytest.approx([0.6 ** k for k in range(1, K + 1)], abs=1e-6)
    assert rates["conditional_accept_rates"] == pytest.approx([0.6] * K, abs=1e-6)


def test_the_per_position_rates_reproduce_the_reported_mean_accepted_length_within_their_interval(tmp_path):
    held, alpha = heldout()
    profile, reported = profile_of(held, alpha)
    back = sp.read(sp.write(tmp_path, profile).parent)
    for name, rates in sections_of(back).items():
        assert back["validation"]["mean_consistency"][name]["passed"], name
        assert sp.consistency(rates, reported[name], GAMMA)["passed"], name


def test_conditional_rates_read_as_marginals_miss_the_reported_mean_accepted_length():
    held, alpha = heldout()
    profile, reported = profile_of(held, alpha)
    for name, rates in sections_of(profile).items():
        wrong = rates | {"marginal_accept_rates": rates["conditional_accept_rates"]}
        assert not sp.consistency(wrong, reported[name], GAMMA)["passed"], name


def test_the_interval_holds_the_estimate_and_narrows_with_more_rows():
    few = profile_sections(*reversed(heldout(10)), K)[sim.OVERALL]
    many = profile_sections(*reversed(heldout(160)), K)[sim.OVERALL]
    for rates in (few, many):
        for (lo, hi), point in zip(rates["marginal_accept_rates_ci95"], rates["marginal_accept_rates"]):
            assert lo <= point <= hi
    width = [hi - lo for lo, hi in few["marginal_accept_rates_ci95"]]
    assert all(w2 < w1 for w1, w2 in zip(width, [hi - lo for lo, hi in many["marginal_accept_rates_ci95"]]))


def test_the_profile_round_trips_through_its_file(tmp_path):
    profile = profile_of(*heldout())[0]
    assert sp.read(sp.write(tmp_path, profile).parent) == json.loads(json.dumps(profile))
    assert sp.read(tmp_path / "none") is None  # an export from before the profile


@pytest.mark.parametrize("change, message", [
    (lambda p: p | {"schema_version": "0.9"}, "schema_version '0.9'"),
    (lambda p: {k: v for k, v in p.items() if k != "n_units"}, "lacks"),
    (lambda p: p | {"per_category": {"chat": {"n_units": 3}}}, "chat lacks"),
    (lambda p: p | {"conditional_accept_rates": p["conditional_accept_rates"][:-1]}, "another length"),
])
def test_a_malformed_profile_is_refused_in_one_line(tmp_path, change, message):
    (tmp_path / sp.FILENAME).write_text(json.dumps(change(profile_of(*heldout())[0])))
    with pytest.raises(PipelineError, match=message) as error:
        sp.read(tmp_path)
    assert "\n" not in str(error.value)


def test_rising_marginals_are_flagged_not_hidden():
    profile = profile_of(*heldout())[0]
    assert all(v["passed"] for v in profile["validation"]["marginal_monotonicity"].values())
    rising = profile | {"marginal_accept_rates": [0.5, 0.6, 0.2]}
    assert sp.monotonicity(rising) == {"passed": False, "rising_positions": [2]}


def decode(*passes: tuple[int, int]) -> SimpleNamespace:
    """A decode's stats: (drafted, accepted) per verify pass."""
    return SimpleNamespace(drafted=[d for d, _ in passes], accepted=[a for _, a in passes])


def test_evals_measured_section_counts_what_the_decoder_accepted_in_the_same_shape():
    passes = [(3, 3), (3, 1), (3, 0), (3, 2)]
    records = [{"method": M.SPECULATIVE, "domain": "chat", "stats": decode(*passes[:2])},
               {"method": M.SPECULATIVE, "domain": "code", "stats": decode(*passes[2:])},
               {"method": M.AUTOREGRESSIVE, "domain": "chat", "stats": decode()}]
    measured = M.measured_profile(records, {"temperature": 0.0})
    assert measured["marginal_accept_rates"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert measured["conditional_accept_rates"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert measured["mean_accept_length"] == pytest.approx(sum(a + 1 for _, a in passes) / len(passes))
    assert measured["per_category"]["chat"]["marginal_accept_rates"] == pytest.approx([1.0, 0.5, 0.5])
    assert measured["marginal_accept_rates"] == pytest.approx(M.per_position_acceptance([r["stats"] for r in records]))
    assert measured["measurement_conditions"]["source"] == sp.MEASURED
    assert set(measured) == set(profile_of(*heldout())[0])  # one schema
    assert "mean_consistency" not in measured["validation"]  # eval's own mean counts the prefill pass: none given
    assert M.measured_profile(records[2:], {}) is None  # the tuned draft did not run


def documented(text: str) -> set[str]:
    """The keys of the table under `| profile key | meaning |` in docs/architecture.md."""
    lines = text.split("\n")
    start = lines.index("| profile key | meaning |") + 2
    keys = set()
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        keys |= set(re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0]))
    return keys


def written() -> set[str]:
    return set(profile_of(*heldout())[0]) | set(sp.SECTION_KEYS)


def test_the_architecture_doc_names_exactly_the_fields_the_profile_has():
    assert documented((REPO / "docs" / "architecture.md").read_text()) == written()


def test_the_doc_check_sees_a_missing_field():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert documented(text.replace("| `n_units` |", "| `n_rows` |")) != written()
