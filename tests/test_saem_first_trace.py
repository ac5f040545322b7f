"""The model's first trace (``ModelInfo``) as one compiled program, and the models for which
it is NumPyro's eager trace (``saem.model._compiled_trace``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from compile_count import Compiles
from numpyro.distributions import constraints
from numpyro.handlers import seed, trace

from numpyro_fed.saem.model import ModelInfo, _compiled_trace

#: sizes no other test uses: the eager trace's operations are compiled afresh
N_SUBJ, N_OBS = 37, 113


def _data(seed_=0, n=N_SUBJ, m=N_OBS):
    rng = np.random.default_rng(seed_)
    subj = np.sort(np.r_[np.arange(n), rng.integers(0, n, m - n)])
    t = rng.uniform(0.5, 12.0, m).astype(np.float32)
    y = (3.0 * np.exp(-0.2 * t) + rng.normal(0, 0.1, m)).astype(np.float32)
    return {"y": jnp.asarray(y), "t": jnp.asarray(t), "subj": jnp.asarray(subj), "n": n}


def pk_like(y, t, subj, n):
    """Random effects on two parameters, a nonlinear mean, a mask and ``to_event``."""
    lA = numpyro.param("lA", 1.0)
    lk = numpyro.param("lk", -1.5)
    om = numpyro.param("om", jnp.array([0.3, 0.3]), constraint=constraints.positive)
    sd = numpyro.param("sd", 0.2, constraint=constraints.positive)
    with numpyro.plate("subject", n):
        a = numpyro.sample("a", dist.Normal(lA, om[0]))
        k = numpyro.sample("k", dist.Normal(lk, om[1]))
    f = jnp.exp(a[subj]) * jnp.exp(-jnp.exp(k[subj]) * t)
    numpyro.deterministic("f", f)
    numpyro.sample("y", dist.Normal(f, sd).mask(t > 0).to_event(1), obs=y)


def _chain(fn):
    out = []
    while fn is not None:
        out.append(fn)
        fn = getattr(fn, "base_dist", None)
    return out


def test_compiled_first_trace_is_numpyros_trace():
    data = _data()
    key = jax.random.key(3)
    got = _compiled_trace(pk_like, (), data, key)
    ref = trace(seed(pk_like, key)).get_trace(**data)
    assert got is not None
    assert list(got) == list(ref)
    for name, r in ref.items():
        g = got[name]
        assert g["type"] == r["type"] and g.get("is_observed") == r.get("is_observed")
        # the draws are the same bits (one PRNG), the computed values the same to rounding
        np.testing.assert_allclose(np.asarray(g["value"]), np.asarray(r["value"]),
                                   rtol=1e-6, err_msg=name)
        assert [f[:3] for f in g.get("cond_indep_stack", [])] == [
            f[:3] for f in r.get("cond_indep_stack", [])]
        if r["type"] != "sample":
            continue
        gc, rc = _chain(g["fn"]), _chain(r["fn"])
        assert [type(d) for d in gc] == [type(d) for d in rc]
        for gd, rd in zip(gc, rc, strict=True):
            assert (gd.batch_shape, gd.event_shape) == (rd.batch_shape, rd.event_shape)
            # attributes outside the pytree fields survive (Independent's
            # `reparametrized_params`, set from its base distribution)
            assert set(vars(rd)) <= set(vars(gd)) | {"_mean", "_variance"}
            for k, v in vars(rd).items():
                if isinstance(v, jax.Array | np.ndarray | float):
                    np.testing.assert_allclose(np.asarray(vars(gd)[k]), np.asarray(v),
                                               rtol=1e-6, err_msg=f"{name}.{k}")
    assert got["y"]["fn"].reparametrized_params == ref["y"]["fn"].reparametrized_params
    # the concrete arrays of the trace are not tracers (they outlive the program)
    leaves = jax.tree.leaves(got)
    assert not any(isinstance(v, jax.core.Tracer) for v in leaves)


def test_first_trace_compiles_one_program_not_one_per_operation():
    data = _data(1, N_SUBJ + 2, N_OBS + 4)  # sizes of this test only
    with Compiles() as c:
        info = ModelInfo(pk_like, (), data, jax.random.key(0))
    assert info.latent_names == ["a", "k"]
    # measured: the eager trace compiled 35 programs here (its operations at these
    # fresh sizes); now 6: `first_trace` and the few of ModelInfo's own set-up
    assert "jit(first_trace)" in c.names or "<persistent cache>" in c.names
    assert len(c.names) <= 12, c.names


def plate_from_data(y, subj):
    """The plainest NumPyro style: a plate size read from the data (concretely)."""
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", int(subj.max()) + 1):
        b = numpyro.sample("b", dist.Normal(mu, tau))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(b[subj], 1.0), obs=y)


def test_model_that_reads_its_data_gets_the_eager_trace():
    data = _data()
    kw = {"y": data["y"], "subj": data["subj"]}
    assert _compiled_trace(plate_from_data, (), kw, jax.random.key(0)) is None
    info = ModelInfo(plate_from_data, (), kw, jax.random.key(0))
    assert info.z_shapes["b"] == (N_SUBJ,)
    assert "subj" in info.static_data


def bad_scale(y):
    s = numpyro.param("s", -1.0)  # no constraint: an invalid Normal scale
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    numpyro.sample("y", dist.Normal(b, s), obs=y)


def test_invalid_argument_raises_numpyros_error_as_the_eager_trace_does():
    """NumPyro validates a distribution's arguments on concrete values only: the program
    computes the same check, and an invalid one goes to the eager trace and its error."""
    y = jnp.ones(5)
    assert _compiled_trace(bad_scale, (y,), {}, jax.random.key(0)) is None
    with pytest.raises(ValueError, match="'y'.*invalid `scale`"):
        ModelInfo(bad_scale, (y,), {}, jax.random.key(0))
