"""Clients sharded across devices: same draws as on one device, work really partitioned.

The checks run in a subprocess because ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
must be set before JAX is imported (the test session has already imported it).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# one worker runs the subprocess (a module fixture would run once per xdist worker)
pytestmark = pytest.mark.xdist_group("sharding")

SCRIPT = textwrap.dedent(
    r"""
    import os, json
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax import random
    from numpyro.infer import MCMC
    from numpyro_fed import ClientPartition, DELF, compressors
    from numpyro_fed.kernels.qlsd import QLSD
    from numpyro_fed.distributed import shard_kernel, shard_partition, client_mesh
    from numpyro_fed.examples import logistic_regression

    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    n, d = 400, 5
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ rng.normal(size=d)))).astype(np.float32)
    part = ClientPartition.iid({"X": X, "y": y}, num_clients=8, key=random.key(1))
    out = {}

    def run(kernel, steps=300):
        mcmc = MCMC(kernel, num_warmup=0, num_samples=steps, progress_bar=False)
        mcmc.run(random.key(3), init_params={"w": jnp.zeros(d)},
                 extra_fields=("bits_up", "bits_down"))
        return mcmc

    cases = {
        "qlsd++": lambda p: QLSD(logistic_regression, p, variant="++", step_size=2e-3,
                                  batch_size=10, bits=4, refresh_every=10),
        "delf": lambda p: DELF(logistic_regression, p, step_size=2e-3,
                               uplink=compressors.top_k(2)),
        "qlsd#-p0.5": lambda p: QLSD(logistic_regression, p, variant="#", step_size=2e-3,
                                     batch_size=10, bits=4, participation=0.5),
    }
    for name, make in cases.items():
        single = run(make(part))
        sharded_kernel = shard_kernel(make(part))
        sharded = run(sharded_kernel)
        a = np.asarray(single.get_samples()["w"])
        b = np.asarray(sharded.get_samples()["w"])
        st = sharded.last_state
        leaf = st.extra.eta_clients if name == "qlsd++" else (
            st.extra.g_local if name == "delf" else st.extra.participants)
        out[name] = {
            "max_abs_diff": float(np.max(np.abs(a - b))),
            "scale": float(np.max(np.abs(a))),
            "bits_equal": bool(np.array_equal(single.get_extra_fields()["bits_up"],
                                              sharded.get_extra_fields()["bits_up"])),
            "data_devices": len(st.data.data["X"].sharding.device_set),
            "data_spec": str(st.data.data["X"].sharding.spec),
            "state_devices": len(leaf.sharding.device_set),
            "state_spec": str(leaf.sharding.spec),
        }
        if name == "qlsd++":
            hlo = jax.jit(sharded_kernel.sample).lower(st, (), {}).compile().as_text()
            out["all_reduce_in_hlo"] = "all-reduce" in hlo
    try:
        shard_partition(ClientPartition.iid({"X": X, "y": y}, num_clients=6, key=random.key(1)))
        out["uneven"] = "no error"
    except ValueError as err:
        out["uneven"] = str(err)
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="session")  # kept when xdist interleaves modules
def result():
    env = dict(os.environ)  # the session's XLA_FLAGS and compilation cache (conftest.py)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=170, env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("name", ["qlsd++", "delf", "qlsd#-p0.5"])
def test_sharded_draws_match_single_device(result, name):
    r = result[name]
    # float32: only the order of the reductions over clients differs (8 clients, 2 per
    # device); the chains stay within 1e-4 * (1 + max|w|) over 300 steps.
    assert r["max_abs_diff"] <= 1e-4 * (1.0 + r["scale"]), r
    assert r["bits_equal"], r


@pytest.mark.parametrize("name", ["qlsd++", "delf", "qlsd#-p0.5"])
def test_client_axis_is_partitioned(result, name):
    r = result[name]
    assert r["data_devices"] == 4 and "clients" in r["data_spec"], r
    assert r["state_devices"] == 4 and "clients" in r["state_spec"], r


def test_server_sum_is_a_cross_device_reduction(result):
    assert result["all_reduce_in_hlo"]


def test_uneven_client_count_raises_clear_error(result):
    assert "not a multiple of the 4 devices" in result["uneven"]
    assert "jax.devices()[:k]" in result["uneven"]


def test_parallel_chain_method_is_refused_with_the_supported_methods():
    """The devices hold the clients: mapping chains over them too (chain_method='parallel',
    i.e. pmap) is refused with a message naming the chain methods that work."""
    import jax
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from jax import random

    from numpyro_fed import QLSD, ClientPartition
    from numpyro_fed.distributed import shard_kernel

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    part = ClientPartition.from_clients(
        [{"y": np.full(5, float(i), np.float32)} for i in range(len(jax.devices()) * 2)])
    kern = shard_kernel(QLSD(model, part, step_size=1e-3, bits=4))
    keys = random.split(random.key(0), len(jax.devices()))
    with pytest.raises(ValueError, match=r"chain_method='parallel'.*'vectorized'.*'sequential'"):
        jax.pmap(lambda k: kern.init(k, 0, None, (), {}).z)(keys)
    kern.init(random.key(0), 0, None, (), {})  # outside pmap: fine
