"""Checks that keep a Flower deployment from degrading silently.

A deployment runs on machines the server does not control: a client may run another version
of the model module or of ``numpyro_fed``, hold invalid rows, share its partition id with
another node, or stop answering. Each of these used to give draws of another target (or a
random walk without data) with, at most, a log line. This module holds what the server and
the clients of :mod:`numpyro_fed.flower.protocol` use to refuse them instead:

* **The errors** :class:`DeploymentError` (the deployment cannot go on: it would not sample
  the spec's target) and its subclasses :class:`ClientMismatchError` (a client computes
  another potential than the server's model and spec) and :class:`ParticipationError` (the
  clients stopped answering).
* **The fingerprint of a client** sent in its ``hello`` reply (the server sends the spec with
  its ``hello``): the settings it parsed from the spec (:func:`spec_settings`: every field of
  :class:`~numpyro_fed.flower.protocol.FlowerSpec` that changes the computation) and its
  potential evaluated on a fixed synthetic *probe* (:func:`probe_rows`, :func:`probe_point`,
  :func:`probe_values`): the likelihood part :math:`-\\tau\\sum_j \\log p(y_j\\mid\\theta)` and
  the prior part :math:`-\\log p(\\theta) - \\log|J(\\theta)|`, value and gradient, at a
  deterministic point :math:`\\theta_{\\rm probe}` on :data:`PROBE_ROWS` deterministic rows of
  the client's row schema (never its data). The server evaluates the same with its own copy
  of the model and compares (:func:`probe_difference`): a probit client in a logit
  deployment, or a client that applies its own likelihood weight, is refused by name.
* **Participation** (:class:`ParticipationMonitor`): ``max_empty_rounds`` consecutive
  rounds in which clients were asked and none answered, or a binomial-tail test that the
  share of answered requests is far below ``min_participation``, stop the run with a
  :class:`ParticipationError` naming the rounds.

**Why the probe values are sent and compared with a tolerance, not hashed.** The same code on
the same machine gives bit-identical probe values (same XLA program, same inputs). Across
machines (another CPU, another XLA build, a GPU) float32 sums may differ in the last bits.
Rounding to a few significant digits before hashing does not fix that: a value that lies
near a rounding boundary rounds differently after a one-ulp change (for float32 rounded to
6 digits, a few percent of the coordinates per ulp of difference), so the hash would refuse
honest clients now and then. The probe is synthetic (it reveals nothing about a client's
rows), so the client sends its :math:`2d + 2` probe numbers and the server compares them with
a relative tolerance :data:`PROBE_RTOL` (float32 evaluations of the same model over 8 rows
agree to ~1e-6; another link function, likelihood weight or prior differs by orders of
magnitude more).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.errors import (  # re-exported: defined here before errors.py
    ClientMismatchError,
    DeploymentError,
    ParticipationError,
)
from numpyro_fed.potential import _log_parts

__all__ = [
    "DeploymentError",
    "ClientMismatchError",
    "ParticipationError",
    "RUN_ONLY_FIELDS",
    "PROBE_ROWS",
    "PROBE_RTOL",
    "PARTICIPATION_ALPHA",
    "PARTICIPATION_WINDOW",
    "spec_settings",
    "spec_differences",
    "probe_point",
    "PROBE_SETS",
    "probe_rows",
    "probe_values",
    "probe_difference",
    "nonfinite_rows_message",
    "ParticipationMonitor",
]


# ====================================================================== spec fingerprint
#: Fields of :class:`~numpyro_fed.flower.protocol.FlowerSpec` that do not change what is
#: computed (how long the server waits, when it gives up): left out of the comparison of the
#: settings a client parsed with the server's.
RUN_ONLY_FIELDS = ("round_timeout", "max_empty_rounds", "min_participation")


def spec_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a spec's ``to_config()`` that change the computation, sorted by name."""
    return {k: config[k] for k in sorted(config) if k not in RUN_ONLY_FIELDS}


