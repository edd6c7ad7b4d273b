"""collect.onpolicy: rows whose completions the draft samples and the target labels (DistillSpec's on-policy data,
Zhou et al. 2023), collected once with the target's own rows and cached like them. Which prompts, which draft and
what the rows and the manifest carry: docs/architecture.md ("Collected data").
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.errors import PipelineError
from pipeline.control.split import onpolicy_prompts


def mark_onpolicy(prompts: dict[str, list[dict]], share: float, cfg: DictConfig) -> dict[str, list[dict]]:
    """The prompts per domain, those the draft answers marked `origin: onpolicy`. The mark is part of the prompt, so
    each shard's name (the hash of its prompts) changes exactly where the choice does."""
    if not share:
        return prompts
    split = cfg.distill.split  # distill's held-out rule on the prompts collected, so held-out prompts stay the target's
    ids = [prompt["id"] for rows in prompts.values() for prompt in rows]
    domains = [domain for domain, rows in prompts.items() for _ in rows]
    chosen = onpolicy_prompts(ids, domains, share, float(split.heldout_fraction), split.heldout_max_prompts_per_domain,
                              int(cfg.seed))
    return {domain: [{**prompt, "origin": "onpolicy"} if prompt["id"] in chosen else prompt for prompt in rows]
            for domain, rows in prompts.items()}


def draft_spec(cfg: DictConfig, draft_dir: str | None) -> dict:
    """model.draft (what distill starts from), or collect.onpolicy.draft as a pretrained draft."""
    if draft_dir is None:
        return OmegaConf.to_container(cfg.model.draft, resolve=True)
    if not (Path(draft_dir) / "config.json").is_file():
        raise PipelineError(f"collect.onpolicy.draft={draft_dir} is not a model directory (no config.json): point it "
                            "at a draft's weights, or null for model.draft")
    return {"init": "pretrained", "path": draft_dir}


def draft_identity(cfg: DictConfig, draft_dir: str | None) -> dict:
    """What decides the draft's samples, for the shard fingerprint: model.draft's construction (its name and FR-Spec
    rows aside: distill's), or the weights and config of the draft directory."""
    from pipeline.modelio.packaged import sha256_of

    spec = draft_spec(cfg, draft_dir)
    if draft_dir is None:
        return {key: value for key, value in spec.items() if key not in ("name", "vocab_subset")}
    return {p.name: sha256_of(p) for p in sorted(Path(draft_dir).iterdir())
            if p.suffix in (".safetensors", ".bin", ".pt") or p.name == "config.json"}


def onpolicy_backend(cfg: DictConfig, settings, target, tokenizer, stop_ids: list[int], dtype):
    """The draft, built as distill builds its initial one (same seed) in the target's dtype, behind OnPolicyBackend."""
    from data.collect_hf import OnPolicyBackend
    from pipeline.modelio.draft_init import build_draft

    draft, _, info = build_draft(draft_spec(cfg, settings.onpolicy.draft), target, tokenizer, cfg.paths, seed=cfg.seed)
    print(f"[collect] on-policy rows: {settings.onpolicy.share:g} of each domain's train prompts answered by the draft "
          f"{info} and labelled by the target")
    return OnPolicyBackend(draft.to(dtype).eval(), target, tokenizer.pad_token_id, stop_ids, settings)


def label_cost(dataset, shard_metas: list[dict]) -> dict[str, dict]:
    """Per origin (target | onpolicy | text): rows, completion tokens, the process CPU and wall seconds spent producing
    them, summed over the shards whichever run or process made each, and labelled tokens per CPU second. Target rows
    cost the target's generation with its labels; on-policy rows the draft's sampling (draft_cpu_s of it) plus the
    target's one labelling pass; text rows that pass alone."""
    columns = dataset.select_columns([c for c in ("origin", "completion_ids") if c in dataset.column_names])
    cost: dict[str, dict] = {}
    for row in columns:
        entry = cost.setdefault(row.get("origin", "target"), {"rows": 0, "tokens": 0})
        entry["rows"] += 1
        entry["tokens"] += len(row["completion_ids"])
    for meta in shard_metas:  # a shard written before the cost was recorded adds none
        for origin, seconds in (meta.get("label_cost") or {}).items():
            entry = cost.setdefault(origin, {"rows": 0, "tokens": 0})
            for key, value in seconds.items():
                entry[key] = round(entry.get(key, 0.0) + value, 3)
    for entry in cost.values():  # the measure collect.text and collect.onpolicy are chosen by (issue: labels per CPU-s)
        if entry.get("cpu_s"):
            entry["tokens_per_cpu_s"] = round(entry["tokens"] / entry["cpu_s"], 2)
    return cost
