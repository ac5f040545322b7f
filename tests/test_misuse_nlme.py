"""The misuse suite of the NONMEM/PK layer (``numpyro_fed.nlme``): a table that the model
cannot honour is refused, naming the subject, the row of the input table and its column; a
``PKModel`` computes on a dataset what a fresh one would, whatever data it met before.

Rows are named by the DataFrame index label of the input table (the tables here start their
index at 10, so that a label is never confused with a position in the padded arrays).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
from numpyro.infer.util import log_density

from numpyro_fed import nlme

pytestmark = pytest.mark.xdist_group("nlme")

IDS = (101, 102, 103)


def _table(cmt_obs=2, dose_cmt=1, wt=(60.0, 70.0, 80.0), multiple=False, rate=0.0,
           cmt_col=True) -> pd.DataFrame:
    """Three subjects: a dose of 100 at time 0 (and at 12 if ``multiple``) into ``dose_cmt``
    (an infusion if ``rate > 0``), five samples (seven if ``multiple``) into ``cmt_obs``;
    covariate WT. Index labels from 10 (subject 101: 10-15, 102: 16-21, 103: 22-27 for a
    single dose)."""
    rows = []
    t_obs = [0.5, 1.0, 2.0, 4.0, 8.0] + ([13.0, 16.0] if multiple else [])
    for k, sid in enumerate(IDS):
        events = [(0.0, "dose")] + [(t, "obs") for t in t_obs[:5]]
        if multiple:
            events += [(12.0, "dose")] + [(t, "obs") for t in t_obs[5:]]
        for t, kind in events:
            dose = kind == "dose"
            rows.append({
                "ID": sid, "TIME": t, "DV": np.nan if dose else 4.0 * np.exp(-0.1 * t) + k,
                "AMT": 100.0 if dose else 0.0, "EVID": int(dose), "MDV": int(dose),
                "CMT": dose_cmt if dose else cmt_obs, "RATE": rate if dose else 0.0,
                "WT": wt[k],
            })
    df = pd.DataFrame(rows, index=range(10, 10 + len(rows)))
    return df if cmt_col else df.drop(columns="CMT")


def _set(df, label, **values):
    df = df.copy()
    for k, v in values.items():
        if k == "CMT":
            df[k] = df[k].astype(object)
        df.loc[label, k] = v
    return df


def _data(df, **kw):
    return nlme.PKDataset.from_dataframe(df, covariates=["WT"], **kw)


ORAL = {"KA": 1.0, "V": 20.0, "CL": 2.0}
IV = {"V": 20.0, "CL": 2.0}
TWO_IV = {"V": 20.0, "CL": 2.0, "Q": 1.0, "V2": 30.0}
TWO_ORAL = {**TWO_IV, "KA": 1.0}


def _ode():
    def rhs(t, A, p):
        return jnp.stack([-p["KA"] * A[0], p["KA"] * A[0] - p["CL"] / p["V"] * A[1]])

    return nlme.ode_model(rhs, 2, central=2, param_names=("KA", "V", "CL"),
                          compartments={1: "depot", 2: "central"})


# ------------------------------------------------------------------ observation compartments
# (structural model, params, dose CMT, CMT of one sample, refusal text or None if accepted)
CMT_CASES = [
    # first-order absorption: 1 depot (its amount is predicted), 2 central
    (lambda: nlme.one_compartment("first_order"), ORAL, 1, 1, None),
    (lambda: nlme.one_compartment("first_order"), ORAL, 1, 7,
     r"CMT=7 is not a compartment .*\{1: 'depot', 2: 'central'\}"),
    (lambda: nlme.one_compartment("first_order"), ORAL, 1, 3, r"CMT=3 is not a compartment"),
    (lambda: nlme.one_compartment("first_order"), ORAL, 1, 2, None),
    (lambda: nlme.one_compartment("first_order"), ORAL, 1, 0, None),
    # IV: 1 central
    (lambda: nlme.one_compartment(None), IV, 1, 2, r"CMT=2 is not a compartment"),
    (lambda: nlme.one_compartment(None), IV, 1, 1, None),
    # peripheral amounts are not computed by the closed forms
    (lambda: nlme.two_compartment(None), TWO_IV, 1, 2,
     r"CMT=2 is the 'peripheral' compartment .*predicts only compartment\(s\) 1 "
     r"\('central'\)"),
    (lambda: nlme.two_compartment("first_order"), TWO_ORAL, 1, 3,
     r"CMT=3 is the 'peripheral' compartment .*1 \('depot'\), 2 \('central'\)"),
    (lambda: nlme.two_compartment("first_order"), TWO_ORAL, 1, 1, None),
    (lambda: nlme.three_compartment(None), {**TWO_IV, "Q3": 1.0, "V3": 40.0}, 1, 4,
     r"CMT=4 is not a compartment"),
    (lambda: nlme.three_compartment(None), {**TWO_IV, "Q3": 1.0, "V3": 40.0}, 1, 3,
     r"CMT=3 is the 'peripheral2' compartment"),
    # an ODE model predicts the amount of any of its compartments
    (_ode, ORAL, 1, 1, None),
    (_ode, ORAL, 1, 5, r"CMT=5 is not a compartment of ode_model"),
    (_ode, ORAL, 1, 2, None),
]


@pytest.mark.parametrize("make, params, dose_cmt, cmt, text", CMT_CASES,
                         ids=[f"{i}-cmt{c[3]}" for i, c in enumerate(CMT_CASES)])
def test_an_observation_compartment_the_model_cannot_predict_is_refused(make, params,
                                                                          dose_cmt, cmt, text):
    """An observation's CMT is honoured: a compartment the structural model lacks or does not
    predict is refused, naming the subject, the row and the column; one it predicts is
    predicted there (another compartment than the observed one: another log density), 0 is
    the observed compartment."""
    structural = make()
    observed = structural.observed_cmt
    df = _set(_table(cmt_obs=observed, dose_cmt=dose_cmt), 18, CMT=cmt)  # subject 102
    pk = nlme.PKModel(structural, params=params)
    if text is None:
        vals = {f"phi_{k}": np.full(3, np.log(v), np.float32) for k, v in params.items()}
        lp = float(log_density(pk.model, (), pk.arrays(_data(df)), vals)[0])
        lp_obs = float(log_density(pk.model, (), pk.arrays(_data(_table(
            cmt_obs=observed, dose_cmt=dose_cmt))), vals)[0])
        assert np.isfinite(lp)
        assert (lp == lp_obs) == (cmt in (0, observed))
        return
    with pytest.raises(ValueError, match=r"subject 102, row 18, column 'CMT'.*" + text):
        pk.arrays(_data(df))
    with pytest.raises(ValueError, match=r"subject 102, row 18, column 'CMT'"):
        pk.fit(_data(df), jax.random.key(0))  # refused before anything is compiled


def test_observations_without_a_compartment_are_of_the_observed_one():
    """No CMT column, CMT 0 or an empty CMT on the samples: the model's observed compartment
    (central): the same log density as CMT 2 for an oral model; a plain function (no
    compartments declared) accepts one compartment and refuses a mix."""
    pk = nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL)
    vals = {f"phi_{p}": np.full(3, np.log(v), np.float32) for p, v in ORAL.items()}

    def lp(df):
        return float(log_density(pk.model, (), pk.arrays(_data(df)), vals)[0])

    ref = lp(_table(cmt_obs=2))
    assert lp(_table(cmt_col=False)) == ref
    assert lp(_table(cmt_obs=0)) == ref
    assert lp(_set(_table(cmt_obs=2), 18, CMT=np.nan)) == ref
    one = nlme.one_compartment("first_order")

    def plain(params, t, doses):
        return one(params, t, doses)

    plain.param_names = one.param_names
    pk_plain = nlme.PKModel(plain, params=ORAL)
    pk_plain.arrays(_data(_table(cmt_obs=2)))
    with pytest.raises(ValueError, match=r"subject 102, row 18, column 'CMT'.*several "
                                         r"compartments \[2, 3\]"):
        pk_plain.arrays(_data(_set(_table(cmt_obs=2), 18, CMT=3)))


def test_a_depot_sample_is_predicted_in_the_depot():
    """The issue's example: samples of one subject marked CMT=1 (the depot of an oral model)
    were fitted bit-identically to CMT=2. They are now predicted as NONMEM does, the amount
    in the depot (A(1)/S1, no scale S1): 100 e^{-KA t} after a bolus of 100 at 0 (float32
    round-off); the other subjects keep their central concentrations; CMT=7 is refused."""
    pk = nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL)
    df = _table(cmt_obs=2)
    df.loc[df["ID"].eq(103) & df["EVID"].eq(0), "CMT"] = 1
    data, central = _data(df), _data(_table(cmt_obs=2))
    a, a2 = pk.arrays(data), pk.arrays(central)
    assert "obs_cmt" in a and "obs_cmt" not in a2
    ind = {k: jnp.full(3, v) for k, v in ORAL.items()}
    f = np.asarray(pk.predict(ind, jnp.asarray(a["obs_time"]), _doses(a), a["doses_before"],
                              binding=a["binding"], obs_cmt=a["obs_cmt"]))
    f2 = np.asarray(pk.predict(ind, jnp.asarray(a2["obs_time"]), _doses(a2),
                               a2["doses_before"], binding=a2["binding"]))
    t = np.asarray(a["obs_time"][2], np.float64)
    np.testing.assert_allclose(f[2], 100.0 * np.exp(-1.0 * t), rtol=1e-5)
    np.testing.assert_array_equal(f[:2], f2[:2])
    assert not np.allclose(f[2], f2[2])
    df.loc[df["ID"].eq(103) & df["EVID"].eq(0), "CMT"] = 7
    with pytest.raises(ValueError, match=r"subject 103, row 23, column 'CMT': CMT=7 "):
        pk.arrays(_data(df))


def _doses(a):
    return nlme.Doses(*(jnp.asarray(a[k]) for k in (
        "dose_time", "dose_amt", "dose_rate", "dose_cmt", "dose_ss", "dose_ii", "dose_mask")))


# ------------------------------------------------------------------ model-stage messages
def _ss_table():
    df = _table(dose_cmt=2, rate=10.0)  # 10 h infusions into the central compartment
    df["SS"] = 0
    df["II"] = 0.0
    return _set(df, 16, SS=1, II=8.0)  # subject 102: steady state every 8 h, overlapping


# (name, model, table, dataset dtype, exception text)
STAGE_CASES = [
    ("dose into a compartment the model lacks",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL),
     lambda: _set(_table(), 16, CMT=9), np.float32,
     r"dose of subject 102, row 16, column 'CMT': cmt=9 is not a compartment"),
    ("dose into a compartment the IV model lacks",
     lambda: nlme.PKModel(nlme.one_compartment(None), params=IV),
     lambda: _set(_table(cmt_obs=1), 22, CMT=2), np.float32,
     r"dose of subject 103, row 22, column 'CMT': cmt=2 is not a compartment"),
    ("overlapping steady-state infusions",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL),
     _ss_table, np.float32,
     r"dose of subject 102, row 16, column 'RATE': steady-state infusion of duration"),
    ("steady state in an ODE model",
     lambda: nlme.PKModel(_ode(), params=ORAL),
     lambda: _set(_set(_table(), 16, SS=1), 16, II=12.0), np.float32,
     r"dose of subject 102, row 16, column 'SS': ss=True"),
    ("exponential error of a DV <= 0",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL,
                          error="exponential"),
     lambda: _set(_table(), 19, DV=-1.0), np.float32,
     r"dv > 0.*<= 0 in `dv` \(column 'DV'\) at subject 102, row 19"),
    ("DV beyond float32 in a float64 dataset",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL),
     lambda: _set(_table(), 19, DV=1e39), np.float64,
     r"observation of subject 102, row 19, column 'DV': 1e\+39 overflows float32 "
     r"\(max 3\.4e38\)"),
    ("AMT beyond float32 in a float64 dataset",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL),
     lambda: _set(_table(), 22, AMT=2e39), np.float64,
     r"dose of subject 103, row 22, column 'AMT': 2e\+39 overflows float32 \(max 3\.4e38\)"),
    ("TIME beyond float32 in a float64 dataset",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL),
     lambda: _set(_table(), 27, TIME=5e38), np.float64,
     r"observation of subject 103, row 27, column 'TIME': 5e\+38 overflows float32"),
    ("covariate beyond float32 in a float64 dataset",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"),
                          params={**ORAL, "CL": nlme.Param(2.0, covariates={"WT": "linear"})}),
     lambda: _table(wt=(60.0, 1e39, 80.0)), np.float64,
     r"covariate 'WT' of subject 102 is 1e\+39, which overflows float32 \(max 3\.4e38\)"),
    ("power covariate <= 0",
     lambda: nlme.PKModel(nlme.one_compartment("first_order"),
                          params={**ORAL, "CL": nlme.Param(2.0, covariates={"WT": "power"})}),
     lambda: _table(wt=(60.0, 70.0, 0.0)), np.float32,
     r"covariate 'WT' is 0 <= 0 for subject 103"),
]


@pytest.mark.parametrize("name, make_pk, make_df, dtype, text", STAGE_CASES,
                         ids=[c[0] for c in STAGE_CASES])
def test_model_stage_checks_name_subject_row_and_column(name, make_pk, make_df, dtype, text):
    """Every check of PKModel.arrays (hence fit) names the subject, the row label of the input
    table and the column at fault, never an index into the padded arrays."""
    pk = make_pk()
    with pytest.raises(ValueError, match=text) as info:
        pk.arrays(_data(make_df(), dtype=dtype))
    assert "index" not in str(info.value)


@pytest.mark.parametrize("column, value, kw", [("DV", 1e39, "dv"), ("AMT", 5e38, "amt"),
                                               ("TIME", 4e38, "time"), ("WT", -1e39,
                                                                        "covariates")])
def test_a_finite_value_beyond_float32_is_said_to_overflow(column, value, kw):
    """A finite 1e39 read into float32 arrays would become inf (and then be called 'NaN or
    infinite'): refused where it is read, as an overflow."""
    label = {"AMT": 22, "TIME": 21}.get(column, 19)  # TIME: the subject's last row
    df = _set(_table(), label, **{column: value})
    subject = 103 if column == "AMT" else 102
    with pytest.raises(ValueError, match=rf"column '{column}' \({kw}=\) = {value:g} at subject "
                                         rf"{subject}, row {label} overflows float32 "
                                         r"\(max 3\.4e38\)".replace("+", r"\+")):
        _data(df)
    _data(df, dtype=np.float64)  # float64 holds it


def test_a_prediction_the_error_model_cannot_take_names_the_row():
    """Evaluated eagerly, a proportional error at a zero prediction (a sample at the time of
    an oral dose) names the subject and row of the sample, not an array index."""
    df = _set(_table(), 11, TIME=0.0)  # subject 101's first sample at the dose time
    pk = nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL, error="proportional")
    vals = {f"phi_{p}": np.full(3, np.log(v), np.float32) for p, v in ORAL.items()}
    with pytest.raises(ValueError, match=r"g\(f\) is zero or NaN at 1 entries at subject 101, "
                                         r"row 11"):
        log_density(pk.model, (), pk.arrays(_data(df)), vals)


