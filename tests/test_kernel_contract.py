"""The kernel contract: every public MCMC kernel of numpyro_fed keeps the same promises
inside :class:`numpyro.infer.MCMC` (as NumPyro's ``test/infer/test_mcmc.py`` parametrises its
checks over its kernels).

``KERNELS`` lists every public kernel: each kernel class of ``numpyro_fed`` (ULA, MALA,
FederatedLangevin, QLSD with its three variants, QLSDSharp/QLSDStar/QLSDPlusPlus, ELF,
DELF/PELF/BELF), the ``LSD`` factory and a ``shard_kernel(...)`` kernel. **Adding a kernel
means adding it to ``KERNELS``**: ``test_every_public_kernel_is_listed`` fails when a kernel
class or factory exported by ``numpyro_fed``, ``numpyro_fed.kernels`` or
``numpyro_fed.distributed``, or a variant of ``numpyro_fed.algorithms.variants``, has no case.

The checks, on ``contract_model`` (4 clients x 30 rows, d = 4; a constrained site and two
deterministic sites):

* samples of shape ``(chains, draws, ...)`` for every latent and deterministic site, finite,
  float32, the constrained site inside its support;
* ``chain_method="vectorized"`` draws the chains ``"sequential"`` draws (up to float32
  rounding; the bits exactly);
* the same keys twice give bit-identical draws and bits; a constructor that only fixes
  arguments of another (``TWINS``) draws that kernel's chains bit for bit;
* a step size far too large for the curvature where the chain runs raises
  :class:`numpyro_fed.DivergenceError`, naming the kernel, chain, iteration and step size;
* the ArviZ round trip keeps every site and, for a federated kernel, the per-step bits
  (``bits_up`` / ``bits_down``), which follow the documented formulas;
* a deployable kernel's Flower deployment (loopback) draws the in-process chain; the others
  are refused by ``FlowerSpec.from_kernel`` (or, sharded, deploy as their unsharded kernel).

CI time: each kernel's program is compiled once vectorized (``runs``, cached for the module:
the second run with the same keys, the divergence run and ArviZ reuse it) and, where the
check runs, once sequential. The fast suite runs every check on every kernel except the
vectorized-vs-sequential check of FederatedLangevin, QLSD#, QLSD*, D-ELF, P-ELF and the
sharded kernel (``SEQUENTIAL_SLOW``) and the Flower deployments other than QLSD++ and B-ELF
(``FLOWER_FAST``), which run with ``-m slow``. The module is one ``xdist_group``: its runs
are made once, on one worker.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import arviz as az
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import MCMC
from numpyro.infer.mcmc import MCMCKernel

import numpyro_fed
import numpyro_fed.distributed
import numpyro_fed.kernels
from numpyro_fed import (
    BELF,
    DELF,
    ELF,
    LSD,
    MALA,
    PELF,
    QLSD,
    ULA,
    ClientPartition,
    DivergenceError,
    FederatedKernel,
    FederatedLangevin,
    QLSDPlusPlus,
    QLSDSharp,
    QLSDStar,
    compressors,
    shard_kernel,
    to_inference_data,
)
from numpyro_fed.compressors import ceil_log2

# ----------------------------------------------------------------------------- problems
NUM_CLIENTS, ROWS, P = 4, 30, 3  # clients, rows per client, covariates
DIM = P + 1  # latent dimension of `contract_model`: w (P) and log tau
DENSE = 32 * DIM * NUM_CLIENTS  # bits of one dense float32 vector per client
TOP1 = NUM_CLIENTS * (32 + ceil_log2(DIM))  # one Top-1 message per client (value + index)
WARMUP, SAMPLES, CHAINS = 10, 20, 2
# U's curvature: ~250 along the data (sum_j x_j x_j'), up to ~1300 along log tau at the worst
# uniform initial point (w = 2, tau = e^-2): gamma * curvature <= 0.3 is stable
STEP = 2e-4
#: per-chain keys, given explicitly so that chain 0 of every run is the chain that
#: `MCMC(num_chains=1).run(random.key(SEED))` and a Flower deployment with `seed=SEED` draw
SEED = 3
KEYS = jnp.stack([random.key(SEED), random.key(SEED + 1)])
#: a start where STEP is far too large: at tau = e^-10 the prior's curvature along w is
#: 1 / tau^2 ~ 5e8, so gamma * curvature ~ 1e5 >> 2 and every Langevin kernel overflows within
#: a few steps (unconstrained values: w, log tau)
DIVERGING_INIT = {"w": jnp.ones((CHAINS, P)), "tau": jnp.full((CHAINS,), -10.0)}
#: a Flower deployment imports its model by reference: here this module, under the name
#: pytest imports it with (tests/ is on sys.path, as for `mc_stats`)
FLOWER_MODEL = "test_kernel_contract:contract_model"


def contract_model(X, y=None):
    """Linear regression (unit noise) with a hierarchical prior: a constrained site
    (``tau > 0``), a deterministic site of the latents (``w_norm``) and one of the data rows
    (``fitted``)."""
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, tau).expand([X.shape[-1]]).to_event(1))
    numpyro.deterministic("w_norm", jnp.linalg.norm(w))
    fitted = numpyro.deterministic("fitted", X @ w)
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(fitted, 1.0), obs=y)


def _clients():
    rng = np.random.default_rng(0)
    out = []
    for k in range(NUM_CLIENTS):  # heterogeneous clients: shifted designs
        X = (rng.normal(size=(ROWS, P)) + 0.3 * k).astype(np.float32)
        y = X @ np.array([0.5, -1.0, 0.3]) + rng.normal(size=ROWS)
        out.append({"X": X, "y": y.astype(np.float32)})
    return out


CLIENTS = _clients()
PART = ClientPartition.from_clients(CLIENTS)
POOLED = {k: np.concatenate([c[k] for c in CLIENTS]) for k in ("X", "y")}
LATENT = {"w": (P,), "tau": ()}  # site shapes (without the chain and draw axes)
SITES = {**LATENT, "w_norm": (), "fitted": (NUM_CLIENTS * ROWS,)}


# ----------------------------------------------------------------------------- the list
#: a per-step bit count that depends on the message (quantisation): checked > 0
VARIABLE = "variable"
NOT_FEDERATED = "runs on the pooled data in one process: there is nothing to deploy"


@dataclass(frozen=True)
class Case:
    """One public kernel.

    :param name: test id.
    :param entry: the public class or factory the kernel is built with.
    :param display: the kernel's name in its messages (``DivergenceError``).
    :param make: ``make(step_size) -> kernel`` of ``contract_model`` on ``PART``.
    :param bits: per-step ``(up, down)`` bits of a federated kernel (ints, or ``VARIABLE``);
        ``None`` for a kernel on the pooled data (ULA, MALA).
    :param flower: why the kernel has no Flower deployment; ``None`` when it has one.
    :param diverge: ``() -> (kernel, init_params, step_size)`` of a run that blows up
        (default: this case's kernel, started at ``DIVERGING_INIT``).
    """

    name: str
    entry: Callable
    display: str
    make: Callable[[float], Any]
    bits: tuple | None
    flower: str | None = None
    diverge: Callable | None = None

    @property
    def federated(self) -> bool:
        return self.bits is not None


def _improper(z):
    """U = x^2 / 2 for x <= 3, -inf beyond. MALA rejects non-finite proposals, so on a proper
    model its chain cannot leave the finite numbers; here a proposal beyond 3 is always
    accepted (log ratio +inf) and the chain's energy becomes -inf."""
    x = z["x"]
    return jnp.sum(jnp.where(x > 3.0, -jnp.inf, 0.5 * x**2))


def _mala_diverging():
    kern = MALA(potential_fn=_improper, step_size=10.0, adapt_step_size=False)
    return kern, {"x": jnp.zeros((CHAINS, 1))}, 10.0


M = contract_model
Q4 = compressors.quantize(bits=4)
K1 = compressors.top_k(1)


def qlsd_pp(step_size):
    """The QLSD++ of the QLSD++ case, also sharded by the ``shard_kernel`` case."""
    return QLSD(M, PART, variant="++", step_size=step_size, batch_size=10, bits=4,
                refresh_every=5)


# Every public kernel. A constructor that only fixes arguments of another (QLSDSharp, LSD,
# ELF(variant=...), ...) is built with the same arguments as its twin: the twin's programs
# are then served from JAX's compilation cache (tests/conftest.py), and the two must draw the
# same chains.
KERNELS = [
    Case("ULA", ULA, "ULA", lambda s: ULA(M, step_size=s), None, flower=NOT_FEDERATED),
    Case("MALA", MALA, "MALA", lambda s: MALA(M, step_size=s), None, flower=NOT_FEDERATED,
         diverge=_mala_diverging),
    # minibatch and a randomised compressor: every random number of its step is drawn
    Case("FederatedLangevin", FederatedLangevin, "FederatedLangevin",
         lambda s: FederatedLangevin(M, PART, step_size=s, batch_size=10, compressor=Q4),
         (VARIABLE, DENSE),
         flower="no Flower protocol (its algorithm is deployed as LSD#)"),
    # QLSD# with the identity compressor: the uncompressed bits 32 d b both ways
    Case("QLSD#", QLSD, "QLSD#", lambda s: QLSD(M, PART, variant="#", step_size=s,
                                                batch_size=10), (DENSE, DENSE)),
    Case("QLSDSharp", QLSDSharp, "QLSD#", lambda s: QLSDSharp(M, PART, step_size=s,
                                                              batch_size=10), (DENSE, DENSE)),
    Case("LSD", LSD, "QLSD#", lambda s: LSD(M, PART, variant="#", step_size=s, batch_size=10),
         (DENSE, DENSE)),
    Case("QLSD*", QLSD, "QLSD*", lambda s: QLSD(M, PART, variant="*", step_size=s,
                                                batch_size=10, bits=4), (VARIABLE, DENSE)),
    Case("QLSDStar", QLSDStar, "QLSD*", lambda s: QLSDStar(M, PART, step_size=s, batch_size=10,
                                                           bits=4), (VARIABLE, DENSE)),
    Case("QLSD++", QLSD, "QLSD++", qlsd_pp, (VARIABLE, DENSE)),
    Case("QLSDPlusPlus", QLSDPlusPlus, "QLSD++",
         lambda s: QLSDPlusPlus(M, PART, step_size=s, batch_size=10, bits=4, refresh_every=5),
         (VARIABLE, DENSE)),
    Case("DELF", DELF, "D-ELF", lambda s: DELF(M, PART, step_size=s, uplink=K1), (TOP1, DENSE)),
    Case("PELF", PELF, "P-ELF", lambda s: PELF(M, PART, step_size=s, downlink=K1),
         (DENSE, TOP1)),
    Case("BELF", BELF, "B-ELF", lambda s: BELF(M, PART, step_size=s, uplink=K1, downlink=K1),
         (TOP1, TOP1)),
    Case("ELF", ELF, "B-ELF", lambda s: ELF(M, PART, variant="B", step_size=s, uplink=K1,
                                            downlink=K1), (TOP1, TOP1)),
    Case("shard_kernel", shard_kernel, "QLSD++", lambda s: shard_kernel(qlsd_pp(s)),
         (VARIABLE, DENSE),
         flower="deploys as its unsharded kernel (sharding places arrays on devices)"),
]
BY_NAME = {c.name: c for c in KERNELS}
assert len(BY_NAME) == len(KERNELS), "duplicate case names"
#: the cases built with the same arguments as another case (the same kernel)
TWINS = {"QLSDSharp": "QLSD#", "LSD": "QLSD#", "QLSDStar": "QLSD*", "QLSDPlusPlus": "QLSD++",
         "ELF": "BELF"}
#: kernels whose vectorized-vs-sequential check runs with -m slow only (see that test)
SEQUENTIAL_SLOW = {"FederatedLangevin", "QLSD#", "QLSD*", "DELF", "PELF", "shard_kernel"}
#: the Flower deployments of the fast suite (the others run with -m slow; tests/test_flower.py
#: compares QLSD#/*/++ and D-/P-/B-ELF deployments over more steps)
FLOWER_FAST = {"QLSD++", "BELF"}


def _params(cases, slow=()):
    """``pytest.param`` per case, the names in ``slow`` marked slow. One ``xdist_group`` for
    the module: the runs of a kernel are made once (``runs``), and a twin finds its kernel's
    programs in the compilation cache."""
    marks = [pytest.mark.xdist_group("kernel_contract")]
    return [pytest.param(c, id=c.name, marks=marks + ([pytest.mark.slow] if c.name in slow
                                                      else []))
            for c in cases]


# ----------------------------------------------------------------------------- the list is full
def _public_kernel_entries():
    """Every public kernel class (concrete ``MCMCKernel`` subclasses) and kernel factory
    (functions annotated to return one, and ``shard_kernel``) of the package."""
    kernel_names = {n for n, o in vars(numpyro_fed.kernels).items()
                    if inspect.isclass(o) and issubclass(o, MCMCKernel)}
    out = {}
    for mod in (numpyro_fed, numpyro_fed.kernels, numpyro_fed.distributed):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isclass(obj):
                if issubclass(obj, MCMCKernel) and not inspect.isabstract(obj):
                    out[name] = obj
            elif inspect.isfunction(obj):  # e.g. `def LSD(...) -> QLSD`
                ret = str(inspect.signature(obj).return_annotation)
                if ret in kernel_names or obj is shard_kernel:
                    out[name] = obj
    return out


def test_every_public_kernel_is_listed():
    """A kernel exported by ``numpyro_fed``, ``numpyro_fed.kernels`` or
    ``numpyro_fed.distributed`` that no case of ``KERNELS`` is built with fails here: add it
    to ``KERNELS``."""
    public = _public_kernel_entries()
    listed = {c.entry for c in KERNELS}
    missing = sorted(name for name, obj in public.items() if obj not in listed)
    assert not missing, f"public kernels missing from KERNELS: {missing}"
    # the detection itself finds what we know of (it would otherwise pass vacuously)
    assert {"ULA", "MALA", "QLSD", "QLSDSharp", "ELF", "BELF", "LSD", "shard_kernel"} <= set(
        public)
    assert "FederatedKernel" not in public  # abstract
    # every QLSD / ELF variant of the package's variant table is run
    from numpyro_fed.algorithms.variants import VARIANTS

    displays = {c.display for c in KERNELS}
    for row in VARIANTS:
        assert row.display in displays, f"variant {row.display} has no case in KERNELS"


# ----------------------------------------------------------------------------- the runs
def _run_kwargs(case):
    return {} if case.federated else dict(POOLED)


def _mcmc(case, chain_method):
    mcmc = MCMC(case.make(STEP), num_warmup=WARMUP, num_samples=SAMPLES, num_chains=CHAINS,
                chain_method=chain_method, progress_bar=False)
    with warnings.catch_warnings():
        # QLSD* warns when its theta* search stops short of tolerance: not this contract
        warnings.simplefilter("ignore", UserWarning)
        mcmc.run(KEYS, **_run_kwargs(case))
    return mcmc


def _draws(mcmc):
    """Samples (grouped by chain) and, for a federated kernel, the per-step bits, as numpy."""
    out = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    extra = mcmc.get_extra_fields(group_by_chain=True)
    if "bits" in extra:
        out["bits"] = np.asarray(extra["bits"])  # exact int64 (chain, draw, (up, down))
    return out


@pytest.fixture(scope="module")
def runs():
    """``runs(case)``, made once per case: ``"vectorized"``, the finished ``MCMC`` of a fresh
    kernel with the keys ``KEYS``; ``"draws"`` and ``"again"``, the draws of that run and of a
    second ``run`` with the same keys (same program: no compilation). ``runs(case,
    sequential=True)`` adds ``"sequential"``, the same with ``chain_method="sequential"``."""
    cache = {}

    def get(case, sequential=False):
        if case.name not in cache:
            vec = _mcmc(case, "vectorized")
            out = {"vectorized": vec, "draws": _draws(vec)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                vec.run(KEYS, **_run_kwargs(case))
            out["again"] = _draws(vec)
            cache[case.name] = out
        if sequential and "sequential" not in cache[case.name]:
            cache[case.name]["sequential"] = _mcmc(case, "sequential")
        return cache[case.name]

    return get


# ----------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("case", _params(KERNELS))
def test_sample_shapes_and_support(runs, case):
    """``(chains, draws, *site shape)`` for every latent and deterministic site, finite
    float32 draws, the constrained site inside its support, chains that differ."""
    s = runs(case)["draws"]
    for site, shape in SITES.items():
        assert s[site].shape == (CHAINS, SAMPLES) + shape, (site, s[site].shape)
        assert s[site].dtype == np.float32, site
        assert np.all(np.isfinite(s[site])), site
    assert np.all(s["tau"] > 0)
    np.testing.assert_allclose(s["w_norm"], np.linalg.norm(s["w"], axis=-1), rtol=1e-5)
    np.testing.assert_allclose(s["fitted"], s["w"] @ POOLED["X"].T, rtol=1e-4, atol=1e-5)
    assert not np.array_equal(s["w"][0], s["w"][1])  # per-chain keys


@pytest.mark.parametrize("case", _params([c for c in KERNELS if c.name not in TWINS],
                                         slow=SEQUENTIAL_SLOW))
def test_vectorized_chains_equal_sequential_chains(runs, case):
    """Chain ``c`` of ``chain_method="vectorized"`` is the chain ``"sequential"`` runs with the
    ``c``-th key: same initial point, same random numbers, same bits (exactly).

    A twin (``TWINS``) draws its original's chains (``test_twins_draw_the_same_chains``).
    The sequential run is a compilation of its own, so the fast suite runs this check for one
    kernel of each vectorisation code: ULA and MALA (each vmaps its own state), QLSD++ and
    B-ELF (the federated base class with QLSD's and ELF's per-chain state; their sequential
    runs also serve the Flower check); the others (``SEQUENTIAL_SLOW``) with ``-m slow``
    (the sharded kernel's unbatched path also runs in ``tests/test_sharding.py``)."""
    run = runs(case, sequential=True)
    vec, seq = run["draws"], _draws(run["sequential"])
    assert vec.keys() == seq.keys()
    for k in vec:
        if k == "bits":
            np.testing.assert_array_equal(vec[k], seq[k])
        else:
            # vmap may batch a float32 reduction in another order. Measured: the federated
            # kernels' latent draws are bitwise equal, ULA's and `fitted` = X @ w differ by
            # <= 5e-7; MALA's dual averaging turns such differences into step sizes 1e-5
            # apart (relative), and its draws differ by <= 2e-5 (w), 1e-4 (`fitted`, values
            # up to ~10) after 30 steps. Another key or initial point moves a chain by the
            # posterior spread (~0.1), a flipped accept decision by a step (~0.02).
            np.testing.assert_allclose(vec[k], seq[k], rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.mark.parametrize("case", _params(KERNELS))
def test_same_key_same_draws(runs, case):
    """The same keys twice: bit-identical draws and bits."""
    first, again = runs(case)["draws"], runs(case)["again"]
    assert first.keys() == again.keys()
    for k in first:
        np.testing.assert_array_equal(first[k], again[k], err_msg=k)


@pytest.mark.parametrize("case", _params([BY_NAME[n] for n in TWINS]))
def test_twins_draw_the_same_chains(runs, case):
    """A constructor that only fixes arguments of another builds the same kernel: the same
    draws and bits, bit for bit."""
    a, b = runs(case)["draws"], runs(BY_NAME[TWINS[case.name]])["draws"]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("case", _params(KERNELS))
def test_divergence_raises_divergence_error(runs, case, capfd):
    """A step size far too large for the curvature where the chain runs stops ``MCMC.run``
    with the ``DivergenceError`` itself, naming the kernel, the chain, the iteration and the
    step size (no JAX runtime-error wrapper, no host-callback traceback).

    The vectorized run of ``runs(case)`` is run again from ``DIVERGING_INIT`` (its compiled
    program is reused: no compilation for this check); MALA, which rejects non-finite
    proposals, runs on an improper potential."""
    if case.diverge is not None:
        kern, init, step = case.diverge()
        mcmc = MCMC(kern, num_warmup=0, num_samples=SAMPLES, num_chains=CHAINS,
                    chain_method="vectorized", progress_bar=False)
    else:
        mcmc, init, step = runs(case)["vectorized"], DIVERGING_INIT, STEP
    with pytest.raises(DivergenceError) as err:
        mcmc.run(KEYS, init_params=init, **_run_kwargs(case))
    assert type(err.value) is DivergenceError
    pattern = (rf"{re.escape(case.display)} chain \d became non-finite at iteration \d+ .*"
               rf"step_size={step:.3g}\. Reduce `step_size`")
    assert re.search(pattern, str(err.value)), str(err.value)
    assert err.value.iteration >= 1 and err.value.chain in range(CHAINS)
    assert "io_callback" not in capfd.readouterr().err


@pytest.mark.parametrize("case", _params(KERNELS))
def test_arviz_round_trip(runs, case):
    """The posterior keeps every site and draw; a federated kernel's ``sample_stats`` hold
    ``bits_up`` / ``bits_down``, equal to the per-step bits of the state; ULA and MALA record
    no bits (and ``to_inference_data`` sends them to ``az.from_numpyro``)."""
    mcmc = runs(case)["vectorized"]
    s = _draws(mcmc)
    if case.federated:
        idata = to_inference_data(mcmc, log_likelihood=False)
        stats = idata.sample_stats
        np.testing.assert_array_equal(stats["bits_up"].values, s["bits"][..., 0])
        np.testing.assert_array_equal(stats["bits_down"].values, s["bits"][..., 1])
        assert stats.attrs["num_clients"] == NUM_CLIENTS
    else:
        with pytest.raises(TypeError, match="az.from_numpyro"):
            to_inference_data(mcmc)
        idata = az.from_numpyro(mcmc, log_likelihood=False)
        assert "bits" not in s and not hasattr(mcmc.last_state, "bits_up")
    for site in SITES:
        np.testing.assert_array_equal(idata.posterior[site].values, s[site], err_msg=site)


@pytest.mark.parametrize("case", _params([c for c in KERNELS if c.federated]))
def test_bits_per_step_follow_the_documented_formula(runs, case):
    """Dense float32 messages cost ``32 d b`` bits each way (identity compressor, model
    broadcast), Top-1 ``b (32 + ceil(log2 d))``; a quantised message has a data-dependent
    length, positive and at most its compressor's bound."""
    bits = runs(case)["draws"]["bits"]
    assert bits.shape == (CHAINS, SAMPLES, 2) and bits.dtype == np.int64
    for j, want in enumerate(case.bits):
        got = bits[..., j]
        if want == VARIABLE:
            assert np.all(got > 0) and np.all(got <= NUM_CLIENTS * Q4.max_bits(DIM)), got
        else:
            np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- Flower
DEPLOYABLE = [c for c in KERNELS if c.flower is None and c.name not in TWINS]


@pytest.mark.parametrize("case", _params(DEPLOYABLE, slow=[c.name for c in DEPLOYABLE
                                                           if c.name not in FLOWER_FAST]))
def test_flower_deployment_gives_the_in_process_draws(runs, case):
    """The Flower deployment (real ``ClientApp``/``ServerApp`` over a loopback grid, each
    client holding only its rows) of ``seed=SEED`` draws chain 0 of the in-process run (whose
    key is ``random.key(SEED)``), warmup included, and declares the same bits."""
    pytest.importorskip("flwr")
    from numpyro_fed.flower import FlowerSpec, run_loopback
    from numpyro_fed.flower import to_inference_data as flower_idata

    mcmc = runs(case, sequential=True)["sequential"]
    steps = WARMUP + SAMPLES  # a deployment has no warmup: it runs every step
    spec = FlowerSpec.from_kernel(mcmc.sampler, FLOWER_MODEL, num_samples=steps, seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # QLSD*'s theta* search
        idata = flower_idata(run_loopback(spec, CLIENTS))
    s = _draws(mcmc)
    for site in LATENT:
        ref, got = s[site][0], idata.posterior[site].values[0, WARMUP:]
        # float32: clients sum over their N_i rows, the kernel over padded rows, the server
        # adds the messages in its own order (the bound of tests/test_flower.py, whose
        # measured differences are <= 6e-7 over 1000 steps)
        assert np.max(np.abs(got - ref)) <= 1e-5 * (1 + np.max(np.abs(ref))), site
    stats = idata.sample_stats  # every client takes part in every round: the same bits
    for j, name in enumerate(("bits_up_declared", "bits_down_declared")):
        np.testing.assert_array_equal(stats[name].values[0, WARMUP:], s["bits"][0, :, j])


@pytest.mark.parametrize("case", [
    pytest.param(*p.values, id=p.id, marks=p.marks)
    for p in _params([c for c in KERNELS if c.flower is not None])])
def test_kernels_without_deployment_are_refused_or_deploy_unsharded(case):
    """A kernel without a Flower deployment is refused by ``FlowerSpec.from_kernel`` with a
    ``ValueError`` that names it; a sharded kernel deploys as its unsharded kernel."""
    from numpyro_fed.flower import FlowerSpec

    kern = case.make(STEP)
    if case.entry is shard_kernel:
        assert isinstance(kern, FederatedKernel)
        assert FlowerSpec.from_kernel(kern, FLOWER_MODEL, num_samples=5, seed=0) == \
            FlowerSpec.from_kernel(qlsd_pp(STEP), FLOWER_MODEL, num_samples=5, seed=0)
        return
    with pytest.raises(ValueError, match=type(kern).__name__):
        FlowerSpec.from_kernel(kern, FLOWER_MODEL, num_samples=5, seed=0)
