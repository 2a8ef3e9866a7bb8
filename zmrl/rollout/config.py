"""The rollout engine's settings."""
from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass

from zmrl.kernels_batch_invariant._dispatch import Mode

from .graph_runner import DECODE_GRAPH_MODES

KERNEL_MODES: tuple[str, ...] = typing.get_args(Mode)  # ("bitwise", "fast")


def valid_graph_batch_sizes(sizes: object, max_num_seqs: int) -> bool:
    """Whether ``sizes`` can be ``EngineConfig.decode_graph_batch_sizes``: a non-empty sequence (a list from YAML,
    an OmegaConf ListConfig from verl) of integers in [1, max_num_seqs]."""
    return (isinstance(sizes, Sequence) and not isinstance(sizes, str) and len(sizes) > 0
            and all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= max_num_seqs for b in sizes))


@dataclass
class EngineConfig:
    block_size: int = 64
    num_blocks: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Most GiB of KDA state snapshots the prefix cache keeps (one per cached block end: 12.4 MiB per block
    # for the bench preset); the least recently used are dropped past it. 0 keeps none (KDA models then
    # get no prefix hits).
    prefix_cache_kda_gib: float = 4.0
    latent_format: str = "native"  # "native" (model dtype) or "fp8"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # Kernel mode of the engine's ops: "bitwise" (the batch-invariant kernels: rollout log-probs equal
    # the trainer's bit for bit) or "fast" (stock kernels where an op has them: faster, parity NOT
    # expected). A value is applied process-wide when the engine is built (set_mode, so a trainer in
    # this process follows) and every engine step runs under it. None (default) follows the process
    # mode, which is "bitwise" unless set_mode changed it. The trainer must use the same mode (the
    # recipe's model.kernel_mode sets both).
    kernel_mode: str | None = None
    # Decode steps (one new token per sequence) through the fixed-shape path of graph_runner.py:
    # "cuda" captures one CUDA graph per (batch, context) bucket and replays it (needs the model on a GPU);
    # "static" runs the same fixed-shape code without capture (any device: tests, debugging); "off" runs
    # decode like prefill; "auto" (default) is "cuda" for a model on a GPU, else "off". Bitwise the same
    # tokens and log-probs in every setting.
    decode_graphs: str = "auto"
    # With the fixed-shape decode path: a step whose rows all sample at one temperature without top-k / top-p
    # draws its tokens and log-probs inside the decode graph (no eager sampling ops, one copy back). False
    # samples eagerly from the graph's logits. The same tokens and log-probs either way
    # (tests/rollout/test_graph_runner.py, uncaptured on CPU and captured on a GPU).
    sample_in_graph: bool = True
    # Batch sizes the fixed-shape decode path captures (each also per context bucket): a batch runs at the
    # smallest one that holds it, padded. None: 1, 2, 4, ... up to max_num_seqs. Finer sizes (e.g. multiples
    # of 16 above 64) pad a draining rollout less and capture more graphs (time at first use, one logits
    # buffer each). Each size is at most max_num_seqs, which is always a bucket. Same bits for any choice.
    decode_graph_batch_sizes: tuple[int, ...] | None = None

    def validate(self) -> "EngineConfig":
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.prefix_cache_kda_gib >= 0:
            raise ValueError(f"EngineConfig.prefix_cache_kda_gib must be >= 0 (GiB), got {self.prefix_cache_kda_gib!r}")
        if self.latent_format not in ("native", "fp8"):
            raise ValueError(f"EngineConfig.latent_format must be 'native' or 'fp8', got {self.latent_format!r}")
        if self.kernel_mode is not None and self.kernel_mode not in KERNEL_MODES:
            raise ValueError(f"EngineConfig.kernel_mode must be None (follow the process mode) or one of "
                             f"{', '.join(map(repr, KERNEL_MODES))} ('bitwise' = rollout/trainer log-prob parity), "
                             f"got {self.kernel_mode!r}")
        sizes = self.decode_graph_batch_sizes
        if sizes is not None:
            if not valid_graph_batch_sizes(sizes, self.max_num_seqs):
                raise ValueError(f"EngineConfig.decode_graph_batch_sizes must be None or a non-empty list of integers "
                                 f"in [1, max_num_seqs = {self.max_num_seqs}], got {sizes!r}")
            self.decode_graph_batch_sizes = tuple(sizes)
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ValueError(f"EngineConfig.decode_graphs must be one of {', '.join(map(repr, DECODE_GRAPH_MODES))}, "
                             f"got {self.decode_graphs!r}")
        return self
