"""The paired bootstrap every stage's intervals use: eval's over requests, distill's keep_best over held-out rows."""
from __future__ import annotations

import warnings

import numpy as np
from scipy.stats import bootstrap

CI_LEVEL = 0.95
N_RESAMPLES = 9999
BOOTSTRAP_SEED = 0  # fixed: the same samples always give the same interval


def bootstrap_ci(samples: tuple, statistic) -> list[float] | None:
    """95% interval of statistic(*samples) over units (requests, held-out rows), or None below 2 units. Paired: every
    resample draws the same unit indices for all samples, so the difficulty a method and its baseline share cancels.
    BCa (Efron & Tibshirani 1993, ch. 14: second-order accurate for a skewed ratio), else the percentile interval
    (ch. 13) where BCa degenerates (no jackknife spread) or its corrections push the interval off the estimate."""
    samples = tuple(np.asarray(x, dtype=float) for x in samples)
    if len(samples[0]) < 2:
        return None
    point = float(statistic(*samples, axis=-1))
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the degenerate-BCa warning: handled by the percentile fallback
            res = bootstrap(samples, statistic, paired=True, vectorized=True, n_resamples=N_RESAMPLES,
                            confidence_level=CI_LEVEL, method=method, rng=np.random.default_rng(BOOTSTRAP_SEED))
        lo, hi = (float(v) for v in res.confidence_interval)
        if np.isfinite(lo) and np.isfinite(hi) and lo <= point <= hi:
            break
    return [lo, hi]
