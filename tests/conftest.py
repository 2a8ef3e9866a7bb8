import os

import pytest
import torch

# One intra-op thread by default: the CI machine has 2 cores, and MKL's threaded small GEMMs slow
# down badly when the cores are shared. Invariance across thread counts is tested explicitly
# (tests that need 2 threads set them and restore the default).
torch.set_num_threads(1)

# Triton kernel tests (marker "triton") run on a CUDA device, or on the CPU under Triton's interpreter
# (TRITON_INTERPRET=1, slow, for developing kernels without a GPU). Other "gpu" tests need CUDA.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" not in item.keywords:
            continue
        if "triton" in item.keywords and TRITON_INTERPRET:
            continue
        item.add_marker(skip_gpu)