def spec_differences(server: Mapping[str, Any], client: Mapping[str, Any]) -> list[str]:
    """``"field=client value (server: value)"`` for each setting that differs."""
    out = []
    for k in sorted(set(server) | set(client)):
        a, b = server.get(k, "<absent>"), client.get(k, "<absent>")
        if a != b:
            out.append(f"{k}={b!r} (server: {a!r})")
    return out


# ===================================================================== model fingerprint
#: Rows of the synthetic probe data set.
PROBE_ROWS = 8
#: Relative tolerance of the probe comparison (see the module docstring).
PROBE_RTOL = 1e-4
_GOLDEN = 0.6180339887498949


def _weyl(n: int, offset: int) -> np.ndarray:
    """``n`` numbers of the golden-ratio sequence in ``(0, 1)`` (float64 arithmetic on small
    integers: the same on every machine, no random generator whose stream could change)."""
    j = np.arange(n, dtype=np.float64) + 1.0 + offset
    return np.mod(j * _GOLDEN, 1.0)


def probe_point(dim: int) -> np.ndarray:
    """The probe point :math:`\\theta_{\\rm probe}` (unconstrained, float32, in
    :math:`(-0.5, 0.5)^d`)."""
    return (_weyl(int(dim), 0) - 0.5).astype(np.float32)


#: The synthetic data sets of the probe, by the values of their floating-point entries: a
#: likelihood is evaluated on those that lie in its support (NumPyro gives ``-inf`` outside).
#: ``"binary"``: :math:`\\{0, 1\\}` (Bernoulli, Poisson, normal observations, binary
#: features); ``"unit"``: :math:`(0.05, 0.95)` (Beta, Gamma, log-normal, normal);
#: ``"counts"``: :math:`\\{1, 2, 3\\}` (positive counts, Gamma, log-normal). Integer and
#: boolean entries are in :math:`\\{0, 1\\}` in all three (valid labels and indices).
PROBE_SETS = ("binary", "unit", "counts")


def probe_rows(schema: Mapping[str, Sequence[Any]], kind: str = "binary"
               ) -> dict[str, np.ndarray]:
    """:data:`PROBE_ROWS` synthetic rows of a row schema ``{key: (row shape, dtype)}`` (the
    ``hello`` schema of a client), with floating-point values of the :data:`PROBE_SETS`
    ``kind``. Floats are generated in float32, so a float64 client gets the same values."""
    if kind not in PROBE_SETS:
        raise ValueError(f"`kind` must be one of {PROBE_SETS}, got {kind!r}.")
    rows = {}
    for m, key in enumerate(sorted(schema)):
        shape, dtype = schema[key]
        shape = tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        u = _weyl(PROBE_ROWS * math.prod(shape), 1000 * (m + 1))
        if dt.kind in "fc":
            vals = {"binary": (u < 0.5).astype(np.float64), "unit": 0.05 + 0.9 * u,
                    "counts": 1.0 + np.floor(3 * u)}[kind]
            vals = vals.astype(np.float32).astype(dt)
        elif dt.kind in "iub":
            vals = (u < 0.5).astype(dt)
        else:
            vals = np.zeros(u.shape, dt)
        rows[key] = vals.reshape(PROBE_ROWS, *shape)
    return rows


#: Compiled probe functions of the models of this process (a loopback run hosts the server
#: and every client: they compile once). Keyed like ``algorithms.oracles._PROGRAMS``.
_PROBES: dict[tuple, Callable] = {}


