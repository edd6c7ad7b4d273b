"""llama.cpp as a serving engine, for real: built from the pinned sdist (cached under artifacts/engines, a few
minutes on 2 cores the first time), its converter and quantizer on a draft, llama-server on 127.0.0.1 giving the
same greedy tokens with and without the draft, llama-bench costs, and one-line errors."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from tests.conftest import LLAMACPP, REPO, SERVER


@pytest.fixture(scope="session")
def gguf_pair(llamacpp_build, real_target, tmp_path_factory):
    """The embedded target's packaged GGUF and a two-layer derived draft exported with an FR-Spec head,
    converted and quantised by llama.cpp to the target's family."""
    from omegaconf import OmegaConf

    from pipeline.modelio.draft_init import build_draft
    from distill.engines import draft_gguf
    from pipeline.engines import llamacpp
    from pipeline.heads import bake_subset
    from pipeline.modelio.models import model_gguf

    spec = OmegaConf.load(REPO / "conf/model/smollm2-135m.yaml").target
    target_gguf = model_gguf(spec, "target", {"models": REPO / "artifacts/models", "cache": REPO / "artifacts/cache"})
    model, tokenizer = real_target
    draft, draft_tokenizer, _ = build_draft({"init": "derive", "derive": {"layers": [0, 1]}}, model, tokenizer, {})
    bake_subset(draft, torch.arange(4096))
    out = tmp_path_factory.mktemp("gguf") / "draft.gguf"
    kind = llamacpp.gguf_file_type(target_gguf)
    return target_gguf, draft_gguf(llamacpp_build, draft, draft_tokenizer, out, kind), kind, tokenizer


@pytest.mark.smoke
def test_the_draft_converts_to_the_targets_quantisation_family(gguf_pair):
    from pipeline.engines import llamacpp

    target_gguf, draft, kind, _ = gguf_pair
    assert kind == "Q4_1" and llamacpp.gguf_file_type(draft) == kind


@pytest.mark.smoke
def test_llama_server_with_the_draft_gives_the_plain_servers_greedy_tokens(llamacpp_build, gguf_pair, tmp_path):
    from pipeline.modelio.chat import encode_chat, stop_token_ids
    from pipeline.engines import llamacpp

    target_gguf, draft, _, tokenizer = gguf_pair
    ids = encode_chat(tokenizer, [{"role": "user", "content": "Name three prime numbers."}])[0].tolist()
    stop = stop_token_ids(tokenizer)
    with llamacpp.Server(llamacpp_build, target_gguf, log_path=tmp_path / "plain.log", **SERVER) as plain:
        reference = plain.complete(ids, 24, Sampling(), 0, stop)
    settings = llamacpp.DraftSettings(n_max=4, p_min=0.0)
    with llamacpp.Server(llamacpp_build, target_gguf, draft, settings, log_path=tmp_path / "spec.log",
                         trace=True, **SERVER) as server:
        speculative = server.complete(ids, 24, Sampling(), 0, stop)
        again = server.complete(ids, 24, Sampling(), 0, stop)  # the next request's passes are its own
        process = server.process
    assert process.poll() is not None  # stopped with the context
    assert "127.0.0.1" in server.url
    assert speculative["tokens"] == reference["tokens"] and len(reference["tokens"]) > 0
    timings = speculative["timings"]
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert "draft_n" not in reference["timings"]
    # per verify pass (LLAMA_TRACE): they add up to the response's counters (complete() checks) and never exceed n_max
    passes = speculative["passes"]
    assert passes == again["passes"] and all(0 <= a <= d <= 4 for a, d in passes) and max(d for _, d in passes) == 4
    with pytest.raises(PipelineError, match="disagrees with its response"):  # a log read at the wrong place
        server.passes_logged(0, {"draft_n": timings["draft_n"] + 1, "draft_n_accepted": timings["draft_n_accepted"]})


