"""Flower deployment of QLSD++ and D-ELF, and the effect of partial participation.

1. Runs QLSD++ (4-bit quantisation, memory) and D-ELF (top-2) as a Flower deployment (real
   ``ClientApp``/``ServerApp`` code, messages through Flower's serialisation, in this
   process) and in process, and reports the largest difference of the draws and the bits
   declared / serialised.
2. Runs in-process QLSD# with participation p in {1, 0.5, 0.25} and reports the error of the
   posterior mean against a long LSD (uncompressed, full participation) reference, with the
   uplink bits per step.
3. With ``--processes``: QLSD++ as real processes on 127.0.0.1 (``flower-superlink``, one
   ``flower-supernode`` per client, ``flwr run``; add ``--tls`` for TLS with a throwaway CA
   and SuperNode authentication), ``--process-clients`` SuperNodes, ``--process-steps``
   steps (each costs seconds: Flower starts one ClientApp process per message and its
   SuperNodes poll every 3 s).

``python examples/flower_qlsd.py [--smoke] [--steps N] [--processes [--tls]] [--out DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import numpy as np
from jax import random
from numpyro.infer import MCMC

from numpyro_fed import DELF, ClientPartition, compressors
from numpyro_fed.examples import logistic_regression
from numpyro_fed.flower import FlowerSpec, run_loopback, to_inference_data
from numpyro_fed.kernels.qlsd import QLSD

#: the Flower model spec (``module:attribute``): clients and server import the model by name
MODEL = "numpyro_fed.examples:logistic_regression"


def _data(num_clients: int, n: int, d: int):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ rng.normal(size=d)))).astype(np.float32)
    part = ClientPartition.iid({"X": X, "y": y}, num_clients=num_clients, key=random.key(1))
    clients = [{k: np.asarray(v[i, : part.sizes_np[i]]) for k, v in part.data.items()}
               for i in range(num_clients)]
    return part, clients


def _run(kernel, steps, warmup=0, key=3, fields=("bits_up",)):
    mcmc = MCMC(kernel, num_warmup=warmup, num_samples=steps, progress_bar=False)
    mcmc.run(random.key(key), extra_fields=fields)
    return mcmc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny settings")
    ap.add_argument("--steps", type=int, default=1000, help="steps of the Flower comparison")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--out", default="out/flower_qlsd")
    ap.add_argument("--processes", action="store_true",
                    help="also run QLSD++ as real Flower processes on 127.0.0.1")
    ap.add_argument("--process-steps", type=int, default=10,
                    help="steps of the multi-process run")
    ap.add_argument("--process-clients", type=int, default=2,
                    help="SuperNodes of the multi-process run (each runs JAX per message)")
    ap.add_argument("--tls", action="store_true",
                    help="multi-process run over TLS with SuperNode authentication")
    args = ap.parse_args(argv)
    steps = 8 if args.smoke else args.steps
    chain = 100 if args.smoke else 20_000
    os.makedirs(args.out, exist_ok=True)
    part, clients = _data(args.clients, 400, 5)
    rows = []
    kernels = {
        "QLSD++ (4 bits)": QLSD(logistic_regression, part, variant="++", step_size=1e-3,
                                batch_size=10, bits=4, refresh_every=20),
        "D-ELF (top-2)": DELF(logistic_regression, part, step_size=1e-3,
                              uplink=compressors.top_k(2)),
    }
    for name, kern in kernels.items():
        ref = np.asarray(_run(kern, steps).get_samples()["w"])
        spec = FlowerSpec.from_kernel(kern, MODEL, num_samples=steps,
                                      seed=3)
        t0 = time.perf_counter()
        coord = run_loopback(spec, clients)
        wall = time.perf_counter() - t0
        ss = to_inference_data(coord).sample_stats
        got = coord.draws
        rows.append({
            "run": f"Flower {name}", "steps": steps,
            "max |draw diff| vs in-process": f"{np.max(np.abs(got - ref)):.2e}",
            "declared up bits/step": f"{ss['bits_up_declared'].values.mean():.0f}",
            "payload up bits/step": f"{ss['bits_up_payload'].values.mean():.0f}",
            "Flower message up bits/step": f"{ss['bits_up_wire'].values.mean():.0f}",
            "wall s": f"{wall:.1f}",
        })
    if args.processes:
        from numpyro_fed.flower.runner import run_processes

        psteps = 2 if args.smoke else args.process_steps
        ppart, pclients = _data(args.process_clients, 400, 5)
        kern = QLSD(logistic_regression, ppart, variant="++", step_size=1e-3, batch_size=10,
                    bits=4, refresh_every=20)
        ref = np.asarray(_run(kern, psteps).get_samples()["w"])
        # a generous round timeout: the first round compiles JAX in every ClientApp process
        spec = FlowerSpec.from_kernel(kern, MODEL, num_samples=psteps,
                                      seed=3, round_timeout=600.0)
        t0 = time.perf_counter()
        idata = run_processes(spec, pclients, os.path.join(args.out, "processes"),
                              tls=args.tls, node_auth=args.tls)
        wall = time.perf_counter() - t0
        ss = idata.sample_stats
        rows.append({
            "run": f"Flower processes QLSD++ (4 bits), {args.process_clients} SuperNodes"
                   + (", TLS + auth" if args.tls else ""),
            "steps": psteps,
            "max |draw diff| vs in-process":
                f"{np.max(np.abs(idata.posterior['w'].values[0] - ref)):.2e}",
            "declared up bits/step": f"{ss['bits_up_declared'].values.mean():.0f}",
            "payload up bits/step": f"{ss['bits_up_payload'].values.mean():.0f}",
            "Flower message up bits/step": f"{ss['bits_up_wire'].values.mean():.0f}",
            "wall s": f"{wall:.1f}",
        })
    # partial participation, in process
    lsd = QLSD(logistic_regression, part, variant="#", step_size=1e-3)
    reference = np.asarray(_run(lsd, 4 * chain, warmup=chain // 4, key=11)
                           .get_samples()["w"]).mean(0)
    for p in (1.0, 0.5, 0.25):
        kern = QLSD(logistic_regression, part, variant="#", step_size=1e-3, batch_size=10,
                    bits=4, participation=p)
        mcmc = _run(kern, chain, warmup=chain // 4, key=5)
        mean = np.asarray(mcmc.get_samples()["w"]).mean(0)
        rows.append({
            "run": f"in-process QLSD# p={p}", "steps": chain,
            "max |draw diff| vs in-process": "",
            "declared up bits/step": f"{np.mean(mcmc.get_extra_fields()['bits_up']):.0f}",
            "payload up bits/step": "", "Flower message up bits/step": "",
            "wall s": f"posterior-mean error {np.linalg.norm(mean - reference):.3f}",
        })
    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(os.path.join(args.out, "flower_qlsd.csv"), index=False)
    table = df.to_markdown(index=False)
    with open(os.path.join(args.out, "flower_qlsd.md"), "w") as f:
        f.write(table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(coord.draws[:, 0], label="Flower D-ELF")
    ax.plot(ref[:, 0], "--", label="in-process D-ELF")
    ax.set_xlabel("step")
    ax.set_ylabel("w[0]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "flower_qlsd.png"), dpi=100)
    if not args.smoke:
        os.makedirs("examples/results", exist_ok=True)
        shutil.copy(os.path.join(args.out, "flower_qlsd.md"), "examples/results/flower_qlsd.md")
    print(table)


if __name__ == "__main__":
    main()
