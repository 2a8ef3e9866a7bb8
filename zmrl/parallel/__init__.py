"""Tensor- and expert-parallel execution with layout-independent numerics (see shard.py and the
README's "Scale-out" section)."""
from .state import (ParallelConfig, destroy_parallel, dp_group, dp_rank, ep_group, ep_rank, get_config,
                    init_parallel, install_cpu_shims, is_initialized, tp_group, tp_rank)
from .shard import PartialLinear, VirtualShards, gather_full_state, load_full_state, shard_model

__all__ = [
    "ParallelConfig", "init_parallel", "destroy_parallel", "is_initialized", "get_config", "install_cpu_shims",
    "tp_group", "ep_group", "dp_group", "tp_rank", "ep_rank", "dp_rank",
    "shard_model", "VirtualShards", "PartialLinear", "gather_full_state", "load_full_state",
]
