"""GPU tests run only where the CUDA driver, cuda-bindings and a device are all present."""
import pytest


@pytest.fixture(scope="session")
def cuda_device():
    """Device 0, or a skip saying what is missing."""
    try:
        from tessera.runtime import driver
        count = driver.device_count()
    except ImportError as e:  # no cuda-bindings, or no driver library (driver.DriverNotFound)
        pytest.skip(f"CUDA runtime unavailable: {e}")
    except driver.CudaError as e:
        pytest.skip(f"CUDA driver unusable: {e}")
    if count == 0:
        pytest.skip("no CUDA device")
    return driver.Device(0)


@pytest.fixture(scope="session")
def arch(cuda_device):
    """The PTX target of device 0 ("sm_90a" on an H100)."""
    return cuda_device.platform().arch


@pytest.fixture
def hopper(cuda_device):
    """A skip where device 0 has no wgmma + TMA path (the native Hopper kernels need sm_90a)."""
    if not cuda_device.platform().has("wgmma"):
        pytest.skip("the native path's wgmma + TMA kernels need an sm_90a GPU (H100/H200)")


@pytest.fixture(scope="session")
def torch_cuda(cuda_device):
    """torch, when it is installed with CUDA."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


@pytest.fixture(autouse=True, scope="session")
def fresh_function_cache(tmp_path_factory):
    """Whole compiled functions (the warm-start cache, runtime/warm.py) cached by this run only: one
    left by an earlier run on the same machine served calls without compiling, and the tests that
    count compiles (`cache_info()`) failed there (an H200 run of session 31). Tests of the warm
    start name their own directories."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TESSERA_FUNCTION_CACHE_DIR", str(tmp_path_factory.mktemp("functions")))
        yield
