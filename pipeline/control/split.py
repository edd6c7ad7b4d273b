"""Which collected prompts train the draft, which calibrate it and which report on it, and which train prompts collect
answers with the draft (collect.onpolicy): distill's rule, in the core so that collect applies the same one. Every
split depends only on the prompt ids and the seed, so a resumed or re-collected run splits the same way.
"""
from __future__ import annotations

import hashlib


def split_by_prompt(prompt_ids: list[str], domains: list[str], fraction: float, max_heldout: int | None,
                    seed: int, origins: list[str] | None = None) -> tuple[list[int], list[int]]:
    """Row indices (train, held-out): per domain, the prompts with the smallest hash(seed, prompt_id) are
    held out (at least one where the domain has two or more prompts), so all turns and samples of a prompt
    stay on one side and the split does not depend on row order. A prompt with a row whose `origins` entry is not
    "target" (the draft's tokens, collect.onpolicy; given text, collect.text) is never held out: held-out rows are the
    target's own; the count is still a share of the domain's collected prompts (text rows' aside), so the held-out
    prompts are those of a collect without either."""
    drafted = {p for p, origin in zip(prompt_ids, origins or ()) if origin != "target"}
    given = {p for p, origin in zip(prompt_ids, origins or ()) if origin == "text"}
    held = set()
    for order in _ordered_by_domain(prompt_ids, domains, seed):
        order = [p for p in order if p not in given]
        n = 0 if len(order) < 2 else max(1, round(fraction * len(order)))
        n = min(n, int(max_heldout)) if max_heldout else n
        held.update([p for p in order if p not in drafted][:n])
    train = [i for i, p in enumerate(prompt_ids) if p not in held]
    heldout = [i for i, p in enumerate(prompt_ids) if p in held]
    return train, heldout


def nested_subset(prompt_ids: list[str], domains: list[str], fraction: float, seed: int) -> list[int]:
    """Row indices of the prompts a learning-curve point trains on: per domain, the first `fraction` of the
    prompts in a fixed hash order (at least one), so a smaller fraction's prompts are always among a larger
    one's and every point keeps the domain mix."""
    kept = set()
    for order in _ordered_by_domain(prompt_ids, domains, f"{seed}/train"):
        kept.update(order[:max(1, round(fraction * len(order)))])
    return [i for i, p in enumerate(prompt_ids) if p in kept]


def onpolicy_prompts(prompt_ids: list[str], domains: list[str], share: float, fraction: float,
                     max_heldout: int | None, seed: int) -> set[str]:
    """The prompts collect answers with the draft: per domain a `share` of those split_by_prompt keeps for training
    (so held-out prompts stay the target's), first in a hash order of their own, so a smaller share's prompts are
    among a larger one's."""
    train, _ = split_by_prompt(prompt_ids, domains, fraction, max_heldout, seed)
    chosen = set()
    for order in _ordered_by_domain([prompt_ids[i] for i in train], [domains[i] for i in train], f"{seed}/onpolicy"):
        chosen.update(order[:round(share * len(order))])
    return chosen


def split_heldout(prompt_ids: list[str], domains: list[str], share: float, seed: int) -> tuple[list[int], list[int], bool]:
    """Held-out row indices -> (calibration, reporting, disjoint). Per domain a `share` of the prompts (by
    another hash) calibrates and the rest reports; a domain with one held-out prompt uses it for both."""
    calibration, reporting, disjoint = set(), set(), True
    for order in _ordered_by_domain(prompt_ids, domains, f"{seed}/calibration"):
        if len(order) < 2:
            disjoint = False
            calibration.update(order)
            reporting.update(order)
            continue
        n = min(len(order) - 1, max(1, round(share * len(order))))
        calibration.update(order[:n])
        reporting.update(order[n:])
    return ([i for i, p in enumerate(prompt_ids) if p in calibration],
            [i for i, p in enumerate(prompt_ids) if p in reporting], disjoint)


def _ordered_by_domain(prompt_ids, domains, salt) -> list[list[str]]:
    """Each domain's distinct prompt ids, ordered by sha256(salt/prompt_id)."""
    by_domain: dict[str, set[str]] = {}
    for pid, domain in zip(prompt_ids, domains):
        by_domain.setdefault(domain, set()).add(pid)
    return [sorted(pids, key=lambda p: hashlib.sha256(f"{salt}/{p}".encode()).hexdigest())
            for pids in by_domain.values()]
