"""Eval's timing harness (eval/harness.py) on fake methods and a fake clock: a stall is caught by the rule fixed
before the run and re-timed, or kept out of the headline with the unfiltered figure beside it; a slow request that
is slow again is kept; a domain calibrated off reuses the plain run and reads "off"; per-domain intervals only where
n supports them. One test on a tiny model: plain decoding through speculative_generate(plan=PLAIN) is the plain
run, token for token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eval import metrics as M
from eval.harness import by_method, retime_stalls, time_request, time_requests
from eval.report import stall_lines
from eval.tables import domain_rows, text_table
from pipeline.decoding import DecodeStats, DraftPlan

N_TOKENS = 20
AR_STEP_S = 0.05  # fake seconds per token of plain decoding
SPEEDUP = 2.0  # the fake speculative method's true speedup
RULE = {"factor": 3.0, "retimes": 2, "agree": 1.25}
BAND = (0.8, 1.25)  # eval.control_band: no HF generate runs here, so no request is judged by it


class FakeClock:
    """Seconds that pass only when a fake method says so: timings are exact and the test cannot flake."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def method(clock: FakeClock, seconds_per_token: float, stalls: dict | None = None):
    """fn(ids, domain, n, seed) -> (tokens, stats) that takes `seconds_per_token`; `stalls` {prompt id: [extra
    seconds of each call]} makes the calls on one request slower, one entry per call (a sleep that happens once)."""
    stalls = {k: list(v) for k, v in (stalls or {}).items()}

    def generate(ids, domain, n, seed):
        extra = stalls.get(ids, [])
        clock.now += n * seconds_per_token + (extra.pop(0) if extra else 0.0)
        return [seed % 7] * n, DecodeStats(target_passes=n, n_generated=n, target_times=[AR_STEP_S] * n)
    return generate


def evaluation(rule=RULE, plans: dict | None = None):
    settings = SimpleNamespace(max_new_tokens=N_TOKENS, stall=rule)
    return SimpleNamespace(settings=settings, plans=plans or {})


def contexts(n: int, domain: str = "chat") -> list[dict]:
    # ids stand in for the encoded prompt: the fake methods key their stalls by it
    return [{"domain": domain, "prompt_id": f"{domain}-{i}", "turn": 0, "ids": f"{domain}-{i}", "seed": i,
             "rotation": i} for i in range(n)]


def plans_for(domains, speculate: dict | None = None) -> dict:
    return {"speculative": {d: DraftPlan(4 if (speculate or {}).get(d, True) else None)
                            for d in [*domains, "default"]}}


def measure(methods: dict, requests: list[dict], ev) -> tuple[list[dict], dict | None]:
    clock = methods.pop("clock")
    records = [r for c in requests for r in time_request(c, methods, ev, clock)]
    return records, retime_stalls(records, requests, methods, ev, clock)


def methods_with(stalls: dict | None = None, spec_stalls: dict | None = None) -> dict:
    clock = FakeClock()
    return {"clock": clock, "autoregressive": method(clock, AR_STEP_S, stalls),
            "speculative": method(clock, AR_STEP_S / SPEEDUP, spec_stalls)}


def headline(records: list[dict], stalls: dict | None, domains=("chat",)) -> dict:
    return M.build(records, plans_for(domains), 0.0, stalls=stalls, band=BAND, min_ci_requests=2)


def test_a_one_off_stall_of_the_first_request_is_caught_and_retimed():
    """The fresh run's failure: the first timed request (plain decoding) 17× slower once. The rule flags it, the
    re-time is clean and replaces it, and the headline is the true speedup."""
    stall = {"chat-0": [16 * N_TOKENS * AR_STEP_S]}  # one call 17× its usual time
    requests = contexts(6)
    records, stalls = measure(methods_with(stall), requests, evaluation())
    assert stalls["suspects"] == [["chat", "chat-0", 0, ["autoregressive"]]]
    assert stalls["retimed"] == [["chat", "chat-0", 0]] and stalls["disturbed"] == []
    metrics = headline(records, stalls)
    assert metrics["overall"]["speedup"] == pytest.approx(SPEEDUP)
    assert "1 of 6 requests re-timed, 0 still disturbed" in stall_lines(metrics)[0]


def test_without_the_stall_rule_the_stall_reaches_the_headline():
    """The wrong variant: eval.stall.factor null. The same stall inflates the headline far past the true speedup."""
    stall = {"chat-0": [16 * N_TOKENS * AR_STEP_S]}
    records, stalls = measure(methods_with(stall), contexts(6), evaluation({**RULE, "factor": None}))
    assert stalls is None
    assert headline(records, stalls)["overall"]["speedup"] > 1.5 * SPEEDUP