@pytest.mark.smoke
def test_llama_bench_prices_longer_forwards_no_cheaper_than_a_step(llamacpp_build, gguf_pair):
    from distill.engines import engine_cost

    target_gguf, draft, _, _ = gguf_pair
    cost = engine_cost(llamacpp_build, target_gguf, draft, max_draft=3, depth=32, repeats=2, threads=None)
    assert set(cost["verify_ratio"]) == {1, 2, 3} and cost["c"] > 0
    assert cost["target_forward_ms"] > 0 and cost["draft_forward_ms"] > 0


@pytest.mark.smoke
def test_llama_servers_own_work_per_pass_is_timed_from_its_timings_and_priced(llamacpp_build, gguf_pair):
    from distill.engines import HOST_SETTINGS, engine_cost, server_host
    from pipeline.modelio.chat import encode_chat
    from pipeline.decoding.cost import host_cost, pass_speedup

    target_gguf, draft, _, tokenizer = gguf_pair
    cost = engine_cost(llamacpp_build, target_gguf, draft, max_draft=4, depth=32, repeats=2, threads=None)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}])[0].tolist()
               for text in ("Name three prime numbers.", "Say hello in French.")]
    host = server_host(llamacpp_build, target_gguf, draft, prompts, cost, OmegaConf.merge(LLAMACPP, {"threads": None}))
    drafted = sorted(float(n) for n in host["chain"])
    assert len(drafted) == len(HOST_SETTINGS) and 0 < drafted[0] <= 1.0 < drafted[1] <= 4.0  # n_max 1 and 4
    assert host["plain"] >= 0 and all(h >= 0 for h in host["chain"].values())
    priced = {**cost, "host": host}
    h0, h1 = host_cost(host, drafted[0])
    # (1 + A)(1 + h_0) / (D·c + r(D) + h(D)), r interpolated from r_0 = 1 at a fractional D
    expected = 1.5 * (1 + h0) / (drafted[0] * cost["c"] + 1 + (cost["verify_ratio"][1] - 1) * drafted[0] + h1)
    assert pass_speedup(0.5, drafted[0], drafted[0], priced) == pytest.approx(expected)


def test_a_server_that_cannot_start_is_one_line_naming_the_log(llamacpp_build, tmp_path):
    from pipeline.engines import llamacpp

    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(PipelineError, match="llama-server exited at start") as info:
        with llamacpp.Server(llamacpp_build, bad, log_path=tmp_path / "server.log", **(SERVER | {"start_timeout": 60})):
            pass
    assert "\n" not in str(info.value) and str(tmp_path / "server.log") in str(info.value)


def test_llamacpps_stop_before_rule_drafts_only_sure_tokens():
    """llama.cpp stops before an unsure token (κ of the token itself), HF after it (κ of the token before)."""
    from distill.simulator import HeldOut
    from distill.policy import pass_profile, simulate

    n = 6
    heldout = HeldOut([{}], ["d"], torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), torch.zeros(n),
                      torch.zeros(n, dtype=torch.long), Sampling(), 1, 0)
    everywhere = torch.ones(n, dtype=torch.bool)
    alpha = torch.ones(n)  # every drafted token accepted
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # sure, unsure, sure, sure, unsure, sure
    drafted, _ = simulate(alpha, keep, heldout, everywhere, 3, stop_before=True, renewal=False)
    # blocks from t = 0..5 (positions past the end are sure and cost drafts): 1, 0, 2, 1, 0, 3
    assert drafted == pytest.approx((1 + 0 + 2 + 1 + 0 + 3) / 6)
    after, _ = simulate(alpha, keep, heldout, everywhere, 3, renewal=False)  # HF: the unsure token is still proposed
    assert after == pytest.approx((2 + 1 + 3 + 2 + 1 + 3) / 6)
    # the passes the decoder runs start at 0, 2 (after 1 accepted + 1) and 5 (after 2 + 1): 1, 2 and 3 drafts
    visited, _ = simulate(alpha, keep, heldout, everywhere, 3, stop_before=True)
    assert visited == pytest.approx((1 + 2 + 3) / 3)
    # per position, what llama-server counts: those passes accept 1, 2 and 1 (past the end nothing is accepted)
    proposed, accepted = pass_profile(alpha, keep, heldout, everywhere, 3, stop_before=True)
    assert proposed == pytest.approx([1, 2 / 3, 1 / 3]) and accepted == pytest.approx([1, 1 / 3, 0])


