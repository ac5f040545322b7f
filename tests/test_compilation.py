"""Compilation: the persistent compilation cache option
(:func:`numpyro_fed.enable_compilation_cache`) and :class:`numpyro_fed.CachedMCMC` (a sampling
loop compiled once)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_count import Compiles
from jax.experimental.compilation_cache import compilation_cache as cc

import numpyro_fed
from numpyro_fed.compilation import default_cache_dir


@pytest.fixture
def restore_cache_config():
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    cc.reset_cache()


def test_cache_is_written_then_read_back_with_the_same_result(tmp_path, restore_cache_config):
    from jax._src import monitoring

    events = []

    def listen(name, **kw):
        events.append(name)

    jax.monitoring.register_event_listener(listen)
    # after programs have been compiled in this process: the cache is turned on anyway
    folder = numpyro_fed.enable_compilation_cache(tmp_path / "cache", min_compile_time_s=0)
    assert folder == tmp_path / "cache" and folder.is_dir()

    def f(x):  # a program no other test compiles
        return jnp.cumsum(jnp.sin(x) * 1.2345) @ jnp.cos(x[::-1])

    x = jnp.linspace(0.0, 1.0, 37)
    first = np.asarray(jax.jit(f)(x))
    assert any(folder.iterdir()), "nothing written to the cache"
    jax.clear_caches()  # what a new process starts from: no program in memory
    events.clear()
    second = np.asarray(jax.jit(f)(x))
    monitoring.unregister_event_listener(listen)
    assert "/jax/compilation_cache/cache_hits" in events
    assert first.tobytes() == second.tobytes()


def test_default_folder_and_bad_argument(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMPYRO_FED_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("NUMPYRO_FED_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "numpyro_fed" / "jax"
    with pytest.raises(ValueError, match="min_compile_time_s"):
        numpyro_fed.enable_compilation_cache(tmp_path, min_compile_time_s=-1)


# ------------------------------------------------------------------ CachedMCMC (issue 16)
_Compiles = Compiles


def _toy_kernel(kind: str = "qlsd"):
    from numpyro_fed import QLSD, ClientPartition, FederatedLangevin
    from numpyro_fed.examples import logistic_regression

    rng = np.random.default_rng(0)
    clients = [{"X": rng.normal(size=(12, 3)).astype(np.float32),
                "y": rng.integers(0, 2, size=12).astype(np.float32)} for _ in range(3)]
    part = ClientPartition.from_clients(clients)
    if kind == "qlsd":
        return QLSD(logistic_regression, part, variant="++", step_size=1e-3, batch_size=4,
                    bits=2, refresh_every=5)
    return FederatedLangevin(logistic_regression, part, step_size=1e-3)


def _same(a, b):
    import jax

    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def test_cached_mcmc_second_run_compiles_nothing():
    from jax import random

    from numpyro_fed import CachedMCMC

    kernel = _toy_kernel("qlsd")
    first = CachedMCMC(kernel, num_warmup=5, num_samples=20, progress_bar=False)
    with _Compiles() as c1:
        first.run(random.key(0))
        first.get_samples()  # NumPyro reshapes the draws (eager operations, compiled once)
    assert c1.names, "the first run compiles its loop"
    # a new CachedMCMC, another key: same kernel, same shapes -> no compilation at all
    again = CachedMCMC(kernel, num_warmup=5, num_samples=20, progress_bar=False)
    with _Compiles() as c2:
        again.run(random.key(1))
        again.get_samples()
    assert c2.names == []
    # and the same object run again
    with _Compiles() as c3:
        first.run(random.key(2))
    assert c3.names == []
    assert not np.array_equal(first.get_samples()["w"], again.get_samples()["w"])


def test_numpyro_mcmc_recompiles_where_cached_mcmc_does_not():
    """What CachedMCMC works around: NumPyro 0.22's MCMC.run compiles its loop every run."""
    from jax import random
    from numpyro.infer import MCMC

    kernel = _toy_kernel("lmc")
    MCMC(kernel, num_warmup=0, num_samples=10, progress_bar=False).run(random.key(0))
    with _Compiles() as c:
        MCMC(kernel, num_warmup=0, num_samples=10, progress_bar=False).run(random.key(1))
    assert any("_fori_collect_loop" in n for n in c.names)


