"""Regenerate the checked-in Python FAQ prompts (data/SOURCES.md, "qa") from the Python docs' FAQ sources.

    python -m pipeline.tools sources tool.faq_dir=<.../_sources/faq> [tool.out=data/prompts/qa_python_faq.jsonl]
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data.sources import python_faq_from_rst
from pipeline.settings import register, setting
from pipeline.errors import PipelineError
from pipeline.control.prompts import write_prompts


@dataclass(frozen=True)
class SourcesSettings:
    """sources: the checked-in Python FAQ prompts, regenerated."""
    faq_dir: str | None = setting(None, "the Python docs' _sources/faq directory (data/SOURCES.md, \"qa\")")
    out: str = setting("data/prompts/qa_python_faq.jsonl", "written atomically")


register("tools", SourcesSettings, name="sources", package="tool")


def run(cfg) -> list[dict]:
    faq_dir = cfg.tool.faq_dir
    if not faq_dir or not list(Path(faq_dir).glob("*.rst.txt")):
        raise PipelineError(f"tool.faq_dir={faq_dir} holds no *.rst.txt: pass the Python docs' _sources/faq directory "
                            "(data/SOURCES.md says how to get it)")
    prompts = python_faq_from_rst(Path(faq_dir))
    write_prompts(cfg.tool.out, prompts)
    print(f"wrote {len(prompts)} prompts to {cfg.tool.out}")
    return prompts
