"""Learning curves from draft exports: held-out acceptance against target tokens and training minutes, one point
per export (`training.data_tokens`; nested subsets of one collect, experiment=curve, give the data-size curve) and
each export's in-run `learning_curve`. A distill stage's `${paths.trained}` (before calibration) is a point too.
Tokens are also priced in CPU-minutes of label work: each export's training record carries what the labels of its
rows cost (each origin at the collect's own rate), or else the collect's (`paths.collect`) manifest gives the CPU
seconds its rows cost per token, over its mix of label sources; the in-run curve is drawn against labels and training
together in CPU-minutes (issue 52's budget) where every point records its training CPU. Writes learning_curve.png, .md (with the gain per doubling) and .json.

    python -m pipeline.tools learning-curve 'tool.drafts=[<draft dir>,...]' tool.out=<dir> [paths.collect=<collect>]
"""
from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.settings import register, setting
from pipeline.decoding.cost import pass_speedup
from pipeline.errors import PipelineError
from pipeline.decoding.spec import SpeculativeSpec


@dataclass(frozen=True)
class LearningCurveSettings:
    """learning-curve: learning curves from draft exports."""
    drafts: tuple[str, ...] = setting([], "draft export directories (paths.draft of distill runs)")
    out: str | None = setting(None, "the directory the report is written into")


register("tools", LearningCurveSettings, name="learning-curve", package="tool")

OVERALL = "overall"


def label_rate(collect: str | None) -> float | None:
    """CPU seconds of label work per labelled token of the collect at `collect`: its manifest's `label_cost` summed
    over the origins (target generations, the draft's samples, given text), so a collect with cheaper sources is
    priced at its own mix; None where it has no manifest or no cost recorded."""
    manifest = Path(collect or "") / "manifest.json"
    if not collect or not manifest.is_file():
        return None
    origins = [o for o in (json.loads(manifest.read_text()).get("label_cost") or {}).values() if o.get("cpu_s")]
    tokens = sum(o.get("tokens", 0) for o in origins)
    return sum(o["cpu_s"] for o in origins) / tokens if tokens else None


def label_minutes(tokens: int | None, rate: float | None) -> float | None:
    return None if tokens is None or rate is None else tokens * rate / 60


def run_point(spec: SpeculativeSpec, source: str, rate: float | None = None) -> dict:
    """One export as a point of the data-size curve."""
    training = spec.training or {}
    trained = (spec.acceptance or {}).get("after_training") or (spec.acceptance or {}).get("after") or {}
    predicted = spec.predicted_speedup or {}
    return {"source": source, "data_tokens": training.get("data_tokens"), "train_fraction": training.get("train_fraction"),
            "train_tokens": training.get("train_tokens"), "train_minutes": training.get("minutes"),
            "acceptance": dict(trained), "before": dict((spec.acceptance or {}).get("before") or {}),
            "predicted_speedup": predicted.get("default", predicted.get(OVERALL)),
            "predicted_by_domain": {d: v for d, v in predicted.items() if d != "default"},
            "label_cpu_minutes": label_minutes(training.get("data_tokens"), own_rate(training, rate)),
            "cpu_minutes": budget_minutes(training, training.get("train_cpu_s"))}


def own_rate(training: dict, rate: float | None) -> float | None:
    """CPU seconds per label of the rows a run trained on: from the cost its distill stage recorded (each origin at
    its own rate) where there is one, else `rate` (the named collect's)."""
    if training.get("label_cpu_s") is None or not training.get("data_tokens"):
        return rate
    return training["label_cpu_s"] / training["data_tokens"]


def budget_minutes(training: dict, train_cpu_s: float | None) -> float | None:
    """Labels and training together in CPU-minutes (every core counts): issue 52's budget. The labels are paid
    before the first step, so every point of an in-run curve carries all of them."""
    if training.get("label_cpu_s") is None or train_cpu_s is None:
        return None
    return (training["label_cpu_s"] + train_cpu_s) / 60


def trained_as_spec(directory: Path) -> SpeculativeSpec:
    """A distill stage's ${paths.trained} (training.json) in an export's shape: the trained weights' held-out
    acceptance, the training record and the in-run curve; no calibration, so no predicted speedup."""
    from pipeline.modelio.trained import read_record

    record = read_record(directory)
    return SpeculativeSpec(target={}, sampling=None, draft={}, training=record["training"],
                           acceptance={"after_training": record["after_training"]},
                           learning_curve=record["learning_curve"])


