"""The online guard (pipeline/decoding/guard.py): exact with it on, its decisions on far and close drafts, probing
back, a draft cache that catches up after passes off, and bad settings as one line."""
import pytest
import torch
from transformers import DynamicCache

from pipeline.decoding import DecodeStats, DraftLength, DraftPlan, autoregressive_generate, chain, speculative_generate
from pipeline.decoding.chain import chain_step
from pipeline.decoding.draft_length import Policy
from pipeline.decoding.guard import Guard, GuardedPolicy, GuardSettings, PassTimes, conditional_rates
from pipeline.decoding.loop import Pair, Profile
from pipeline.errors import PipelineError
from pipeline.heads import head_rows
from pipeline.sampling import Sampling
from tests.conftest import SHIPPED, N_SAMPLES, chi_square_pvalue, exact_joint, random_prompts, speculative_joint_counts

torch.set_num_threads(1)

KNOBS = {k: v for k, v in SHIPPED.eval.guard.items()
         if k not in ("enabled", "compare")}  # the shipped eval.guard knobs
COST = {"c": 0.1, "verify_ratio": {1: 1.1, 2: 1.2, 4: 1.4, 8: 1.8}}  # the embedded pair's shape on a CPU
PRIOR = (0.5, 0.25, 0.125)  # P_k: the chance the first k drafts are accepted
NEVER_PAYS = {"c": 5.0, "verify_ratio": {1: 2.0}}  # a draft step dearer than the target's: always off, then probes


def guard(cost=COST, prior=PRIOR, **settings) -> Guard:
    """A guard on the calibrated costs alone unless told otherwise: its decisions then never depend on the clock."""
    return Guard(cost, prior, GuardSettings(**{**KNOBS, "measure_every": 0, **settings}))


def decisions(stats_list):
    total = stats_list[0].guard
    for stats in stats_list[1:]:
        total = total.add(stats.guard)
    return total


# ---- exactness ----

@pytest.mark.parametrize("draft_name", ["close", "far"])
@pytest.mark.parametrize("drafting", [4, DraftLength("confidence", 8, 0.5), (2, 2, 1)], ids=["fixed", "confidence", "tree"])
def test_greedy_speculative_with_the_guard_equals_autoregressive(target, drafts, draft_name, drafting):
    for prompt in random_prompts(6, seed=3):
        expected = autoregressive_generate(target, prompt, max_new_tokens=24).tokens.tolist()
        out = speculative_generate(target, drafts[draft_name], prompt,
                                   plan=DraftPlan(drafting, guard=guard(probe_every=2)), max_new_tokens=24)
        assert out.tokens.tolist() == expected
        # every pass is decided but the plain prefill (the first) and a last pass left no room to draft
        assert out.stats.guard.passes >= out.stats.target_passes - 2


@pytest.mark.parametrize("draft_name,drafting,cost,settings", [
    ("far", 2, NEVER_PAYS, dict(probe_every=1)),  # off, probe, off, probe: the draft cache catches up each time
    ("close", 2, COST, dict()),  # shortened to what pays
    ("far", (2, 1), COST, dict(probe_every=1)),  # a token tree, truncated or off
], ids=["off_and_probe", "shortened", "tree"])
def test_samples_with_the_guard_follow_the_target_distribution(target, drafts, draft_name, drafting, cost, settings):
    probs = exact_joint(target, 1.0)
    counts = speculative_joint_counts(target, drafts[draft_name], N_SAMPLES, temperature=1.0, drafting=drafting,
                                      guard=guard(cost, **settings))
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_the_distribution_test_rejects_a_guard_that_also_eases_acceptance(target, far_draft, monkeypatch):
    """The wrong variant: a guard that keeps its running acceptance up by accepting every draft it lets through."""
    def accept_all(p, q, drafts, generator):
        n = torch.tensor(drafts.shape[0])
        return n, p[-1].multinomial(1, generator=generator)[0]
    monkeypatch.setattr(chain, "verify_draft", accept_all)
    counts = speculative_joint_counts(target, far_draft, N_SAMPLES, temperature=1.0, drafting=2, guard=guard())
    assert chi_square_pvalue(counts, exact_joint(target, 1.0)) < 1e-6


# ---- decisions ----

def test_the_guard_switches_off_on_a_far_draft_and_keeps_drafting_on_a_close_one(target, close_draft, far_draft):
    def run(draft):
        return decisions([speculative_generate(target, draft, prompt, plan=DraftPlan(4, guard=guard()),
                                               max_new_tokens=40).stats for prompt in random_prompts(6, seed=1)])
    far, close = run(far_draft), run(close_draft)
    assert far.off > 0.6 * far.passes and far.probes > 0
    assert close.off < 0.25 * close.passes
    assert close.shortened > 0  # γ = 4 does not pay at this acceptance and cost: the guard drafts fewer


