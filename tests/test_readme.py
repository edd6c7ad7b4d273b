"""The README: its serving snippet runs as written against the real embedded target and a draft export; each row of
its headline results is measured in the docs/results.md section it links to; the docs' section links land; and the
README and docs/results.md stay short."""
from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import REPO


def serving_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Serving the exported draft"):text.index("## Beyond one machine")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.smoke
def test_the_readme_serving_snippet_runs_and_decodes_like_the_target(real_target, real_target_path, tmp_path,
                                                                      capsys):
    from pipeline.modelio.draft_init import build_draft
    from distill.export import ExportParts, save_draft
    from pipeline.decoding import DraftLength, autoregressive_generate
    from pipeline.sampling import Sampling
    from pipeline.decoding.spec import Recipe, SpeculativeSpec

    target, tokenizer = real_target
    draft, draft_tokenizer, info = build_draft({"init": "derive", "derive": {"layers": [0, 1]}}, target, tokenizer, {})
    spec = SpeculativeSpec({"name": "SmolLM2"}, Sampling(), info, list(range(4096)),
                           recipes={"default": Recipe(chain=DraftLength("fixed", 3), draft_temperature=0.0)})
    save_draft(draft, draft_tokenizer, tmp_path / "draft", target.generation_config, ExportParts(spec, "# card"))
    code = serving_snippet()
    paths = 'target_dir, draft_dir = "artifacts/models/SmolLM2-135M-Instruct-b179c9523d0e", "artifacts/draft"'
    assert paths in code, "the snippet's paths line changed: update this test"
    scope = {}
    exec(code.replace(paths, f"target_dir, draft_dir = {str(real_target_path)!r}, {str(tmp_path / 'draft')!r}"), scope)
    printed = capsys.readouterr().out
    reference = autoregressive_generate(target, scope["ids"], max_new_tokens=48, eos_token_id=tokenizer.eos_token_id)
    assert scope["out"].tokens.tolist() == reference.tokens.tolist()  # greedy: lossless means identical
    assert tokenizer.decode(reference.tokens) in printed
    assert isinstance(scope["ids"], torch.Tensor) and scope["ids"].dim() == 2


# A figure as the docs write it: a ratio or difference with its interval (`1.03× [1.02, 1.05]`,
# `+0.015 [+0.005, +0.029]`), else a plain decimal number (`0.273`, `14.5`).
FIGURE = re.compile(r"[+−-]?\d+(?:\.\d+)?×? \[[+−-]?\d+(?:\.\d+)?, [+−-]?\d+(?:\.\d+)?\]|[+−-]?\d+\.\d+")


def anchor(heading: str) -> str:
    """The fragment a Markdown heading gets (GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """Each `## ` section of a document by its heading's fragment: its text up to the next `## ` heading, whitespace
    collapsed (a figure may wrap across lines)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {anchor(h): " ".join(body.split()) for h, body in zip(parts[1::2], parts[2::2])}


def headline_rows(readme: str) -> list[dict]:
    """The README's Results table: per row its claim, its figures and the docs/results.md fragment it links to."""
    table = readme[readme.index("## Results"):readme.index("## Serving the exported draft")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 4 or cells[0] in ("claim", "---"):
            continue
        links = re.findall(r"\]\(docs/results\.md#([^)]+)\)", cells[3])
        rows.append({"claim": cells[0], "links": links, "figures": FIGURE.findall(" ".join(cells[:3]))})
    return rows


def check_headline_rows(readme: str, results: str) -> list[str]:
    """What is wrong with the README's headline table against docs/results.md, one line per fault."""
    by_anchor, faults = sections(results), []
    rows = headline_rows(readme)
    if not 1 <= len(rows) <= 8:
        faults.append(f"{len(rows)} headline rows: the table holds one to eight")
    for row in rows:
        if len(row["links"]) != 1 or row["links"][0] not in by_anchor:
            faults.append(f"{row['claim']!r}: links {row['links']}, not one section of docs/results.md")
            continue
        section = by_anchor[row["links"][0]]
        faults += [f"{row['claim']!r}: {f} is not in its section" for f in row["figures"] if f not in section]
    return faults


def test_each_headline_row_of_the_readme_is_measured_in_the_results_section_it_links():
    """Every row of the README's Results table links to one `## ` section of docs/results.md, and every figure of the
    row (a ratio with its interval, a plain decimal number) is written in that section, where its date, machine and
    command are."""
    readme, results = (REPO / "README.md").read_text(), (REPO / "docs/results.md").read_text()
    rows = headline_rows(readme)
    assert sum(len(row["figures"]) for row in rows) >= 10, rows
    assert any(row["claim"] == "The first run on any machine" for row in rows)
    assert check_headline_rows(readme, results) == []


def in_row(readme: str, claim: str, old: str, new: str) -> str:
    """The README with `old` replaced by `new` in the headline row of `claim` only."""
    lines = readme.splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.startswith(f"| {claim} |"))
    assert old in lines[i], (old, lines[i])
    lines[i] = lines[i].replace(old, new)
    return "".join(lines)


def test_the_headline_check_refuses_a_figure_or_a_link_its_section_does_not_hold():
    readme = (REPO / "README.md").read_text()
    results = (REPO / "docs/results.md").read_text()
    first = "The first run on any machine"
    assert check_headline_rows(in_row(readme, first, "1.03× [1.01, 1.06]", "1.03× [1.01, 1.07]"), results) == [
        f"{first!r}: 1.03× [1.01, 1.07] is not in its section"]
    assert check_headline_rows(in_row(readme, first, "0.289", "0.288"), results) == [
        f"{first!r}: 0.288 is not in its section"]
    # a figure docs/results.md holds, but in another section than the row links to
    assert check_headline_rows(in_row(readme, first, "1.03× [1.01, 1.06]", "1.11× [1.05, 1.16]"), results) == [
        f"{first!r}: 1.11× [1.05, 1.16] is not in its section"]
    wrong_link = in_row(readme, first, "docs/results.md#the-first-run-on-any-machine", "docs/results.md#the-first-run")
    assert check_headline_rows(wrong_link, results) == [
        f"{first!r}: links ['the-first-run'], not one section of docs/results.md"]


def test_every_link_into_the_results_and_the_journal_lands_on_a_heading():
    """The README's, docs/results.md's and docs/tools.md's links to a section of docs/results.md, docs/journal.md or
    docs/tools.md name a heading that exists (GitHub's fragment; a repeated heading gets -1, -2, ...)."""
    def fragments(text: str) -> set[str]:
        found, seen = set(), {}
        for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
            base = anchor(heading)
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
        return found

    docs = {name: fragments((REPO / "docs" / name).read_text()) for name in ("results.md", "journal.md", "tools.md")}
    broken = []
    for source, base in (("README.md", "docs/"), ("docs/results.md", ""), ("docs/tools.md", "")):
        text = (REPO / source).read_text()
        link = r"\]\(" + re.escape(base) + r"(results\.md|journal\.md|tools\.md)#([^)]+)\)"
        for name, fragment in re.findall(link, text):
            if fragment not in docs[name]:
                broken.append(f"{source} -> {name}#{fragment}")
        if source != "README.md":
            own = source.rsplit("/", 1)[1]
            broken += [f"{source} -> #{f}" for f in re.findall(r"\]\(#([^)]+)\)", text) if f not in docs[own]]
    assert broken == []


def test_the_readme_and_the_results_stay_short():
    """A newcomer reads the README in five minutes; docs/results.md holds the current evidence only (the history is
    docs/journal.md)."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
    assert len((REPO / "docs/results.md").read_text().splitlines()) <= 800