@pytest.mark.smoke
def test_eval_inside_llama_cpp_routes_each_domain_as_calibrated_and_decodes_losslessly(llamacpp_build, real_target,
                                                                                      real_target_path, tmp_path):
    """eval.engine=llamacpp on the real target: a domain calibrated "off" is served by the plain server, one
    calibrated on by the draft server; greedy tokens equal the plain server's; speedups recompute from the records."""
    import json

    from hydra import compose, initialize_config_dir

    from pipeline.modelio.draft_init import build_draft
    from distill.export import ExportParts, save_draft
    from eval.stage import run
    from pipeline.decoding import DraftLength
    from pipeline.decoding.spec import Recipe, SpeculativeSpec
    from tests.conftest import RecordingTracker

    model, tokenizer = real_target
    draft, draft_tokenizer, info = build_draft({"init": "derive", "derive": {"layers": [0, 1]}}, model, tokenizer, {})
    on = {"speculate": True, "n_max": 2, "p_min": 0.0, "predicted_per_pass": {"proposed": [1, 1], "accepted": [.5, .2]}}
    spec = SpeculativeSpec({"name": "SmolLM2"}, Sampling(), info, list(range(4096)),
                           recipes={"default": Recipe(chain=DraftLength("fixed", 2))},
                           engines={"llamacpp": {"by_domain": {"code": on, "default": {**on, "speculate": False}}}})
    save_draft(draft, draft_tokenizer, tmp_path / "draft", model.generation_config, ExportParts(spec, "# card"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"{d}-{i}", "domain": d, "turns": [text]}) + "\n"
                               for i, (d, text) in enumerate([("code", "Write a Python function that adds two numbers."),
                                                              ("math", "What is 12 times 7?")])))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            f"paths.artifacts={tmp_path}", f"paths.models={REPO / 'artifacts/models'}",
            f"paths.cache={REPO / 'artifacts/cache'}", f"paths.engines={REPO / 'artifacts/engines'}",
            "tracking.enabled=false", "eval.engine=llamacpp", f"eval.draft={tmp_path / 'draft'}", "eval.draft_init=none",
            f"eval.prompts_file={prompts}", "eval.max_new_tokens=16", "eval.warmup_tokens=2", "eval.temperature=0.0"])
    run(cfg, RecordingTracker())
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["methods"] == ["autoregressive", "speculative", "speculative_defaults"]
    assert metrics["plan"]["speculative"]["math"]["draft"] is None  # off: the plain server answers
    assert metrics["plan"]["speculative"]["code"]["flags"] == ["--spec-draft-n-max", "2", "--spec-draft-p-min", "0"]
    records = [json.loads(line) for line in (tmp_path / "eval" / "requests.jsonl").read_text().splitlines()]
    by = {(r["method"], r["domain"]): r for r in records}
    assert by[("speculative", "math")]["drafted"] == 0 and by[("speculative", "code")]["drafted"] > 0
    code = metrics["domains"]["code"]["speculative"]["per_pass"]  # the per-pass log, beside the prediction
    assert code["predicted"] == on["predicted_per_pass"] and len(code["inside"]["accepted"]) == 2
    assert code["passes"] >= len(by[("speculative", "code")]["passes"]) > 0 and code["proposed"][0] == pytest.approx(
        len(by[("speculative", "code")]["passes"]) / code["passes"], abs=1e-6)  # n_max 2, p_min 0: every pass drafts
    assert metrics["domains"]["math"]["speculative"]["per_pass"] is None  # off: the plain server drafts nothing
    assert "Per draft position k" in (tmp_path / "eval" / "report.md").read_text()
    assert list(metrics["comparisons"]["overall"]) == ["speculative_vs_speculative_defaults"]  # drafts paired
    for domain in ("code", "math"):
        entry = metrics["domains"][domain]
        assert entry["speculative"]["greedy_match"] == 1.0
        plain, spec_ = by[("autoregressive", domain)], by[("speculative", domain)]
        expected = (spec_["n_tokens"] / spec_["time_s"]) / (plain["n_tokens"] / plain["time_s"])
        assert entry["speculative"]["speedup"] == pytest.approx(expected)


