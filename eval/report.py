"""report.md: a short results page (setup, the tables of eval/tables.py, advice, checks, sweeps, fidelity, plots),
requests.jsonl and the tracker's metrics."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from eval.metrics import flat_metrics
from eval.plots import write_plots
from eval.tables import (BATCH_PREDICTIONS, batch_rows, batch_verdict, comparison_lines, comparison_text, domain_rows,
                         draft_rows, latency_rows, markdown_table, method_label, method_rows, num, policy_rows,
                         speedup_text)
from pipeline.atomic import atomic_dir, write_json
from pipeline.decoding.cost import predicted_speedup
from pipeline.measure.intervals import N_RESAMPLES
from pipeline.machine import cpu_name

CI_NOTE = (f"[lo, hi] = 95% confidence interval: bootstrap over requests ({N_RESAMPLES:,} resamples, BCa, "
           "percentile where BCa degenerates), each resample taking the same requests for a method and for the "
           "autoregressive run, of the same pooled ratio as the estimate; `n<2, no CI`: a single request gives "
           "no interval. With only a few requests the bootstrap understates the spread (3 requests allow 10 "
           "distinct resamples), so a domain with fewer requests than eval.min_requests_for_ci shows its point "
           "estimate alone (`n=3, no CI`); the overall interval always stands. `off (plain)`: the domain is "
           "calibrated off, so the method decodes plainly there — the plain run's tokens and time, not timed twice.")
def machine() -> dict:
    """Where the numbers were measured: they mean nothing without it."""
    import transformers

    info = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _model_line(ident: dict) -> str:
    params = ident.get("n_params")
    if not params:
        size = "size unknown"
    else:
        size = f"{params / 1e6:.1f}M parameters" if params >= 1e5 else f"{params:,} parameters"
    layers = ident.get("num_hidden_layers")
    source = ident.get("source", ident.get("path", "?"))
    return f"{source} — {ident.get('architecture', '?')}, {layers} layers, {size}"


def _step_and_r(spec: dict) -> tuple[float, float]:
    """The target's 1-token step (ms) implied by c and the draft forward, and r = verify pass / step."""
    c, draft_ms, verify_ms = spec.get("c") or 0.0, spec.get("draft_forward_ms", 0.0), spec.get("verify_forward_ms", 0.0)
    step_ms = draft_ms / c if c else 0.0
    return step_ms, verify_ms / step_ms if step_ms and verify_ms else 1.0


def _cost_line(spec: dict, measured: float) -> str:
    """c and the speedup the measured acceptance predicts (Leviathan et al. Thm 3.8 with the verify pass costed as
    measured: L / (Dc + r), L the measured mean accepted length), so a reader can tell a weak draft from overhead."""
    gamma, c = spec.get("drafted_per_pass") or spec.get("gamma", 0), spec.get("c", 0.0)
    mal = spec.get("mean_accepted_length", 0.0)
    if c is None:  # HF generate and the engines time whole requests, not each forward
        return (f"mean accepted length {mal:.2f} at {gamma:.2f} drafts per pass, measured {measured:.2f}× (this engine "
                "reports no per-forward times, so c and the time model's prediction are not shown)")
    draft_ms, verify_ms = spec.get("draft_forward_ms", 0.0), spec.get("verify_forward_ms", 0.0)
    step_ms, r = _step_and_r(spec)
    predicted = predicted_speedup(mal - 1, gamma, c, r) if gamma else 0.0
    return (f"c (draft forward / target forward) = {c:.3f} (draft {draft_ms:.1f} ms, target step {step_ms:.1f} ms, "
            f"verify pass {verify_ms:.1f} ms, r = {r:.2f}). Time model (Leviathan et al. Thm 3.8, verify costed "
            f"as measured): mean accepted length {mal:.2f} / (Dc + r) at D = {gamma:.2f} drafts per pass predicts "
            f"{predicted:.2f}×; "
            f"measured {measured:.2f}× (the rest is prefill, sampling and the decoder's own overhead, and γ "
            "varying by domain).")


