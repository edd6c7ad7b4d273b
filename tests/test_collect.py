"""Collect stage: output contract, determinism, resume, multi-process, white-box labels, bad input."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.control.tracking import _NullRun
from tests.conftest import SHIPPED, REPO, tiny_llama

torch.set_num_threads(1)

SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = ["hello", "world", "write", "code", "sum", "two", "numbers", "translate", "this", "more", "now"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tiny_target(path: Path, vocab_size: int = 32, seed: int = 0) -> Path:
    """A tiny random Llama plus an offline word-level tokenizer with a chat template, saved as an
    HF directory that `model.target.path=<dir>` accepts. EOS (= pad) is `</s>`, id 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + WORDS
    tokens += [f"w{i}" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="</s>", chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    tiny_llama(vocab_size=vocab_size, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


PROMPTS = ([{"id": f"chat-{i}", "domain": "chat", "turns": ["hello world", "now write more"] if i % 2 else ["hello"]}
            for i in range(5)]
           + [{"id": f"code-{i}", "domain": "code", "turns": ["write code to sum two numbers " * (1 + i)],
               "system": "code"} for i in range(3)])


def write_prompts(artifacts: Path, prompts=PROMPTS) -> None:
    (artifacts / "prompts").mkdir(parents=True, exist_ok=True)
    (artifacts / "prompts" / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))


TINY = ["collect.max_new_tokens=10", "collect.samples_per_prompt=2", "collect.topk=4",
        "collect.batch_size=3", "collect.shard_size=2"]


def overrides(artifacts: Path, target: Path, extra=()) -> list[str]:
    return [f"paths.artifacts={artifacts}", f"model.target.path={target}", "tracking.enabled=false",
            "runtime.device=cpu", "runtime.dtype=float32", "runtime.threads=1", *TINY, *extra]


def compose(artifacts: Path, target: Path, extra=()):
    from pipeline.control.params import compose_config

    return compose_config(overrides(artifacts, target, extra))


def collect(artifacts: Path, target: Path, extra=()) -> dict:
    from data.collect import run

    return run(compose(artifacts, target, extra), _NullRun())


def rows_of(artifacts: Path) -> list[dict]:
    from datasets import load_from_disk

    return load_from_disk(str(artifacts / "collect" / "dataset")).to_list()


def leftovers(collect_dir: Path) -> list[str]:
    """Temporary files/dirs of atomic writes still lying around."""
    return [str(p) for p in collect_dir.rglob(".*tmp-*")]


# ----------------------------------------------------------------------------- contract

def test_collect_writes_the_output_contract(tmp_path, tiny_target):
    from data.collect_rows import features
    from pipeline.modelio.chat import encode_chat, messages_for
    from pipeline.modelio.models import load_tokenizer

    write_prompts(tmp_path)
    result = collect(tmp_path, tiny_target)
    rows = rows_of(tmp_path)
    manifest = json.loads((tmp_path / "collect" / "manifest.json").read_text())
    tokenizer = load_tokenizer(tiny_target)
    prompts = {p["id"]: p for p in PROMPTS}

    from datasets import load_from_disk
    assert load_from_disk(str(tmp_path / "collect" / "dataset")).features == features(4, hidden=True)
    # one row per prompt turn and sample, ids unique and structured
    expected = sum(len(p["turns"]) for p in PROMPTS) * 2
    assert len(rows) == result["rows"] == manifest["rows"] == expected
    assert len({r["id"] for r in rows}) == expected
    for r in rows:
        assert r["id"] == f"{r['prompt_id']}/t{r['turn']}/s{r['sample']}"
        assert r["domain"] == prompts[r["prompt_id"]]["domain"]
        ids = r["completion_ids"]
        assert 1 <= len(ids) <= 10
        if r["finish_reason"] == "eos":  # stop token included, nothing after it
            assert ids[-1] == 1 and 1 not in ids[:-1]
        else:
            assert r["finish_reason"] == "length" and len(ids) == 10 and 1 not in ids
        assert r["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert len(r["topk_ids"]) == len(r["topk_logprobs"]) == len(ids)
        assert all(len(k) == 4 for k in r["topk_ids"])
        assert all(a >= b for lp in r["topk_logprobs"] for a, b in zip(lp, lp[1:]))  # best first
    # prompt_ids: the chat-templated context; turn 1 follows sample 0's answer to turn 0
    by_id = {r["id"]: r for r in rows}
    for r in rows:
        p = prompts[r["prompt_id"]]
        answers = [by_id[f"{p['id']}/t{t}/s0"]["text"] for t in range(r["turn"])]
        assert r["prompt_ids"] == encode_chat(tokenizer, messages_for(p, answers, r["turn"]))[0].tolist()
    assert {r["finish_reason"] for r in rows} == {"eos", "length"}  # the tiny model does both

    assert manifest["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 1.0}
    assert manifest["max_new_tokens"] == 10 and manifest["samples_per_prompt"] == 2
    assert manifest["seed"] == 0 and manifest["topk"] == 4 and manifest["stop_token_ids"] == [1]
    assert manifest["hidden_states"] is True and all(len(r["final_hidden"]) == len(r["completion_ids"]) for r in rows)
    assert set(manifest["target"]["weights_sha256"]) == {"model.safetensors"}
    assert len(manifest["tokenizer_sha256"]) == len(manifest["chat_template_sha256"]) == 64
    assert manifest["domains"]["chat"]["prompts"] == 5 and manifest["domains"]["code"]["completions"] == 6
    assert manifest["total_tokens"] == sum(len(r["completion_ids"]) for r in rows)
    assert manifest["tokens_per_s"] > 0 and manifest["disk_bytes"] > 0
    assert not leftovers(tmp_path / "collect")


def test_manifest_sampling_round_trips_through_the_core_sampling(tmp_path, tiny_target):
    from pipeline.sampling import Sampling

    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, ["collect.temperature=0.8", "collect.top_k=5", "collect.top_p=0.9",
                                    "collect.domains=[code]", "collect.samples_per_prompt=1", "collect.topk=0"])
    manifest = json.loads((tmp_path / "collect" / "manifest.json").read_text())
    sampling = Sampling.from_dict(manifest["sampling"])
    assert sampling == Sampling(temperature=0.8, top_k=5, top_p=0.9)
    assert sampling.to_dict() == manifest["sampling"]


def test_same_seed_gives_identical_rows_and_another_seed_does_not(tmp_path, tiny_target):
    for name in ("a", "b"):
        write_prompts(tmp_path / name)
        collect(tmp_path / name, tiny_target)
    write_prompts(tmp_path / "c")
    collect(tmp_path / "c", tiny_target, ["seed=1"])
    assert rows_of(tmp_path / "a") == rows_of(tmp_path / "b")
    assert rows_of(tmp_path / "a") != rows_of(tmp_path / "c")


def test_greedy_collect_and_domain_selection(tmp_path, tiny_target):
    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, ["collect.temperature=0", "collect.samples_per_prompt=1",
                                    "collect.domains=[code]", "collect.topk=0"])
    rows = rows_of(tmp_path)
    assert {r["domain"] for r in rows} == {"code"} and len(rows) == 3
    assert "topk_ids" not in rows[0]
    # greedy: the first completion token is the argmax of the target's next-token logits
    from pipeline.modelio.models import load_model
    model = load_model(tiny_target)
    for r in rows:
        logits = model(torch.tensor([r["prompt_ids"]])).logits[0, -1]
        assert r["completion_ids"][0] == int(logits.argmax())


# ----------------------------------------------------------------------------- white-box labels

def assert_topk_matches_fresh_forward(model, rows, k: int) -> None:
    """Stored top-k = top-k of log_softmax(target logits, T=1) over prompt_ids + completion_ids."""
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        n, p = len(r["completion_ids"]), len(r["prompt_ids"])
        fresh = torch.log_softmax(logits[p - 1:p - 1 + n], dim=-1)  # row j predicts completion_ids[j]
        stored_ids = torch.tensor(r["topk_ids"], dtype=torch.long)
        stored_lp = torch.tensor(r["topk_logprobs"], dtype=torch.float32)
        # the stored log-probs are the fresh ones at the stored ids (fp16 storage tolerance) ...
        torch.testing.assert_close(fresh.gather(1, stored_ids), stored_lp, atol=2e-2, rtol=2e-3)
        # ... and they are the k largest: same values as a fresh top-k (ids may swap only on ties)
        torch.testing.assert_close(fresh.topk(k).values, stored_lp, atol=2e-2, rtol=2e-3)
        agree = (fresh.topk(k).indices == stored_ids).float().mean()
        assert agree > 0.95, f"{r['id']}: only {agree:.0%} of top-{k} ids agree"


def test_topk_labels_match_a_fresh_target_forward(tmp_path, tiny_target):
    from pipeline.modelio.models import load_model

    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, ["collect.topk=8", "collect.batch_size=4"])  # padded batches
    rows = rows_of(tmp_path)
    assert_topk_matches_fresh_forward(load_model(tiny_target), rows, 8)


