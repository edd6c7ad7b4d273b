"""Calibration on held-out rows, without running the stage: temperature calibration recovers a known
temperature, the best γ follows the walltime formula (with a measured verify cost), the draft-length policy
simulator, the token-tree choice and the sibling acceptance of a tree against exact enumeration."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import WORD_VOCAB as VOCAB, peaked_target


# ---------------------------------------------------------------- calibration
def random_heldout(target, temperature: float, rows: int = 6, seed: int = 1):
    """Held-out rows of random prompts and completions in two domains, labelled by `target` at `temperature`."""
    from distill.aligned import Truncation
    from distill.simulator import build_heldout
    from pipeline.sampling import Sampling

    g = torch.Generator().manual_seed(seed)
    samples = [{"prompt_ids": torch.randint(6, VOCAB, (5,), generator=g).tolist(),
                "completion_ids": torch.randint(6, VOCAB, (12,), generator=g).tolist(), "domain": "ab"[i % 2]}
               for i in range(rows)]
    return build_heldout(target, samples, Sampling(temperature), Truncation(512, 256), support=VOCAB, batch_size=8,
                         pad_token_id=1)


@pytest.mark.parametrize("scale", [1.5, 1 / 1.5])
def test_calibration_recovers_a_known_temperature(scale):
    """Draft logits = target logits × s, so q_τ = p_T exactly at τ = s·T: calibration must find it
    (s = 1/1.5 is "draft = target logits / 1.5", whose best τ is T/1.5)."""
    import copy

    from distill.simulator import calibrate_temperature

    target = peaked_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(1 / 20)  # moderate peaks, so temperature matters everywhere
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.mul_(scale)
    T = 0.8
    heldout = random_heldout(target, T)
    result = calibrate_temperature(draft, heldout, [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0], refine=7)
    for domain in ("a", "b", "overall"):
        assert result["temperature"][domain] == pytest.approx(scale * T, rel=0.04)
        assert result["acceptance"][domain] == pytest.approx(1.0, abs=0.01)
    assert result["acceptance_at_serving"]["overall"] < 0.97


def test_best_gamma_follows_the_walltime_formula():
    from distill.simulator import best_gamma

    alpha = 0.8
    gamma, speedups = best_gamma([alpha ** k for k in range(1, 9)], {"c": 0.05}, gammas=range(1, 9))
    formula = {g: (1 - alpha ** (g + 1)) / ((1 - alpha) * (g * 0.05 + 1)) for g in range(1, 9)}
    assert gamma == max(formula, key=formula.get)
    assert speedups[4] == pytest.approx(formula[4])
    assert best_gamma([0.1 ** k for k in range(1, 9)], {"c": 0.3}, gammas=range(1, 9))[0] == 1


def test_best_gamma_costs_the_verify_pass_as_measured():
    from distill.simulator import best_gamma

    # with verification costing r_γ, the speedup is (1 + Σ P_k) / (γc + r_γ)
    gamma, speedups = best_gamma([0.5, 0.25], {"c": 0.1, "verify_ratio": {1: 1.5, 2: 1.6}}, gammas=[1, 2])
    assert speedups[1] == pytest.approx(1.5 / 1.6) and speedups[2] == pytest.approx(1.75 / 1.8) and gamma == 2


def test_best_gamma_prices_the_decoders_host_work_per_pass():
    from distill.simulator import best_gamma

    # host work in target steps: 0.05 per plain pass, 0.2 / 0.8 per pass drafting 1 / 4 (linear between)
    host = {"plain": 0.05, "chain": {"1": 0.2, "4": 0.8}, "tree": {"3": 0.3, "6": 0.6}}
    cost = {"c": 0.1, "verify_ratio": {1: 1.5, 2: 1.6}, "host": host}
    gamma, speedups = best_gamma([0.5, 0.25], cost, gammas=[1, 2])
    assert speedups[1] == pytest.approx(1.5 * 1.05 / (0.1 + 1.5 + 0.2))
    assert speedups[2] == pytest.approx(1.75 * 1.05 / (0.2 + 1.6 + 0.4))
    # priced at 0 the same choice would be γ = 2 (the test above); the host work of the longer pass flips it
    assert gamma == 1


def test_policy_simulator_matches_the_walltime_formula_and_prefers_stopping_when_unsure():
    from distill.simulator import HeldOut
    from distill.policy import choose, simulate
    from pipeline.decoding.draft_length import DraftLength
    from pipeline.sampling import Sampling

    n = 400
    heldout = HeldOut([{}], ["d"] * 1, torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), torch.zeros(n),
                      torch.zeros(n, dtype=torch.long), Sampling(), 1, 0)
    everywhere = torch.ones(n, dtype=torch.bool)
    alpha = torch.full((n,), 0.8)
    drafted, accepted = simulate(alpha, None, heldout, everywhere, 4)
    assert drafted == 4 and accepted == pytest.approx(sum(0.8 ** k for k in range(1, 5)), rel=0.02)  # Leviathan eq. 1
    # stretches of sure positions (α = 1, the draft is confident) of varying length, each ended by a hopeless one
    # (α = 0, unsure): a confidence stop drafts through each stretch and stops at its unsure end, which no fixed γ
    # can (with equal stretches the decoder's passes would line up with them and a fixed γ would do as well)
    pattern = [v for run in (1, 5, 2, 7, 3) for v in [1.0] * run + [0.0]]
    alpha = torch.tensor(pattern * (n // len(pattern) + 1))[:n]
    keep = {0.5: alpha.clone()}
    options = [DraftLength("fixed", g) for g in (1, 2, 4, 8)] + [DraftLength("confidence", 16, 0.5)]
    best = choose(alpha, keep, heldout, options, {"c": 0.3})["overall"]
    assert best["draft_length"].policy == "confidence", best


def test_tree_choice_counts_top_k_hits_per_depth_and_prefers_a_tree_where_the_argmax_misses():
    from distill.simulator import HeldOut
    from distill.tree_choice import K_MAX, choose, nodes, simulate
    from pipeline.sampling import Sampling

    n = 400
    heldout = HeldOut([{}], ["d"], torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), torch.zeros(n),
                      torch.zeros(n, dtype=torch.long), Sampling(), 1, 0)
    everywhere = torch.ones(n, dtype=torch.bool)

    def hits(rank: int) -> torch.Tensor:  # greedy: the target's token is the draft's (rank+1)-th choice
        return (torch.full((n, 1), rank) < torch.arange(1, K_MAX + 1)).float()

    # the target's token is the draft's second choice everywhere: a chain never gets past depth 1, a (2, 2, 2)
    # tree accepts all three depths
    assert simulate(hits(1), heldout, everywhere, (1, 1, 1)) == 0.0
    assert simulate(hits(1), heldout, everywhere, (2, 2, 2)) == pytest.approx(3.0, abs=0.02)
    assert simulate(hits(1), heldout, everywhere, (2, 1)) == pytest.approx(1.0, abs=0.01)
    # sampled serving: per-depth probabilities multiply along the path
    half = torch.full((n, K_MAX), 0.5)
    assert simulate(half, heldout, everywhere, (2, 2)) == pytest.approx(0.5 + 0.25, abs=0.01)
    assert nodes((3, 2, 1)) == 3 + 6 + 6
    free = {"c": 0.05, "verify_ratio": None}  # free verification
    best = choose(hits(1), heldout, free, candidates=[(1,), (1, 1, 1), (2, 2), (2, 2, 2)])["overall"]
    assert best["tree"] == [2, 2, 2]
    # the draft's argmax always right: the chain wins (a tree only adds verify cost)
    costly = {"c": 0.05, "verify_ratio": {3: 1.3, 14: 2.35}}  # r(N) for the chain's 3 and the tree's 14 nodes
    best = choose(hits(0), heldout, costly, candidates=[(1, 1, 1), (2, 2, 2)])
    assert best["overall"]["tree"] == [1, 1, 1]


def test_a_tree_deeper_than_a_held_out_row_misses_past_the_rows_end():
    from distill.simulator import HeldOut
    from distill.tree_choice import K_MAX, simulate
    from pipeline.sampling import Sampling

    n = 3  # one row of three positions (a short completion), every top-2 draft token the target's
    heldout = HeldOut([{}], ["d"], torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), torch.zeros(n),
                      torch.zeros(n, dtype=torch.long), Sampling(), 1, 0)
    hits, everywhere = torch.ones(n, K_MAX), torch.ones(n, dtype=torch.bool)
    deeper = simulate(hits, heldout, everywhere, (2, 2, 2, 2, 2))  # five deep over three positions
    assert deeper == pytest.approx(simulate(hits, heldout, everywhere, (2, 2, 2))) and deeper > 0


def _exact_sibling_acceptance(p: list[float], q: list[float], k: int, replace: bool = False) -> float:
    """P(one of k candidates is accepted) by enumerating every draw order: recursive rejection sampling with
    candidates drawn without replacement (q renormalised without the rejected token), or, for the wrong
    variant, i.i.d. draws with q left as it was."""
    def step(p, q, depth):
        if depth == k or sum(q) == 0:
            return 0.0
        total = 0.0
        for x, qx in enumerate(q):
            if qx == 0:
                continue
            a = min(1.0, p[x] / qx)
            residual = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
            mass = sum(residual)
            p_next = [r / mass for r in residual] if mass > 0 else p
            if replace:
                q_next = q
            else:
                q_next = [0.0 if i == x else qi for i, qi in enumerate(q)]
                q_next = [qi / sum(q_next) for qi in q_next] if sum(q_next) > 0 else q_next
            total += qx * (a + (1 - a) * step(p_next, q_next, depth + 1))
        return total

    return step(p, q, 0)


def test_sibling_acceptance_matches_exact_enumeration_and_rejects_iid_siblings():
    from distill.tree_choice import K_MAX, _race

    p = [0.05, 0.4, 0.3, 0.15, 0.1]  # the last column is the bucket the draft cannot propose
    q = [0.5, 0.2, 0.25, 0.05, 0.0]
    estimate = _race(torch.tensor([p]), torch.tensor([q]), 20000, torch.Generator().manual_seed(0))[0]
    exact = [_exact_sibling_acceptance(p, q, k) for k in range(1, K_MAX + 1)]
    iid = [_exact_sibling_acceptance(p, q, k, replace=True) for k in range(1, K_MAX + 1)]
    assert exact[0] == pytest.approx(sum(min(a, b) for a, b in zip(p, q)))  # one sibling: the chain's α
    # Monte Carlo error of a mean of 20k bounded draws: ≤ 0.5/sqrt(20000) ≈ 0.0035 per column; 4 sigma
    assert estimate.tolist() == pytest.approx(exact, abs=0.015)
    assert max(abs(a - b) for a, b in zip(iid[1:], exact[1:])) > 0.05  # the wrong rule is told apart
    assert all(a <= b + 1e-9 for a, b in zip(exact, exact[1:])) and exact[-1] <= 0.9 + 1e-9  # never the bucket


def test_the_simulator_averages_over_the_passes_the_decoder_runs_not_over_every_start():
    """Monte Carlo of the decoder's passes over rows with clustered hard and easy stretches (each pass from t draws
    its acceptances with the rows' α and starts the next pass at t + accepted + 1): the simulator's accepted drafts
    per pass match the draws within 3 SE; the average over every start alike (renewal=False) is rejected."""
    from distill.simulator import HeldOut
    from distill.policy import simulate
    from pipeline.sampling import Sampling

    gen = torch.Generator().manual_seed(0)
    n_rows, length, gamma = 64, 60, 3
    stretch = torch.tensor([0.9] * 10 + [0.1] * 10).repeat(length // 20)  # easy, hard, easy, ...
    alpha = (stretch + 0.05 * torch.randn(n_rows, length, generator=gen)).clamp(0, 1)
    heldout = HeldOut([{}] * n_rows, ["d"] * n_rows, torch.zeros(n_rows * length, 1, dtype=torch.long),
                      torch.zeros(n_rows * length, 1), torch.zeros(n_rows * length),
                      torch.arange(n_rows).repeat_interleave(length), Sampling(), 1, 0)
    everywhere = torch.ones(n_rows * length, dtype=torch.bool)
    accepted_per_pass = []
    for _ in range(40):
        for row in alpha:
            t = 0
            while t < length:
                k = 0
                while k < gamma and t + k < length and bool(torch.rand((), generator=gen) < row[t + k]):
                    k += 1
                accepted_per_pass.append(k)
                t += k + 1
    draws = torch.tensor(accepted_per_pass, dtype=torch.float64)
    mean, se = float(draws.mean()), float(draws.std() / len(draws) ** 0.5)
    _, renewal = simulate(alpha.flatten(), None, heldout, everywhere, gamma)
    _, uniform = simulate(alpha.flatten(), None, heldout, everywhere, gamma, renewal=False)
    assert abs(renewal - mean) < 3 * se, (renewal, mean, se)
    assert abs(uniform - mean) > 10 * se, (uniform, mean, se)


def test_the_simulator_counts_tokens_over_passes_in_closed_form():
    """Two rows of n positions, one the draft always wins (α = 1), one it always loses (α = 0): the decoder runs
    n/(γ+1) passes of γ accepted on the first and n passes of 0 on the second, so accepted per pass is the ratio of
    sums γ/(γ+2), not the mean of the rows' rates γ/2 (what a mean over rows or over every start gives)."""
    from distill.simulator import HeldOut
    from distill.policy import simulate
    from pipeline.sampling import Sampling

    gamma, n = 3, 40  # n a multiple of γ + 1: the first row ends on a pass's bonus token
    alpha = torch.cat([torch.ones(n), torch.zeros(n)])
    heldout = HeldOut([{}] * 2, ["d"] * 2, torch.zeros(2 * n, 1, dtype=torch.long), torch.zeros(2 * n, 1),
                      torch.zeros(2 * n), torch.arange(2).repeat_interleave(n), Sampling(0.7), 1, 0)
    everywhere = torch.ones(2 * n, dtype=torch.bool)
    drafted, accepted = simulate(alpha, None, heldout, everywhere, gamma)
    assert drafted == pytest.approx(gamma) and accepted == pytest.approx(gamma / (gamma + 2))
    _, uniform = simulate(alpha, None, heldout, everywhere, gamma, renewal=False)
    assert uniform > 1.5 * gamma / (gamma + 2)  # the wrong average is told apart


