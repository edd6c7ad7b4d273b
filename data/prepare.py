"""The prepare stage: per-domain train / held-out eval prompt sets (${paths.prompts}/train.jsonl, eval.jsonl,
manifest.json, SOURCES.md), replaced in one rename; deterministic given cfg.seed and the pinned sources.
"""
from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from data import sources
from pipeline.control.prompts import SPLITS, TEXT_FILE, load_prompts, normalized_text, write_prompts
from pipeline.atomic import atomic_dir, write_json
from pipeline.errors import PipelineError
from pipeline.modelio.packaged import sha256_of

BUILTIN_DOMAINS = ("chat", "code", "summarization", "math", "qa", "translation")
SOURCES_MD = Path(__file__).resolve().parent / "SOURCES.md"


def _unknown_domain(domain: str) -> PipelineError:
    return PipelineError(f"unknown domain {domain!r} in data.domains: built-in domains are {list(BUILTIN_DOMAINS)}; "
                         "remove it or give its prompts in data.extra_files")


def _entry_split(entry, path) -> str | None:
    split = entry.get("split")
    if split is not None and split not in SPLITS:
        raise PipelineError(f"data.extra_files entry {path}: split must be one of {list(SPLITS)}, "
                            f"got {split!r}; fix the entry or drop `split`")
    return split