def test_a_request_that_stays_stalled_is_kept_out_of_the_headline_with_the_unfiltered_figure_beside():
    """A request disturbed on the first timing and on every re-time: listed as disturbed, left out of every figure
    (the headline is the true speedup on the rest), its count stated and the overall speedup with it shown."""
    stall = {"chat-2": [10.0, 20.0, 40.0]}  # a different stall each time: never reproduced, never clean
    records, stalls = measure(methods_with(spec_stalls=stall), contexts(6), evaluation())
    assert stalls["disturbed"] == [["chat", "chat-2", 0]]
    metrics = headline(records, stalls)
    assert metrics["overall"]["speedup"] == pytest.approx(SPEEDUP)
    assert metrics["overall"]["n_requests"] == 5 and metrics["stalls"]["n_excluded"] == 1
    unfiltered = metrics["stalls"]["unfiltered"]["speedup"]["speculative"]["speedup"]
    assert unfiltered < 0.8 * SPEEDUP
    line = stall_lines(metrics)[0]
    assert "chat chat-2 turn 0" in line and "kept out of every figure" in line and f"{unfiltered:.2f}×" in line
    # the wrong variant, no re-time allowed: the request is still flagged rather than trusted
    _, no_retimes = measure(methods_with(spec_stalls=stall), contexts(6), evaluation({**RULE, "retimes": 0}))
    assert no_retimes["disturbed"] == [["chat", "chat-2", 0]]


def test_a_request_slow_by_its_content_is_slow_again_and_kept():
    """A request whose speculative run is 4× slower every time (say, nothing accepted): the re-time reproduces it,
    so it is the request's real cost, kept in the headline (dropping it would flatter the draft)."""
    slow = {"chat-1": [3 * N_TOKENS * AR_STEP_S / SPEEDUP] * 3}
    records, stalls = measure(methods_with(spec_stalls=slow), contexts(6), evaluation())
    assert stalls["suspects"] and stalls["disturbed"] == []
    metrics = headline(records, stalls)
    assert metrics["overall"]["n_requests"] == 6 and metrics["overall"]["speedup"] < 0.9 * SPEEDUP


def test_an_off_domain_reuses_the_plain_run_and_reads_off():
    """code calibrated off: its speculative records are the plain run's (the same tokens and time, never timed
    twice), so its speedup is exactly 1 and the table says "off", not "fixed", not "0.00→0.00"."""
    clock = FakeClock()
    calls = []

    def counted(fn, name):
        def generate(ids, domain, n, seed):
            calls.append((name, domain))
            return fn(ids, domain, n, seed)
        return generate
    methods = {"autoregressive": counted(method(clock, AR_STEP_S), "autoregressive"),
               "speculative": counted(method(clock, AR_STEP_S / SPEEDUP), "speculative")}
    plans = plans_for(["chat", "code"], {"code": False})
    ev = evaluation(plans=plans)
    records = [r for c in contexts(3) + contexts(3, "code") for r in time_request(c, methods, ev, clock)]
    assert ("speculative", "code") not in calls and ("speculative", "chat") in calls
    code = [r for r in records if r["domain"] == "code"]
    ar, spec = ([r for r in code if r["method"] == m] for m in ("autoregressive", "speculative"))
    assert [(r["tokens"], r["time_s"]) for r in spec] == [(r["tokens"], r["time_s"]) for r in ar]
    metrics = M.build(records, plans, 0.0, band=BAND, min_ci_requests=2)
    assert metrics["domains"]["code"]["speculative"]["off"] is True
    assert metrics["domains"]["code"]["speedup"] == 1.0
    assert "off" not in metrics["domains"]["chat"]["speculative"]
    assert metrics["overall"]["speculative"]["n_plain_requests"] == 3
    table = text_table(*domain_rows(metrics))
    code_row = next(line for line in table.splitlines() if line.startswith("code"))
    assert "off (plain)" in code_row and "0.00" not in code_row and "fixed" not in code_row


def test_a_domain_below_the_minimum_shows_its_point_estimate_without_an_interval():
    """eval.min_requests_for_ci = 8: a domain of 5 requests gives its speedup with "n=5, no CI" and no interval,
    a domain of 8 its interval; the overall interval (13 requests) stands. The wrong variant (minimum 2) gives the
    5-request domain an interval."""
    records, _ = measure(methods_with(), contexts(5), evaluation())
    more, _ = measure(methods_with(), contexts(8, "code"), evaluation())
    metrics = M.build(records + more, plans_for(["chat", "code"]), 0.0, band=BAND, min_ci_requests=8)
    chat, code = metrics["domains"]["chat"], metrics["domains"]["code"]
    assert chat["speedup_ci95"] is None and chat["speculative"]["speedup_ci95"] is None
    assert chat["ci_withheld"] == "n=5 < 8" and chat["speedup"] == pytest.approx(SPEEDUP)
    assert code["speedup_ci95"] is not None and metrics["overall"]["speedup_ci95"] is not None
    chat_row = next(line for line in text_table(*domain_rows(metrics)).splitlines() if line.startswith("chat"))
    assert "(n=5, no CI)" in chat_row
    assert M.build(records + more, plans_for(["chat", "code"]), 0.0, band=BAND,
                   min_ci_requests=2)["domains"]["chat"]["speedup_ci95"] is not None