# ------------------------------------------------------------------ no subject
def test_no_subject_is_refused():
    """A dataset of no subject is refused when built (not NumPyro's 'size of plate should be
    positive'), and so is the model called on arrays of no subject."""
    data = _data(_table())
    empty = (lambda a: a[:0])
    with pytest.raises(ValueError, match="at least one subject"):
        nlme.PKDataset(np.asarray(data.ids[:0]), nlme.Observations(*map(empty, data.obs)),
                       nlme.Doses(*map(empty, data.doses)), {}, {}, {}, data.ignored)
    with pytest.raises(ValueError, match="idx selects no subject"):
        data.subjects(np.zeros(3, bool))
    pk = nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL)
    a = pk.arrays(data)
    a0 = {k: (v[:0] if k not in ("binding",) else v) for k, v in a.items()}
    with pytest.raises(ValueError, match="no subject"):
        log_density(pk.model, (), a0, {})


# ------------------------------------------------------------------ the model's binding
def _cl_wt():
    return nlme.PKModel(nlme.one_compartment("first_order"),
                        params={"KA": 1.0, "V": 20.0,
                                "CL": nlme.Param(2.0, covariates={"WT": "linear"})})


VALS = {"phi_KA": np.zeros(3, np.float32), "phi_V": np.full(3, 3.0, np.float32),
        "phi_CL": np.full(3, 0.7, np.float32), "beta_CL_WT": np.float32(0.01)}