def test_probing_re_enables_speculation_when_acceptance_recovers():
    policy = GuardedPolicy(Policy(4), guard(probe_every=3))
    budgets = []
    for _ in range(12):  # everything rejected: the guard goes off
        budgets.append(policy.budget())
        policy.update(budgets[-1], 0)
    assert budgets[-3:].count(0) >= 2 and policy.stats.off > 0
    for _ in range(12):  # everything accepted again: probes see it and drafting comes back
        budgets.append(policy.budget())
        policy.update(budgets[-1], budgets[-1])
    assert budgets[-1] >= 1 and budgets[-3:].count(0) == 0
    assert policy.stats.probes >= 1


def test_a_pass_that_pays_is_left_alone_and_a_longer_one_is_chosen_when_it_pays():
    sure = GuardedPolicy(Policy(2), guard(prior=(0.99, 0.98, 0.97, 0.96), longest=4))
    assert sure.budget() == 4 and sure.stats.lengthened == 1
    as_calibrated = GuardedPolicy(Policy(1), guard(prior=(0.3, 0.09), longest=1))
    assert as_calibrated.budget() == 1 and as_calibrated.stats.shortened == as_calibrated.stats.lengthened == 0


class FakeClock:
    """Each pass lasts what the test says: plain passes `plain` s, passes with drafts `factor` × their price."""
    def __init__(self, plain: float, factor: float):
        self.now, self.plain, self.factor, self.pending = 0.0, plain, factor, 0.0

    def __call__(self) -> float:
        self.now += self.pending
        self.pending = 0.0
        return self.now


def run_timed(policy: GuardedPolicy, clock: FakeClock, passes: int) -> list[int]:
    budgets = []
    for _ in range(passes):
        budgets.append(policy.budget())
        steps = 1.0 / policy.per_cost[budgets[-1]]
        clock.pending = clock.plain * (clock.factor * steps if budgets[-1] else 1.0)
        policy.update(budgets[-1], budgets[-1])
    return budgets


def test_measured_costs_switch_off_what_the_calibrated_ones_would_keep():
    """The calibrated profile says one draft pays (2 tokens for 1.2 steps); the clock says a pass with drafts
    costs twice what it was priced (2 tokens for 2.4 steps): the guard goes off. With the clock agreeing, it
    keeps drafting."""
    half = (0.5, 0.25, 0.125)
    for factor, expect_off in ((2.0, True), (1.0, False)):
        clock = FakeClock(plain=0.05, factor=factor)
        policy = GuardedPolicy(Policy(1), guard(prior=half, measure_every=8, longest=1), clock=clock)
        budgets = run_timed(policy, clock, 60)  # every draft accepted: 2 tokens a pass
        assert policy.stats.timing > 0
        assert policy.stats.cost_factor == pytest.approx(factor, rel=1e-6)
        assert (budgets[-20:].count(0) > 10) == expect_off


def test_pass_times_leave_out_the_passes_that_read_the_prompt():
    clock = FakeClock(plain=1.0, factor=1.0)
    times = PassTimes(keep=0.9, clock=clock)
    for seconds, steps, drafted in ((50.0, 1.0, False), (9.0, 1.5, True), (1.0, 1.0, False), (3.0, 1.5, True)):
        times.start()
        clock.pending = seconds
        times.stop(steps, drafted)
    assert times.factor == pytest.approx(2.0)  # (3 / 1.5) / 1: the 50 s and 9 s prompt reads left out


def test_conditional_rates_from_cumulative_acceptance():
    assert conditional_rates((0.5, 0.25, 0.0), 5) == [0.5, 0.5, 0.0, 0.0, 0.0]


