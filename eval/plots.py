"""Eval plots (PNG, matplotlib's non-interactive Agg backend so they render on a headless machine)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)

DRAFTS = {"speculative_init": "undistilled draft", "speculative": "evaluated draft"}


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def acceptance_by_domain(metrics: dict, path: Path) -> str:
    """Acceptance rate per domain as eval measured it, undistilled vs tuned draft side by side, with the held-out
    acceptance each draft's calibration measured (speculative.json) as a marker; a domain calibrated off draws no
    bar but the word "off", as the table says it."""
    domains = list(metrics["domains"])
    drafts = [m for m in DRAFTS if any(m in metrics["domains"][d] for d in domains)]
    heldout = metrics.get("heldout_acceptance") or {}
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(domains) + 2), 3.6))
    width = 0.8 / max(len(drafts), 1)
    for i, method in enumerate(drafts):
        xs = [j + (i - (len(drafts) - 1) / 2) * width for j in range(len(domains))]
        runs = [metrics["domains"][d].get(method) for d in domains]
        on = [(x, r["acceptance_rate"]) for x, r in zip(xs, runs) if r and not r.get("off")]
        bars = ax.bar([x for x, _ in on], [v for _, v in on], width, label=f"{DRAFTS[method]} (eval)", color=f"C{i}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        for x, r in zip(xs, runs):
            if r and r.get("off"):
                ax.text(x, 0.02, "off", ha="center", va="bottom", fontsize=7, rotation=90, color=f"C{i}")
        marks = [(x, heldout[method][d]) for x, d in zip(xs, domains) if d in heldout.get(method, {})]
        if marks:
            ax.plot([x for x, _ in marks], [v for _, v in marks], "_", ms=14, mew=2, color="k" if i else "grey",
                    label=f"{DRAFTS[method]} (held-out, calibration)")
    ax.set_xticks(range(len(domains)), domains, rotation=30, ha="right")
    ax.set(ylim=(0, 1.05), ylabel="acceptance rate", title=f"Draft acceptance per domain (T={metrics['temperature']})")
    ax.legend(fontsize=7)
    return _save(fig, path)


def per_position(metrics: dict, path: Path) -> str:
    """P(draft token k accepted) per domain, tuned draft."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for domain, d in metrics["domains"].items():
        values = d.get("speculative", {}).get("per_position_acceptance") or []
        if values:
            ax.plot(range(1, len(values) + 1), values, marker="o", label=domain)
    longest = max((len(d.get("speculative", {}).get("per_position_acceptance") or [])
                   for d in metrics["domains"].values()), default=0)
    ax.set(xticks=range(1, longest + 1), xlabel="draft position k", ylabel="P(token k accepted)", ylim=(0, 1.05),
           title="Per-position acceptance (evaluated draft)")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def gamma_sweep(metrics: dict, path: Path) -> str:
    """Acceptance rate and speedup against γ, from the sweep subset."""
    sweep = metrics["gamma_sweep"]
    gammas = sorted(int(g) for g in sweep["by_gamma"])
    points = [sweep["by_gamma"][str(g)] for g in gammas]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.4))
    left.plot(gammas, [p["acceptance_rate"] for p in points], marker="o", label="acceptance rate")
    left.plot(gammas, [p["mean_accepted_length"] / (g + 1) for p, g in zip(points, gammas)], marker="s",
              label="mean accepted length / (γ+1)")
    left.set(xticks=gammas, xlabel="γ (draft tokens per target pass)", ylim=(0, 1.05), title="Acceptance vs γ")
    left.legend(fontsize=7)
    right.plot(gammas, [p["speedup"] for p in points], marker="o", color="C2")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set(xticks=gammas, xlabel="γ", ylabel="speedup vs autoregressive",
              title=f"Speedup vs γ ({sweep['n_requests']} requests)")
    return _save(fig, path)