def load_exports(dirs: list[str]) -> list[tuple[str, SpeculativeSpec]]:
    out = []
    for d in dirs:
        spec = SpeculativeSpec.read(Path(d))  # one-line errors for another version or a broken file
        if spec is None and (Path(d) / "training.json").is_file():
            spec = trained_as_spec(Path(d))
        if spec is None:
            raise PipelineError(f"{d} has no speculative.json: point at a draft export (a distill stage's paths.draft)"
                                " or a distill stage's paths.trained")
        if not spec.distilled and not spec.cost.get("c"):
            raise PipelineError(f"{d} is an undistilled export with no calibration: point at paths.draft, or calibrate "
                                "it (stage=calibrate calibrate.draft=<dir>) to size it as a reference")
        out.append((str(d), spec))
    return out


def doubling_gains(points: list[dict]) -> list[dict]:
    """Acceptance gained per doubling of training data between successive runs: where it nears zero, more data
    of the same kind buys little."""
    rows = []
    for a, b in zip(points, points[1:]):
        if not a["data_tokens"] or not b["data_tokens"] or b["data_tokens"] <= a["data_tokens"]:
            continue
        doublings = math.log2(b["data_tokens"] / a["data_tokens"])
        rows.append({"from_tokens": a["data_tokens"], "to_tokens": b["data_tokens"],
                     "gain_per_doubling": {d: (b["acceptance"][d] - a["acceptance"][d]) / doublings
                                           for d in b["acceptance"] if d in a["acceptance"]}})
    return rows


REACH = 16  # extrapolate at most this many times the largest run's data: further out a log-line means nothing


def tokens_needed(points: list[dict], targets=(0.3, 0.35, 0.4, 0.5), last: int = 3) -> dict:
    """Per domain and target acceptance, the target tokens a collect needs: `measured` (the smallest run that
    reached it), `extrapolated` along a line through the last `last` runs (acceptance against log2 of the tokens;
    optimistic where the curve flattens), or `out of reach` (the line rises too slowly to get there within
    REACH times the largest run's data, or not at all)."""
    runs = [p for p in points if p["data_tokens"]]
    if len({p["data_tokens"] for p in runs}) < 2:
        return {}
    fit = runs[-last:]
    xs = [math.log2(p["data_tokens"]) for p in fit]
    out = {}
    for d in runs[-1]["acceptance"]:
        ys = [p["acceptance"].get(d) for p in fit]
        if any(y is None for y in ys):
            continue
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        need = {}
        for t in targets:
            reached = [p["data_tokens"] for p in runs if (p["acceptance"].get(d) or 0) >= t]
            tokens = round(2 ** (mx + (t - my) / slope)) if slope > 0 else None
            if reached:
                need[str(t)] = {"tokens": min(reached), "how": "measured"}
            elif tokens is not None and tokens <= REACH * runs[-1]["data_tokens"]:
                need[str(t)] = {"tokens": tokens, "how": "extrapolated"}
            else:
                need[str(t)] = {"tokens": None, "how": "out of reach"}
        out[d] = {"gain_per_doubling": slope, "tokens": need}
    return out


# ---------------------------------------------------------------- sizing by the window
ALPHA_CAP = 0.95  # a projected acceptance is capped here: the log-line has no ceiling, a draft has
GAMMAS = range(1, 9)
DOUBLINGS = (1, 2)  # the sizing projects each candidate this many doublings of labels past its largest run


def candidate(spec: SpeculativeSpec) -> str:
    """A draft's architecture as the sizing table names it: how it was made, the layers it keeps, its head rows."""
    draft = spec.draft or {}
    layers = draft.get("layers") or draft.get("keep_layers")
    kept = f" {layers}" if layers else ("" if draft.get("init") != "pretrained" else " (all layers)")
    head = f", head {len(spec.vocab_subset):,}" if spec.vocab_subset else ", full head"
    return f"{draft.get('init', 'draft')}{kept}{head}"


def chain_speedup(alpha: float, cost: dict) -> float:
    """The best fixed-γ chain's predicted speedup at a per-token acceptance α (Leviathan et al. 2023: α i.i.d. per
    position, E[accepted] = α(1 − α^γ)/(1 − α)), priced by the export's own cost profile (pipeline/decoding/cost.py),
    or 1 (plain decoding) where no γ pays."""
    alpha = min(max(alpha, 0.0), ALPHA_CAP)
    return max([1.0] + [pass_speedup(alpha * (1 - alpha ** g) / (1 - alpha), g, g, cost) for g in GAMMAS])