def probe_values(potential: Any, likelihood_weight: Any, rows: Mapping[str, np.ndarray]
                 ) -> np.ndarray:
    """The fingerprint of a potential: ``[V_lik, grad V_lik, V_prior, grad V_prior]``
    (length :math:`2d + 2`, float64) at :func:`probe_point` on the synthetic ``rows``
    (:func:`probe_rows`), with :math:`V_{\\rm lik} = -\\tau\\sum_j\\log p(y_j\\mid\\theta)`
    (the model's per-row log-likelihoods, as a client's potential sums them) and
    :math:`V_{\\rm prior} = -\\log p(\\theta) - \\log|J(\\theta)|` (the model run on the
    first probe row).

    :param potential: a :class:`~numpyro_fed.potential.FederatedPotential` of the model (a
        client's, built on its rows with its shared arguments; the server's, on zeros of the
        row schema): only its parameter structure and model are used, not its data.
    :param likelihood_weight: :math:`\\tau` as the potential's owner applies it.
    """
    pot = potential
    schema = tuple(sorted((k, str(v.dtype), tuple(v.shape[1:])) for k, v in rows.items()))
    key = (pot.model, schema, tuple(pot.latent_names))
    fn = _PROBES.get(key) if not pot.shared else None
    if fn is None:
        def fn(theta, rows, tau):
            row0 = jax.tree.map(lambda a: a[0], rows)

            def lik(t):
                return -tau * jnp.sum(pot.rows_loglik(t, rows))

            def prior(t):
                return -_log_parts(pot.model, pot._row_kwargs(row0), pot.unravel(t),
                                   pot._latent, pot._prior_sites)[0]

            v_lik, g_lik = jax.value_and_grad(lik)(theta)
            v_pri, g_pri = jax.value_and_grad(prior)(theta)
            return jnp.concatenate([v_lik[None], g_lik, v_pri[None], g_pri])

        fn = jax.jit(fn)
        if not pot.shared:
            _PROBES[key] = fn
            while len(_PROBES) > 8:
                _PROBES.pop(next(iter(_PROBES)))
    theta = jnp.asarray(probe_point(pot.dim))
    rows = {k: jnp.asarray(v) for k, v in rows.items()}
    return np.asarray(fn(theta, rows, jnp.asarray(likelihood_weight, jnp.float32)), np.float64)


def _close(got: np.ndarray, ref: np.ndarray) -> tuple[bool, float]:
    """Whether ``got`` equals ``ref`` up to :data:`PROBE_RTOL` of the block's largest finite
    magnitude (same non-finite entries required); the largest relative difference."""
    fin_r, fin_g = np.isfinite(ref), np.isfinite(got)
    if not np.array_equal(fin_r, fin_g):
        return False, math.inf
    if not fin_r.any():
        return True, 0.0
    scale = float(np.max(np.abs(ref[fin_r])))
    diff = float(np.max(np.abs(got[fin_r] - ref[fin_r])))
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return rel <= PROBE_RTOL, rel


def probe_difference(ref: np.ndarray, got: np.ndarray, likelihood_weight: float) -> str | None:
    """What differs between the server's probe values ``ref`` and a client's ``got``
    (:func:`probe_values`), in words, or ``None`` when they agree.

    A likelihood part that is a constant multiple :math:`c \\ne 1` of the server's is
    reported as a likelihood weight :math:`c\\tau`; anything else as another likelihood or
    another prior."""
    ref, got = np.asarray(ref, np.float64).ravel(), np.asarray(got, np.float64).ravel()
    if ref.size != got.size:
        return (f"its model has {max(got.size - 2, 0) // 2} parameters (unconstrained), the "
                f"server's {max(ref.size - 2, 0) // 2}")
    d = ref.size // 2 - 1
    lik, pri = slice(0, d + 1), slice(d + 1, 2 * d + 2)
    out = []
    ok, rel = _close(got[lik], ref[lik])
    if not ok:
        r, g = ref[lik], got[lik]
        fin = np.isfinite(r) & np.isfinite(g)
        c = float(r[fin] @ g[fin] / (r[fin] @ r[fin])) if fin.any() and r[fin].any() else 0.0
        if c > 0 and _close(g, c * r)[0]:
            out.append(f"its likelihood is {c:.6g} times the server's on the probe: it runs "
                       f"with a likelihood weight (temperature) of {c * likelihood_weight:.6g} "
                       f"instead of the spec's likelihood_weight={likelihood_weight:g}")
        else:
            out.append("its log-likelihood differs from the server's model on the probe "
                       f"(largest relative difference {rel:.3g}): another model, or another "
                       "version of the model's module")
    ok, rel = _close(got[pri], ref[pri])
    if not ok:
        out.append(f"its prior (or the parameters' constraints) differs from the server's "
                   f"model on the probe (largest relative difference {rel:.3g})")
    return "; ".join(out) or None