# (name of dataset A, table A, table B): B differs from A by its covariate median, its
# dosing routes (bolus / infusion, depot / central) or its number of doses
SECOND_DATA = [
    ("other weights", lambda: _table(), lambda: _table(wt=(40.0, 45.0, 90.0))),
    ("oral bolus, then infusions into the central compartment",
     lambda: _table(), lambda: _table(dose_cmt=2, rate=50.0, wt=(50.0, 55.0, 65.0))),
    ("single, then multiple doses",
     lambda: _table(), lambda: _table(multiple=True, wt=(65.0, 72.0, 90.0))),
    ("infusions, then oral boluses",
     lambda: _table(dose_cmt=2, rate=50.0), lambda: _table(wt=(30.0, 90.0, 91.0))),
]


@pytest.mark.parametrize("name, table_a, table_b", SECOND_DATA, ids=[c[0] for c in SECOND_DATA])
def test_a_second_dataset_is_computed_as_by_a_fresh_model(name, table_a, table_b):
    """pk used on A, then on B, gives on B exactly what a fresh PKModel gives (log density,
    predictions): no reference, level, specialisation or record order is kept from A; and pk
    itself is unchanged."""
    a, b = _data(table_a()), _data(table_b())
    pk = _cl_wt()
    log_density(pk.model, (), pk.arrays(a), VALS)
    got = float(log_density(pk.model, (), pk.arrays(b), VALS)[0])
    fresh = _cl_wt()
    want = float(log_density(fresh.model, (), fresh.arrays(b), VALS)[0])
    assert got == want
    bound_a = pk.bind(a)
    assert pk.references == {} and not pk.is_bound
    assert pk.bind(b).references == fresh.bind(b).references == {
        "WT": float(np.median(b.covariates["WT"]))}
    assert bound_a.references == {"WT": float(np.median(a.covariates["WT"]))}
    # the predictions of the model bound to B, and of pk on B's arguments
    ind = {"KA": jnp.ones(3), "V": jnp.full(3, 20.0), "CL": jnp.full(3, 2.0)}
    arr = pk.arrays(b)
    doses = nlme.Doses(*(jnp.asarray(arr[k]) for k in (
        "dose_time", "dose_amt", "dose_rate", "dose_cmt", "dose_ss", "dose_ii", "dose_mask")))
    t = jnp.asarray(arr["obs_time"])
    p1 = np.asarray(pk.predict(ind, t, doses, arr["doses_before"], binding=arr["binding"]))
    p2 = np.asarray(fresh.bind(b).predict(ind, t, doses, arr["doses_before"]))
    np.testing.assert_array_equal(p1, p2)
    assert np.all(np.isfinite(p1))


