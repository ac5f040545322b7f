"""Client partitions of a NumPyro model's data for federated sampling.

A :class:`ClientPartition` holds the per-client data of a model's keyword arguments
(arrays whose leading axis indexes data points), stacked into padded arrays of shape
``(b, N_max, ...)`` together with the per-client sizes ``(b,)``.  Client computations
are then expressed with :func:`jax.vmap` over the leading axis instead of Python loops.

Padding convention
------------------
Each client's rows are padded up to ``N_max`` with copies of that client's **first**
row, not with zeros.  Padded rows must always be masked out (see
:attr:`ClientPartition.mask`), but because they are copies of genuine data, evaluating
the model on them stays finite: e.g. a log-normal likelihood of a zero observation
would be ``-inf`` and give NaN gradients even when multiplied by a zero mask.

Example::

    from jax import random
    clients = ClientPartition.dirichlet(
        {"X": X, "y": y}, num_clients=20, labels=y, concentration=0.5, key=random.key(1)
    )
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from numpyro_fed._validation import check_float, check_int, check_positive_float

__all__ = ["ClientPartition"]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _is_tracer(x: Any) -> bool:
    """Return ``True`` if ``x`` is an abstract JAX value (not concrete)."""
    return isinstance(x, jax.core.Tracer)


def _rng_from_key(key: Any) -> np.random.Generator:
    """Derive a numpy :class:`~numpy.random.Generator` from a JAX PRNG key.

    Accepts new-style typed keys (``jax.random.key(0)``) and legacy raw ``uint32``
    keys (``jax.random.PRNGKey(0)``).  The same key always gives the same generator.

    :param key: a JAX PRNG key.
    :raises ValueError: if ``key`` is not a JAX PRNG key.
    """
    try:
        if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
            raw = np.asarray(jax.random.key_data(key))
        else:
            raw = np.asarray(key)
    except TypeError as err:
        raise ValueError(
            f"key must be a JAX PRNG key such as jax.random.key(0) or "
            f"jax.random.PRNGKey(0), got {type(key).__name__}"
        ) from err
    if raw.dtype != np.uint32 or raw.size == 0:
        raise ValueError(
            f"key must be a JAX PRNG key such as jax.random.key(0) or "
            f"jax.random.PRNGKey(0), got an array of dtype {raw.dtype} and shape {raw.shape}"
        )
    return np.random.default_rng([int(v) for v in raw.ravel()])


def _to_numpy_array(name: str, value: Any, where: str) -> np.ndarray:
    """Convert one data value to a numpy array with a leading data-point axis.

    :raises ValueError: for scalars, strings or non-numeric objects.
    """
    if isinstance(value, str | bytes) or value is None:
        raise ValueError(
            f"{where}: data[{name!r}] must be an array whose leading axis indexes data "
            f"points, got {type(value).__name__}; put non-partitioned values "
            f"(scalars, settings) into `shared` instead"
        )
    try:
        arr = np.asarray(value)
    except Exception as err:  # re-raised with a clearer message
        raise ValueError(
            f"{where}: data[{name!r}] could not be converted to an array ({err}); "
            f"put non-array values into `shared` instead"
        ) from err
    if arr.ndim == 0:
        raise ValueError(
            f"{where}: data[{name!r}] is a scalar, not an array with a leading data-point "
            f"axis; put scalars and other non-partitioned model arguments into `shared`"
        )
    if arr.dtype == object or arr.dtype.kind in "USV":
        raise ValueError(
            f"{where}: data[{name!r}] has non-numeric dtype {arr.dtype}; data arrays must be "
            f"numeric (put other model arguments into `shared`)"
        )
    return arr


def _as_pooled(data: Mapping[str, ArrayLike], where: str = "data") -> tuple[dict, int]:
    """Validate a mapping of arrays sharing a leading axis; return numpy copies and ``N``.

    :raises ValueError: if the mapping is empty, a value is not an array, or the
        leading axes disagree.
    """
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{where} must be a mapping from model keyword names to arrays, "
            f"got {type(data).__name__}"
        )
    if len(data) == 0:
        raise ValueError(f"{where} is empty: pass at least one array, e.g. {{'X': X, 'y': y}}")
    arrays: dict[str, np.ndarray] = {}
    first: str | None = None
    for name, value in data.items():
        if not isinstance(name, str):
            raise ValueError(f"{where}: keys must be strings (model keyword names), got {name!r}")
        arr = _to_numpy_array(name, value, where)
        if first is not None and arr.shape[0] != arrays[first].shape[0]:
            raise ValueError(
                f"{where}: arrays must share the leading (data-point) axis, but "
                f"{first!r} has {arrays[first].shape[0]} rows and {name!r} has "
                f"{arr.shape[0]} rows; make all arrays the same length"
            )
        if first is None:
            first = name
        arrays[name] = arr
    return arrays, int(arrays[first].shape[0])


def _check_num_clients(num_clients: Any, n: int) -> int:
    """Validate ``1 <= num_clients <= n``."""
    num_clients = check_int("num_clients", num_clients, minimum=1)
    if num_clients > n:
        raise ValueError(
            f"num_clients={num_clients} exceeds the number of data points N={n}; every client "
            f"needs at least one row, so use num_clients <= {n}"
        )
    return num_clients


def _check_labels(values: ArrayLike, n: int, arg: str) -> np.ndarray:
    """Validate a per-row label array (``labels`` or ``groups``) of length ``n``."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(
            f"{arg} must be a 1-D array with one entry per data point (length N={n}), "
            f"got shape {arr.shape}"
        )
    return arr