def slowdown_advice(metrics: dict) -> str | None:
    """When speculative decoding ran slower than plain decoding: why, in the time model's terms, and what to
    change. None when it did not."""
    spec, speedup = metrics["overall"].get("speculative") or {}, metrics["overall"].get("speedup") or 0.0
    if not spec or speedup >= 1.0 or spec.get("c") is None:  # no per-forward times: nothing to explain it with
        return None
    length, drafted, c = spec.get("mean_accepted_length", 0.0), spec.get("drafted_per_pass", 0.0), spec.get("c", 0.0)
    r = _step_and_r(spec)[1]
    fixes = []
    if r > 1.15:
        fixes.append(f"a verify pass costs {r:.2f} decoding steps on this device: try the other runtime.dtype "
                     "(float32 or bfloat16), whichever makes multi-token forwards cheaper")
    if drafted * c > 0.3 * length:
        fixes.append(f"the drafts cost {drafted * c:.2f} target steps per pass: a cheaper draft (fewer layers, a "
                     "smaller FR-Spec head) or shorter drafts (eval.draft_length=confidence)")
    if length < 1.5:
        fixes.append(f"only {length:.2f} tokens per target pass: distil longer or on more data "
                     "(distill.trainer.max_steps, collect.max_prompts_per_domain)")
    return (f"speculative decoding ran at {speedup:.2f}× plain decoding: each target pass yielded {length:.2f} tokens "
            f"for {drafted:.2f} draft steps at c = {c:.3f} and a verify pass of {r:.2f} steps "
            f"({drafted:.2f}·c + r = {drafted * c + r:.2f} > {length:.2f}). What to change: "
            + ("; ".join(fixes) if fixes else "nothing single stands out; see report.md's time model") + ".")


def _fidelity(metrics: dict) -> list[str]:
    fid = metrics.get("fidelity") or {}
    if not fid:
        return []
    lines = ["## Fidelity", ""]
    if metrics["temperature"] == 0:
        lines.append("Greedy decoding: speculative output must equal the target's own autoregressive output token "
                     "for token (speculative decoding is lossless). Share of prompts that match exactly, all turns:")
    else:
        lines.append(f"Sampling at T={metrics['temperature']} is checked in distribution by the decoder's tests; "
                     f"here a separate greedy run on {fid.get('n_prompts')} prompt(s) per domain compares "
                     "speculative and autoregressive outputs token for token:")
    lines += ["", markdown_table(["domain", "greedy match"],
                                 [[d, num(v)] for d, v in fid["by_domain"].items()] + [["all", num(fid["share"])]]), ""]
    mismatches = fid.get("mismatches") or []
    if mismatches:
        lines += ["Each mismatch with the target's top-2 logit gap where the outputs first differ (a near-tie is a "
                  f"gap ≤ {fid.get('near_tie_ulps')} ulp of the top logit in the serving dtype: the batched verify "
                  "pass and the 1-token step round differently there; a larger gap would be a decoder bug):", "",
                  markdown_table(["draft", "domain", "prompt", "turn", "first differing token", "top-2 gap", "ulp",
                                  "near-tie"],
                                 [[str(x) for x in (m.get("method", "speculative"), m["domain"], m["prompt_id"], m["turn"],
                                                    m["position"], m["top2_gap"], m["ulp"])]
                                  + ["yes" if m["near_tie"] else "**no**"] for m in mismatches]),
                  ""]
    fp32 = fid.get("fp32")
    if fp32:
        lines += [f"The mismatched request(s) of the tuned draft again, greedy, with float32 copies of both models "
                  f"({fp32['n_prompts']} prompt(s)): match share **{num(fp32['share'])}**"
                  + (" — every reduced-precision mismatch above was rounding." if fp32["share"] == 1.0 else
                     f"; {len(fp32['mismatches'])} mismatch(es) remain in fp32: a decoder bug to investigate."), ""]
    if fid["share"] < 1.0 and not mismatches and not fp32:
        lines.append("A mismatch under greedy decoding in reduced precision can come from a near-tie between two "
                     "tokens resolved differently by a batched verify pass and a single-token step; in fp32 it "
                     "points at a decoder bug.")
    return lines


