"""Regenerate the checked-in Python FAQ prompts (data/SOURCES.md, "qa") from the Python docs' FAQ sources.

    python -m pipeline.tools sources tool.faq_dir=<.../_sources/faq> [tool.out=data/prompts/qa_python_faq.jsonl]
"""
from __future__ import annotations

from pathlib import Path

from data.sources import python_faq_from_rst
from pipeline.errors import PipelineError
from pipeline.control.prompts import write_prompts


def run(cfg) -> list[dict]:
    faq_dir = cfg.tool.faq_dir
    if not faq_dir or not list(Path(faq_dir).glob("*.rst.txt")):
        raise PipelineError(f"tool.faq_dir={faq_dir} holds no *.rst.txt: pass the Python docs' _sources/faq directory "
                            "(data/SOURCES.md says how to get it)")
    prompts = python_faq_from_rst(Path(faq_dir))
    write_prompts(cfg.tool.out, prompts)
    print(f"wrote {len(prompts)} prompts to {cfg.tool.out}")
    return prompts
