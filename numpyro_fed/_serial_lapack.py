"""Batched LAPACK calls of a CPU program run one after another: a work-around for a deadlock
of XLA:CPU in jaxlib 0.10.

jaxlib 0.10 runs every *batched* LAPACK kernel of the CPU backend (Cholesky, triangular
solve, LU, QR, eigen- and singular-value decompositions, ...) through ``ParallelBatchMap``:
the kernel, itself running on a worker of XLA's intra-op thread pool, splits the batch into
tasks on that same pool and blocks until they are done. XLA:CPU's thunk executor runs
independent operations of a program concurrently on that pool. When as many batched LAPACK
calls as the pool has workers start together, every worker waits for tasks that only a free
worker could run: the process hangs for ever, every thread parked on a futex, no CPU used.
On a 2-core machine two concurrent calls are enough. Measured here (jaxlib 0.10.2, 2 cores):
one program holding two independent ``cholesky`` + ``solve_triangular`` chains hangs on
every run for batches of 16 x 200 x 200, 4 x 474 x 474, 1000 x 20 x 20 or 10000 x 5 x 5
(smaller ones pass, by timing); the same chains one after the other never hang. SAEM's exact
information of a crossed model (474 latents, a group of 464) hung this way. Neither
``--xla_cpu_multi_thread_eigen=false`` nor synchronous dispatch changes it.

:func:`serialise` rewrites a traced program so that its batched LAPACK calls (and the loops,
conditionals and calls that contain one) form a chain: the floating operands of each take a
data dependency on the results of the one before (see :func:`_tie`), so XLA cannot start a call
before the previous one has finished. Values are unchanged bit for bit; programs with fewer
than two such calls are left as they are. :mod:`numpyro_fed._programs` applies it to every
program it compiles for the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

__all__ = ["LAPACK_PRIMITIVES", "count_batched_calls", "serialise"]

_LOG = logging.getLogger(__name__)

#: primitives that XLA:CPU runs as a LAPACK (or ducc FFT) kernel with ``ParallelBatchMap``
LAPACK_PRIMITIVES = frozenset({
    "cholesky", "triangular_solve", "lu", "qr", "geqrf", "geqp3", "householder_product",
    "ormqr", "eigh", "eig", "svd", "schur", "hessenberg", "tridiagonal", "tridiagonal_solve",
    "fft",
})


def _sub_jaxprs(params: dict) -> list[tuple[str, int | None, Any]]:
    """``(param name, index in a tuple or None, jaxpr)`` of every jaxpr among ``params``."""
    found = []
    for name, v in params.items():
        if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            found.append((name, None, v))
        elif isinstance(v, (tuple, list)):
            for i, u in enumerate(v):
                if isinstance(u, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    found.append((name, i, u))
    return found


def _open(j) -> jcore.Jaxpr:
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _is_batched_lapack(eqn) -> bool:
    if eqn.primitive.name not in LAPACK_PRIMITIVES:
        return False
    for v in eqn.invars:
        shape = getattr(v.aval, "shape", ())
        batch = shape[:-1] if eqn.primitive.name == "fft" else shape[:-2]
        if int(np.prod(batch, dtype=np.int64)) > 1:
            return True
    return False


def count_batched_calls(jaxpr) -> int:
    """How many batched LAPACK calls ``jaxpr`` holds, a loop, conditional or call counted
    once per call it holds (what can run at the same time)."""
    n = 0
    for eqn in _open(jaxpr).eqns:
        if _is_batched_lapack(eqn):
            n += 1
        else:
            n += sum(count_batched_calls(j) for _, _, j in _sub_jaxprs(eqn.params))
    return n


def _retrace(j):
    """``j`` (a closed or open jaxpr) with its own batched LAPACK calls chained: the same
    signature, or ``j`` unchanged when it cannot be rebuilt with one."""
    closed = j if isinstance(j, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(j, ())
    avals = closed.in_avals
    if not all(isinstance(a, jcore.ShapedArray) for a in avals):
        return j
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    try:
        new = jax.make_jaxpr(
            lambda *xs: _eval(closed.jaxpr, closed.consts, xs))(*specs)
    except Exception as e:  # noqa: BLE001 -- not rebuildable: kept whole (chained outside)
        _LOG.debug("batched LAPACK calls inside a %s left unordered: %r", type(j).__name__, e)
        return j
    if [(a.shape, a.dtype, a.weak_type) for a in new.out_avals] != [
            (a.shape, a.dtype, a.weak_type) for a in closed.out_avals]:
        return j
    if isinstance(j, jcore.ClosedJaxpr):
        return new
    return new.jaxpr if not new.consts else j


def _numeric_array(v) -> bool:
    """An array of a number or boolean dtype (not a key, token or reference)."""
    aval = jax.typeof(v)
    return (isinstance(aval, jcore.ShapedArray)
            and not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended))


def _float_array(v) -> bool:
    """An array of a real or complex floating dtype (not a key, token or reference)."""
    aval = jax.typeof(v)
    return (isinstance(aval, jcore.ShapedArray)
            and jax.dtypes.issubdtype(aval.dtype, np.inexact))


def _tie(vals: Sequence, token: Sequence) -> list:
    """``vals`` made to wait for every array of ``token``: each floating array ``x`` of
    ``vals`` becomes ``x - z``, with ``z = 0 * sum |t|``, ``t`` one element of each array of
    ``token`` (0 where not finite).

    That is ``x`` exactly (``x - (+0) = x`` for every float, signed zeros, infinities and
    NaNs included), but XLA cannot prove it (it does not fold ``0 * y`` for floats), so the
    value is a real data dependency. Every operand and every result take part: a loop or call
    whose first operand is not used by its LAPACK call, or whose first result does not come
    from it, would otherwise leave the two calls unordered. An optimization barrier is not
    a dependency here: XLA:CPU removes it before it builds the thunk graph, whose order comes
    from the buffers each operation reads and writes (measured: with barriers the calls
    stayed concurrent, and hung)."""
    ts = [t for t in token if _numeric_array(t) and jnp.size(t)]
    idx = [i for i, v in enumerate(vals) if _float_array(v)]
    if not idx or not ts:
        return list(vals)
    acc = jnp.zeros((), jnp.float32)
    for t in ts:
        e = jnp.real(jnp.ravel(t)[0]).astype(jnp.float32)
        acc = acc + jnp.where(jnp.isfinite(e), jnp.abs(e), jnp.zeros((), jnp.float32))
    zero = jnp.zeros((), jnp.float32) * acc
    out = list(vals)
    for i in idx:
        x = vals[i]
        out[i] = x - zero.astype(x.dtype)
    return out


def _eval(jaxpr: jcore.Jaxpr, consts: Sequence, args: Sequence) -> list:
    """Evaluate ``jaxpr`` (under a trace), chaining its batched LAPACK calls."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    token: list | None = None
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        params = eqn.params
        chained = _is_batched_lapack(eqn)
        if not chained:
            subs = [(n, i, j) for n, i, j in _sub_jaxprs(params) if count_batched_calls(j)]
            if subs:
                chained = True
                params = dict(params)
                for name, i, j in subs:
                    if i is None:
                        params[name] = _retrace(j)
                    else:
                        old = params[name]
                        seq = list(old)
                        seq[i] = _retrace(j)
                        params[name] = (type(old)._make(seq) if hasattr(old, "_make")
                                        else type(old)(seq))  # a NamedTuple, or not
        if chained and token is not None:
            invals = _tie(invals, token)
        bind_params = eqn.primitive.get_bind_params(params)
        sinfo = jcore.source_info_util
        name_stack = sinfo.current_name_stack() + eqn.source_info.name_stack
        with (sinfo.user_context(eqn.source_info.traceback, name_stack=name_stack),
              eqn.ctx.manager):
            ans = eqn.primitive.bind(*invals, **bind_params)
        outs = list(ans) if eqn.primitive.multiple_results else [ans]
        if chained:
            token = outs
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def serialise(traced: jax.stages.Traced) -> Callable | None:
    """The function of the flat arguments of ``traced`` that computes the same values with
    its batched LAPACK calls one after another (see the module docstring), or ``None`` when
    ``traced`` holds fewer than two of them (nothing can run at the same time)."""
    closed = traced.jaxpr
    if count_batched_calls(closed) < 2:
        return None
    out_tree = traced.out_tree

    def program(*flat):
        return jax.tree.unflatten(out_tree, _eval(closed.jaxpr, closed.consts, flat))

    return program