def control_lines(metrics: dict) -> list[str]:
    """The control pair's verdict (eval/metrics.py control_check)."""
    control = metrics.get("control")
    if not control:
        return []
    low, high = control["band"]
    head = (f"Control pair (own plain decoding vs HF generate, the same computation): {len(control['disturbed'])} of "
            f"{control['n_requests']} requests outside {low}–{high}× of each other")
    if not control["disturbed"]:
        return [head + ": no request was disturbed by other load."]
    names = ", ".join(f"{d} {p} turn {t}" for d, p, t in control["disturbed"])
    clean = control.get("without_disturbed")
    if not clean:
        return [head + f" — every request was disturbed by other load ({names}): read no timing of this run."]
    # the unfiltered figure (every request, the headline) first, the filtered one beside it, each labelled
    unfiltered = (control.get("unfiltered") or {}).get("speedup", {})
    n, kept = control["n_requests"], control["n_requests"] - len(control["disturbed"])

    def both(method: str, filtered: dict) -> str:
        first = f"{speedup_text(unfiltered[method])} unfiltered (all {n} requests), " if method in unfiltered else ""
        return f"{method_label(method)} {first}{speedup_text(filtered)} filtered (without the disturbed, {kept} requests)"
    speedups = "; ".join(both(m, v) for m, v in clean["speedup"].items())
    return [head + f" (band fixed before the run, eval.control_band) — disturbed by other load: {names}. "
                   f"Overall speedup: {speedups}.",
            *[comparison_text("overall without them", name.removeprefix("speculative_vs_"), c)
              for name, c in clean["comparisons"].items()]]


def stall_lines(metrics: dict) -> list[str]:
    """The stall rule's verdict (eval.stall, eval/harness.py retime_stalls)."""
    stalls = metrics.get("stalls")
    if not stalls:
        return []
    rule = stalls["rule"]
    head = (f"Stall rule (fixed before the run, eval.stall: a method slower than {rule['factor']:g}× its median seconds "
            f"per token; re-timed up to {rule['retimes']}×): {len(stalls['suspects'])} of {stalls['n_requests']} "
            f"requests re-timed, {len(stalls['disturbed'])} still disturbed")
    if not stalls["disturbed"]:
        return [head + "."]
    names = ", ".join(f"{d} {p} turn {t}" for d, p, t in stalls["disturbed"])
    if not stalls.get("n_excluded"):
        return [head + f" ({names}) — every request: read no timing of this run."]
    unfiltered = "; ".join(f"{method_label(m)} {speedup_text(v)}" for m, v in stalls["unfiltered"]["speedup"].items())
    return [head + f" ({names}): kept out of every figure above ({stalls['n_excluded']} requests). "
                   f"Overall with them: {unfiltered}."]


def _setup_lines(metrics: dict) -> list[str]:
    setup = metrics["setup"]
    m = setup["machine"]
    sampling = (f"temperature {metrics['temperature']}" + (" (greedy)" if metrics["temperature"] == 0 else "")
                + f", top-k {metrics['top_k']}, top-p {metrics['top_p']}, max {metrics['max_new_tokens']} new tokens")
    lines = [
        "# Speculative decoding evaluation", "",
        "## Setup", "",
        f"- **target**: {_model_line(setup['target'])}",
        f"- **draft**: {_model_line(setup['draft'])}",
    ]
    if setup.get("draft_init"):
        lines.append(f"- **draft (undistilled)**: {_model_line(setup['draft_init'])}")
    if setup["draft"].get("vocab_subset"):
        lines.append(f"- draft head restricted to {setup['draft']['vocab_subset']:,} target tokens (FR-Spec)")
    lines += [
        f"- **machine**: {m['cpu']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads"
        + (f", GPU {m['gpu']}" if m.get("gpu") else "") + f"), device {setup['device']}, {setup['dtype']}; "
        f"torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}",
        f"- **decoding**: {sampling}; draft length per domain as the table's last column"
        + ("; draft length and τ per domain from the draft's `speculative.json`" if setup.get("calibrated") else ""),
        f"- **prompts**: {setup['prompt_source']} — "
        + ", ".join(f"{d} {p['n_prompts']} ({p['n_turns']} turn{'s' * (p['n_turns'] != 1)})"
                    for d, p in setup["prompts"].items()),
        "- every request (one user turn) ran with every method back to back, in rotating order, after a "
        "warm-up; later turns are conditioned on the target's own autoregressive answer",
        f"- wall time of the measurement: {metrics['wall_s']:.0f} s"
        + (" (" + ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in metrics["wall_s_parts"].items()) + ")"
           if metrics.get("wall_s_parts") else "")
        + (f"; the {metrics['budget']['max_minutes']}-minute budget (eval.max_minutes) stopped it after "
           f"{metrics['budget']['prompts_done']} of {metrics['budget']['prompts_planned']} prompts"
           if metrics.get("budget") else ""), "",
    ]
    return lines