# ---------------------------------------------------------------- keep_best under an engine's rule
def test_an_engine_that_drafts_the_argmax_keeps_the_weights_that_accept_more_under_its_rule():
    """Refinement can raise Σ min(p_T, q_T) while lowering p_T(argmax q) (the refined Qwen draft in llama-server):
    a flattened copy of the target (same argmaxes) against a noisier sharper one. Our decoder's rule prefers the
    noisy draft, llama.cpp's greedy drafting the flat one, and weights_for_rule must judge by the engine's rule;
    the same draft on both sides is a tie, which keeps the trained weights as keep_best does."""
    import copy

    from distill.simulator import acceptance
    from distill.engines import weights_for_rule

    target = peaked_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(1 / 5)
    flat, noisy = copy.deepcopy(target), copy.deepcopy(target)
    noise = torch.randn(noisy.lm_head.weight.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        flat.lm_head.weight.mul_(0.2)
        noisy.lm_head.weight.add_(0.3 * noisy.lm_head.weight.std() * noise)
    T = 0.7
    heldout = random_heldout(target, T)
    sampled = {name: float(acceptance(m, heldout, [T])[0].mean()) for name, m in (("flat", flat), ("noisy", noisy))}
    assert sampled["noisy"] > sampled["flat"] + 0.1  # the wrong judge (our decoder's rule) would ship the noisy one
    for rule in ("interval", "mean"):
        judged = weights_for_rule(noisy, flat, heldout, rule=rule)
        alpha = judged["acceptance_calibration"]
        assert judged["selected"] == "init" and alpha["init"] > alpha["distilled"] + 0.03 and judged["rule"] == rule
        assert weights_for_rule(flat, noisy, heldout, rule=rule)["selected"] == "distilled"
    same = copy.deepcopy(noisy)
    assert weights_for_rule(noisy, same, heldout, rule="mean")["selected"] == "distilled"  # a tie keeps the trained
    assert weights_for_rule(noisy, same, heldout, rule="interval")["selected"] == "init"  # a tie shows no gain


def _rows_heldout(positions_per_row: int, rows: int):
    from types import SimpleNamespace

    row_of = torch.arange(rows).repeat_interleave(positions_per_row)
    return SimpleNamespace(row_of=row_of, n_positions=len(row_of))


def test_keep_best_ships_trained_weights_only_for_a_gain_the_rows_resolve():
    """A gain that sits within the rows' spread (half the rows up, half down, a small mean gain) ships under the
    mean rule — the deliberately weaker judge, shown to disagree — and not under the interval rule; a gain every row
    shares ships under both; a loss under neither. One row has no interval: the interval rule judges as the mean."""
    from distill.simulator import keep_best

    heldout = _rows_heldout(10, 12)
    initial = torch.full((heldout.n_positions,), 0.6)
    swing = torch.tensor([0.12, -0.10] * 6).repeat_interleave(10)  # mean +0.01, rows ±0.1
    noisy_gain = keep_best(initial, initial + swing, heldout, "interval")
    assert noisy_gain["selected"] == "init" and noisy_gain["ci95"][0] < 0 < noisy_gain["ci95"][1]
    assert abs(noisy_gain["difference"] - 0.01) < 1e-6
    assert keep_best(initial, initial + swing, heldout, "mean")["selected"] == "distilled"  # the wrong judge ships it
    shared = initial + 0.01 + torch.linspace(0, 0.002, heldout.n_positions)
    for rule in ("interval", "mean"):
        assert keep_best(initial, shared, heldout, rule)["selected"] == "distilled"
        assert keep_best(initial, initial - 0.01, heldout, rule)["selected"] == "init"
    one_row = _rows_heldout(10, 1)
    single = keep_best(initial[:10], initial[:10] + 0.01, one_row, "interval")
    assert single["ci95"] is None and single["selected"] == "distilled"


def test_the_model_card_says_which_weights_an_engine_serves():
    from types import SimpleNamespace

    from distill.export import _weights_line

    spec = SimpleNamespace(selected="distilled")
    assert _weights_line(spec, None) == [] and _weights_line(spec, {"selected": "distilled"}) == []
    apart = _weights_line(spec, {"selected": "init", "acceptance_calibration": {"distilled": 0.5, "init": 0.6},
                                 "ci95": [-0.15, -0.05], "rule": "interval"})
    assert "initial draft's" in apart[0] and "0.500" in apart[0] and "0.600" in apart[0] and "[-0.150, -0.050]" in apart[0]
    same = _weights_line(spec, {"selected": "distilled", "acceptance_calibration": {"distilled": 0.6, "init": 0.5}})
    assert "same as the checkpoint's" in same[0]


def test_the_draft_is_judged_as_it_serves_in_the_serving_dtype():
    """keep_best, the learning curve and calibrate judge the draft in the serving dtype (the target's): an update of the
    fp32 master weights below bf16's half spacing, which the bf16 export and bf16 training forwards both round away,
    leaves the judged α exactly the served draft's; the fp32 draft run in fp32 (the old judge) reads a difference."""
    import copy
    from types import SimpleNamespace

    from distill.simulator import acceptance
    from distill.heldouts import as_served, serving_alpha
    from pipeline.sampling import Sampling

    target = peaked_target()
    heldout = random_heldout(target, 1.0)
    served = copy.deepcopy(target).to(torch.bfloat16)
    draft = copy.deepcopy(served).float()
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(1 + 2 ** -10)  # below half of bf16's relative spacing (≥ 2^-9): rounds back to the served value
    assert all(torch.equal(a.bfloat16(), b) for a, b in zip(draft.parameters(), served.parameters()))

    judged = serving_alpha(SimpleNamespace(draft=draft, serving_dtype=torch.bfloat16, sampling=Sampling(1.0)),
                           heldout, None)
    assert torch.equal(judged, acceptance(served, heldout, [1.0])[0])
    assert not torch.equal(acceptance(draft, heldout, [1.0])[0], judged)  # wrong variant: the fp32 judge
    assert next(draft.parameters()).dtype == torch.float32  # the trained model itself is left as it was
    assert as_served(draft, torch.float32) is draft


def test_the_served_copy_of_a_draft_in_training_is_freed_after_each_held_out_evaluation(monkeypatch):
    """A draft in training carries its forward bound to itself as an attribute (accelerate's autocast wrapper), so
    its served copy is a reference cycle; served_acceptance frees it on return. The wrong variant — the copy only
    dropped — outlives the evaluation (on the real pair: 1.3 GB per evaluation, until 24 GiB ran out)."""
    import copy
    import gc
    import types
    import weakref

    from distill import heldouts
    from distill.simulator import acceptance

    target = peaked_target()
    heldout = random_heldout(target, 1.0)
    draft = copy.deepcopy(target).float()
    draft.forward = types.MethodType(type(draft).forward, draft)  # as accelerate's prepare_model binds it
    copies = []
    monkeypatch.setattr(heldouts, "as_served", lambda m, dtype: copies.append(
        weakref.ref(served := heldouts.__dict__["copy"].deepcopy(m).to(dtype))) or served)
    gc.disable()  # no full collection by chance: only what the code frees is freed
    try:
        acceptance(heldouts.as_served(draft, torch.bfloat16), heldout, [1.0])  # the wrong variant
        assert copies[-1]() is not None, "the copy was freed without a collection: nothing to test"
        gc.collect()
        alphas = heldouts.served_acceptance(draft, torch.bfloat16, heldout, [1.0], None)
        assert copies[-1]() is None and len(alphas) == 1
    finally:
        gc.enable()


def test_the_served_copy_is_the_model_cast_with_ties_kept_and_the_original_untouched(tiny_llama_factory):
    """as_served converts each tensor straight into the copy (no second fp32 model): the same weights and logits as
    deepcopy(model).to(dtype), tied embeddings still one tensor, the fp32 model as it was."""
    import copy

    from distill.heldouts import as_served

    model = tiny_llama_factory(tie=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    served, cast = as_served(model, torch.bfloat16), copy.deepcopy(model).to(torch.bfloat16)
    assert served.lm_head.weight is served.model.embed_tokens.weight
    assert all(torch.equal(a, b) for a, b in zip(served.state_dict().values(), cast.state_dict().values()))
    tokens = torch.randint(0, model.config.vocab_size, (1, 7))
    assert torch.equal(served(tokens).logits, cast(tokens).logits)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert next(model.parameters()).dtype == torch.float32
