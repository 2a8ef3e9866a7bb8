"""Capacity planning: parameter counts and cache bytes of a ``ModelConfig`` (``sizing.py``) and the
GPU-memory capacity planner behind ``zmrl plan`` (``planner.py``). Arithmetic only: builds no tensors."""