@pytest.mark.smoke
def test_a_server_that_dies_mid_eval_is_one_line_not_a_hang(llamacpp_build, gguf_pair, tmp_path):
    from pipeline.engines import llamacpp

    target_gguf, _, _, _ = gguf_pair
    with llamacpp.Server(llamacpp_build, target_gguf, log_path=tmp_path / "server.log", **SERVER) as server:
        server.process.kill()
        server.process.wait()
        with pytest.raises(PipelineError, match="llama-server died mid-request") as info:
            server.complete([1, 2, 3], 4, Sampling(), 0)
    assert "\n" not in str(info.value)


def test_per_pass_rates_count_passes_that_drafted_nothing_and_meet_the_prediction_for_the_setting_served():
    """eval.engine=llamacpp's per-position table: the share of decoding passes accepting at least k drafts, where a
    pass without drafts (p_min stopped before the first) is a plain step the log omits; and the prediction is the
    one made for the setting the server ran, never another's."""
    from types import SimpleNamespace

    from eval.engine_llamacpp import EngineStats, per_pass, predicted_per_pass
    from pipeline.engines.llamacpp import DraftSettings

    def record(passes, n_tokens):
        stats = EngineStats([a for a, _ in passes], [d for _, d in passes])
        return {"stats": stats, "tokens": [0] * n_tokens}

    # request 1: passes (2 of 2), (0 of 2), (1 of 1) and 2 plain steps: tokens = 1 + 3 + 1 + 2 + 1 + 1 = 9
    # request 2: one pass (2 of 2) and nothing else: tokens = 1 + 3 = 4
    records = [record([(2, 2), (0, 2), (1, 1)], 9), record([(2, 2)], 4)]
    predicted = {"proposed": [0.6, 0.5], "accepted": [0.5, 0.9]}
    out = per_pass(records, predicted)
    assert out["passes"] == 5 + 1 and out["requests"] == 2
    assert out["accepted"] == pytest.approx([3 / 6, 2 / 6], abs=1e-6)  # ≥ 1 accepted in 3 passes, ≥ 2 in 2
    assert out["proposed"] == pytest.approx([4 / 6, 3 / 6], abs=1e-6)
    lo, hi = out["accepted_ci95"][0]
    assert lo <= 0.5 <= hi and out["inside"]["accepted"] == [True, hi > 0.9]
    ignoring_plain_steps = 3 / 4  # the deliberately wrong denominator: logged passes only
    assert out["accepted"][0] != pytest.approx(ignoring_plain_steps)
    assert per_pass([record([], 5)], None) is None  # a plain server: nothing drafted, nothing to tabulate

    entry = {"speculate": True, "n_max": 2, "p_min": 0.5, "predicted_per_pass": predicted,
             "predicted_per_pass_server_defaults": {"proposed": [1, 1, 1], "accepted": [0.4, 0.2, 0.1]}}
    spec = SimpleNamespace(engines={"llamacpp": {"by_domain": {"default": entry}}})
    assert predicted_per_pass(spec, "code", DraftSettings(2, 0.5)) is predicted
    assert predicted_per_pass(spec, "code", DraftSettings()) is entry["predicted_per_pass_server_defaults"]
    assert predicted_per_pass(spec, "code", DraftSettings(3, 0.5)) is None  # not what was calibrated
    assert predicted_per_pass(None, "code", DraftSettings()) is None


