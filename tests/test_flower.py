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

from numpyro_fed import DELF, ClientPartition, compressors
from numpyro_fed.bits import counter_value
from numpyro_fed.examples import logistic_regression
from numpyro_fed.flower import FlowerSpec, make_client_app, run_loopback, serve, to_inference_data
from numpyro_fed.flower.apps import _load_state
from numpyro_fed.flower.runner import LoopbackGrid
from numpyro_fed.kernels.elf import BELF, PELF
from numpyro_fed.kernels.qlsd import QLSD

B = 4
#: the Flower model spec (``module:attribute``) of the logistic regression
MODEL = "numpyro_fed.examples:logistic_regression"


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
    return np.asarray(mcmc.get_samples()["w"]), mcmc.get_extra_fields(), mcmc.last_state


KERNELS = {
    "qlsd++": lambda p, **kw: QLSD(logistic_regression, p, variant="++", step_size=2e-3,
                                   batch_size=10, bits=4, refresh_every=10, **kw),
    "delf": lambda p, **kw: DELF(logistic_regression, p, step_size=2e-3,
                                 uplink=compressors.top_k(2), **kw),
    "qlsd#-p0.5": lambda p, **kw: QLSD(logistic_regression, p, variant="#", step_size=2e-3,
                                       batch_size=10, bits=4, participation=0.5, **kw),
    "pelf": lambda p, **kw: PELF(logistic_regression, p, step_size=2e-3,
                                 downlink=compressors.top_k(2), **kw),
    # participation 0.5: absent clients catch up on the compressed model broadcast
    "belf-p0.5": lambda p, **kw: BELF(logistic_regression, p, step_size=2e-3, batch_size=10,
                                      uplink=compressors.top_k(2), downlink=compressors.top_k(1),
                                      w0="compressed", participation=0.5, **kw),
    # theta* found by the federated Barzilai-Borwein search, then g* and QLSD* steps
    "qlsd*": lambda p, **kw: QLSD(logistic_regression, p, variant="*", step_size=2e-3,
                                  batch_size=10, bits=4, **kw),
}
#: steps of the comparison: the issue's first 1000 steps for QLSD++ and D-ELF (~15 s each);
#: the later kernels use fewer to keep the suite fast (the first 60 steps already contain
#: catch-ups of both kinds for B-ELF)
STEPS = {"qlsd++": 1000, "delf": 1000, "pelf": 60, "belf-p0.5": 60, "qlsd*": 60}
#: the fast suite runs QLSD++ and D-ELF for 250 steps (25 QLSD++ refreshes; ~9 s each instead
#: of ~35 s); `make test-slow` runs the 1000 steps of the issue
FAST_STEPS = {"qlsd++": 250, "delf": 250}


