"""The K3.1 Pro–style hybrid model: config, presets, modules, checkpoint I/O, entry points."""
from .cache import CacheFullError, ModelCache, forward_incremental
from .checkpoint import CheckpointError, load_pretrained, save_pretrained
from .config import ConfigError, LinearAttnConfig, ModelConfig
from .context import ForwardContext, SequenceState, cu_seqlens_from_lens, packed_context
from .model import HybridForCausalLM, build_model, forward_packed, forward_packed_hidden
from .recompute import RECOMPUTE_POLICIES, apply_recompute

__all__ = [
    "CacheFullError", "CheckpointError", "ConfigError", "ForwardContext", "HybridForCausalLM", "LinearAttnConfig",
    "ModelCache", "ModelConfig", "RECOMPUTE_POLICIES", "SequenceState", "apply_recompute", "build_model", "cu_seqlens_from_lens", "forward_incremental",
    "forward_packed", "forward_packed_hidden", "load_pretrained", "packed_context", "save_pretrained",
]
