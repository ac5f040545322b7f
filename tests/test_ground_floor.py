"""The ground floor of the package: its error types in :mod:`numpyro_fed.errors`, the modules
split out of the old monoliths, and the old import paths that keep working."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import numpy as np
import pytest

import numpyro_fed

ROOT = Path(numpyro_fed.__file__).resolve().parent


def _errors():
    """:mod:`numpyro_fed.errors` (imported in each test, so that each fails on its own where
    the module is missing)."""
    return importlib.import_module("numpyro_fed.errors")


def _package_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(numpyro_fed.__path__, "numpyro_fed."))


def test_errors_module_imports_nothing_from_the_package():
    """Any layer may import :mod:`numpyro_fed.errors`: it must import no package module."""
    _errors()
    tree = ast.parse((ROOT / "errors.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and (n.level or
                                                       (n.module or "").startswith("numpyro_fed"))]
    assert not [m for m in imported if m == "numpyro_fed" or m.startswith("numpyro_fed.")
                or m == ""], imported


def test_every_public_exception_and_warning_class_lives_in_errors():
    """A public exception or warning class defined anywhere else in the package is an error
    type users cannot find in one place: each must be defined in ``numpyro_fed/errors.py``
    (and re-exported where it used to live)."""
    _errors()
    elsewhere = []
    for name in _package_modules():
        if name == "numpyro_fed.errors":
            continue
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == name and not attr.startswith("_")):
                elsewhere.append(f"{name}.{attr}")
    assert not elsewhere, (
        f"exception/warning classes defined outside numpyro_fed.errors: {elsewhere}; move "
        "them to numpyro_fed/errors.py and re-export them from their old module")


def test_errors_lists_what_it_defines():
    errors = _errors()
    defined = {n for n, o in vars(errors).items()
               if inspect.isclass(o) and issubclass(o, BaseException) and o.__module__ ==
               "numpyro_fed.errors"}
    assert defined == set(errors.__all__)


@pytest.mark.parametrize("module, name", [
    ("numpyro_fed", "DivergenceError"),
    ("numpyro_fed.kernels", "DivergenceError"),
    ("numpyro_fed.kernels.base", "DivergenceError"),
    ("numpyro_fed", "ConvergenceWarning"),
    ("numpyro_fed", "SingularFitWarning"),
    ("numpyro_fed.saem", "ConvergenceWarning"),
    ("numpyro_fed.saem", "SingularFitWarning"),
    ("numpyro_fed.saem.result", "ConvergenceWarning"),
    ("numpyro_fed.saem.result", "SingularFitWarning"),
    ("numpyro_fed.flower", "DeploymentError"),
    ("numpyro_fed.flower.checks", "DeploymentError"),
    ("numpyro_fed.flower.checks", "ClientMismatchError"),
    ("numpyro_fed.flower.checks", "ParticipationError"),
    ("numpyro_fed.flower", "WireFormatError"),
    ("numpyro_fed.flower.codecs", "WireFormatError"),
])
def test_old_import_paths_give_the_same_classes(module, name):
    """Users' ``from numpyro_fed.kernels.base import DivergenceError`` (and the others) keep
    working and catch what the package raises."""
    assert getattr(importlib.import_module(module), name) is getattr(_errors(), name)


def test_the_kernels_raise_the_errors_module_class():
    errors = _errors()
    from numpyro_fed.kernels.base import DivergenceGuard, raise_if_nonfinite

    with pytest.raises(errors.DivergenceError, match="at 3"):
        raise_if_nonfinite(np.array([1.0, np.nan]), 3, "non-finite at {iteration}")
    guard = DivergenceGuard.create("chain{chain} diverged at {iteration}")
    with pytest.raises(errors.DivergenceError, match="diverged at 2") as info:
        guard.update(np.array([np.inf]), 2).check()
    assert info.value.iteration == 2
    assert issubclass(errors.SingularFitWarning, errors.ConvergenceWarning)


# ------------------------------------------------------------------ minibatch indices
def test_minibatch_module_is_ground_floor_and_old_paths_work():
    from numpyro_fed import minibatch, potential
    from numpyro_fed.algorithms import oracles

    tree = ast.parse((ROOT / "minibatch.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.level or (n.module or "").startswith("numpyro_fed"))]
    assert potential.client_bits is minibatch.client_bits
    assert potential.batch_indices is minibatch.batch_indices
    assert oracles.batch_indices is minibatch.batch_indices


@pytest.mark.parametrize("max_size", [50, 1 << 16])
def test_all_clients_indices_are_each_clients_own(max_size):
    """The kernels' one-call indices of all clients equal what each client draws alone (a
    deployed client), in both regimes (multiply-shift below 2^16 rows, randint above), and
    stay in each client's range."""
    import jax
    import jax.numpy as jnp

    from numpyro_fed.minibatch import batch_indices, clients_batch_indices

    key = jax.random.key(3)
    sizes = jnp.asarray([1, 7, 50, 33], jnp.int32)
    together = np.asarray(clients_batch_indices(key, sizes, 64, max_size))
    assert together.shape == (4, 64)
    for i in range(4):
        alone = np.asarray(batch_indices(key, i, sizes[i], 64, max_size))
        np.testing.assert_array_equal(together[i], alone)
        assert together[i].min() >= 0 and together[i].max() < int(sizes[i])
    assert len(np.unique(together[2])) > 30  # 64 draws of 50 rows: ~36 distinct expected


# ------------------------------------------------------------------ kernels/federated.py
@pytest.mark.parametrize("module", ["numpyro_fed", "numpyro_fed.kernels",
                                    "numpyro_fed.kernels.langevin"])
