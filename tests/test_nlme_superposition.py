"""Sparse dose superposition (``numpyro_fed.nlme.superposition``): the predictions of the
closed forms evaluated on the (sample, dose) pairs that can contribute equal the dense
``vmap`` over subjects of every sample with every dose (float64, to rounding), for every
route (depot/central boluses and infusions), steady state with its NONMEM resets, ``TLAG``
and ``F``, the record order of samples and doses at the same time, and observations of the
depot; the pair list is small on data with many doses; and a fit's log-density and its
gradient are unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed import nlme
from numpyro_fed.nlme.data import Doses
from numpyro_fed.nlme.superposition import PAIR_BLOCK, predict_pairs, superposition_pairs


def _random_doses(rng, n, D, absorb, ss_frac=0.3, inf_frac=0.3, n_cmt=1):
    """Random dosing histories: sorted times (some ties), boluses and infusions into the
    depot or the central compartment, some steady-state doses; padding at the end."""
    nd = rng.integers(1, D + 1, n)
    time = np.sort(np.round(rng.uniform(0.0, 100.0, (n, D)) / 4.0) * 4.0, axis=1)
    amt = rng.uniform(50.0, 150.0, (n, D))
    inf = rng.uniform(size=(n, D)) < inf_frac
    rate = np.where(inf, amt / rng.uniform(0.5, 2.0, (n, D)), 0.0)
    cmts = [1, 2] if absorb else [1]
    cmt = rng.choice(cmts, (n, D)).astype(np.int32)
    ss = rng.uniform(size=(n, D)) < ss_frac
    ii = np.where(ss, rng.choice([6.0, 8.0, 12.0], (n, D)), 0.0)
    mask = np.arange(D)[None] < nd[:, None]
    z = lambda a, v=0: np.where(mask, a, v)  # noqa: E731
    return Doses(z(time), z(amt), z(rate), z(cmt, 1).astype(np.int32), z(ss, False),
                 z(ii), mask)


def _dense(structural, p, t, d, nb=None, cmt=None):
    """The dense evaluation: every sample with every (recorded-before) dose."""
    def subject(pp, tt, dd, nn, cc):
        if nn is None:
            return structural(pp, tt, dd) if cc is None else structural(pp, tt, dd, cmt=cc)
        D = dd.mask.shape[-1]

        def sample(tj, nj, cj):
            dj = dd._replace(mask=dd.mask & (jnp.arange(D) < nj))
            c = None if cj is None else cj[None]
            f = structural if c is None else (lambda a, b, e: structural(a, b, e, cmt=c))
            return f(pp, tj[None], dj)[0]

        return jax.vmap(sample)(tt, nn, cc)

    return jax.vmap(subject)(p, t, d, nb, cmt)


CASES = [  # (compartments, absorption, lag/F, record order, depot observations)
    (1, "first_order", False, False, False),
    (1, "first_order", True, True, True),
    (1, None, False, True, False),
    (2, "first_order", True, False, False),
    (2, None, True, True, False),
    (3, "first_order", False, True, True),
]


@pytest.mark.parametrize("n_cmt, absorb, dosing, record, depot_obs", CASES)
def test_pairs_equal_the_dense_superposition(n_cmt, absorb, dosing, record, depot_obs):
    with jax.enable_x64(True):
        rng = np.random.default_rng(n_cmt * 10 + bool(absorb) + 2 * dosing)
        n, T, D = 7, 9, 8
        model = nlme.compartment_model(n_cmt, absorb)
        d = _random_doses(rng, n, D, absorb is not None)
        # samples at dose times too (ties: before or after the dose in record order)
        t = np.sort(np.where(rng.uniform(size=(n, T)) < 0.3,
                             d.time[np.arange(n)[:, None], rng.integers(0, D, (n, T))],
                             rng.uniform(0.0, 130.0, (n, T))), axis=1)
        nb = None
        if record:
            le = (d.time[:, None, :] <= t[:, :, None]) & d.mask[:, None, :]
            lt = (d.time[:, None, :] < t[:, :, None]) & d.mask[:, None, :]
            nb = np.where(rng.uniform(size=(n, T)) < 0.5, le.sum(-1), lt.sum(-1))
        cmt = None
        if depot_obs:
            cmt = rng.choice([0, 1], (n, T)).astype(np.int32)
        names = {"CL": 3.0, "V": 20.0, "KA": 1.2, "Q": 4.0, "V2": 50.0, "Q3": 1.5, "V3": 120.0}
        p = {k: v * np.exp(0.2 * rng.normal(size=n)) for k, v in names.items()
             if k in model.param_names}
        if dosing:
            p["TLAG"] = 0.5 * np.exp(0.2 * rng.normal(size=n))
            p["F"] = np.full(n, 0.7)
        # the general model (every route traced) once, else the one specialised to the doses
        structural = model if (n_cmt, absorb) == (1, "first_order") else model.for_doses(d)
        ref = jax.jit(lambda p, t, d, nb, c: _dense(structural, p, t, d, nb, c))(
            p, t, d, nb, cmt)
        pairs = superposition_pairs(t, d, nb)
        assert pairs.shape[0] % PAIR_BLOCK == 0 and pairs.shape[0] < n * T * D
        out = jax.jit(lambda p, t, d, pr, c: predict_pairs(structural, p, t, d, pr, c))(
            p, t, d, pairs, cmt)
        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())


def test_pairs_on_many_doses_are_few():
    """Doses at or before each sample and not reset by a later steady-state dose: on a
    regimen of 40 doses with a steady-state restart, the dense 11 x 40 product per subject
    shrinks to the doses since the restart."""
    n, T, D = 2, 11, 40
    time = np.tile(np.arange(D) * 8.0, (n, 1))
    ss = np.zeros((n, D), bool)
    ss[:, 30] = True  # doses before the 31st are reset by it
    d = Doses(time, np.full((n, D), 100.0), np.zeros((n, D)), np.ones((n, D), np.int32), ss,
              np.where(ss, 8.0, 0.0), np.ones((n, D), bool))
    t = np.tile(np.linspace(241.0, 320.0, T), (n, 1))  # after the restart at 240
    pairs = superposition_pairs(t, d, block=1)
    assert pairs[:, 3].all()
    # sample at time s sees the doses recorded in [240, s]
    expect = sum(int(np.sum((time[0] >= 240.0) & (time[0] <= s))) for s in t[0]) * n
    assert pairs.shape[0] == expect < n * T * D // 4


def test_model_log_density_and_gradient_unchanged():
    """The fit's model with the pairs of ``arrays(data)`` has the log-density and gradient of
    the dense evaluation (Phenobarb: 59 subjects, many IV doses; float64)."""
    from numpyro.infer.util import log_density

    with jax.enable_x64(True):
        data = nlme.load_phenobarb(np.float64)
        pk = nlme.PKModel(nlme.one_compartment(None),
                          params={"CL": nlme.Param(0.005), "V": nlme.Param(1.0)},
                          error="proportional")
        a = pk.arrays(data)
        assert "pairs" in a
        dense = {k: v for k, v in a.items() if k != "pairs"}
        rng = np.random.default_rng(0)
        n = data.n_subjects
        vals = {"phi_CL": jnp.asarray(np.log(0.005) + 0.2 * rng.normal(size=n)),
                "phi_V": jnp.asarray(0.2 * rng.normal(size=n))}

        def lp(v, kw):
            # the data as jit arguments (tracers): the dense path is taken without pairs
            f = jax.jit(lambda v, arr: log_density(pk.model, (), {**arr, "binding":
                                                                   kw["binding"]}, v)[0])
            arr = {k: x for k, x in kw.items() if k != "binding"}
            return f(v, arr), jax.grad(lambda v: f(v, arr))(v)

        l1, g1 = lp(vals, a)
        l0, g0 = lp(vals, dense)
        np.testing.assert_allclose(l1, l0, rtol=1e-12)
        for k in vals:
            np.testing.assert_allclose(g1[k], g0[k], rtol=1e-9, atol=1e-9)


def test_predict_on_concrete_data_uses_pairs_and_equals_the_dense_path():
    """``PKModel.predict`` (the diagnostics' path) lists the pairs itself when the times and
    doses are concrete; inside ``jit`` (traced data) it evaluates densely: the same values
    (Phenobarb; float64)."""
    from numpyro_fed.nlme.data import Doses as D

    with jax.enable_x64(True):
        data = nlme.load_phenobarb(np.float64)
        pk = nlme.PKModel(nlme.one_compartment(None),
                          params={"CL": nlme.Param(0.005), "V": nlme.Param(1.0)})
        a = pk.arrays(data)
        n = data.n_subjects
        indiv = {"CL": jnp.full(n, 0.005) * jnp.exp(0.1 * jnp.arange(n) / n),
                 "V": jnp.full(n, 1.0)}
        doses = D(*(jnp.asarray(a[k]) for k in ("dose_time", "dose_amt", "dose_rate",
                                                 "dose_cmt", "dose_ss", "dose_ii",
                                                 "dose_mask")))
        t, nb = jnp.asarray(a["obs_time"]), jnp.asarray(a["doses_before"])
        concrete = pk.predict(indiv, t, doses, nb, binding=a["binding"])
        traced = jax.jit(lambda t, d, nb: pk.predict(indiv, t, d, nb, binding=a["binding"]))(
            t, doses, nb)
        assert np.abs(traced).max() > 0
        m = data.obs.mask
        np.testing.assert_allclose(np.asarray(concrete)[m], np.asarray(traced)[m], rtol=1e-10,
                                   atol=1e-12 * float(np.abs(traced).max()))
        # the padding samples of the bound data are not evaluated (0)
        assert (~m).any() and np.all(np.asarray(concrete)[~m] == 0.0)
        # other times (no padding known): every entry, as the dense path
        t2 = t + 0.5
        c2 = pk.predict(indiv, t2, doses, nb, binding=a["binding"])
        d2 = jax.jit(lambda t, d, nb: pk.predict(indiv, t, d, nb, binding=a["binding"]))(
            t2, doses, nb)
        np.testing.assert_allclose(c2, d2, rtol=1e-10, atol=1e-12 * float(np.abs(d2).max()))


def test_louis_information_of_a_multiple_dose_fit_runs_on_the_pairs():
    """The program that crashed XLA:CPU with (1, 1) per-pair programs in 7c3f32d (segfault,
    jaxlib 0.10.2): the Louis information -- batched forward-over-reverse Hessians of the
    complete-data log-density over the draws -- of a float32 fit of multiple-dose data
    (Quinidine, 12 patients) on the pairs (a crash fails this test's worker), finite and
    symmetric."""
    import warnings

    from numpyro_fed.saem import ConvergenceWarning, Schedule

    data = nlme.load_quinidine().subjects(list(range(12)))
    pk = nlme.PKModel(nlme.one_compartment(),
                      params={"CL": nlme.Param(10.0), "V": nlme.Param(200.0),
                              "KA": nlme.Param(1.0, random=False)}, error="additive")
    assert "pairs" in pk.arrays(data)
    with warnings.catch_warnings():  # a short run is refused as converged: expected
        warnings.simplefilter("ignore", ConvergenceWarning)
        fit = pk.fit(data, jax.random.key(0), schedule=Schedule(num_iters=6,
                                                                num_exploration=3),
                     num_draws=25, num_chains=1)
        info = np.asarray(fit.result.fisher_information(method="louis"))
    assert info.shape[0] == info.shape[1] >= 5 and np.all(np.isfinite(info))
    np.testing.assert_allclose(info, info.T, rtol=1e-6, atol=1e-6)
