"""Misuses of a Flower deployment that used to degrade it silently (issue 27).

Each case used to return draws (of another target, or of a random walk without data) with
at most a log line, or to name the wrong client / the wrong fault; now it stops with an error
naming the client or the rounds. All run over the in-process
:class:`~numpyro_fed.flower.runner.LoopbackGrid` (real ``ClientApp``/``ServerApp`` code).
"""

import json

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

pytest.importorskip("flwr")

from jax import random
from jax.scipy.stats import norm

from numpyro_fed import ClientPartition
from numpyro_fed.flower import (
    ClientMismatchError,
    ClientWorker,
    DeploymentError,
    FlowerSpec,
    ParticipationError,
    make_client_app,
    run_loopback,
    serve,
)
from numpyro_fed.flower.checks import PROBE_RTOL, probe_difference
from numpyro_fed.flower.runner import LoopbackGrid

B = 4
MODEL = "numpyro_fed.examples:logistic_regression"
#: this module's `glm`, imported by reference (tests/ is on sys.path, see test_kernel_contract)
GLM = "test_misuse_flower:glm"


def glm(X, y=None, link="logit"):
    """A binary GLM whose link is a (non-row) keyword: a client passing `link="probit"` in its
    shared arguments runs another model under the same reference."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[-1]]).to_event(1))
    eta = X @ w
    probs = norm.cdf(eta) if link == "probit" else None
    with numpyro.plate("data", X.shape[0]):
        if probs is None:
            numpyro.sample("y", dist.Bernoulli(logits=eta), obs=y)
        else:
            numpyro.sample("y", dist.Bernoulli(probs=jnp.clip(probs, 1e-6, 1 - 1e-6)), obs=y)


def probit_regression(X, y=None, prior_scale: float = 1.0):
    """The logistic regression's next version, with a probit link."""
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[-1]]).to_event(1))
    p = jnp.clip(norm.cdf(X @ w), 1e-6, 1 - 1e-6)
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(0)
    n, d = 240, 4
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ rng.normal(size=d)))).astype(np.float32)
    part = ClientPartition.iid({"X": X, "y": y}, num_clients=B, key=random.key(1))
    return [{k: np.asarray(v[i, : part.sizes_np[i]]) for k, v in part.data.items()}
            for i in range(B)]


def _spec(**kw):
    base = dict(algorithm="qlsd", model=MODEL, num_clients=B, step_size=2e-3, num_samples=40,
                round_timeout=0.5)
    return FlowerSpec(**{**base, **kw})


def _app(clients, worker=ClientWorker, shared=None):
    """A ClientApp whose client i holds clients[i] and the shared arguments shared[i]."""
    shared = shared or {}

    def load(ctx):
        i = int(ctx.node_config["partition-id"])
        return i, clients[i], shared.get(i, {})

    return make_client_app(load, worker=worker)


def _round(group):
    return int(group.split("-")[1]) if group.startswith("step-") else -1


# ================================================================== participation
@pytest.mark.parametrize("max_empty", [3, 5])
def test_all_clients_stop_answering_stops_naming_the_rounds(clients, max_empty):
    """Every client stops answering at round 9: the run used to return all 40 draws (31 of
    them a random walk without data); now it stops after `max_empty_rounds` empty rounds."""
    # the default (3) is used as is: the spec without the option is the run of the issue
    spec = _spec() if max_empty == 3 else _spec(max_empty_rounds=max_empty)
    rounds = list(range(9, 9 + max_empty))
    listed = ", ".join(map(str, rounds))
    with pytest.raises(ParticipationError,
                       match=rf"rounds {listed} had no participant.*did not answer in time"
                       ) as err:
        run_loopback(spec, clients, faults=lambda node, g: "drop" if _round(g) >= 9 else None)
    assert err.value.rounds == rounds
    assert isinstance(err.value, DeploymentError) and isinstance(err.value, RuntimeError)