def test_the_per_pass_prediction_has_an_interval_over_held_out_rows():
    """predicted_per_pass's rates are pass_profile's, with a bootstrap interval over rows: rows that disagree widen
    it, identical rows leave none, and a domain without rows predicts nothing rather than a rate."""
    from distill.simulator import HeldOut
    from distill.engines import per_pass_prediction
    from distill.policy import pass_profile, pass_profile_rows

    rows, length = 8, 12
    n = rows * length
    heldout = HeldOut([{}] * rows, ["d"] * rows, torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1),
                      torch.zeros(n), torch.arange(rows).repeat_interleave(length), Sampling(), rows, 0)
    everywhere = torch.ones(n, dtype=torch.bool)
    alpha = torch.tensor([0.95 if r % 2 else 0.2 for r in range(rows)]).repeat_interleave(length)
    keep = torch.ones(n)
    per_row = pass_profile_rows(alpha, keep, heldout, everywhere, 3, stop_before=True)
    out = per_pass_prediction(*per_row)
    assert out["rows"] == rows
    assert out["accepted"] == pytest.approx(pass_profile(alpha, keep, heldout, everywhere, 3, True)[1], abs=1e-4)
    for value, (lo, hi) in zip(out["accepted"], out["accepted_ci95"]):
        assert lo <= value <= hi and hi - lo > 0.05  # half the rows accept 0.95, half 0.2
    same = per_pass_prediction(*pass_profile_rows(torch.full((n,), 0.6), keep, heldout, everywhere, 3, True))
    assert all(hi - lo < 1e-6 for lo, hi in same["accepted_ci95"])
    none = per_pass_prediction(*pass_profile_rows(alpha, keep, heldout, torch.zeros(n, dtype=torch.bool), 3, True))
    assert none["rows"] == 0 and none["accepted"] == []


def test_measured_and_predicted_are_judged_as_a_difference_with_both_errors():
    """The eval's verdict on a prediction with an interval: measured − predicted, the two errors in quadrature. A
    prediction far from the measurement is refused even with wide intervals; the point-in-interval test alone
    (the wrong judge) refuses a prediction whose own error covers the gap."""
    from eval.engine_llamacpp import difference

    near = difference((0.60, [0.50, 0.70]), (0.75, [0.62, 0.88]))  # outside the measured CI, inside the joint one
    assert near[0] == pytest.approx(-0.15) and near[1] < 0 < near[2]
    half = ((0.10 / 1.96) ** 2 + (0.13 / 1.96) ** 2) ** 0.5 * 1.96
    assert near[2] - near[0] == pytest.approx(half, abs=1e-3)
    far = difference((0.60, [0.55, 0.65]), (0.85, [0.80, 0.90]))
    assert far[2] < 0
    assert difference((0.6, None), (0.7, [0.6, 0.8])) is None


def test_the_overall_row_is_predicted_only_where_every_domain_ran_one_setting():
    """The overall per-pass row gets the calibration's default entry (all reporting rows) for a method whose servers
    ran one setting everywhere (the server's defaults); a per-domain calibrated setting mixes predictions: none."""
    from types import SimpleNamespace

    from eval.engine_llamacpp import overall_predictions
    from pipeline.engines.llamacpp import DraftSettings

    defaults = {"proposed": [1, 1, 1], "accepted": [0.6, 0.4, 0.2]}
    entry = {"speculate": True, "n_max": 2, "p_min": 0.5, "predicted_per_pass": {"proposed": [1], "accepted": [0.5]},
             "predicted_per_pass_server_defaults": defaults}
    spec = SimpleNamespace(engines={"llamacpp": {"by_domain": {"default": entry, "code": entry}}})
    plan = {"autoregressive": {"code": (None, DraftSettings()), "chat": (None, DraftSettings())},
            "speculative": {"code": ("speculative", DraftSettings(2, 0.5)), "chat": (None, DraftSettings())},
            "speculative_defaults": {"code": ("speculative", DraftSettings()), "chat": ("speculative", DraftSettings())}}
    out = overall_predictions({"speculative": spec}, plan)
    assert out == {"speculative_defaults": defaults}


