"""collect.text: given text (chat logs in the common formats, plain files) labelled by the target in one forward pass;
rows, labels, domains, the token cap, the split, resume, label cost, and bad input that fails before anything is
written."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pipeline.errors import PipelineError
from tests.test_collect import (_cli, assert_topk_matches_fresh_forward, collect, leftovers, overrides, rows_of,
                                save_tiny_target, write_prompts, SPECIALS)

torch.set_num_threads(1)

LOG = [{"messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "write code now"},
                     {"role": "user", "content": "more"}, {"role": "assistant", "content": "sum two numbers"}]},
       {"conversations": [{"from": "system", "value": "code"}, {"from": "human", "value": "write code"},
                          {"from": "gpt", "value": "sum this"}], "domain": "code"},
       {"prompt": "translate this", "completion": "hello world"},
       {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                     {"role": "assistant", "content": "world"}], "domain": "chat"}]
PLAIN = "write code to sum two numbers " * 12  # 72 tokens: rows of 1 context + 16 labelled tokens (chunk_tokens=16)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


def corpus(root: Path, log=LOG, plain=PLAIN) -> Path:
    folder = root / "corpus"
    (folder / "docs").mkdir(parents=True)
    (folder / "log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    (folder / "docs" / "notes.txt").write_text(plain)
    (folder / ".hidden").write_bytes(b"\x00\x01 skipped: hidden")
    return folder


def text(folder: Path, *extra: str) -> list[str]:
    return [f"collect.text.paths=[{folder}]", "collect.text.chunk_tokens=16", *extra]


def test_text_rows_carry_the_targets_labels_and_their_own_domain(tmp_path, tiny_target):
    from pipeline.modelio.models import load_model

    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, [*text(corpus(tmp_path)), "collect.topk=8", "collect.batch_size=4"])
    rows = rows_of(tmp_path)
    given = [r for r in rows if r["origin"] == "text"]
    assert {r["origin"] for r in rows} == {"target", "text"} and len(rows) - len(given) > 0
    by_source = {}
    for r in given:
        by_source.setdefault(r["prompt_id"], []).append(r)
    assert sorted(by_source) == ["text/corpus/docs/notes.txt:1"] + [f"text/corpus/log.jsonl:{n}" for n in (1, 2, 3, 4)]
    # each assistant answer is a row ending in the template's end of turn (</s>, id 1); plain text is cut in chunks
    assert [r["turn"] for r in by_source["text/corpus/log.jsonl:1"]] == [0, 1]
    assert all(r["completion_ids"][-1] == 1 and r["finish_reason"] == "eos"
               for r in given if r["prompt_id"].startswith("text/corpus/log"))
    assert [len(r["completion_ids"]) for r in by_source["text/corpus/docs/notes.txt:1"]] == [16, 16, 16, 16, 3]
    assert {r["domain"] for r in by_source["text/corpus/log.jsonl:2"]} == {"code"}
    assert {r["domain"] for r in by_source["text/corpus/log.jsonl:3"]} == {"text"}  # collect.text.domain
    assert by_source["text/corpus/log.jsonl:2"][0]["text"] == "sum this"
    assert_topk_matches_fresh_forward(load_model(tiny_target), given, 8)
    manifest = json.loads((tmp_path / "collect" / "manifest.json").read_text())
    cost = manifest["label_cost"]
    assert cost["text"]["tokens"] == sum(len(r["completion_ids"]) for r in given) and cost["text"]["cpu_s"] > 0
    # the generation speed counts the generated tokens alone
    assert manifest["tokens_per_s"] == pytest.approx(cost["target"]["tokens"] / manifest["generate_s"], rel=2e-2)  # all rows: +30%
    assert cost["text"]["tokens_per_cpu_s"] > 0 and cost["target"]["tokens_per_cpu_s"] > 0


def test_a_log_of_the_targets_own_answers_gives_the_rows_generation_gave(tmp_path):
    """A serving log holds what the target said: labelled by one prefill, its rows are the generated rows' tokens
    and labels (the generated answer cut by max_new_tokens gains the end of turn the log's template adds)."""
    target = save_tiny_target(tmp_path / "target", vocab_size=256)  # a wide vocabulary: few special ids sampled
    questions = ["hello world", "write code", "sum two numbers", "translate this", "now write more", "hello"]
    write_prompts(tmp_path / "generated", [{"id": f"p{i}", "domain": "chat", "turns": [words]}
                                           for i, words in enumerate(questions)])
    sampled = ["collect.temperature=1.0", "collect.samples_per_prompt=1", "collect.hidden_states=true"]
    collect(tmp_path / "generated", target, sampled)
    # the log keeps text: answers with a special id (other than the closing </s>) would not survive decoding
    generated = [r for r in rows_of(tmp_path / "generated")
                 if all(t >= len(SPECIALS) for t in r["completion_ids"][:-1]) and r["completion_ids"][-1] != 0]
    log = [{"messages": [{"role": "user", "content": questions[int(r["prompt_id"][1:])]},
                         {"role": "assistant", "content": r["text"]}]} for r in generated]
    write_prompts(tmp_path / "logged")
    collect(tmp_path / "logged", target, [*sampled, *text(corpus(tmp_path, log, "hello")),
                                          "collect.text.chunk_tokens=64"])
    logged = [r for r in rows_of(tmp_path / "logged") if r["prompt_id"].startswith("text/corpus/log")]
    assert len(logged) == len(generated) >= 2
    for g, t in zip(generated, logged):
        n = len(g["completion_ids"])
        assert t["prompt_ids"] == g["prompt_ids"] and t["completion_ids"][:n] == g["completion_ids"]
        assert t["completion_ids"][n:] == ([] if g["finish_reason"] == "eos" else [1])
        for column, atol in (("topk_logprobs", 2e-2), ("final_hidden", 2e-2)):
            torch.testing.assert_close(torch.tensor(t[column][:n]).float(), torch.tensor(g[column]).float(), atol=atol,
                                       rtol=1e-2)
        assert t["topk_ids"][:n] == g["topk_ids"]


def test_the_prepared_text_is_labelled_for_the_collected_domains_only(tmp_path, tiny_target):
    write_prompts(tmp_path)
    prepared = [{"text": PLAIN, "domain": "code", "source": "python-stdlib/x"},
                {"text": PLAIN, "domain": "poetry", "source": "elsewhere"}]
    (tmp_path / "prompts" / "text.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prepared))
    collect(tmp_path, tiny_target, ["collect.text.prepared=true", "collect.text.chunk_tokens=16", "collect.topk=8"])
    given = [r for r in rows_of(tmp_path) if r["origin"] == "text"]
    assert {r["prompt_id"] for r in given} == {"text/prepared:1"} and {r["domain"] for r in given} == {"code"}
    assert json.loads((tmp_path / "collect" / "manifest.json").read_text())["text"]["prepared"] is True
    (tmp_path / "off").mkdir()
    write_prompts(tmp_path / "off")
    (tmp_path / "off" / "prompts" / "text.jsonl").write_text((tmp_path / "prompts" / "text.jsonl").read_text())
    collect(tmp_path / "off", tiny_target, ["collect.text.prepared=false", "collect.topk=8"])
    assert rows_of(tmp_path / "off") and not any(r.get("origin") == "text" for r in rows_of(tmp_path / "off"))


def test_max_tokens_caps_the_text_in_file_order(tmp_path, tiny_target):
    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, text(corpus(tmp_path), "collect.text.max_tokens=20"))
    given = [r for r in rows_of(tmp_path) if r["origin"] == "text"]
    assert sum(len(r["completion_ids"]) for r in given) <= 20
    assert given and given[0]["prompt_id"] == "text/corpus/docs/notes.txt:1"  # sorted: docs/ before log.jsonl


def test_text_rows_are_never_held_out_and_leave_the_held_out_prompts_as_they_were():
    from pipeline.control.split import split_by_prompt

    ids = [f"chat-{i}" for i in range(10)]
    domains = ["chat"] * 10
    _, held = split_by_prompt(ids, domains, 0.2, None, 0, ["target"] * 10)
    more = ids + [f"text/log:{i}" for i in range(30)]
    train, held_with_text = split_by_prompt(more, domains + ["chat"] * 30, 0.2, None, 0,
                                            ["target"] * 10 + ["text"] * 30)
    assert held_with_text == held and len(held) == 2 and set(range(10, 40)) <= set(train)
    # the deliberately wrong variant, text rows counted as the target's, holds out other prompts: the rule matters
    _, counted = split_by_prompt(more, domains + ["chat"] * 30, 0.2, None, 0, ["target"] * 40)
    assert counted != held


def test_resume_after_a_crash_redoes_no_text_shard(tmp_path, tiny_target, monkeypatch):
    import data.collect as stage

    settings = [*text(corpus(tmp_path)), "collect.shard_size=2"]
    write_prompts(tmp_path / "whole")
    collect(tmp_path / "whole", tiny_target, settings)
    write_prompts(tmp_path / "crashed")
    real_save, saved, crash = stage._save_shard, [], [True]

    def save_then_crash(final, *args):
        real_save(final, *args)
        saved.append(final.name)
        if crash[0] and final.name.startswith("text-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(stage, "_save_shard", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        collect(tmp_path / "crashed", tiny_target, settings)
    assert not (tmp_path / "crashed" / "collect" / "dataset").exists() and not leftovers(tmp_path / "crashed" / "collect")
    done, saved[:], crash[0] = list(saved), [], False
    collect(tmp_path / "crashed", tiny_target, settings)
    assert not set(done) & set(saved) and saved
    assert rows_of(tmp_path / "crashed") == rows_of(tmp_path / "whole")


def _write(tmp_path: Path, name: str, content: bytes | str) -> Path:
    path = tmp_path / "input" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("name, content, message", [
    ("log.jsonl", '{"prompt": "hi", "completion": "yo"}\n{"messages": [', r"log\.jsonl:2 is not valid JSON"),
    ("log.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n', r"log\.jsonl:1: no assistant answer"),
    ("log.jsonl", '{"question": "hi", "answer": "yo"}\n', r"log\.jsonl:1: unknown keys \['answer', 'question'\]"),
    ("log.jsonl", '{"messages": [{"role": "robot", "content": "hi"}]}\n', r"log\.jsonl:1: role 'robot'"),
    ("log.jsonl", '[1, 2]\n', r"log\.jsonl:1: a list, not an object"),
    ("log.jsonl", '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}\n',
     r"content 5 is not text"),
    ("weights.bin", b"\x89PNG\x00\x00\x01binary", r"weights\.bin is not UTF-8 text \(a binary file\?\)"),
    ("latin1.txt", "caf\xe9".encode("latin-1"), r"latin1\.txt is not UTF-8 text"),
])
def test_a_bad_file_fails_in_one_line_before_anything_is_written(tmp_path, tiny_target, name, content, message):
    path = _write(tmp_path, name, content)
    write_prompts(tmp_path)
    with pytest.raises(PipelineError, match=message) as e:
        collect(tmp_path, tiny_target, [f"collect.text.paths=[{path.parent}]"])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "collect").exists()


@pytest.mark.parametrize("extra, message", [
    (["collect.text.paths=[{empty}]"], r"the folder .*empty holds no files"),
    (["collect.text.paths=[{empty}/nothing-here]"], r"nothing-here does not exist"),
    (["collect.text.paths=[{empty}]", "collect.text.chunk_tokens=0"], r"collect\.text\.chunk_tokens=0 must be an "),
    (["collect.text.max_tokens=-3"], r"collect\.text\.max_tokens=-3 must be an integer"),
    (["collect.text.paths=[{empty}]", "collect.backend=vllm"], r"collect\.text\.paths needs collect\.backend=hf"),
    (["collect.text.paths=[{empty}]", "collect.topk=0"], r"needs collect\.topk > 0"),
    (["+collect.text.bogus=1"], r"unknown setting\(s\) collect\.text\.bogus"),
])
def test_bad_text_settings_are_one_line_and_write_nothing(tmp_path, tiny_target, extra, message):
    (tmp_path / "empty").mkdir()
    write_prompts(tmp_path)
    with pytest.raises(PipelineError, match=message) as e:
        collect(tmp_path, tiny_target, [x.format(empty=tmp_path / "empty") for x in extra])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "collect").exists()


def test_an_empty_folder_exits_2_in_one_line_before_any_stage_writes(tmp_path, tiny_target):
    (tmp_path / "empty").mkdir()
    done = _cli([sys.executable, "-m", "pipeline", "stage=all", *overrides(tmp_path / "run", tiny_target),
                 f"collect.text.paths=[{tmp_path / 'empty'}]"])
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "holds no files" in done.stderr and not (tmp_path / "run").exists()


def test_ce_refuses_a_collect_with_text_rows(tmp_path, tiny_target):
    """loss=ce learns the sampled tokens, which in text rows are the text's, not the target's samples."""
    from types import SimpleNamespace

    from datasets import load_from_disk

    from distill.stage import split_rows
    from tests.test_collect import compose

    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, text(corpus(tmp_path)))
    cfg = compose(tmp_path, tiny_target)
    inputs = SimpleNamespace(collected=load_from_disk(str(tmp_path / "collect" / "dataset")), cfg=cfg,
                             settings=SimpleNamespace(split=cfg.distill.split, objective=SimpleNamespace(loss="ce")))
    with pytest.raises(PipelineError, match=r"loss=ce .* text rows"):
        split_rows(inputs)


