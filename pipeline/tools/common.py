"""What the subcommands that decode share: their prompts, their models and eval's one timing harness (eval/sweeps.py
`timed` and `rotated` on pipeline/timing.py's clock), so a tool's figures are measured the way eval measures its."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from eval.sweeps import rotated, timed
from pipeline.errors import PipelineError
from pipeline.prompts import load_prompts
from pipeline.timing import synced_clock


def first_turns(path: str | Path, n: int) -> list[dict]:
    """{domain, text}: the first user turn of n prompts spread over the file (Spec-Bench groups its categories)."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"tool.prompts={path} is not a file: run `python -m pipeline stage=prepare` or pass a "
                            "prompt JSONL")
    rows = load_prompts(path)
    step = max(1, len(rows) // n)
    return [{"domain": row.get("domain", "default"), "text": row["turns"][0]} for row in rows[::step]][:n]


def model_dir(cfg, role: str) -> Path:
    """tool.<role>, else the preset's converted target / the pipeline's draft export (paths.draft)."""
    from pipeline.models import resolve_model

    chosen = cfg.tool.get(role)
    if chosen is None:
        return resolve_model(cfg.model.target, "target", cfg.paths) if role == "target" else Path(cfg.paths.draft)
    if not (Path(chosen) / "config.json").is_file():
        raise PipelineError(f"tool.{role}={chosen} is not an HF model directory (no config.json): pass a directory "
                            "the pipeline exported or converted")
    return Path(chosen)


def check_given_dirs(cfg) -> None:
    """tool.target and tool.draft, where given, are model directories: checked before anything loads or converts."""
    for role in ("target", "draft"):
        if cfg.tool.get(role) is not None:
            model_dir(cfg, role)


def load_pair(cfg) -> SimpleNamespace:
    """Target, draft and tokenizer on runtime.device in runtime.dtype, and the clock that times them."""
    from pipeline.chat import stop_token_ids
    from pipeline.models import load_model, load_tokenizer, resolve_device

    target_dir, draft_dir = model_dir(cfg, "target"), model_dir(cfg, "draft")
    if not (draft_dir / "config.json").is_file():
        raise PipelineError(f"no draft at {draft_dir}: run `python -m pipeline stage=distill` or pass tool.draft=<dir>")
    device, dtype = resolve_device(cfg.runtime, target_dir, cfg.paths.models)
    target, tokenizer = load_model(target_dir, device, dtype), load_tokenizer(target_dir)
    return SimpleNamespace(target=target, draft=load_model(draft_dir, device, dtype), tokenizer=tokenizer,
                           draft_dir=draft_dir, device=device, dtype=dtype, clock=synced_clock(device),
                           stop=stop_token_ids(tokenizer, target))


def measure(methods: dict, requests: list[dict], n: int, clock, warmup_tokens: int = 8) -> dict[str, list[dict]]:
    """{method: a record per request}: each method fn(ids, domain, n, seed) -> (tokens, stats) decodes every request
    in eval's rotating order after an untimed warm-up on the first; a request's seed is the same for every method."""
    first = requests[0]
    for fn in methods.values():
        fn(first["ids"], first["domain"], warmup_tokens, first["seed"])
    records: dict[str, list[dict]] = {name: [] for name in methods}
    for k, request in enumerate(requests):
        for name in rotated(list(methods), k):
            tokens, stats, seconds = timed(methods[name], request["ids"], request["domain"], n, request["seed"], clock)
            records[name].append({"tokens": tokens, "stats": stats, "time_s": seconds, "domain": request["domain"]})
    return records
