"""`python -m pipeline.tools <subcommand> [hydra overrides]`: one command, settings declared once in conf/tools/, and
the tools that time measure through eval's one harness (tests/test_harness.py). Smoke runs on the distill tests' tiny target and draft."""
from __future__ import annotations

import json
import re

import pytest

from pipeline.errors import PipelineError
from pipeline.tools.__main__ import SUBCOMMANDS, compose, run
from tests.conftest import REPO


def test_every_subcommand_declares_its_settings_once_and_composes():
    from dataclasses import fields

    from pipeline.tools.__main__ import _settings

    for subcommand in SUBCOMMANDS:  # its module's dataclass, a default and a help per key
        assert all(f.metadata["help"] for f in fields(_settings(subcommand))), subcommand
    for subcommand in SUBCOMMANDS:
        cfg = compose(subcommand, [])
        assert cfg.tool and cfg.tracking.enabled is False, subcommand
    with pytest.raises(PipelineError, match="bad configuration"):
        compose("learning-curve", ["tool.undeclared=1"])  # a key the settings do not declare is refused, by Hydra
    with pytest.raises(PipelineError, match="tool.undeclared is not a setting of learning-curve: .* declares drafts, out"):
        compose("learning-curve", ["+tool.undeclared=1"])  # and with a `+`, by the tool


def test_help_lists_every_subcommand_with_what_it_does(capsys):
    from pipeline.tools.__main__ import main

    assert main(["--help"]) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.split("subcommands:\n")[1].splitlines())
    assert sorted(listed) == sorted(SUBCOMMANDS) and all(len(what) > 20 for what in listed.values())


def test_an_unknown_subcommand_is_one_line_naming_the_known_ones():
    with pytest.raises(PipelineError, match="is not one of learning-curve, cost-profile") as e:
        run(["bench"])
    assert "\n" not in str(e.value)


def test_sources_regenerates_the_faq_prompts(tmp_path):
    faq = tmp_path / "faq"
    faq.mkdir()
    (faq / "general.rst.txt").write_text("General FAQ\n===========\n\nWhy is Python slow?\n-------------------\n\n"
                                         "Details\n-------\n")
    out = tmp_path / "qa.jsonl"
    prompts = run(["sources", f"tool.faq_dir={faq}", f"tool.out={out}"])
    assert [p["turns"] for p in prompts] == [["Why is Python slow?"], ["Details"]]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [p["id"] for p in prompts]


def commands_in(text: str) -> tuple[set[str], set[str]]:
    """(modules run with `python -m`, subcommands of `python -m pipeline.tools`) that a text names."""
    return (set(re.findall(r"python -m ([A-Za-z_][\w.]*)", text)),
            set(re.findall(r"python -m pipeline\.tools ([a-z-]+)", text)))


def test_the_docs_name_only_the_two_commands_and_real_subcommands():
    names = ("README.md", "docs/architecture.md", "docs/tools.md", "data/SOURCES.md")
    text = "".join((REPO / name).read_text() for name in names)
    modules, subcommands = commands_in(text)
    assert modules == {"pipeline", "pipeline.tools", "pytest"} and subcommands and subcommands <= set(SUBCOMMANDS)
    retired = commands_in("run `python -m eval.bench --target t` or `python -m pipeline.tools ttft`")
    assert retired == ({"eval.bench", "pipeline.tools"}, {"ttft"})  # what the check would refuse


def test_compare_drafts_headers_keep_the_part_that_tells_drafts_apart():
    from pipeline.tools.compare_drafts import render

    names = ["runs/trained-fkl1/draft_init", "runs/trained-fkl1/draft", "runs/trained-top1/draft"]
    entry = {"rows": 1, "positions": 2, "acceptance": dict.fromkeys(names, 0.5),
             "difference": {n: [0.0, [0, 0]] for n in names[1:]}}
    header = render({"overall": entry}, names).splitlines()[0].split()
    # wrong variant: the first two cut to the same 18-character head, "trained-fkl1/draft"
    assert header[3:6] == ["…d-fkl1/draft_init", "trained-fkl1/draft", "trained-top1/draft"]