def test_rejected_messages_count_as_absent(clients):
    """Clients that answer with corrupted messages only: every message is rejected, so the
    rounds are empty too."""
    with pytest.raises(ParticipationError, match=r"rounds 5, 6, 7 had no participant.*"
                                                 r"rejected"):
        run_loopback(_spec(), clients,
                     faults=lambda node, g: "corrupt" if _round(g) >= 5 else None)


def test_empty_round_check_can_be_switched_off(clients):
    spec = _spec(num_samples=12, max_empty_rounds=0, min_participation=0.0)
    coord = run_loopback(spec, clients, faults=lambda node, g: "drop" if _round(g) >= 9 else None)
    assert np.asarray(coord.log.participants)[9:].sum() == 0


def test_most_clients_gone_stops_on_the_participation_test(clients):
    """3 of 4 clients stop answering at round 10: one client still answers, so no round is
    empty, but a quarter of the requests answered is far below min_participation=0.5."""
    spec = _spec(num_samples=200)
    index = {}
    app = _app(clients)
    grid = LoopbackGrid(app, [{"partition-id": i} for i in range(B)],
                        faults=lambda node, g: "drop" if _round(g) >= 10 and index[node] else None)
    index.update({nid: int(c.node_config["partition-id"]) for nid, c in grid.contexts.items()})
    with pytest.raises(ParticipationError,
                       match=r"participation fell far below the spec's: in rounds 0-\d+, .*"
                             r"min_participation=0.5.*client [123] \(\d+ of \d+ missed\)"
                       ) as err:
        serve(grid, spec)
    # the binomial tail at level 1e-6 / (2 * 200) needs ~80 rounds of a quarter answered
    assert 60 < err.value.rounds[-1] < 200 and err.value.rounds[0] == 0


@pytest.mark.parametrize("p, loss", [(0.25, 0.0), (0.5, 0.1), (1.0, 0.3)])
def test_random_partial_participation_and_faults_do_not_stop_the_run(clients, p, loss):
    """Random Bernoulli participation and messages lost at random: the run goes on.
    p = 0.25 with 4 clients has rounds in which nobody is asked (32%, several in a row):
    they are the design, as in process, and are not counted as empty. With random losses,
    a round whose asked clients all fail has probability ~0.031 (p = 0.5, 10% lost: mostly
    rounds asking one client) or 0.3^4 = 0.008 (p = 1, 30% lost); 4 such rounds in a row
    somewhere in 150 rounds: < 1e-4. The share of answered requests (0.9, 0.7) is above
    min_participation = 0.5, whose test has a false-alarm probability below 1e-6."""
    rng = np.random.default_rng(5)
    lost = {}

    def faults(node, group):
        if not group.startswith("step-"):
            return None
        if group not in lost:
            lost[group] = {}
        return lost[group].setdefault(node, "drop" if rng.uniform() < loss else None)

    if p == 0.25:
        with pytest.warns(UserWarning, match="no client with probability"):
            spec = _spec(num_samples=150, participation=p, max_empty_rounds=4)
    else:
        spec = _spec(num_samples=150, participation=p, max_empty_rounds=4)
    coord = run_loopback(spec, clients, faults=faults)
    asked = np.asarray(coord.log.asked)
    present = np.asarray(coord.log.participants)
    assert coord.draws.shape == (150, 2 * 2)
    # binomial sd of the answered share over ~600 (p=1) / ~300 (p=0.5) requests: < 0.02
    assert abs(present.sum() / asked.sum() - (1 - loss)) < 0.08
    if p == 0.25:  # the design's empty rounds, 3 in a row somewhere, did not stop it
        empty = ~asked.any(1)
        assert any(empty[k:k + 3].all() for k in range(len(empty) - 2))