def test_text_labelling_counts_against_collects_budget(tmp_path, tiny_target):
    # a budget the first round of generated shards already spends: no text shard starts after it, and the dataset
    # merges without the text it did not reach (it used to be labelled whatever the budget)
    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, [*text(corpus(tmp_path)), "collect.shard_size=2", "collect.max_minutes=0.0001"])
    manifest = json.loads((tmp_path / "collect" / "manifest.json").read_text())
    assert manifest["budget"]["stopped_early"] and manifest["budget"]["shards_done"] == len(manifest["domains"]) == 2
    assert "text" not in manifest["domains"]


def test_after_the_first_round_the_source_with_less_time_so_far_goes_next():
    from data.collect import _next_kind

    queues = {"generated": ["g1", "g2"], "text": ["t1"]}
    assert _next_kind(queues, {"generated": 0.0, "text": 0.0}, first_round=True) == "generated"
    assert _next_kind(queues, {"generated": 30.0, "text": 2.0}, first_round=False) == "text"
    assert _next_kind(queues, {"generated": 30.0, "text": 31.0}, first_round=False) == "generated"
    assert _next_kind({"generated": [], "text": ["t1"]}, {"generated": 0.0, "text": 9.0}, True) == "text"
    assert _next_kind({"generated": [], "text": []}, {"generated": 0.0, "text": 0.0}, False) is None
