"""Record the draws, bits and algorithm state of every kernel configuration of the kernel
contract (and a few more paths: participation, memory, exact gradients, ELF's compressed w0)
to an ``.npz``, or compare them with a recorded file, bit for bit.

Run from a checkout's root (the working directory decides which ``numpyro_fed`` is imported):

    python benchmarks/record_draws.py record /tmp/draws_base.npz   # e.g. in the base checkout
    python benchmarks/record_draws.py compare /tmp/draws_base.npz  # after a refactor

Used to check that the refactor of issue 30 (one algorithm value per family) left every
chain bit-identical.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]

import test_kernel_contract as tkc  # noqa: E402
from numpyro.infer import MCMC  # noqa: E402

from numpyro_fed import ELF, QLSD, FederatedLangevin, compressors  # noqa: E402

M, PART, Q4, K1 = tkc.M, tkc.PART, tkc.Q4, tkc.K1
EXTRA = {
    "QLSD#-p0.6-mem": lambda s: QLSD(M, PART, variant="#", step_size=s, batch_size=10, bits=4,
                                     participation=0.6, memory_rate=0.05),
    "QLSD*-exact": lambda s: QLSD(M, PART, variant="*", step_size=s, bits=4),
    "QLSD*-user": lambda s: QLSD(M, PART, variant="*", step_size=s, batch_size=10, bits=4,
                                 theta_star={"w": np.zeros(3), "tau": 1.0}),
    "QLSD++-exact-p0.7": lambda s: QLSD(M, PART, variant="++", step_size=s, bits=4,
                                        participation=0.7),
    "QLSD++-p0.7": lambda s: QLSD(M, PART, variant="++", step_size=s, batch_size=10, bits=4,
                                  refresh_every=3, participation=0.7),
    "DELF-p0.6-batch": lambda s: ELF(M, PART, variant="D", step_size=s, uplink=K1,
                                     participation=0.6, batch_size=10),
    "PELF-p0.6-w0c": lambda s: ELF(M, PART, variant="P", step_size=s, downlink=K1,
                                   participation=0.6, w0="compressed"),
    "BELF-scaled-w0c": lambda s: ELF(M, PART, variant="B", step_size=s,
                                     uplink=compressors.scaled(compressors.rand_k(2)),
                                     downlink=K1, w0="compressed"),
    "FedLangevin-id": lambda s: FederatedLangevin(M, PART, step_size=s),
}
STATE_FIELDS = ("eta_clients", "eta", "zeta", "grad_zeta", "refreshes", "participants",
                "g_local", "g", "w")


def configs():
    out = {c.name: c.make for c in tkc.KERNELS}
    out.update(EXTRA)
    return out


def record_one(name, make):
    out = {}
    for method in ("vectorized", "sequential"):
        if method == "sequential" and name not in ("QLSD++", "BELF", "QLSD*", "PELF"):
            continue
        mcmc = MCMC(make(tkc.STEP), num_warmup=tkc.WARMUP, num_samples=tkc.SAMPLES,
                    num_chains=tkc.CHAINS, chain_method=method, progress_bar=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if name in ("ULA", "MALA"):
                mcmc.run(tkc.KEYS, **tkc.POOLED)
            else:
                mcmc.run(tkc.KEYS, extra_fields=("bits",))
        for k, v in mcmc.get_samples(group_by_chain=True).items():
            out[f"{name}/{method}/z/{k}"] = np.asarray(v)
        ex = mcmc.get_extra_fields(group_by_chain=True)
        if "bits" in ex:
            out[f"{name}/{method}/bits"] = np.asarray(ex["bits"])
        st = mcmc.last_state
        if hasattr(type(st), "total_up"):
            out[f"{name}/{method}/total_up"] = np.asarray(
                tkc.numpyro_fed.kernels.langevin.counter_value(st.total_up))
            out[f"{name}/{method}/total_down"] = np.asarray(
                tkc.numpyro_fed.kernels.langevin.counter_value(st.total_down))
        extra = getattr(st, "extra", None) if name not in ("ULA", "MALA") else None
        for f in STATE_FIELDS:
            if extra is None:
                break
            try:
                v = getattr(extra, f)
            except AttributeError:
                continue
            if isinstance(v, tuple) and not v:
                continue
            v = np.asarray(v)
            if v.size:
                out[f"{name}/{method}/extra/{f}"] = v
    return out


def main(mode, path, only=None):
    import numpyro_fed

    print("numpyro_fed from", numpyro_fed.__file__)
    data = {}
    for name, make in configs().items():
        if only and name not in only:
            continue
        data.update(record_one(name, make))
        print(name, "done", flush=True)
    if mode == "record":
        np.savez(path, **data)
        print(f"recorded {len(data)} arrays to {path}")
        return 0
    ref = dict(np.load(path))
    bad = []
    for k, v in ref.items():
        if only and k.split("/")[0] not in only:
            continue
        if k not in data:
            bad.append(f"missing {k}")
        elif v.shape != data[k].shape or not np.array_equal(v, data[k], equal_nan=True):
            diff = (np.max(np.abs(v.astype(np.float64) - data[k].astype(np.float64)))
                    if v.shape == data[k].shape else "shape")
            bad.append(f"differs {k}: {diff}")
    print(f"compared {len(ref)} arrays: {len(bad)} differ")
    for b in bad:
        print("  ", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], set(sys.argv[3:]) or None))
