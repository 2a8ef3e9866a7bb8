"""Batch-invariant ops: every token's outputs are computed with an arithmetic order that depends
on that token's own inputs (and its context) alone. See DESIGN §2."""
from ._dispatch import InvariantOp, get_mode, invariant_op, kernel_mode, set_mode
from .matmul import bmm_fixed, grouped_linear, linear
from .reduce import tree_mean, tree_sum

__all__ = [
    "InvariantOp", "bmm_fixed", "get_mode", "grouped_linear", "invariant_op", "kernel_mode", "linear", "set_mode",
    "tree_mean", "tree_sum",
]

# Register the Triton backend (a no-op without triton). Last: its modules import the ops above.
from . import triton as _triton_backend  # noqa: E402,F401
