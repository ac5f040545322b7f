"""A repeated SAEM run replays the programs of an earlier run with the same key, without
tracing them (:mod:`numpyro_fed.saem.memo`, :func:`numpyro_fed._programs.replay_scope`),
and never returns what a fresh run would not.

Each case runs a fit, changes one thing the programs depend on (a global the model reads,
an array it closes over changed in place, a distribution's method, a library constant,
the data), fits again and compares with the same fit traced afresh (replay off: every
program traced, compiled ones reused only for the same program content, which
``tests/test_cache_correctness.py`` checks against fresh processes' computations): bit for
bit. Each also checks that the change matters (so that it cannot pass by accident)
and, where nothing changed, that the run was replayed. The replay path itself is exercised
with the suite's verification off (``NUMPYRO_FED_VERIFY_TRACE_KEYS=1`` traces every replayed
program anyway and raises if it is not the recorded one: the rest of the suite runs so).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.distributions import constraints

from numpyro_fed import _programs
from numpyro_fed.saem import SAEM, Schedule

#: module globals the models read
SCALE = 1.0
SHIFT = np.zeros(12, np.float32)


def model(y, n):
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n):
        z = numpyro.sample("z", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(SCALE * z + SHIFT, 1.0), obs=y)


class Wide(dist.Normal):
    """A Normal whose log-density is scaled by the global ``SCALE`` (a method reading a
    global: invisible in the distribution's parameters)."""

    def log_prob(self, value):
        return SCALE * super().log_prob(value)


def wide_model(y, n):
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n):
        z = numpyro.sample("z", dist.Normal(mu, tau))
        numpyro.sample("y", Wide(z, 1.0), obs=y)


Y = (1.5 + 2.0 * np.random.default_rng(0).standard_normal(12)).astype(np.float32)


def _fit(m=model, seed=0, y=Y, **kw):
    settings = dict(num_chains=2, num_draws=10,
                    schedule=Schedule(num_iters=30, num_exploration=15, num_burnin=2))
    settings.update(kw)
    return SAEM(m, **settings).run(random.key(seed), y, len(y))


def _same(a, b) -> None:
    np.testing.assert_array_equal(a.theta, b.theta)
    np.testing.assert_array_equal(a.trajectory.to_numpy(), b.trajectory.to_numpy())
    np.testing.assert_array_equal(a.z_draws, b.z_draws)
    assert a.convergence_messages == b.convergence_messages


@pytest.fixture
def replay(monkeypatch):
    """The replay path as users run it (the suite otherwise traces every replayed program
    to verify it), with no recorded run."""
    monkeypatch.setattr(_programs, "VERIFY_TRACE_KEYS", False)
    _programs._REPLAYS.clear()
    yield
    _programs._REPLAYS.clear()


def _fresh(fn):
    """``fn`` traced afresh: every program traced and taken from the content-keyed cache
    only if the fresh trace is the same program (what a fresh process computes:
    tests/test_cache_correctness.py; no recompilation, so that these tests stay cheap)."""
    from numpyro_fed.saem import fit as fit_mod

    old = fit_mod.REPLAY_RUNS
    fit_mod.REPLAY_RUNS = False
    try:
        before = _programs.stats()["replay_hits"]
        out = fn()
        assert _programs.stats()["replay_hits"] == before
        return out
    finally:
        fit_mod.REPLAY_RUNS = old


def _replayed(fn):
    before = _programs.stats()["replay_hits"]
    out = fn()
    return out, _programs.stats()["replay_hits"] - before


def test_a_repeated_run_is_replayed_and_equals_a_fresh_run(replay):
    """Nothing changed, another seed: every program is replayed (none traced) and the fit
    is the fresh fit of that seed, bit for bit."""
    _fit(seed=0)
    again, hits = _replayed(lambda: _fit(seed=1))
    assert hits >= 3
    _same(again, _fresh(lambda: _fit(seed=1)))
    # and the result's own programs (standard errors, -2LL) after a replayed fit
    np.testing.assert_array_equal(again.fisher_information(), _fit(seed=1).fisher_information())


def test_a_changed_global_is_seen(replay):
    global SCALE
    try:
        first = _fit()
        SCALE = 2.0
        second, hits = _replayed(_fit)
        fresh = _fresh(_fit)
    finally:
        SCALE = 1.0
    assert hits == 0
    _same(second, fresh)
    assert not np.array_equal(first.theta, second.theta)


def test_an_array_changed_in_place_is_seen(replay):
    first = _fit()
    try:
        SHIFT[:] = 3.0
        second, hits = _replayed(_fit)
        fresh = _fresh(_fit)
    finally:
        SHIFT[:] = 0.0
    assert hits == 0
    _same(second, fresh)
    assert not np.array_equal(first.theta, second.theta)


def test_a_distribution_method_reading_a_global_is_seen(replay):
    global SCALE
    try:
        first = _fit(wide_model)
        SCALE = 0.5
        second, hits = _replayed(lambda: _fit(wide_model))
        fresh = _fresh(lambda: _fit(wide_model))
    finally:
        SCALE = 1.0
    assert hits == 0
    _same(second, fresh)
    assert not np.array_equal(first.theta, second.theta)


