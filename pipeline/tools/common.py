"""The harness of the subcommand that times (gpu-check): eval's rotating order and clock
(eval/harness.py `rotated` and `timed` on pipeline/timing.py's clock), so a tool's figures are measured the way eval
measures its."""
from __future__ import annotations

from eval.harness import rotated, timed


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