def sizing(exports: list[tuple[str, SpeculativeSpec]], doublings=DOUBLINGS) -> list[dict]:
    """One row per candidate draft (exports grouped by `candidate`, in the order first named; the first is the
    reference): its measured c, held-out acceptance at its largest run, gain per doubling of labels (≥ 2 runs),
    acceptance and chain speedup projected `doublings` further, the calibration's predicted speedup, and the labelled
    tokens at which its projected chain speedup reaches the reference's now (within REACH× its largest run)."""
    groups: dict[str, list[tuple[dict, dict]]] = {}
    for src, spec in exports:
        if spec.cost.get("c"):  # a trained directory has no calibration, no cost profile
            groups.setdefault(candidate(spec), []).append((run_point(spec, src), spec.cost))
    rows, costs = [], {}
    for name, runs in groups.items():
        runs.sort(key=lambda run: run[0]["data_tokens"] or 0)
        points = [point for point, _ in runs]
        last, cost = runs[-1]  # the largest run's acceptance, priced by its own cost profile
        costs[name] = cost
        alpha = last["acceptance"].get(OVERALL)
        gain = tokens_needed(points).get(OVERALL, {}).get("gain_per_doubling")
        ahead = {k: alpha + gain * k for k in doublings} if gain is not None and alpha is not None else {}
        rows.append({"candidate": name, "c": cost["c"], "runs": len(points), "data_tokens": last["data_tokens"],
                     "acceptance": alpha, "gain_per_doubling": gain, "projected_acceptance": ahead,
                     "predicted_speedup": last["predicted_speedup"],
                     "chain_speedup": chain_speedup(alpha, cost) if alpha is not None else None,
                     "projected_chain_speedup": {k: chain_speedup(a, cost) for k, a in ahead.items()}})
    for row in rows[1:]:
        row["tokens_to_pass_reference"] = tokens_to_pass(row, costs[row["candidate"]], rows[0]["chain_speedup"])
    return rows


def tokens_to_pass(row: dict, cost: dict, bar: float | None) -> int | None:
    """Labelled tokens at which `row`'s projected chain speedup first reaches `bar` (its own tokens if it already
    does), stepping a tenth of a doubling up to REACH× its largest run; None beyond that or without a curve."""
    if bar is None or row["acceptance"] is None or not row["data_tokens"]:
        return None
    for tenth in range(int(10 * math.log2(REACH)) + 1):
        alpha = row["acceptance"] + (row["gain_per_doubling"] or 0.0) * tenth / 10
        if chain_speedup(alpha, cost) >= bar:
            return round(row["data_tokens"] * 2 ** (tenth / 10))
        if not row["gain_per_doubling"] or row["gain_per_doubling"] <= 0:
            return None
    return None


def sizing_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    ks = DOUBLINGS
    lines = ["", "Sizing by the window: each candidate's cost c and held-out acceptance α at its largest run, α and the "
             "best chain's speedup (α i.i.d., the export's cost profile) projected along its curve per doubling of "
             f"labels, and the labelled tokens at which it reaches the reference ({rows[0]['candidate']}) now:", "",
             "| candidate | c | runs | tokens | α | gain / doubling | " + " | ".join(f"α at {2 ** k}×" for k in ks)
             + " | predicted (calibrated) | chain now | " + " | ".join(f"chain at {2 ** k}×" for k in ks)
             + " | tokens to pass the reference |", "|" + "---|" * (9 + 2 * len(ks))]
    for r in rows:
        passing = "reference" if r is rows[0] else _f(r.get("tokens_to_pass_reference"), ",")
        if r is not rows[0] and r.get("tokens_to_pass_reference") is None:
            passing = f"> {REACH}× its largest run" if r["gain_per_doubling"] else "no curve (one run)"
        lines.append(f"| {r['candidate']} | {r['c']:.3f} | {r['runs']} | {_f(r['data_tokens'], ',')} | "
                     f"{_f(r['acceptance'])} | {_f(r['gain_per_doubling'], '+.3f')} | "
                     + " | ".join(_f(r["projected_acceptance"].get(k)) for k in ks)
                     + f" | {_f(r['predicted_speedup'], '.3f')} | {_f(r['chain_speedup'], '.3f')} | "
                     + " | ".join(_f(r["projected_chain_speedup"].get(k), ".3f") for k in ks) + f" | {passing} |")
    return lines