# ----------------------------------------------------------------------------- resume & scale-out

def crash_then_resume(tmp_path, target, monkeypatch, extra=()) -> Path:
    """Collects tmp_path/"whole" uninterrupted, then tmp_path/"crashed" with a Ctrl-C right after its first shard is
    written, checks nothing final or temporary was left, resumes it and checks no finished shard was redone (shards of
    2 prompts: chat 3, code 2) and the rows equal the uninterrupted run's. Returns the crashed run's root."""
    import data.collect as stage

    write_prompts(tmp_path / "whole")
    collect(tmp_path / "whole", target, list(extra))
    crashed = tmp_path / "crashed"
    write_prompts(crashed)
    real_save, saved = stage._save_shard, []

    def save_then_crash(final, *args):
        real_save(final, *args)
        saved.append(final.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "_save_shard", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        collect(crashed, target, list(extra))
    assert not (crashed / "collect" / "dataset").exists() and not (crashed / "collect" / "manifest.json").exists()
    assert len(saved) == 1 and len(list((crashed / "collect" / "shards").glob("*/*"))) == 1
    assert not leftovers(crashed / "collect")

    redone = []
    monkeypatch.setattr(stage, "_save_shard", lambda final, *a: (redone.append(final.name), real_save(final, *a)))
    collect(crashed, target, list(extra))
    assert saved[0] not in redone and len(redone) == 4
    assert rows_of(crashed) == rows_of(tmp_path / "whole")
    return crashed


def test_resume_after_a_crash_reproduces_an_uninterrupted_run(tmp_path, tiny_target, monkeypatch):
    crash_then_resume(tmp_path, tiny_target, monkeypatch)


def test_more_prompts_per_domain_later_only_add_shards(tmp_path, tiny_target, monkeypatch):
    import data.collect as stage

    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, ["collect.max_prompts_per_domain=2"])
    real_save, redone = stage._save_shard, []
    monkeypatch.setattr(stage, "_save_shard", lambda final, *a: (redone.append(final.name), real_save(final, *a)))
    collect(tmp_path, tiny_target)  # every prompt: the first shard of each domain is already done
    assert len(redone) == 3 and not any("-00000-" in name for name in redone)  # chat 2 more, code 1 more
    fresh = tmp_path / "fresh"
    write_prompts(fresh)
    collect(fresh, tiny_target)
    assert rows_of(tmp_path) == rows_of(fresh)


