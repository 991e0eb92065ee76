import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Each xdist worker gets its share of the cores, and so do the train.py processes it starts (they inherit the
# variable): two workers each running torch's all-core thread pool oversubscribe the cores, and OpenMP threads
# spinning for a core then slow every test several times over.
os.environ.setdefault("OMP_NUM_THREADS",
                      str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