def _need(entry: dict) -> str:
    if entry["how"] == "measured":
        return f"≤ {entry['tokens']:,}"
    if entry["how"] == "extrapolated":
        return f"≈ {entry['tokens']:,}"
    return f"> {REACH}× the largest run"


def _with_epochs(spec: SpeculativeSpec, rate: float | None = None) -> list[dict]:
    """The in-run curve with `epochs` = tokens seen / tokens of the train rows (below 1 every point is new data) and
    the label CPU-minutes of the distinct tokens seen so far."""
    data, rate = spec.training.get("data_tokens"), own_rate(spec.training, rate)
    return [c | {"epochs": c["train_tokens"] / data if data else None,
                 "label_cpu_minutes": label_minutes(min(c["train_tokens"], data or c["train_tokens"]), rate),
                 "cpu_minutes": budget_minutes(spec.training, c.get("train_cpu_s"))}
            for c in spec.learning_curve]


def plot(points: list[dict], curves: list[tuple[str, list[dict]]], path: Path) -> None:
    """Top: one point per run against the target tokens it trained on (held-out acceptance, predicted speedup),
    per domain. Bottom: held-out acceptance during training against minutes and tokens seen (per domain for
    the run with the most data, overall for every run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({d for p in points for d in p["acceptance"] if d != OVERALL}) + [OVERALL]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    style = {d: {"linewidth": 2.5, "color": "black"} if d == OVERALL else {"linewidth": 1.2} for d in domains}
    tokens = [p["data_tokens"] for p in points]
    for ax, key, label in ((axes[0, 0], "acceptance", "held-out acceptance"),
                           (axes[0, 1], "predicted_by_domain", "predicted speedup")):
        for d in domains:
            ax.plot(tokens, [(p.get(key) or {}).get(d) for p in points], marker="o", label=d, **style[d])
        ax.set_xscale("log")
        ax.set(xlabel="target tokens trained on (log)", ylabel=label, title="Data size (one run each)")
        ax.legend(fontsize=7)
    largest = curves[-1] if curves else None
    budget = bool(curves) and all(c.get("cpu_minutes") is not None for _, curve in curves for c in curve)
    for ax, key, label in ((axes[1, 0], *(("cpu_minutes", "label + training CPU-minutes") if budget
                                           else ("train_minutes", "training minutes"))),
                           (axes[1, 1], "train_tokens", "completion tokens seen (epochs included)")):
        if largest:
            for d in domains[:-1]:
                ax.plot([c[key] for c in largest[1]], [c.get("by_domain", {}).get(d) for c in largest[1]],
                        linestyle="--", linewidth=1, label=f"{d} ({largest[0]})")
        for name, curve in curves:
            ax.plot([c[key] for c in curve], [c["acceptance"] for c in curve], marker=".", label=f"overall ({name})")
        ax.set(xlabel=label, ylabel="held-out acceptance", title="During training")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x, fmt=".3f") -> str:
    return "–" if x is None else format(x, fmt)


def markdown(points: list[dict], gains: list[dict], curves: list[tuple[str, list[dict]]], needed: dict | None = None) -> str:
    domains = sorted({d for p in points for d in p["acceptance"] if d != OVERALL}) + [OVERALL]
    lines = ["# Learning curve", "", "Held-out acceptance of the trained draft (reporting part, serving sampling).", "",
             "| target tokens | label CPU-min | share | train minutes | " + " | ".join(domains) + " | predicted speedup |",
             "|" + "---|" * (len(domains) + 5)]
    for p in points:
        lines.append(f"| {_f(p['data_tokens'], ',')} | {_f(p.get('label_cpu_minutes'), '.1f')} | "
                     f"{_f(p['train_fraction'], '.3g')} | {_f(p['train_minutes'], '.1f')} | "
                     + " | ".join(_f(p["acceptance"].get(d)) for d in domains) + f" | {_f(p['predicted_speedup'], '.2f')}{'×' if p['predicted_speedup'] else ''} |")
    if points and points[0]["before"]:
        lines.append("| undistilled | | | | " + " | ".join(_f(points[0]["before"].get(d)) for d in domains) + " | |")
    if gains:
        lines += ["", "Acceptance gained per doubling of the data:", "",
                  "| from → to tokens | " + " | ".join(domains) + " |", "|" + "---|" * (len(domains) + 1)]
        lines += [f"| {g['from_tokens']:,} → {g['to_tokens']:,} | "
                  + " | ".join(_f(g["gain_per_doubling"].get(d), "+.3f") for d in domains) + " |" for g in gains]
    if needed:
        targets = list(next(iter(needed.values()))["tokens"])
        lines += ["", "Target tokens (all domains together) for a held-out acceptance: ≤ a run that reached it; ≈ along a "
                  "line through the last runs against log2(tokens), optimistic where the curve flattens:", "",
                  "| domain | gain per doubling | " + " | ".join(targets) + " |", "|" + "---|" * (len(targets) + 2)]
        lines += [f"| {d} | {v['gain_per_doubling']:+.3f} | " + " | ".join(_need(v["tokens"][t]) for t in targets) + " |"
                  for d, v in needed.items()]
    for name, curve in curves:
        lines += ["", f"During training ({name}):", "", "| step | tokens seen | epochs | label CPU-min | minutes | "
                  "label + training CPU-min | overall | " + " | ".join(domains[:-1]) + " |", "|" + "---|" * (len(domains) + 6)]
        lines += [f"| {c['step']} | {c['train_tokens']:,} | {_f(c.get('epochs'), '.2f')} | "
                  f"{_f(c.get('label_cpu_minutes'), '.1f')} | {_f(c.get('train_minutes'), '.1f')} | "
                  f"{_f(c.get('cpu_minutes'), '.1f')} | "
                  f"{_f(c['acceptance'])} | "
                  + " | ".join(_f(c.get("by_domain", {}).get(d)) for d in domains[:-1]) + " |" for c in curve]
    return "\n".join(lines) + "\n"


def write_files(out: Path, writers: dict) -> None:
    """{file name: fn(path) that writes it}: all written into a staging directory beside `out`, then each renamed
    into `out`, so a failure leaves nothing half-written there."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.tmp-", dir=out.parent) as staging:
        for name, write in writers.items():
            write(Path(staging) / name)
        for name in writers:
            (Path(staging) / name).replace(out / name)