def test_a_budget_stops_before_a_shard_that_would_overrun_and_a_rerun_completes_it(tmp_path, tiny_target):
    """collect.max_minutes far below one shard's time: the first round (a shard per domain) still runs, the next
    shard would end past the budget so none starts, the merge keeps what ran; a rerun without a budget finishes the
    rest and gives the rows of an uninterrupted run."""
    write_prompts(tmp_path / "whole")
    collect(tmp_path / "whole", tiny_target)
    write_prompts(tmp_path)
    collect(tmp_path, tiny_target, ["collect.max_minutes=0.0001"])
    manifest = json.loads((tmp_path / "collect" / "manifest.json").read_text())
    assert manifest["budget"] == {"max_minutes": 0.0001, "shards_done": 2, "stopped_early": True}
    assert {row["domain"] for row in rows_of(tmp_path)} == {"chat", "code"}
    collect(tmp_path, tiny_target, ["collect.max_minutes=null"])
    assert json.loads((tmp_path / "collect" / "manifest.json").read_text())["budget"]["stopped_early"] is False
    assert rows_of(tmp_path) == rows_of(tmp_path / "whole")


def test_changed_sampling_settings_never_reuse_old_shards(tmp_path, tiny_target):
    write_prompts(tmp_path)
    collect(tmp_path, tiny_target)
    first = json.loads((tmp_path / "collect" / "manifest.json").read_text())["fingerprint"]
    collect(tmp_path, tiny_target, ["collect.temperature=0.9"])
    second = json.loads((tmp_path / "collect" / "manifest.json").read_text())["fingerprint"]
    assert first != second
    assert sorted(p.name for p in (tmp_path / "collect" / "shards").iterdir()) == sorted([first, second])
    fresh = tmp_path / "fresh"
    write_prompts(fresh)
    collect(fresh, tiny_target, ["collect.temperature=0.9"])
    assert rows_of(tmp_path) == rows_of(fresh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_accelerate_processes_produce_the_rows_of_one_cli_process(tmp_path, tiny_target):
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        write_prompts(d)
    single = _cli([sys.executable, "-m", "pipeline", "stage=collect", *overrides(one, tiny_target)])
    assert single.returncode == 0, single.stderr[-2000:]
    assert "eos_share" in single.stdout  # the per-domain summary table
    # accelerate's torch.distributed launcher (`--multi_gpu`) runs CPU processes too; its `--cpu`
    # launcher needs MPI for more than one process.
    multi = _cli([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--num_cpu_threads_per_process", "1", "--main_process_port", str(_free_port()),
                  "-m", "pipeline", "stage=collect", *overrides(two, tiny_target)])
    assert multi.returncode == 0, multi.stderr[-2000:]
    metas = [json.loads(p.read_text()) for p in (two / "collect" / "shards").glob("*/*/meta.json")]
    assert {m["process_index"] for m in metas} == {0, 1}
    key = lambda r: r["id"]  # noqa: E731
    assert sorted(rows_of(two), key=key) == sorted(rows_of(one), key=key)


# ----------------------------------------------------------------------------- batching

def hf_settings(temperature: float, batch_size: int, hidden: bool = False):
    """Backend settings of the tests below: 8 new tokens, top-4 labels."""
    from data.collect_rows import CollectSettings

    return CollectSettings(temperature=temperature, max_new_tokens=8, samples_per_prompt=1, topk=4, hidden_states=hidden,
                           batch_size=batch_size, shard_size=1, backend="hf", seed=0, keep_shards=True, domains=None,
                           max_prompts_per_domain=None, max_minutes=None, vllm={})


def test_out_of_memory_halves_the_batch_and_matches_a_run_at_that_size(tiny_target, monkeypatch):
    from data.collect_hf import HFBackend
    from pipeline.modelio.models import load_model

    model = load_model(tiny_target)
    contexts = [[3, 6, 7, 1, 4], [3, 6, 1, 4], [3, 8, 9, 10, 11, 1, 4], [3, 12, 1, 4], [3, 13, 14, 1, 4]]
    reference = HFBackend(model, 1, [1], hf_settings(0.7, batch_size=2)).generate(contexts, seed=7)

    backend = HFBackend(model, 1, [1], hf_settings(0.7, batch_size=8))
    real = backend._generate_batch

    def small_gpu(batch):
        if len(batch) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(batch)

    monkeypatch.setattr(backend, "_generate_batch", small_gpu)
    got = backend.generate(contexts, seed=7)
    assert backend.batch_size == 2
    assert [c.ids for c in got] == [c.ids for c in reference]


def test_stored_final_hidden_states_give_the_labels_of_a_target_pass(tiny_target):
    """collect.hidden_states: the head's input stored per generated token (left-padded batches, sampled) gives,
    through the head alone, the collect's own top-k labels and the FR-Spec subset mass of distill's teacher-forced
    target pass; the same states one position off (a wrong alignment) do not."""
    from data.collect_hf import HFBackend
    from distill.aligned import Truncation
    from distill.labels import labels_from_hidden, teacher_labels
    from pipeline.modelio.models import load_model

    model = load_model(tiny_target)
    contexts = [[3, 6, 7, 1, 4], [3, 6, 1, 4], [3, 8, 9, 10, 11, 1, 4], [3, 12, 1, 4]]
    completions = HFBackend(model, 1, [1], hf_settings(0.7, batch_size=4, hidden=True)).generate(contexts, seed=3)
    assert all(c.final_hidden.shape == (len(c.ids), model.config.hidden_size) for c in completions)
    vocab = torch.arange(0, model.config.vocab_size, 3)
    lengths = [len(c.ids) for c in completions]
    stored = labels_from_hidden(model, [c.final_hidden.astype("float32") for c in completions], lengths, 4, vocab)
    rows = [{"prompt_ids": ctx, "completion_ids": c.ids} for ctx, c in zip(contexts, completions)]
    forward = teacher_labels(model, rows, Truncation(64, 64), 4, vocab, 2, 1)
    for i, c in enumerate(completions):
        assert stored["topk_ids"][i] == c.topk_ids.tolist()
        assert stored["subset_logmass"][i] == pytest.approx(forward["subset_logmass"][i], abs=2e-3)
    shifted = [np.roll(c.final_hidden.astype("float32"), 1, axis=0) for c in completions]
    off = labels_from_hidden(model, shifted, lengths, 0, vocab)["subset_logmass"]
    worst = max(abs(a - b) for row, ref in zip(off, forward["subset_logmass"]) for a, b in zip(row, ref))
    assert worst > 0.05, worst


def test_batches_are_length_sorted_and_never_more_than_double_the_prefill():
    from data.collect_hf import HFBackend

    backend = HFBackend.__new__(HFBackend)  # only the batching rule, no model
    backend.batch_size = 4
    lengths = [49, 286, 64, 60, 70, 150, 100, 90, 55, 58, 62, 66, 68, 52, 50, 64]
    batches = backend._batches(lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths, reverse=True)
    for b in batches:
        assert len(b) <= 4 and len(b) * lengths[b[0]] <= 2 * sum(lengths[i] for i in b)
    assert [lengths[i] for i in batches[0]] == [286, 150, 100, 90]
    backend.batch_size = 16
    assert [lengths[i] for i in backend._batches(lengths)[0]] == [286, 150, 100, 90]  # 70 would pad past 2x


def test_batched_generation_equals_unbatched_greedy(tiny_target):
    """Left padding must not change what the target generates (greedy, fp32)."""
    from data.collect_hf import HFBackend
    from pipeline.modelio.models import load_model

    model = load_model(tiny_target)
    contexts = [[3, 6, 7, 1, 4], [3, 8, 9, 10, 11, 12, 13, 1, 4], [3, 14, 1, 4]]
    batched = HFBackend(model, 1, [1], hf_settings(0.0, batch_size=3)).generate(contexts, seed=0)
    single = HFBackend(model, 1, [1], hf_settings(0.0, batch_size=1)).generate(contexts, seed=0)
    assert [c.ids for c in batched] == [c.ids for c in single]


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("extra, message", [
    (["collect.domains=[chat,poetry]"], "poetry"),
    (["collect.domains=[]"], "collect.domains is empty"),
    (["model.target.path=/nonexistent/target"], "does not exist"),
    (["collect.max_new_tokens=0"], "max_new_tokens"),
    (["collect.samples_per_prompt=0"], "samples_per_prompt"),
    (["collect.backend=tgi"], "collect.backend"),
    (["collect.temperature=0", "collect.samples_per_prompt=2"], "identical"),
    (["collect.temperature=-0.5"], r"collect\.temperature"),
    (["collect.top_p=1.5"], r"collect\.top_p"),
    (["collect.top_k=-1"], r"collect\.top_k"),
    # a value of the wrong type: the group's structured config refuses it while composing
    (["collect.top_k=0.5"], r"collect\.top_k=0\.5: Value '0\.5' of type 'float' could not be converted to Integer"),
    (["collect.topk=abc"], r"collect\.topk=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    (["collect.temperature=abc"], r"collect\.temperature=abc: Value 'abc' of type 'str' could not be converted"),
    (["collect.batch_size=0"], r"collect\.batch_size"),
    (["+collect.no_such_knob=1"], r"^unknown setting\(s\) collect\.no_such_knob"),
    (["collect.keep_shards=maybe"], r"collect\.keep_shards=maybe: Value 'maybe' is not a valid bool"),
    (["collect.max_prompts_per_domain=abc"], r"collect\.max_prompts_per_domain=abc: Value 'abc' of type 'str'"),
    (["collect.max_minutes=0"], r"collect\.max_minutes=0\.0 must be > 0"),
])
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, tiny_target, extra, message):
    write_prompts(tmp_path)
    with pytest.raises(PipelineError, match=message) as e:
        collect(tmp_path, tiny_target, extra)
    assert "\n" not in str(e.value) and ": " in str(e.value)
    assert not (tmp_path / "collect").exists()


def test_collect_settings_are_the_yaml_keys_and_frozen(tmp_path, tiny_target):
    """CollectSettings is the collect group's structured config (temperature, top_k and top_p its `sampling`), every
    value from the composed config; a missing key is one line."""
    import dataclasses

    from omegaconf import OmegaConf, open_dict

    from data.collect_rows import CollectSettings

    cfg = compose(tmp_path, tiny_target)
    settings = CollectSettings.from_config(cfg.collect, cfg.seed)
    assert OmegaConf.get_type(cfg.collect) is CollectSettings
    assert [f.name for f in dataclasses.fields(CollectSettings)] == list(cfg.collect)
    assert settings.sampling.to_dict() == {k: cfg.collect[k] for k in CollectSettings.SAMPLING}
    assert settings.max_minutes == cfg.collect.max_minutes and dict(settings.vllm) == cfg.collect.vllm
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.topk = 0
    with pytest.raises(TypeError):
        settings.vllm["tensor_parallel_size"] = 2
    with open_dict(cfg.collect):
        del cfg.collect.keep_shards
    with pytest.raises(PipelineError, match=r"collect\.keep_shards missing") as e:
        CollectSettings.from_config(cfg.collect, cfg.seed)
    assert "\n" not in str(e.value)


def test_missing_prompts_is_one_line_on_the_cli(tmp_path, tiny_target):
    done = _cli([sys.executable, "-m", "pipeline", "stage=collect", *overrides(tmp_path, tiny_target)])
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "stage=prepare" in done.stderr
    assert not (tmp_path / "collect").exists()


def test_vllm_backend_names_the_package_when_missing(tmp_path, tiny_target, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    write_prompts(tmp_path)
    with pytest.raises(PipelineError, match="pip install vllm"):
        collect(tmp_path, tiny_target, ["collect.backend=vllm"])
    assert not (tmp_path / "collect" / "dataset").exists()


# ------------------------------------------------------------- the vLLM backend's row mapping, on a fake engine
class FakeLogprob:  # vllm.sequence.Logprob: logprob, rank (1 = best), decoded_token
    def __init__(self, logprob: float, rank: int):
        self.logprob, self.rank, self.decoded_token = logprob, rank, None


class FakeCompletionOutput:  # vllm.outputs.CompletionOutput
    def __init__(self, token_ids, finish_reason, logprobs=None):
        self.token_ids, self.finish_reason, self.logprobs = tuple(token_ids), finish_reason, logprobs


def fake_vllm(outputs):
    """A stand-in `vllm` module whose LLM returns `outputs` (one CompletionOutput per prompt) and records
    what the backend asked for."""
    import types

    calls = {}

    class LLM:
        def __init__(self, **kwargs):
            calls["llm"] = kwargs

        def generate(self, prompts, params, use_tqdm=True):
            calls["prompts"], calls["params"] = prompts, params
            return [types.SimpleNamespace(outputs=[output]) for output in outputs[:len(prompts)]]

    def sampling_params(**kwargs):
        return types.SimpleNamespace(**kwargs)

    def tokens_prompt(prompt_token_ids):
        return {"prompt_token_ids": prompt_token_ids}

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.TokensPrompt = LLM, sampling_params, tokens_prompt
    return module, calls


def vllm_backend(monkeypatch, outputs, topk=3, top_k=0):
    import types

    from data.collect_vllm import VLLMBackend
    from pipeline.sampling import Sampling

    module, calls = fake_vllm(outputs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    settings = types.SimpleNamespace(sampling=Sampling(0.7, top_k, 0.9), max_new_tokens=4, topk=topk)
    options = SHIPPED.collect.vllm  # the shipped collect.vllm
    return VLLMBackend("/models/t", settings, stop_ids=[1, 7], dtype=torch.bfloat16, options=options), calls


def ranked(*pairs):
    """One position's log-prob dict {token: Logprob} from (token, logprob, rank) triples, in scrambled order."""
    return {token: FakeLogprob(lp, rank) for token, lp, rank in reversed(pairs)}


def test_vllm_rows_map_finish_reason_top_k_ranks_and_logprobs(monkeypatch):
    positions = [ranked((5, -0.1, 1), (9, -2.5, 2), (4, -3.0, 3)),
                 # the sampled token 30 is outside the top-3: vLLM adds it (rank 8); only the 3 best ranks are kept
                 ranked((12, -0.5, 1), (3, -1.25, 2), (8, -4.0, 3), (30, -6.0, 8)),
                 ranked((1, -0.01, 1), (2, -5.0, 2), (6, -7.0, 3))]
    outputs = [FakeCompletionOutput([5, 30, 1], "stop", positions),        # ends on a stop id: eos
               FakeCompletionOutput([5, 30, 2], "length", positions),      # max_tokens
               FakeCompletionOutput([5, 30, 2], "stop", positions)]        # a stop *string*, not an id: length
    backend, calls = vllm_backend(monkeypatch, outputs)
    done = backend.generate([[2, 4], [2, 5, 6], [3]], seed=11)

    assert [c.finish_reason for c in done] == ["eos", "length", "length"]
    assert [c.ids for c in done] == [[5, 30, 1], [5, 30, 2], [5, 30, 2]]
    first = done[0]
    assert first.topk_ids.dtype == np.int32 and first.topk_logprobs.dtype == np.float16
    assert first.topk_ids.tolist() == [[5, 9, 4], [12, 3, 8], [1, 2, 6]]
    np.testing.assert_array_equal(first.topk_logprobs,
                                  np.array([[-0.1, -2.5, -3.0], [-0.5, -1.25, -4.0], [-0.01, -5.0, -7.0]], np.float16))
    # what the engine was asked: token prompts, raw log-probs of width k, per-request seeds, stop ids, top_k off = -1
    assert calls["llm"]["logprobs_mode"] == "raw_logprobs" and calls["llm"]["max_logprobs"] == 3
    assert calls["llm"]["dtype"] == "bfloat16"
    assert [p["prompt_token_ids"] for p in calls["prompts"]] == [[2, 4], [2, 5, 6], [3]]
    params = calls["params"]
    assert [p.logprobs for p in params] == [3, 3, 3] and all(p.top_k == -1 for p in params)
    assert all(p.stop_token_ids == [1, 7] and p.max_tokens == 4 and p.temperature == 0.7 for p in params)
    assert len({p.seed for p in params}) == 3 and all(0 <= p.seed < 2**31 for p in params)


def test_vllm_rows_without_labels_and_with_a_short_logprob_list(monkeypatch):
    backend, _ = vllm_backend(monkeypatch, [FakeCompletionOutput([4, 7], "stop")], topk=0, top_k=5)
    (done,) = backend.generate([[2]], seed=0)
    assert (done.ids, done.finish_reason, done.topk_ids, done.topk_logprobs) == ([4, 7], "eos", None, None)
    short = FakeCompletionOutput([4, 5], "length", [ranked((4, -0.2, 1), (5, -1.0, 2), (6, -2.0, 3))])
    backend, _ = vllm_backend(monkeypatch, [short])
    with pytest.raises(PipelineError, match="1 log-prob rows for 2 tokens"):
        backend.generate([[2]], seed=0)


# ----------------------------------------------------------------------------- the real target

@pytest.mark.smoke
def test_real_target_collects_two_prompts_per_domain(tmp_path, real_target, real_target_path):
    model, tokenizer = real_target
    write_prompts(tmp_path, [
        {"id": "chat-0", "domain": "chat", "turns": ["What is the capital of France?", "And of Italy?"]},
        {"id": "chat-1", "domain": "chat", "turns": ["Say hello in one word."]},
        {"id": "math-0", "domain": "math", "turns": ["What is 12 + 30? Answer with the number."]},
        {"id": "math-1", "domain": "math", "turns": ["Compute 7 * 6. Solve it step by step."]}])
    collect(tmp_path, real_target_path, ["collect.max_new_tokens=16", "collect.samples_per_prompt=1",
                                         "collect.topk=8", "collect.batch_size=4", "collect.shard_size=2"])
    rows = rows_of(tmp_path)
    manifest = json.loads((tmp_path / "collect" / "manifest.json").read_text())
    assert len(rows) == 5 and set(manifest["domains"]) == {"chat", "math"}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in manifest["stop_token_ids"]
    for r in rows:
        assert r["text"].strip() and len(r["completion_ids"]) <= 16
        assert (r["finish_reason"] == "eos") == (r["completion_ids"][-1] in manifest["stop_token_ids"])
        assert tokenizer.decode(r["prompt_ids"]).startswith("<|im_start|>system")
    follow_up = next(r for r in rows if r["id"] == "chat-0/t1/s0")
    first = next(r for r in rows if r["id"] == "chat-0/t0/s0")
    assert first["text"] in tokenizer.decode(follow_up["prompt_ids"])
    assert_topk_matches_fresh_forward(model, rows, 8)