def nonfinite_rows_message(index: int, rows: Mapping[str, np.ndarray]) -> str | None:
    """Why client ``index``'s rows cannot be used because a floating-point row holds NaN or
    infinity (naming the key, the client's partition id and its own row), or ``None``."""
    for key in sorted(rows):
        a = np.asarray(rows[key])
        if a.ndim == 0 or a.dtype.kind not in "fc":
            continue
        bad = ~np.isfinite(a.reshape(a.shape[0], -1)).all(-1)
        if not bad.any():
            continue
        j = int(np.flatnonzero(bad)[0])
        entry = a[j].reshape(-1)
        value = entry[~np.isfinite(entry)][0]
        more = int(bad.sum()) - 1
        return (f"client {index}'s data key {key!r} has a non-finite value ({value}) at its "
                f"row {j}{f' and in {more} more rows' if more else ''}; the federated "
                "potential would be NaN there and the chain would diverge: remove or impute "
                f"these rows on client {index}")
    return None


# ========================================================================= participation
#: Total false-alarm probability of the participation test over a whole run (split over its
#: rounds and the two windows by Bonferroni's inequality).
PARTICIPATION_ALPHA = 1e-6
#: Rounds of the recent window of the participation test (besides the whole run).
PARTICIPATION_WINDOW = 100


def _binom_cdf(k: int, n: int, p: float) -> float:
    """:math:`P(X \\le k)` for :math:`X \\sim \\mathrm{Binomial}(n, p)`."""
    from scipy.special import bdtr

    if k >= n:
        return 1.0
    return float(bdtr(k, n, p))


def _rounds_text(rounds: Sequence[int]) -> str:
    rounds = list(rounds)
    if len(rounds) > 8:
        return f"{rounds[0]}-{rounds[-1]} ({len(rounds)} rounds)"
    return ", ".join(map(str, rounds))


