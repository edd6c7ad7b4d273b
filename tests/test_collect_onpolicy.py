"""collect.onpolicy: the draft's tokens with the target's labels, origin per row, held-out prompts the target's own,
resume, label cost per origin, bad settings."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pipeline.errors import PipelineError
from tests.test_collect import (_cli, crash_then_resume, assert_topk_matches_fresh_forward, collect, compose, overrides, rows_of,
                                save_tiny_target, write_prompts)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> Path:
    """Another random model with the target's tokenizer, its head untied and its weights 10x HF's initial scale: its
    samples and distributions are far from the target's (at HF's scale both near-uniform models copy their input)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = save_tiny_target(tmp_path_factory.mktemp("tiny_draft"))
    config = LlamaConfig.from_pretrained(path)
    config.initializer_range, config.tie_word_embeddings = 0.2, False
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def onpolicy(draft: Path, share: float = 0.5) -> list[str]:
    return [f"collect.onpolicy.share={share}", f"collect.onpolicy.draft={draft}"]


def manifest_of(artifacts: Path) -> dict:
    return json.loads((artifacts / "collect" / "manifest.json").read_text())


def greedy(model, prompt_ids: list[int], max_new_tokens: int, stop: int = 1) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == stop:
                break
    return ids[len(prompt_ids):]


def test_onpolicy_rows_carry_the_targets_labels_not_the_drafts(tmp_path, tiny_target, tiny_draft):
    from pipeline.modelio.models import load_model

    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, [*onpolicy(tiny_draft), "collect.topk=8", "collect.batch_size=4"])
    rows, manifest = rows_of(tmp_path), manifest_of(tmp_path)
    drafted = [r for r in rows if r["origin"] == "onpolicy"]
    assert {r["origin"] for r in rows} == {"target", "onpolicy"}
    # half of each domain's train prompts (chat 4, code 2: one held out in each), every turn and sample of them
    assert {r["domain"] for r in drafted} == {"chat", "code"}
    assert len({r["prompt_id"] for r in drafted if r["domain"] == "chat"}) == 2
    assert len({r["prompt_id"] for r in drafted if r["domain"] == "code"}) == 1
    target, draft = load_model(tiny_target), load_model(tiny_draft)
    assert_topk_matches_fresh_forward(target, drafted, 8)
    with pytest.raises(AssertionError):  # the wrong labeller: the draft's own distribution over its tokens
        assert_topk_matches_fresh_forward(draft, drafted, 8)
    for r in drafted:  # the final hidden states are the target's too: its head's input at each completion position
        p, n = len(r["prompt_ids"]), len(r["completion_ids"])
        with torch.no_grad():
            states = target.model(torch.tensor([r["prompt_ids"] + r["completion_ids"]])).last_hidden_state[0]
        torch.testing.assert_close(torch.tensor(r["final_hidden"]), states[p - 1:p - 1 + n], atol=1e-2, rtol=1e-2)
    cost = manifest["label_cost"]
    assert cost["onpolicy"]["rows"] == len(drafted) and cost["target"]["rows"] == len(rows) - len(drafted)
    assert cost["onpolicy"]["tokens"] == sum(len(r["completion_ids"]) for r in drafted)
    assert 0 < cost["onpolicy"]["draft_cpu_s"] <= cost["onpolicy"]["cpu_s"] and cost["target"]["cpu_s"] > 0
    assert manifest["onpolicy"]["share"] == 0.5 and manifest["columns"][-1] == "origin"


