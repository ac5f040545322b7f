"""Counting the programs a block of test code compiles (shared by the compile-once tests)."""

from __future__ import annotations


class Compiles:
    """Programs compiled by XLA or read back from JAX's persistent cache (``jax.monitoring``)
    while the context is open: ``names`` lists them.

    Tracing is not counted: the library's programs are traced on every run and compiled once
    per program content (:mod:`numpyro_fed._programs`); a program read back from the
    persistent cache (the suite's ``.jax_cache``) counts, as it was not in memory."""

    def __enter__(self):
        from jax._src import monitoring

        self.names: list[str] = []

        def listen(event, duration, fun_name="", **kw):
            if event == "/jax/core/compile/backend_compile_duration":
                self.names.append(fun_name)
            elif event == "/jax/compilation_cache/cache_retrieval_time_sec":
                self.names.append("<persistent cache>")

        self._listen = listen
        monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        from jax._src import monitoring

        monitoring.unregister_event_duration_listener(self._listen)
