import jax
import pytest


@pytest.fixture
def x64():
    """Run a test in float64 (exactness tests); other tests run in JAX's default float32."""
    with jax.enable_x64(True):
        yield