def test_greedy_onpolicy_tokens_are_the_drafts_and_held_out_prompts_stay_the_targets(tmp_path, tiny_target,
                                                                                      tiny_draft):
    """share=1: every train prompt answered by the draft (its greedy tokens, not the target's), every held-out prompt by
    the target. Distill's held-out split never takes an on-policy prompt, even under a larger heldout_fraction than the
    collect planned for, where the split without origins would."""
    from distill.heldouts import split_collected
    from pipeline.modelio.models import load_model
    from pipeline.control.split import split_by_prompt

    write_prompts(tmp_path)
    greedy_one = ["collect.temperature=0", "collect.samples_per_prompt=1"]
    collect(tmp_path, tiny_target, [*onpolicy(tiny_draft, 1.0), *greedy_one])
    rows = rows_of(tmp_path)
    target, draft = load_model(tiny_target), load_model(tiny_draft)
    drafted = [r for r in rows if r["origin"] == "onpolicy"]
    differs = 0
    for r in rows:
        model = draft if r["origin"] == "onpolicy" else target
        assert r["completion_ids"] == greedy(model, r["prompt_ids"], 10), r["id"]
        differs += r["origin"] == "onpolicy" and r["completion_ids"] != greedy(target, r["prompt_ids"], 10)
    assert differs > 0  # the check can tell the draft's tokens from the target's
    ids, domains = [r["prompt_id"] for r in rows], [r["domain"] for r in rows]
    cfg = compose(tmp_path, tiny_target)
    _, held = split_by_prompt(ids, domains, cfg.distill.split.heldout_fraction, None, 0)
    assert {ids[i] for i in held} == {r["prompt_id"] for r in rows if r["origin"] == "target"}
    assert {r["prompt_id"] for r in drafted} == set(ids) - {ids[i] for i in held}
    from datasets import load_from_disk

    dataset = load_from_disk(str(tmp_path / "collect" / "dataset"))
    wider = cfg.distill.split.copy()
    wider.heldout_fraction = 0.5
    _, held = split_collected(dataset, wider, 0)
    assert held and all(rows[i]["origin"] == "target" for i in held)
    _, unfiltered = split_by_prompt(ids, domains, 0.5, None, 0)
    assert any(rows[i]["origin"] == "onpolicy" for i in unfiltered)


def test_resume_after_a_crash_reproduces_an_uninterrupted_onpolicy_run(tmp_path, tiny_target, tiny_draft,
                                                                       monkeypatch):
    extra = onpolicy(tiny_draft)
    crashed = crash_then_resume(tmp_path, tiny_target, monkeypatch, extra)
    rows = rows_of(crashed)
    assert rows == rows_of(tmp_path / "whole") and len({r["id"] for r in rows}) == len(rows)
    cost = manifest_of(crashed)["label_cost"]
    assert sum(c["rows"] for c in cost.values()) == len(rows) and all(c["cpu_s"] > 0 for c in cost.values())
    # another share is another set of shards; share 0 keeps the rows of a collect without the setting
    collect(crashed, tiny_target, onpolicy(tiny_draft, 0.0))
    assert "origin" not in rows_of(crashed)[0]
    assert manifest_of(crashed)["fingerprint"] != manifest_of(tmp_path / "whole")["fingerprint"]
    write_prompts(tmp_path / "plain")
    collect(tmp_path / "plain", tiny_target)
    assert manifest_of(crashed)["fingerprint"] == manifest_of(tmp_path / "plain")["fingerprint"]


def test_ce_refuses_a_collect_with_onpolicy_rows(tmp_path, tiny_target, tiny_draft):
    """loss=ce learns the sampled tokens, which in on-policy rows are the draft's own."""
    from types import SimpleNamespace

    from datasets import load_from_disk

    from distill.stage import split_rows

    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, onpolicy(tiny_draft))
    cfg = compose(tmp_path, tiny_target)
    inputs = SimpleNamespace(collected=load_from_disk(str(tmp_path / "collect" / "dataset")), cfg=cfg,
                             settings=SimpleNamespace(split=cfg.distill.split, objective=SimpleNamespace(loss="ce")))
    with pytest.raises(PipelineError, match=r"loss=ce .* on-policy rows"):
        split_rows(inputs)


@pytest.mark.parametrize("extra, message", [
    (["collect.onpolicy.share=1.5"], r"collect\.onpolicy\.share=1\.5 must be in \[0, 1\]"),
    (["collect.onpolicy.share=abc"], r"collect\.onpolicy\.share=abc: Value 'abc' of type 'str' could not be converted"),
    (["collect.onpolicy.share=0.5", "collect.topk=0"], r"needs collect\.topk > 0"),
    (["collect.onpolicy.share=0.5", "collect.backend=vllm"], r"needs collect\.backend=hf"),
    (["collect.onpolicy.share=0.5", "collect.onpolicy.draft=/nonexistent/draft"], r"is not a model directory"),
    (["+collect.onpolicy.bogus=1"], r"unknown setting\(s\) collect\.onpolicy\.bogus"),
])
def test_bad_onpolicy_settings_are_one_line_and_write_nothing(tmp_path, tiny_target, extra, message):
    write_prompts(tmp_path)
    with pytest.raises(PipelineError, match=message) as e:
        collect(tmp_path, tiny_target, extra)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "collect").exists()


def test_a_bad_share_exits_2_in_one_line_on_the_cli(tmp_path, tiny_target):
    write_prompts(tmp_path)
    done = _cli([sys.executable, "-m", "pipeline", "stage=collect", *overrides(tmp_path, tiny_target),
                 "collect.onpolicy.share=1.5"])
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "collect.onpolicy.share=1.5" in done.stderr and not (tmp_path / "collect").exists()
