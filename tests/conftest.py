import pytest
import torch

# One intra-op thread by default: the CI machine has 2 cores, and MKL's threaded small GEMMs slow
# down badly when the cores are shared. Invariance across thread counts is tested explicitly
# (tests that need 2 threads set them and restore the default).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
