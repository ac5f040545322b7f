"""The misuse suite: every public kernel and entry point, given bad input, raises an exception
of the documented type whose message names the argument at fault.

The cases are tables, so that adding a kernel (``KERNELS``) or an entry point runs it through
every misuse that applies. The checks of the model itself (data-dependent priors, discrete
latents, factorisation, control flow on data, missing observations) are in
``tests/test_model_checks.py``; the divergence mechanism in ``tests/test_divergence.py``, and
that every public kernel (``shard_kernel`` included) raises ``DivergenceError`` instead of
returning non-finite draws in ``tests/test_kernel_contract.py``.
"""

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import MCMC

from numpyro_fed import (
    BELF,
    DELF,
    ELF,
    LSD,
    PELF,
    QLSD,
    SAEM,
    ULA,
    ClientPartition,
    FederatedLangevin,
    FederatedPotential,
    QLSDPlusPlus,
    QLSDSharp,
    QLSDStar,
    compressors,
    shard_kernel,
)

pytestmark = pytest.mark.xdist_group("misuse")


def gauss_model(y):
    theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta, sigma).to_event(1), obs=y)


def _clients():
    rng = np.random.default_rng(0)
    return [{"y": (rng.normal(size=(n, 2)) + 0.1 * k).astype(np.float32)}
            for k, n in enumerate((12, 20, 30, 40))]


PART = ClientPartition.from_clients(_clients())
POT = FederatedPotential(gauss_model, PART)
STAR = {"theta": np.zeros(2, np.float32), "sigma": np.float32(1.0)}
TOP1 = compressors.top_k(1)

# every public federated kernel: name -> (constructor, kwargs that make it valid)
KERNELS = {
    "FederatedLangevin": (FederatedLangevin, {}),
    "LSD": (LSD, {}),
    "QLSD": (QLSD, {"bits": 4}),
    "QLSDSharp": (QLSDSharp, {"bits": 4}),
    "QLSDStar": (QLSDStar, {"bits": 4, "theta_star": STAR}),
    "QLSDPlusPlus": (QLSDPlusPlus, {"bits": 4}),
    "ELF": (ELF, {"variant": "B", "uplink": TOP1, "downlink": TOP1}),
    "DELF": (DELF, {"uplink": TOP1}),
    "PELF": (PELF, {"downlink": TOP1}),
    "BELF": (BELF, {"uplink": TOP1, "downlink": TOP1}),
}
PARTICIPATION = {"QLSD", "QLSDSharp", "QLSDStar", "QLSDPlusPlus", "ELF", "DELF", "PELF", "BELF"}


def build(name, **overrides):
    cls, base = KERNELS[name]
    kw = {"step_size": 1e-3, "potential": POT, **base, **overrides}
    return cls(gauss_model, PART, **kw)


# (bad keyword arguments, exception type, text the message must contain)
COMMON = [
    ({"step_size": 0.0}, ValueError, "step_size"),
    ({"step_size": -1e-3}, ValueError, "step_size"),
    ({"step_size": float("nan")}, ValueError, "step_size"),
    ({"step_size": float("inf")}, ValueError, "step_size"),
    ({"step_size": "big"}, TypeError, "step_size"),
    ({"step_size": True}, TypeError, "step_size"),  # not silently 1.0
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": -3}, ValueError, "batch_size"),
    ({"batch_size": 13}, ValueError, "batch_size"),  # the smallest client holds 12 rows
    ({"batch_size": 2.5}, TypeError, "batch_size"),
    ({"batch_size": True}, TypeError, "batch_size"),
]


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("bad, exc, text", COMMON, ids=lambda v: repr(v)[:30])
def test_every_kernel_names_a_bad_argument(name, bad, exc, text):
    with pytest.raises(exc, match=text):
        build(name, **bad)


@pytest.mark.parametrize("name", sorted(PARTICIPATION))
@pytest.mark.parametrize("p", [0.0, -0.5, 1.5, float("nan")])
def test_every_kernel_names_a_bad_participation(name, p):
    with pytest.raises(ValueError, match="participation"):
        build(name, participation=p)


@pytest.mark.parametrize("name", sorted(PARTICIPATION))
def test_every_kernel_refuses_a_bool_participation(name):
    with pytest.raises(TypeError, match="`participation` must be a number"):
        build(name, participation=True)  # not silently p = 1.0


SPECIFIC = [
    ("QLSD", {"variant": "#!"}, ValueError, "variant"),
    ("QLSDSharp", {"variant": "*"}, ValueError, "variant"),
    ("QLSD", {"bits": -1}, ValueError, "bits"),  # bits=0 is valid: s = 2**0 = 1 level
    ("QLSD", {"bits": 4, "levels": 3}, ValueError, "at most one"),
    ("QLSD", {"compressor": "no-such-compressor", "bits": None}, ValueError, "compressor"),
    ("QLSD", {"variant": "++", "refresh_every": 0}, ValueError, "refresh_every"),
    ("QLSD", {"memory_rate": -0.1}, ValueError, "memory_rate"),
    ("QLSDStar", {"theta_star": {"theta": np.zeros(2)}}, ValueError, "sigma"),
    ("QLSDStar", {"theta_star": {**STAR, "beta": 0.0}}, ValueError, "beta"),
    ("QLSDStar", {"theta_star": {**STAR, "theta": np.zeros(3)}}, ValueError, "theta"),
    ("QLSDStar", {"theta_star": {**STAR, "sigma": -1.0}}, ValueError, "sigma"),
    ("QLSDStar", {"theta_star": {**STAR, "sigma": np.nan}}, ValueError, "sigma"),
    ("LSD", {"bits": 4}, ValueError, "bits"),
    ("ELF", {"variant": "Z"}, ValueError, "variant"),
    ("DELF", {"variant": "B"}, ValueError, "variant"),
    ("DELF", {"uplink": "no-such-compressor"}, ValueError, "no-such-compressor"),
    ("BELF", {"w0": "nowhere"}, ValueError, "w0"),
]


