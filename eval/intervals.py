"""Intervals over requests: paired bootstrap CIs of pooled ratios (speedup, acceptance, TTFT, a sweep point's), and
the verdict of one method against another. Samples are per-request arrays; the statistics are vectorised."""
from __future__ import annotations

import numpy as np

from pipeline.measure.intervals import bootstrap_ci


def _div(num, den):
    """num / den elementwise, 0 where den is 0 (the point estimates' convention for an empty denominator)."""
    den = np.asarray(den, dtype=float)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def pooled(num, den, axis=-1):
    """Σ num / Σ den: tokens/s of (tokens, seconds), acceptance of (accepted, drafted)."""
    return _div(np.sum(num, axis=axis), np.sum(den, axis=axis))


def speedup_stat(tok_m, sec_m, tok_ar, sec_ar, axis=-1):
    """(Σ tokens_m / Σ time_m) / (Σ tokens_AR / Σ time_AR): the pooled point estimate, vectorised."""
    return _div(pooled(tok_m, sec_m, axis), pooled(tok_ar, sec_ar, axis))


def per_request(records: list[dict]) -> dict[tuple, list[float]]:
    """(domain, prompt, turn) → [tokens, seconds, accepted, drafted], summed so pooled sums are unchanged."""
    out: dict[tuple, list[float]] = {}
    for r in records:
        row = out.setdefault((r["domain"], r["prompt_id"], r["turn"]), [0.0, 0.0, 0.0, 0.0])
        row[0] += len(r["tokens"])
        row[1] += r["time_s"]
        if r["stats"] is not None:
            row[2] += sum(r["stats"].accepted)
            row[3] += sum(r["stats"].drafted)
    return out


def paired(a: list[dict], b: list[dict]) -> tuple[np.ndarray, ...]:
    """tokens and seconds of a and of b on the requests both ran, aligned request by request."""
    ra, rb = per_request(a), per_request(b)
    keys = [k for k in ra if k in rb]
    return (np.array([ra[k][0] for k in keys]), np.array([ra[k][1] for k in keys]),
            np.array([rb[k][0] for k in keys]), np.array([rb[k][1] for k in keys]))


def speedup_ci(records: list[dict], ar: list[dict]) -> list[float] | None:
    return bootstrap_ci(paired(records, ar), speedup_stat)


def paired_ratio(samples: tuple) -> tuple[float, list[float] | None]:
    """(Σ tokens_a / Σ seconds_a) / (Σ tokens_b / Σ seconds_b) of samples (tokens_a, seconds_a, tokens_b, seconds_b)
    per request, and its paired 95% interval."""
    samples = tuple(np.asarray(x, dtype=float) for x in samples)
    return float(speedup_stat(*samples)), bootstrap_ci(samples, speedup_stat)


def acceptance_ci(records: list[dict]) -> list[float] | None:  # of Σ accepted / Σ drafted
    rows = list(per_request(records).values())
    return bootstrap_ci((np.array([r[2] for r in rows]), np.array([r[3] for r in rows])), pooled)


# A bootstrap over n requests has at most C(2n−1, n) distinct resamples (3 for n = 2, 10 for n = 3): its interval
# understates the noise, so below this many requests no verdict is given at all.
MIN_REQUESTS_FOR_VERDICT = 5


def compare(records: list[dict], other: list[dict]) -> dict:
    """Ratio of two methods' speedups on the same requests (AR cancels: the ratio of their tokens/s), its paired
    CI, and whether that CI contains 1 (the two cannot be told apart on these requests; None without a CI or
    with fewer than MIN_REQUESTS_FOR_VERDICT requests)."""
    samples = paired(records, other)
    (ratio, ci), n = paired_ratio(samples), len(samples[0])
    verdict = None if ci is None or n < MIN_REQUESTS_FOR_VERDICT else bool(ci[0] <= 1.0 <= ci[1])
    return {"ratio": ratio, "ci95": ci, "n_requests": n, "within_noise": verdict}
