import pytest
import torch

import engine.kernels.tiles as T


@pytest.fixture
def cuda():
    """The GPU, for `gpu`-marked kernel tests: they need the compiled kernels, so they skip under the interpreter."""
    if T.INTERPRETED:
        pytest.skip("GPU kernel tests need TRITON_INTERPRET=0")
    return torch.device("cuda")