def test_an_off_domain_reads_off_and_a_disturbed_plain_against_plain_reading_is_flagged():
    """A method served by the plain server in a domain (calibrated "off") is plain decoding timed twice: the report
    says "off", and a reading beyond ±5% of 1.00× flags the run's timings; a drafting domain's slow reading is a
    result, never a flag."""
    from eval.engine_llamacpp import report

    def row(speedup, drafted=0):
        return {"tokens_per_s": 10.0, "speedup": speedup, "speedup_ci95": [speedup - 0.01, speedup + 0.01],
                "n_drafted": drafted, "acceptance_rate": 0.5, "acceptance_rate_ci95": None, "per_pass": None}

    plain = {"tokens_per_s": 10.0}
    plan = {"autoregressive": {"chat": {"draft": None}, "code": {"draft": None}},
            "speculative": {"chat": {"draft": None}, "code": {"draft": "speculative"}}}

    def metrics(chat_speedup):
        return {"engine": "llamacpp", "version": "0.3.36", "temperature": 0.7, "plan": plan,
                "domains": {"chat": {"autoregressive": plain, "speculative": row(chat_speedup)},
                            "code": {"autoregressive": plain, "speculative": row(0.5, drafted=10)}},
                "overall": {"autoregressive": plain, "speculative": row(0.75, drafted=10)}}

    quiet = report(metrics(1.02))
    assert "| chat | speculative | 10.0 | off (plain server: 1.02×" in quiet and "disturbed" not in quiet
    assert "| code | speculative | 10.0 | 0.50×" in quiet  # drafting: its number, unflagged
    loud = report(metrics(1.40))
    assert "**Timings disturbed:**" in loud and "chat speculative 1.40×" in loud and "code speculative" not in loud


def test_two_drafts_in_one_llama_server_eval_are_compared_paired_on_the_same_requests():
    """eval.engine=llamacpp with the tuned draft and a published one (eval.draft_init): each drafting method against
    each later one as a paired tokens/s ratio with its interval, in metrics and the report; plain decoding is never
    one of the pair. The wrong variant, unpaired means of per-request rates, reads another figure."""
    from eval.engine_llamacpp import EngineStats, comparison_table, draft_comparisons

    def rec(method, prompt, seconds, tokens=10):
        return {"method": method, "domain": "code", "prompt_id": prompt, "turn": 0, "time_s": seconds,
                "tokens": [0] * tokens, "stats": EngineStats([1], [2])}

    fast = [0.5, 0.6, 0.4, 0.5, 0.9, 0.5, 0.45, 0.55]
    records = [rec(m, p, s * f) for p, s in enumerate([1.0, 2.0, 1.5, 1.0, 3.0, 1.2, 1.1, 0.9])
               for m, f in [("autoregressive", 1.0), ("speculative", fast[p]), ("speculative_init", 0.8)]]
    out = draft_comparisons(records)
    assert list(out) == ["speculative_vs_speculative_init"]
    c = out["speculative_vs_speculative_init"]
    seconds = {m: sum(r["time_s"] for r in records if r["method"] == m) for m in ("speculative", "speculative_init")}
    assert c["ratio"] == pytest.approx(seconds["speculative_init"] / seconds["speculative"])
    assert c["n_requests"] == 8 and c["ci95"][0] < c["ratio"] < c["ci95"][1] and c["within_noise"] is False
    unpaired = sum(0.8 / f for f in fast) / len(fast)  # mean of per-request ratios: not the pooled paired ratio
    assert c["ratio"] != pytest.approx(unpaired, rel=1e-3)
    table = comparison_table({"comparisons": {"overall": out}})
    assert "| overall | speculative / speculative_init | " in "\n".join(table)
    assert comparison_table({}) == []