def test_a_changed_library_constant_is_seen(replay, monkeypatch):
    """A tuning constant of the library (the M-step's variance floor, here above the
    variance) is part of the key."""
    from numpyro_fed.saem import mstep

    first = _fit()
    monkeypatch.setattr(mstep, "VARIANCE_FLOOR", 4.0)
    second, hits = _replayed(_fit)
    fresh = _fresh(_fit)
    assert hits == 0
    _same(second, fresh)
    assert not np.array_equal(first.trajectory.to_numpy(), second.trajectory.to_numpy())


def test_new_data_of_the_same_shape_are_fitted_afresh(replay):
    first = _fit()
    y2 = Y + 1.0
    second, hits = _replayed(lambda: _fit(y=y2))
    assert hits == 0
    _same(second, _fresh(lambda: _fit(y=y2)))
    assert not np.array_equal(first.theta, second.theta)


def test_a_setting_that_is_not_a_value_turns_replay_off(replay):
    """An init strategy of the user's (a function that may read anything) is not keyed:
    such runs trace every program."""
    def init(site=None):
        return numpyro.infer.init_to_median(site)

    _fit(init_strategy=init)
    again, hits = _replayed(lambda: _fit(init_strategy=init))
    assert hits == 0
    _same(again, _fresh(lambda: _fit(init_strategy=init)))


def test_a_run_that_raises_is_not_recorded(replay):
    def bad(y, n):
        model(y, n)
        numpyro.factor("boom", jnp.where(numpyro.param("mu", 0.0) > 1e9, 0.0, jnp.nan))

    with pytest.raises(ValueError, match="boom"):
        _fit(bad)
    assert not _programs._REPLAYS


def test_a_wrong_replay_raises_under_verification(monkeypatch):
    """The guard of the suite: a recorded run whose key does not determine its programs
    (here: a closure value the key leaves out) is caught when the replayed program is
    traced anyway, with a RuntimeError naming the defect."""
    monkeypatch.setattr(_programs, "VERIFY_TRACE_KEYS", True)
    _programs._REPLAYS.clear()
    x = jnp.arange(3.0)

    def run(c):
        def f(v):
            return v * c

        with _programs.replay_scope(("same key",)) as scope:
            scope.activate()
            return _programs.compile_program(f, (x,))(x)

    np.testing.assert_array_equal(run(2.0), 2.0 * x)
    with pytest.raises(RuntimeError, match="replayed run prepared another program"):
        run(3.0)
    _programs._REPLAYS.clear()


def test_replayed_runs_follow_the_key_not_the_model_object(replay):
    """Two model objects with the same code and data (a model made by a factory, a new
    ``PKModel.bind`` per fit) share the recording; a model with other code does not."""
    def make():
        def m(y, n):
            model(y, n)
        return m

    twin = make()

    def other(y, n):
        mu = numpyro.param("mu", 0.0)
        tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
        with numpyro.plate("subject", n):
            z = numpyro.sample("z", dist.Normal(mu, tau))
            numpyro.sample("y", dist.Normal(z, 2.0), obs=y)

    _fit(make())
    a, hits = _replayed(lambda: _fit(twin))
    assert hits >= 3
    _same(a, _fresh(lambda: _fit(twin)))
    _fit(model)
    b, hits = _replayed(lambda: _fit(other))
    assert hits == 0
    _same(b, _fresh(lambda: _fit(other)))


def test_the_key_covers_the_model_and_its_settings():
    """The run key changes with the model's code, its data and a setting, not with the seed."""
    from numpyro_fed.saem import memo

    s = SAEM(model, num_chains=2)
    k = memo.run_key(s, random.key(0), (Y, 12), {}, None)
    assert k is not None
    assert memo.run_key(s, random.key(1), (Y, 12), {}, None) == k
    assert memo.run_key(s, random.key(0), (Y + 1, 12), {}, None) != k
    assert memo.run_key(SAEM(model, num_chains=3), random.key(0), (Y, 12), {}, None) != k
    assert memo.run_key(SAEM(wide_model, num_chains=2), random.key(0), (Y, 12), {}, None) != k
    # x64 toggled: another key
    with jax.enable_x64(True):
        assert memo.run_key(s, random.key(0), (Y, 12), {}, None) != k


