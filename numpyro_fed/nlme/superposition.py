"""Sparse dose superposition for linear structural models.

A linear model's prediction is the sum over the doses of each dose's response. The dense
evaluation (``vmap`` over subjects of the ``(T, D)`` product of every sample with every dose)
costs ``subjects x max samples x max doses`` responses, most of them padding or doses that
cannot act on the sample: on ``nlme::Quinidine`` (136 subjects, up to 11 samples and 40 doses
each) 59 840 pairs, of which 1 336 can contribute. Here the pairs (sample, dose) that can
contribute are listed once on the host -- the dose is recorded at or before the sample (and,
in record order, before it), and no later steady-state dose recorded at or before the sample
has reset it (NONMEM's ``SS = 1``) -- and the structural function is evaluated on each pair
alone (one sample, one dose), then summed per sample with a segment sum. Which pairs can
contribute depends on the record times only (not on ``TLAG``, which can only delay a dose),
so the list is computed once per dataset and is an ordinary data argument of the model.

The pair count is padded to a multiple of :data:`PAIR_BLOCK` (padding pairs have a masked
dose and add exactly 0), so that datasets of nearly the same size share compiled programs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PAIR_BLOCK", "superposition_pairs", "predict_pairs", "supports_superposition"]

#: the pair count is padded to a multiple of this
PAIR_BLOCK = 128

_FIELDS = ("time", "amt", "rate", "cmt", "ss", "ii", "mask")


def supports_superposition(structural: Any) -> bool:
    """Whether ``structural`` is linear in its doses (``superposition = True``: the
    prediction with several doses is the sum of the predictions with each dose alone, once
    the steady-state resets are accounted for)."""
    return bool(getattr(structural, "superposition", False))


def superposition_pairs(obs_time: Any, doses: Any, doses_before: Any = None,
                        obs_mask: Any = None, block: int = PAIR_BLOCK) -> np.ndarray:
    """The (sample, dose) pairs that can contribute to a prediction, on the host.

    :param obs_time: ``(n, T)`` sample times.
    :param doses: dosing record, fields ``(n, D)``.
    :param doses_before: ``(n, T)`` number of doses recorded before each sample (record
        order), or ``None`` (every dose at or before the sample's time).
    :param obs_mask: ``(n, T)``: the samples whose pairs are listed (the others are predicted
        0); default: every sample, padding included (every entry then equals the dense
        prediction).
    :param block: the count is padded to a multiple of ``block``.
    :return: ``(P, 4)`` int32: subject, sample index, dose index, and 1 for a real pair (0
        for padding).
    """
    t = np.asarray(obs_time, np.float64)
    n, T = t.shape
    dtime = np.asarray(doses.time, np.float64).reshape(n, -1)
    D = dtime.shape[1]
    mask = np.asarray(doses.mask, bool).reshape(n, D)
    ss = mask & np.asarray(doses.ss, bool).reshape(n, D)
    # reset: the earliest record time of a steady-state dose recorded after dose j
    # (NONMEM's SS = 1 reset), as the structural models compute it over the doses they see
    idx = np.arange(D)
    later = (dtime[:, None, :] > dtime[:, :, None]) | (
        (dtime[:, None, :] == dtime[:, :, None]) & (idx[None, None, :] > idx[None, :, None]))
    resets = later & ss[:, None, :]  # [i, j, k]: dose k resets dose j
    seen = mask[:, None, :] & (dtime[:, None, :] <= t[:, :, None])  # (n, T, D)
    if obs_mask is not None:
        seen &= np.asarray(obs_mask, bool).reshape(n, T)[:, :, None]
    if doses_before is None:
        reset = np.min(np.where(resets, dtime[:, None, :], np.inf), axis=2, initial=np.inf)
        cand = seen & (t[:, :, None] < reset[:, None, :])
    else:
        # record order: a sample sees (and is reset by) only the doses recorded before it
        nb = np.asarray(doses_before).reshape(n, T)
        seen &= idx[None, None, :] < nb[:, :, None]
        cand = np.zeros((n, T, D), bool)
        for i in range(n):  # (T, D, D) per subject
            r = resets[i][None] & seen[i][:, None, :]  # [j, d, k]
            reset = np.min(np.where(r, dtime[i][None, None, :], np.inf), axis=2,
                           initial=np.inf)  # (T, D)
            cand[i] = seen[i] & (t[i][:, None] < reset)
    s, j, k = np.nonzero(cand)
    P = len(s)
    Pp = max(block, -(-P // block) * block)
    out = np.zeros((Pp, 4), np.int32)
    out[:P, 0], out[:P, 1], out[:P, 2], out[:P, 3] = s, j, k, 1
    return out


def predict_pairs(structural: Any, indiv: dict, obs_time: Any, doses: Any, pairs: Any,
                  obs_cmt: Any = None) -> jax.Array:
    """Predictions ``(n, T)`` of a linear structural model (one subject:
    ``structural(p, t, d[, cmt=...])``) as the sum of its responses to each dose alone over
    the ``pairs`` of :func:`superposition_pairs`. A subject with a dose the model cannot
    take gets NaN everywhere, as in the dense evaluation (``structural._poison``)."""
    from numpyro_fed.nlme.data import Doses

    obs_time = jnp.asarray(obs_time)
    n, T = obs_time.shape
    pairs = jnp.asarray(pairs)
    s, on = pairs[:, 0], pairs[:, 3] > 0
    o = s * T + pairs[:, 1]  # flat sample index
    # 1-d gathers with explicit clipping (in range anyway) and a clipped segment sum
    take = lambda x, i: jnp.take(jnp.reshape(x, (-1,)), i, mode="clip")  # noqa: E731
    D = jnp.shape(doses.time)[-1]
    q = s * D + pairs[:, 2]  # flat dose index
    p = {nm: take(jnp.broadcast_to(jnp.asarray(v), (n,)), s) for nm, v in indiv.items()}
    # each pair is evaluated as one dose and one sample, (T, D) = (1, 1). It was evaluated
    # with the sample twice, (2, 1), from 7c3f32d to 2026-11-29: a (1, 1) program segfaulted
    # XLA:CPU (jaxlib 0.10.2) in the batched Hessians of the Louis information as written
    # then (reproduced at 7c3f32d; bisected: the crash leaves with 6c99505, which replaced
    # the default standard errors, and the Louis program of today runs with (1, 1) at
    # batches of 25 to 256 draws; test_nlme_superposition's Louis test keeps it run). The
    # doubled evaluation cost 37% of a Quinidine fit's loop (6.1-6.6 s against 4.0 s)
    t = take(obs_time, o)[:, None]
    d = Doses(**{f: take(jnp.asarray(getattr(doses, f)), q)[:, None] for f in _FIELDS})
    d = d._replace(mask=d.mask.astype(bool) & on[:, None])
    if obs_cmt is None:
        v = jax.vmap(lambda pp, tt, dd: structural(pp, tt, dd)[0])(p, t, d)
    else:
        c = take(jnp.asarray(obs_cmt), o)[:, None]
        v = jax.vmap(lambda pp, tt, dd, cc: structural(pp, tt, dd, cmt=cc)[0])(p, t, d, c)
    out = jax.ops.segment_sum(v, o, num_segments=n * T, indices_are_sorted=True,
                              mode=jax.lax.GatherScatterMode.CLIP).reshape(n, T)
    poison = getattr(structural, "_poison", None)
    if poison is not None:
        def bad(dd):
            return poison(structural._dose_arrays(dd, v.dtype))

        full = Doses(**{f: jnp.asarray(getattr(doses, f)) for f in _FIELDS})
        out = out + jax.vmap(bad)(full)[:, None]
    return out