def _split_static_shared(shared: Mapping[str, Any]) -> tuple[tuple, tuple[str, ...], tuple]:
    """Split ``shared`` into hashable static items and pytree children.

    Arrays (and unhashable values) become pytree children so that they are traced under
    :func:`jax.jit`; hashable Python values (``num_classes=10``) stay static.
    """
    static: list[tuple[str, Any]] = []
    dyn_keys: list[str] = []
    dyn_vals: list[Any] = []
    for k, v in shared.items():
        is_array = isinstance(v, jax.Array | np.ndarray | np.generic)
        if not is_array and isinstance(v, Hashable):
            try:
                hash(v)
            except TypeError:
                is_array = True
        else:
            is_array = True
        if is_array:
            dyn_keys.append(k)
            dyn_vals.append(v)
        else:
            static.append((k, v))
    return tuple(static), tuple(dyn_keys), tuple(dyn_vals)


class _RowIndex:
    """The original row index ``(b, N_max)`` of a partition, carried in its pytree metadata.

    Two holders are equal when they are the same object or hold equal arrays (so that a
    partition rebuilt by ``jax.tree.map`` or returned by a jitted function keeps its row
    index, and partitions of different row orders never share a cached treedef)."""

    __slots__ = ("value",)

    def __init__(self, value: np.ndarray | None) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _RowIndex):
            return NotImplemented
        if self.value is None or other.value is None:
            return self.value is None and other.value is None
        return self.value.shape == other.value.shape and bool(
            np.array_equal(self.value, other.value)
        )

    def __hash__(self) -> int:
        return hash(None if self.value is None else self.value.shape)


def _check_finite_rows(
    arrays: Mapping[str, Any], sizes: np.ndarray, names: tuple, row_index: np.ndarray | None
) -> None:
    """Raise if a real (unpadded) row of a floating-point data array is NaN or infinite,
    naming the key, the client, the client's row and the row of the input data."""
    for k, v in arrays.items():
        if _is_tracer(v):
            continue
        if not jnp.issubdtype(v.dtype, jnp.inexact):
            continue
        a = np.asarray(v)
        bad_rows = ~np.isfinite(a.reshape(a.shape[0], a.shape[1], -1)).all(-1)
        bad_rows &= np.arange(a.shape[1])[None, :] < sizes[:, None]
        if not bad_rows.any():
            continue
        i, j = (int(t) for t in np.argwhere(bad_rows)[0])
        entry = a[i, j].reshape(-1)
        value = entry[~np.isfinite(entry)][0]
        orig = int(row_index[i, j]) if row_index is not None else int(sizes[:i].sum()) + j
        more = int(bad_rows.sum()) - 1
        raise ValueError(
            f"data[{k!r}] has a non-finite value ({value}) in client {i} ({names[i]!r}), at "
            f"its row {j} (row {orig} of the input data)"
            f"{f' and in {more} more rows' if more else ''}. "
            "The federated potential would be NaN there and the chains would diverge: remove "
            "or impute these rows before building the partition."
        )


