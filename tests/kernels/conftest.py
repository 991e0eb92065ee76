import pytest
import torch

import streamtrain_kernels.tiles as T


@pytest.fixture
def cuda():
    """The GPU, for `gpu`-marked kernel tests: they need the compiled kernels, so they skip under the interpreter."""
    if T.INTERPRETED:
        pytest.skip("GPU kernel tests need TRITON_INTERPRET=0")
    return torch.device("cuda")


@pytest.fixture
def interpreter():
    """The CPU, for tests that launch a jit kernel of their own on CPU tensors: only the interpreter runs those
    (tests/conftest.py sets TRITON_INTERPRET=1 unless the environment says otherwise)."""
    if not T.INTERPRETED:
        pytest.skip("launching a kernel on CPU tensors needs TRITON_INTERPRET=1")
    return torch.device("cpu")
