"""A true multi-process Flower deployment on loopback, over TLS with SuperNode authentication.

``run_processes`` starts a ``flower-superlink`` (TLS with a throwaway CA,
``--enable-supernode-auth``, no runtime dependency installation), registers each client's
public key with ``flwr supernode register``, starts one ``flower-supernode`` per client (its
own ``.npz`` only), submits the app with ``flwr run`` and reads the draws back. Everything
listens on 127.0.0.1; telemetry is off. Flower's round latency (one ClientApp process per
message, 3 s SuperNode polling) makes a step cost seconds, so the run is a few steps: the
long comparisons run in process over ``LoopbackGrid`` (tests/test_flower.py).
"""

import numpy as np
import pytest

pytest.importorskip("flwr")

from numpyro_fed.flower.runner import flower_executables  # noqa: E402

if flower_executables() is None:
    pytest.skip("Flower's executables (flower-superlink, flower-supernode, flwr, ...) are not "
                "installed", allow_module_level=True)

from jax import random  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

from numpyro_fed import ClientPartition  # noqa: E402
from numpyro_fed.examples import logistic_regression  # noqa: E402
from numpyro_fed.flower import FlowerSpec  # noqa: E402
from numpyro_fed.flower.runner import run_processes  # noqa: E402
from numpyro_fed.kernels.qlsd import QLSD  # noqa: E402

MODEL = "numpyro_fed.examples:logistic_regression"  # the Flower model spec (``module:attribute``)

B, STEPS = 2, 3


# slow (58 s on the CI machine, real Flower processes over TLS): `make test-slow`; the protocol
# itself is checked bit for bit in process over LoopbackGrid (tests/test_flower.py)
@pytest.mark.slow
def test_processes_tls_auth_match_inprocess_qlsdpp(tmp_path):
    rng = np.random.default_rng(0)
    n, d = 120, 4
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ rng.normal(size=d)))).astype(np.float32)
    part = ClientPartition.iid({"X": X, "y": y}, num_clients=B, key=random.key(1))
    clients = [{k: np.asarray(v[i, : part.sizes_np[i]]) for k, v in part.data.items()}
               for i in range(B)]
    # refresh every 2 steps: steps 0 and 2 refresh the control point, step 1 uses it
    kernel = QLSD(logistic_regression, part, variant="++", step_size=2e-3, batch_size=10,
                  bits=4, refresh_every=2)
    mcmc = MCMC(kernel, num_warmup=0, num_samples=STEPS, progress_bar=False)
    mcmc.run(random.key(3), extra_fields=("bits_up", "bits_down"))
    ref = np.asarray(mcmc.get_samples()["w"])
    # a lost round would change the draws (the run goes on without it): on a loaded machine
    # the first round (JAX compiling in each ClientApp process) may exceed the default 60 s
    spec = FlowerSpec.from_kernel(kernel, MODEL, num_samples=STEPS,
                                  seed=3, round_timeout=300.0)
    stopped = []
    idata = run_processes(spec, clients, tmp_path, tls=True, node_auth=True, timeout=400,
                          on_stopped=stopped.append)
    # every process (SuperLink, SuperNodes, their SuperExec/ServerApp/ClientApp children,
    # the warm launcher) has ended
    assert stopped == [[]]
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")}
    assert "running on https://127.0.0.1:" in logs["superlink.log"]
    assert logs["superlink.log"].count("[ControlServicer.RegisterNode] Created node_id") == B
    # each SuperNode read only its own rows
    for i in range(B):
        with np.load(tmp_path / "data" / f"client_{i}.npz") as f:
            np.testing.assert_array_equal(f["X"], clients[i]["X"])
    got = idata.posterior["w"].values[0]
    # same tolerance as tests/test_flower.py (float32 summation order; measured here: 0)
    assert np.max(np.abs(got - ref)) <= 1e-5 * (1 + np.max(np.abs(ref)))
    ss = idata.sample_stats
    np.testing.assert_array_equal(ss["bits_up_declared"].values[0],
                                  np.asarray(mcmc.get_extra_fields()["bits_up"]))
    np.testing.assert_array_equal(ss["bits_down_declared"].values[0],
                                  np.asarray(mcmc.get_extra_fields()["bits_down"]))
    # the serialised payload is the declared message padded to whole bytes per client
    declared, payload = ss["bits_up_declared"].values[0], ss["bits_up_payload"].values[0]
    assert np.all(payload >= declared) and np.all(payload - declared < 8 * B)
    assert ss["num_participants"].values[0].tolist() == [B] * STEPS