def _count(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PipelineError(f"data.{key}={value!r} is not a count >= 0: use e.g. data.{key}=40")


def check_settings(cfg) -> None:
    """`data.*` checked without reading a source or a prompt file (pipeline/__main__.py runs it before any stage).
    What needs the files (an extra file's rows and domains, a source's prompts) is checked by build()."""
    data = cfg.data
    _count("train_per_domain", data.train_per_domain)
    _count("eval_per_domain", data.eval_per_domain)
    for key in ("max_train", "max_eval"):
        for domain, cap in (data.get(key) or {}).items():
            _count(f"{key}.{domain}", cap)
    fraction = data.extra_eval_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise PipelineError(f"data.extra_eval_fraction={fraction!r} is not a share in [0, 1]: use e.g. 0.2")
    for entry in data.extra_files:
        entry = OmegaConf.create({"path": entry}) if isinstance(entry, str) else entry
        if not entry.get("path"):
            raise PipelineError(f"data.extra_files entry {entry!r} has no path: give a path or "
                                "{path, split, domain_map}")
        _entry_split(entry, Path(entry.path))
    shared = sorted(set(data.text.python_source.modules) & set(data.code.stdlib_modules))
    if shared:
        raise PipelineError(f"data.text.python_source.modules {shared} are code prompts' modules too (their source "
                            "answers those prompts): drop them from one of the lists")
    _count("text.python_source.max_chars", data.text.python_source.max_chars)
    _count("text.python_docs.max_chars", data.text.python_docs.max_chars)
    if not data.extra_files:  # extra files may add domains: those are known once they are read
        unknown = [domain for domain in data.domains if domain not in BUILTIN_DOMAINS]
        if unknown:
            raise _unknown_domain(unknown[0])


def load_extra_files(data, seed: int) -> tuple[dict[tuple[str, str], list[dict]], list[dict]]:
    """User prompt files (a path or {path, split, domain_map}) -> {(domain, split): prompts in priority order} and
    their provenance; rows without their own `split` are divided by a seeded `extra_eval_fraction`."""
    groups: dict[tuple[str, str], list[dict]] = {}
    provenance = []
    for entry in data.extra_files:
        if isinstance(entry, str):
            entry = OmegaConf.create({"path": entry})
        path = Path(entry.path)
        entry_split = _entry_split(entry, path)
        domain_map = dict(entry.get("domain_map") or {})
        unsplit: dict[str, list[dict]] = {}
        rows = load_prompts(path)
        for row in rows:
            row = dict(row)
            row["domain"] = domain_map.get(row["domain"], row["domain"])
            row.setdefault("source", f"file:{path.name}")
            split = row.pop("split", None) or entry_split
            if split is None:
                unsplit.setdefault(row["domain"], []).append(row)
            else:
                groups.setdefault((row["domain"], split), []).append(row)
        for domain, items in sorted(unsplit.items()):
            rng = random.Random(f"{seed}:extra:{path.name}:{domain}")
            items = rng.sample(items, len(items))
            n_eval = round(len(items) * data.extra_eval_fraction)
            groups.setdefault((domain, "eval"), []).extend(items[:n_eval])
            groups.setdefault((domain, "train"), []).extend(items[n_eval:])
        provenance.append({"path": str(path), "sha256": sha256_of(path), "rows": len(rows),
                           "split": entry_split, "domain_map": domain_map or None})
    for key, items in groups.items():  # extra rows are in file order: make any prefix a sample
        groups[key] = random.Random(f"{seed}:extra:{key[0]}:{key[1]}").sample(items, len(items))
    return groups, provenance


def build(cfg) -> tuple[dict[str, list[dict]], dict]:
    """All prompts per split (in memory) and the manifest; writes nothing but the wheel cache."""
    data, seed = cfg.data, int(cfg.seed)
    extras, extra_provenance = load_extra_files(data, seed)
    domains = list(dict.fromkeys([*data.domains, *(d for d, _ in extras)]))
    wanted = {d: {"train": int(data.max_train.get(d, data.train_per_domain)),
                  "eval": int(data.max_eval.get(d, data.eval_per_domain))} for d in domains}
    ctx = sources.SourceContext(data=data, seed=seed, cache=Path(cfg.paths.cache), wanted=wanted)

    chosen: dict[str, dict[str, list[dict]]] = {}
    report: dict[str, dict] = {}
    for domain in domains:
        supplied = {s: extras.get((domain, s)) for s in SPLITS}
        built, provenance = {"train": [], "eval": []}, []
        if domain not in BUILTIN_DOMAINS and not any(supplied.values()):
            raise _unknown_domain(domain)
        if domain in BUILTIN_DOMAINS and not all(supplied.values()):
            result = getattr(sources, domain)(ctx)
            built, provenance = {"train": result.train, "eval": result.eval}, result.provenance
        chosen[domain] = {s: (supplied[s] or built[s]) for s in SPLITS}
        report[domain] = {"available": {s: len(chosen[domain][s]) for s in SPLITS},
                          "replaced_by_extra_files": [s for s in SPLITS if supplied[s]],
                          "sources": provenance}

    # Sources keep prompts in priority order, so the caps keep a prefix. Leak guard: no train
    # prompt may repeat the text of any eval prompt (of any domain) or of an earlier train prompt.
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for domain in domains:
        splits["eval"].extend(chosen[domain]["eval"][: ctx.wanted[domain]["eval"]])
    taken = {normalized_text(p) for p in splits["eval"]}
    for domain in domains:
        train = []
        for p in chosen[domain]["train"]:
            if len(train) >= ctx.wanted[domain]["train"]:
                break
            text = normalized_text(p)
            if text not in taken:
                taken.add(text)
                train.append(p)
        splits["train"].extend(train)
    counts = {d: {s: sum(p["domain"] == d for p in splits[s]) for s in SPLITS} for d in domains}
    for split, prompts in splits.items():
        seen: dict[str, str] = {}
        for p in prompts:
            if p["id"] in seen:
                raise PipelineError(f"duplicate prompt id {p['id']!r} in the {split} split (domains "
                                    f"{seen[p['id']]!r} and {p['domain']!r}); rename it in your extra file")
            seen[p["id"]] = p["domain"]
    manifest = {
        "seed": seed,
        "python": ".".join(map(str, sys.version_info[:3])),
        "counts": counts,
        "domains": report,
        "extra_files": extra_provenance,
        "config": OmegaConf.to_container(data, resolve=True),
    }
    return splits, manifest


def _source_label(prompts: list[dict]) -> str:
    return "+".join(sorted({p.get("source", "?").split("/")[0] for p in prompts})) or "-"


def run(cfg, tracker=None) -> dict:
    """Build the prompt sets and write them atomically under cfg.paths.prompts; return counts (logged, with the
    manifest and SOURCES.md, by a tracker)."""
    splits, manifest = build(cfg)
    text, provenance = sources.python_text(cfg.data)
    manifest["text"] = {"rows": len(text), "chars": sum(len(r["text"]) for r in text), "sources": provenance}
    out = Path(cfg.paths.prompts)
    with atomic_dir(out) as tmp:
        for split, prompts in splits.items():
            write_prompts(tmp / f"{split}.jsonl", prompts)
        (tmp / TEXT_FILE).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in text))
        manifest["files"] = {name: {"rows": len(rows), "sha256": sha256_of(tmp / name)} for name, rows in
                             [*((f"{s}.jsonl", splits[s]) for s in SPLITS), (TEXT_FILE, text)]}
        write_json(tmp / "manifest.json", manifest)
        if SOURCES_MD.is_file():
            shutil.copyfile(SOURCES_MD, tmp / "SOURCES.md")
        # the atomic helpers create private (0600/0700) temp files; the output is meant to be shared
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)

    rows = []
    for domain, counts in manifest["counts"].items():
        by_split = {s: [p for p in splits[s] if p["domain"] == domain] for s in SPLITS}
        rows.append((domain, str(counts["train"]), str(counts["eval"]),
                     f"train: {_source_label(by_split['train'])}; eval: {_source_label(by_split['eval'])}"))
    header = ("domain", "train", "eval", "source")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    print(f"prompts written to {out}")
    for r in [header, *rows]:
        print(f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")

    result = {f"prompts/{s}/{d}": c[s] for d, c in manifest["counts"].items() for s in SPLITS}
    for s in SPLITS:
        result[f"prompts/{s}/total"] = len(splits[s])
    if tracker is not None:
        tracker.log_metrics(result)
        for name in ("manifest.json", "SOURCES.md"):
            if (out / name).is_file():
                tracker.log_artifact(str(out / name), "prompts")
    return result