def test_participation_errors_reach_the_launching_process(clients, tmp_path):
    """run_processes raises the ServerApp's ParticipationError (written next to the output
    file), as it does for a DivergenceError."""
    from numpyro_fed.flower.apps import serve_and_write
    from numpyro_fed.flower.runner import raise_server_error

    grid = LoopbackGrid(_app(clients), [{"partition-id": i} for i in range(B)],
                        faults=lambda node, g: "drop" if _round(g) >= 2 else None)
    out = tmp_path / "draws.nc"
    with pytest.raises(ParticipationError):
        serve_and_write(grid, _spec(), out)
    assert not out.exists()
    with pytest.raises(ParticipationError, match="rounds 2, 3, 4 had no participant") as err:
        raise_server_error(out, tmp_path / "logs")
    assert err.value.rounds == [2, 3, 4]


@pytest.mark.parametrize("kw, exc, arg", [
    ({"max_empty_rounds": -1}, ValueError, "max_empty_rounds"),
    ({"max_empty_rounds": 1.5}, TypeError, "max_empty_rounds"),
    ({"min_participation": 1.5}, ValueError, "min_participation"),
    ({"min_participation": "half"}, TypeError, "min_participation"),
])
def test_participation_options_are_checked(kw, exc, arg):
    with pytest.raises(exc, match=f"`{arg}`"):
        _spec(**kw)


# ============================================================ model and settings mismatch
class _ProbitClient(ClientWorker):
    """Client 2 imports another version of the model's module (probit instead of logit)."""

    def load_model(self, spec):
        return probit_regression if self.index == 2 else super().load_model(spec)


def _own_settings(**override):
    """A client 1 that runs with its own settings, written over those it received."""

    class OwnSettings(ClientWorker):
        def handle(self, cmd, arrays, state):
            if self.index == 1 and "spec" in cmd:
                cmd = {**cmd, "spec": json.dumps({**json.loads(cmd["spec"]), **override})}
            return super().handle(cmd, arrays, state)

    return OwnSettings


class _OwnWeightInCode(ClientWorker):
    """Client 3's code applies its own likelihood weight (a modified numpyro_fed)."""

    def make_problem(self, spec, prior_weight, max_size):
        if self.index == 3:
            from dataclasses import replace

            spec = replace(spec, likelihood_weight=0.5)
        return super().make_problem(spec, prior_weight, max_size)


class _OldClient(ClientWorker):
    """A client of an older numpyro_fed: no fingerprint in its hello reply."""

    def fingerprint(self, spec_json):
        return {} if self.index == 0 else super().fingerprint(spec_json)


@pytest.mark.parametrize("model, worker, shared, match, refused", [
    (MODEL, _ProbitClient, None,
     r"refused client 2 \(node \d+\): its log-likelihood differs from the server's model", [2]),
    (GLM, ClientWorker, {2: {"link": "probit"}},
     r"refused client 2 \(node \d+\): its log-likelihood differs", [2]),
    (MODEL, _own_settings(likelihood_weight=0.5), None,
     r"refused client 1 \(node \d+\): it runs with other settings than the spec: "
     r"likelihood_weight=0.5 \(server: 1.0\)", [1]),
    (MODEL, _own_settings(compressor="quantize(s=4)", variant="++"), None,
     r"refused client 1 .*other settings than the spec: compressor='quantize\(s=4\)' "
     r"\(server: 'quantize\(s=16\)'\), variant='\+\+' \(server: '#'\)", [1]),
    (MODEL, _own_settings(prior="size"), None,
     r"refused client 1 .*prior='size' \(server: 'split'\)", [1]),
    (MODEL, _OwnWeightInCode, None,
     r"refused client 3 \(node \d+\): its likelihood is 0.5 times the server's on the probe: "
     r"it runs with a likelihood weight \(temperature\) of 0.5", [3]),
    (MODEL, ClientWorker, {0: {"prior_scale": 3.0}, 2: {"prior_scale": 3.0}},
     r"refused client 0 .*its prior .*differs.*client 2 .*its prior", [0, 2]),
    (MODEL, _OldClient, None, r"refused client 0 .*sent no fingerprint", [0]),
], ids=["probit-module", "probit-shared-kwarg", "weight-in-spec", "compressor-variant",
        "prior-mode", "weight-in-code",
        "prior-kwarg", "old-client"])
