"""The tables eval prints and report.md renders: one row builder per table over metrics.json, their labels and
number formats, and the text and markdown renderings."""
from __future__ import annotations

METHOD_LABELS = {"autoregressive": "own autoregressive", "speculative": "own speculative",
                 "speculative_init": "own speculative, undistilled draft", "hf_generate": "HF generate",
                 "hf_assisted": "HF assisted (HF defaults)", "hf_assisted_fixed": "HF assisted (fixed γ)",
                 "hf_assisted_calibrated": "HF assisted (our calibration)",
                 "speculative_fixed": "own speculative, fixed γ", "speculative_confidence": "own speculative, confidence stop",
                 "speculative_heuristic": "own speculative, HF heuristic schedule"}


def num(value, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def with_ci(value, ci, fmt: str = ".2f", unit: str = "", withheld: str | None = None) -> str:
    """`1.38× [1.21, 1.52]`; a null interval says why instead of hiding: `withheld` (a domain with fewer requests
    than eval.min_requests_for_ci, e.g. "n=3, no CI"), else fewer than 2 requests."""
    if value is None:
        return "–"
    if ci is None:
        bounds = f"({withheld})" if withheld else "[n<2, no CI]"
    else:
        bounds = f"[{num(ci[0], fmt)}, {num(ci[1], fmt)}]"
    return f"{num(value, fmt)}{unit} {bounds}"


def _withheld(group: dict) -> str | None:
    """"n=3, no CI" for a group whose intervals were withheld (eval.min_requests_for_ci), else None."""
    return f"n={group.get('n_requests')}, no CI" if group.get("ci_withheld") else None


def speedup_text(m: dict, withheld: str | None = None) -> str:
    if m.get("off"):  # calibrated off: plain decoding, timed once (eval/harness.py decodes_plainly)
        return "off (plain)"
    return with_ci(m.get("speedup"), m.get("speedup_ci95"), unit="×", withheld=withheld)


def _tau(tau, temperature: float, row: str) -> str:
    if temperature == 0 or row == "overall":
        return "–"  # greedy: the draft proposes its argmax, no temperature involved
    return "=T" if tau is None else num(tau)


def _drafting(m: dict) -> str:
    """What drafted for a method: its token tree when it ran one, else its draft-length policy."""
    if m.get("tree"):
        return "tree (" + ", ".join(map(str, m["tree"])) + ")"
    entry = m.get("draft_length")
    if not entry:
        return "–"
    if entry["policy"] == "confidence":
        return f"conf ≥ {entry['threshold']:g}, ≤ {entry['max']}"
    return f"{entry['policy']} {entry['max']}"


def domain_rows(metrics: dict) -> tuple[list[str], list[list[str]]]:
    """The headline table: one row per domain plus `overall`."""
    header = ["domain", "n", "acceptance init→tuned", "mean acc. len", "drafts/pass", "tok/s AR", "tok/s spec",
              "speedup", "greedy match", "draft τ", "draft length"]
    rows = []
    for name, d in [*metrics["domains"].items(), ("overall", metrics["overall"])]:
        spec, init, ar = d.get("speculative", {}), d.get("speculative_init"), d.get("autoregressive", {})
        withheld = _withheld(d)
        acceptance = _acceptance(spec, withheld)
        if init:
            acceptance = f"{'off' if init.get('off') else num(init.get('acceptance_rate'))}→{acceptance}"
        off = bool(spec.get("off"))
        rows.append([name, str(d.get("n_prompts", "")), acceptance,
                     "–" if off else num(spec.get("mean_accepted_length")),
                     "–" if off else num(spec.get("drafted_per_pass")), num(ar.get("tokens_per_s"), ".1f"),
                     "= AR" if off else num(spec.get("tokens_per_s"), ".1f"),
                     "off (plain)" if off else with_ci(d.get("speedup"), d.get("speedup_ci95"), unit="×",
                                                   withheld=withheld),
                     num(d.get("greedy_match")), "–" if off else _tau(spec.get("draft_temperature"),
                                                                     metrics["temperature"], name),
                     "off" if off else _drafting(spec)])
    return header, rows


def _acceptance(m: dict, withheld: str | None = None) -> str:
    if m.get("off"):
        return "off"
    if "acceptance_rate" not in m:
        return "–"
    return with_ci(m["acceptance_rate"], m.get("acceptance_rate_ci95"), withheld=withheld)


def method_rows(metrics: dict) -> tuple[list[str], list[list[str]]]:
    """Every method's tokens/s, latency and speedup over all domains."""
    header = ["method", "tok/s", "latency p50 (s)", "latency p95 (s)", "speedup", "greedy match"]
    rows = []
    for method in sorted(metrics["methods"], key=_method_order):
        m, label = metrics["overall"].get(method), method_label(method, engine_of(metrics))
        if m:
            rows.append([label, num(m["tokens_per_s"], ".1f"), num(m["latency_p50_s"]), num(m["latency_p95_s"]),
                         "1.00×" if method == "autoregressive" else speedup_text(m),
                         "ref" if method == "autoregressive" else num(m.get("greedy_match"))])
    return header, rows


def latency_rows(metrics: dict) -> tuple[list[str], list[list[str]]]:
    """Streaming latency per domain and own method, the ratios to plain decoding with their intervals."""
    header = ["domain", "method", "TTFT p50 (ms)", "TTFT p95 (ms)", "ITL mean (ms)", "ITL p50 (ms)", "ITL p95 (ms)",
              "TTFT / AR", "ITL speedup", "speedup"]
    rows = []
    for name, d in [*metrics["domains"].items(), ("overall", metrics["overall"])]:
        for method in sorted(metrics["methods"], key=_method_order):
            m = d.get(method)
            if not isinstance(m, dict) or m.get("ttft_p50_s") is None or m.get("off"):
                continue  # an off method's stream is the plain run's
            ms = [num(None if m.get(k) is None else 1000 * m[k], ".1f")
                  for k in ("ttft_p50_s", "ttft_p95_s", "itl_mean_s", "itl_p50_s", "itl_p95_s")]
            plain = method == "autoregressive"
            rows.append([name, method, *ms, "1.00" if plain else with_ci(m.get("ttft_ratio"), m.get("ttft_ratio_ci95")),
                         "1.00×" if plain else with_ci(m.get("itl_speedup"), m.get("itl_speedup_ci95"), unit="×"),
                         "1.00×" if plain else speedup_text(m)])
    return header, rows


HF_ENGINE_LABELS = {"autoregressive": "HF generate", "speculative": "HF assisted",  # eval.engine=hf's methods
                    "speculative_init": "HF assisted, undistilled draft"}


def engine_of(metrics: dict) -> str:
    return ((metrics.get("setup") or {}).get("settings") or {}).get("engine", "ours")


def method_label(method: str, engine: str = "ours") -> str:
    if engine == "hf":
        return HF_ENGINE_LABELS.get(method, f"HF assisted, draft `{method.removeprefix('speculative_')}`")
    if method in METHOD_LABELS:
        return METHOD_LABELS[method]
    return f"own speculative, draft `{method.removeprefix('speculative_')}`"  # eval.extra_drafts


def _method_order(method: str) -> int:
    order = list(METHOD_LABELS)
    return order.index(method) if method in order else order.index("speculative_init") + 1


def draft_rows(metrics: dict) -> tuple[list[str], list[list[str]]]:
    """Per domain, every method, several drafts side by side (eval.extra_drafts); c = draft step / target step."""
    header = ["domain", "method", "tok/s", "speedup", "acceptance", "mean acc. len", "c", "drafting"]
    own = [m for m in sorted(metrics["methods"], key=_method_order) if m.startswith("speculative")]
    rows = []
    for name, d in [*metrics["domains"].items(), ("overall", metrics["overall"])]:
        rows.append([name, "plain (own autoregressive)", num(d.get("autoregressive", {}).get("tokens_per_s"), ".2f"),
                     "1.00×", "–", "–", "–", "–"])
        for method in own:
            m = d.get(method)
            if m and m.get("off"):
                rows.append([name, method_label(method), num(m.get("tokens_per_s"), ".2f"), speedup_text(m),
                             "off", "–", "–", "off"])
            elif m:
                rows.append([name, method_label(method), num(m.get("tokens_per_s"), ".2f"), speedup_text(m, _withheld(d)),
                             _acceptance(m, _withheld(d)), num(m.get("mean_accepted_length")), num(m.get("c")),
                             _drafting(m)])
        for method in sorted(metrics["methods"], key=_method_order):
            m = d.get(method) if method.startswith("hf_") else None
            if m:
                rows.append([name, method_label(method), num(m.get("tokens_per_s"), ".2f"), speedup_text(m),
                             "–", "–", "–", "–"])
    return header, rows


def policy_rows(metrics: dict) -> tuple[list[str], list[list[str]]]:
    """Per domain and draft-length policy (eval.compare_draft_lengths); wasted = proposed − accepted drafts."""
    header = ["domain", "policy", "drafting", "mean acc. len", "drafts/pass", "wasted/pass", "speedup"]
    rows = []
    for name, d in [*metrics["domains"].items(), ("overall", metrics["overall"])]:
        for method in ("speculative", "speculative_fixed", "speculative_confidence", "speculative_heuristic"):
            m = d.get(method)
            if not m:
                continue
            passes, off = m.get("target_passes") or 1, bool(m.get("off"))
            rows.append([name, "calibrated" if method == "speculative" else method.removeprefix("speculative_"),
                         "off" if off else _drafting(m), "–" if off else num(m.get("mean_accepted_length")),
                         "–" if off else num(m.get("drafted_per_pass")),
                         "–" if off else num(m.get("wasted_drafts", 0) / passes), speedup_text(m, _withheld(d))])
    return header, rows


def comparison_text(scope: str, name: str, c: dict, engine: str = "ours") -> str:
    spec, other = method_label("speculative", engine), method_label(name, engine)
    ratio, n = with_ci(c["ratio"], c["ci95"], unit="×"), c.get("n_requests")
    if c["within_noise"] is None:
        return f"{scope}: {spec} vs {other}: tokens/s ratio {ratio} — {n} requests, too few to tell from noise."
    if c["within_noise"]:
        return f"{scope}: {spec} and {other} are within noise of each other (tokens/s ratio {ratio}, {n} requests)."
    verdict = "faster" if c["ratio"] > 1 else "slower"
    return f"{scope}: {spec} is {verdict} than {other} beyond noise (tokens/s ratio {ratio}, {n} requests)."


def comparison_lines(metrics: dict) -> list[str]:
    """Each domain's (and overall) paired comparison of the evaluated draft with every other non-AR method, in words."""
    scopes = [*metrics["domains"].items(), ("overall", metrics["overall"])]
    return [comparison_text(scope, key.removeprefix("speculative_vs_"), c, engine_of(metrics))
            for scope, d in scopes for key, c in (d.get("comparisons") or {}).items()]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


BATCH_PREDICTIONS = {"calibration": "the draft's per-batch-size calibration (speculative.json `batching`)",
                     "profile": "a batch profile timed here with the acceptance measured at the smallest B"}


def batch_rows(sweep: dict) -> tuple[list[str], list[list[str]]]:
    """Per batch size (the speedup's CI is over the batches); greedy rows must be identical."""
    header = ["B", "γ", "tok/s plain", "tok/s spec", "speedup", "batches", "acceptance", "identical", "c(B)", "r(B)",
              "predicted", "no host"]
    rows = [[str(size), str(r["gamma"]), num(r["plain_tok_s"], ".1f"), num(r["spec_tok_s"], ".1f"),
             with_ci(r["speedup"], r["ci95"], ".3f", "×"), str(r["n_batches"]), num(r["acceptance"], ".3f"),
             "–" if r["identical"] is None else str(r["identical"]).lower(), num(r["c"], ".3f"), num(r["r"]),
             num(r["predicted"], ".3f"), num(r["no_host"], ".3f")] for size, r in sweep["by_batch"].items()]
    return header, rows


def batch_verdict(sweep: dict) -> str:
    step = "within" if sweep["within_one_step"] else "not within"
    return (f"Break-even batch (from it on speculation loses at every larger B): measured {sweep['break_even']} "
            f"(smallest B whose CI lies below 1: {sweep['ci_below_one']}), predicted {sweep['predicted_break_even']}: "
            f"{step} one step of the grid.")
