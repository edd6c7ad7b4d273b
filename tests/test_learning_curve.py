"""Learning curves: nested train subsets (distill.split.train_fraction) and the report built from draft exports."""
from __future__ import annotations

import json

import pytest

from pipeline.control.split import nested_subset
from pipeline.tools.learning_curve import doubling_gains
from pipeline.tools.__main__ import main as tools_main
from pipeline.sampling import Sampling
from pipeline.decoding.spec import SpeculativeSpec


def tool(subcommand: str, drafts: list, out) -> int:
    """`python -m pipeline.tools <subcommand> tool.drafts=[...] tool.out=<out>`, in process: its exit code."""
    return tools_main([subcommand, f"tool.drafts=[{','.join(repr(str(d)) for d in drafts)}]", f"tool.out='{out}'"])


def main(argv: list) -> int:  # the learning curve's old argument shape, kept so the tests read as before
    return tool("learning-curve", argv[:-2], argv[-1])


def test_nested_subsets_keep_every_domain_and_grow_by_inclusion():
    prompt_ids = [f"{d}-{i}" for d in ("chat", "code") for i in range(20) for _ in range(2)]  # 2 rows per prompt
    domains = [p.split("-")[0] for p in prompt_ids]
    subsets = {f: set(nested_subset(prompt_ids, domains, f, seed=0)) for f in (0.1, 0.25, 0.5, 1.0)}
    assert subsets[0.1] < subsets[0.25] < subsets[0.5] < subsets[1.0] == set(range(len(prompt_ids)))
    for f, rows in subsets.items():
        kept = {prompt_ids[i] for i in rows}
        assert {p.split("-")[0] for p in kept} == {"chat", "code"}
        assert len([p for p in kept if p.startswith("chat")]) == max(1, round(f * 20))
        assert all(i + 1 in rows for i in rows if i % 2 == 0)  # both rows of a prompt, or neither
    assert set(nested_subset(prompt_ids, domains, 0.5, seed=1)) != subsets[0.5]  # the order follows the seed


def _export(path, data_tokens: int, after: dict, curve: list[dict]):
    spec = SpeculativeSpec(target={"path": "t"}, sampling=Sampling(0.7), draft={"init": "derive"},
                           acceptance={"before": {"chat": 0.1, "overall": 0.1}, "after": after,
                                       "after_training": after},
                           predicted_speedup={"default": 1.0 + after["overall"]},
                           training={"data_tokens": data_tokens, "train_fraction": data_tokens / 8000,
                                     "train_tokens": 3 * data_tokens, "minutes": 2.0},
                           learning_curve=curve)
    path.mkdir()
    spec.write(path)
    return str(path)


def test_report_from_exports_of_nested_runs(tmp_path):
    curve = [{"step": 10, "train_tokens": 500, "train_minutes": 0.5, "acceptance": 0.2, "by_domain": {"chat": 0.2}},
             {"step": 20, "train_tokens": 1000, "train_minutes": 1.0, "acceptance": 0.3, "by_domain": {"chat": 0.3}}]
    dirs = [_export(tmp_path / f"share-{n}", n, {"chat": a, "overall": a}, curve)
            for n, a in ((4000, 0.35), (1000, 0.2), (2000, 0.3), (8000, 0.36))]
    assert main([*dirs, "--out", str(tmp_path / "report")]) == 0
    data = json.loads((tmp_path / "report" / "learning_curve.json").read_text())
    assert [p["data_tokens"] for p in data["runs"]] == [1000, 2000, 4000, 8000]  # sorted by data size
    gains = [g["gain_per_doubling"]["overall"] for g in data["gains"]]
    assert gains == pytest.approx([0.1, 0.05, 0.01])  # the curve flattens
    assert (tmp_path / "report" / "learning_curve.png").stat().st_size > 1000
    md = (tmp_path / "report" / "learning_curve.md").read_text()
    assert "| 8,000 |" in md and "+0.010" in md and "During training (share-1000)" in md
    assert data["tokens_needed"]["overall"]["gain_per_doubling"] > 0


def report_beside_collect(tmp_path, drafts: list) -> dict:
    """learning-curve over `drafts` with paths.collect at a collect whose target rows cost 0.3 CPU-s a token: its json."""
    collect = tmp_path / "collect"
    collect.mkdir()
    (collect / "manifest.json").write_text(json.dumps({"label_cost": {"target": {"tokens": 1000, "cpu_s": 300.0}}}))
    listed = ",".join(f"'{d}'" for d in drafts)
    assert tools_main(["learning-curve", f"tool.drafts=[{listed}]", f"tool.out='{tmp_path / 'out'}'",
                       f"paths.collect='{collect}'"]) == 0
    return json.loads((tmp_path / "out" / "learning_curve.json").read_text())


