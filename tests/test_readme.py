"""The README's serving snippet runs as written against the real embedded target and a draft export."""
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


def test_every_speedup_in_the_readme_results_is_in_docs_results():
    """The README's results paragraph quotes only figures measured in docs/results.md (where each has its date,
    machine, command and interval)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Results"):text.index("## Serving the exported draft")]
    results = (REPO / "docs/results.md").read_text()
    figures = re.findall(r"\d+\.\d+× \[\d+\.\d+, \d+\.\d+\]|\d+\.\d+×", section)
    assert len(figures) >= 5, figures
    assert [f for f in figures if f not in results] == []
