"""SAEM on models that compute shapes from their data (issue 28, "any model that NumPyro's
NUTS runs, SAEM runs"): plate sizes from ``int(x.max()) + 1``, ``len(np.unique(x))``,
``np.bincount``, a Python or NumPy integer argument, boolean indexing and Python control flow
on the data. The data arguments the model reads concretely are found automatically
(:attr:`ModelInfo.static_data`: constants of the compiled programs, compiled once per
value); the others stay traced (compiled once per shape)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import saem_cases as sc
from compile_count import Compiles
from numpyro.distributions import constraints

from numpyro_fed.saem import SAEM, Schedule
from numpyro_fed.saem.model import ModelInfo, merge_data, split_data

DATA_DEPENDENT = [n for n in sc.CASE_NAMES if sc.get_case(n).data_dependent_shapes]
#: the arguments each case's model reads concretely (the others stay traced)
EXPECTED_STATIC = {
    "sleepstudy_unique": ["subj"],                     # len(np.unique(subj)), b[subj]
    "orthodont_bincount": ["female", "subj"],          # np.bincount(subj, weights=female)
    "cbpp_long": ["herd", "incidence", "period", "size"],  # max, unique, `if np.any(i > s)`
    "dyestuff_int": [],                                # a Python int is not an array
}
#: short runs: the twin comparison needs the same programs, not a converged fit
SHORT = Schedule(num_iters=30, num_exploration=15, num_burnin=2)


def _short_fit(model, data, seed=0, **kw):
    return SAEM(model, schedule=SHORT, num_draws=5, **kw).run(jax.random.key(seed), **data)


def test_the_four_cases_are_the_data_dependent_ones():
    assert sorted(DATA_DEPENDENT) == sorted(EXPECTED_STATIC)


# ------------------------------------------------------------------ the cases and twins
@pytest.mark.parametrize("name", [
    "cbpp_long",  # int(max) + 1, a param shape from len(np.unique), Python control flow
    # (the default fit below covers sleepstudy_unique)
    pytest.param("sleepstudy_unique", marks=pytest.mark.slow),
    pytest.param("orthodont_bincount", marks=pytest.mark.slow),
    pytest.param("dyestuff_int", marks=pytest.mark.slow),
])
def test_data_dependent_case_fits_as_its_twin(name):
    """Same seed, same schedule: the data-dependent model and its constant-size twin run the
    same computation (the static arrays are constants of the programs), so the estimates
    agree to float32 round-off. sleepstudy_unique and dyestuff_int have the twin's data
    layout (bitwise-equal estimates measured); orthodont_bincount and cbpp_long are the long
    format of a padded twin (a different summation order: 4e-6 relative measured)."""
    case = sc.get_case(name)
    twin = sc.get_case(case.twin)
    res = _short_fit(case.model, case.data)
    ref = _short_fit(twin.model, twin.data)
    assert res.settings["static_data"] == EXPECTED_STATIC[name]
    assert res.settings["subjects"] == ref.settings["subjects"] == twin.n_subjects
    est, est_twin = res.estimates(), ref.estimates()
    assert est.keys() == est_twin.keys()
    for k in est:
        assert est[k] == pytest.approx(est_twin[k], rel=1e-4, abs=1e-5), k


def test_default_fit_of_a_data_dependent_model_reaches_the_exact_maximum():
    """``SAEM(model).run(key, **data)`` with every default on sleepstudy with its number of
    subjects counted by ``len(np.unique(subj))``: the targets of the test set (fixed effects
    within max(0.2 SE, 1%), variances within max(0.3 SE, 10%), -2LL at the estimate within
    0.5 of the exact maximum) against the exact closed-form reference."""
    res, _ = sc.default_fit("sleepstudy_unique", seed=0)
    assert res.settings["static_data"] == ["subj"]
    score = sc.compare("sleepstudy_unique", res.params)
    assert score["ok"], score["failures"]


# ------------------------------------------------------------------ idioms (no compilation)
def _rows(n_sub=5, per=4, seed=0):
    rng = np.random.default_rng(seed)
    subj = np.repeat(np.arange(n_sub), per).astype(np.int32)
    x = rng.normal(size=n_sub * per).astype(np.float32)
    y = (1.0 + rng.normal(size=n_sub)[subj] + 0.5 * x
         + 0.3 * rng.normal(size=n_sub * per)).astype(np.float32)
    return subj, x, y


def _body(n, subj, x, y):
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n):
        b = numpyro.sample("b", dist.Normal(mu, tau))
    with numpyro.plate("obs", len(x)):
        numpyro.sample("y", dist.Normal(b[subj] + 0.5 * x, sigma), obs=y)


def m_max(subj, x, y=None):
    _body(int(subj.max()) + 1, subj, x, y)


def m_unique(subj, x, y=None):
    _body(len(np.unique(subj)), subj, x, y)


def m_bincount(subj, x, y=None):
    _body(len(np.bincount(subj)), subj, x, y)


def m_jnp_max(subj, x, y=None):  # a traced jnp scalar as plate size
    _body(subj.max() + 1, subj, x, y)


def m_zeros(subj, x, y=None):  # an array shape from the data
    _body(jnp.zeros(int(np.max(subj)) + 1).shape[0], subj, x, y)


def m_boolean_index(subj, x, keep, y=None):  # boolean indexing of the data
    _body(len(np.unique(subj[keep])), subj[keep], x[keep], None if y is None else y[keep])


def m_control_flow(subj, x, y=None):  # Python control flow on the data
    if np.all(x > 100.0):
        raise ValueError("x out of range")
    centre = float(x.mean()) if x.std() > 0 else 0.0
    _body(int(subj.max()) + 1, subj, x - centre, y)


def m_size_arg(subj, x, n, y=None):  # the size as an argument (int, numpy or 0-d array)
    _body(n, subj, x, y)


def m_traced_only(subj, x, y=None, n=5):  # nothing read concretely: everything traced
    _body(n, subj, x, y)


IDIOMS = [
    # (id, model, extra data, static arguments expected)
    ("int(max)+1", m_max, {}, ("subj",)),
    ("len(np.unique)", m_unique, {}, ("subj",)),
    ("np.bincount", m_bincount, {}, ("subj",)),
    ("jnp max as plate size", m_jnp_max, {}, ("subj",)),
    ("shape of jnp.zeros", m_zeros, {}, ("subj",)),
    ("boolean index", m_boolean_index, {"keep": np.arange(20) % 7 != 3},
     ("keep", "subj")),  # x[keep] with a concrete mask traces
    ("python control flow", m_control_flow, {}, ("subj", "x")),
    ("numpy int argument", m_size_arg, {"n": np.int64(5)}, ("n",)),
    ("0-d jax array argument", m_size_arg, {"n": jnp.asarray(5)}, ("n",)),
    ("python int argument", m_size_arg, {"n": 5}, ()),
    ("nothing concrete", m_traced_only, {}, ()),
]


@pytest.mark.parametrize("model,extra,expected", [i[1:] for i in IDIOMS],
                         ids=[i[0] for i in IDIOMS])
def test_static_data_found_for_each_idiom(model, extra, expected):
    """The minimal set of arguments the model reads concretely; the model then runs with the
    other arrays traced (as the compiled programs run it)."""
    subj, x, y = _rows()
    data = {"subj": subj, "x": x, "y": y, **extra}
    info = ModelInfo(model, (), data, jax.random.key(0))
    assert info.static_data == expected
    arrays, static = split_data((), data, info.static_data)
    traced = sorted(arrays[1])
    assert traced == sorted(set(k for k in data if k != "n" or not isinstance(data[k], int))
                            - set(expected))

    values = {n: info.trace0[n]["value"] for n in info.param_names + info.latent_names}

    def run(arrs, vals):
        a, k = merge_data(arrs, static)
        return info.site_log_probs(vals, a, k)

    jax.eval_shape(run, arrays, values)  # runs with the traced arrays, params and latents


def test_static_data_given_as_jax_arrays():
    """Data given as jax.Arrays: the one the model reads concretely is found too (and
    reaches the programs as NumPy: a closed-over jax.Array would be traced again)."""
    subj, x, y = _rows()
    data = {"subj": jnp.asarray(subj), "x": jnp.asarray(x), "y": jnp.asarray(y)}
    info = ModelInfo(m_unique, (), data, jax.random.key(0))
    assert info.static_data == ("subj",)


def test_positional_static_argument():
    """Positional arguments are found by position."""
    subj, x, y = _rows()
    info = ModelInfo(m_unique, (subj, x), {"y": y}, jax.random.key(0))
    assert info.static_data == (0,)


def test_static_data_is_keyed_by_content():
    from numpyro_fed.saem.model import StaticData

    a = np.arange(6, dtype=np.int32)
    assert StaticData(a) == StaticData(a.copy()) and hash(StaticData(a)) == hash(
        StaticData(a.copy()))
    assert StaticData(a) != StaticData(a[::-1].copy())
    assert StaticData(a) != StaticData(a.astype(np.int64))
    # a jax.Array reaches the model as the NumPy array of its values (JAX would stage every
    # operation on a closed-over jax.Array inside the programs' traces)
    assert StaticData(jnp.asarray(a)) == StaticData(a)
    assert isinstance(StaticData(jnp.asarray(a)).value, np.ndarray)
    (_, _), static = split_data((), {"s": a, "x": np.ones(3)}, ("s",))
    args, kwargs = merge_data(((), {"x": jnp.ones(3)}), static)
    assert kwargs["s"] is a  # the model gets the object it was given, as in NumPyro's MCMC


# ------------------------------------------------------------------ runs
@pytest.mark.parametrize("n", [pytest.param(6, marks=pytest.mark.slow), np.int64(6),
                               jnp.asarray(6)], ids=["int", "np.int64", "0-d array"])
def test_size_passed_as_an_argument(n):
    """Dyestuff with the number of batches passed positionally as a Python int, a NumPy
    integer or a 0-d array: the same fit as the twin with the size a constant default."""
    case = sc.get_case("dyestuff")
    data = dict(case.data)
    batch, y = data.pop("batch"), data.pop("y")
    res = SAEM(sc.dyestuff_int_model, schedule=SHORT, num_draws=5).run(
        jax.random.key(0), batch, n, y=y)
    ref = _short_fit(case.model, case.data)
    assert res.settings["subjects"] == 6
    assert res.settings["static_data"] == ([] if isinstance(n, int) else [1])
    for k, v in ref.estimates().items():
        assert res.estimates()[k] == pytest.approx(v, rel=1e-5), k


_Compiles = Compiles


def test_repeated_fit_does_not_recompile_and_new_static_values_are_not_stale():
    """A data-dependent model fitted again on the same data, and on new values of the
    arguments it only computes with (traced), compiles nothing; new values of an argument it
    reads concretely give new programs (never the old ones: the plate size follows)."""
    subj, x, y = _rows(n_sub=6, per=5)
    kw = dict(schedule=SHORT, num_draws=5)
    first = SAEM(m_max, **kw).run(jax.random.key(0), subj, x, y=y)
    assert first.settings["static_data"] == [0]
    with _Compiles() as c:
        again = SAEM(m_max, **kw).run(jax.random.key(0), subj, x, y=y)
        fresh = SAEM(m_max, **kw).run(jax.random.key(1), subj, x * 1.5, y=y + 2.0)
    assert c.names == []
    assert again.estimates() == first.estimates()
    assert fresh.estimates()["mu"] == pytest.approx(first.estimates()["mu"] + 2.0, abs=0.5)
    # 3 subjects instead of 6, same shapes: the subject index is static, a new program
    merged = np.minimum(subj, 2).astype(np.int32)
    res = SAEM(m_max, **kw).run(jax.random.key(0), merged, x, y=y)
    assert res.settings["subjects"] == 3
    assert res.z_draws.shape[-1] == 3


# ------------------------------------------------------------------ what cannot be handled
def bad_param_in_python(subj, x, y=None):
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", int(subj.max()) + 1):
        b = numpyro.sample("b", dist.Normal(mu, tau))
    scale = 2.0 if tau > 0.5 else 1.0  # a param in Python control flow
    with numpyro.plate("obs", len(x)):
        numpyro.sample("y", dist.Normal(b[subj] + x, scale), obs=y)


def bad_latent_in_numpy(subj, x, y=None):
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", len(np.unique(subj))):
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    shift = np.asarray(b)[subj]  # a latent through NumPy
    with numpyro.plate("obs", len(x)):
        numpyro.sample("y", dist.Normal(shift + x, 1.0), obs=y)


def _line(fn, text):
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


UNHANDLED = [
    (bad_param_in_python, "param site 'tau'", "if tau > 0.5"),
    (bad_latent_in_numpy, "latent site 'b'", "np.asarray(b)"),
]


@pytest.mark.parametrize("model,what,text", UNHANDLED, ids=["param", "latent"])
def test_model_that_cannot_be_traced_names_the_site_and_the_line(model, what, text):
    """A model that NumPyro's MCMC runs (params are constants there) but that reads a param
    or a latent value in Python: a ValueError naming the site and the file:line, not a raw
    JAX error."""
    subj, x, y = _rows()
    line = _line(model, text)
    with pytest.raises(ValueError, match=re.escape(what)) as err:
        SAEM(model).run(jax.random.key(0), subj, x, y=y)
    msg = str(err.value)
    assert f"test_saem_shapes.py:{line}" in msg, msg
    assert "SAEM:" in msg