@pytest.mark.parametrize("name,long", [
    *((n, False) for n in KERNELS),
    *(pytest.param(n, True, marks=pytest.mark.slow, id=f"{n}-1000") for n in FAST_STEPS),
])
def test_flower_run_matches_inprocess_kernel(problem, name, long):
    part, clients = problem
    steps = STEPS.get(name, 150) if long else FAST_STEPS.get(name, STEPS.get(name, 150))
    kernel = KERNELS[name](part)
    ref, extra, last = _inprocess(kernel, steps)
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=steps, seed=3)
    coord = run_loopback(spec, clients)
    idata = to_inference_data(coord)
    got = idata.posterior["w"].values[0]
    # float32: the clients sum over their N_i rows, the kernel over padded rows, and the
    # server sums the received messages in its own order; measured max difference: 6e-7 over
    # 1000 steps (QLSD++, max |w| 1.8), 0 (D-ELF over 1000 steps; P-ELF, B-ELF with
    # catch-ups, QLSD* incl. its theta* search). A quantisation level or top-k index flipped
    # by such a difference would show up as a jump of ~|v|/s, far above this bound.
    assert np.max(np.abs(got - ref)) <= 1e-5 * (1 + np.max(np.abs(ref)))
    # the bits the compressor declared are those the in-process kernel counts
    ss = idata.sample_stats
    np.testing.assert_array_equal(ss["bits_up_declared"].values[0], np.asarray(extra["bits_up"]))
    down = ss["bits_down_declared"].values[0]
    if spec.algorithm in ("pelf", "belf") and spec.participation < 1:
        # in process, the model update counts as a broadcast to all b clients; the deployment
        # sends it to the asked clients only, each getting the updates of the rounds it missed
        # (same coded lengths as in process) or, when cheaper, the dense w (32 d bits)
        per_client = np.asarray(extra["bits_down"]) // B
        asked = ss["asked"].values[0]
        missed = {(k, i): (kind, m) for k, i, kind, m in coord.log.catchups}
        expect = np.zeros(steps, np.int64)
        for k in range(steps):
            for i in np.flatnonzero(asked[k]):
                kind, m = missed.get((k, i), ("replay", 0))
                expect[k] += 32 * 4 if kind == "dense" else per_client[k - m : k + 1].sum()
        np.testing.assert_array_equal(down, expect)
        assert {kind for _, _, kind, _ in coord.log.catchups} == {"replay", "dense"}
    else:
        np.testing.assert_array_equal(down, np.asarray(extra["bits_down"]))
    # one-off rounds (ELF's initial gradients, QLSD*'s search and g* round) cost the same;
    # in process QLSD also counts the broadcast of theta_0 (b 32 d bits) as one-off, which the
    # deployment sends with the first step instead
    up_once = counter_value(last.total_up) - int(np.sum(extra["bits_up"]))
    down_once = counter_value(last.total_down) - int(np.sum(extra["bits_down"]))
    assert coord.setup_bits["up_declared"] == up_once
    theta0 = B * 32 * 4 if spec.algorithm == "qlsd" else 0
    assert coord.setup_bits["down_declared"] + theta0 == down_once
    if spec.variant == "*":
        # same BB iterations on the same float32 gradient sums (measured: bitwise equal)
        np.testing.assert_allclose(coord.theta_star, kernel.theta_star, rtol=1e-5, atol=1e-6)
        assert coord.theta_star_search.rounds == kernel.theta_star_search.rounds > 1
        assert coord.theta_star_search.converged


def test_wire_payload_is_the_declared_message(problem):
    """By construction nothing but the compressed message crosses the wire: the payload is
    the declared bits padded to whole bytes (< 8 bits per client and round)."""
    part, clients = problem
    kernel = KERNELS["qlsd++"](part)
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=30, seed=3)
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
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=14, seed=3,
                                  round_timeout=1.0)
    plan = {("step-3", 0): "drop", ("step-5", 1): "timeout", ("step-7", 2): "corrupt",
            ("step-9", 3): "oversize", ("step-11", 0): "crash"}
    index = {}

    def faults(node, group):
        return plan.get((group, index.get(node)))

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


def test_belf_catch_up_under_faults_keeps_w_and_g_consistent(problem, caplog):
    """B-ELF with lost, late, crashed and rejected messages: every client's shadow model is
    bitwise the server's w of the round it holds, catch-ups replay the missed compressed
    updates (a client whose reply was lost skips the one it already applied) or send the dense
    w when that is cheaper, and g = sum_i g_i."""
    part, clients = problem
    steps = 16
    kernel = BELF(logistic_regression, part, step_size=2e-3, uplink=compressors.top_k(2),
                  downlink=compressors.top_k(1))  # |Q^P| = 34 bits, dense w: 128 bits
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=steps,
                                  seed=3, round_timeout=1.0)
    plan = {("step-3", 0): "drop", ("step-5", 1): "timeout", ("step-7", 3): "corrupt",
            ("step-9", 3): "oversize", ("step-11", 0): "crash",
            **{(f"step-{k}", 2): "drop" for k in range(8, 12)}}
    index = {}
    app = make_client_app(lambda c: (int(c.node_config["partition-id"]),
                                     clients[int(c.node_config["partition-id"])], {}))
    grid = LoopbackGrid(app, [{"partition-id": i} for i in range(B)],
                        faults=lambda node, group: plan.get((group, index.get(node))))
    index.update({nid: int(ctx.node_config["partition-id"]) for nid, ctx in grid.contexts.items()})
    with caplog.at_level(logging.WARNING, logger="numpyro_fed.flower"):
        coord = serve(grid, spec)
    parts = np.asarray(coord.log.participants)
    assert parts.sum() == steps * B - len(plan)
    assert "oversized message" in caplog.text and len(coord.log.rejected) == 3
    # drop at 3 -> replay of rounds 3-4 at round 4; timeout at 5 (client holds round 5) ->
    # replay of 5-6, round 5 skipped by the client; corrupt at 7 -> replay at 8; 4 rounds
    # dropped -> 5 updates (170 bits) at round 12 cost more than the dense w (128 bits)
    assert {(4, 0, "replay", 1), (6, 1, "replay", 1), (8, 3, "replay", 1),
            (12, 2, "dense", 4)} <= set(coord.log.catchups)
    total = np.zeros_like(coord.server_state["g"])
    for nid, ctx in grid.contexts.items():
        st, i = _load_state(ctx), index[nid]
        assert st["w_round"] >= coord.server_state["known"][i]
        np.testing.assert_array_equal(st["w"], coord.shadow_models[st["w_round"]])
        total += st["g"] + (st["pending"] if st["pending_round"] == coord.applied[i] else 0.0)
    np.testing.assert_array_equal(coord.shadow_models[-1], coord.server_state["w"])
    np.testing.assert_allclose(total, coord.server_state["g"], rtol=1e-5, atol=1e-4)
    assert np.all(np.isfinite(coord.draws))


