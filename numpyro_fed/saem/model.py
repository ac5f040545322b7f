"""Model introspection for MCMC-SAEM: parameters, latents, data checks and the subject layout.

:class:`ModelInfo` flattens the ``param`` sites (:math:`\\theta`, unconstrained) and the latent
``sample`` sites (:math:`z`, unconstrained) of a NumPyro model and checks the model and its
data once, with messages that name the site and the fix. :func:`subject_layout` finds the
*subjects*: the plate that holds every latent site, and for every element of every site's
log-density the subject it belongs to -- from the plate for sites inside it (padded
subject x time arrays), and from the sparsity of the derivative of the log-density for
sites outside it (long format: one row per observation with an integer subject index, the
random effects gathered as ``z[subject]``). Given :math:`\\theta`,
:math:`p(y, z\\mid\\theta) = \\prod_i p(y_i, z_i\\mid\\theta)` then holds by construction, which
the E-step (per-subject Metropolis tests) and the likelihood (per-subject integrals) use.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro.distributions import constraints
from numpyro.distributions import distribution as dist_base
from numpyro.distributions.distribution import validation_enabled
from numpyro.distributions.transforms import IndependentTransform, biject_to
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.util import compute_log_probs

from numpyro_fed import _programs

__all__ = ["ModelInfo", "StaticData", "SubjectLayout", "subject_layout", "group_layout",
           "log_joint_per_subject", "split_data", "merge_data", "static_as_numpy",
           "find_static_data", "prefer_forward", "block_hessian", "block_jet", "pad_mask",
           "pad_log_density"]


# ------------------------------------------------------------------------------ data
def _is_array(v) -> bool:
    return isinstance(v, np.ndarray | jax.Array) or (
        hasattr(v, "__array__") and not isinstance(v, str | bytes | int | float | bool)
    )


class StaticData:
    """A data argument the model reads concretely (a plate size from ``x.max()``,
    ``np.unique``, Python control flow on it): closed over by the compiled programs (a
    constant of the program, so the content-keyed cache of :mod:`numpyro_fed._programs`
    compiles once per value) instead of traced. Hashable and compared by content (its
    type, shape, dtype and bytes); :func:`merge_data` hands the model the original object,
    as NumPyro's MCMC does (a ``jax.Array`` as the NumPy array of its values: JAX stages
    every operation on a closed-over ``jax.Array`` inside a trace)."""

    __slots__ = ("value", "_digest")

    def __init__(self, value) -> None:
        # a jax.Array would be staged again by every operation inside a trace (x.max() of a
        # closed-over jax.Array is a tracer): the model gets its values as a NumPy array
        self.value = np.asarray(value) if isinstance(value, jax.Array) else value
        self._digest: bytes | None = None

    @property
    def digest(self) -> bytes:
        if self._digest is None:
            h = hashlib.blake2b(digest_size=20)
            h.update(f"{type(self.value).__module__}.{type(self.value).__name__}".encode())
            _programs._array_digest(h, self.value)
            self._digest = h.digest()
        return self._digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticData) and other.digest == self.digest

    def __repr__(self) -> str:
        return (f"StaticData({type(self.value).__name__}{tuple(np.shape(self.value))} "
                f"{np.asarray(self.value).dtype}, {self.digest.hex()[:16]})")


def split_data(args: tuple, kwargs: dict, static_names=()):
    """Split model arguments into array leaves (traced by the compiled programs: new values
    reuse them) and a hashable static remainder (part of the compilation cache key).

    :param static_names: the array arguments the model reads concretely
        (:attr:`ModelInfo.static_data`: positions of positional arguments, names of
        keyword arguments); they go to the static part as :class:`StaticData`.
    """
    arrays_a, static_a = [], []
    for i, v in enumerate(args):
        if _is_array(v) and i not in static_names:
            arrays_a.append(jnp.asarray(v))
            static_a.append(None)
        else:
            arrays_a.append(None)
            static_a.append(StaticData(v) if _is_array(v) else v)
    arrays_k, static_k = {}, {}
    for k in sorted(kwargs):
        v = kwargs[k]
        if _is_array(v) and k not in static_names:
            arrays_k[k] = jnp.asarray(v)
        else:
            static_k[k] = StaticData(v) if _is_array(v) else v
    return (tuple(arrays_a), arrays_k), (tuple(static_a), tuple(sorted(static_k.items())))


def static_as_numpy(args: tuple, kwargs: dict, static_names=()):
    """``(args, kwargs)`` with the ``jax.Array`` arguments in ``static_names`` (those the
    model reads concretely) as NumPy arrays: inside a trace JAX stages every operation on a
    closed-over ``jax.Array`` (``int(x.max())`` of one is a tracer), never on a NumPy one."""
    if not static_names:
        return args, kwargs

    def conv(name, v):
        return np.asarray(v) if name in static_names and isinstance(v, jax.Array) else v

    return (tuple(conv(i, v) for i, v in enumerate(args)),
            {k: conv(k, v) for k, v in kwargs.items()})


def _unwrap(v):
    return v.value if isinstance(v, StaticData) else v


def merge_data(arrays, static):
    """Inverse of :func:`split_data`: ``(args, kwargs)``."""
    arrays_a, arrays_k = arrays
    static_a, static_k = static
    args = tuple(a if s is None else _unwrap(s)
                 for a, s in zip(arrays_a, static_a, strict=True))
    return args, {**{k: _unwrap(v) for k, v in static_k}, **arrays_k}


def data_signature(arrays, static):
    """Hashable description of the structure of the data (shapes, dtypes, static values)."""
    leaves, tree = jax.tree.flatten(arrays)
    try:
        hash(static)
        st = static
    except TypeError:
        st = repr(static)
    return (tree, tuple((tuple(np.shape(v)), str(jnp.result_type(v))) for v in leaves), st)


def _arg_label(name) -> str:
    return f"positional argument {name}" if isinstance(name, int) else f"argument '{name}'"


def _array_names(args, kwargs) -> list:
    """The array arguments, non-integer ones first (those a model most often only computes
    with), by position or keyword."""
    named = [(i, v) for i, v in enumerate(args) if _is_array(v)]
    named += [(k, kwargs[k]) for k in sorted(kwargs) if _is_array(kwargs[k])]

    def is_int(v):
        dt = np.asarray(v).dtype if not hasattr(v, "dtype") else v.dtype
        return bool(np.issubdtype(dt, np.integer) or np.issubdtype(dt, np.bool_))

    return ([n for n, v in named if not is_int(v)], [n for n, v in named if is_int(v)])


def _abstract_run(model, args, kwargs, key, static_names, values: dict, traced: dict):
    """Run the model as the compiled programs do -- the array arguments not in
    ``static_names`` traced, the param and latent values of ``traced`` traced, the other
    ``values`` constants -- shapes only (:func:`jax.eval_shape`: nothing is compiled).
    Returns the exception raised, or ``None``."""
    arrays, static = split_data(args, kwargs, static_names)
    const = {n: v for n, v in values.items() if n not in traced}

    def run(arrs, tv):
        a, k = merge_data(arrs, static)
        return compute_log_probs(seed(model, key), a, k, {**const, **tv},
                                 sum_log_prob=False)[0]

    try:
        jax.eval_shape(run, arrays, traced)
    except Exception as err:  # noqa: BLE001 -- the caller decides what it means
        return err
    return None


def find_static_data(model, args, kwargs, key, values: dict, param_names, latent_names):
    """The array arguments the model must see concretely (NumPyro's MCMC passes concrete
    model arguments; SAEM's compiled programs trace the data to compile once per shape).

    The model is run abstractly (:func:`jax.eval_shape`, no compilation) with the data
    traced, as the compiled programs run it; if that fails (a plate size from
    ``int(x.max()) + 1``, ``len(np.unique(x))``, ``np.bincount``; Python control flow on
    data; boolean indexing), the integer arrays are made static, else every array, and then
    as many arguments as possible are traced again, one at a time (non-integer ones first),
    keeping each that the model does not concretise: a minimal static set, the rest traced.

    :return: a tuple of argument positions (int) and keyword names (str), sorted.
    :raises ValueError: the model fails even with every array argument static: it reads a
        param or latent value concretely (named, with the file and line).
    """
    traced = {n: values[n] for n in list(param_names) + list(latent_names)}
    floats, ints = _array_names(args, kwargs)

    def fails(names):
        return _abstract_run(model, args, kwargs, key, frozenset(names), values, traced)

    err0 = fails(())
    if err0 is None:
        return ()
    if ints and fails(ints) is None:
        keep, order = set(ints), list(ints)
    else:
        err = fails(floats + ints)
        if err is not None:
            raise ValueError(_unhandled_message(model, args, kwargs, key, values, traced,
                                                floats + ints, err, set(param_names))
                             ) from err
        keep, order = set(floats + ints), floats + ints
    for n in order:
        if fails(keep - {n}) is None:
            keep.discard(n)
    return tuple(sorted(keep, key=lambda n: (isinstance(n, str), str(n))))


_LIBRARY_DIRS: tuple | None = None


def _library_dirs() -> tuple:
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        import os
        import sysconfig

        import jaxlib
        import numpyro

        dirs = [os.path.dirname(m.__file__) for m in (jax, jaxlib, numpyro, np)]
        dirs.append(os.path.dirname(os.path.abspath(__file__)))  # numpyro_fed/saem
        dirs.append(os.path.abspath(_programs.__file__))
        for k in ("stdlib", "platstdlib"):
            try:
                dirs.append(sysconfig.get_paths()[k])
            except KeyError:
                pass
        _LIBRARY_DIRS = tuple(os.path.abspath(d) for d in dirs)
    return _LIBRARY_DIRS


def user_frame(err: BaseException) -> str:
    """``file:line (code)`` of the deepest frame of ``err``'s traceback outside JAX, NumPyro,
    NumPy, the standard library and SAEM itself: the user's line where it happened; ``""``
    when there is none."""
    import os
    import traceback

    libs = _library_dirs()
    found = ""
    seen = set()
    e = err
    while e is not None and id(e) not in seen:  # JAX may keep the full trace in a cause
        seen.add(id(e))
        for fr in traceback.extract_tb(e.__traceback__):
            f = os.path.abspath(fr.filename)
            if fr.filename.startswith("<") or any(f.startswith(d + os.sep) or f == d
                                                    for d in libs):
                continue
            code = f" (`{fr.line.strip()}`)" if fr.line else ""
            found = f"{fr.filename}:{fr.lineno}{code}"
        if found:
            break
        e = e.__cause__ or e.__context__
    return found


def _unhandled_message(model, args, kwargs, key, values, traced, names, err,
                       params=()) -> str:
    """The error for a model that fails even with every data argument static: which param
    or latent value it reads concretely, and where."""
    where = user_frame(err)
    culprits = []
    if _abstract_run(model, args, kwargs, key, frozenset(names), values, {}) is None:
        culprits = [n for n in traced
                    if _abstract_run(model, args, kwargs, key, frozenset(names), values,
                                     {n: traced[n]}) is not None]
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    first = first.rstrip(".") + "."
    at = f" at {where}" if where else ""
    if culprits:
        kinds = ", ".join(
            f"{'param site' if n in params else 'latent site'} '{n}'" for n in culprits)
        return (
            f"SAEM: the model uses the value of {kinds} in Python{at}: {first} "
            "SAEM estimates params and samples latents inside compiled programs, where "
            "their values are abstract (every data argument was already given to the "
            "model concretely). Write that line with jax.numpy (`jnp.where`, "
            "`jax.lax.cond`, shapes from the data rather than from a param), or pass the "
            "value as data (a model argument)."
        )
    return (
        f"SAEM: the model cannot be traced{at}, even with every data argument ("
        + ", ".join(_arg_label(n) for n in names) + ") given concretely: "
        f"{type(err).__name__}: {first} Rewrite that line with jax.numpy operations "
        "(SAEM runs the model inside compiled programs, as jax.jit does)."
    )


#: XLA:CPU's fusion emitters (``xla_cpu_use_fusion_emitters``, on by default) generate each
#: fusion through MLIR; the classic emitters compile the SAEM programs 1.5-2.5x faster and run
#: them as fast (measured on Theophylline, 2-core CPU: loop 5.5 -> 3.6 s to compile, 0.49 vs
#: 0.47 s to run; initial state 2.0 -> 0.8 s). Dropped on the other backends
#: (:func:`numpyro_fed._programs.platform_options`: a GPU compiler rejects it).
_FAST_CODEGEN = {"xla_cpu_use_fusion_emitters": False}
#: XLA options of the programs that run once per model structure (introspection, the
#: initial state): compiled for compile speed (no LLVM optimisation; 2-3x faster to compile,
#: and they run for milliseconds)
ONCE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, **_FAST_CODEGEN}
#: XLA options of the SAEM loop and the likelihood / information programs: LLVM's -O1 runs
#: them as fast as the default -O2 (measured on Theophylline: 0.75 s vs 0.81 s for the
#: whole fit) and compiles 25% faster (10.9 s vs 14.4 s); the random numbers lowered
#: without loops (:func:`numpyro_fed._programs.unrolled_threefry`: the same bits, the
#: Theophylline fit 20% faster)
LOOP_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1, **_FAST_CODEGEN,
                         _programs.UNROLLED_RNG: True}


def jit_once(fn, **kw):
    """A program that runs once per fit (see :data:`ONCE_COMPILER_OPTIONS`): traced on
    every call, compiled once per program content (:class:`numpyro_fed._programs.Program`,
    never stale when the model reads a global or a mutable object)."""
    return _programs.Program(fn, compiler_options=ONCE_COMPILER_OPTIONS, tag="SAEM", **kw)


def jit_loop(fn, **kw):
    """The programs that run on every fit (see :data:`LOOP_COMPILER_OPTIONS`), compiled as
    :func:`jit_once`."""
    return _programs.Program(fn, compiler_options=LOOP_COMPILER_OPTIONS, tag="SAEM", **kw)


# ------------------------------------------------------------------------------ model
class ModelInfo:
    """Static description of the user's model: param sites, latent sites, flat layouts.

    Raises clear errors for what SAEM cannot handle (no param, no latent, a discrete latent)
    and for bad data (non-finite observed values, an observed array that does not match the
    shape of its site).
    """

    def __init__(self, model, args, kwargs, key):
        tr = _trace_model(model, args, kwargs, key)
        self.model = model
        #: whether the model's log density runs a loop (scan / while), found at the first
        #: use (:func:`prefer_forward`)
        self._has_loop: bool | None = None
        params = {n: s for n, s in tr.items() if s["type"] == "param"}
        latents = {
            n: s for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]
        }
        observed = {n: s for n, s in tr.items() if s["type"] == "sample" and s["is_observed"]}
        if not params:
            raise ValueError(
                "SAEM: the model has no `numpyro.param` site. Declare the hyperparameters "
                "to estimate as `numpyro.param(name, init_value, constraint=...)`."
            )
        if not latents:
            raise ValueError(
                "SAEM: the model has no latent `sample` site (all sample sites are observed). "
                "SAEM integrates out latent variables; without them maximise the likelihood "
                "directly (e.g. numpyro.infer.SVI with a Delta guide or an optimiser)."
            )
        for n, s in latents.items():
            if s["fn"].support.is_discrete:
                raise ValueError(
                    f"SAEM: latent site '{n}' has a discrete distribution "
                    f"({_dist_name(s['fn'])}). The SAEM E-steps are Langevin/gradient "
                    "kernels: they need continuous latent variables and do not enumerate "
                    "discrete ones (`infer={'enumerate': ...}` is not supported). Marginalise "
                    f"'{n}' out of the model by hand (sum the likelihood over its values, e.g. "
                    "a mixture likelihood with dist.MixtureSameFamily / dist.MixtureGeneral), "
                    "or make it observed (`obs=`)."
                )
            if _has_false_mask(s["fn"]):
                raise ValueError(
                    f"SAEM: latent site '{n}' is masked (`numpyro.handlers.mask` or "
                    "`.mask(...)` with False entries). A masked latent element has no density: "
                    "its draws wander off and every statistic that uses them (a variance, a "
                    "mean) is undefined. Mask only the observed sites (padding of unequal "
                    "numbers of observations per subject), and drop padded subjects from the "
                    "data instead of masking their random effects."
                )
        _check_not_empty(latents, observed, args, kwargs)
        for n, s in observed.items():
            _check_observed(n, s)
        self.param_names = sorted(params)
        self.latent_names = sorted(latents)
        self.observed_names = sorted(observed)
        self.param_constraints = {
            n: s["kwargs"].get("constraint", constraints.real) for n, s in params.items()
        }
        self.param_transforms = {n: biject_to(c) for n, c in self.param_constraints.items()}
        self.latent_transforms = {n: biject_to(latents[n]["fn"].support) for n in latents}
        theta0_c = {n: jnp.asarray(params[n]["value"]) for n in self.param_names}
        self.theta0_c = theta0_c
        theta0_u = {n: self.param_transforms[n].inv(v) for n, v in theta0_c.items()}
        self.theta0_u_flat, self._unravel_theta = ravel_pytree(theta0_u)
        _, self._unravel_theta_c = ravel_pytree(theta0_c)
        z0_c = {n: jnp.asarray(latents[n]["value"]) for n in self.latent_names}
        z0_u = {n: self.latent_transforms[n].inv(v) for n, v in z0_c.items()}
        self.z0_u_flat, self._unravel_z = ravel_pytree(z0_u)
        self.z_shapes = {n: jnp.shape(v) for n, v in z0_c.items()}
        self.z_u_shapes = {n: jnp.shape(v) for n, v in z0_u.items()}
        self.dim_theta = int(self.theta0_u_flat.size)
        self.dim_z = int(self.z0_u_flat.size)
        self.trace0 = tr
        self.n_obs = int(sum(np.size(observed[n]["value"]) for n in observed))
        self.theta_coord_names = []
        for n in self.param_names:
            size = int(np.size(theta0_c[n]))
            if np.ndim(theta0_c[n]) == 0:
                self.theta_coord_names.append(n)
            else:
                idx = np.array(np.unravel_index(np.arange(size), np.shape(theta0_c[n]))).T
                self.theta_coord_names += [f"{n}[{','.join(map(str, i))}]" for i in idx]
        #: offsets of each param site in the flat constrained / unconstrained vectors (they
        #: differ for matrix constraints: a q x q ``lower_cholesky`` has q(q+1)/2 coordinates)
        self.param_offsets = np.cumsum(
            [0] + [int(np.size(theta0_c[n])) for n in self.param_names]
        )
        self.param_offsets_u = np.cumsum(
            [0] + [int(np.size(theta0_u[n])) for n in self.param_names]
        )
        self.dim_theta_c = int(self.param_offsets[-1])
        self._staged: dict = {}
        #: the array arguments the model reads concretely (positions of positional
        #: arguments, names of keyword arguments): static in the compiled programs
        #: (constants, compiled once per value), the others traced (compiled once per
        #: shape); see :func:`find_static_data`
        self.static_data: tuple = find_static_data(
            model, args, kwargs, key,
            {n: tr[n]["value"] for n in self.param_names + self.latent_names},
            self.param_names, self.latent_names)

    # -- theta ------------------------------------------------------------------------------
    def constrain_theta(self, theta_u_flat) -> dict:
        u = self._unravel_theta(theta_u_flat)
        return {n: self.param_transforms[n](v) for n, v in u.items()}

    def unconstrain_theta(self, theta_c: dict):
        u = {n: self.param_transforms[n].inv(jnp.asarray(theta_c[n])) for n in self.param_names}
        return ravel_pytree(u)[0]

    def theta_c_flat(self, theta_u_flat):
        return ravel_pytree(self.constrain_theta(theta_u_flat))[0]

    def check_init_params(self, init_params: dict) -> dict:
        """Constrained initial values, every one checked against its site's support."""
        unknown = set(init_params) - set(self.param_names)
        if unknown:
            raise ValueError(
                f"`init_params` names unknown param sites {sorted(unknown)}; the model's "
                f"param sites are {self.param_names}."
            )
        out = dict(self.theta0_c)
        for n, v in init_params.items():
            v = jnp.asarray(v, dtype=jnp.result_type(self.theta0_c[n]))
            if jnp.shape(v) != jnp.shape(self.theta0_c[n]):
                raise ValueError(
                    f"init_params['{n}'] has shape {jnp.shape(v)}, but the param site has "
                    f"shape {jnp.shape(self.theta0_c[n])}."
                )
            c = self.param_constraints[n]
            ok = np.asarray(c.check(v))
            if not bool(np.all(ok)) or not bool(np.all(np.isfinite(np.asarray(v)))):
                raise ValueError(
                    f"init_params['{n}'] = {np.asarray(v)} lies outside the support of the "
                    f"param site ({c}); give a value inside it (e.g. a positive value for "
                    "constraints.positive, a lower-triangular matrix with a positive diagonal "
                    "for constraints.lower_cholesky)."
                )
            out[n] = v
        return out

    # -- latents ----------------------------------------------------------------------------
    def constrain_z(self, z_u_flat):
        u = self._unravel_z(z_u_flat)
        zc = {n: self.latent_transforms[n](v) for n, v in u.items()}
        logj = sum(
            jnp.sum(self.latent_transforms[n].log_abs_det_jacobian(u[n], zc[n])) for n in u
        )
        return zc, logj

    def unconstrain_z(self, z_c: dict):
        u = {n: self.latent_transforms[n].inv(jnp.asarray(z_c[n])) for n in self.latent_names}
        return ravel_pytree(u)[0]

    # -- densities --------------------------------------------------------------------------
    def site_log_probs(self, values: dict, args, kwargs) -> dict:
        """Elementwise log-density of every sample site at ``values`` (params and latents,
        constrained), as NumPyro's ``compute_log_probs(..., sum_log_prob=False)``.

        Inside a trace (the compiled programs) the model is staged once per data structure
        by a nested :func:`jax.jit`: every further use -- under ``grad``, ``jacfwd``,
        ``vmap`` -- reuses that jaxpr (and JAX's caches of its transforms) instead of running
        the model's Python again. The SAEM loop uses the density a dozen times (E-step
        gradients, the M-step's scores and Hessians): staging cuts its tracing time. Called
        on concrete values, the model runs eagerly as before (a model may use its data on the
        host).
        """
        arrays, static = split_data(args, kwargs, self.static_data)
        leaves = jax.tree.leaves((values, arrays))
        if any(isinstance(v, jax.core.Tracer) for v in leaves):
            try:
                key = (static, bool(dist_base._VALIDATION_ENABLED))
                hash(key)
            except TypeError:
                key = None
            if key is not None:
                fn = self._staged.get(key)
                if fn is None:
                    model = self.model

                    def lps_of(vals, arrs):
                        a, k = merge_data(arrs, static)
                        return compute_log_probs(model, a, k, vals, sum_log_prob=False)[0]

                    fn = self._staged[key] = jax.jit(lps_of)
                return fn(values, arrays)
        return compute_log_probs(self.model, args, kwargs, values, sum_log_prob=False)[0]

    def log_joint_c(self, theta_c, z_c, args, kwargs):
        lps = self.site_log_probs({**theta_c, **z_c}, args, kwargs)
        return sum(jnp.sum(v) for v in lps.values())

    def log_joint(self, theta_u_flat, z_u_flat, args, kwargs):
        """:math:`\\log p(y, z\\mid\\theta) + \\log|J(z)|` on flat unconstrained vectors."""
        zc, logj = self.constrain_z(z_u_flat)
        return self.log_joint_c(self.constrain_theta(theta_u_flat), zc, args, kwargs) + logj

    def trace_at(self, theta_c, z_c, args, kwargs):
        return trace(substitute(self.model, data={**theta_c, **z_c})).get_trace(*args, **kwargs)

    def prior_draw(self, key, theta_c, args, kwargs):
        """One draw of the latents from :math:`p(z\\mid\\theta)` (flat unconstrained)."""
        tr = trace(seed(substitute(self.model, data=theta_c), key)).get_trace(*args, **kwargs)
        return self.unconstrain_z({n: tr[n]["value"] for n in self.latent_names})

    def nonfinite_sites(self, theta_c, z_u, args, kwargs) -> list[str]:
        """Names of the sites whose log-density is not finite at ``theta_c`` for some row of
        ``z_u`` (``(chains, dim_z)``, flat unconstrained); for error messages (host side)."""
        def per_site(zf):
            zc, _ = self.constrain_z(zf)
            lps, _ = compute_log_probs(self.model, args, kwargs, {**theta_c, **zc})
            return {n: jnp.isfinite(v) for n, v in lps.items()}

        # invalid parameters are what is looked for here: no validation error on the way
        with validation_enabled(False):
            ok = jax.vmap(per_site)(jnp.atleast_2d(jnp.asarray(z_u)))
        return [n for n in self.observed_names + self.latent_names
                if n in ok and not bool(np.all(np.asarray(ok[n])))]

    def check_finite_at(self, theta_c, z_u_flat, args, kwargs) -> None:
        """Raise a ``ValueError`` naming the site whose log-density is not finite at the
        initial point (NaN or infinite data, a value outside the support)."""
        zc, _ = self.constrain_z(z_u_flat)
        with validation_enabled(False):  # the message below says more than NumPyro's
            lps, tr = compute_log_probs(self.model, args, kwargs, {**theta_c, **zc},
                                        sum_log_prob=False)
        for n in self.observed_names + self.latent_names:
            lp = np.asarray(lps[n])
            if not np.all(np.isfinite(lp)):
                bad = np.argwhere(~np.isfinite(lp))
                where = ", ".join(str(tuple(int(i) for i in b)) for b in bad[:5])
                kind = "observed" if n in self.observed_names else "latent"
                raise ValueError(
                    f"SAEM: the log-density of {kind} site '{n}' is not finite at the initial "
                    f"parameters (at index {where}{' ...' if len(bad) > 5 else ''}). Check the "
                    f"data of '{n}' and its covariates (NaN, inf, a value outside the support "
                    f"of {type(tr[n]['fn']).__name__}) and the initial values of the params "
                    "(`init_params`)."
                )


def _dist_name(fn) -> str:
    """Name of a distribution, through the wrappers that ``plate``/``expand``/``to_event``/
    ``mask`` add (``ExpandedDistribution(Bernoulli)`` -> ``Bernoulli``)."""
    while hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return type(fn).__name__


def _holds_tracer(obj, depth: int = 0, seen: set | None = None) -> bool:
    """Whether a tracer may be reachable from ``obj`` (containers, and the attributes of
    objects: a distribution's parameters, a constraint's bounds), a few levels deep; ``True``
    (as if it were) past a few thousand objects."""
    if isinstance(obj, jax.core.Tracer):
        return True
    if depth > 6 or obj is None or isinstance(
            obj, str | bytes | int | float | bool | complex | np.ndarray | jax.Array | type
            | types.ModuleType | types.FunctionType | types.BuiltinFunctionType):
        return False
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if len(seen) > 5000:
        return True
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return any(_holds_tracer(v, depth + 1, seen) for v in items)


def _distributions(obj, out: list, depth: int = 0) -> list:
    """The distribution objects in a trace site's ``fn``, wrappers and bases included."""
    if isinstance(obj, dist.Distribution) and depth < 8:
        out.append(obj)
        for v in vars(obj).values():
            _distributions(v, out, depth + 1)
    return out


def _instance_fields(d) -> dict:
    """A distribution's instance attributes, without the lazily cached ones (recomputed on
    use)."""
    lazy = {n for c in type(d).__mro__ for n, v in vars(c).items()
            if type(v).__name__ == "lazy_property"}
    return {k: v for k, v in vars(d).items() if k not in lazy}


def _compiled_trace(model, args, kwargs, key):
    """The model's seeded trace computed by one compiled program (:func:`jit_once`) instead
    of operation by operation: run eagerly, the first trace of a model compiles every
    operation of its body as a program of its own (161 programs, 6.2 s of the first
    ``PKModel`` fit on ``nlme::Quinidine``; one program here).

    The trace comes back with its arrays concrete and its distributions rebuilt from their
    pytree fields (the attributes outside them as the model set them). NumPyro validates a
    distribution's arguments only on concrete values: the program computes the same checks
    for the distributions of the trace. ``None`` -- and the caller traces the model
    eagerly, as NumPyro does, with its errors -- when that would not be the same trace: the
    model reads its data concretely (a plate size from ``int(x.max())``), an argument is
    invalid (the eager trace raises NumPyro's error), or something of the trace does not
    survive the round trip (an object or attribute holding a traced value).
    """
    box: dict = {}

    def first_trace(arrs, k):
        a, kw = merge_data(arrs, static)
        tr = trace(seed(model, k)).get_trace(*a, **kw)
        leaves, treedef = jax.tree.flatten(tr)
        traced = [isinstance(v, jax.core.Tracer) for v in leaves]
        box["treedef"] = treedef
        box["fixed"] = [None if t else v for v, t in zip(leaves, traced, strict=True)]
        box["traced"] = traced
        dists = {n: _distributions(s["fn"], []) for n, s in tr.items() if s["type"] == "sample"}
        box["fields"] = {n: [(type(d), _instance_fields(d)) for d in ds]
                         for n, ds in dists.items()}
        # NumPyro's validation of the distributions' arguments (on by default), which a
        # trace skips: computed here, checked below
        valid = [jnp.all(d.arg_constraints[p](v))
                 for ds in dists.values() for d in ds if d._validate_args
                 for p, v in d.get_args().items()
                 if not constraints.is_dependent(d.arg_constraints[p])]
        return [v for v, t in zip(leaves, traced, strict=True) if t], valid

    try:
        arrays, static = split_data(args, kwargs)
        out, valid = jit_once(first_trace)(arrays, key)
    except Exception:  # noqa: BLE001 -- the model needs concrete data: traced eagerly
        return None
    if not all(bool(v) for v in valid) or any(_holds_tracer(v) for v in box["fixed"]):
        return None  # an invalid argument: the eager trace raises NumPyro's error
    it = iter(out)
    tr = jax.tree.unflatten(box["treedef"], [next(it) if t else v for v, t in zip(
        box["fixed"], box["traced"], strict=True)])
    for n, fields in box["fields"].items():
        ds = _distributions(tr[n]["fn"], [])
        if len(ds) != len(fields) or any(type(d) is not t
                                         for d, (t, _) in zip(ds, fields, strict=True)):
            return None
        for d, (_, f) in zip(ds, fields, strict=True):
            # attributes outside the pytree fields (Independent's `reparametrized_params`):
            # as the model set them, unless they hold a traced value
            for k, v in f.items():
                if k not in vars(d):
                    if _holds_tracer(v):
                        return None
                    setattr(d, k, v)
    return tr


def _trace_model(model, args, kwargs, key):
    """Trace of the model on its data (one compiled program where possible:
    :func:`_compiled_trace`); a site that does not fit its plate (NumPyro's bare
    ``Incompatible shapes for broadcasting``) becomes an error naming the site, the plate
    and the sizes."""
    tr = _compiled_trace(model, args, kwargs, key)
    if tr is not None:
        return tr
    try:
        return trace(seed(model, key)).get_trace(*args, **kwargs)
    except AssertionError as err:
        # NumPyro's bare `assert size > 0, "size of plate should be positive"`
        if "plate should be positive" not in str(err):
            raise
        raise ValueError(
            "SAEM: a plate of the model has size 0" + _empty_data_note(args, kwargs)
            + ". SAEM needs at least one subject (and one observation) to estimate "
            "anything: check the data passed to SAEM.run (a filter that removed every "
            "row, the wrong column)."
        ) from err
    except ValueError as err:
        msg = _plate_mismatch_message(err) or _invalid_param_message(model, args, kwargs, key,
                                                                     err)
        if msg is None:
            raise
        raise ValueError(msg) from err


def _empty_data_note(args, kwargs) -> str:
    """``" (empty data: x of shape (0,), ...)"`` for the array arguments with no element."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    empty = [f"{n} of shape {tuple(np.shape(v))}" for n, v in named
             if hasattr(v, "shape") and hasattr(v, "dtype") and np.size(v) == 0]
    return f" (empty data: {', '.join(empty)})" if empty else ""


def _check_not_empty(latents: dict, observed: dict, args, kwargs) -> None:
    """Refuse a latent site with no element (zero subjects) and a model with no
    observation: there is nothing to estimate, and the E-step's reductions over zero
    elements fail with bare errors."""
    for n, s in latents.items():
        if int(np.size(s["value"])) == 0:
            raise ValueError(
                f"SAEM: latent site '{n}' has no element (shape "
                f"{tuple(jnp.shape(s['value']))}): zero subjects"
                + _empty_data_note(args, kwargs) + ". SAEM needs at least one subject to "
                "estimate anything: check the data passed to SAEM.run (a filter that "
                "removed every row, the wrong column)."
            )
    if observed and all(int(np.size(s["value"])) == 0 for s in observed.values()):
        raise ValueError(
            f"SAEM: the observed site{'s' if len(observed) > 1 else ''} "
            + ", ".join(f"'{n}'" for n in sorted(observed)) + " have no element: zero "
            "observations" + _empty_data_note(args, kwargs) + ". SAEM fits a model to data: "
            "check the data passed to SAEM.run."
        )


def _invalid_param_message(model, args, kwargs, key, err: BaseException) -> str | None:
    """For NumPyro's bare ``<Dist> distribution got invalid <arg> parameter`` (argument
    validation, e.g. a NaN covariate in a mean): the site and the elements, found by tracing
    the model again without validation; ``None`` if that does not find them."""
    if "distribution got invalid" not in str(err):
        return None
    try:
        with validation_enabled(False):
            tr = trace(seed(model, key)).get_trace(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- the original error is re-raised
        return None
    for n, site in tr.items():
        if site["type"] != "sample":
            continue
        d = site["fn"]
        while d is not None:
            for arg, c in getattr(d, "arg_constraints", {}).items():
                if constraints.is_dependent(c) or arg not in d.__dict__:
                    continue
                v = getattr(d, arg)
                try:
                    bad = ~np.asarray(c(v), bool)
                except Exception:  # noqa: BLE001 -- a constraint that cannot be checked here
                    continue
                if not np.any(bad):
                    continue
                idx = np.argwhere(np.atleast_1d(bad))
                where = ", ".join(str(tuple(int(i) for i in b)) for b in idx[:5])
                what = ("NaN or inf" if not np.all(np.isfinite(np.asarray(v, float)))
                        else f"outside {c}")
                kind = "observed site" if site["is_observed"] else "site"
                return (
                    f"SAEM: the distribution of {kind} '{n}' ({_dist_name(d)}) has an invalid "
                    f"`{arg}` parameter ({what}, at index {where}"
                    f"{' ...' if len(idx) > 5 else ''}) when the model runs on these data at "
                    f"the initial params. Check the data that enter '{n}' (covariates, "
                    "indices) for NaN or inf: drop (or impute) those rows, or mask them with "
                    "`numpyro.handlers.mask`; and check the initial values of the params."
                )
            d = getattr(d, "base_dist", None)
    return None


def _plate_mismatch_message(err: BaseException) -> str | None:
    """The site and plate of a failed ``plate.process_message`` (read from the traceback of
    the error, the only place NumPyro leaves them), as a message; ``None`` if the error did
    not come from a plate."""
    from numpyro.primitives import plate as plate_cls

    found = None
    tb = err.__traceback__
    while tb is not None:
        loc = tb.tb_frame.f_locals
        if isinstance(loc.get("self"), plate_cls) and isinstance(loc.get("msg"), dict):
            found = loc
        tb = tb.tb_next
    if found is None:
        return None
    pl, msg = found["self"], found["msg"]
    name = msg.get("name")
    bshape = tuple(found.get("dist_batch_shape", getattr(msg.get("fn"), "batch_shape", ())))
    data = ""
    if msg.get("is_observed"):
        data = f", its observed data shape {tuple(jnp.shape(msg['value']))}"
    return (
        f"SAEM: sample site '{name}' does not fit plate '{pl.name}' (size {pl.size}, dim "
        f"{pl.dim}): its distribution has batch shape {bshape}{data}. A plate needs one "
        f"element per row of the data it holds: make the size of plate '{pl.name}' the "
        f"length of the data of '{name}' (e.g. `numpyro.plate('{pl.name}', len(y))`), and "
        f"check the arrays that index or broadcast into '{name}' (an integer subject "
        "index, covariates) have that length too."
    )


def _has_false_mask(fn) -> bool:
    """Whether a (wrapped) distribution carries a mask with a False entry."""
    d = fn
    while True:
        if isinstance(d, dist.MaskedDistribution):
            m = d._mask
            if (m is False) or (not isinstance(m, bool) and not bool(np.all(np.asarray(m)))):
                return True
            d = d.base_dist
        elif isinstance(d, dist.Independent | dist.ExpandedDistribution):
            d = d.base_dist
        else:
            return False


def _check_observed(name, site) -> None:
    value = site["value"]
    fn = site["fn"]
    shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    vshape = tuple(jnp.shape(value))
    if vshape != shape:
        plates = ", ".join(f"'{f.name}' (size {f.size})" for f in site["cond_indep_stack"])
        # the plates whose size differs from the data along their dim
        off = [
            f"plate '{f.name}' has size {f.size} but the data have {vshape[ax]} along dim "
            f"{f.dim}"
            for f in site["cond_indep_stack"]
            if f.dim is not None
            and 0 <= (ax := len(vshape) - fn.event_dim + f.dim) < len(vshape)
            and len(vshape) == len(shape) and vshape[ax] != f.size
        ]
        raise ValueError(
            f"SAEM: observed site '{name}' has data of shape {vshape} but its distribution has "
            f"shape {shape}" + (f" (plates {plates})" if plates else "")
            + (f": {'; '.join(off)}" if off else "") + ". Give one "
            "observation per element of the site: match the plate sizes to the length of the "
            "data (a broadcast observation would be counted more than once)."
        )
    if jnp.issubdtype(jnp.result_type(value), jnp.floating):
        v = np.asarray(value)
        mask = getattr(fn, "_mask", None)
        bad = ~np.isfinite(v)
        if mask is not None and not isinstance(mask, bool):
            # the mask is over the batch dims: align it with the value's event dims
            m = np.broadcast_to(np.asarray(mask), tuple(fn.batch_shape))
            bad = bad & np.broadcast_to(m.reshape(m.shape + (1,) * fn.event_dim), bad.shape)
        if np.any(bad):
            idx = np.argwhere(bad)
            where = ", ".join(str(tuple(int(i) for i in b)) for b in idx[:5])
            raise ValueError(
                f"SAEM: observed site '{name}' has {int(bad.sum())} non-finite value(s) "
                f"(NaN or inf) at index {where}{' ...' if len(idx) > 5 else ''}. Drop (or "
                "impute) those rows, or mask them with `numpyro.handlers.mask` / "
                "`dist.mask(...)` and put a finite placeholder in the data."
            )


# ------------------------------------------------------------------------------ subjects
class SubjectLayout(NamedTuple):
    """Where the subjects are.

    - **plate** -- the plate holding every latent site (``None`` when there is none: one
      block, the whole model).
    - **n** -- number of subjects (blocks).
    - **q** -- latent coordinates per subject (unconstrained; the largest group's).
    - **zidx** -- ``(n, q)`` flat indices of each subject's coordinates in :math:`z` (``-1``:
      a padded entry of a smaller group, see :func:`pad_mask`).
    - **site_ids** -- for every sample site, the subject of each element of its elementwise
      log-density (``-1``: an element that depends on no latent, e.g. a row of data with
      no random effect); a tuple of ``(name, array)``.
    - **outside** -- the sites outside the plate, whose subjects were found from the
      derivatives (long format); they are found again for new data by
      ``ids_program(arrays, key) -> (ids, error)`` (compiled once).
    """

    plate: str | None
    n: int
    q: int
    zidx: np.ndarray
    site_ids: tuple
    outside: tuple = ()
    ids_program: object = None

    @property
    def ids(self) -> dict:
        return dict(self.site_ids)


def _latent_plate(info: ModelInfo, name: str | None):
    frames = [{f.name: f for f in info.trace0[n]["cond_indep_stack"]} for n in info.latent_names]
    common = set(frames[0])
    for f in frames[1:]:
        common &= set(f)
    if name is not None:
        if name not in common:
            raise ValueError(
                f"subject_plate={name!r} does not contain every latent site of the model "
                f"(plates of the latent sites: {sorted(set().union(*frames))})."
            )
        return name, frames[0][name].size
    if not common:
        return None, 1
    best = min(common, key=lambda n: frames[0][n].dim)
    return best, frames[0][best].size


def joint_layout(info: ModelInfo) -> SubjectLayout:
    """One block: the whole latent vector (no subject structure)."""
    return SubjectLayout(None, 1, info.dim_z, np.arange(info.dim_z)[None, :], ())


def _elementwise_lps(info, theta_c, z_u_flat, args, kwargs):
    zc, _ = info.constrain_z(z_u_flat)
    return info.site_log_probs({**theta_c, **zc}, args, kwargs)


def subject_layout(info: ModelInfo, name: str | None, args, kwargs, key,
                   max_block: int = 64) -> tuple[SubjectLayout | None, str]:
    """The subject layout of the model, or ``(None, reason)``.

    The subjects are the plate holding every latent site (``name``, or the outermost such
    plate). Each latent site must keep its shape in unconstrained space. For a site inside
    the plate the subject of each log-density element is its index along the plate; for a
    site outside it (long format), the subject is found from the derivative of each element
    with respect to each subject's latents (two random points, so that an accidental zero
    derivative is not taken for independence); an element that depends on two subjects means
    the model does not factorise over them.
    """
    plate, n = _latent_plate(info, name)
    if plate is None:
        # latents in several plates (grouping factors): their connected groups; a latent in
        # no plate at all leaves the model as one joint block, as before
        if name is None and all(info.trace0[nm]["cond_indep_stack"]
                                for nm in info.latent_names):
            return group_layout(info, args, kwargs, key, max_block=max_block)
        return None, "no plate holds every latent site"
    for nm in info.latent_names:
        if info.z_shapes[nm] != info.z_u_shapes[nm]:
            return None, f"latent site '{nm}' changes shape in unconstrained space"
    # subject of every flat z coordinate
    zid = {}
    for nm in info.latent_names:
        s = info.trace0[nm]
        fr = {f.name: f for f in s["cond_indep_stack"]}
        shape = info.z_u_shapes[nm]
        axis = len(shape) - s["fn"].event_dim + fr[plate].dim
        if axis < 0 or shape[axis] != n:
            return None, f"latent site '{nm}' does not carry the subject axis"
        view = [1] * len(shape)
        view[axis] = n
        zid[nm] = np.broadcast_to(np.arange(n).reshape(view), shape)
    flat_ids = np.asarray(ravel_pytree({k: jnp.asarray(v) for k, v in zid.items()})[0]).astype(
        np.int64)
    counts = np.bincount(flat_ids, minlength=n)
    if np.any(counts != counts[0]) or counts[0] == 0:
        return None, "subjects have different numbers of latent coordinates"
    q = int(counts[0])
    zidx = np.stack([np.nonzero(flat_ids == i)[0] for i in range(n)])
    theta_c = info.theta0_c
    z0 = info.z0_u_flat
    # shapes only: traced abstractly (an eager evaluation dispatches and compiles op by op)
    lps0 = jax.eval_shape(lambda z: _elementwise_lps(info, theta_c, z, args, kwargs), z0)
    site_ids = {}
    outside = []
    for nm in info.latent_names + info.observed_names:
        s = info.trace0[nm]
        fr = {f.name: f for f in s["cond_indep_stack"]}
        shape = jnp.shape(lps0[nm])
        if plate in fr:
            axis = len(shape) + fr[plate].dim
            if axis < 0 or shape[axis] != n:
                return None, f"the log-density of site '{nm}' does not carry the subject axis"
            view = [1] * len(shape)
            view[axis] = n
            site_ids[nm] = np.broadcast_to(np.arange(n).reshape(view), shape).astype(np.int32)
        elif nm in info.latent_names:
            return None, f"latent site '{nm}' is outside the subject plate"
        else:
            outside.append(nm)
    lay = SubjectLayout(plate, int(n), q, zidx, (), tuple(outside))
    if outside:
        arrays, static = split_data(args, kwargs, info.static_data)
        fn = outside_ids_program(info, lay, static)
        lay = lay._replace(ids_program=fn)
        ids, err = fn(arrays, key)
        if err:
            return None, err
        site_ids.update({k: np.asarray(v) for k, v in ids.items()})
    return lay._replace(site_ids=tuple(sorted(site_ids.items()))), ""


#: most coordinates of the padded layout, as a multiple of the real ones, that
#: :func:`group_layout` accepts (the padding costs work in proportion). Judged on the total,
#: not the ratio of the biggest to the smallest group: lme4's grouseticks with three nested
#: intercepts (location / brood / chick, 584 latents in 63 locations of 3 to 29) pads to 1827
#: (3.1x), where a ratio of 4 refused it and the fit fell back to one joint block (exact
#: -2LL 0.54-0.82 above the minimum on seeds 0-1, fixed effects 0.5 SE off)
MAX_PADDING = 4
#: largest single connected group (crossed factors) laid out as one "subject" -- with the
#: subjects' defaults: the centring shift of the fixed effects (:func:`centring_design`;
#: without it the intercept and the crossed effects trade off and the intercept converges at
#: EM's slow rate), 50 chains; a larger one is the joint block (2 chains, no centring). It
#: was 512: lme4's InstEval with 60 lecturers (1394 students crossed with them, one group
#: of 1454 latents) fell back to the joint block, and seeds 0-3 ended 0.03-0.17 above the
#: exact -2LL minimum with two of them off the targets (seed 0's student variance 0.35 SE,
#: with no warning); laid out as one group they end 0.001-0.005 above it, every estimate
#: within 0.06 SE, in 36-64 s against 14-33 s. As large as the group analysis goes.
MAX_ONE_GROUP_DIM = 4096
#: most latent coordinates for which :func:`group_layout` computes the dependency structure
#: (one directional derivative of the model's log-density per coordinate)
MAX_GROUP_ANALYSIS_DIM = 4096
#: most (latent coordinate, log-density element) pairs of that analysis (its memory)
MAX_GROUP_ANALYSIS_SIZE = 2e7


def _union_find_groups(dz: int, pairs: np.ndarray) -> np.ndarray:
    """Connected components of ``dz`` nodes joined by the edges ``pairs`` ``(m, 2)``:
    a component label per node, numbered in the order of each component's first node."""
    parent = np.arange(dz)

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in pairs:
        ra, rb = find(int(a)), find(int(b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    roots = np.array([find(i) for i in range(dz)])
    _, labels = np.unique(roots, return_inverse=True)
    return labels.astype(np.int64)


def group_layout(info: ModelInfo, args, kwargs, key,
                 max_block: int = 64) -> tuple[SubjectLayout | None, str]:
    r"""The layout of a model whose latents lie in several plates (crossed or nested grouping
    factors): the *groups* are the connected components of the bipartite graph joining each
    latent coordinate to the log-density elements (of every sample site, latent or observed)
    that depend on it, found from the sparsity of the derivatives at two random points.

    Nested factors (batches with the casks of each batch; subjects with their occasions)
    give one group per top-level unit, holding its own latent and those of the units nested
    in it; crossed factors couple everything into one group (returned as ``(None, reason)``:
    the joint layout is that group). :math:`p(y, z\mid\theta) = \prod_g p(y_g, z_g\mid
    \theta)` holds over the groups by construction, which is all the E-step, the M-step's
    centring and the likelihood need of a "subject". Groups of unequal sizes (a different
    number of latents per group: herds with different numbers of observation-level effects)
    are padded to the largest (:func:`pad_mask`), up to :data:`MAX_PADDING` times as many
    coordinates in all as the real ones.
    """
    for nm in info.latent_names:
        if info.z_shapes[nm] != info.z_u_shapes[nm]:
            return None, f"latent site '{nm}' changes shape in unconstrained space"
    dz = info.dim_z
    if dz > MAX_GROUP_ANALYSIS_DIM:
        return None, (f"no plate holds every latent site, and {dz} latent coordinates are "
                      f"too many to find the groups (at most {MAX_GROUP_ANALYSIS_DIM})")
    names = tuple(info.latent_names + info.observed_names)
    arrays, static = split_data(args, kwargs, info.static_data)
    shapes = jax.eval_shape(lambda z: _elementwise_lps(info, info.theta0_c, z, args, kwargs),
                            info.z0_u_flat)
    n_el = sum(int(np.prod(np.shape(shapes[nm]))) for nm in names)
    if dz * n_el > MAX_GROUP_ANALYSIS_SIZE:
        return None, (f"no plate holds every latent site, and {dz} latent coordinates x "
                      f"{n_el} log-density elements are too many to find the groups (at most "
                      f"{MAX_GROUP_ANALYSIS_SIZE:.0e})")

    @jit_once
    def deps(arrays, key, theta_c, z0):
        a, kw = merge_data(arrays, static)

        def lp_all(zf):
            lps = _elementwise_lps(info, theta_c, zf, a, kw)
            return {nm: jnp.reshape(lps[nm], (-1,)) for nm in names}

        def dep(zf):
            eye = jnp.eye(dz, dtype=zf.dtype)
            return jax.lax.map(lambda v: jax.jvp(lp_all, (zf,), (v,))[1], eye,
                               batch_size=max_block)

        k1, k2 = random.split(key)
        za = z0 + 0.3 * random.normal(k1, z0.shape, z0.dtype)
        zb = z0 + 1.0 * random.normal(k2, z0.shape, z0.dtype)
        d1, d2 = dep(za), dep(zb)
        return {nm: (d1[nm] != 0) | (d2[nm] != 0) for nm in names}  # (dz, size)

    nz = {nm: np.asarray(v) for nm, v in
          deps(arrays, key, info.theta0_c, info.z0_u_flat).items()}
    edges = []
    for nm in names:
        m = nz[nm]
        for col in np.nonzero(m.any(0))[0]:
            rows = np.nonzero(m[:, col])[0]
            if len(rows) > 1:
                edges.append(np.stack([np.repeat(rows[0], len(rows) - 1), rows[1:]], 1))
    pairs = np.concatenate(edges) if edges else np.zeros((0, 2), np.int64)
    labels = _union_find_groups(dz, pairs)
    n = int(labels.max()) + 1
    if n == 1 and dz > MAX_ONE_GROUP_DIM:
        return None, ("no plate holds every latent site, and the latents form one connected "
                      "group (crossed grouping factors): one block")
    counts = np.bincount(labels, minlength=n)
    q = int(counts.max())
    if n * q > MAX_PADDING * dz:
        return None, ("no plate holds every latent site, and the connected groups of latents "
                      f"have very unequal sizes ({int(counts.min())} to {q} coordinates: "
                      f"padded to the largest, {n * q} coordinates for {dz})")
    # groups of unequal sizes are padded to the largest (-1: see pad_mask)
    zidx = np.full((n, q), -1, np.int64)
    for g in range(n):
        c = np.nonzero(labels == g)[0]
        zidx[g, :len(c)] = c
    site_ids = {}
    for nm in names:
        m = nz[nm]
        shape = np.shape(shapes[nm])
        anyd = m.any(0)
        first = np.argmax(m, 0)
        site_ids[nm] = np.where(anyd, labels[first], -1).astype(np.int32).reshape(shape)
    # the plates of the latents of the first group, outermost first, name the grouping
    plates = []
    for nm in info.latent_names:
        for f in info.trace0[nm]["cond_indep_stack"]:
            if f.name not in plates:
                plates.append(f.name)
    label = "groups(" + "/".join(plates) + ")"
    return SubjectLayout(label, n, q, zidx, tuple(sorted(site_ids.items())), names), ""


def _elementwise_logdet(t, u, c):
    """:math:`\\log|J|` of an elementwise transform, one value per element of ``u``
    (an ``IndependentTransform`` is unwrapped to its elementwise base)."""
    while isinstance(t, IndependentTransform):
        t = t.base_transform
    return jnp.broadcast_to(t.log_abs_det_jacobian(u, c), jnp.shape(u))


def outside_ids_program(info: ModelInfo, layout: SubjectLayout, static, max_block: int = 64):
    """A function ``(arrays, key) -> (ids, error)`` finding the subject of every element of
    the sites outside the subject plate (long format) for data of this structure; compiled
    once. ``False`` when every site is inside the plate (nothing depends on the data)."""
    outside = layout.outside
    if not outside:
        return False
    n, q = layout.n, layout.q
    zsub = jnp.asarray(layout.zidx)
    theta_c = info.theta0_c
    z0 = info.z0_u_flat

    # the analysis point (drawn with the run's key) is an argument, not a constant: the
    # program is the same for every key, compiled once
    @jit_once
    def deps(arrays, key, theta_c, z0):
        args, kwargs = merge_data(arrays, static)

        def lp_out(zf):
            lps = _elementwise_lps(info, theta_c, zf, args, kwargs)
            return {nm: lps[nm] for nm in outside}

        def dep(zf, kd):
            # derivative of every element along a random direction supported on one subject
            vals = random.normal(kd, (n, q), zf.dtype) + 2.0
            rows = jnp.zeros((n, zf.size), zf.dtype).at[jnp.arange(n)[:, None], zsub].set(vals)
            return jax.lax.map(lambda v: jax.jvp(lp_out, (zf,), (v,))[1], rows,
                               batch_size=max_block)

        k1, k2, k3 = random.split(key, 3)
        zb = z0 + 0.3 * random.normal(k1, z0.shape, z0.dtype)
        d1, d2 = dep(z0, k2), dep(zb, k3)
        out = {}
        for nm in outside:
            nz = (d1[nm] != 0) | (d2[nm] != 0)  # (n, *shape)
            out[nm] = (jnp.sum(nz, 0), jnp.argmax(nz, 0))
        return out

    def run(arrays, key):
        res = deps(arrays, key, theta_c, z0)
        ids = {}
        for nm in outside:
            cnt, arg = (np.asarray(v) for v in res[nm])
            if np.any(cnt > 1):
                return None, (f"an element of the log-density of site '{nm}' depends on the "
                              "latents of more than one subject")
            ids[nm] = np.where(cnt == 1, arg, -1).astype(np.int32)
        msg = _clamped_subject_index(merge_data(arrays, static), ids, n)
        if msg:
            raise ValueError(msg)
        return ids, ""

    return run


def _clamped_subject_index(data, ids: dict, n: int) -> str:
    """An error message when an integer data argument is a subject index (its in-range
    values are the subjects the rows were found to depend on) with values outside
    ``0..n-1``: JAX indexing clamps them (``>= n`` reads subject ``n-1``, a negative one
    counts from the end) and those rows would silently be fitted to the wrong subject.
    ``data``: the model's ``(args, kwargs)`` (traced and static arrays alike)."""
    args, kwargs = data
    named = [(f"argument {i}", a) for i, a in enumerate(args) if _is_array(a)]
    named += [(f"'{k}'", a) for k, a in kwargs.items() if _is_array(a)]
    for label, a in named:
        if not jnp.issubdtype(jnp.result_type(a), jnp.integer) or np.ndim(a) == 0:
            continue
        v = np.asarray(a)
        for site, sid in ids.items():
            if v.shape != np.shape(sid):
                continue
            inside = (v >= 0) & (v < n)
            if inside.all() or len(np.unique(v[inside])) < 2:
                continue
            if not np.array_equal(v[inside], sid[inside]):
                continue
            bad = np.argwhere(~inside)
            i = tuple(int(j) for j in bad[0])
            return (
                f"SAEM: the integer data {label} indexes the subjects of site '{site}' (its "
                f"values are the subjects those rows depend on), but {len(bad)} of its values "
                f"lie outside 0..{n - 1}, the size of the subject plate (e.g. {int(v[i])} at "
                f"index {i if len(i) > 1 else i[0]}). JAX clamps out-of-range indices without "
                f"an error (an index >= {n} reads subject {n - 1}, a negative one counts from "
                "the end), so these rows would be fitted to the wrong subject. Number the "
                f"subjects 0..{n - 1} (e.g. `pandas.factorize(df.ID)[0]`) and give the plate "
                "the number of subjects."
            )
    return ""


def log_joint_per_subject(info: ModelInfo, layout: SubjectLayout, theta_c, z_u_flat, args,
                          kwargs, observed_only: bool = False, ids: dict | None = None):
    """Per-subject :math:`\\log p(y_i, z_i\\mid\\theta) + \\log|J(z_i)|` of flat unconstrained
    ``z``, and the rest (the terms that depend on no latent).

    :return: ``(per_subject (n,), rest ())``; ``sum(per_subject) + rest`` is the model's log
        joint density (:meth:`ModelInfo.log_joint`). With ``observed_only``: the same for
        :math:`\\log p(y_i\\mid z_i, \\theta)`. With the joint layout (no plate): ``(1,)``.
    :param ids: the subject ids of the site elements as (traced) arrays; default: the
        layout's.
    """
    zu_d = info._unravel_z(z_u_flat)
    zc = {nm: info.latent_transforms[nm](v) for nm, v in zu_d.items()}
    lps = info.site_log_probs({**theta_c, **zc}, args, kwargs)
    names = info.observed_names if observed_only else info.latent_names + info.observed_names
    dt = z_u_flat.dtype
    if layout.plate is None:
        out = sum(jnp.sum(lps[nm]) for nm in names)
        if not observed_only:
            out = out + info.constrain_z(z_u_flat)[1]
        return jnp.reshape(out, (1,)).astype(dt), jnp.zeros((), dt)
    ids = layout.ids if ids is None else ids
    n = layout.n
    out = jnp.zeros(n + 1, dt)
    for nm in names:
        lp = lps[nm]
        i = jnp.asarray(ids[nm])
        lp = jnp.broadcast_to(lp, i.shape).astype(dt)
        seg = jnp.where(i < 0, n, i).reshape(-1)
        out = out + jax.ops.segment_sum(lp.reshape(-1), seg, num_segments=n + 1)
    if not observed_only:
        lj = jnp.concatenate([
            _elementwise_logdet(info.latent_transforms[nm], zu_d[nm], zc[nm]).reshape(-1)
            for nm in info.latent_names
        ]).astype(dt)
        zid = np.empty(info.dim_z, np.int32)
        zx = np.asarray(layout.zidx)
        valid = zx >= 0  # padded entries of unequal groups (-1) hold no coordinate
        zid[zx[valid]] = np.broadcast_to(np.arange(n)[:, None], zx.shape)[valid]
        out = out + jax.ops.segment_sum(lj, jnp.asarray(zid), num_segments=n + 1)
    return out[:n], out[n]


def pad_mask(zidx) -> np.ndarray:
    """``(n, q)`` bool: the padded entries of a layout whose groups have unequal sizes
    (``zidx == -1``). A padded entry is a pseudo-coordinate with a standard normal density,
    independent of everything (it integrates to 1): the E-step draws it afresh and the
    likelihood integrates it out exactly, so equal-size blocks serve unequal groups."""
    return np.asarray(zidx) < 0


def units_per_block(info: ModelInfo, layout: SubjectLayout) -> dict[str, int]:
    """Per latent site, the most random-effect *units* of it in one block: a unit is one
    element of the site's batch shape (its event dimensions, e.g. a random intercept and
    slope written ``.to_event(1)``, are one unit). 1 for a level of random effects with one
    unit per subject; more for a level nested inside the blocks -- the casks of a batch, the
    broods of a location, a subject's occasions (inter-occasion variability),
    observation-level effects."""
    zidx = np.asarray(layout.zidx)
    out, start = {}, 0
    for nm in info.latent_names:  # the flat order of z (ravel_pytree: sorted names)
        size = int(np.prod(info.z_u_shapes[nm], dtype=np.int64))
        batch = int(np.prod(info.trace0[nm]["fn"].batch_shape, dtype=np.int64))
        per_unit = max(1, size // max(1, batch))
        inside = ((zidx >= start) & (zidx < start + size)).sum(1)  # (n,)
        out[nm] = max(1, int(inside.max()) // per_unit) if inside.size else 1
        start += size
    return out


def pad_log_density(xb, zidx):
    """The standard normal log-density of the padded entries of blocks ``xb``
    ``(..., n, q)``, per subject ``(..., n)`` (0 without padding)."""
    mask = pad_mask(zidx)
    if not mask.any():
        return jnp.zeros(xb.shape[:-1], xb.dtype)
    m = jnp.asarray(mask, xb.dtype)
    return jnp.sum(m * (-0.5 * xb**2 - 0.5 * np.log(2.0 * np.pi)), -1)


def _block_kind(zidx) -> str:
    """How the ``(n, q)`` index ``zidx`` (a permutation of the flat latent coordinates) maps
    ``z`` to subject blocks: ``"rows"`` (subject-major, a reshape), ``"cols"``
    (coordinate-major: a reshape and a transpose) or ``"gather"``."""
    zidx = np.asarray(zidx)
    n, q = zidx.shape
    a = np.arange(n * q)
    if np.array_equal(zidx, a.reshape(n, q)):
        return "rows"
    if np.array_equal(zidx, a.reshape(q, n).T):
        return "cols"
    return "gather"


def to_blocks(x, zidx):
    """``(..., d_z) -> (..., n, q)``: the subject blocks of flat latent vectors (a reshape
    where the layout allows it: no gather in the compiled program)."""
    zidx = np.asarray(zidx)
    n, q = zidx.shape
    kind = _block_kind(zidx)
    if kind == "rows":
        return x.reshape(x.shape[:-1] + (n, q))
    if kind == "cols":
        return jnp.swapaxes(x.reshape(x.shape[:-1] + (q, n)), -1, -2)
    if pad_mask(zidx).any():
        return jnp.where(jnp.asarray(zidx < 0), jnp.zeros((), x.dtype),
                         x[..., np.maximum(zidx, 0)])
    return x[..., zidx]


def from_blocks(xb, zidx):
    """Inverse of :func:`to_blocks`: ``(..., n, q) -> (..., d_z)``."""
    zidx = np.asarray(zidx)
    n, q = zidx.shape
    kind = _block_kind(zidx)
    lead = xb.shape[:-2]
    if kind == "rows":
        return xb.reshape(lead + (n * q,))
    if kind == "cols":
        return jnp.swapaxes(xb, -1, -2).reshape(lead + (n * q,))
    valid = zidx.reshape(-1) >= 0
    inv = np.empty(int(valid.sum()), np.int64)
    inv[zidx.reshape(-1)[valid]] = np.nonzero(valid)[0]
    return xb.reshape(lead + (n * q,))[..., inv]


def block_hessian(grad_fn, z, lay):
    """Per-subject Hessian blocks ``(n, q, q)`` of a function whose Hessian is block
    diagonal over subjects: ``q`` Hessian-vector products, one per coordinate of every
    subject at once. Padded entries (:func:`pad_mask`) get the curvature 1 of their standard
    normal pseudo-density (``grad_fn`` is the gradient of a negative log-density)."""
    return block_jet(lambda x: (jnp.zeros(()), grad_fn(x)), z, lay)[2]


def block_jet(value_grad_fn, z, lay):
    """``(value, gradient, Hessian blocks (n, q, q))`` at ``z`` of a function whose Hessian is
    block diagonal over subjects, from one program site: ``value_grad_fn(z) -> (value,
    gradient (d_z,))`` differentiated forward along the ``q`` block coordinates (the value
    and gradient are the primal outputs of those JVPs). Padded entries as
    :func:`block_hessian`."""
    n, q = np.shape(lay.zidx)

    def col(e_k):
        e = from_blocks(jnp.broadcast_to(e_k, (n, q)), lay.zidx)
        (v, g), (_, hv) = jax.jvp(value_grad_fn, (z,), (e,))
        return v, g, to_blocks(hv, lay.zidx)  # (n, q): column k of each block

    v, g, cols = jax.vmap(col, out_axes=(None, None, 0))(jnp.eye(q, dtype=z.dtype))
    H = jnp.transpose(cols, (1, 2, 0))
    H = (H + jnp.swapaxes(H, -1, -2)) / 2.0
    mask = pad_mask(lay.zidx)
    if mask.any():
        H = H + jnp.asarray(mask, H.dtype)[..., None] * jnp.eye(q, dtype=H.dtype)
    return v, g, H


#: :func:`centring_design`: a design point whose gradients exceed this many times the
#: median of the subject's points is scaled down to it.
CENTRING_OUTLIER = 100.0


def centring_design(info: ModelInfo, layout: SubjectLayout, theta_u, z_u_flat, args, kwargs,
                    key, ids: dict | None = None, num_extra: int = 4, rtol: float = 1e-5):
    """The shifts that leave the observation model unchanged: a ``(d_z, d_theta)`` matrix
    :math:`M` such that :math:`\\log p(y\\mid z, \\theta)` depends on :math:`(\\theta_k, z)`
    only through :math:`z + M_{\\cdot k}\\theta_k` (pure JAX; data-dependent, computed in the
    compiled program).

    A model written with zero-mean random effects and the fixed effects in the likelihood
    (lme4's ``y ~ x + (1 | g)`` as ``b ~ Normal(0, tau)``, ``mean = beta0 + beta1 x_i + b_i``)
    is the *non-centred* parametrisation of the same model whose random effects
    :math:`\\phi_i = b_i + X_i\\beta` have mean :math:`X_i\\beta`; EM and SAEM on the
    non-centred form converge very slowly (:math:`\\beta` and :math:`b` trade off; the
    fraction of missing information about :math:`\\beta` is near one). SAEM works in the
    centred coordinates by moving the chains with :math:`\\theta` (:math:`z \\leftarrow z -
    M\\,\\Delta\\theta`) and differentiating the complete-data log-likelihood along
    :math:`z(\\theta') = z - M(\\theta' - \\theta)` -- a shift of unit Jacobian, so every
    choice of :math:`M` is exact; this one is the fast one.

    Found per subject :math:`i` and coordinate :math:`k` from gradients at ``q + num_extra``
    random points: :math:`\\partial_{\\theta_k}\\ell_i = \\nabla_{z_i}\\ell_i\\cdot m_{ik}`
    solved by least squares; entries whose residual exceeds ``rtol`` (relative to the largest
    :math:`|\\partial_{\\theta_k}\\ell_i|` over the points) are 0 (a
    fixed effect of a within-subject covariate, a variance). No subject plate: zeros.
    """
    d, dz = int(theta_u.shape[0]), int(z_u_flat.shape[0])
    dt = z_u_flat.dtype
    if layout.plate is None:
        return jnp.zeros((dz, d), dt)
    q = layout.q
    P = q + num_extra
    k1, k2 = random.split(key)
    thetas = theta_u + 0.2 * jnp.maximum(1.0, jnp.abs(theta_u)) * random.normal(
        k1, (P, d), dt)
    zs = z_u_flat + 0.3 * random.normal(k2, (P, dz), dt)

    def obs_ll(t, z):
        return log_joint_per_subject(info, layout, info.constrain_theta(t), z, args, kwargs,
                                     observed_only=True, ids=ids)[0]

    def grads(t, z):
        gt = jax.jacfwd(obs_ll)(t, z)  # (n, d)
        gz = to_blocks(jax.grad(lambda zz: jnp.sum(obs_ll(t, zz)))(z), layout.zidx)
        return gt, gz

    gt, gz = jax.vmap(grads)(thetas, zs)  # (P, n, d), (P, n, q)
    G = jnp.moveaxis(gz, 0, 1)  # (n, P, q)
    R = jnp.moveaxis(gt, 0, 1)  # (n, P, d)
    # a point whose equations are far larger than the subject's others (CENTRING_OUTLIER x
    # their median) is scaled down to that size (an exact shift holds at every point
    # whatever its scale): unscaled, it set both the least-squares fit and the tolerance
    # below for all the others (Quinidine with time-varying covariates: a covariate
    # coefficient at -0.36 on WEIGHT 119 gave gradients of 3e14 at one point, the tolerance
    # 1e11, and a spurious shift of 1.9e8 on phi_V per unit coefficient -- the chains moved
    # to phi_V = 7e4 and the fit to NaN). Points of ordinary size keep weight 1, so the
    # design of every other model is unchanged (which of several exact shifts the
    # minimum-norm solution picks depends on the weights: an intercept split between
    # nested herd and observation effects). A non-finite point is left out.
    size = (jnp.max(jnp.abs(G), axis=2, keepdims=True)
            + jnp.max(jnp.abs(R), axis=2, keepdims=True))  # (n, P, 1)
    finite_pt = jnp.isfinite(size)
    med = jnp.nanmedian(jnp.where(finite_pt, size, jnp.nan), axis=1, keepdims=True)
    w = jnp.minimum(1.0, CENTRING_OUTLIER * med / (size + 1e-30))
    w = jnp.where(finite_pt & jnp.isfinite(w), w, 0.0)
    G, R = jnp.where(w > 0, G * w, 0.0), jnp.where(w > 0, R * w, 0.0)
    scale = jnp.linalg.norm(G, axis=1) + 1e-30  # (n, q)
    if layout.n == 1 and layout.q > 1 and str(layout.plate).startswith("groups("):
        # one connected group (crossed factors): the shift is not unique (the intercept
        # moves every level of either factor). Put it on the factor with the fewest levels
        # -- the one that leaves the intercept least determined (minimum norm weighted by
        # the number of levels squared), as a centred parametrisation would
        sizes = np.concatenate([np.full(int(np.prod(info.z_u_shapes[nm])),
                                        float(np.prod(info.z_u_shapes[nm])))
                                for nm in info.latent_names])
        scale = scale * jnp.asarray(sizes[np.asarray(layout.zidx)] ** 2, dt)
    Gs = G / scale[:, None, :]
    m = jax.vmap(lambda a, b: jnp.linalg.lstsq(a, b)[0])(Gs, R)  # (n, q, d) scaled
    m = m / scale[:, :, None]
    fit = jnp.einsum("npq,nqd->npd", G, m)
    # the residual is judged against the size of what is explained (R), plus rounding in
    # G m: not against |G||m|, which a spurious, large m would inflate until any fit passed.
    # An exact shift leaves a float32 residual below 5e-7 of max|R| (measured: lme4-style
    # sleepstudy, epil, Theophylline, Dyestuff); a near miss -- log sigma when the residuals
    # at theta_0 are close to linear in the covariate, as on sleepstudy -- 1.4e-3 and up.
    # rtol = 1e-5 lies between them (20x and 140x).
    eps = jnp.finfo(dt).eps
    tol = (rtol * jnp.max(jnp.abs(R), axis=1, keepdims=True)
           + 64.0 * eps * jnp.max(jnp.einsum("npq,nqd->npd", jnp.abs(G), jnp.abs(m)), axis=1,
                                  keepdims=True) + 1e-30)
    ok = jnp.all(jnp.abs(fit - R) <= tol, axis=1)
    ok = ok & jnp.any(jnp.abs(R) > 0, axis=1)  # (n, d)
    m = jnp.where(ok[:, None, :], m, 0.0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return from_blocks(jnp.moveaxis(m, -1, 0), layout.zidx).T  # (d_z, d)


#: up to this many coordinates, :func:`score_hessian` differentiates forward over forward
#: (``d^2`` second-order tangents, no reverse pass); beyond, forward over reverse (``d``
#: Hessian-vector products). The reverse pass of a sparse-superposition PK model transposes
#: its gathers into scatter-adds, slow on XLA:CPU: measured on ``nlme::Quinidine`` (2-core
#: CPU, loaded), the 6 x 6 Hessian of one draw in 8.8 ms forward-over-forward against 23 ms
#: forward-over-reverse, the 2 x 2 one of the SA-Newton coordinates of two chains in 9.1 ms
#: against 14.7 ms
FORWARD_HESSIAN_MAX = 8

#: the same bound for a function with a loop (``scan``, ``while``: e.g. the record-by-record
#: amounts of a PK model with time-varying covariates, ``nlme.timevarying``), whose forward
#: tangents each carry the loop's work while one reverse pass runs it back once: measured on
#: ``nlme::Quinidine`` with GLYCO and WEIGHT in force at each record (136 subjects, idle
#: 2-core CPU), the Hessian in 2 / 4 / 8 coordinates took 3.6 / 9.1 / 46 ms forward over
#: forward against 5.0 / 6.9 / 9.5 ms forward over reverse, the gradient in 8 coordinates
#: 3.4 ms forward against 1.9 ms reverse (the same model without the covariates, no loop:
#: 7.9 against 10.1 ms in 8 coordinates)
FORWARD_HESSIAN_MAX_LOOP = 2

_LOOP_PRIMITIVES = frozenset({"scan", "while"})


def _has_loop(jaxpr) -> bool:
    """Whether a jaxpr (or any jaxpr nested in its equations' parameters: ``jit``, ``cond``
    branches, custom derivatives, ...) contains a ``scan`` or ``while`` loop."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _LOOP_PRIMITIVES:
            return True
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns") and _has_loop(sub):
                    return True
    return False


def prefer_forward(f: Callable, x: jax.Array, info: ModelInfo | None = None) -> bool:
    """Whether the derivatives of a scalar function ``f`` in its ``d`` coordinates ``x``
    ``(d,)`` are cheaper in forward mode (a ``jacfwd`` gradient, :func:`score_hessian`
    forward over forward): ``d <= FORWARD_HESSIAN_MAX``, or ``FORWARD_HESSIAN_MAX_LOOP``
    when ``f`` runs a loop. One extra trace of ``f`` decides, from its jaxpr -- once per
    :class:`ModelInfo` when ``f`` is a function of that model's log density (``info``; the
    loops are the model's) -- so the choice depends on the program only, never on timings,
    and a run is reproducible."""
    d = x.shape[0]
    if d > FORWARD_HESSIAN_MAX:
        return False
    if d <= FORWARD_HESSIAN_MAX_LOOP:
        return True
    loop = None if info is None else getattr(info, "_has_loop", None)
    if loop is None:
        loop = _has_loop(jax.make_jaxpr(f)(x).jaxpr)
        if info is not None:
            info._has_loop = loop
    return not loop


def score_hessian(f: Callable, x: jax.Array, forward: bool | None = None,
                  info: ModelInfo | None = None) -> tuple[jax.Array, jax.Array]:
    """Gradient ``(d,)`` and Hessian ``(d, d)`` of a scalar function ``f`` at ``x`` ``(d,)``:
    forward over forward mode when :func:`prefer_forward` (or ``forward``) says so
    (:math:`H_{jk} = \\partial_j\\partial_k f` from the ``d x d`` directional derivatives
    of the JVPs), else the gradient and :func:`jax.hessian` (forward over reverse). The two
    are the same derivatives, up to rounding."""
    if forward is None:
        forward = prefer_forward(f, x, info)
    if forward:
        g = jax.jacfwd(f)

        def g2(y):
            v = g(y)
            return v, v

        H, g0 = jax.jacfwd(g2, has_aux=True)(x)
        return g0, H
    return jax.grad(f)(x), jax.hessian(f)(x)


def centred_score_hess(info: ModelInfo, theta_u, z, args, kwargs, M, idx=None):
    """Per row of ``z`` ``(S, d_z)``: the complete-data score ``(S, d)`` and Hessian
    ``(S, d, d)`` in :math:`\\theta` (unconstrained), differentiated along the centred
    coordinates :math:`z(t) = z - M(t - \\theta)` (:func:`centring_design`; a shift of unit
    Jacobian, so the Louis identity holds for every ``M``; ``M = 0``: the model's own
    coordinates). With ``idx`` (static indices, ``k`` of them): the score ``(S, k)`` and
    Hessian ``(S, k, k)`` in the coordinates ``theta[idx]`` only (the others held at
    ``theta_u``), at the cost of ``k`` rather than ``d`` coordinates (:func:`score_hessian`)."""
    sub = None if idx is None else jnp.asarray(np.asarray(idx, np.int32))

    def one(zf):
        def f(x):
            t = x if sub is None else theta_u.at[sub].set(x)
            return info.log_joint(t, zf - M @ (t - theta_u), args, kwargs)

        return score_hessian(f, theta_u if sub is None else theta_u[sub], info=info)

    return jax.vmap(one)(z)