def test_federated_kernel_old_paths(module):
    from numpyro_fed.kernels import federated

    mod = importlib.import_module(module)
    assert mod.FederatedKernel is federated.FederatedKernel
    assert mod.FedState is federated.FedState


def test_federated_kernel_module_does_not_need_the_langevin_kernels():
    """The base class sits below its subclasses: ``kernels/federated.py`` imports none of
    ``kernels/langevin.py``, ``qlsd.py``, ``elf.py``."""
    tree = ast.parse((ROOT / "kernels" / "federated.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not mods & {"numpyro_fed.kernels.langevin", "numpyro_fed.kernels.qlsd",
                       "numpyro_fed.kernels.elf"}
    from numpyro_fed.kernels.elf import ELF
    from numpyro_fed.kernels.federated import FederatedKernel
    from numpyro_fed.kernels.langevin import FederatedLangevin
    from numpyro_fed.kernels.qlsd import QLSD

    assert all(issubclass(k, FederatedKernel) for k in (ELF, QLSD, FederatedLangevin))


# ------------------------------------------------------------------ module names
def test_no_two_modules_share_a_file_name_runner():
    """One module named ``runner.py`` at most (``flower/runner.py``); CachedMCMC lives in
    ``numpyro_fed/cached_mcmc.py``."""
    runners = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("runner.py"))
    assert len(runners) <= 1, runners
    from numpyro_fed import cached_mcmc

    assert numpyro_fed.CachedMCMC is cached_mcmc.CachedMCMC


# ------------------------------------------------------------------ NumPyro versions
@pytest.mark.parametrize("version, ok", [
    ("0.22.0", True), ("0.22.1", True), ("0.22.2.dev0", True),
    ("0.21.9", False), ("0.23.0", False), ("0.23.0rc1", False), ("1.22.0", False),
    ("0.2", False), ("unknown", False),
])
def test_numpyro_versions_cachedmcmc_was_tested_on(version, ok):
    from numpyro_fed.cached_mcmc import numpyro_supported

    why = numpyro_supported(version)
    assert (why is None) == ok
    if not ok:
        assert f"NumPyro {version} is installed" in why
        assert "pip install 'numpyro>=0.22,<0.23'" in why and "numpyro.infer.MCMC" in why


def test_installed_numpyro_is_a_tested_version():
    """Fails loudly when the environment's NumPyro is not one CachedMCMC was tested on (e.g.
    after an upgrade): rerun tests/test_compilation.py and tests/test_cache_correctness.py
    on it, then widen TESTED_NUMPYRO and the pin in pyproject.toml together."""
    import numpyro

    from numpyro_fed.cached_mcmc import numpyro_supported

    why = numpyro_supported()
    assert why is None, f"NumPyro {numpyro.__version__}: {why}"


def test_pyproject_requires_the_tested_numpyro_range():
    import tomllib

    from numpyro_fed.cached_mcmc import _requirement

    meta = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    reqs = [r.replace(" ", "") for r in meta["project"]["dependencies"]
            if r.replace(" ", "").startswith("numpyro") and not r.startswith("numpyro_")]
    assert reqs == [_requirement()] == ["numpyro>=0.22,<0.23"]


def _ula_draws(mcmc_cls, **kw):
    import jax
    import numpyro
    import numpyro.distributions as dist

    from numpyro_fed import ULA

    def model():
        numpyro.sample("x", dist.Normal(1.0, 2.0).expand([3]).to_event(1))

    m = mcmc_cls(ULA(model, step_size=0.1), num_warmup=5, num_samples=20,
                 progress_bar=False, **kw)
    m.run(jax.random.key(7))
    return np.asarray(m.get_samples()["x"]), m


@pytest.mark.parametrize("version", ["0.23.0", "0.21.0"])
def test_untested_numpyro_warns_and_runs_numpyros_own_loop(monkeypatch, version):
    """With an unknown NumPyro, CachedMCMC says so (version and fix) and gives MCMC's draws
    through NumPyro's own loop, caching no loop of its own."""
    import numpyro
    from numpyro.infer import MCMC

    from numpyro_fed import CachedMCMC, cached_mcmc
    from numpyro_fed.errors import NumPyroVersionWarning

    reference, _ = _ula_draws(MCMC)
    cached_mcmc.clear_cache()
    monkeypatch.setattr(numpyro, "__version__", version)
    with pytest.warns(NumPyroVersionWarning,
                      match=rf"NumPyro {version} is installed.*pip install "
                            r"'numpyro>=0\.22,<0\.23'"):
        draws, m = _ula_draws(CachedMCMC)
    assert not m.cached_loop
    assert cached_mcmc.cached_loops() == 0
    np.testing.assert_array_equal(draws, reference)


def test_numpyro_without_the_private_names_warns(monkeypatch):
    from numpyro_fed import CachedMCMC, cached_mcmc
    from numpyro_fed.errors import NumPyroVersionWarning

    monkeypatch.setattr(cached_mcmc, "_collect_and_postprocess", None)
    with pytest.warns(NumPyroVersionWarning, match="lacks numpyro.infer.mcmc._collect_and"):
        _, m = _ula_draws(CachedMCMC)
    assert not m.cached_loop


def test_tested_numpyro_uses_the_cached_loop():
    import warnings

    from numpyro.infer import MCMC

    from numpyro_fed import CachedMCMC, cached_mcmc

    cached_mcmc.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draws, m = _ula_draws(CachedMCMC)
    assert m.cached_loop and cached_mcmc.cached_loops() == 1
    np.testing.assert_array_equal(draws, _ula_draws(MCMC)[0])