@pytest.mark.parametrize("name, bad, exc, text", SPECIFIC,
                         ids=[f"{c[0]}-{next(iter(c[1]))}" for c in SPECIFIC])
def test_kernel_specific_arguments_are_named(name, bad, exc, text):
    with pytest.raises(exc, match=text):
        build(name, **bad)


@pytest.mark.parametrize("make, exc, text", [
    (lambda: compressors.quantize(bits=-1), ValueError, "bits"),
    (lambda: compressors.quantize(levels=0), ValueError, "levels"),
    (lambda: compressors.quantize(bits=2.5), TypeError, "bits"),
    (lambda: compressors.top_k(0), ValueError, "k"),
    (lambda: compressors.top_k(-1), ValueError, "k"),
    (lambda: compressors.rand_k(0), ValueError, "k"),
    (lambda: compressors.identity(float_bits=0), ValueError, "float_bits"),
], ids=["quantize-bits-neg", "quantize-levels0", "quantize-bits-float", "top_k-0", "top_k-neg",
        "rand_k-0", "identity-float_bits"])
def test_compressor_parameters_are_named(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


def test_top_k_larger_than_the_dimension_is_named():
    with pytest.raises(ValueError, match="k"):
        build("DELF", uplink=compressors.top_k(4), potential=None)  # d = 3


def test_potential_arguments_are_named():
    with pytest.raises(TypeError, match="partition"):
        FederatedPotential(gauss_model, {"y": np.zeros((4, 2))})
    with pytest.raises(ValueError, match="likelihood_weight"):
        FederatedPotential(gauss_model, PART, likelihood_weight=[1.0, 1.0])
    with pytest.raises(ValueError, match="likelihood_weight"):
        FederatedPotential(gauss_model, PART, likelihood_weight=-1.0)
    with pytest.raises(ValueError, match="prior"):
        FederatedPotential(gauss_model, PART, prior="everywhere")
    with pytest.raises(ValueError, match="prior"):
        FederatedPotential(gauss_model, PART, prior=[0.5, 0.5])


@pytest.mark.parametrize("make, exc, text", [
    (lambda: ClientPartition.from_clients([]), ValueError, "clients"),
    (lambda: ClientPartition.from_clients([{"y": np.zeros((3, 2))}, {"y": np.zeros((0, 2))}]),
     ValueError, "client"),
    (lambda: ClientPartition.from_clients([{"y": np.zeros((3, 2))}, {"x": np.zeros((3, 2))}]),
     ValueError, "y"),
    (lambda: ClientPartition.from_clients([{"x": np.zeros((3, 2)), "y": np.zeros(2)}]),
     ValueError, "y"),
    (lambda: ClientPartition.from_clients([{"y": np.zeros((3, 2))}, {"y": np.zeros((3, 5))}]),
     ValueError, "y"),
    (lambda: ClientPartition.from_clients([{"y": np.array([[0.0, np.nan], [1.0, 2.0]])}]),
     ValueError, "y"),
    (lambda: ClientPartition.iid({"y": np.zeros((10, 2))}, num_clients=11, key=random.key(0)),
     ValueError, "num_clients"),
    (lambda: ClientPartition.iid({"y": np.zeros((10, 2))}, num_clients=0, key=random.key(0)),
     ValueError, "num_clients"),
    (lambda: ClientPartition.iid({"x": np.zeros((10, 2)), "y": np.zeros(9)}, num_clients=2,
                                 key=random.key(0)), ValueError, "rows"),
    (lambda: ClientPartition.dirichlet({"y": np.zeros(10)}, 2, labels=np.zeros(9),
                                       concentration=1.0, key=random.key(0)),
     ValueError, "labels"),
    (lambda: ClientPartition.dirichlet({"y": np.zeros(10)}, 2, labels=np.zeros(10),
                                       concentration=-1.0, key=random.key(0)),
     ValueError, "concentration"),
], ids=["no-clients", "empty-client", "key-mismatch", "row-mismatch", "shape-mismatch",
        "nan", "too-many-clients", "zero-clients", "unequal-rows", "labels-length",
        "concentration"])
def test_partition_misuse_is_named(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


@pytest.mark.parametrize("make, exc, text", [
    (lambda: SAEM(gauss_model, kernel="no-such-kernel"), ValueError, "kernel"),
    (lambda: SAEM(gauss_model, step_size=-1.0), ValueError, "step_size"),
    (lambda: SAEM(gauss_model, num_mcmc_steps=0), ValueError, "num_mcmc_steps"),
    (lambda: SAEM(gauss_model, num_chains=0), ValueError, "num_chains"),
    (lambda: SAEM(gauss_model, mstep="nope"), ValueError, "mstep"),
], ids=["kernel", "step_size", "num_mcmc_steps", "num_chains", "mstep"])
def test_saem_arguments_are_named(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


def test_run_level_misuse_is_named():
    kern = build("QLSD")
    mcmc = MCMC(kern, num_warmup=0, num_samples=2, progress_bar=False)
    with pytest.raises(TypeError, match=r"random\.key"):
        mcmc.run(0)
    with pytest.raises(TypeError, match="kernel"):
        shard_kernel(ULA(gauss_model, step_size=1e-3))
