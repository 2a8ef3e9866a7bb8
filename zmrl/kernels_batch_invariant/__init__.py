"""Batch-invariant ops: every token's outputs are computed with an arithmetic order that depends
on that token's own inputs (and its context) alone. See docs/numerics.md."""
from ._dispatch import InvariantOp, get_mode, invariant_op
from .matmul import bmm_fixed, grouped_linear, linear, linear_blockdiag, linear_concat
from .numerics import (Numerics, NumericsError, NumericsFingerprint, apply_numerics, check_same_numerics,
                       current_numerics, fingerprint, kernel_mode, numerics_scope, set_mode)
from .reduce import tree_mean, tree_sum

__all__ = [
    "InvariantOp", "Numerics", "NumericsError", "NumericsFingerprint", "apply_numerics", "bmm_fixed",
    "check_same_numerics", "current_numerics", "fingerprint", "get_mode", "grouped_linear", "invariant_op",
    "kernel_mode", "linear", "linear_blockdiag", "linear_concat", "numerics_scope", "set_mode", "tree_mean", "tree_sum",
]

# Register the Triton backend (a no-op without triton). Last: its modules import the ops above.
from . import triton as _triton_backend  # noqa: E402,F401