def test_spec_validation_and_theta_star_given(problem):
    part, clients = problem
    with pytest.raises(ValueError, match="contractive `downlink`"):
        FlowerSpec(algorithm="belf", model="m:f", num_clients=2, step_size=1e-3, num_samples=2,
                   compressor="top_k(k=1)", downlink="quantize(s=4)")
    with pytest.raises(ValueError, match="P-ELF sends dense gradients"):
        FlowerSpec(algorithm="pelf", model="m:f", num_clients=2, step_size=1e-3, num_samples=2,
                   compressor="top_k(k=1)", downlink="top_k(k=1)")
    with pytest.raises(ValueError, match="theta_star_method"):
        FlowerSpec(algorithm="qlsd", variant="*", model="m:f", num_clients=2, step_size=1e-3,
                   num_samples=2, theta_star_method="bfgs")
    # a given (constrained) theta*: unconstrained by the server, one counted g* round
    theta = {"w": np.array([0.3, -0.2, 0.5, 0.1])}
    kernel = QLSD(logistic_regression, part, variant="*", step_size=2e-3, batch_size=10, bits=4,
                  theta_star=theta)
    kernel._prepare_theta_star(random.key(3))
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=3, seed=3)
    coord = run_loopback(FlowerSpec.from_config(spec.to_config()), clients)
    assert coord.theta_star_search.method == "user" and coord.setup_bits["rounds"] == 1
    assert coord.setup_bits["up_declared"] == kernel._star_bits[0] == B * 32 * 4
    np.testing.assert_allclose(coord.theta_star, kernel.theta_star, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(coord.g_star, kernel.g_star, rtol=1e-6, atol=1e-5)


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
    _, extra_full, _ = _inprocess(full_kernel, steps)
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


# --------------------------------------------------------------------------- divergence
@pytest.mark.parametrize("name", ["qlsd#", "delf"])
def test_diverging_deployment_stops_with_the_in_process_error(problem, name):
    """A large step size: the deployment stops with the in-process DivergenceError (same
    kernel name, iteration and step size) instead of rejecting non-finite messages and
    returning draws that grow to 1e38."""
    from numpyro_fed import DivergenceError

    part, clients = problem
    kernel = (QLSD(logistic_regression, part, variant="#", step_size=5.0, batch_size=10, bits=4)
              if name == "qlsd#" else
              DELF(logistic_regression, part, step_size=5.0, uplink=compressors.top_k(2)))
    with pytest.raises(DivergenceError) as inproc:
        _inprocess(kernel, 200)
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=200, seed=3)
    with pytest.raises(DivergenceError) as deployed:
        run_loopback(spec, clients)
    head = str(inproc.value).split(" Reduce")[0]
    assert str(deployed.value).startswith(head), (str(deployed.value), head)
    assert deployed.value.iteration == inproc.value.iteration