class ParticipationMonitor:
    """Stops a deployment whose clients stopped answering (:class:`ParticipationError`).

    After each round the server calls :meth:`update` with the clients it asked and those
    whose message it applied.

    * **Empty rounds.** A round in which clients were asked and none answered moves the chain
      by the prior share, the memory term and the noise only: a random walk without data.
      ``max_empty_rounds`` such rounds in a row raise (``0``: never). Rounds in which nobody
      was asked (possible by design with ``participation < 1``, as in process) carry no
      evidence: they neither count nor break a streak. With sparse participation and a lossy
      network, where a round often asks a single client, such streaks also come by chance
      (a round asking one client whose messages are lost with probability :math:`f` is
      empty with probability :math:`f`): raise ``max_empty_rounds`` there.
    * **Share of answered requests.** Given the requests, a client that answers each with
      probability :math:`r` answers :math:`S \\sim \\mathrm{Binomial}(A, r)` of :math:`A`
      requests (independent faults). The declared participation :math:`p` is what the
      server asks for, so :math:`S/A` is the observed participation over the declared one.
      The run stops when :math:`P(\\mathrm{Binomial}(A, \\rho) \\le S) < \\alpha'` with
      :math:`\\rho` = ``min_participation``, over the whole run and over the last
      :data:`PARTICIPATION_WINDOW` rounds. A single test at :math:`\\alpha'` would refuse an
      honest run (:math:`r \\ge \\rho`) with probability at most :math:`\\alpha'`; the test
      is repeated after every round on two windows, so :math:`\\alpha' =`
      :data:`PARTICIPATION_ALPHA` / (2 ``num_rounds``) keeps the probability of refusing an
      honest run anywhere below :data:`PARTICIPATION_ALPHA` (Bonferroni). A few unlucky
      rounds (random timeouts, or the random low rounds of Bernoulli sampling, which the test
      does not see since it conditions on the requests) do not trigger it. A clear fault is
      caught fast: 3 of 4 clients gone for the 100 rounds of the window (100 of 400 requests
      answered, :math:`\\rho = 1/2`) gives a tail of 1.3e-24, far below the level
      (5e-11 for a run of 10 000 rounds); measured: 3 of 4 clients gone at round 5000 of
      10 000 (``participation=1``) stop the run at round 5088.

    :param num_clients: ``b``.
    :param participation: the spec's declared :math:`p`.
    :param num_rounds: the rounds of the run (for the Bonferroni split).
    :param max_empty_rounds: consecutive empty rounds that stop the run (0: never).
    :param min_participation: :math:`\\rho` (0: no test).
    """

    def __init__(self, num_clients: int, participation: float, num_rounds: int,
                 max_empty_rounds: int, min_participation: float) -> None:
        self.b = int(num_clients)
        self.p = float(participation)
        self.max_empty = int(max_empty_rounds)
        self.rho = float(min_participation)
        self.level = PARTICIPATION_ALPHA / (2 * max(1, int(num_rounds)))
        self.streak: list[int] = []
        self.rounds = 0
        # per client: requests and answers over the whole run and over the recent window
        # (running sums: the check costs O(b) per round, whatever the length of the run)
        self._total = np.zeros((2, self.b), np.int64)
        self._window = np.zeros((2, self.b), np.int64)
        self._recent: deque[np.ndarray] = deque()

    def update(self, k: int, asked: np.ndarray, present: np.ndarray,
               why: Mapping[int, str] | None = None) -> None:
        """Record round ``k``; raise :class:`ParticipationError` when the run must stop.

        :param why: optional reason of each asked client's absence (for the message)."""
        asked, present = np.asarray(asked, bool), np.asarray(present, bool)
        counts = np.stack([asked, present & asked]).astype(np.int64)
        self.rounds += 1
        self._total += counts
        self._window += counts
        self._recent.append(counts)
        if len(self._recent) > PARTICIPATION_WINDOW:
            self._window -= self._recent.popleft()
        if asked.any() and not present.any():
            self.streak.append(int(k))
        elif present.any():
            self.streak = []
        if self.max_empty and len(self.streak) >= self.max_empty:
            reasons = ""
            if why:
                reasons = " Last reasons: " + "; ".join(
                    f"client {i}: {why[i]}" for i in sorted(why)) + "."
            raise ParticipationError(
                f"Flower deployment: rounds {_rounds_text(self.streak)} had no participant: "
                f"every client asked ({np.flatnonzero(asked).tolist()} in round {k}) failed "
                "to deliver a message, so these rounds moved the chain by the prior, memory "
                f"and noise only (a random walk without data).{reasons} Check the clients "
                "(SuperNodes, network, `round_timeout`), or raise `max_empty_rounds` (0 "
                "switches this check off).", self.streak)
        if self.rho > 0:
            self._test(k)

    def _test(self, k: int) -> None:
        windows = [(k - self.rounds + 1, self._total)]  # the whole run, rounds 0..k
        if self.rounds > len(self._recent):
            windows.append((k - len(self._recent) + 1, self._window))
        for first, (a, s) in windows:
            n_asked, n_got = int(a.sum()), int(s.sum())
            if n_asked == 0 or n_got >= self.rho * n_asked:
                continue
            tail = _binom_cdf(n_got, n_asked, self.rho)
            if tail >= self.level:
                continue
            per = sorted(((int(a[i] - s[i]), i) for i in range(self.b)), reverse=True)
            worst = ", ".join(f"client {i} ({m} of {int(a[i])} missed)" for m, i in per if m > 0)
            raise ParticipationError(
                f"Flower deployment: participation fell far below the spec's: in rounds "
                f"{first}-{k}, {n_got} of the {n_asked} requests were answered "
                f"({n_got / n_asked:.1%}; observed participation "
                f"{n_got / (self.b * (k - first + 1)):.3g} for the declared "
                f"participation={self.p:g}), "
                f"below min_participation={self.rho:g} of the requests (binomial tail "
                f"P = {tail:.2g} < {self.level:.2g}). Missing: {worst}. Check these clients, "
                "or lower `min_participation` (0 switches this check off).",
                range(first, k + 1))
