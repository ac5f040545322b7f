"""The key of a SAEM run that determines its programs: a repeated run replays them without
tracing (:func:`numpyro_fed._programs.replay_scope`).

Every :meth:`SAEM.run <numpyro_fed.saem.SAEM.run>` traces its programs afresh and takes the
compiled ones from the cache keyed by their content, so that no run gets a program of other
code or data (:mod:`numpyro_fed._programs`). Tracing is most of a repeated fit's time on small
data (Theophylline: ~2.8 of 4.2 s). A run whose key equals an earlier run's prepares the
same programs in the same order, so it takes them from that run instead, without tracing:

- **the model, by value**: the fingerprint of the jaxpr of one full run of the model on
  these data (:func:`model_fingerprint`: every site's value, distribution -- all its
  parameters and its class --, elementwise log-density, a draw from it, the transform of its
  support, scale and mask; every deterministic site; the plates; the return value), the
  data closed over as constants, so that a global, a closure or an array changed in place
  that the model reads changes the key;
- **the data by content** (every array's bytes) and the structure of the arguments;
- **the settings by value** (a setting that is not a plain value -- a user's kernel,
  M-step or init strategy other than NumPyro's and this library's own -- turns replay off);
- **the library's configuration**: every upper-case module constant of ``numpyro_fed`` (the
  tuning constants a test or a user may change), NumPyro's validation flag, JAX's
  configuration;
- the random key's type (not its value: programs take keys as arguments).

The run adds what it finds about the model before its first program (which data it reads
concretely). What this cannot see: a model whose behaviour under SAEM's effect handlers is
not that of its plain run (one that inspects NumPyro's handler stack); a library function
monkeypatched between runs. The test suite traces every replayed program anyway and raises
if it is not the recorded one (``NUMPYRO_FED_VERIFY_TRACE_KEYS=1``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import sys
import types
from typing import Any

import jax
import numpy as np
from numpyro.distributions import distribution as _distribution
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, trace

from numpyro_fed import _programs

__all__ = ["run_key", "model_fingerprint"]


class _NoKey(Exception):
    """Something that cannot be keyed by value: no replay for this run."""


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _value(v: Any, depth: int = 0) -> Any:
    """A hashable fingerprint of ``v`` by value, or :class:`_NoKey`."""
    if depth > 16:
        raise _NoKey("nested too deep")
    if isinstance(v, _PLAIN):
        return (type(v).__name__, v)
    if isinstance(v, (np.ndarray, np.generic, jax.Array)):
        if isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            return ("key", str(jax.typeof(v)), _digest(jax.random.key_data(v)))
        weak = bool(getattr(jax.typeof(v), "weak_type", False)) if isinstance(v, jax.Array) \
            else False
        return (type(v).__name__, weak, _digest(v))
    if isinstance(v, enum.Enum):
        return (type(v).__module__, type(v).__qualname__, v.name)
    if isinstance(v, dict):
        return ("dict", tuple((_value(k, depth + 1), _value(u, depth + 1))
                              for k, u in sorted(v.items(), key=lambda kv: repr(kv[0]))))
    if isinstance(v, (tuple, list)):
        return (type(v).__module__, type(v).__qualname__,
                tuple(_value(u, depth + 1) for u in v))
    if isinstance(v, (frozenset, set)):
        return ("set", tuple(sorted(repr(_value(u, depth + 1)) for u in v)))
    if isinstance(v, functools.partial):
        return ("partial", _value(v.func, depth + 1), _value(v.args, depth + 1),
                _value(v.keywords, depth + 1))
    if isinstance(v, types.FunctionType):
        mod = getattr(v, "__module__", "") or ""
        if not mod.startswith(("numpyro.", "numpyro_fed.", "jax.")):
            raise _NoKey(f"a function of module {mod!r}")
        cells = tuple(_value(c.cell_contents, depth + 1) for c in v.__closure__ or ())
        return ("fn", mod, v.__qualname__, v.__code__, cells)
    fields = getattr(type(v), "__dataclass_fields__", None)
    if fields is not None:
        return (type(v).__module__, type(v).__qualname__,
                tuple((k, _value(getattr(v, k), depth + 1)) for k in fields))
    raise _NoKey(f"a value of type {type(v).__name__}")


def _digest(x) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    _programs._array_digest(h, x)
    return h.digest()


def _library_constants() -> tuple:
    """Every upper-case module constant of ``numpyro_fed`` with a plain value, by value."""
    out = []
    for name in sorted(m for m in sys.modules if m == "numpyro_fed"
                       or m.startswith("numpyro_fed.")):
        mod = sys.modules[name]
        for k, v in sorted(vars(mod).items()):
            if k.lstrip("_").isupper() and _immutable(v):
                out.append((name, k, _value(v)))
    return tuple(out)


def _immutable(v) -> bool:
    """A plain immutable value (tuning constants; not the caches and counters)."""
    if isinstance(v, _PLAIN + (enum.Enum,)):
        return True
    if isinstance(v, (tuple, frozenset)):
        return all(_immutable(u) for u in v)
    return False


def _data(args, kwargs) -> tuple:
    """The arguments by content: arrays by their bytes, plain values by value, other
    objects (e.g. :class:`~numpyro_fed.nlme.model.Binding`, which holds a structural model)
    by their type: the library gives them to the model and nothing else, so what they make
    the model compute is in the model's fingerprint (:func:`model_fingerprint`, which runs
    the model on them)."""
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    out = []
    for x in leaves:
        try:
            out.append(_value(x))
        except _NoKey:
            out.append(("object", type(x).__module__, type(x).__qualname__))
    return (treedef, tuple(out))


def model_fingerprint(model, args, kwargs, rng_key) -> tuple:
    """A fingerprint of what the model computes on these data: the jaxpr (by value,
    constants included) of one seeded run of it with every array argument closed over,
    whose outputs are every site's value, distribution parameters, elementwise
    log-density, a draw from the distribution, the transform of its support and its scale
    and mask, every deterministic value and the model's return value; with the sites'
    names, types, distribution classes and structure, plates and transforms. Raises
    :class:`_NoKey` for a model it cannot read."""
    meta: list = []

    def probe(key):
        with trace() as tr:
            ret = seed(model, key)(*args, **kwargs)
        outs = [ret]
        for i, (name, site) in enumerate(tr.items()):
            kind = site["type"]
            m = [name, kind, bool(site.get("is_observed", False)),
                 repr(sorted((site.get("infer") or {}).items())),
                 tuple((f.name, f.dim, f.size) for f in site.get("cond_indep_stack", ())),
                 len(site.get("intermediates") or ())]
            outs.append(site.get("value"))
            for field in ("scale", "mask"):
                v = site.get(field)
                if isinstance(v, (jax.Array, np.ndarray)):
                    outs.append(v)
                else:
                    m.append(repr(v))
            a, k = site.get("args", ()), dict(site.get("kwargs") or {})
            c = k.pop("constraint", None)
            arr = jax.tree.leaves((a, k), is_leaf=lambda x: x is None)
            m.append(tuple(repr(x) for x in arr
                           if not isinstance(x, (jax.Array, np.ndarray))))
            outs.append([x for x in arr if isinstance(x, (jax.Array, np.ndarray))])
            fn = site.get("fn")
            if kind == "sample":
                leaves, tdef = jax.tree.flatten(fn)
                m.append(tdef)
                m.append((type(fn).__module__, type(fn).__qualname__))
                outs.append(leaves)
                v = site["value"]
                outs.append(fn.log_prob(v))
                c = fn.support
                try:
                    outs.append(fn.sample(jax.random.fold_in(key, i)))
                except NotImplementedError:
                    m.append("no sample")
            if c is not None:
                m.append((type(c).__module__, type(c).__qualname__))
                try:
                    t = biject_to(c)
                except NotImplementedError:
                    m.append("no transform")
                else:
                    v = site["value"]
                    u = t.inv(v)
                    outs += [u, t(u), t.log_abs_det_jacobian(u, t(u))]
                    m.append((type(t).__module__, type(t).__qualname__))
            meta.append(tuple(m))
        return outs

    traced = jax.jit(probe).trace(rng_key)
    h = hashlib.blake2b(digest_size=32)
    try:
        _programs._feed_jaxpr(h, traced.jaxpr.jaxpr, traced.jaxpr.consts, 0)
    except _programs._Unkeyable as err:
        raise _NoKey(str(err)) from err
    key = (h.digest(), traced.out_tree, tuple(meta))
    hash(key)
    return key


def run_key(saem, rng_key, args, kwargs, extra: Any) -> tuple | None:
    """The key of a run of ``saem`` (a :class:`~numpyro_fed.saem.SAEM`) on these data, or
    ``None`` when something in it cannot be keyed by value (then the run traces every
    program, as without a key). ``extra``: the run's other arguments, by value."""
    try:
        settings = tuple((k, _value(v)) for k, v in sorted(vars(saem).items())
                         if k not in ("model", "program"))
        key = (
            settings,
            _value(extra),
            _data(args, kwargs),
            str(jax.typeof(rng_key)),
            _library_constants(),
            bool(_distribution._VALIDATION_ENABLED),
            _programs._config_fingerprint(),
            jax.default_backend(),
            model_fingerprint(saem.model, args, kwargs, rng_key),
        )
        hash(key)
        return key
    except Exception:  # noqa: BLE001
        # a setting, an argument or a model this cannot read by value (or a model that
        # raises: the run itself reports it): no replay, every program is traced
        return None