def test_a_diverging_server_app_is_raised_by_the_launching_process(problem, tmp_path):
    """Multi-process deployments: the ServerApp writes its DivergenceError next to the
    output file before it propagates, and run_processes raises it again in the launching
    process (tested here without processes: the ServerApp's body over a LoopbackGrid)."""
    from numpyro_fed import DivergenceError
    from numpyro_fed.flower.apps import error_path, make_client_app, serve_and_write
    from numpyro_fed.flower.runner import LoopbackGrid, raise_server_error

    part, clients = problem
    kernel = DELF(logistic_regression, part, step_size=5.0, uplink=compressors.top_k(2))
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=200, seed=3)
    app = make_client_app(lambda ctx: (int(ctx.node_config["partition-id"]),
                                       clients[int(ctx.node_config["partition-id"])], {}))
    grid = LoopbackGrid(app, [{"partition-id": i} for i in range(len(clients))])
    out = tmp_path / "draws.nc"
    with pytest.raises(DivergenceError) as server:
        serve_and_write(grid, spec, out)
    assert not out.exists() and (tmp_path / "draws.nc.error.json").exists()
    assert error_path(out).endswith(".error.json")
    with pytest.raises(DivergenceError, match="step_size") as launcher:
        raise_server_error(out, tmp_path / "logs")
    assert launcher.value.iteration == server.value.iteration
    assert str(launcher.value).startswith(str(server.value).split("\n")[0])
    raise_server_error(tmp_path / "other.nc")  # no error file: nothing to raise


def _spec(**kw):
    base = dict(algorithm="qlsd", model="m:f", num_clients=2, step_size=1e-3, num_samples=2)
    return FlowerSpec(**{**base, **kw})


@pytest.mark.parametrize("kw, exc, arg", [
    ({"step_size": -1e-3}, ValueError, "step_size"),
    ({"step_size": 0.0}, ValueError, "step_size"),
    ({"step_size": float("nan")}, ValueError, "step_size"),
    ({"step_size": "big"}, TypeError, "step_size"),
    ({"batch_size": -5}, ValueError, "batch_size"),
    ({"batch_size": 2.5}, TypeError, "batch_size"),
    ({"num_clients": 0}, ValueError, "num_clients"),
    ({"num_samples": 1.5}, TypeError, "num_samples"),
    ({"memory_rate": 1.5}, ValueError, "memory_rate"),
    ({"refresh_every": 0}, ValueError, "refresh_every"),
    ({"likelihood_weight": -1.0}, ValueError, "likelihood_weight"),
    ({"round_timeout": 0.0}, ValueError, "round_timeout"),
    ({"seed": -1}, ValueError, "seed"),
    ({"theta_star_gtol": 0.0}, ValueError, "theta_star_gtol"),
    ({"compressor": "zip(k=3)"}, ValueError, "compressor"),
    ({"compressor": ""}, TypeError, "compressor"),
    ({"variant": "x"}, ValueError, "variant"),
    ({"algorithm": "sgld"}, ValueError, "algorithm"),
])
def test_spec_rejects_bad_arguments_naming_them(kw, exc, arg):
    with pytest.raises(exc, match=f"`{arg}`"):
        _spec(**kw)


def test_client_with_wrong_data_shape_is_named(problem):
    _, clients = problem
    spec = _spec(model=MODEL, num_clients=B, num_samples=2)
    bad = [dict(c) for c in clients]
    bad[2] = {"X": bad[2]["X"][:, :3], "y": bad[2]["y"]}
    with pytest.raises(ValueError, match=r"client 2's data key 'X' has rows of shape \(3,\)"):
        run_loopback(spec, bad)
    bad = [dict(c) for c in clients]
    bad[1] = {"X": bad[1]["X"]}
    with pytest.raises(ValueError, match=r"client 1's data has keys \['X'\].*missing: \['y'\]"):
        run_loopback(spec, bad)
    bad = [dict(c) for c in clients]
    bad[3] = {"X": bad[3]["X"], "y": bad[3]["y"][:-1]}
    with pytest.raises(ValueError, match="client 3's data keys have different numbers of rows"):
        run_loopback(spec, bad)
    with pytest.raises(ValueError, match="`batch_size`=1000 exceeds the size of client"):
        run_loopback(_spec(model=MODEL, num_clients=B, num_samples=2,
                           batch_size=1000), clients)