# ---------------------------------------------------------------------------
# ClientPartition
# ---------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class ClientPartition:
    """Per-client data of a NumPyro model, stacked into padded arrays.

    ``data[k]`` has shape ``(b, N_max, ...)``: client ``i`` owns rows
    ``data[k][i, :sizes[i]]``; the remaining rows are padding, equal to copies of the
    client's first row so that model evaluation on them stays finite (always mask them
    out with :attr:`mask`).  ``shared`` holds non-partitioned model keyword arguments
    passed unchanged to every client (e.g. ``num_classes=10`` or a prior scale).

    The partition is a JAX pytree: the padded arrays, the sizes and the array-valued
    entries of ``shared`` are leaves, while keys, client names and hashable
    (non-array) shared values are static.  Python-side attributes
    (:attr:`num_clients`, :attr:`max_size`) are derived from array shapes and remain
    available under :func:`jax.jit`; those needing concrete sizes (:attr:`sizes_np`,
    :attr:`total_size`, :attr:`weights`, ...) raise outside concrete contexts.

    :param data: mapping from model keyword name to an already padded array of shape
        ``(b, N_max, ...)``.
    :param sizes: integer array ``(b,)`` of client sizes, ``1 <= sizes[i] <= N_max``.
    :param shared: optional mapping of non-partitioned model keyword arguments.
    :param client_names: optional names of the clients (default ``("0", "1", ...)``).
    :param row_index: optional integer array ``(b, N_max)``: the row of the user's input
        data that each real row holds, ``-1`` on padding (see :attr:`row_index`; the
        constructors ``iid``, ``dirichlet``, ``by_group`` and ``power_law`` set it, the
        default is the pooled order :meth:`pooled`).
    :raises ValueError: if shapes are inconsistent, sizes are out of range, or a real row
        of a floating-point array holds NaN or infinity (naming the key, the client and the
        row).
    """

    def __init__(
        self,
        data: Mapping[str, ArrayLike],
        sizes: ArrayLike,
        shared: Mapping[str, Any] | None = None,
        client_names: Sequence[Any] | None = None,
        row_index: ArrayLike | None = None,
    ) -> None:
        if not isinstance(data, Mapping) or len(data) == 0:
            raise ValueError(
                "data must be a non-empty mapping from model keyword names to padded arrays "
                "of shape (num_clients, N_max, ...)"
            )
        arrays: dict[str, jax.Array] = {}
        first: str | None = None
        for name, value in data.items():
            if not isinstance(name, str):
                raise ValueError(f"data keys must be strings (model keyword names), got {name!r}")
            if not isinstance(value, jax.Array):
                value = jnp.asarray(_to_numpy_array(name, value, "data"))
            if value.ndim < 2:
                raise ValueError(
                    f"data[{name!r}] must have shape (num_clients, N_max, ...), got shape "
                    f"{value.shape}; use ClientPartition.from_clients or another constructor "
                    f"to build padded arrays from unpadded data"
                )
            if first is not None:
                ref = arrays[first].shape
                if value.shape[0] != ref[0]:
                    raise ValueError(
                        f"data arrays disagree on the number of clients (axis 0): {first!r} has "
                        f"{ref[0]} and {name!r} has {value.shape[0]}"
                    )
                if value.shape[1] != ref[1]:
                    raise ValueError(
                        f"data arrays disagree on the padded size N_max (axis 1): {first!r} has "
                        f"{ref[1]} and {name!r} has {value.shape[1]}"
                    )
            else:
                first = name
            arrays[name] = value
        b, n_max = arrays[first].shape[:2]
        if b < 1:
            raise ValueError("a ClientPartition needs at least one client (num_clients >= 1)")

        if _is_tracer(sizes):
            sizes_arr = sizes.astype(jnp.int32)
            sizes_np = None
        else:
            sizes_np = np.asarray(sizes)
            if sizes_np.ndim != 1 or sizes_np.shape[0] != b:
                raise ValueError(
                    f"sizes must be a 1-D array of length num_clients={b}, got shape "
                    f"{sizes_np.shape}"
                )
            if sizes_np.dtype.kind not in "iu":
                if sizes_np.dtype.kind != "f" or not np.all(np.mod(sizes_np, 1) == 0):
                    raise ValueError(f"sizes must be integers, got dtype {sizes_np.dtype}")
            sizes_np = sizes_np.astype(np.int64)
            bad = np.flatnonzero((sizes_np < 1) | (sizes_np > n_max))
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"sizes must satisfy 1 <= sizes[i] <= N_max={n_max}, but client {i} has size "
                    f"{int(sizes_np[i])}; every client needs at least one row (a client with no "
                    f"data must be removed)"
                )
            sizes_arr = jnp.asarray(sizes_np, dtype=jnp.int32)

        shared_dict = dict(shared) if shared is not None else {}
        for k in shared_dict:
            if not isinstance(k, str):
                raise ValueError(f"shared keys must be strings (model keyword names), got {k!r}")
            if k in arrays:
                raise ValueError(
                    f"key {k!r} appears both in data and in shared; a model argument is either "
                    f"partitioned (data) or passed unchanged to every client (shared)"
                )

        if client_names is None:
            names = tuple(str(i) for i in range(b))
        else:
            names = tuple(client_names)
            if len(names) != b:
                raise ValueError(
                    f"client_names must have one entry per client ({b}), got {len(names)}"
                )

        index_np = None
        if row_index is not None:
            index_np = np.asarray(row_index)
            if index_np.shape != (b, n_max) or index_np.dtype.kind not in "iu":
                raise ValueError(
                    f"row_index must be an integer array of shape (num_clients, N_max) = "
                    f"({b}, {n_max}), got shape {index_np.shape} and dtype {index_np.dtype}"
                )
            index_np = index_np.astype(np.int64)
            if sizes_np is not None:
                real = np.arange(n_max)[None, :] < sizes_np[:, None]
                if np.any(index_np[real] < 0) or np.any(index_np[~real] != -1):
                    raise ValueError(
                        "row_index must be >= 0 on the clients' rows and -1 on padding"
                    )
                if len(np.unique(index_np[real])) != int(real.sum()):
                    raise ValueError("row_index must not repeat a row of the input data")
        if sizes_np is not None:
            _check_finite_rows(arrays, sizes_np, names, index_np)

        self.data: dict[str, jax.Array] = arrays
        self.sizes: jax.Array = sizes_arr
        self.shared: dict[str, Any] = shared_dict
        self.client_names: tuple = names
        self._sizes_np: np.ndarray | None = sizes_np
        self._row_index: np.ndarray | None = index_np

    # -- pytree -----------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple, tuple]:
        """Flatten into ``(data, sizes, shared arrays)`` children and static aux data."""
        static, dyn_keys, dyn_vals = _split_static_shared(self.shared)
        shared_order = tuple(self.shared)
        children = (self.data, self.sizes, dyn_vals)
        aux = (tuple(self.data), shared_order, static, dyn_keys, self.client_names,
               _RowIndex(self._row_index))
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> ClientPartition:
        """Rebuild a partition from :meth:`tree_flatten` output without validation."""
        keys, shared_order, static, dyn_keys, names, row_index = aux
        data, sizes, dyn_vals = children
        shared_items = dict(static)
        shared_items.update(zip(dyn_keys, dyn_vals, strict=True))
        obj = object.__new__(cls)
        obj.data = {k: data[k] for k in keys}
        obj.sizes = sizes
        obj.shared = {k: shared_items[k] for k in shared_order}
        obj.client_names = names
        obj._sizes_np = None
        obj._row_index = row_index.value
        return obj

    # -- basic attributes ------------------------------------------------------

    @property
    def keys(self) -> tuple[str, ...]:
        """Names of the partitioned model keyword arguments."""
        return tuple(self.data)

    @property
    def num_clients(self) -> int:
        """Number of clients ``b`` (from array shapes, available under ``jit``)."""
        return int(next(iter(self.data.values())).shape[0])

    @property
    def max_size(self) -> int:
        """Padded per-client size ``N_max`` (from array shapes, available under ``jit``)."""
        return int(next(iter(self.data.values())).shape[1])

    @property
    def sizes_np(self) -> np.ndarray:
        """Python-side (numpy ``int64``) copy of :attr:`sizes`.

        :raises ValueError: if the sizes are abstract (inside a ``jit`` trace).
        """
        if self._sizes_np is None:
            if _is_tracer(self.sizes) or not isinstance(self.sizes, jax.Array | np.ndarray):
                raise ValueError(
                    "sizes_np needs concrete sizes but sizes is traced or abstract (inside "
                    "jax.jit/vmap/eval_shape); use `sizes` or `mask` inside traced code"
                )
            self._sizes_np = np.asarray(self.sizes).astype(np.int64)
        return self._sizes_np

    @property
    def total_size(self) -> int:
        """Total number of (unpadded) data points over all clients."""
        return int(self.sizes_np.sum())

    @property
    def mask(self) -> jax.Array:
        """Boolean ``(b, N_max)`` mask, ``True`` on real rows and ``False`` on padding."""
        return jnp.arange(self.max_size)[None, :] < self.sizes[:, None]

    @property
    def weights(self) -> np.ndarray:
        """Client weights ``sizes / total_size`` (numpy ``(b,)``, summing to one)."""
        s = self.sizes_np
        return s / s.sum()

    # -- unpadded views -------------------------------------------------------

    def client(self, i: int) -> dict[str, np.ndarray]:
        """Return the unpadded data of client ``i`` (``shared`` is not included).

        :param i: client index, ``-num_clients <= i < num_clients``.
        :raises IndexError: if ``i`` is out of range.
        """
        b = self.num_clients
        if not -b <= int(i) < b:
            raise IndexError(f"client index {i} out of range for {b} clients")
        i = int(i) % b
        n = int(self.sizes_np[i])
        return {k: np.asarray(v[i, :n]) for k, v in self.data.items()}

    def pooled(self, order: str = "clients") -> dict[str, np.ndarray]:
        """Return all clients' unpadded rows, concatenated in client order (``order=
        "clients"``) or in the user's row order (``order="user"``, see :meth:`user_order`).

        :param order: ``"clients"`` or ``"user"``.
        :raises ValueError: for another ``order``.
        """
        if order not in ("clients", "user"):
            raise ValueError(f"`order` must be 'clients' or 'user', got {order!r}.")
        mask = np.arange(self.max_size)[None, :] < self.sizes_np[:, None]
        rows = {k: np.asarray(v)[mask] for k, v in self.data.items()}
        if order == "clients":
            return rows
        perm = self.user_order()
        return {k: v[perm] for k, v in rows.items()}

    def user_order(self) -> np.ndarray:
        """The permutation ``(total_size,)`` that puts the rows of :meth:`pooled` (client
        order) in the user's row order: ``pooled()[k][user_order()]`` is
        ``pooled(order="user")[k]``.

        The user's row order is the order of :attr:`row_index` (:meth:`original_index`):
        for ``iid``, ``dirichlet``, ``power_law`` and ``by_group`` exactly the rows of the
        arrays the partition was built from; for ``from_clients`` (and the direct
        constructor without ``row_index``) the clients' rows concatenated in the order of
        the clients given, so the identity. Every per-row output of the federated kernels
        (deterministic sites, the replayed observed data and log-likelihood, ArviZ's
        groups) is in this order."""
        return np.argsort(self.original_index(), kind="stable")

    @property
    def row_index(self) -> np.ndarray:
        """Row of the user's input data held by each padded row: ``(b, N_max)`` integers,
        ``-1`` on padding.

        The constructors that shuffle rows (``iid``, ``dirichlet``, ``power_law``) and
        ``by_group`` record the original index of every row, so per-row results (pointwise
        log-likelihoods, PSIS-LOO Pareto k) can be mapped back to the user's rows; for
        ``from_clients`` and the direct constructor it is the position in :meth:`pooled`
        (the clients' rows concatenated in client order)."""
        if self._row_index is not None:
            return self._row_index
        sizes = self.sizes_np
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        pos = np.arange(self.max_size)[None, :]
        return np.where(pos < sizes[:, None], offsets[:, None] + pos, -1)

    def original_index(self) -> np.ndarray:
        """Original row index ``(total_size,)`` of each row of :meth:`pooled` (see
        :attr:`row_index`)."""
        return self.row_index[np.asarray(self.mask)]

    def client_index(self) -> np.ndarray:
        """Return the client id ``(total_size,)`` of each row of :meth:`pooled`.

        Useful as an ArviZ coordinate for per-observation quantities.
        """
        return np.repeat(np.arange(self.num_clients), self.sizes_np)

    # -- checks --------------------------------------------------------------

    def check_batch_size(self, batch_size: int | None) -> None:
        """Check that a per-client minibatch size fits every client.

        :param batch_size: ``None`` (full batch) or an int with ``1 <= batch_size <= min(sizes)``.
        :raises ValueError: naming the smallest client and how to fix it.
        """
        batch_size = check_int("batch_size", batch_size, minimum=1, allow_none=True,
                               hint=" Use None for full-batch gradients.")
        if batch_size is None:
            return
        s = self.sizes_np
        i = int(np.argmin(s))
        smallest = int(s[i])
        if batch_size > smallest:
            raise ValueError(
                f"batch_size={batch_size} exceeds the size of the smallest client: client {i} "
                f"({self.client_names[i]!r}) has only {smallest} rows; use batch_size <= "
                f"{smallest}, batch_size=None (full batch), or a partition with larger clients "
                f"(e.g. a larger min_size)"
            )

    def check_model(self, model: Callable) -> None:
        """Check that every data/shared key is a keyword parameter of ``model``.

        A model with ``**kwargs`` accepts any key.  If the signature of ``model``
        cannot be inspected, the check is skipped.

        :raises ValueError: naming the unknown key and the model's accepted parameters.
        """
        try:
            sig = inspect.signature(model)
        except (TypeError, ValueError):
            return
        params = sig.parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return
        accepted = tuple(
            p.name
            for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        )
        name = getattr(model, "__name__", repr(model))
        for k in (*self.data, *self.shared):
            if k not in accepted:
                where = "data" if k in self.data else "shared"
                free = [a for a in accepted if a not in self.data and a not in self.shared]
                lower = {a.lower(): a for a in free}
                close = lower.get(k.lower()) or next(
                    iter(difflib.get_close_matches(k, free, n=1)), None
                )
                hint = f" (did you mean {close!r}?)" if close else ""
                raise ValueError(
                    f"{where} key {k!r} is not a keyword parameter of model {name!r}, which "
                    f"accepts {accepted}{hint}; the partition has data keys {self.keys}"
                    f"{' and shared keys ' + str(tuple(self.shared)) if self.shared else ''}. "
                    "Rename the key to match the model's signature (the model reads its "
                    "observations from the argument of that name)."
                )

    def __repr__(self) -> str:
        try:
            s = self.sizes_np
        except ValueError:
            size_txt = "sizes: traced"
        else:
            med = float(np.median(s))
            size_txt = (
                f"sizes: min {int(s.min())} / median {med:g} / max {int(s.max())}, "
                f"total {int(s.sum())}"
            )
        return f"ClientPartition(num_clients={self.num_clients}, keys={self.keys}, {size_txt})"

    # -- constructors ----------------------------------------------------------

    @classmethod
    def _from_indices(
        cls,
        arrays: Mapping[str, np.ndarray],
        indices: Sequence[np.ndarray],
        shared: Mapping[str, Any] | None,
        client_names: Sequence[Any] | None = None,
    ) -> ClientPartition:
        """Build a partition from pooled arrays and per-client row indices.

        Padding rows repeat each client's first row.
        """
        sizes = np.array([len(ix) for ix in indices], dtype=np.int64)
        empty = np.flatnonzero(sizes == 0)
        if empty.size:
            raise ValueError(
                f"client {int(empty[0])} would have no data; every client needs at least one row"
            )
        n_max = int(sizes.max())
        gather = np.empty((len(indices), n_max), dtype=np.int64)
        row_index = np.full((len(indices), n_max), -1, dtype=np.int64)
        for i, ix in enumerate(indices):
            gather[i, : len(ix)] = ix
            gather[i, len(ix) :] = ix[0]
            row_index[i, : len(ix)] = ix
        data = {k: jnp.asarray(v[gather]) for k, v in arrays.items()}
        return cls(data, sizes, shared=shared, client_names=client_names, row_index=row_index)

    @classmethod
    def from_clients(
        cls,
        clients: Sequence[Mapping[str, ArrayLike]],
        shared: Mapping[str, Any] | None = None,
        client_names: Sequence[Any] | None = None,
    ) -> ClientPartition:
        """Build a partition from a list of per-client data mappings.

        The user's row order (:meth:`user_order`) is the concatenation of the clients'
        rows in the order given: per-row outputs of a run (deterministic sites, observed
        data, pointwise log-likelihood) list client 0's rows first, then client 1's, ...

        :param clients: one mapping per client, all with the same keys; within a client
            all arrays share the leading (data-point) axis.
        :param shared: non-partitioned model keyword arguments.
        :param client_names: optional client names.
        :raises ValueError: for an empty list, an empty client, inconsistent keys or
            trailing shapes.
        """
        if isinstance(clients, Mapping) or not isinstance(clients, Sequence) or not clients:
            raise ValueError(
                "clients must be a non-empty sequence of mappings (one per client), "
                "e.g. [{'X': X0, 'y': y0}, {'X': X1, 'y': y1}]"
            )
        per_client: list[dict[str, np.ndarray]] = []
        keys: tuple[str, ...] | None = None
        for i, c in enumerate(clients):
            arrays, n = _as_pooled(c, where=f"clients[{i}]")
            if keys is None:
                keys = tuple(arrays)
            elif set(arrays) != set(keys):
                missing = sorted(set(keys) - set(arrays))
                extra = sorted(set(arrays) - set(keys))
                raise ValueError(
                    f"clients have inconsistent keys: client {i} is missing keys {missing} and "
                    f"has extra keys {extra} compared to client 0 {list(keys)}; every client must "
                    f"provide the same keys"
                )
            if n == 0:
                raise ValueError(
                    f"client {i} has no data (0 rows); every client needs at least one row, so "
                    f"drop empty clients before building the partition"
                )
            per_client.append(arrays)
        assert keys is not None
        pooled: dict[str, np.ndarray] = {}
        for k in keys:
            trailing = {c[k].shape[1:] for c in per_client}
            if len(trailing) > 1:
                raise ValueError(
                    f"data[{k!r}] has inconsistent trailing shapes across clients: "
                    f"{sorted(trailing)}; all clients must have the same per-row shape"
                )
            pooled[k] = np.concatenate([c[k] for c in per_client], axis=0)
        sizes = np.array([len(c[keys[0]]) for c in per_client], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        indices = [np.arange(o, o + s) for o, s in zip(offsets, sizes, strict=True)]
        return cls._from_indices(pooled, indices, shared, client_names)

    @classmethod
    def iid(
        cls,
        data: Mapping[str, ArrayLike],
        num_clients: int,
        *,
        key: Any,
        shared: Mapping[str, Any] | None = None,
    ) -> ClientPartition:
        """Split pooled data uniformly at random into clients of near-equal sizes.

        Sizes differ by at most one (the first ``N % num_clients`` clients get one more
        row).  Within a client, rows keep their original relative order.

        :param data: mapping name -> array with a common leading axis ``N``.
        :param num_clients: number of clients, ``1 <= num_clients <= N``.
        :param key: JAX PRNG key; the same key gives the same partition.
        :param shared: non-partitioned model keyword arguments.
        """
        arrays, n = _as_pooled(data)
        b = _check_num_clients(num_clients, n)
        rng = _rng_from_key(key)
        perm = rng.permutation(n)
        indices = [np.sort(ix) for ix in np.array_split(perm, b)]
        return cls._from_indices(arrays, indices, shared)

    @classmethod
    def dirichlet(
        cls,
        data: Mapping[str, ArrayLike],
        num_clients: int,
        *,
        labels: ArrayLike,
        concentration: float,
        key: Any,
        min_size: int = 1,
        max_tries: int = 100,
        shared: Mapping[str, Any] | None = None,
    ) -> ClientPartition:
        """Label-skewed split: class proportions per client drawn from a Dirichlet.

        For each class ``c`` draw ``p_c ~ Dir(concentration * 1_b)`` and split the
        (shuffled) rows of class ``c`` among clients in proportions ``p_c``.  Small
        ``concentration`` (e.g. 0.1) gives strongly non-iid clients, large values
        (e.g. 100) nearly iid ones.  The draw is repeated until every client has at
        least ``min_size`` rows.

        :param data: mapping name -> array with a common leading axis ``N``.
        :param num_clients: number of clients.
        :param labels: ``(N,)`` class label of each row.
        :param concentration: Dirichlet concentration, ``> 0``.
        :param key: JAX PRNG key; the same key gives the same partition.
        :param min_size: minimum number of rows per client (``>= 1``).
        :param max_tries: maximum number of draws before giving up.
        :param shared: non-partitioned model keyword arguments.
        :raises ValueError: for invalid arguments, or if no valid split is found within
            ``max_tries`` draws.
        """
        arrays, n = _as_pooled(data)
        b = _check_num_clients(num_clients, n)
        lab = _check_labels(labels, n, "labels")
        conc = check_positive_float("concentration", concentration)
        min_size = check_int("min_size", min_size, minimum=1)
        max_tries = check_int("max_tries", max_tries, minimum=1)
        if min_size * b > n:
            raise ValueError(
                f"min_size={min_size} with num_clients={b} needs at least {min_size * b} "
                f"rows but N={n}; use fewer clients or a smaller min_size"
            )
        rng = _rng_from_key(key)
        _, cls_of_row = np.unique(lab, return_inverse=True)
        class_rows = [np.flatnonzero(cls_of_row == c) for c in range(cls_of_row.max() + 1)]
        smallest = 0
        for _ in range(max_tries):
            assigned: list[list[np.ndarray]] = [[] for _ in range(b)]
            for rows in class_rows:
                rows = rng.permutation(rows)
                p = rng.dirichlet(np.full(b, conc))
                p = np.nan_to_num(p, nan=0.0)
                if not p.sum() > 0:
                    p = np.eye(b)[rng.integers(b)]
                cuts = np.floor(np.cumsum(p / p.sum()) * len(rows)).astype(np.int64)[:-1]
                for i, part in enumerate(np.split(rows, cuts)):
                    assigned[i].append(part)
            indices = [np.sort(np.concatenate(parts)) for parts in assigned]
            smallest = min(len(ix) for ix in indices)
            if smallest >= min_size:
                return cls._from_indices(arrays, indices, shared)
        raise ValueError(
            f"dirichlet: could not give every client at least min_size={min_size} rows in "
            f"max_tries={max_tries} draws (smallest client had {smallest}) with "
            f"concentration={concentration} and num_clients={b}; use a larger concentration, "
            f"fewer clients, a smaller min_size or a larger max_tries"
        )

    @classmethod
    def by_group(
        cls,
        data: Mapping[str, ArrayLike],
        groups: ArrayLike,
        shared: Mapping[str, Any] | None = None,
    ) -> ClientPartition:
        """One client per distinct group value (e.g. patient, hospital).

        Clients are ordered by sorted group value, and :attr:`client_names` holds the
        group values (as Python scalars).  Within a client, rows keep their original order.

        :param data: mapping name -> array with a common leading axis ``N``.
        :param groups: ``(N,)`` group value of each row.
        :param shared: non-partitioned model keyword arguments.
        """
        arrays, n = _as_pooled(data)
        g = _check_labels(groups, n, "groups")
        values, inverse = np.unique(g, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        sizes = np.bincount(inverse, minlength=len(values))
        indices = np.split(order, np.cumsum(sizes)[:-1])
        return cls._from_indices(arrays, indices, shared, client_names=tuple(values.tolist()))

    @classmethod
    def power_law(
        cls,
        data: Mapping[str, ArrayLike],
        num_clients: int,
        *,
        key: Any,
        exponent: float = 1.0,
        min_size: int = 1,
        shared: Mapping[str, Any] | None = None,
    ) -> ClientPartition:
        """Quantity skew: client sizes follow a power law in their rank.

        Client ``r`` (``r = 0, ..., b-1``) receives ``min_size`` rows plus a share of the
        remaining ``N - b * min_size`` rows proportional to ``(r + 1) ** -exponent``
        (largest-remainder rounding), so sizes are non-increasing in ``r``, each
        ``>= min_size``, and sum to ``N``.  Rows are assigned by a random permutation.

        :param data: mapping name -> array with a common leading axis ``N``.
        :param num_clients: number of clients.
        :param key: JAX PRNG key; the same key gives the same partition.
        :param exponent: power-law exponent ``>= 0`` (0 gives near-equal sizes).
        :param min_size: minimum number of rows per client (``>= 1``).
        :param shared: non-partitioned model keyword arguments.
        """
        arrays, n = _as_pooled(data)
        b = _check_num_clients(num_clients, n)
        exponent = check_float("exponent", exponent, low=0.0)
        min_size = check_int("min_size", min_size, minimum=1)
        rest = n - b * min_size
        if rest < 0:
            raise ValueError(
                f"min_size={min_size} with num_clients={b} needs at least {b * min_size} rows "
                f"but N={n}; use fewer clients or a smaller min_size"
            )
        w = (np.arange(b) + 1.0) ** (-exponent)
        share = rest * w / w.sum()
        extra = np.floor(share).astype(np.int64)
        left = rest - int(extra.sum())
        frac_order = np.argsort(-(share - extra), kind="stable")
        extra[frac_order[:left]] += 1
        sizes = min_size + extra
        rng = _rng_from_key(key)
        perm = rng.permutation(n)
        indices = [np.sort(ix) for ix in np.split(perm, np.cumsum(sizes)[:-1])]
        return cls._from_indices(arrays, indices, shared)