@pytest.mark.parametrize("options", [
    dict(num_warmup=6, num_samples=9, thinning=2),
    dict(num_warmup=4, num_samples=7, num_chains=2, chain_method="vectorized"),
    # 2 sequential chains: the vectorized case's program per chain (26 s: suite time)
    pytest.param(dict(num_warmup=4, num_samples=7, num_chains=2, chain_method="sequential"),
                 marks=pytest.mark.slow),
    dict(num_warmup=8, num_samples=12, progress_bar=True),
])
def test_cached_mcmc_same_draws_as_numpyro_mcmc(options):
    from jax import random
    from numpyro.infer import MCMC

    from numpyro_fed import CachedMCMC

    kernel = _toy_kernel("qlsd")
    options = {"progress_bar": False, **options}
    runs = []
    # compiler_options=None (the default): the program MCMC compiles (bit for bit); the CPU
    # options of "auto" (LOOP_COMPILER_OPTIONS) may round differently in the last bits
    for make in (MCMC, CachedMCMC, partial(CachedMCMC, compiler_options="auto")):
        mcmc = make(kernel, **options)
        mcmc.run(random.key(3), extra_fields=("extra.refreshes",))
        runs.append(mcmc)
    ref, ours, fast = runs
    _same(ref.get_samples(group_by_chain=True), ours.get_samples(group_by_chain=True))
    # float32 chains of 15-20 steps: rounding differences stay at a few ulps (seen: 1e-7)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6),
                 ref.get_samples(group_by_chain=True), fast.get_samples(group_by_chain=True))
    _same(ref.get_extra_fields(group_by_chain=True), ours.get_extra_fields(group_by_chain=True))
    _same(ref.last_state.z, ours.last_state.z)
    assert ours.last_state.bits_up.shape == ref.last_state.bits_up.shape


def test_cached_mcmc_nuts_and_model_arguments():
    """Any NumPyro kernel; model arguments baked in (keyed by identity) or traced
    (``jit_model_args=True``, keyed by shape)."""
    import numpyro
    import numpyro.distributions as dist
    from jax import random
    from numpyro.infer import MCMC, NUTS

    from numpyro_fed import CachedMCMC

    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    x = np.random.default_rng(1).normal(size=(15, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0])).astype(np.float32)
    kernel = NUTS(model)
    ref = MCMC(kernel, num_warmup=20, num_samples=20, progress_bar=False)
    ref.run(random.key(0), x, y=y)
    # the program MCMC compiles (NUTS's trajectories turn last-bit differences of other
    # compiler options into visibly different draws, as any change of XLA version does)
    ours = CachedMCMC(kernel, num_warmup=20, num_samples=20, progress_bar=False,
                      compiler_options=None)
    ours.run(random.key(0), x, y=y)
    _same(ref.get_samples(), ours.get_samples())
    with _Compiles() as c:
        ours.run(random.key(0), x, y=y)
    assert c.names == []
    # new data of the same shapes: traced arguments need no new loop
    traced = CachedMCMC(kernel, num_warmup=20, num_samples=20, progress_bar=False,
                        jit_model_args=True)
    traced.run(random.key(0), x, y=y)
    with _Compiles() as c:
        traced.run(random.key(0), x, y=y + 1.0)
    assert c.names == []


def test_cached_mcmc_cache_key_and_clear():
    """Loops are kept by what they compute: a setting the program does not read (LMC's
    ``num_warmup``) or an equal new kernel object shares the loop; one it reads (MALA's
    adaptation schedule reads ``num_warmup``) is a new loop."""
    from jax import random

    from numpyro_fed import MALA, CachedMCMC, cached_mcmc

    cached_mcmc.clear_cache()
    assert cached_mcmc.cached_loops() == 0
    kernel = _toy_kernel("lmc")
    CachedMCMC(kernel, num_warmup=0, num_samples=5, progress_bar=False).run(random.key(0))
    assert cached_mcmc.cached_loops() == 1
    CachedMCMC(kernel, num_warmup=3, num_samples=5, progress_bar=False).run(random.key(0))
    assert cached_mcmc.cached_loops() == 1
    CachedMCMC(_toy_kernel("lmc"), num_warmup=0, num_samples=5,
               progress_bar=False).run(random.key(0))
    assert cached_mcmc.cached_loops() == 1
    mala = MALA(kernel.potential.pooled_model(), step_size=1e-2)
    for warmup in (2, 3, 2):
        CachedMCMC(mala, num_warmup=warmup, num_samples=5,
                   progress_bar=False).run(random.key(0))
    assert cached_mcmc.cached_loops() == 3
    cached_mcmc.clear_cache()
    assert cached_mcmc.cached_loops() == 0


