"""NONMEM's additional doses (``ADDL``/``II``) in :meth:`PKDataset.from_dataframe`: written
out one row per dose, checked against the same regimen written row by row."""

import numpy as np
import pandas as pd
import pytest

from numpyro_fed.nlme.data import MAX_ADDITIONAL_DOSES, PKDataset, _quinidine_frame

QUINIDINE_COVARIATES = ["AGE", "HEIGHT", "WEIGHT", "GLYCO", "RACE", "SMOKE", "ETHANOL",
                        "HEART", "CREATININE"]
QUINIDINE_CATEGORICAL = ["RACE", "SMOKE", "ETHANOL", "HEART", "CREATININE"]


def _compress(df: pd.DataFrame, covariates: list[str]) -> tuple[pd.DataFrame, int]:
    """``df`` with each run of regular doses written as its first dose with ``ADDL``/``II``
    (written independently of the library): a dose row starts a run; a later dose row of
    the subject joins it when it repeats the dose (``AMT``, ``CMT``, ``RATE``; ``SS = 0``)
    exactly ``k`` intervals after the first (the interval: ``II`` of a steady-state first
    dose, else the time to the second), and when writing it out cannot change the table:
    the row before it was recorded at an earlier time (the written-out dose goes before the
    rows at its time) and holds the covariates it holds (the written-out dose takes
    those). Returns the table and the number of dose rows removed."""
    keep = np.ones(len(df), bool)
    addl = np.zeros(len(df), np.int64)
    ii = df["II"].to_numpy(float).copy()
    t = df["TIME"].to_numpy(float)
    for _, rows in df.groupby("ID", sort=False).indices.items():
        rows = np.sort(rows)
        doses = [r for r in rows if df["EVID"].iat[r] == 1]
        i = 0
        while i < len(doses):
            r = doses[i]
            step = ii[r] if df["SS"].iat[r] == 1 else None
            n, j = 0, i + 1
            while j < len(doses):
                d = doses[j]
                prev = rows[np.searchsorted(rows, d) - 1]
                same = all(df[c].iat[d] == df[c].iat[r] for c in ("AMT", "CMT")) and \
                    df["SS"].iat[d] == 0 and t[prev] < t[d] and \
                    all(df[c].iat[d] == df[c].iat[prev] for c in covariates)
                if same and step is None and t[d] > t[r]:
                    step = t[d] - t[r]
                if not same or step is None or t[r] + (n + 1) * step != t[d]:
                    break
                n += 1
                keep[d] = False
                j += 1
            if n:
                addl[r], ii[r] = n, step
            i = j if n else i + 1
    out = df.assign(ADDL=addl, II=ii)[keep]
    return out, int((~keep).sum())


def _arrays(ds: PKDataset) -> dict:
    out = {f"obs.{k}": v for k, v in ds.obs._asdict().items()}
    out.update({f"doses.{k}": v for k, v in ds.doses._asdict().items()})
    out.update({f"tv.{k}": v for k, v in ds.time_varying.items()})
    out.update({f"dtv.{k}": v for k, v in ds.dose_time_varying.items()})
    out.update({f"cov.{k}": v for k, v in ds.covariates.items()})
    out["doses_before"] = ds.doses_before
    return out


def test_quinidine_written_with_addl_reads_as_written_row_by_row():
    """The real multiple-dose data (1028 doses, steady-state ones among them) with its
    regular runs of doses written as ADDL: every array equals the row-by-row table's
    exactly, and each written-out dose names the row it comes from."""
    raw = _quinidine_frame()
    compressed, removed = _compress(raw, QUINIDINE_COVARIATES)
    assert removed > 300  # most of the doses are in runs (a test that compresses nothing
    # checks nothing)
    assert (compressed["ADDL"] > 0).sum() > 50
    kw = dict(covariates=QUINIDINE_COVARIATES, categorical=QUINIDINE_CATEGORICAL)
    ref = PKDataset.from_dataframe(raw, **kw)
    got = PKDataset.from_dataframe(compressed, **kw)
    a, b = _arrays(ref), _arrays(got)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    assert any("additional dose(s) (ADDL)" in n for n in got.notes)
    # the written-out doses carry the label of the dose row they repeat
    src = compressed.index[compressed["ADDL"] > 0]
    labels = set(got.dose_rows[got.doses.mask].tolist())
    assert set(src) <= labels and labels <= set(compressed.index)
    # and a column of zeros changes nothing
    np.testing.assert_array_equal(
        PKDataset.from_dataframe(raw.assign(ADDL=0), **kw).doses.time, ref.doses.time)


def _table(**cols) -> pd.DataFrame:
    base = {"ID": [1, 1, 1, 1, 1], "TIME": [0.0, 3, 24, 30, 30],
            "DV": [0.0, 1.2, 2.0, 0, 1.5], "AMT": [100.0, 0, 0, 0, 0],
            "EVID": [1, 0, 0, 2, 0], "CMT": [1, 2, 2, 2, 2], "II": [12.0, 0, 0, 0, 0],
            "ADDL": [3, 0, 0, 0, 0], "WT": [70.0, 70, 72, 75, 75]}
    base.update(cols)
    return pd.DataFrame(base)


