"""Prompt sets: the JSONL schema (docs/architecture.md, "Prompts"; Spec-Bench's question.jsonl accepted too), loading
with line-numbered errors, atomic writing, split access.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

from pipeline.atomic import atomic_file
from pipeline.errors import PipelineError

TEXT_FILE = "text.jsonl"  # beside the splits: data.text's rows (no prompts), which collect.text.prepared labels
SPLITS = ("train", "eval")
PREPARE_HINT = "run `python -m pipeline stage=prepare` first"


def _from_spec_bench(obj: dict) -> dict:
    """Spec-Bench / MT-Bench row -> our schema (reference answers are dropped)."""
    out = {"id": str(obj["question_id"]), "domain": obj["category"], "turns": obj.get("turns")}
    for key in ("system", "source", "split"):
        if key in obj:
            out[key] = obj[key]
    out.setdefault("source", "spec-bench")
    return out


def validate_prompt(obj, where: str) -> dict:
    """One prompt object in our schema, or PipelineError("<where>: <problem>; <fix>") for a missing or
    wrong-typed field."""
    if not isinstance(obj, dict):
        raise PipelineError(f"{where}: expected a JSON object, got {type(obj).__name__}; "
                            'write one object per line like {"id": ..., "domain": ..., "turns": [...]}')
    if "id" not in obj and "domain" not in obj and "question_id" in obj and "category" in obj:
        obj = _from_spec_bench(obj)
    for key in ("id", "domain"):
        value = obj.get(key)
        if not isinstance(value, str) or not value.strip():
            problem = "missing" if key not in obj else f"must be a non-empty string, got {value!r}"
            raise PipelineError(f"{where}: field {key!r} {problem}; every prompt needs "
                                '"id" (unique string), "domain" (string) and "turns" (list of strings)')
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        problem = ("missing" if "turns" not in obj
                   else f"must be a non-empty list of strings, got {turns!r:.60}")
        raise PipelineError(f"{where}: field 'turns' {problem}; give the user messages as "
                            '"turns": ["first message", ...]')
    for i, turn in enumerate(turns):
        if not isinstance(turn, str) or not turn.strip():
            raise PipelineError(f"{where}: turns[{i}] must be a non-empty string, got {turn!r:.60}; "
                                "remove empty turns")
    for key in ("system", "source"):
        if key in obj and not isinstance(obj[key], str):
            raise PipelineError(f"{where}: field {key!r} must be a string, got {obj[key]!r:.60}; "
                                "fix or remove it")
    if "split" in obj and obj["split"] not in SPLITS:
        raise PipelineError(f"{where}: field 'split' must be one of {list(SPLITS)}, got "
                            f"{obj['split']!r}; fix it or drop it to use the configured held-out fraction")
    return obj


def load_prompts(path: str | Path) -> list[dict]:
    """Read and validate a prompt JSONL file (our schema or Spec-Bench's); ids must be unique."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"prompt file {path} not found; check the path (relative paths are "
                            "resolved from the current directory)")
    prompts: list[dict] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PipelineError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); "
                                    "each line must be one complete JSON object") from None
            prompt = validate_prompt(obj, where)
            if prompt["id"] in first_line:
                raise PipelineError(f"{where}: duplicate id {prompt['id']!r} (first on line "
                                    f"{first_line[prompt['id']]}); ids must be unique within a file")
            first_line[prompt["id"]] = lineno
            prompts.append(prompt)
    if not prompts:
        raise PipelineError(f"prompt file {path} is empty; add one JSON prompt object per line")
    return prompts


def write_prompts(path: str | Path, prompts: Iterable[dict]) -> None:
    """Validate and write prompts as JSONL, atomically (a crash leaves no partial file)."""
    path = Path(path)
    with atomic_file(path) as f:
        for i, p in enumerate(prompts):
            validate_prompt(p, f"{path} row {i}")
            f.write(json.dumps(p, ensure_ascii=False) + "\n")


def normalized_text(prompt: dict) -> str:
    """The prompt's text for duplicate / leak checks: lower-case words of all turns joined."""
    return " ".join(re.findall(r"\w+", " ".join(prompt["turns"]).lower()))


def load_split(prompts_dir: str | Path, split: str, domains: Iterable[str] | None = None) -> list[dict]:
    """Prompts of one split written by the prepare stage, optionally only some domains; one line when prepare
    has not run or a domain is unknown."""
    if split not in SPLITS:
        raise PipelineError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    path = Path(prompts_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise PipelineError(f"no prepared prompts at {path}; {PREPARE_HINT}")
    return keep_domains(load_prompts(path), domains, f"have no {split} prompts in {path}",
                        f"fix the domain names or add them to data.domains / data.extra_files and "
                        f"{PREPARE_HINT.replace('first', 'again')}")


def keep_domains(prompts: list[dict], domains: Iterable[str] | None, missing: str, fix: str) -> list[dict]:
    """The prompts of `domains` (None = all); one line when one of them has none."""
    if domains is None:
        return prompts
    available = sorted({p["domain"] for p in prompts})
    absent = [d for d in domains if d not in available]
    if absent:
        raise PipelineError(f"domain(s) {absent} {missing} (available: {available}); {fix}")
    return [p for p in prompts if p["domain"] in set(domains)]


def by_domain(prompts: list[dict], limit: int | None = None, domains: Iterable[str] = ()) -> dict[str, list[dict]]:
    """{domain: its prompts in file order, at most `limit` (None or 0 = all)}, `domains` first in their order."""
    out: dict[str, list[dict]] = {domain: [] for domain in domains}
    for prompt in prompts:
        out.setdefault(prompt["domain"], []).append(prompt)
    return {domain: rows[:limit] if limit else rows for domain, rows in out.items()}