def test_cached_mcmc_changed_settings_or_data_is_a_new_loop():
    """No stale program: a kernel setting changed after a run (the step size) and a numpy
    argument changed in place both give what NumPyro's MCMC gives, not the cached draws."""
    import numpyro
    import numpyro.distributions as dist
    from jax import random
    from numpyro.infer import MCMC

    from numpyro_fed import ULA, CachedMCMC, cached_mcmc

    def model(x):
        numpyro.sample("m", dist.Normal(x.mean(), 1.0))

    cached_mcmc.clear_cache()
    x = np.zeros(4, np.float32)
    kernel = ULA(model, step_size=0.1)

    def both():
        out = []
        for make in (MCMC, partial(CachedMCMC, compiler_options=None)):
            mcmc = make(kernel, num_warmup=0, num_samples=6, progress_bar=False)
            mcmc.run(random.key(0), x)
            out.append(np.asarray(mcmc.get_samples()["m"]))
        np.testing.assert_array_equal(*out)
        return out[1]

    first = both()
    kernel._step_size = 0.2
    second = both()
    x[:] = 3.0  # in place: same object, new content
    third = both()
    assert cached_mcmc.cached_loops() == 3
    assert not np.array_equal(first, second) and not np.array_equal(second, third)


@pytest.mark.parametrize("kind", [pytest.param("qlsd*", marks=pytest.mark.slow),  # 18 s
                                  "delf", "mala"])
def test_cached_mcmc_second_run_compiles_nothing_other_kernels(kind):
    """QLSD* (theta* found by the first ``init``), an ELF kernel and MALA (step-size
    adaptation reads ``num_warmup``): the second run of a new CachedMCMC compiles nothing."""
    from jax import random

    from numpyro_fed import DELF, MALA, QLSD, CachedMCMC
    from numpyro_fed.compressors import top_k
    from numpyro_fed.examples import logistic_regression

    base = _toy_kernel("lmc")
    if kind == "qlsd*":
        kernel = QLSD(logistic_regression, base.partition, variant="*", step_size=1e-3,
                      batch_size=4, bits=2)
    elif kind == "delf":
        kernel = DELF(logistic_regression, base.partition, step_size=1e-3, uplink=top_k(1))
    else:
        kernel = MALA(base.potential.pooled_model(), step_size=1e-2)
    first = CachedMCMC(kernel, num_warmup=4, num_samples=6, progress_bar=False)
    first.run(random.key(0))
    first.get_samples()
    with _Compiles() as c:
        mcmc = CachedMCMC(kernel, num_warmup=4, num_samples=6, progress_bar=False)
        mcmc.run(random.key(1))
        mcmc.get_samples()
    assert c.names == []


def test_cpu_tuned_compiler_options_are_dropped_on_other_backends():
    """The library's XLA options are tuned for XLA:CPU; a GPU compiler rejects
    ``xla_cpu_*`` options ("No such compile option", seen with jax 0.11 on an H200: every
    SAEM and CachedMCMC program failed to compile there), so they apply on the CPU only."""
    from numpyro_fed._programs import platform_options
    from numpyro_fed.saem.model import LOOP_COMPILER_OPTIONS, ONCE_COMPILER_OPTIONS

    for opts in (LOOP_COMPILER_OPTIONS, ONCE_COMPILER_OPTIONS):
        assert platform_options(opts, "cpu") == opts
        assert platform_options(opts, "gpu") == {}
        assert platform_options(opts, "tpu") == {}
    other = {"xla_gpu_autotune_level": 0}
    assert platform_options({**other, **LOOP_COMPILER_OPTIONS}, "gpu") == other
    assert platform_options(None) == {}
    # on this (CPU) machine the default backend keeps them
    assert platform_options(LOOP_COMPILER_OPTIONS) == (
        LOOP_COMPILER_OPTIONS if jax.default_backend() == "cpu" else {})
