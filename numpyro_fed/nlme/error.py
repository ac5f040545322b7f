"""Residual error models of nonlinear mixed-effects models, with M3 censoring below the LLOQ.

An observation :math:`y_{ij}` of subject :math:`i` is the structural prediction
:math:`f_{ij}` plus a residual error whose standard deviation :math:`g(f)` depends on the
error model (Monolix's names):

- ``additive``: :math:`y = f + a\\varepsilon`, :math:`g(f) = a`;
- ``proportional``: :math:`y = f + b|f|\\varepsilon`, :math:`g(f) = b|f|`;
- ``combined1``: :math:`y = f + (a + b|f|)\\varepsilon`, :math:`g(f) = a + b|f|`;
- ``combined2``: :math:`y = f + \\sqrt{a^2 + b^2 f^2}\\,\\varepsilon`,
  :math:`g(f) = \\sqrt{a^2 + b^2 f^2}`;
- ``exponential``: :math:`y = f e^{\\sigma\\varepsilon}`, :math:`g = \\sigma` on the log scale,

with :math:`\\varepsilon \\sim N(0, 1)`. The exponential model is a log-normal distribution
of :math:`y` (:math:`\\log y \\sim N(\\log f, \\sigma^2)`); its log-density is taken on the
*observation* scale (it includes the Jacobian :math:`-\\log y`), so that -2LL, AIC and BIC
compare across the five error models on the same data.

**Censoring (M3).** Observations below the lower limit of quantification (BLQ) are given by
a boolean ``cens`` (``True`` = below the LLOQ) and the limit ``lloq``; Beal's M3 method
replaces their density by the probability of being below the limit,
:math:`\\log P(Y < \\mathrm{LLOQ}) = \\log\\Phi((\\mathrm{LLOQ} - f)/g(f))` (exponential
model: :math:`\\log\\Phi((\\log \\mathrm{LLOQ} - \\log f)/\\sigma)`), computed with
:func:`jax.scipy.special.log_ndtr`, which stays finite and accurate far in the tail.
Upper censoring (NONMEM's ``CENS = -1``) is not supported and is refused.

**Proportional error at** :math:`f = 0`. The proportional model's standard deviation
:math:`b|f|` is zero where the prediction is zero (e.g. before the first dose, or at the
dosing time of an oral dose). Nothing is floored or changed silently: :meth:`ErrorModel.dist`
refuses such predictions when their values are known (a ``ValueError``), and under ``jit``
the log-density there is NaN (:math:`y \\ne 0`: an impossible observation; :math:`y = 0`:
:math:`0/0`). Likewise the exponential model needs :math:`f > 0` (:math:`f = 0`: -inf,
:math:`f < 0`: NaN under ``jit``). Use a combined model (``"combined2"`` is the recommended
default of the model builder) when predictions can be zero; it is finite and differentiable
at :math:`f = 0`.

**Parameters.** The error parameters are ``numpyro.param`` sites with a positive constraint
(their names carry the ``prefix``, e.g. ``"conc_a"``), so that :class:`numpyro_fed.saem.SAEM`
estimates them; with no censoring the additive model is a plain
:class:`~numpyro.distributions.Normal` whose scale is one parameter, the case in which
SAEM's M-step is in closed form.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.scipy.special import log_ndtr
from numpyro.distributions import constraints
from numpyro.distributions.util import validate_sample
from numpyro.util import not_jax_tracer

__all__ = [
    "ALIASES",
    "KINDS",
    "CensoredLogNormal",
    "CensoredNormal",
    "ErrorModel",
]

KINDS: tuple[str, ...] = ("additive", "proportional", "combined1", "combined2", "exponential")
"""The error models, by their canonical names."""

ALIASES: dict[str, str] = {
    "constant": "additive",
    "add": "additive",
    "prop": "proportional",
    "comb1": "combined1",
    "comb2": "combined2",
    "exp": "exponential",
    "log": "exponential",
    "lognormal": "exponential",
}
"""Accepted alternative names (case-insensitive) and the kind each one means. ``"combined"``
alone is refused: software disagree on whether it means ``combined1`` or ``combined2``."""

_PARAMS: dict[str, tuple[str, ...]] = {
    "additive": ("a",),
    "proportional": ("b",),
    "combined1": ("a", "b"),
    "combined2": ("a", "b"),
    "exponential": ("sigma",),
}
_DEFAULT_INIT: dict[str, float] = {"a": 1.0, "b": 0.1, "sigma": 0.1}
_LOG_SQRT_2PI = 0.5 * float(np.log(2.0 * np.pi))


# ------------------------------------------------------------------------------ helpers
def _concrete(x) -> np.ndarray | None:
    """``x`` as a NumPy array if its value is known (not a JAX tracer), else ``None``."""
    if not not_jax_tracer(x):
        return None
    return np.asarray(x)


def _where_text(bad: np.ndarray, labels: np.ndarray | None, limit: int = 10) -> str:
    """Where the ``True`` entries of ``bad`` are: their labels (when of ``bad``'s shape) or
    their indices."""
    if labels is not None and np.shape(labels) == np.shape(bad):
        found = [str(v) for v in np.asarray(labels)[bad]]
        what = "at"
    else:
        idx = np.argwhere(bad)
        found = [str(int(i[0])) if bad.ndim == 1 else str(tuple(int(j) for j in i))
                 for i in idx]
        what = "at index" if bad.ndim <= 1 else "at index (row, column, ...)"
    more = f", ... ({len(found)} in all)" if len(found) > limit else ""
    return f"{what} {', '.join(found[:limit])}{more}"


def _arg(name: str, columns: Mapping[str, Any] | None) -> str:
    """An argument's name in a message, with the column of the input table it came from."""
    col = None if columns is None else columns.get(name)
    return f"`{name}`" + ("" if col is None else f" (column {col!r})")


def _as_cens(cens, who: str, labels=None, columns=None):
    """``cens`` as a boolean array. A concrete array is checked (values 0/1 or booleans); a
    traced one must already be boolean (its values cannot be checked under ``jit``)."""
    c = _concrete(cens)
    if c is None:
        if jnp.asarray(cens).dtype != jnp.bool_:
            raise TypeError(
                f"{who}: `cens` is a traced array of dtype {jnp.asarray(cens).dtype}; inside "
                "jit it must be boolean (True = below the LLOQ), because its values cannot be "
                "checked there. Convert it before tracing, e.g. `cens = np.asarray(CENS) == 1`."
            )
        return cens
    if c.dtype != np.bool_:
        if not np.issubdtype(c.dtype, np.number):
            raise TypeError(f"{who}: `cens` must be a boolean array (True = below the LLOQ), "
                            f"got dtype {c.dtype}.")
        bad = ~np.isin(c, (0, 1))
        if bad.any():
            raise ValueError(
                f"{who}: {_arg('cens', columns)} must hold booleans or 0/1 (1 = below the "
                f"LLOQ); it has {int(bad.sum())} other value(s) {_where_text(bad, labels)} "
                f"(values {np.unique(c[bad])[:5].tolist()}). Upper censoring (NONMEM's "
                "CENS = -1, above the ULOQ) is not supported: drop those rows or mark them "
                "missing."
            )
    return jnp.asarray(c.astype(bool))


def _broadcast_shape(who: str, **arrays) -> tuple[int, ...]:
    shapes = {k: tuple(jnp.shape(v)) for k, v in arrays.items() if v is not None}
    try:
        return tuple(jnp.broadcast_shapes(*shapes.values()))
    except ValueError:
        listed = ", ".join(f"{k} {s}" for k, s in shapes.items())
        raise ValueError(f"{who}: the shapes do not broadcast together: {listed}.") from None


# ------------------------------------------------------------------------------ distributions
class CensoredNormal(dist.Distribution):
    """Normal observations with left censoring (Beal's M3 likelihood).

    An uncensored entry has the :class:`~numpyro.distributions.Normal` log-density of its
    value; a censored one (``cens`` True) has :math:`\\log P(Y < \\mathrm{lloq}) =
    \\log\\Phi((\\mathrm{lloq} - \\mathrm{loc})/\\mathrm{scale})`, whatever its value (a
    BLQ row's DV may be 0, the LLOQ or NaN). ``lloq`` is read only at censored entries: its
    other entries may be anything, NaN included. The value of a censored entry and the lloq
    of an uncensored entry are replaced by finite placeholders before use, so that neither
    the log-density nor its gradient sees them.

    :meth:`sample` draws the *uncensored* variable (simulate BLQ data by comparing the draw
    with the LLOQ).

    :param loc: mean of the uncensored variable.
    :param scale: its standard deviation (positive).
    :param lloq: lower limit of quantification, used where ``cens`` is True.
    :param cens: boolean, True where the observation is below the LLOQ.
    :param validate_args: numpyro's argument validation.
    """

    arg_constraints = {
        "loc": constraints.real,
        "scale": constraints.positive,
        "lloq": constraints.real,
        "cens": constraints.boolean,
    }
    pytree_data_fields = ("loc", "scale", "lloq", "cens")
    support = constraints.real
    reparametrized_params = ["loc", "scale"]
    _lloq_placeholder = 0.0

    def __init__(self, loc, scale, lloq, cens, *, validate_args: bool | None = None):
        who = type(self).__name__
        cens = _as_cens(cens, who)
        batch_shape = _broadcast_shape(who, loc=loc, scale=scale, lloq=lloq, cens=cens)
        self.loc = jnp.broadcast_to(loc, batch_shape)
        self.scale = jnp.broadcast_to(scale, batch_shape)
        self.cens = jnp.broadcast_to(cens, batch_shape)
        lloq = jnp.broadcast_to(jnp.asarray(lloq, dtype=jnp.result_type(float)), batch_shape)
        self.lloq = jnp.where(self.cens, lloq, self._lloq_placeholder)
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    @classmethod
    def infer_shapes(cls, loc=(), scale=(), lloq=(), cens=()):
        """``(batch_shape, event_shape)`` from the shapes of the arguments."""
        return tuple(jnp.broadcast_shapes(loc, scale, lloq, cens)), ()

    def _z_log_prob(self, value):
        """Log-density of the uncensored variable at ``value`` (any finite placeholder at
        censored entries) -- the Normal's."""
        z = (value - self.loc) / self.scale
        return -0.5 * z**2 - jnp.log(self.scale) - _LOG_SQRT_2PI

    def _log_cdf_lloq(self):
        return log_ndtr((self.lloq - self.loc) / self.scale)

    def _safe_value(self, value):
        return jnp.where(self.cens, self.loc, value)

    def sample(self, key, sample_shape: tuple[int, ...] = ()):
        """Draws of the uncensored variable, of shape ``sample_shape + batch_shape``."""
        eps = jax.random.normal(key, tuple(sample_shape) + self.batch_shape)
        return self.loc + self.scale * eps

    @validate_sample
    def log_prob(self, value):
        """M3 log-likelihood: the log-density at uncensored entries, the log-probability of
        being below ``lloq`` at censored ones.

        :param value: observations, broadcastable to ``batch_shape``.
        :return: array of shape ``broadcast(value, batch_shape)``.
        """
        dens = self._z_log_prob(self._safe_value(value))
        return jnp.where(self.cens, self._log_cdf_lloq(), dens)

    def _validate_sample(self, value):
        # A censored entry's value is not used: only uncensored ones must be in the support.
        mask = jnp.logical_or(self.support(jnp.where(self.cens, 1.0, value)), self.cens)
        if not_jax_tracer(mask) and not np.all(mask):
            warnings.warn(f"{type(self).__name__}: out-of-support uncensored observations "
                          "given to log_prob.", stacklevel=3)
        return mask


class CensoredLogNormal(CensoredNormal):
    """Log-normal observations with left censoring (Beal's M3 likelihood).

    ``loc`` and ``scale`` are those of :math:`\\log Y` (as in
    :class:`~numpyro.distributions.LogNormal`). An uncensored entry has the log-normal
    log-density of its value on the observation scale (with the :math:`-\\log y` Jacobian);
    a censored one has :math:`\\log\\Phi((\\log \\mathrm{lloq} - \\mathrm{loc})/
    \\mathrm{scale})`. ``lloq`` must be positive at censored entries (it is read only
    there). :meth:`sample` draws the uncensored variable.

    :param loc: mean of :math:`\\log Y`.
    :param scale: standard deviation of :math:`\\log Y` (positive).
    :param lloq: lower limit of quantification on the observation scale (positive), used
        where ``cens`` is True.
    :param cens: boolean, True where the observation is below the LLOQ.
    :param validate_args: numpyro's argument validation.
    """

    arg_constraints = {
        "loc": constraints.real,
        "scale": constraints.positive,
        "lloq": constraints.positive,
        "cens": constraints.boolean,
    }
    pytree_data_fields = ("loc", "scale", "lloq", "cens")
    support = constraints.positive
    _lloq_placeholder = 1.0

    def _z_log_prob(self, value):
        logy = jnp.log(value)
        return super()._z_log_prob(logy) - logy

    def _log_cdf_lloq(self):
        return log_ndtr((jnp.log(self.lloq) - self.loc) / self.scale)

    def _safe_value(self, value):
        return jnp.where(self.cens, jnp.exp(self.loc), value)

    def sample(self, key, sample_shape: tuple[int, ...] = ()):
        """Draws of the uncensored variable, of shape ``sample_shape + batch_shape``."""
        return jnp.exp(super().sample(key, sample_shape))


# ------------------------------------------------------------------------------ error model
class ErrorModel:
    """A residual error model: its parameters, its observation distribution (with M3
    censoring), weighted residuals and simulation.

    :param kind: ``"additive"``, ``"proportional"``, ``"combined1"``, ``"combined2"`` or
        ``"exponential"`` (case-insensitive); aliases: ``"constant"``/``"add"`` (additive),
        ``"prop"``, ``"comb1"``, ``"comb2"``, ``"exp"``/``"log"``/``"lognormal"``
        (exponential). See the module docstring for the formulas.
    :param init: initial values of the parameters, by name with or without the prefix
        (``{"a": 0.5}`` or ``{"conc_a": 0.5}``); positive finite numbers. Defaults:
        ``a = 1.0``, ``b = 0.1``, ``sigma = 0.1``.
    :param prefix: prepended to the parameter names (one error model per observed output:
        ``prefix="conc_"`` gives ``"conc_a"``, ``"conc_b"``).
    :raises ValueError: unknown ``kind``; unknown, duplicate or non-positive ``init`` entries.
    :raises TypeError: ``kind``, ``prefix`` or ``init`` of the wrong type.
    """

    def __init__(self, kind: str = "additive", *, init: Mapping[str, float] | None = None,
                 prefix: str = ""):
        if not isinstance(kind, str):
            raise TypeError(f"ErrorModel: `kind` must be a string among {KINDS}, "
                            f"got {type(kind).__name__}.")
        if not isinstance(prefix, str):
            raise TypeError(f"ErrorModel: `prefix` must be a string, got {type(prefix).__name__}.")
        key = kind.strip().lower()
        key = ALIASES.get(key, key)
        if key not in KINDS:
            aliases = ", ".join(f"{a!r} -> {k!r}" for a, k in ALIASES.items())
            hint = (" ('combined' is ambiguous: choose 'combined1' (a + b|f|) or 'combined2' "
                    "(sqrt(a^2 + b^2 f^2)))") if key == "combined" else ""
            raise ValueError(f"ErrorModel: unknown kind {kind!r}{hint}. Valid kinds: "
                             f"{', '.join(KINDS)}; aliases: {aliases}.")
        self.kind: str = key
        self.prefix: str = prefix
        base = _PARAMS[key]
        self.param_names: tuple[str, ...] = tuple(prefix + p for p in base)
        self._init: dict[str, float] = {prefix + p: _DEFAULT_INIT[p] for p in base}
        if init is not None:
            self._init.update(self._check_init(init, base))

    def _check_init(self, init, base) -> dict[str, float]:
        who = f"ErrorModel({self.kind!r})"
        if not isinstance(init, Mapping):
            raise TypeError(f"{who}: `init` must be a dict {{name: value}}, "
                            f"got {type(init).__name__}.")
        out, unknown, bad = {}, [], []
        for k, v in init.items():
            full = k if k in self.param_names else self.prefix + k if k in base else None
            if full is None:
                unknown.append(k)
                continue
            if full in out:
                raise ValueError(f"{who}: `init` gives {full!r} twice (as {k!r} and with/"
                                 "without the prefix); give it once.")
            try:
                x = np.asarray(v, dtype=float)
            except (TypeError, ValueError):
                x = np.asarray(np.nan)
            if x.ndim != 0 or isinstance(v, bool) or not np.isfinite(x) or x <= 0:
                bad.append(f"{k}={v!r}")
                continue
            out[full] = float(x)
        if unknown:
            raise ValueError(f"{who}: unknown `init` key(s) {unknown}; this model's parameters "
                             f"are {list(self.param_names)} (the prefix may be omitted: "
                             f"{list(base)}).")
        if bad:
            raise ValueError(f"{who}: `init` values must be positive finite numbers (standard "
                             f"deviations / coefficients of variation), got {', '.join(bad)}.")
        return out

    @property
    def init(self) -> dict[str, float]:
        """The initial values ``{full name: value}``."""
        return dict(self._init)

    def __repr__(self) -> str:
        init = ", ".join(f"{k}={v:g}" for k, v in self._init.items())
        pre = f", prefix={self.prefix!r}" if self.prefix else ""
        return f"ErrorModel({self.kind!r}{pre}, init={{{init}}})"

    # ------------------------------------------------------------------------- parameters
    def params(self) -> dict[str, Any]:
        """Declare the parameters as ``numpyro.param`` sites (positive constraint, the init
        values) -- call inside the NumPyro model.

        :return: ``{full name: value}`` (the current value under a handler, e.g. SAEM's
            substitution; the init value outside).
        """
        return {n: numpyro.param(n, jnp.asarray(self._init[n]), constraint=constraints.positive)
                for n in self.param_names}

    def _get(self, params: Mapping[str, Any]) -> list:
        missing = [n for n in self.param_names if n not in params]
        if missing:
            raise ValueError(f"ErrorModel({self.kind!r}): `params` lacks {missing} (it has "
                             f"{sorted(params)}); pass the dict returned by `params()`.")
        return [params[n] for n in self.param_names]

    def scale(self, f, params: Mapping[str, Any]):
        """The residual standard deviation :math:`g(f)` (exponential: :math:`\\sigma` on the
        log scale), broadcast to the shape of ``f`` (and of the parameters).

        :param f: structural predictions.
        :param params: the parameter values, ``{full name: value}`` (other keys ignored).
        :return: array :math:`g(f)`. Proportional: zero where ``f`` is zero (see the module
            docstring).
        """
        f = jnp.asarray(f)
        vals = self._get(params)
        if self.kind == "additive" or self.kind == "exponential":
            (s,) = vals
            g = jnp.asarray(s)
        elif self.kind == "proportional":
            (b,) = vals
            g = b * jnp.abs(f)
        elif self.kind == "combined1":
            a, b = vals
            g = a + b * jnp.abs(f)
        else:  # combined2
            a, b = vals
            g = jnp.sqrt(a**2 + (b * f) ** 2)
        return jnp.broadcast_to(g, jnp.broadcast_shapes(jnp.shape(f), jnp.shape(g)))

    # ------------------------------------------------------------------------- distribution
    def dist(self, f, params: Mapping[str, Any], *, cens=None, lloq=None,
             labels=None) -> dist.Distribution:
        """The distribution of the observations given the predictions ``f``.

        Without censoring: :class:`~numpyro.distributions.Normal` ``(f, g(f))`` (the first
        four kinds) or :class:`~numpyro.distributions.LogNormal` ``(log f, sigma)``
        (exponential; ``f`` must be positive). With ``cens`` and ``lloq``:
        :class:`CensoredNormal` / :class:`CensoredLogNormal` (M3 likelihood). Pass
        ``cens=None`` when no observation is censored: SAEM's M-step recognises the plain
        additive Normal (closed form).

        :param f: structural predictions.
        :param params: ``{full name: value}``, as returned by :meth:`params`.
        :param cens: boolean array, True where the observation is below the LLOQ (0/1
            accepted when concrete).
        :param lloq: the LLOQ (read at censored entries only; positive for the exponential
            model).
        :param labels: optional labels of the entries (e.g. ``"subject 3, row 17"``, of the
            shape of ``f``), named in the messages instead of array indices.
        :return: a distribution of batch shape ``broadcast(f, g(f), cens, lloq)``, with
            log-densities on the observation scale.
        :raises ValueError: ``cens`` without ``lloq`` or the reverse; a concrete ``lloq``
            not finite (or, exponential, not positive) at a censored entry; bad ``cens``;
            concrete predictions where :math:`g(f)` is not positive (proportional error at
            ``f = 0``) or, exponential, ``f <= 0`` (under ``jit``: NaN log-densities).
        """
        who = f"ErrorModel({self.kind!r}).dist"
        if (cens is None) != (lloq is None):
            given, lacking = ("cens", "lloq") if lloq is None else ("lloq", "cens")
            raise ValueError(f"{who}: `{given}` given without `{lacking}`: M3 censoring needs "
                             "both (cens: True where below the LLOQ; lloq: the limit).")
        f = jnp.asarray(f)
        g = self.scale(f, params)
        self._check_prediction(f, g, who, labels)
        if cens is None:
            if self.kind == "exponential":
                return dist.LogNormal(jnp.log(f), g)
            return dist.Normal(f, g)
        cens = _as_cens(cens, who)
        c, q = _concrete(cens), _concrete(lloq)
        if c is not None and q is not None:
            shape = _broadcast_shape(who, f=f, cens=c, lloq=q)
            c = np.broadcast_to(c, shape)
            q = np.broadcast_to(np.asarray(q, dtype=float), shape)
            self._check_lloq(c, q, who, labels)
        if self.kind == "exponential":
            return CensoredLogNormal(jnp.log(f), g, lloq, cens)
        return CensoredNormal(f, g, lloq, cens)

    def _check_prediction(self, f, g, who: str, labels=None) -> None:
        """Refuse, when their values are known, predictions the model cannot evaluate: a
        zero scale (proportional error at ``f = 0``) or ``f <= 0`` for the exponential model.
        Under ``jit`` they give NaN log-densities (not checked, not hidden)."""
        fc, gc = _concrete(f), _concrete(g)
        if fc is None or gc is None:
            return
        if self.kind == "exponential":
            bad = np.broadcast_to(~(fc > 0), gc.shape)
            if bad.any():
                raise ValueError(
                    f"{who}: the exponential error model needs predictions f > 0 (y = f "
                    f"exp(eps)); f <= 0 or NaN at {int(bad.sum())} entries "
                    f"{_where_text(bad, labels)}. Fix the structural model, or use an additive "
                    "or combined error model."
                )
            return
        bad = ~(gc > 0)
        if bad.any():
            why = ("proportional error has g(f) = b|f| = 0 where f = 0: use a combined error "
                   "model (ErrorModel('combined2')) when predictions can be zero"
                   if self.kind == "proportional" else
                   "check the parameters (positive) and the predictions (finite)")
            raise ValueError(f"{who}: the residual standard deviation g(f) is zero or NaN at "
                             f"{int(bad.sum())} entries {_where_text(bad, labels)}; {why}.")

    def _check_lloq(self, c: np.ndarray, q: np.ndarray, who: str,
                    labels: np.ndarray | None = None, columns=None) -> None:
        bad = c & ~np.isfinite(q)
        if bad.any():
            raise ValueError(f"{who}: {_arg('lloq', columns)} is NaN or infinite at "
                             f"{int(bad.sum())} censored observation(s) "
                             f"{_where_text(bad, labels)}; give the LLOQ of every censored "
                             "observation.")
        if self.kind == "exponential":
            bad = c & (q <= 0)
            if bad.any():
                raise ValueError(
                    f"{who}: the exponential error model needs lloq > 0 at censored "
                    f"observations (P(Y < lloq) = Phi((log lloq - log f)/sigma)); lloq <= 0 "
                    f"at {int(bad.sum())} of them {_where_text(bad, labels)}. Fix the LLOQ "
                    "values, or use an additive/combined error model."
                )

    # ------------------------------------------------------------------------- diagnostics
    def residuals(self, y, f, params: Mapping[str, Any], *, cens=None):
        """Weighted residuals :math:`(y - f)/g(f)` (exponential: :math:`(\\log y - \\log f)
        /\\sigma`) -- IWRES with individual predictions ``f``.

        :param y: observations.
        :param f: predictions.
        :param params: ``{full name: value}``.
        :param cens: optional boolean, True where censored: those residuals are NaN (a
            censored observation has no residual; diagnostics impute them).
        :return: array of shape ``broadcast(y, f)``.
        """
        y, f = jnp.asarray(y), jnp.asarray(f)
        g = self.scale(f, params)
        if self.kind == "exponential":
            r = (jnp.log(y) - jnp.log(f)) / g
        else:
            r = (y - f) / g
        if cens is not None:
            r = jnp.where(_as_cens(cens, f"ErrorModel({self.kind!r}).residuals"), jnp.nan, r)
        return r

    def sample(self, key, f, params: Mapping[str, Any]):
        """Simulate uncensored observations given the predictions.

        :param key: a JAX PRNG key.
        :param f: predictions.
        :param params: ``{full name: value}``.
        :return: draws of shape ``broadcast(f, g(f))``.
        """
        f = jnp.asarray(f)
        g = self.scale(f, params)
        eps = jax.random.normal(key, g.shape, dtype=jnp.result_type(g, float))
        if self.kind == "exponential":
            return f * jnp.exp(g * eps)
        return f + g * eps

    def check_observations(self, dv, cens=None, mask=None, *, lloq=None,
                           labels=None, columns: Mapping[str, Any] | None = None) -> None:
        """Check (host side) that the observations can be evaluated by this error model.

        Refused: NaN or infinite ``dv`` among uncensored observations, and finite values
        of ``dv`` or ``lloq`` beyond float32 when JAX computes in float32 (they would become
        infinite); ``dv <= 0`` among
        uncensored observations for the exponential model (:math:`\\log y` undefined);
        ``cens`` not boolean/0-1; ``cens`` with censored entries but no ``lloq``; ``lloq``
        not finite (exponential: not positive) at a censored observation. Entries where
        ``mask`` is False (padding, MDV = 1) are ignored, and so is the DV of a censored
        entry.

        :param dv: observations (any shape).
        :param cens: optional boolean (or 0/1), True where below the LLOQ.
        :param mask: optional boolean, False where the entry is not an observation.
        :param lloq: the LLOQ (needed where ``cens`` is True).
        :param labels: optional labels of the entries (same shape as ``dv``, e.g.
            ``"ID 3, TIME 2"``), used in the messages instead of array indices.
        :param columns: optional ``{"dv": column, "lloq": column}``: the columns of the input
            table the arguments came from, named in the messages.
        :raises ValueError: as above, naming how many entries and where, and the fix.
        """
        who = f"ErrorModel({self.kind!r}).check_observations"
        try:
            y = np.asarray(dv, dtype=float)
        except (TypeError, ValueError):
            raise TypeError(f"{who}: `dv` must be numeric, got {np.asarray(dv).dtype}.") from None
        shape = y.shape
        parts = dict(dv=y, cens=cens, mask=mask, lloq=lloq, labels=labels)
        _broadcast_shape(who, **{k: (np.asarray(v) if v is not None else None)
                                 for k, v in parts.items()})

        def full(x, dtype):
            return np.broadcast_to(np.asarray(x, dtype=dtype), shape)

        if labels is not None:
            labels = full(labels, object)
        used = np.ones(shape, bool) if mask is None else full(_as_mask(mask, who), bool)
        c = np.zeros(shape, bool)
        if cens is not None:
            c = full(np.asarray(_as_cens(np.asarray(cens), who, labels, columns)), bool) & used
        if lloq is None and c.any():
            raise ValueError(f"{who}: `cens` marks {int(c.sum())} observation(s) below the "
                             "LLOQ but `lloq` is None: give the LLOQ (M3 likelihood).")
        if lloq is not None:
            if cens is None:
                raise ValueError(f"{who}: `lloq` given without `cens`: say which observations "
                                 "are below the LLOQ (cens = True).")
            self._check_lloq(c, full(lloq, float), who, labels, columns)
        obs = used & ~c
        if not jax.config.jax_enable_x64:  # finite here, infinite once JAX has cast it
            big = float(np.finfo(np.float32).max)
            for name, v, where in (("dv", y, obs), ("lloq", lloq, c)):
                if v is None:
                    continue
                v = full(v, float)
                with np.errstate(invalid="ignore"):
                    bad = where & np.isfinite(v) & (np.abs(v) > big)
                if bad.any():
                    raise ValueError(
                        f"{who}: {_arg(name, columns)} overflows float32 (max 3.4e38), the "
                        f"float type JAX computes in, at {int(bad.sum())} observation(s) "
                        f"{_where_text(bad, labels)}: rescale it (other units), or enable "
                        "JAX's float64.")
        bad = obs & ~np.isfinite(y)
        if bad.any():
            raise ValueError(
                f"{who}: {_arg('dv', columns)} is NaN or infinite at {int(bad.sum())} uncensored "
                f"observation(s) {_where_text(bad, labels)}. Fix: drop those rows or mark them "
                "missing (mask False / MDV = 1), or, if they are below the LLOQ, set cens = "
                "True with their lloq (M3)."
            )
        if self.kind == "exponential":
            bad = obs & (y <= 0)
            if bad.any():
                raise ValueError(
                    f"{who}: the exponential error model needs dv > 0 (it models log dv); "
                    f"{int(bad.sum())} uncensored observation(s) are <= 0"
                    f"{'' if columns is None else ' in ' + _arg('dv', columns)} "
                    f"{_where_text(bad, labels)}. Fix: use an additive or combined error model "
                    "(e.g. ErrorModel('combined2')), or, if they are below the LLOQ, censor them "
                    "(cens = True with lloq > 0: M3)."
                )


def _as_mask(mask, who: str) -> np.ndarray:
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        if not np.issubdtype(m.dtype, np.number) or not np.isin(m, (0, 1)).all():
            raise ValueError(f"{who}: `mask` must be boolean (True = an observation to use), "
                             f"got values {np.unique(m)[:5].tolist()}.")
        m = m.astype(bool)
    return m