@pytest.mark.slow
def test_a_fit_on_a_second_dataset_is_that_of_a_fresh_model():
    """pk.fit(A) then pk.fit(B) gives the fit of a fresh PKModel on B (same estimates, bit
    for bit: same seed, same program), with B's covariate reference and dosing routes; the
    fit's model is bound to its data, and pk stays unbound. Slow: three SAEM programs to
    compile (90 s on 2 busy cores); the test above checks the same on the log density."""
    from numpyro_fed.saem import Schedule

    a = _data(_table())
    b = _data(_table(multiple=True, wt=(40.0, 45.0, 90.0)))
    kw = {"schedule": Schedule(num_iters=6, num_exploration=3), "num_chains": 1}
    pk = _cl_wt()
    fit_a = pk.fit(a, jax.random.key(0), **kw)
    fit_b = pk.fit(b, jax.random.key(1), **kw)
    fresh = _cl_wt().fit(b, jax.random.key(1), **kw)
    for k, v in fresh.params.items():
        np.testing.assert_array_equal(np.asarray(fit_b.params[k]), np.asarray(v), err_msg=k)
    pd.testing.assert_frame_equal(fit_b.predictions(), fresh.predictions())
    assert not pk.is_bound and pk.references == {}
    assert fit_a.pk.references == {"WT": 70.0} and fit_b.pk.references == {"WT": 45.0}
    assert fit_b.pk.is_bound
    # simulating A's fit on B's design keeps A's reference (the estimates refer to it) and
    # takes B's routes
    sim = fit_a.simulate(jax.random.key(2), b)
    assert np.all(np.isfinite(sim["f"]))