def test_a_trained_directory_is_a_point_and_tokens_are_priced_in_label_cpu_minutes(tmp_path):
    # a distill stage's ${paths.trained} (no calibration) beside a collect whose target rows cost 0.3 CPU-s a token
    curve = [{"step": 10, "train_tokens": 1500, "train_minutes": 0.5, "acceptance": 0.2, "by_domain": {"chat": 0.2}},
             {"step": 20, "train_tokens": 3000, "train_minutes": 1.0, "acceptance": 0.25, "by_domain": {"chat": 0.25}}]
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "training.json").write_text(json.dumps({
        "version": 1, "after_training": {"chat": 0.25, "overall": 0.25}, "learning_curve": curve,
        "training": {"data_tokens": 2000, "train_fraction": 1.0, "train_tokens": 3000, "minutes": 1.0}}))
    data = report_beside_collect(tmp_path, [trained])
    assert data["label_cpu_s_per_token"] == pytest.approx(0.3)
    assert data["runs"][0]["label_cpu_minutes"] == pytest.approx(2000 * 0.3 / 60)  # the train rows' distinct tokens
    # in-run: distinct tokens seen, capped at the data once epochs repeat it (wrong variant: 3000 seen tokens priced)
    assert [c["label_cpu_minutes"] for c in data["in_run"]["run"]] == pytest.approx([1500 * 0.3 / 60, 2000 * 0.3 / 60])
    assert data["runs"][0]["acceptance"]["overall"] == 0.25


def test_doubling_gains_skip_runs_without_more_data():
    points = [{"data_tokens": 100, "acceptance": {"overall": 0.1}}, {"data_tokens": 100, "acceptance": {"overall": 0.2}}]
    assert doubling_gains(points) == []