# ---- passes of no drafts ----

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_pass_of_no_drafts_is_a_plain_step(target, close_draft, temperature):
    prompt = torch.tensor([[3, 5, 7]])
    caches = DynamicCache(config=target.config), DynamicCache(config=close_draft.config)
    p = Sampling(temperature)
    pair = Pair(target, close_draft, head_rows(target), head_rows(close_draft), p, p,
                generator=torch.Generator().manual_seed(0))
    stats = DecodeStats()
    with torch.inference_mode():
        seq, new = chain_step(pair, prompt, caches, 0, Policy(0), stats, Profile("cpu"))
    assert len(new) == 1 and seq.shape[1] == 4 and stats.drafted == [0] and stats.accepted == [0]
    assert caches[0].get_seq_length() == 3 and caches[1].get_seq_length() == 0  # the draft catches up later


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafting", [3, (2, 2)], ids=["chain", "tree"])
def test_the_draft_cache_catches_up_after_passes_off(target, temperature, drafting):
    """The target as its own draft accepts every draft (p = q), and does so only if its cache, behind by every
    token committed while off, is fed exactly those tokens before drafting again."""
    out = [speculative_generate(target, target, prompt, sampling=Sampling(temperature),
                                plan=DraftPlan(drafting, guard=guard(NEVER_PAYS, probe_every=2)), max_new_tokens=30,
                                generator=torch.Generator().manual_seed(1)).stats for prompt in random_prompts(4, 5)]
    assert sum(s.guard.off for s in out) > 0 and sum(s.guard.probes for s in out) > 0
    for s in out:  # every draft accepted: a chain's every token, a tree's path to its full depth
        assert s.accepted == (s.depths if isinstance(drafting, tuple) else s.drafted)
    assert sum(s.n_drafted for s in out) > 0


# ---- bad settings ----

@pytest.mark.parametrize("values,message", [
    (dict(window=0), "guard.window"), (dict(probe_every=0), "guard.probe_every"), (dict(margin=1.5), "guard.margin"),
    (dict(longest=2.5), "guard.longest"), (dict(prior_passes=-1), "guard.prior_passes")])
def test_bad_guard_settings_are_one_line(values, message):
    with pytest.raises(PipelineError, match=message) as error:
        GuardSettings(**{**KNOBS, **values})
    assert "\n" not in str(error.value)


def test_unknown_guard_keys_and_a_guard_without_costs_are_one_line():
    with pytest.raises(PipelineError, match="unknown keys"):
        GuardSettings.from_dict({"window": 4, "windw": 2})
    with pytest.raises(PipelineError, match="draft cost"):
        Guard({"verify_ratio": {1: 1.1}}, PRIOR, GuardSettings(**KNOBS))
    with pytest.raises(PipelineError, match="probabilities"):
        Guard(COST, (1.5,), GuardSettings(**KNOBS))


# ---- eval: settings, plans, metrics ----

def eval_settings(*overrides: str):
    from hydra import compose, initialize_config_dir

    from eval.settings import EvalSettings
    from tests.conftest import REPO

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return EvalSettings.from_config(compose("config", overrides=list(overrides)).eval)


def test_eval_guards_each_domain_from_the_draft_calibration():
    from pipeline.decoding.spec import SpeculativeSpec

    spec = SpeculativeSpec(target={}, sampling=Sampling(0.7), draft={}, cost=COST,
                           per_position_acceptance={"code": [0.4, 0.2], "overall": [0.3, 0.1]})
    settings = eval_settings("eval.guard.probe_every=3")
    assert guard_for(spec, "code", settings).prior == (0.4, 0.2)
    assert guard_for(spec, "chat", settings).prior == (0.3, 0.1)  # an uncalibrated domain: the overall figure
    assert guard_for(spec, "code", settings).settings.probe_every == 3
    assert guard_for(spec, "code", eval_settings("eval.guard.enabled=false")) is None
    assert guard_for(SpeculativeSpec(target={}, sampling=Sampling(0.7), draft={}), "code", settings) is None


@pytest.mark.parametrize("override,message", [
    ("eval.guard.window=0", "eval.guard.window"), ("eval.guard.enabled=maybe", "eval.guard.enabled"),
    ("+eval.guard.windw=4", "unknown keys"), ("~eval.guard.margin", "lacks"), ("eval.guard.probe_every=0", "eval.guard.probe_every")])
def test_a_bad_eval_guard_is_one_line(override, message):
    with pytest.raises(PipelineError, match=message) as error:
        eval_settings(override)
    assert "\n" not in str(error.value)


def test_metrics_count_the_guard_decisions(target, far_draft):
    from eval.metrics import speculative_counters

    stats = [speculative_generate(target, far_draft, prompt, plan=DraftPlan(4, guard=guard()), max_new_tokens=30).stats
             for prompt in random_prompts(3, seed=2)]
    counted = speculative_counters([{"stats": s} for s in stats], ar_step_s=0.01)["guard_decisions"]
    assert counted == decisions(stats).to_dict() | {"cost_factor": 1.0} and counted["off"] > 0
    assert "guard" not in speculative_counters([{"stats": DecodeStats(drafted=[1], accepted=[0], target_passes=1)}],
                                               ar_step_s=0.01)


def guard_for(spec, domain, settings, tree=None):
    """The guard spec.plan gives a domain's chain (or `tree`) under eval's guard settings."""
    return spec.plan(domain, spec.sampling, drafting=tuple(tree) if tree else 4, guard=settings.guard_settings).guard
