"""Test-session settings: compile speed (the suite spends most of its time compiling).

Set before JAX creates its CPU backend, and inherited by the processes the tests start
(Flower SuperNodes, ClientApps):

- ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU's classic emitters compile 1.3-2.5x
  faster than its MLIR fusion emitters and run these programs as fast (measured in
  ``numpyro_fed/saem/model.py``, where the SAEM programs set it themselves);
- ``--xla_backend_optimization_level=0``: no LLVM optimisation of the compiled code. The
  suite's programs run for milliseconds to seconds and take longer to compile than to run;
  measured on five of its heaviest tests: 112 s -> 93 s (the one compute-bound test, NUTS
  on a logistic regression, 12 s -> 15 s). XLA's own (HLO) optimisations are unchanged, and
  the SAEM programs keep their own level (``jax.jit(compiler_options=...)`` overrides it);
- JAX's persistent compilation cache in ``.jax_cache/`` (git-ignored): a program compiled
  once in the session (e.g. the same kernel on the same shapes in two tests, or in a test
  and in the Flower processes it starts) is read back instead of compiled again. It is
  keyed by the program and the compiler options, so it cannot serve a stale program;
  ``NUMPYRO_FED_TEST_CACHE=0`` turns it off;
- ``NUMPYRO_FED_WARM_PROGRAMS=0``: no standard-error programs compiled in the shadow of a
  fit's loop (the tests of that warming turn it on);
- ``NUMPYRO_FED_VERIFY_TRACE_KEYS=1``: the library's program cache (:mod:`numpyro_fed.
  _programs`) reuses an executable when a fresh trace has the fingerprint of an earlier one,
  without lowering it again; in the suite every trace is lowered anyway and a fingerprint
  that lowered to another program raises, so that every program the suite builds checks the
  fingerprint (``tests/test_cache_correctness.py`` runs the users' path, without it).
"""

import os
from pathlib import Path

_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in _flags:
        _flags = f"{_flags} {_flag}"
os.environ["XLA_FLAGS"] = _flags.strip()
if os.environ.get("NUMPYRO_FED_TEST_CACHE", "1") != "0":
    _cache = Path(__file__).resolve().parents[1] / ".jax_cache"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_cache))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

os.environ.setdefault("NUMPYRO_FED_VERIFY_TRACE_KEYS", "1")
# SAEM fits compile their standard errors' programs on a worker thread while their loop
# runs (numpyro_fed.saem.fit.WARM_PROGRAMS): wall time saved on an idle machine, extra work
# when every core runs a test worker and the test never asks for the standard errors
# (measured: 8% of the SAEM shape and boundary tests). It changes no number
# (tests/test_saem_warm.py, which turns it on, as does the replay test of a warmed run)
os.environ.setdefault("NUMPYRO_FED_WARM_PROGRAMS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Run a test in float64 (exactness tests); other tests run in JAX's default float32."""
    with jax.enable_x64(True):
        yield
