"""The persistent compilation cache option (:func:`numpyro_fed.enable_compilation_cache`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

import numpyro_fed
from numpyro_fed.compilation import default_cache_dir


@pytest.fixture
def restore_cache_config():
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    cc.reset_cache()


def test_cache_is_written_then_read_back_with_the_same_result(tmp_path, restore_cache_config):
    from jax._src import monitoring

    events = []

    def listen(name, **kw):
        events.append(name)

    jax.monitoring.register_event_listener(listen)
    # after programs have been compiled in this process: the cache is turned on anyway
    folder = numpyro_fed.enable_compilation_cache(tmp_path / "cache", min_compile_time_s=0)
    assert folder == tmp_path / "cache" and folder.is_dir()

    def f(x):  # a program no other test compiles
        return jnp.cumsum(jnp.sin(x) * 1.2345) @ jnp.cos(x[::-1])

    x = jnp.linspace(0.0, 1.0, 37)
    first = np.asarray(jax.jit(f)(x))
    assert any(folder.iterdir()), "nothing written to the cache"
    jax.clear_caches()  # what a new process starts from: no program in memory
    events.clear()
    second = np.asarray(jax.jit(f)(x))
    monitoring.unregister_event_listener(listen)
    assert "/jax/compilation_cache/cache_hits" in events
    assert first.tobytes() == second.tobytes()


def test_default_folder_and_bad_argument(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMPYRO_FED_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("NUMPYRO_FED_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "numpyro_fed" / "jax"
    with pytest.raises(ValueError, match="min_compile_time_s"):
        numpyro_fed.enable_compilation_cache(tmp_path, min_compile_time_s=-1)
