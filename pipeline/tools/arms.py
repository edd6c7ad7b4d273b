"""Compare distillation objectives ("arms") trained on one collect with one budget: per export (its directory names
the arm) the objective, steps, minutes and the trained draft's held-out acceptance per domain (`after_training`,
reporting part) with the gain over the undistilled draft, one table per serving temperature. Writes arms.md and .json.

    python -m pipeline.tools arms 'tool.drafts=[<draft dir>,...]' tool.out=<dir>
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.tools.learning_curve import OVERALL, _f, drafts_and_out, load_exports, write_files
from pipeline.errors import PipelineError
from pipeline.spec import SpeculativeSpec


def objective_name(training: dict) -> str:
    """The objective in the words of the papers: `fkl`, `on-policy λ=0.5 jsd`, `AdaSPEC 50% fkl`, ..."""
    parts = []
    if training.get("lmbda"):
        parts.append(f"on-policy λ={training['lmbda']:g}")
    if training.get("seq_kd"):
        parts.append("seq-KD")
    if training.get("adaspec_keep") is not None:
        parts.append(f"AdaSPEC {training['adaspec_keep']:.0%}")
    parts.append(str(training.get("loss")))
    if training.get("teacher") == "online":
        parts.append("(online teacher)")
    return " ".join(parts)


def arm_row(name: str, spec: SpeculativeSpec) -> dict:
    training = spec.training or {}
    after = dict((spec.acceptance or {}).get("after_training") or {})
    before = dict((spec.acceptance or {}).get("before") or {})
    gains = {d: after[d] - before[d] for d in after if d in before}
    domain_gains = [g for d, g in gains.items() if d != OVERALL]
    return {"arm": name, "temperature": spec.sampling.temperature, "objective": objective_name(training),
            "steps": training.get("steps"), "minutes": training.get("minutes"),
            "data_tokens": training.get("data_tokens"), "train_tokens": training.get("train_tokens"),
            "acceptance": after, "before": before, "gain": gains,
            "min_domain_gain": min(domain_gains) if domain_gains else None,
            "calibrated": ((spec.acceptance or {}).get("after_calibrated") or {}).get(OVERALL),
            "predicted_speedup": (spec.predicted_speedup or {}).get(OVERALL), "c": (spec.cost or {}).get("c")}


def check_comparable(rows: list[dict]) -> None:
    """Arms are only comparable on the same data: refuse exports of different collects or train shares."""
    data = {r["data_tokens"] for r in rows}
    if len(data) > 1:
        raise PipelineError(f"the exports trained on different data ({sorted(data, key=str)} completion tokens): "
                            "compare arms of one collect and one distill.split")


def markdown(rows: list[dict]) -> str:
    domains = sorted({d for r in rows for d in r["acceptance"] if d != OVERALL}) + [OVERALL]
    lines = ["# Objective arms", "",
             "Held-out acceptance Σmin(p, q) of each trained draft on the reporting part, at the serving sampling it "
             "was calibrated for; the gain over the undistilled draft in points under it. Sorted by overall acceptance.",
             ""]
    for temperature in sorted({r["temperature"] for r in rows}):
        group = sorted((r for r in rows if r["temperature"] == temperature),
                       key=lambda r: -(r["acceptance"].get(OVERALL) or 0))
        lines += [f"## Serving temperature {temperature:g}", "",
                  "| arm | objective | steps | minutes | " + " | ".join(domains) + " | smallest domain gain | calibrated (τ) | predicted speedup | c |",
                  "|" + "---|" * (len(domains) + 8)]
        for r in group:
            lines.append(f"| {r['arm']} | {r['objective']} | {_f(r['steps'], 'd')} | {_f(r['minutes'], '.1f')} | "
                         + " | ".join(_f(r["acceptance"].get(d)) for d in domains)
                         + f" | {_f(r['min_domain_gain'], '+.3f')} | {_f(r['calibrated'])} | "
                         f"{_f(r['predicted_speedup'], '.2f')}× | {_f(r['c'], '.3f')} |")
            lines.append("| | gain | | | " + " | ".join(_f(r["gain"].get(d), "+.3f") for d in domains) + " | | | | |")
        lines += ["| undistilled | | | | " + " | ".join(_f(group[0]["before"].get(d)) for d in domains) + " | | | | |",
                  "", "Predicted speedups use each export's cost profile (c = draft step / target step): compare them "
                  "across arms only where c agrees.", ""]
    return "\n".join(lines)


def run(cfg) -> list[dict]:
    drafts, out = drafts_and_out(cfg.tool)
    rows = [arm_row(Path(src).name, spec) for src, spec in load_exports(drafts)]
    check_comparable(rows)
    md, data = markdown(rows), json.dumps(rows, indent=1)
    write_files(out, {"arms.md": lambda path: path.write_text(md), "arms.json": lambda path: path.write_text(data)})
    print(md)
    return rows