def _result_lines(metrics: dict) -> list[str]:
    lines = [
        "## Results per domain", "",
        markdown_table(*domain_rows(metrics)), "",
        "acceptance = accepted / proposed draft tokens; mean acc. len = generated tokens per target pass "
        "(bonus token included; the first pass is the plain prefill, 1 token); speedup = tokens/s of "
        "speculative over autoregressive decoding on the same requests (equal to the time ratio when both emit "
        "the same tokens); "
        "draft τ `=T`: the draft samples at the target's temperature.", "",
        CI_NOTE, "",
        "## Methods (all domains)", "",
        markdown_table(*method_rows(metrics)), "",
        _cost_line(metrics["overall"]["speculative"], metrics["overall"]["speedup"]), "",
    ]
    if overall := metrics.get("predicted_overall"):
        lines += [f"Calibration predicted {overall['speedup']:.2f}× overall for these requests (each domain's predicted "
                  f"speedup, mixed by the tokens generated in it); measured {metrics['overall']['speedup']:.2f}×.", ""]
    if advice := slowdown_advice(metrics):
        lines += [f"**Slower than plain decoding.** {advice}", ""]
    header, rows = latency_rows(metrics)
    if rows:
        lines += ["## Streaming latency", "", markdown_table(header, rows), "",
                  "TTFT = time to the first token (every own method's first pass is the same plain prefill); ITL = "
                  "inter-token latency after it, a chunk of k tokens committed g after the previous one counting as "
                  "k tokens of g/k (mean = Σ(last − first commit) / Σ(tokens − 1)); TTFT / AR and ITL speedup are "
                  "paired over the same requests with 95% bootstrap CIs.", ""]
    if any(m.startswith("speculative_") and m != "speculative_init" and m.removeprefix("speculative_") not in
           ("fixed", "confidence", "heuristic") for m in metrics["methods"]):
        lines += ["## Drafts side by side (eval.extra_drafts)", "", markdown_table(*draft_rows(metrics)), ""]
    if any("speculative_fixed" in d for d in metrics["domains"].values()):
        lines += ["## Draft-length policies", "", markdown_table(*policy_rows(metrics)), ""]
    comparisons = comparison_lines(metrics)
    if comparisons:
        lines += ["## Comparisons", "", "Ratio of the evaluated draft's speedup to each other method's on the same "
                  "requests (= ratio of their tokens/s), with a paired bootstrap 95% CI:", "",
                  *[f"- {c}" for c in comparisons], ""]
    control, stalls = control_lines(metrics), stall_lines(metrics)
    if control:
        lines += ["## Control pair", "", *[f"- {line}" for line in control], ""]
    if stalls:
        lines += ["## Timing checks", "", *[f"- {line}" for line in stalls], ""]
    return lines