def test_order_ties_covariates_and_notes():
    """Doses at 0 (the row), 12, 24, 36: the one at 24 goes before the sample at 24 (which
    counts it; noted), takes the weight in force before that row (70), the one at 36 the
    weight of the last row (75); II of the first dose, not at steady state, reads as 0."""
    ds = PKDataset.from_dataframe(_table())
    np.testing.assert_array_equal(ds.doses.time[0], [0, 12, 24, 36])
    np.testing.assert_array_equal(ds.doses.amt[0], [100] * 4)
    np.testing.assert_array_equal(ds.doses.ii[0], [0] * 4)
    assert not ds.doses.ss.any()
    np.testing.assert_array_equal(ds.doses_before[0], [1, 3, 3])
    np.testing.assert_array_equal(ds.dose_time_varying["WT"][0], [70, 70, 70, 75])
    np.testing.assert_array_equal(ds.time_varying["WT"][0], [70, 72, 75])
    assert ds.dose_rows[0].tolist() == [0, 0, 0, 0]
    assert any("3 additional dose(s) (ADDL) of 1 dose row(s)" in n for n in ds.notes)
    assert any("1 additional dose(s) fall at the time of an observation" in n
               for n in ds.notes)


def test_steady_state_pattern_continues_with_ordinary_doses():
    ds = PKDataset.from_dataframe(_table(SS=[1, 0, 0, 0, 0], RATE=[0.0] * 5))
    np.testing.assert_array_equal(ds.doses.ss[0], [True, False, False, False])
    np.testing.assert_array_equal(ds.doses.ii[0], [12, 0, 0, 0])  # the pattern's II kept
    ds = PKDataset.from_dataframe(_table(RATE=[50.0, 0, 0, 0, 0]))
    np.testing.assert_array_equal(ds.doses.rate[0], [50] * 4)
    np.testing.assert_array_equal(ds.doses.cmt[0], [1] * 4)


def test_missing_addl_reads_as_zero_and_other_subjects_untouched():
    df = pd.concat([_table(ADDL=[2, ".", ".", ".", "."]),
                    _table(ID=[2] * 5, ADDL=[np.nan] * 5)], ignore_index=True)
    ds = PKDataset.from_dataframe(df)
    np.testing.assert_array_equal(ds.doses.time[0, :3], [0, 12, 24])
    np.testing.assert_array_equal(ds.doses.mask, [[True] * 3, [True, False, False]])


@pytest.mark.parametrize(
    ("edit", "kw", "match"),
    [
        (dict(ADDL=[-1, 0, 0, 0, 0]), {}, r"column 'ADDL' \(addl=\) at subject 1, row 0 is -1: "
         r"ADDL is the number of doses after this one, an integer >= 0 \(a negative ADDL, "
         r"NONMEM's empirical steady state, is not supported"),
        (dict(ADDL=[1.5, 0, 0, 0, 0]), {}, r"at subject 1, row 0 is 1.5: ADDL is the number"),
        (dict(ADDL=[0, 2, 0, 0, 0]), {}, r"at subject 1, row 1 is 2 on a row that is not a dose "
         r"\(an observation\)"),
        (dict(ADDL=[0, 0, 0, 1, 0]), {}, r"row 3 is 1 on a row that is not a dose \(EVID=2\)"),
        (dict(II=[0.0] * 5), {}, r"row 0 is 3 but the interdose interval is 0: give the time "
         r"between the doses in column 'II' \(ii=\)"),
        (dict(SS=[1, 0, 0, 0, 0], RATE=[10.0, 0, 0, 0, 0]), {},
         r"row 0 continues a steady-state infusion \(SS=1, RATE>0\)"),
        (dict(ADDL=[MAX_ADDITIONAL_DOSES + 1, 0, 0, 0, 0]), {},
         r"asks for 10,000,001 additional doses .*\(ADDL counts doses, not hours\)"),
        ({}, dict(addl=None), r"additional doses \(column 'ADDL'\) at subject 1, row 0, but the "
         r"column is not read as ADDL \(addl=None or another column\): pass addl='ADDL'"),
    ],
)
def test_addl_misuse(edit, kw, match):
    df = _table(**edit)
    with pytest.raises(ValueError, match=match):
        PKDataset.from_dataframe(df, **kw)


def test_addl_in_another_column():
    df = _table().rename(columns={"ADDL": "NDOSE"})
    ds = PKDataset.from_dataframe(df, addl="NDOSE")
    np.testing.assert_array_equal(ds.doses.time[0], [0, 12, 24, 36])
    assert "NDOSE" not in ds.covariates and "NDOSE" not in ds.time_varying
    with pytest.raises(ValueError, match=r"column is not read as ADDL .* pass addl='ADDL'"):
        PKDataset.from_dataframe(_table(NDOSE=[0] * 5), addl="NDOSE")


def test_addl_duplicating_a_written_dose_is_refused_naming_both_rows():
    df = pd.concat([_table(), pd.DataFrame({"ID": [1], "TIME": [12.0], "DV": [0.0],
                   "AMT": [100.0], "EVID": [1], "CMT": [1], "II": [0.0], "ADDL": [0],
                   "WT": [70.0]}, index=[9])])
    df = df.iloc[[0, 1, 5, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"2 rows are fully duplicated .*: rows 0 \(subject 1, "
                       r"time 12\), 9 \(subject 1, time 12\)"):
        PKDataset.from_dataframe(df)
