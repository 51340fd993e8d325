import numpy as np
import pytest

from rnnlm import backend

XPS = [pytest.param("cpu", id="numpy")]
XPS.append(pytest.param("gpu", id="cupy", marks=pytest.mark.skipif(
    not backend.gpu_available(), reason="no CUDA device / CuPy")))


@pytest.fixture(params=XPS)
def xp(request):
    """NumPy, and CuPy when a CUDA device is present: kernel tests run on both."""
    return backend.get_xp(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