# --------------------------------------------------------------------------- wire codecs
@pytest.mark.parametrize("comp", [
    compressors.identity(), compressors.quantize(16), compressors.quantize(bits=1),
    compressors.top_k(3), compressors.rand_k(3), compressors.scaled(compressors.quantize(4)),
    compressors.scaled(compressors.rand_k(2)),
], ids=lambda c: c.name)
def test_codec_is_chosen_by_the_spec_and_reproduces_the_compressor(comp):
    """The codec read from the compressor's spec serialises exactly the declared bits and
    decodes to the in-process compressor's output, bit for bit."""
    from numpyro_fed.flower.codecs import codec_for, wire_codec

    d = 10
    codec = wire_codec(comp, d)
    assert codec.name == comp.name and codec_for(comp.name, d).name == comp.name
    v = random.normal(random.key(4), (d,))
    key = random.key(5)
    payload, n, dec = codec.compress(key, v)
    v_hat, bits = comp(key, v)
    assert n == int(bits) and payload.size == -(-n // 8)
    np.testing.assert_array_equal(dec, np.asarray(v_hat, np.float32))
    dec2, n2 = codec.decode(payload)
    np.testing.assert_array_equal(dec2, dec)
    assert n2 == n


def _bottom_k(k):
    """A custom compressor that keeps the k *smallest* coordinates but is called
    "top_k(k=...)": no spec, so nothing may deploy it as the library's top_k."""
    import jax.numpy as jnp
    from jax import lax

    def fn(key, v):
        _, idx = lax.top_k(-jnp.abs(v), k)
        return jnp.zeros_like(v).at[idx].set(v[idx]), jnp.int32(k * 34)

    return compressors.Compressor(
        name=f"top_k(k={k})", fn=fn, nominal_bits=lambda d: k * 34, omega=None,
        alpha=lambda d: k / d, unbiased=False, randomised=False)


def test_custom_compressor_is_not_deployed_under_a_library_name(problem):
    """Regression: the codec and the FlowerSpec used to read the compressor's *name*, so a
    custom compressor named like a library one was silently replaced by the library's in
    the deployment (different draws than in process). Now only the structured spec counts,
    and a compressor without one is refused with the list of deployable compressors."""
    from numpyro_fed.flower.codecs import wire_codec

    part, _ = problem
    custom = _bottom_k(2)
    assert custom.spec is None
    with pytest.raises(ValueError, match=r"'top_k\(k=2\)'.*no `spec`.*Deployable compressors: "
                                         r"identity\(\), quantize"):
        wire_codec(custom, 4)
    kernel = DELF(logistic_regression, part, step_size=2e-3, uplink=custom)
    with pytest.raises(ValueError, match=r"`compressor`='top_k\(k=2\)' is not a deployable"):
        FlowerSpec.from_kernel(kernel, "m:f", num_samples=2, seed=3)
    with pytest.raises(ValueError, match=r"`downlink`.*no `spec`"):
        _spec(algorithm="pelf", downlink=custom)
    # a library compressor that has no wire format: float_bits other than 32
    with pytest.raises(ValueError, match=r"`float_bits` must be 32, got 16"):
        wire_codec(compressors.top_k(2, float_bits=16), 4)


def test_spec_reads_compressors_and_variants_in_every_accepted_form():
    """FlowerSpec stores the canonical spec text of a compressor given as an object, a spec
    or a string, and the canonical QLSD variant of any spelling the kernels accept."""
    q = compressors.quantize(bits=4)
    for given in (q, q.spec, "quantize(s=16)", "quantize:16", "bits:4", " Quantize(s=16) "):
        assert _spec(compressor=given).compressor == "quantize(s=16)"
    assert _spec(algorithm="delf", compressor=compressors.scaled(compressors.rand_k(2))
                 ).compressor == "scaled(rand_k(k=2))"
    for spelling, canon in (("sharp", "#"), ("QLSD*", "*"), ("plusplus", "++"), ("++", "++")):
        assert _spec(variant=spelling).variant == canon
    with pytest.raises(ValueError, match=r"`variant`='x'.*'#', 'sharp'"):
        _spec(variant="x")