def tree_sweep(metrics: dict, path: Path) -> str:
    """Measured speedup of each swept tree against distill's predicted one, and both against tree size."""
    sweep = metrics["tree_sweep"]
    keys = list(sweep["by_tree"])
    points = [sweep["by_tree"][k] for k in keys]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    nodes = [p["drafted_per_pass"] for p in points]
    right.plot(nodes, [p["speedup"] for p in points], "o", label="measured")
    for k, p, n in zip(keys, points, nodes):
        right.annotate(f"({k})", (n, p["speedup"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    predicted = [(p["predicted_speedup"], p["speedup"], k) for k, p in zip(keys, points) if p["predicted_speedup"]]
    if predicted:
        right.plot(nodes, [p["predicted_speedup"] for p in points], "s", mfc="none", label="predicted (distill)")
        xs, ys, labels = zip(*predicted)
        left.plot(xs, ys, "o")
        for x, y, label in zip(xs, ys, labels):
            left.annotate(f"({label})", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        lo, hi = min(xs + ys) * 0.95, max(xs + ys) * 1.05
        left.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
    left.set(xlabel="predicted speedup (held-out simulator + cost profile)", ylabel="measured speedup",
             title="Predicted vs measured per tree")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set(xlabel="draft nodes per target pass", ylabel="speedup vs autoregressive",
              title=f"Tree size ({sweep['n_requests']} requests)")
    right.legend(fontsize=7)
    return _save(fig, path)


def latency(records: list[dict], path: Path) -> str:
    """Per-request latency distribution of every method (all domains pooled)."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    data = [[r["time_s"] for r in records if r["method"] == m] for m in methods]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(methods) + 1.5), 3.6))
    ax.boxplot(data, showmeans=True)
    ax.set_xticks(range(1, len(methods) + 1), methods, rotation=20, ha="right")
    ax.set(ylabel="latency per request (s)", title="Request latency (prefill + decode)")
    return _save(fig, path)


def predicted_vs_measured(metrics: dict, path: Path) -> str:
    """Measured speedup per domain (95% CI) against the calibration's prediction for what ran there, with the
    ±10% band the prediction should land in. Domains at one point (those calibrated off: 1.0 predicted, plain
    decoding measured) share one label."""
    predicted = metrics["predicted"]
    points = [(predicted[d]["speedup"], d, metrics["domains"][d]["speculative"]) for d in predicted
              if d in metrics["domains"] and "speculative" in metrics["domains"][d]]
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    labels: dict[tuple[float, float], list[str]] = {}
    for x, domain, m in points:
        lo, hi = m.get("speedup_ci95") or (m["speedup"], m["speedup"])
        ax.errorbar([x], [m["speedup"]], yerr=[[m["speedup"] - lo], [hi - m["speedup"]]], fmt="o", capsize=3)
        labels.setdefault((round(x, 2), round(m["speedup"], 2)), []).append(
            domain + ("" if predicted[domain]["speculate"] else " (off)"))
    for (x, y), names in labels.items():
        ax.annotate(", ".join(names), (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    values = [v for x, _, m in points for v in (x, *(m.get("speedup_ci95") or (m["speedup"],)))]
    low, high = min(values + [0.9]) - 0.05, max(values + [1.1]) + 0.05
    ax.plot([low, high], [low, high], "k-", lw=0.8)
    ax.fill_between([low, high], [0.9 * low, 0.9 * high], [1.1 * low, 1.1 * high], color="grey", alpha=0.15,
                    label="within 10%")
    ax.set(xlim=(low, high), ylim=(low, high), xlabel="predicted speedup (distill's calibration)",
           ylabel="measured speedup (eval, 95% CI)", title="Predicted vs measured, evaluated draft")
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(metrics: dict, records: list[dict], out_dir: Path) -> list[str]:
    """Writes every plot that has data into out_dir; returns the file names."""
    files = [acceptance_by_domain(metrics, out_dir / "acceptance_by_domain.png"),
             per_position(metrics, out_dir / "per_position_acceptance.png")]
    if metrics.get("gamma_sweep"):
        files.append(gamma_sweep(metrics, out_dir / "gamma_sweep.png"))
    if metrics.get("tree_sweep"):
        files.append(tree_sweep(metrics, out_dir / "tree_sweep.png"))
    if metrics.get("predicted"):
        files.append(predicted_vs_measured(metrics, out_dir / "predicted_vs_measured.png"))
    files.append(latency(records, out_dir / "latency.png"))
    return files
