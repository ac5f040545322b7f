"""Flower deployment: same draws as in process, bits on the wire, faults, participation.

The fast tests drive the real ``ClientApp``/``ServerApp`` code over
:class:`~numpyro_fed.flower.runner.LoopbackGrid` (every message content goes through
Flower's protobuf serialisation).
"""

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from jax import random
from numpyro.infer import MCMC

from models import logistic_regression
from numpyro_fed import DELF, ClientPartition, compressors
from numpyro_fed.flower import FlowerSpec, run_loopback, to_inference_data
from numpyro_fed.flower.apps import _load_state
from numpyro_fed.flower.runner import LoopbackGrid
from numpyro_fed.kernels.qlsd import QLSD

B = 4


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    n, d = 240, 4
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ rng.normal(size=d)))).astype(np.float32)
    part = ClientPartition.iid({"X": X, "y": y}, num_clients=B, key=random.key(1))
    clients = [
        {k: np.asarray(v[i, : part.sizes_np[i]]) for k, v in part.data.items()} for i in range(B)
    ]
    return part, clients


def _inprocess(kernel, steps):
    mcmc = MCMC(kernel, num_warmup=0, num_samples=steps, progress_bar=False)
    mcmc.run(random.key(3), extra_fields=("bits_up", "bits_down"))
    return np.asarray(mcmc.get_samples()["w"]), mcmc.get_extra_fields()


KERNELS = {
    "qlsd++": lambda p, **kw: QLSD(logistic_regression, p, variant="++", step_size=2e-3,
                                   batch_size=10, bits=4, refresh_every=10, **kw),
    "delf": lambda p, **kw: DELF(logistic_regression, p, step_size=2e-3,
                                 uplink=compressors.top_k(2), **kw),
    "qlsd#-p0.5": lambda p, **kw: QLSD(logistic_regression, p, variant="#", step_size=2e-3,
                                       batch_size=10, bits=4, participation=0.5, **kw),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_flower_run_matches_inprocess_kernel(problem, name):
    part, clients = problem
    steps = 150
    kernel = KERNELS[name](part)
    ref, extra = _inprocess(kernel, steps)
    spec = FlowerSpec.from_kernel(kernel, "models:logistic_regression", num_samples=steps, seed=3)
    coord = run_loopback(spec, clients)
    idata = to_inference_data(coord)
    got = idata.posterior["w"].values[0]
    # float32: the clients sum over their N_i rows, the kernel over padded rows, and the
    # server sums the received messages in its own order; measured max difference over 200
    # steps: 8e-7 (QLSD++), 0 (D-ELF). A quantisation level flipped by such a difference
    # would show up as a jump of ~|v|/s, far above this bound.
    assert np.max(np.abs(got - ref)) <= 1e-5 * (1 + np.max(np.abs(ref)))
    # the bits the compressor declared are those the in-process kernel counts
    np.testing.assert_array_equal(idata.sample_stats["bits_up_declared"].values[0],
                                  np.asarray(extra["bits_up"]))
    np.testing.assert_array_equal(idata.sample_stats["bits_down_declared"].values[0],
                                  np.asarray(extra["bits_down"]))


def test_wire_payload_is_the_declared_message(problem):
    """By construction nothing but the compressed message crosses the wire: the payload is
    the declared bits padded to whole bytes (< 8 bits per client and round)."""
    part, clients = problem
    kernel = KERNELS["qlsd++"](part)
    spec = FlowerSpec.from_kernel(kernel, "models:logistic_regression", num_samples=30, seed=3)
    ss = to_inference_data(run_loopback(spec, clients)).sample_stats
    declared = ss["bits_up_declared"].values[0]
    payload = ss["bits_up_payload"].values[0]
    n = ss["num_participants"].values[0]
    assert np.all(payload >= declared) and np.all(payload - declared < 8 * n)
    # the whole message (keys, round, protobuf framing) is what Flower adds on top
    assert np.all(ss["bits_up_wire"].values[0] > payload)
    raw_bits = 32 * sum(v.size for c in clients for v in c.values()) / 30
    assert np.mean(payload) < raw_bits


def test_faults_and_malformed_messages_are_survived_and_rejected(problem, caplog):
    part, clients = problem
    kernel = KERNELS["delf"](part)
    spec = FlowerSpec.from_kernel(kernel, "models:logistic_regression", num_samples=14, seed=3,
                                  round_timeout=1.0)
    plan = {("step-3", 0): "drop", ("step-5", 1): "timeout", ("step-7", 2): "corrupt",
            ("step-9", 3): "oversize", ("step-11", 0): "crash"}
    index = {}

    def faults(node, group):
        return plan.get((group, index.get(node)))

    from numpyro_fed.flower import make_client_app, serve

    app = make_client_app(lambda c: (int(c.node_config["partition-id"]),
                                     clients[int(c.node_config["partition-id"])], {}))
    grid = LoopbackGrid(app, [{"partition-id": i} for i in range(B)], faults=faults)
    index.update({nid: int(ctx.node_config["partition-id"]) for nid, ctx in grid.contexts.items()})
    with caplog.at_level(logging.WARNING, logger="numpyro_fed.flower"):
        coord = serve(grid, spec)
    parts = np.asarray(coord.log.participants)
    for (group, client) in plan:
        assert not parts[int(group.split("-")[1]), client]
    assert parts.sum() == 14 * B - len(plan)
    text = caplog.text
    assert "oversized message" in text and "did not answer in time" in text
    assert "client error" in text and "rejected" in text
    assert len(coord.log.rejected) == 3  # corrupt, oversize, crash (lost ones are absent)
    # error feedback stays consistent: g = sum_i g_i over the clients' committed state
    total = np.zeros_like(coord.server_state["g"])
    for nid, ctx in grid.contexts.items():
        st = _load_state(ctx)
        i = index[nid]
        g_i = st["g"] + (st["pending"] if st["pending_round"] == coord.applied[i] else 0.0)
        total += g_i
    np.testing.assert_allclose(total, coord.server_state["g"], rtol=1e-5, atol=1e-4)
    assert np.all(np.isfinite(coord.draws))


def test_inprocess_participation_records_and_halves_uplink(problem):
    part, _ = problem
    steps = 400
    kernel = KERNELS["qlsd#-p0.5"](part)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=steps, progress_bar=False)
    mcmc.run(random.key(0), extra_fields=("bits_up", "extra.participants"))
    mask = np.asarray(mcmc.get_extra_fields()["extra.participants"])
    assert mask.shape == (steps, B)
    # Bernoulli(0.5) over 1600 client-rounds: sd of the fraction = 0.0125; 4 sd band
    assert abs(mask.mean() - 0.5) < 0.05
    full_kernel = QLSD(logistic_regression, part, variant="#", step_size=2e-3, batch_size=10,
                       bits=4)
    _, extra_full = _inprocess(full_kernel, steps)
    bits_half = np.mean(mcmc.get_extra_fields()["bits_up"])
    assert bits_half < 0.6 * np.mean(np.asarray(extra_full["bits_up"]))


def test_example_smoke(tmp_path):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "flower_qlsd.py"
    spec = importlib.util.spec_from_file_location("flower_qlsd", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / "flower_qlsd.md").exists() and (tmp_path / "flower_qlsd.png").exists()
