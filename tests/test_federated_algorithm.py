"""One algorithm value per family, two generic drivers (issue 30).

* a QLSD variant with client state, defined here (outside the package), runs in process
  (``AlgorithmKernel``) and deploys on the loopback Flower grid with no change to the library,
  drawing the same chain;
* no module of ``numpyro_fed/flower`` branches on an algorithm's or a variant's name;
* every algorithm value describes itself: its description builds the same algorithm again.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import MCMC

from numpyro_fed import ClientPartition
from numpyro_fed.algorithms import estimators
from numpyro_fed.algorithms import qlsd as qlsd_alg
from numpyro_fed.algorithms.federated import FederatedAlgorithm, from_description
from numpyro_fed.kernels.driver import AlgorithmKernel

MODEL = "test_federated_algorithm:toy_model"
B, ROWS, D = 3, 20, 3


def toy_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[-1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


# ---------------------------------------------------------------- the toy variant
class DampedState(NamedTuple):
    """Client state of the toy estimator (field names of its own)."""

    anchor: jax.Array
    anchor_grad: jax.Array
    count: jax.Array


def damped_svrg(batch_size: int, refresh_every: int, damping: float = 0.5):
    """A damped SVRG control variate: :math:`H = \\hat g(\\theta) - \\lambda[\\hat g(a) -
    \\nabla U_i(a)]` on one minibatch (unbiased for any :math:`\\lambda`), anchor :math:`a`
    refreshed every ``refresh_every`` rounds."""

    def init(oracle, theta):
        proto = jax.eval_shape(oracle.full_grad, theta)
        return DampedState(theta, jnp.zeros(proto.shape, proto.dtype), jnp.zeros((), jnp.int32))

    def refresh(oracle, point, state):
        return DampedState(point, oracle.full_grad(point), state.count + 1)

    def estimate(oracle, key, theta, state):
        g = oracle.batch_grad(key, theta, batch_size)
        g_anchor = oracle.batch_grad(key, state.anchor, batch_size)
        return g - damping * (g_anchor - state.anchor_grad)

    return estimators.GradientEstimator(init, refresh, estimate, refresh_every=refresh_every)


def toy_qlsd(**options) -> FederatedAlgorithm:
    """The toy variant as an algorithm value; its description points here, so that a deployed
    client builds it again from the options."""
    est = damped_svrg(options["batch_size"], options["refresh_every"])
    return qlsd_alg.algorithm(**options, estimator=est, name="QLSD-damped",
                              factory="test_federated_algorithm:toy_qlsd")


def _clients():
    rng = np.random.default_rng(1)
    out = []
    for k in range(B):
        X = (rng.normal(size=(ROWS, D)) + 0.2 * k).astype(np.float32)
        y = (X @ np.array([0.5, -1.0, 0.3]) + rng.normal(size=ROWS)).astype(np.float32)
        out.append({"X": X, "y": y})
    return out


def test_toy_variant_runs_in_process_and_deploys_unchanged():
    """A variant built outside the package (its own estimator with its own client state,
    memory, a randomised compressor) runs in process and on the loopback Flower grid, and the
    deployment draws the in-process chain (same seed) with the same declared bits."""
    pytest.importorskip("flwr")
    from numpyro_fed.flower import FlowerSpec, run_loopback
    from numpyro_fed.flower import to_inference_data as flower_idata

    clients = _clients()
    part = ClientPartition.from_clients(clients)
    alg = toy_qlsd(variant="#", step_size=2e-3, batch_size=8, compressor="quantize(s=16)",
                   memory_rate=0.1, refresh_every=4, participation=1.0)
    assert alg.refresh_every == 4 and alg.name == "QLSD-damped"
    kernel = AlgorithmKernel(toy_model, part, algorithm=alg)
    steps, seed = 12, 5
    mcmc = MCMC(kernel, num_warmup=0, num_samples=steps, progress_bar=False)
    mcmc.run(random.key(seed), extra_fields=("bits",))
    ref = np.asarray(mcmc.get_samples()["w"])
    count = np.asarray(mcmc.last_state.extra.clients.estimator.count)
    assert count == 3  # refreshed at steps 0, 4, 8: the client state is the toy's
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=steps, seed=seed)
    assert spec.algorithm == "test_federated_algorithm:toy_qlsd" and spec.options
    spec = FlowerSpec.from_config(spec.to_config())  # what the clients receive
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        coord = run_loopback(spec, clients)
    got = flower_idata(coord).posterior["w"].values[0]
    # float32 summation order only (clients sum over their rows, the kernel over padded rows)
    assert np.max(np.abs(got - ref)) <= 1e-5 * (1 + np.max(np.abs(ref)))
    bits = np.asarray(mcmc.get_extra_fields()["bits"])
    np.testing.assert_array_equal(coord.log.bits_up_declared, bits[:, 0])
    np.testing.assert_array_equal(coord.log.bits_down_declared, bits[:, 1])
    # the deployed clients kept the toy's state by its field names
    node = next(iter(coord.transport.grid.contexts.values())) if hasattr(
        coord.transport, "grid") else None
    if node is not None:
        assert "anchor_grad" in " ".join(node.state["numpyro_fed.arrays"].keys())


FLOWER = Path(__file__).resolve().parents[1] / "numpyro_fed" / "flower"
#: an algorithm's or a variant's name compared or looked up in code
NAME_BRANCH = re.compile(
    r"""(==|!=|\bin\b)\s*\(?\s*["'](qlsd|delf|pelf|belf|elf|\#|\*|\+\+|D|P|B)["']"""
    r"""|["'](qlsd|delf|pelf|belf)["']\s*(==|!=|\bin\b)"""
    r"""|\.variant\s*(==|!=)|algorithm\s*(==|!=|in)\s*""")


def test_flower_does_not_branch_on_algorithm_names():
    """The deployment is generic over FederatedAlgorithm: no module of ``flower/`` compares an
    algorithm's or variant's name (a new variant needs no change there)."""
    hits = []
    for path in sorted(FLOWER.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if NAME_BRANCH.search(code):
                hits.append(f"{path.name}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
    # the pattern finds what it is meant to find (it would otherwise pass vacuously)
    assert NAME_BRANCH.search('if spec.algorithm == "qlsd":')
    assert NAME_BRANCH.search('elif alg in ("delf", "belf"):')
    assert NAME_BRANCH.search('if spec.variant == "*":')


@pytest.mark.parametrize("make", [
    lambda: qlsd_alg.algorithm("++", step_size=1e-3, compressor="bits:2", dim=4,
                               batch_size=5, refresh_every=7, participation=0.5),
    lambda: qlsd_alg.algorithm("*", step_size=1e-3, theta_star={"w": [0.0, 1.0]},
                               theta_star_method="adam"),
    lambda: __import__("numpyro_fed.algorithms.elf", fromlist=["x"]).algorithm(
        "B", step_size=1e-3, uplink="top_k:1", downlink="top_k:2", w0="compressed"),
], ids=["qlsd++", "qlsd*", "belf"])
def test_description_builds_the_same_algorithm(make):
    """An algorithm's description (what a deployment sends) builds it again: same name,
    options, compressors and setup rounds."""
    alg = make()
    again = from_description(alg.description)
    assert again.description == alg.description and again.name == alg.name
    assert again.setup == alg.setup and again.search == alg.search
    for a, b in ((alg.uplink, again.uplink), (alg.downlink, again.downlink)):
        assert (a is None) == (b is None) and (a is None or a.name == b.name)


def test_algorithm_constructor_validates_once():
    """The compressor rules live in the algorithm constructor (the kernels and FlowerSpec
    both call it): a biased compressor for QLSD, a non-contractive one for ELF."""
    from numpyro_fed.algorithms import elf

    with pytest.raises(ValueError, match="unbiased compressor"):
        qlsd_alg.algorithm("#", step_size=1e-3, compressor="top_k:1")
    with pytest.raises(ValueError, match="not a contractive.*`downlink`"):
        elf.algorithm("B", step_size=1e-3, uplink="top_k:1", downlink="quantize:4")
    with pytest.raises(ValueError, match="`memory_rate`"):
        qlsd_alg.algorithm("#", step_size=1e-3, memory_rate=1.5)
    with pytest.raises(ValueError, match="`step_size`"):
        elf.algorithm("D", step_size=-1.0)