def test_a_dataset_built_from_arrays_is_named_by_subject_and_position():
    """A PKDataset built from arrays has no input table: a fault is named by subject ID, the
    observation's (dose's) number within the subject and the item's column name."""
    data = _data(_table())
    dv = np.array(data.obs.dv, np.float64)
    dv[1, 2] = np.nan  # subject 102, 3rd observation
    obs = data.obs._replace(dv=dv)
    doses = data.doses._replace(cmt=np.where(np.arange(3)[:, None] == 2, 5, data.doses.cmt))
    pk = nlme.PKModel(nlme.one_compartment("first_order"), params=ORAL)
    bare = nlme.PKDataset(data.ids, obs, data.doses, data.covariates, {}, {}, data.ignored)
    with pytest.raises(ValueError, match=r"`dv` \(column 'DV'\) is NaN or infinite at 1 "
                                         r"uncensored observation\(s\) at subject 102, "
                                         r"observation 3 of the subject"):
        pk.arrays(bare)
    bare = nlme.PKDataset(data.ids, data.obs, doses, data.covariates, {}, {}, data.ignored)
    with pytest.raises(ValueError, match=r"dose of subject 103, dose 1 of the subject, column "
                                         r"'CMT': cmt=5 is not a compartment"):
        pk.arrays(bare)
    big = data.obs._replace(dv=np.where(np.arange(5) == 4, 1e39, dv))  # float64: finite
    bare = nlme.PKDataset(data.ids, big, data.doses, data.covariates, {}, {}, data.ignored)
    with pytest.raises(ValueError, match=r"observation of subject 101, observation 5 of the "
                                         r"subject, column 'DV': 1e\+39 overflows float32 "
                                         r"\(max 3\.4e38\)"):
        pk.arrays(bare)
    with pytest.raises(ValueError, match=r"`dv` overflows float32 \(max 3\.4e38\)"):
        pk.error.check_observations(np.array([1.0, 1e39]))


def test_the_model_definition_cannot_change_behind_it():
    """The PKModel keeps copies of its Params, read-only: editing the caller's Param (or
    trying to replace one) does not change the model, nor what it computes."""
    cl = nlme.Param(2.0, covariates={"WT": "linear"})
    pk = nlme.PKModel(nlme.one_compartment("first_order"),
                      params={"KA": 1.0, "V": 20.0, "CL": cl})
    data = _data(_table())
    before = float(log_density(pk.model, (), pk.arrays(data), VALS)[0])
    cl.covariates["WT"] = "power"
    cl.value = 5.0
    assert pk.params["CL"].covariates == {"WT": "linear"} and pk.params["CL"].value == 2.0
    assert float(log_density(pk.model, (), pk.arrays(data), VALS)[0]) == before
    with pytest.raises(TypeError):
        pk.params["CL"] = cl