def test_a_client_running_another_model_or_settings_is_refused(clients, model, worker, shared,
                                                                match, refused):
    spec = _spec(model=model, num_samples=3, compressor="quantize(s=16)")
    with pytest.raises(ClientMismatchError, match=match) as err:
        run_loopback(spec, clients, client_app=_app(clients, worker, shared))
    assert err.value.clients == refused


def test_same_model_and_settings_are_accepted(clients):
    """The check refuses nothing when the clients run the server's model: with shared
    arguments equal to the model's defaults, and with another likelihood weight set in the
    spec (the same for everyone)."""
    spec = _spec(model=GLM, num_samples=3, likelihood_weight=0.5)
    coord = run_loopback(spec, clients,
                         client_app=_app(clients, shared={1: {"link": "logit"}}))
    assert coord.draws.shape == (3, 4)


def test_probe_comparison_tolerates_float_noise_and_names_a_scaled_likelihood():
    """Benign float32 differences (another summation order or machine: ~1e-6 relative) pass;
    a likelihood scaled by c is reported as a likelihood weight c * tau; another likelihood
    or prior as such."""
    rng = np.random.default_rng(0)
    d = 5
    ref = rng.normal(size=2 * d + 2) * 10
    noisy = ref * (1 + 1e-6 * rng.normal(size=ref.size))
    assert probe_difference(ref, noisy, 1.0) is None
    assert probe_difference(ref, ref * (1 + 10 * PROBE_RTOL), 1.0) is not None
    scaled = ref.copy()
    scaled[: d + 1] *= 0.25
    assert "likelihood weight (temperature) of 0.5 instead of the spec's likelihood_weight=2" \
        in probe_difference(ref, scaled, 2.0)
    other = ref.copy()
    other[d + 1:] += 1.0
    assert probe_difference(ref, other, 1.0).startswith("its prior")
    assert "parameters" in probe_difference(ref, ref[:-2], 1.0)


# ============================================================================= data faults
@pytest.mark.parametrize("client, key, row, value", [
    (2, "X", 3, np.nan), (1, "y", 0, np.inf), (3, "X", 7, -np.inf),
])
def test_non_finite_data_names_the_client_and_its_row(clients, client, key, row, value):
    """A NaN in client 2's row 3 used to be reported as "client 0, row 3" (the one-client
    partition a client builds); now the client's partition id and its own row."""
    bad = [dict(c) for c in clients]
    a = bad[client][key].copy()
    if a.ndim == 2:
        a[row, 1] = value
    else:
        a[row] = value
    bad[client][key] = a
    shown = {np.nan: "nan", np.inf: "inf", -np.inf: "-inf"}[value]
    with pytest.raises(ValueError, match=rf"client {client}'s data key '{key}' has a non-finite "
                                         rf"value \({shown}\) at its row {row}; .*on client "
                                         rf"{client}"):
        run_loopback(_spec(num_samples=2), bad)


@pytest.mark.parametrize("ids, match", [
    ((0, 1, 3, 3), r"duplicate partition id 3 \(nodes \d+ and \d+\).*partition ids \[2\] have "
                   r"no client"),
    ((2, 1, 2, 0), r"duplicate partition id 2 \(nodes \d+ and \d+\).*partition ids \[3\]"),
    ((0, 1, 2, 7), r"clients \[3\] did not answer the hello round \(node \d+ announced "
                   r"partition id 7, outside 0..3\)"),
])
def test_duplicate_or_invalid_partition_ids_are_named(clients, ids, match):
    """Two SuperNodes started with the same partition id used to be reported as "clients [2]
    did not answer the hello round"; now the duplicate id and its nodes are named."""
    data = {i: clients[i % B] for i in ids}
    app = make_client_app(lambda c: (int(c.node_config["partition-id"]),
                                     data[int(c.node_config["partition-id"])], {}))
    grid = LoopbackGrid(app, [{"partition-id": i} for i in ids])
    with pytest.raises(DeploymentError, match=match):
        serve(grid, _spec(num_samples=2))
