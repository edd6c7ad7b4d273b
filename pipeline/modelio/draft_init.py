"""The draft a run starts from (`model.draft.init`: `pretrained` of the target's family, `derive` from the target's
layers, optionally narrowed to `derive.hidden_size` by the hidden dimensions of largest embedding norm, or `fresh`),
built the same way by every stage that needs it: distill trains it, collect samples on-policy rows from it
(collect.onpolicy).
"""
from __future__ import annotations

import copy

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.errors import PipelineError
from pipeline.modelio.models import check_compatible, derive_draft, load_model, load_tokenizer, resolve_model

INITS = ("derive", "pretrained", "fresh")


def build_draft(spec: DictConfig | dict, target, target_tokenizer, paths, seed: int = 0):
    """(draft model in fp32 on the target's device, tokenizer, description for manifests)."""
    spec = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec)
    init = spec.get("init") or "derive"
    device = next(target.parameters()).device
    if init == "pretrained":
        path = resolve_model(spec, "draft", paths)
        draft, tokenizer = load_model(path, device, torch.float32), load_tokenizer(path)
        check_compatible(target_tokenizer, tokenizer, target, draft)
        info = {"init": "pretrained", "path": str(path)}
        keep = spec.get("keep_layers")
        if keep:  # a cheaper draft: a subset of the pretrained draft's own layers, distilled to recover
            draft = derive_draft(draft, list(keep))
            info["keep_layers"] = [int(i) for i in keep]
        return draft, tokenizer, info
    if init == "derive":
        derive = spec.get("derive") or {}
        layers = derive.get("layers")
        if layers is None:
            raise PipelineError("model.draft.init=derive needs model.draft.derive.layers: e.g. [0, 1, 2, 3]")
        draft = derive_draft(target, list(layers)).float()
        width = derive.get("hidden_size")
        if width and int(width) != target.config.hidden_size:
            draft = narrow_hidden(draft, int(width))
        return draft.to(device), target_tokenizer, {"init": "derive", "layers": [int(i) for i in layers],
                                                    "hidden_size": draft.config.hidden_size}
    if init == "fresh":
        fresh = spec.get("fresh") or {}
        config = copy.deepcopy(target.config)
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads"):
            if fresh.get(key):
                setattr(config, key, int(fresh[key]))
        config.head_dim = config.hidden_size // config.num_attention_heads
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1] * config.num_hidden_layers
        torch.manual_seed(seed)
        draft = type(target)(config).float()
        return draft.to(device).eval(), target_tokenizer, {"init": "fresh", **{k: getattr(config, k) for k in (
            "num_hidden_layers", "hidden_size", "intermediate_size")}}
    raise PipelineError(f"unknown model.draft.init={init!r}: use one of {', '.join(INITS)}")


# Which axis of each Llama/Qwen2-style weight is the residual-stream (hidden) axis.
_HIDDEN_AXIS = {"embed_tokens.weight": 1, "lm_head.weight": 1, "norm.weight": 0, "input_layernorm.weight": 0,
                "post_attention_layernorm.weight": 0, "q_proj.weight": 1, "k_proj.weight": 1, "v_proj.weight": 1,
                "o_proj.weight": 0, "gate_proj.weight": 1, "up_proj.weight": 1, "down_proj.weight": 0}


def narrow_hidden(draft, width: int):
    """The same layers with a `width`-dimensional residual stream: keep the hidden dimensions with the
    largest embedding column norm and slice every weight's hidden axis (attention heads keep head_dim)."""
    config = copy.deepcopy(draft.config)
    if not 0 < width < config.hidden_size:
        raise PipelineError(f"model.draft.derive.hidden_size={width} must be below the target's "
                            f"{config.hidden_size}: use a smaller width or null")
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    old = config.hidden_size
    keep = draft.get_input_embeddings().weight.norm(dim=0).topk(width).indices.sort().values
    config.hidden_size = width
    narrow = type(draft)(config).to(next(draft.parameters()).dtype)
    state = {}
    for key, value in draft.state_dict().items():
        suffix = ".".join(key.split(".")[-2:]) if not key.startswith("lm_head") else key
        axis = _HIDDEN_AXIS.get(suffix)
        if axis is None and old in value.shape and not key.endswith(".bias"):  # q/k/v biases: head axis
            raise PipelineError(f"cannot narrow weight {key} of a {type(draft).__name__}: "
                                "use derive.hidden_size=null or init=fresh for this architecture")
        state[key] = value if axis is None else value.index_select(axis, keep.to(value.device))
    narrow.load_state_dict(state)
    if getattr(config, "tie_word_embeddings", False):
        narrow.tie_weights()
    return narrow.eval()
