"""zmrl: zero-mismatch RL toolkit (README.md, docs/numerics.md)."""
import os as _os

# MKL reads MKL_CBWR at its first GEMM, so it is set here, before any zmrl module can run one: the
# default CPU GEMM mode of the numerics contract (zmrl/kernels_batch_invariant/numerics.py, which
# checks that it took effect).
_os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")