def test_plain_decoding_through_the_speculative_entry_point_is_the_plain_run(tiny_llama_factory):
    """What an off domain runs: speculative_generate(plan=PLAIN) gives autoregressive_generate's tokens for the
    same seed when sampling, with the same passes and no draft forward (the same code path, so reusing the plain
    run's time is exact)."""
    from pipeline.decoding import PLAIN, autoregressive_generate, speculative_generate
    from pipeline.sampling import Sampling

    target = tiny_llama_factory(vocab_size=64, hidden_size=32, layers=2, seed=0)
    ids = torch.tensor([[2, 4, 7, 8, 3, 2, 5]])
    sampling = Sampling(0.9, 20)

    def run(fn, **kw):
        return fn(input_ids=ids, sampling=sampling, max_new_tokens=12, generator=torch.Generator().manual_seed(3), **kw)
    plain = run(lambda **kw: autoregressive_generate(target, **kw))
    off = run(lambda **kw: speculative_generate(target, target, plan=PLAIN, **kw))
    assert off.tokens.tolist() == plain.tokens.tolist()
    assert off.stats.target_passes == plain.stats.target_passes and off.stats.draft_times == []
    forced = run(lambda **kw: speculative_generate(target, target, plan=DraftPlan(2), **kw))
    assert forced.stats.n_drafted > 0  # the wrong variant: a drafting is not the plain run


# ---------------------------------------------------------------- the loop every other comparison times through

def _fake_methods(calls: list):
    def method(name):
        def fn(ids, domain, n, seed):
            calls.append((name, ids, n, seed))
            return [ids] * n, None
        return fn
    return {name: method(name) for name in ("a", "b", "c")}


def test_time_requests_warms_up_then_rotates_who_runs_first_with_one_seed_per_request():
    calls = []
    requests = [{"ids": k, "domain": "d", "seed": 100 + k} for k in range(3)]
    records = by_method(time_requests(requests, _fake_methods(calls), 5, iter(range(100)).__next__, "t", 2))
    assert calls[:3] == [("a", 0, 2, 100), ("b", 0, 2, 100), ("c", 0, 2, 100)]  # untimed warm-up, short
    timed = calls[3:]
    assert [name for name, *_ in timed] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(seed == 100 + ids and n == 5 for _, ids, n, seed in timed)
    assert [r["tokens"] for r in records["b"]] == [[0] * 5, [1] * 5, [2] * 5]
    assert all(r["time_s"] == 1 for recs in records.values() for r in recs)  # one clock reading each side


def test_the_rotation_check_sees_a_harness_that_always_runs_one_method_first(monkeypatch):
    import eval.harness as harness

    monkeypatch.setattr(harness, "rotated", lambda names, k: names)
    calls = []
    time_requests([{"ids": k, "domain": "d", "seed": k} for k in range(3)], _fake_methods(calls), 1,
                  iter(range(100)).__next__, "t", 1)
    assert [name for name, *_ in calls[3:]] != ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_a_budget_cut_leaves_drafting_domains_twice_the_requests_of_domains_calibrated_off():
    from collections import Counter

    from eval.harness import interleaved

    prompts = {d: [{"domain": d, "i": i} for i in range(12)] for d in ("chat", "code", "math")}
    queue = interleaved(prompts, {"code": 2, "math": 2})  # chat decodes plainly
    assert {p["domain"] for p in queue[:3]} == {"chat", "code", "math"}  # the first round: every domain once
    for cut in range(3, 25):
        counts = Counter(p["domain"] for p in queue[:cut])
        assert min(counts["code"], counts["math"]) >= 2 * counts["chat"] - 1, (cut, counts)
    plain = Counter(p["domain"] for p in interleaved(prompts)[:12])  # unweighted: round robin, which the bound rejects
    assert plain == {"chat": 4, "code": 4, "math": 4} and plain["code"] < 2 * plain["chat"] - 1
    assert len(queue) == 36 and {id(p) for p in queue} == {id(p) for ps in prompts.values() for p in ps}
