"""Engine configs are checked against the engines' own config code: pipeline/engines/fields.json holds the keys
each engine accepts at the version it names, read from that engine's source by tests/engine_fields.py (the llama.cpp
list is read again from the tree the llama.cpp tests build, and compared with that llama-server's --help); a key or
value outside it is refused. HF's generation_config is checked live against the installed transformers. The
configs a calibrate run exports for HF, vLLM, SGLang and TensorRT-LLM are checked in tests/test_engines_gpu.py."""
from __future__ import annotations

import re
import subprocess
from types import SimpleNamespace

import torch

from pipeline.engines import llamacpp
from pipeline.engines.rules import FIELDS, RULES, candidate_rules, rule_record, unknown_keys
from tests.conftest import SHIPPED, REPO, SERVER
from tests.engine_fields import extract, llama_server_flags, pydantic_fields, struct_flags


def test_each_field_list_names_its_version_and_source_and_admits_every_rule_setting():
    assert set(FIELDS) == {"llamacpp", "vllm", "sglang", "trtllm"}
    for name, entry in FIELDS.items():
        assert entry["version"] and entry["source"] and len(entry["fields"]) >= 10, name
    for engine, rules in RULES.items():
        for rule, settings in rules.items():
            config = [x for kv in settings.items() for x in kv] if engine in ("sglang", "llamacpp") else settings
            assert engine == "hf" or unknown_keys(engine, config) == [], (engine, rule)


def test_a_wrong_key_or_value_fails_the_check():
    assert unknown_keys("vllm", {"model": ".", "num_speculative_token": 3}) == ["num_speculative_token"]
    assert unknown_keys("vllm", {"draft_sample_method": "sampled"}) == ["draft_sample_method=sampled"]
    assert unknown_keys("vllm", {"rejection_sample_method": "strict"}) == ["rejection_sample_method=strict"]
    assert unknown_keys("sglang", ["--speculative-num-step", "3", "--speculative-eagle-topk", "1"]) == [
        "--speculative-num-step"]
    assert unknown_keys("trtllm", {"decoding_type": "DraftTarget", "max_draft_length": 3}) == [
        "max_draft_length", "decoding_type=DraftTarget"]
    # --draft-max was removed at the pinned llama.cpp (common/arg.cpp: arg_removed), --spec-type takes names
    assert unknown_keys("llamacpp", ["--draft-max", "4", "--spec-type", "draft"]) == ["--draft-max", "--spec-type=draft"]


def test_llama_server_gets_only_flags_of_the_pinned_version():
    chosen = SHIPPED.calibrate.llamacpp
    for n_max in chosen.n_max:
        for p_min in chosen.p_min:
            assert unknown_keys("llamacpp", llamacpp.draft_flags("draft.gguf", llamacpp.DraftSettings(n_max, p_min))) == []
    server = llamacpp.Server(REPO, "t.gguf", "d.gguf", llamacpp.SERVER_DEFAULTS, parallel=2, **SERVER)  # builds, never starts
    assert unknown_keys("llamacpp", server.command[1:]) == []


