"""Monte Carlo error helpers shared by the statistical tests."""

import numpy as np


def batch_means_se(draws, num_batches=40):
    """Batch-means estimate and standard error of the mean of ``draws`` (chains, samples, ...).

    Each chain is cut into ``num_batches`` consecutive batches, much longer than the
    integrated autocorrelation time, so batch means are ~independent; the SE is their
    standard deviation over sqrt(total number of batches)."""
    draws = np.asarray(draws, np.float64)
    c, s = draws.shape[:2]
    m = s // num_batches
    bm = draws[:, : m * num_batches].reshape((c, num_batches, m) + draws.shape[2:]).mean(2)
    bm = bm.reshape((c * num_batches,) + draws.shape[2:])
    return bm.mean(0), bm.std(0, ddof=1) / np.sqrt(c * num_batches)