def test_a_run_that_warmed_its_programs_is_replayed_whole(replay, monkeypatch):
    """A first fit compiles its standard errors' programs while its loop runs (the warming:
    what it compiles depends on timing) and its convergence check runs them; the next fit
    replays every program of that check without tracing or warming, and equals a fresh
    fit."""
    from numpyro_fed.saem import fit as fit_mod

    monkeypatch.setattr(fit_mod, "WARM_AFTER_S", 0.0)
    monkeypatch.setattr(fit_mod, "WARM_PROGRAMS", True)  # off in the suite (conftest)
    monkeypatch.setattr(SAEM, "_loop_busy", staticmethod(lambda outputs: lambda: True))
    traced = []
    orig = _programs._prepare_traced

    def spy(fn, *a, **k):
        traced.append(getattr(fn, "__name__", "?"))
        return orig(fn, *a, **k)

    monkeypatch.setattr(_programs, "_prepare_traced", spy)
    orig_warm, warmed_first = fit_mod.warm_programs, []

    def warm(fields, busy):
        out = orig_warm(fields, busy)
        warmed_first.extend(out)
        return out

    monkeypatch.setattr(fit_mod, "warm_programs", warm)
    _fit(seed=0)
    assert warmed_first  # the first fit warmed its standard errors' programs
    n_first = len(traced)
    warmed = []
    monkeypatch.setattr(fit_mod, "warm_programs", lambda *a: warmed.append(1) or {})
    again, hits = _replayed(lambda: _fit(seed=1))
    # only the model's first trace (before the run knows its static data) is traced again
    assert traced[n_first:] == ["first_trace"] and hits >= 3 and not warmed
    monkeypatch.undo()
    _same(again, _fresh(lambda: _fit(seed=1)))


class Link:
    """A model argument that is an object (as ``PKModel``'s ``Binding`` holds its structural
    model): keyed by its type only, what it makes the model compute is in the model's
    fingerprint."""

    def __init__(self, k: float) -> None:
        self.k = k

    def __call__(self, z):
        return self.k * z


def link_model(y, n, link):
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n):
        z = numpyro.sample("z", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(link(z), 1.0), obs=y)


def test_an_object_argument_is_seen_through_the_model(replay):
    def fit(link, seed=0):
        return SAEM(link_model, num_chains=2, num_draws=10,
                    schedule=Schedule(num_iters=30, num_exploration=15, num_burnin=2)
                    ).run(random.key(seed), Y, len(Y), link=link)

    first = fit(Link(1.0))
    other, hits = _replayed(lambda: fit(Link(2.0)))  # a new object computing otherwise
    assert hits == 0
    _same(other, _fresh(lambda: fit(Link(2.0))))
    assert not np.array_equal(first.theta, other.theta)
    fit(Link(1.0))
    same, hits = _replayed(lambda: fit(Link(1.0), seed=1))  # a new object, the same model
    assert hits >= 3
    _same(same, _fresh(lambda: fit(Link(1.0), seed=1)))


def test_no_fit_imports_a_library_module():
    """The constants of the library's modules are part of a run's key
    (``memo._library_constants``): a module that a fit imports on its way changes the key of
    the next fit, which is then traced again instead of replayed (the second fit of a
    time-varying covariate model on ``nlme::Quinidine``: 39 s traced, the first fit having
    imported ``nlme.timevarying``). Every ``numpyro_fed`` module imported inside a function
    of the SAEM and NLME layers is imported with them, but the ODE layer, which the user
    imports (``nlme.ode_model``) before any fit of an ODE model."""
    import ast
    import pathlib
    import sys

    import numpyro_fed.nlme
    import numpyro_fed.saem  # noqa: F401

    root = pathlib.Path(numpyro_fed.__file__).parent
    lazy = set()
    for sub in ("saem", "nlme"):
        for path in sorted((root / sub).glob("*.py")):
            for fn in ast.walk(ast.parse(path.read_text())):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                            "numpyro_fed"):
                        lazy.add((node.module, path.name, fn.name))
    assert ("numpyro_fed.nlme.ode", "__init__.py", "__getattr__") in lazy  # the scan works
    missing = sorted(x for x in lazy
                     if x[0] not in sys.modules and x[0] != "numpyro_fed.nlme.ode")
    assert not missing, f"imported by a fit, not with the package: {missing}"


def test_runs_under_one_key_that_take_different_paths_are_all_replayed(monkeypatch):
    """Runs under one key may prepare different programs where their numbers decide (a
    convergence check that examines a variance near 0 on one seed only). Each path is
    remembered (up to REPLAY_PATHS): a run takes a recorded program only while every call so
    far matched one recorded run's, and seeds taking turns no longer trace again what the
    other replaced (with one path remembered, the third run below traced its second
    program)."""
    monkeypatch.setattr(_programs, "VERIFY_TRACE_KEYS", False)
    x = jnp.arange(3.0)

    def first(v):
        return v + 1.0

    def second_a(v):
        return v * 2.0

    def second_b(v):
        return v - 3.0

    def run(branch):
        before = _programs.stats()["replay_hits"]
        with _programs.replay_scope(("two paths", id(run))) as scope:
            scope.activate()
            out = [np.asarray(_programs.compile_program(first, (x,))(x))]
            second = second_a if branch == "a" else second_b
            out.append(np.asarray(_programs.compile_program(second, (x,))(x)))
        return out, _programs.stats()["replay_hits"] - before

    ref_a, n = run("a")
    assert n == 0  # recorded
    ref_b, n = run("b")
    assert n == 1  # the first program replayed, the other path traced (and recorded)
    out, n = run("a")
    assert n == 2  # both of path a's programs replayed
    for o, r in zip(out, ref_a, strict=True):
        np.testing.assert_array_equal(o, r)
    out, n = run("b")
    assert n == 2
    np.testing.assert_array_equal(out[1], ref_b[1])
    np.testing.assert_array_equal(out[1], np.asarray(x) - 3.0)  # not path a's program