def test_an_engine_eval_takes_a_published_drafts_gguf_as_the_draft_before(tmp_path):
    """eval.draft_init may name a .gguf (a published draft as packaged) beside a directory; `none`, or a path that is
    neither an existing directory nor a .gguf file, serves the tuned draft alone."""
    from types import SimpleNamespace

    from eval.engine_llamacpp import draft_sources

    paths = SimpleNamespace(draft=str(tmp_path / "draft"), draft_init=str(tmp_path / "missing"))
    published = tmp_path / "published-Q4_K_M.gguf"
    published.write_bytes(b"GGUF")
    (tmp_path / "init").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")

    def sources(draft_init):
        return draft_sources(SimpleNamespace(draft=None, draft_init=draft_init), paths)

    assert sources(str(published)) == {"speculative": tmp_path / "draft", "speculative_init": published}
    assert sources(str(tmp_path / "init"))["speculative_init"] == tmp_path / "init"
    assert list(sources("none")) == list(sources(None)) == list(sources(str(tmp_path / "weights.bin"))) == ["speculative"]
    assert list(sources(str(tmp_path / "absent.gguf"))) == ["speculative"]


def test_a_cached_build_with_other_flags_is_rebuilt_and_x86_builds_leave_out_the_amx_kernels(tmp_path):
    """A tree built before a flag changed (ggml's AMX kernels segfault on multi-token batches in the pinned version)
    is not taken as built: the build is redone with today's flags."""
    import json
    import platform

    from pipeline.engines import llamacpp

    root = tmp_path / "llama.cpp-pinned"
    for name in llamacpp.BINARIES:
        llamacpp.binary(root, name).parent.mkdir(parents=True, exist_ok=True)
        llamacpp.binary(root, name).touch()
    (root / "src").mkdir()
    (root / "src" / "convert_hf_to_gguf.py").touch()
    stamp = root / "build" / "cmake_flags.json"
    assert not llamacpp.is_built(root)  # no record of its flags: an older build
    stamp.write_text(json.dumps(llamacpp.CMAKE_FLAGS))
    assert llamacpp.is_built(root)
    stamp.write_text(json.dumps([f for f in llamacpp.CMAKE_FLAGS if "amx" not in f]))
    assert llamacpp.is_built(root) == (platform.machine().lower() not in ("x86_64", "amd64"))
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert any("-mno-amx-int8" in flag for flag in llamacpp.CMAKE_FLAGS)


def test_eval_max_minutes_stops_an_engines_loop_after_a_round_of_domains(monkeypatch):
    """eval.max_minutes bounds the engines' request loop as it bounds ours: each call here takes 30 s of a fake clock,
    2 methods a request, 2 minutes allowed: the first round (one request a domain) runs, the next would end past the
    budget; without a budget every request runs."""
    import time as clock
    from types import SimpleNamespace

    from eval import engine_llamacpp as E

    now = [1000.0]
    monkeypatch.setattr(clock, "time", lambda: now[0])

    def decode(ids, domain, n, seed):
        now[0] += 30.0
        return [1, 2], E.EngineStats([1], [1]), 30.0

    methods = {"autoregressive": decode, "speculative": decode}
    settings = SimpleNamespace(max_new_tokens=2, max_minutes=2)
    requests = [{"domain": d, "prompt_id": f"{d}{i}", "ids": [1]} for i in range(3) for d in ("chat", "code")]
    cut = E.engine_records(requests, methods, 0, "llamacpp", settings)
    assert E.requests_done(cut, requests, list(methods)) == {"done": 2, "planned": 6}
    assert {r["domain"] for r in cut} == {"chat", "code"}
    assert {r["time_s"] for r in cut} == {30.0}  # the engine's own seconds, no clock of ours
    whole = E.engine_records(requests, methods, 0, "llamacpp", SimpleNamespace(max_new_tokens=2, max_minutes=None))
    assert len(whole) == 12
    report = E.report({"engine": "llamacpp", "version": "x", "temperature": 0.7, "domains": {}, "overall": {},
                       "requests": {"done": 2, "planned": 6}})
    assert "stopped the run after 2 of 6 requests" in report