def test_hf_generation_config_fields_are_the_installed_transformers_own():
    from transformers import GenerationConfig

    known = set(GenerationConfig().to_dict())
    shipped = {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    assert set(shipped) <= known and "num_assistant_token" not in known


def test_the_extractors_read_fields_literals_flags_and_removed_options():
    source = ('from typing import Literal\nMode = Literal["a", "b"]\nclass C:\n    x: int = 1\n    mode: Mode = "a"\n'
              '    _private: int = 0\n    def f(self): y: int = 2\nclass D:\n    z: int = 0\n')
    assert pydantic_fields(source, "C") == {"fields": ["mode", "x"], "values": {"mode": ["a", "b"]}}
    struct = ('class S:\n    foo_bar: A[int, "help"] = 1\n    hidden: A[int, Arg(no_cli=True)] = 0\n'
              '    renamed: A[int, Arg(help="h", cli_name="--other", aliases=["--alias"])] = 0\n    plain: int = 0\n')
    assert struct_flags(struct) == ["--foo-bar", "--other", "--alias"]
    arg_cpp = ('static std::initializer_list<enum llama_example> mm = {\n LLAMA_EXAMPLE_SERVER,\n};\n'
               'add_opt(common_arg({"-a", "--aa"}, "h", f));\n'
               'add_opt(common_arg({"--b"}, {"--no-b"}, "h", f).set_examples({LLAMA_EXAMPLE_SERVER}));\n'
               'add_opt(common_arg({"--c"}, "h", f).set_examples({LLAMA_EXAMPLE_CLI}));\n'
               'add_opt(common_arg({"--d"}, "h", f).set_examples(mm));\n'
               'add_opt(common_arg({"--e"}, "h", f).set_excludes({LLAMA_EXAMPLE_SERVER}));\n'
               'add_opt(common_arg({"--gone"}, "h", [](){ arg_removed("x"); }).set_examples({LLAMA_EXAMPLE_SERVER}));\n')
    assert llama_server_flags(arg_cpp) == ["-a", "--aa", "--b", "--no-b", "--d"]


def test_greedy_serving_leaves_every_engine_one_rule_and_records_how_it_is_selected():
    assert all(list(candidate_rules(engine, True)) == ["greedy"] for engine in RULES)
    assert set(candidate_rules("vllm", False)) == {"greedy", "tau"} and list(candidate_rules("sglang", False)) == ["greedy"]
    tau = rule_record("vllm", "tau", 0.7)
    assert tau["settings"] == {"draft_sample_method": "probabilistic", "rejection_sample_method": "standard"}
    assert (tau["draft_temperature"], tau["draft_top_k_top_p"], tau["verification"]) == (0.7, False, "probabilistic")
    assert rule_record("trtllm", "tau", 0.7)["draft_top_k_top_p"] is True
    llama = rule_record("llamacpp", "greedy", 0.7)
    assert (llama["draft_temperature"], llama["verification"], llama["settings"]) == (0.0, "strict", {})
    assert "default" in llama["set_by"] and rule_record("sglang", "greedy", 0.7)["set_by"] == "the export"


def test_each_domain_takes_the_rule_and_length_predicted_fastest():
    from distill.engines import choose_fixed

    rows = torch.arange(6).repeat_interleave(8)  # six rows of eight positions, three per domain
    part = SimpleNamespace(domains=["code"] * 3 + ["chat"] * 3, row_of=rows)
    code = rows < 3
    weak, strong = torch.where(code, 0.9, 0.1), torch.where(code, 0.2, 0.8)
    alphas = {"greedy": {"calibration": weak, "reporting": weak}, "tau": {"calibration": strong, "reporting": strong}}
    cost = {"c": 0.05, "verify_ratio": {1: 1.0, 2: 1.0, 4: 1.0}}
    table = choose_fixed(alphas, SimpleNamespace(calibration=part, reporting=part), cost, [1, 2, 4], 0.05)
    assert (table["code"]["rule"], table["chat"]["rule"]) == ("greedy", "tau")
    assert table["code"]["num_speculative_tokens"] == 4 and all(e["speculate"] for e in table.values())
    only_weak = choose_fixed({"greedy": alphas["greedy"]}, SimpleNamespace(calibration=part, reporting=part), cost,
                             [1, 2, 4], 0.05)
    assert only_weak["chat"]["predicted_speedup_if_on"] < table["chat"]["predicted_speedup_if_on"]


def help_flags(text: str) -> set[str]:
    """The options llama-server --help lists: the run of comma-separated names that opens each entry (up to its
    value hint or help text, e.g. `-t,    --threads N`)."""
    runs = (re.match(r"(?:-[\w.-]+,?\s*)+", line) for line in text.splitlines() if line.startswith("-"))
    return {name for run in runs if run for name in re.findall(r"-[\w.-]+", run.group(0))}


def test_the_llama_cpp_field_list_is_the_built_servers_own(llamacpp_build):
    entry = FIELDS["llamacpp"]
    assert {k: entry[k] for k in ("fields", "values")} == extract("llamacpp", llamacpp_build / "src")
    shown = subprocess.run([str(llamacpp.binary(llamacpp_build, "llama-server")), "--help"], capture_output=True,
                           text=True, timeout=60)
    listed = help_flags(shown.stdout + shown.stderr)
    assert set(entry["fields"]) <= listed and "--spec-draft-n-max" in listed
    assert "--spec-draft-sampling" not in listed  # later llama.cpp's draft sampling switch is not in this version
