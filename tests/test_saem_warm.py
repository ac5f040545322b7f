"""The programs of the standard errors compile while a fit's loop runs
(:meth:`numpyro_fed.saem.SAEM._warm_while_running`,
:func:`numpyro_fed.saem.result.warm_programs`): a speed measure that must never change a
number. The loop of these small models ends in well under a second, so the tests say when
it is "still running" (``SAEM._loop_busy``) instead of relying on timing."""

import threading

import jax
import numpy as np
import pytest
from saem_cases import get_case

import numpyro_fed._programs as programs
import numpyro_fed.saem.fit as fit_mod
import numpyro_fed.saem.result as result_mod
from numpyro_fed.saem import SAEM

pytestmark = pytest.mark.xdist_group("saem_warm")


@pytest.fixture(autouse=True)
def _warming_on():
    """The suite turns the warming off (tests/conftest.py); these tests are about it (a
    patch of its own: the tests' ``monkeypatch.undo()`` keeps it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fit_mod, "WARM_PROGRAMS", True)
        yield


@pytest.fixture(scope="module")
def theoph():
    case = get_case("theoph_long")
    # its loop compiled once: the fits below dispatch it at once (the tests' _loop_busy
    # then says whether it runs), rather than compiling it on the worker thread
    SAEM(case.model).run(jax.random.key(3), **case.data)
    return case


def _run(case, monkeypatch, busy_answers):
    """A fit with the loop reported busy for the given answers (then done); the names of
    the programs compiled by the fit's own path after the warming, and what warming
    compiled."""
    answers = list(busy_answers)
    monkeypatch.setattr(fit_mod, "WARM_AFTER_S", 0.0)
    # every fit warms as the answers say (a repeated run would replay its recorded programs
    # instead: tests/test_saem_replay.py)
    monkeypatch.setattr(fit_mod, "REPLAY_RUNS", False)
    monkeypatch.setattr(SAEM, "_loop_busy",
                        staticmethod(lambda outputs: lambda: bool(answers and answers.pop(0))))
    warmed, after, asked = {}, [], []
    orig_warm, orig_compile = fit_mod.warm_programs, programs.compile_program
    orig_program = result_mod.SAEMResult._program

    def program(self, name, build):
        if warmed and self._warm:  # the fit's own check, after the warming
            asked.append(name)
        return orig_program(self, name, build)

    def warm(fields, busy):
        out = orig_warm(fields, busy)
        warmed.update(out)
        return out

    def compile_program(fn, *a, **k):
        if warmed:  # after the warming: the fit's own compilations
            after.append(getattr(fn, "__name__", "?"))
        return orig_compile(fn, *a, **k)

    monkeypatch.setattr(fit_mod, "warm_programs", warm)
    monkeypatch.setattr(programs, "compile_program", compile_program)
    monkeypatch.setattr(result_mod.SAEMResult, "_program", program)
    res = SAEM(case.model).run(jax.random.key(3), **case.data)
    se = res.standard_errors()
    monkeypatch.undo()
    return res, se, warmed, after, asked


def _same(a, b):
    return all((a[k] == b[k]) or (np.isnan(a[k]) and np.isnan(b[k])) for k in a)


def test_warmed_programs_serve_the_fit_and_change_no_number(theoph, monkeypatch):
    ref, se_ref, warmed0, _, _ = _run(theoph, monkeypatch, [])  # never busy: no warming
    assert warmed0 == {}
    # the loop "runs" through the whole warming: the modes, the Gaussianity check and the
    # Gauss-Hermite information (3 latents per subject) are compiled
    res, se, warmed, after, asked = _run(theoph, monkeypatch, [True] * 10)
    assert {k[0] for k in warmed} == {("modes",), ("exact",), ("info_gq", None)}
    # the fit's convergence check computed its standard errors with the warmed runners:
    # none of the three was traced or compiled again (the library's result programs are all
    # named "f": only those the warming does not cover -- the slope of the likelihood at 0
    # of a scale that fell -- are compiled by the check)
    assert {n for n in asked if n in {k[0] for k in warmed}}  # it used warmed programs
    assert after.count("f") == len({n for n in asked if n not in {k[0] for k in warmed}})
    assert res._warm == {}  # dropped after the fit: a later call traces afresh
    np.testing.assert_array_equal(res.theta, ref.theta)
    assert _same(se, se_ref)
    assert res.convergence_messages == ref.convergence_messages


def test_warming_stops_when_the_loop_ends(theoph, monkeypatch):
    # busy through the wait and the first program only (the wait asks twice): the modes
    # are compiled, nothing else
    _, se, warmed, _, _ = _run(theoph, monkeypatch, [True, True, True, False])
    assert [k[0] for k in warmed] == [("modes",)]
    assert all(np.isfinite(v) for v in se.values())


def test_a_runner_for_other_arguments_is_not_used(theoph):
    res = SAEM(theoph.model).run(jax.random.key(3), **theoph.data)
    static = fit_mod.split_data(res.args, res.kwargs, res.info.static_data)[1]
    key = (("modes",), repr(static))

    def never(*a):
        raise AssertionError("a runner compiled for other arguments was called")

    # a runner for arguments of another signature
    res._warm = {key: (result_mod._signature((np.zeros(2),)), never)}
    res._mode_cache = None
    z = res._modes()[0]
    assert np.all(np.isfinite(np.asarray(z)))


def test_a_new_loop_compiles_on_a_worker_while_the_programs_warm(theoph):
    """With nothing compiled, the loop program compiles on a worker thread, which then
    runs it, while this thread warms the standard errors' programs: the same numbers as a
    fit whose programs were all compiled before (bit for bit)."""
    ref = SAEM(theoph.model).run(jax.random.key(3), **theoph.data)
    se_ref = ref.standard_errors()
    programs.clear()
    threads, orig = [], programs.Pending.finish

    def finish(self):
        threads.append(threading.current_thread().name)
        return orig(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(programs.Pending, "finish", finish)
        res = SAEM(theoph.model).run(jax.random.key(3), **theoph.data)
    # the loop on the worker, the standard errors' programs (and the rest) on this thread
    assert sum(t.startswith("numpyro_fed-compile") for t in threads) == 1
    assert threads.count(threading.current_thread().name) >= 3
    np.testing.assert_array_equal(res.theta, ref.theta)
    np.testing.assert_array_equal(res.z_draws, ref.z_draws)
    assert _same(res.standard_errors(), se_ref)
    assert res.convergence_messages == ref.convergence_messages


def test_an_error_of_the_worker_is_raised_by_the_fit(theoph, monkeypatch):
    orig = programs.Pending.finish

    def broken(self):
        if threading.current_thread().name.startswith("numpyro_fed-compile"):
            raise MemoryError("XLA could not allocate the loop")
        return orig(self)

    programs.clear()
    monkeypatch.setattr(programs.Pending, "finish", broken)
    with pytest.raises(MemoryError, match="could not allocate the loop"):
        SAEM(theoph.model).run(jax.random.key(3), **theoph.data)
