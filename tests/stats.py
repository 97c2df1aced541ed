"""Statistics for the sampling tests (losslessness is a statement about distributions)."""

import jax
import numpy as np


def chi2_pvalue(observed, expected, impossible: str = "an outcome of probability 0 occurred"):
    """Pearson chi-square p-value; cells with expected < 5 are pooled, zero-expected cells must be empty
    (else the assertion says `impossible`)."""
    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    assert observed[expected == 0].sum() == 0, impossible
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(np.sum((obs - exp) ** 2 / exp))
    df = len(obs) - 1
    return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0)) if df > 0 else 1.0