def drafts_and_out(tool) -> tuple[list[str], Path]:
    """tool.drafts and tool.out, checked (the out directory is written only after every export has loaded)."""
    drafts = [str(d) for d in tool.drafts or []]
    if not drafts:
        raise PipelineError("tool.drafts is empty: name draft export directories, 'tool.drafts=[<dir>,<dir>]'")
    if not tool.out:
        raise PipelineError("tool.out is not set: name the directory to write the report into, tool.out=<dir>")
    out = Path(tool.out)
    if out.exists() and not out.is_dir():
        raise PipelineError(f"tool.out={out} is a file, not a directory: pass a directory to write the report into")
    return drafts, out


def run(cfg) -> dict:
    drafts, out = drafts_and_out(cfg.tool)
    load_order = load_exports(drafts)  # the sizing's reference is the first draft named
    exports = [(src, spec) for src, spec in load_order if spec.distilled]  # an undistilled one: the sizing's alone
    rate = label_rate(cfg.paths.get("collect"))
    points = sorted((run_point(spec, src, rate) for src, spec in exports), key=lambda p: p["data_tokens"] or 0)
    exports.sort(key=lambda e: e[1].training.get("data_tokens") or 0)
    from pipeline.tools.compare_drafts import short_names  # two runs' `trained` folders: told apart by their parents

    sources = [src for src, _ in exports]
    names = dict(zip(sources, short_names(sources))) if len(exports) > 1 else {src: "run" for src in sources}
    curves = [(names[src], _with_epochs(spec, rate)) for src, spec in exports if spec.learning_curve]
    table = sizing(load_order)
    if len({candidate(spec) for _, spec in exports}) > 1:  # curves of different drafts: one per draft, in the sizing
        gains, needed = [], {}
    else:
        gains, needed = doubling_gains(points), tokens_needed(points)
    md = markdown(points, gains, curves, needed) + "\n".join(sizing_markdown(table)) + ("\n" if table else "")
    result = {"runs": points, "gains": gains, "tokens_needed": needed, "in_run": dict(curves),
              "label_cpu_s_per_token": rate, "sizing": table}
    write_files(out, {"learning_curve.png": lambda path: plot(points, curves, path),
                      "learning_curve.md": lambda path: path.write_text(md),
                      "learning_curve.json": lambda path: path.write_text(json.dumps(result, indent=1))})
    print(md)
    return result
