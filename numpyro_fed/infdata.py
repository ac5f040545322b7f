"""ArviZ helpers: what ``az.from_numpyro`` cannot know about a federated run.

``az.from_numpyro(mcmc)`` already works on a federated kernel: the kernel's ``model``
attribute binds the pooled data in the user's row order
(:meth:`~numpyro_fed.partition.ClientPartition.user_order`), so ArviZ replays the model on
all rows (observed data, pooled log-likelihood) and every per-row site -- those, the
deterministic sites of the posterior (computed on the same rows by the kernel's
``postprocess_fn``) and a posterior predictive on the user's ``X`` -- lines up with the
user's arrays; the per-step bits land in ``sample_stats`` as ``bits`` with a trailing
``(up, down)`` axis. :func:`to_inference_data` adds

* ``bits_up`` and ``bits_down`` as separate ``sample_stats`` variables;

* the pointwise log-likelihood and the observed data in the user's row order, with the
  original row index and a ``client`` coordinate on one row dimension (PSIS-LOO Pareto k
  values map back to the user's rows), or a leave-one-client-out log-likelihood
  (``log_likelihood="client"``);
* the client sizes as ``constant_data``;
* the cumulative communication (including warmup, thinned-out steps and one-off rounds) as
  ``sample_stats`` attributes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.bits import counter_value
from numpyro_fed.kernels.federated import FederatedKernel

__all__ = ["to_inference_data", "communication_summary"]


def communication_summary(mcmc) -> dict[str, Any]:
    """Cumulative bits of a finished federated run, per chain and in total.

    :return: dict with ``up``, ``down`` (``int64`` arrays over chains, exact), ``total``,
        ``per_step_up`` / ``per_step_down`` (mean bits per iteration over kept draws, from
        the exact ``int64`` per-step counts collected with ``extra_fields``).
    """
    kernel = mcmc.sampler
    if not isinstance(kernel, FederatedKernel):
        raise TypeError("communication_summary needs an MCMC run with a federated kernel.")
    state = mcmc.last_state
    up = np.atleast_1d(counter_value(state.total_up))
    down = np.atleast_1d(counter_value(state.total_down))
    extra = mcmc.get_extra_fields()
    out = {"up": up, "down": down, "total": up + down}
    for j, name in enumerate(("bits_up", "bits_down")):
        if name in extra:
            per_step = counter_value(extra[name])
        elif "bits" in extra:
            per_step = counter_value(extra["bits"])[..., j]
        else:
            continue
        out["per_step_" + name[5:]] = (int(np.sum(per_step)) / per_step.size if per_step.size
                                       else float("nan"))
    return out


def _pointwise(kernel: FederatedKernel, samples: dict, batch: int = 256) -> np.ndarray:
    """Per-row log-likelihood ``(chain, draw, b, N_max)`` of constrained ``samples``."""
    pot = kernel.potential
    data = kernel.partition
    latent = {k: samples[k] for k in pot.latent_names}
    chains, draws = np.shape(latent[pot.latent_names[0]])[:2]
    flat = jax.tree.map(lambda v: jnp.reshape(v, (chains * draws,) + jnp.shape(v)[2:]), latent)

    @jax.jit
    def one(z):
        return pot.pointwise_loglik(pot.unconstrain(z), data)

    ll = jax.lax.map(one, flat, batch_size=min(batch, chains * draws))
    return np.asarray(ll).reshape((chains, draws) + ll.shape[1:])


def _name_rows(ds, num_rows: int, row_dim: str, coords: dict):
    """``observed_data`` (replayed on the pooled rows, already in the user's row order, see
    :meth:`~numpyro_fed.potential.FederatedPotential.pooled_model`) with its row axis named
    ``row_dim`` and the original row index and client as coordinates (variables whose
    leading axis is not the rows are kept as they are)."""
    out = {}
    for name, da in ds.data_vars.items():
        if da.ndim and da.shape[0] == num_rows:
            da = da.rename({da.dims[0]: row_dim})
            da = da.drop_vars([c for c in da.coords if row_dim in da[c].dims])
        out[name] = da
    new = ds.__class__(out, attrs=ds.attrs)
    if row_dim in new.dims:
        new = new.assign_coords(coords)
    return new


def to_inference_data(mcmc, *, log_likelihood: str | bool = "row", **kwargs):
    """``az.from_numpyro`` plus client information for a federated run.

    :param mcmc: a finished :class:`numpyro.infer.MCMC` run with a federated kernel.
    :param log_likelihood: ``"row"`` (pointwise log-likelihood of every row, for PSIS-LOO /
        WAIC), ``"client"`` (summed per client: a leave-one-client-out log-likelihood), or
        ``False``. The rows of ``log_likelihood`` and ``observed_data`` share one dimension
        (``<site>_dim_0`` for a model with one observed site, else ``row``), are sorted in
        the user's order and carry the original row index
        (:meth:`~numpyro_fed.partition.ClientPartition.original_index`, which undoes the
        shuffle of ``iid`` / ``dirichlet`` / ``power_law``) as coordinate, and a ``client``
        coordinate: a PSIS-LOO Pareto k maps back to the user's row.
    :param kwargs: passed to :func:`arviz.from_numpyro` (``coords``, ``dims``, ...).
    :return: :class:`arviz.InferenceData`.
    """
    import arviz as az
    import xarray as xr

    kernel = mcmc.sampler
    if not isinstance(kernel, FederatedKernel):
        raise TypeError(
            "to_inference_data needs an MCMC run with a numpyro_fed federated kernel; use "
            "az.from_numpyro for other kernels."
        )
    if log_likelihood not in ("row", "client", False):
        raise ValueError("`log_likelihood` must be 'row', 'client' or False.")
    idata = az.from_numpyro(mcmc, log_likelihood=False, **kwargs)
    stats = idata.sample_stats
    if "bits" in stats:
        bits = stats["bits"]
        axis = bits.dims[-1]
        split = {name: bits.isel({axis: j}, drop=True) for j, name in
                 enumerate(("bits_up", "bits_down")) if name not in stats}
        stats = stats.drop_vars("bits").assign(split)
        idata.sample_stats = stats.drop_dims(axis, errors="ignore")
    part = kernel.partition
    names = np.asarray([str(n) for n in part.client_names])
    obs = kernel.potential.observed_names
    var = obs[0] if len(obs) == 1 else "log_lik"
    row_dim = f"{var}_dim_0" if len(obs) == 1 else "row"
    original = part.original_index()  # the user's row of each pooled row
    order = np.argsort(original, kind="stable")
    client_of_row = np.asarray(part.client_index())
    row_coords = {row_dim: original[order], "client": (row_dim, names[client_of_row][order])}
    if "observed_data" in idata.groups():
        idata.observed_data = _name_rows(idata.observed_data, part.total_size, row_dim,
                                         row_coords)
    if log_likelihood:
        samples = mcmc.get_samples(group_by_chain=True)
        ll = _pointwise(kernel, samples)
        mask = np.asarray(part.mask)
        if log_likelihood == "row":
            rows = ll[:, :, mask][:, :, order]  # pooled rows, put back in the user's order
            da = xr.DataArray(
                rows,
                dims=("chain", "draw", row_dim),
                coords={
                    "chain": idata.posterior.chain.values,
                    "draw": idata.posterior.draw.values,
                    **row_coords,
                },
            )
        else:
            da = xr.DataArray(
                np.where(mask, ll, 0.0).sum(-1),
                dims=("chain", "draw", "client"),
                coords={
                    "chain": idata.posterior.chain.values,
                    "draw": idata.posterior.draw.values,
                    "client": names,
                },
            )
        idata.add_groups({"log_likelihood": xr.Dataset({var: da})})
    sizes = xr.Dataset(
        {"client_size": xr.DataArray(np.asarray(part.sizes_np), dims=("client",),
                                     coords={"client": names})}
    )
    if "constant_data" in idata.groups():
        idata.constant_data = idata.constant_data.merge(sizes)
    else:
        idata.add_groups({"constant_data": sizes})
    comm = communication_summary(mcmc)
    idata.sample_stats.attrs.update(
        {
            "bits_up_total": comm["up"].tolist(),
            "bits_down_total": comm["down"].tolist(),
            "kernel": type(kernel).__name__,
            "compressor": kernel.compressor.name,
            "num_clients": int(part.num_clients),
        }
    )
    return idata