def test_a_directory_without_an_export_is_one_clear_error(tmp_path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no speculative.json" in err


def test_tokens_needed_solves_the_log_line_through_the_last_runs():
    from pipeline.tools.learning_curve import tokens_needed

    points = [{"data_tokens": n, "acceptance": {"chat": a, "flat": 0.2}}
              for n, a in ((1000, 0.05), (2000, 0.2), (4000, 0.25), (8000, 0.3))]  # the first run is left out of the fit
    needed = tokens_needed(points, targets=(0.2, 0.3, 0.4, 0.6))
    assert needed["chat"]["gain_per_doubling"] == pytest.approx(0.05)
    chat = needed["chat"]["tokens"]
    assert chat["0.2"] == {"tokens": 2000, "how": "measured"} and chat["0.3"] == {"tokens": 8000, "how": "measured"}
    assert chat["0.4"] == {"tokens": 32000, "how": "extrapolated"}
    assert chat["0.6"]["how"] == "out of reach"  # 2^6 = 64 times the data: past what a log-line can tell
    assert needed["flat"]["tokens"]["0.3"] == {"tokens": None, "how": "out of reach"}  # a curve that does not rise


def test_a_failure_while_writing_leaves_nothing_half_written(tmp_path, monkeypatch):
    import pipeline.tools.learning_curve as lc

    curve = [{"step": 10, "train_tokens": 500, "train_minutes": 0.5, "acceptance": 0.2, "by_domain": {"chat": 0.2}}]
    dirs = [_export(tmp_path / f"share-{n}", n, {"chat": a, "overall": a}, curve) for n, a in ((1000, 0.2), (2000, 0.3))]
    out = tmp_path / "report"
    out.mkdir()
    (out / "learning_curve.md").write_text("an earlier report")

    def failing_plot(points, curves, path):
        path.write_bytes(b"\x89PNG half")  # a partial file, then the crash
        raise RuntimeError("disk full")

    monkeypatch.setattr(lc, "plot", failing_plot)
    with pytest.raises(RuntimeError, match="disk full"):
        main([*dirs, "--out", str(out)])
    assert [p.name for p in out.iterdir()] == ["learning_curve.md"] and (out / "learning_curve.md").read_text() == "an earlier report"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.tmp")]  # the staging directory is gone


def test_label_cpu_is_priced_at_the_collects_mix_of_sources(tmp_path):
    """Text rows at a tenth of a generated token's cost make the mix's rate (1000 x 0.3 + 1000 x 0.03) / 2000; the
    wrong variant, the target rows' rate alone, would be 0.3."""
    from pipeline.tools.learning_curve import label_rate

    (tmp_path / "manifest.json").write_text(json.dumps({"label_cost": {
        "target": {"tokens": 1000, "cpu_s": 300.0}, "text": {"tokens": 1000, "cpu_s": 30.0},
        "old": {"tokens": 50}}}))  # an origin without a recorded cost is left out, not priced at zero
    assert label_rate(str(tmp_path)) == pytest.approx(0.165)
    assert label_rate(str(tmp_path / "none")) is None


# ---------------------------------------------------------------- sizing by the window
def _candidate(path, draft: dict, c: float, data_tokens: int, alpha: float, subset=None):
    spec = SpeculativeSpec(target={"path": "t"}, sampling=Sampling(0.7), draft=draft, vocab_subset=subset,
                           acceptance={"after": {"overall": alpha}, "after_training": {"overall": alpha}},
                           predicted_speedup={"overall": 1.0}, cost={"c": c},
                           training={"data_tokens": data_tokens, "train_fraction": 1.0, "train_tokens": data_tokens,
                                     "minutes": 1.0})
    path.mkdir()
    spec.write(path)
    return str(path)


def test_the_chain_speedup_is_the_best_fixed_gamma_by_hand():
    from pipeline.tools.learning_curve import chain_speedup

    # c = 0.1, free verification: γ=1 (1 + .5)/1.1 = 1.3636; γ=2 (1 + .75)/1.2 = 1.4583; γ=3 (1 + .875)/1.3 = 1.4423
    assert chain_speedup(0.5, {"c": 0.1}) == pytest.approx(1.75 / 1.2)
    assert chain_speedup(0.0, {"c": 0.1}) == 1.0  # no γ pays: plain decoding


def test_the_sizing_projects_each_draft_on_its_own_curve_and_finds_the_tokens_to_pass_the_reference(tmp_path):
    from pipeline.tools.learning_curve import chain_speedup, load_exports, sizing

    published = _candidate(tmp_path / "published", {"init": "pretrained"}, 0.30, 20000, 0.75)
    shallow = [_candidate(tmp_path / f"shallow-{n}", {"init": "pretrained", "keep_layers": [0, 1, 2]}, 0.10, n, a,
                          subset=list(range(64))) for n, a in ((10000, 0.40), (20000, 0.45))]
    rows = sizing(load_exports([published, *shallow]))
    assert [r["candidate"] for r in rows] == ["pretrained (all layers), full head",
                                              "pretrained [0, 1, 2], head 64"]
    ref, cand = rows
    # its own two runs only: the published draft's point (0.75 at 20k) would bend a mixed curve
    assert cand["gain_per_doubling"] == pytest.approx(0.05) and cand["runs"] == 2
    assert cand["projected_acceptance"] == pytest.approx({1: 0.50, 2: 0.55})
    assert cand["chain_speedup"] == pytest.approx(chain_speedup(0.45, {"c": 0.10}))
    bar = chain_speedup(0.75, {"c": 0.30})
    assert ref["chain_speedup"] == pytest.approx(bar)
    tokens = cand["tokens_to_pass_reference"]
    assert tokens is not None and tokens > 20000
    doublings = round(10 * __import__("math").log2(tokens / 20000)) / 10
    assert chain_speedup(0.45 + 0.05 * doublings, {"c": 0.10}) >= bar  # passes there ...
    assert chain_speedup(0.45 + 0.05 * (doublings - 0.1), {"c": 0.10}) < bar  # ... and not a tenth of a doubling before


def test_a_calibrated_published_draft_is_a_sizing_reference_and_an_uncalibrated_one_is_refused(tmp_path, capsys):
    from dataclasses import replace

    published = tmp_path / "published"
    published.mkdir()
    SpeculativeSpec(target={"path": "t"}, sampling=Sampling(0.7), draft={"init": "pretrained"}, distilled=False,
                    acceptance={"before": {"overall": 0.75}, "after": {"overall": 0.75}}, cost={"c": 0.30},
                    predicted_speedup={"overall": 1.4}).write(published)
    shallow = _candidate(tmp_path / "shallow", {"init": "derive", "layers": [0, 1]}, 0.10, 20000, 0.40)
    assert tool("learning-curve", [str(published), shallow], tmp_path / "report") == 0
    data = json.loads((tmp_path / "report" / "learning_curve.json").read_text())
    assert [r["acceptance"] for r in data["sizing"]] == [0.75, 0.40]  # the reference: its calibrated acceptance
    assert [p["data_tokens"] for p in data["runs"]] == [20000]  # no training: no point of the data-size curve
    spec = SpeculativeSpec.read(published)
    replace(spec, cost={}).write(published)  # the wrong variant: nothing to price it with
    assert tool("learning-curve", [str(published), shallow], tmp_path / "report2") == 2
    assert "undistilled export with no calibration" in capsys.readouterr().err


def test_the_report_of_several_drafts_carries_the_sizing_table(tmp_path):
    published = _candidate(tmp_path / "published", {"init": "pretrained"}, 0.30, 20000, 0.70)
    shallow = _candidate(tmp_path / "shallow", {"init": "derive", "layers": [0, 1]}, 0.10, 20000, 0.40)
    assert tool("learning-curve", [published, shallow], tmp_path / "report") == 0
    data = json.loads((tmp_path / "report" / "learning_curve.json").read_text())
    assert [r["candidate"] for r in data["sizing"]] == ["pretrained (all layers), full head", "derive [0, 1], full head"]
    assert data["gains"] == [] and data["tokens_needed"] == {}  # no curve drawn through two different drafts
    md = (tmp_path / "report" / "learning_curve.md").read_text()
    assert "Sizing by the window" in md and "| derive [0, 1], full head | 0.100 | 1 | 20,000 | 0.400 |" in md
    assert "no curve (one run)" in md


def test_each_export_is_priced_at_its_own_label_mix_and_its_curve_at_labels_plus_training(tmp_path):
    # two trained directories: one on generated rows only, one on text rows too (cheaper labels), each recording what
    # its rows' labels cost and its training CPU per point; the collect named in paths.collect is not theirs
    def trained(name, label_cpu_s, cpu_points):
        curve = [{"step": 10 * (i + 1), "train_tokens": 1000 * (i + 1), "train_minutes": 0.5 * (i + 1),
                  "train_cpu_s": cpu, "acceptance": 0.2 + 0.05 * i, "by_domain": {"chat": 0.2 + 0.05 * i}}
                 for i, cpu in enumerate(cpu_points)]
        path = tmp_path / name
        path.mkdir()
        (path / "training.json").write_text(json.dumps({
            "version": 1, "after_training": {"chat": curve[-1]["acceptance"], "overall": curve[-1]["acceptance"]},
            "learning_curve": curve, "training": {"data_tokens": 2000, "train_fraction": 1.0, "train_tokens": 2000,
                                                  "minutes": 1.0, "label_cpu_s": label_cpu_s,
                                                  "train_cpu_s": cpu_points[-1]}}))
        return path

    generated, text = trained("generated", 600.0, [60.0, 120.0]), trained("text", 60.0, [30.0, 90.0])
    data = report_beside_collect(tmp_path, [generated, text])
    by_source = {p["source"]: p for p in data["runs"]}
    # the record's own cost, not the named collect's rate (wrong variant: 2000 tokens x 0.3 = 10 CPU-min for both)
    assert by_source[str(generated)]["label_cpu_minutes"] == pytest.approx(10.0)
    assert by_source[str(text)]["label_cpu_minutes"] == pytest.approx(1.0)
    assert by_source[str(text)]["cpu_minutes"] == pytest.approx((60 + 90) / 60)
    # every in-run point carries all the labels (paid before the first step) plus the training CPU so far
    assert [c["cpu_minutes"] for c in data["in_run"]["text"]] == pytest.approx([90 / 60, 150 / 60])
    assert [c["cpu_minutes"] for c in data["in_run"]["generated"]] == pytest.approx([660 / 60, 720 / 60])
    assert "label + training CPU-min" in (tmp_path / "out" / "learning_curve.md").read_text()


def test_runs_whose_folders_share_a_name_are_told_apart_by_their_parents(tmp_path):
    curve = [{"step": 10, "train_tokens": 500, "train_minutes": 0.5, "acceptance": 0.2, "by_domain": {"chat": 0.2}}]
    for run in ("run1", "run2"):
        (tmp_path / run).mkdir()
    dirs = [_export(tmp_path / run / "trained", n, {"chat": 0.2, "overall": 0.2}, curve)
            for run, n in (("run1", 1000), ("run2", 2000))]
    assert main([*dirs, "--out", str(tmp_path / "report")]) == 0
    data = json.loads((tmp_path / "report" / "learning_curve.json").read_text())
    assert set(data["in_run"]) == {"run1/trained", "run2/trained"}  # wrong variant: one curve "trained" for both


def test_the_label_cpu_of_the_rows_trained_on_counts_each_origin_at_its_rate():
    from datasets import Dataset

    from distill.stage import label_cpu_seconds

    rows = Dataset.from_dict({"origin": ["target", "text", "target", "text"],
                              "completion_ids": [[1] * 10, [2] * 100, [3] * 30, [4] * 50]})
    manifest = {"label_cost": {"target": {"tokens": 40, "cpu_s": 20.0}, "text": {"tokens": 150, "cpu_s": 3.0}}}
    assert label_cpu_seconds(rows, [0, 1], manifest) == pytest.approx(10 * 0.5 + 100 * 0.02)
    assert label_cpu_seconds(rows, [1, 3], manifest) == pytest.approx(150 * 0.02)  # held-out rows not passed: not counted
    assert label_cpu_seconds(rows, [0, 1], {"label_cost": {"target": {"tokens": 40, "cpu_s": 20.0}}}) is None