def _sweep_lines(metrics: dict) -> list[str]:
    lines = []
    sweep = metrics.get("gamma_sweep")
    if sweep:
        rows = [[g, num(p["acceptance_rate"]), num(p["mean_accepted_length"]), num(p["tokens_per_s"], ".1f"),
                 speedup_text(p)] for g, p in sweep["by_gamma"].items()]
        lines += ["## γ sweep", "", f"On {sweep['n_requests']} requests ({sweep['n_prompts_per_domain']} prompt(s) "
                  "per domain), evaluated draft, each γ interleaved with an autoregressive run of the same "
                  "request.", "",
                  markdown_table(["γ", "acceptance", "mean acc. len", "tok/s", "speedup"], rows), ""]
    trees = metrics.get("tree_sweep")
    if trees:
        rows = [[f"({k})", num(p["drafted_per_pass"], ".1f"), num(p["mean_accepted_length"]), num(p["tokens_per_s"], ".1f"),
                 speedup_text(p), num(p["predicted_speedup"]) + ("×" if p["predicted_speedup"] else "")]
                for k, p in trees["by_tree"].items()]
        lines += ["## Tree sweep", "", f"On {trees['n_requests']} requests ({trees['n_prompts_per_domain']} prompt(s) "
                  "per domain), evaluated draft, each tree interleaved with an autoregressive run of the same "
                  "request; predicted = distill's simulator on its reporting part with the cost profile, averaged "
                  "over the requests' domains.", "",
                  markdown_table(["tree", "nodes/pass", "mean acc. len", "tok/s", "speedup", "predicted"], rows), ""]
    batches = metrics.get("batch_sweep")
    if batches and batches["by_batch"]:
        lines += ["## Batch sweep", "", "Batched speculation (pipeline/decoding/batch.py) against batched plain "
                  f"decoding on the first turns of {batches['n_prompts']} prompts cut into batches of B, both in "
                  f"rotating order; predicted = {BATCH_PREDICTIONS[batches['prediction']]}; no host = the same γ "
                  "priced by its forwards alone.", "", markdown_table(*batch_rows(batches)), "",
                  batch_verdict(batches), ""]
    return lines


def write_outputs(out_dir: Path, metrics: dict, records: list[dict]) -> list[str]:
    """metrics.json, requests.jsonl (raw per-request numbers), plots and report.md (the setup, the tables, advice,
    checks, sweeps, fidelity, plots), in one atomic rename."""
    stalls = metrics.get("stalls") or {}
    disturbed = {tuple(key) for key in stalls.get("disturbed", [])} if stalls.get("n_excluded") else set()
    with atomic_dir(out_dir) as tmp:
        write_json(tmp / "metrics.json", metrics)
        with open(tmp / "requests.jsonl", "w") as f:
            for r in records:
                row = {k: r[k] for k in ("method", "domain", "prompt_id", "turn", "time_s")}
                row["n_tokens"] = len(r["tokens"])
                row.update({k: r[k] for k in ("reused", "retimed") if r.get(k)})  # a copy of the plain run; re-timed
                if (r["domain"], r["prompt_id"], r["turn"]) in disturbed:
                    row["disturbed"] = True  # kept out of metrics.json's figures (eval.stall)
                if r["stats"] is not None and r["method"] != "autoregressive":
                    row["accepted"] = r["stats"].accepted  # accepted drafts per verify pass
                if getattr(r["stats"], "chunk_times", None):  # own methods: when each pass's tokens were committed
                    row["ttft_s"], row["itl_mean_s"] = r["stats"].ttft, r["stats"].mean_itl
                f.write(json.dumps(row) + "\n")
        plots = write_plots(metrics, records, tmp)
        lines = _setup_lines(metrics) + _result_lines(metrics) + _sweep_lines(metrics) + _fidelity(metrics)
        lines += ["## Plots", ""] + [f"![{p.removesuffix('.png')}]({p})" for p in plots] + [""]
        (tmp / "report.md").write_text("\n".join(lines))
    return plots


def log_to_tracker(tracker, metrics: dict, out_dir: Path) -> None:
    # Tags, not params: the config (eval.draft=null, eval.gamma=null, ...) is already logged as params,
    # and MLflow refuses to change a param; these are what those settings resolved to.
    tracker.set_tags({"eval.resolved_draft": metrics["draft"][:250], "eval.resolved_gamma": metrics["gamma"],
                      "eval.temperature": metrics["temperature"]})
    tracker.log_metrics(flat_metrics(metrics))
    for k, value in enumerate(metrics["overall"]["speculative"].get("per_position_acceptance", []), 1):
        tracker.log_metrics({"overall.speculative.per_position_acceptance": value}, step=k)
    for g, point in (metrics.get("gamma_sweep") or {}).get("by_gamma", {}).items():
        tracker.log_metrics({f"gamma_sweep.{key}": v for key, v in point.items()}, step=int(g))
    tracker.log_artifacts(str(out_dir), "eval")
