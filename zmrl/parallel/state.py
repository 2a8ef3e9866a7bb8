"""Process groups for tensor / expert / data parallelism, from megatron-core's ``parallel_state``.

``init_parallel(ParallelConfig(tp=2, ep=1, virtual_shards=2))`` initialises torch.distributed (gloo on
CPU, NCCL on GPU) from the usual launcher variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK``: torchrun sets them) and asks megatron-core for the groups. The model
code only ever sees ``tp_group()`` / ``ep_group()`` (``None`` = a group of one, no communication).

On CPU megatron-core needs two shims: ``torch.cuda.current_device`` must
answer ``"cpu"`` (its global memory buffer allocates there) and the CUDA RNG tracker must be replaced
by one that forks the CPU generator. zmrl's own layers use neither, but a user who mixes in
megatron-core modules on a CPU run gets working ones; the shims are installed only when CUDA is absent.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    """Layout of one model replica.

    tp: tensor-parallel degree (MLA/KDA heads, dense and shared-expert MLPs are split over it).
    ep: expert-parallel degree (routed experts and their LoRA are partitioned over it).
    dp: data-parallel degree; 0 means "whatever is left of the world" (world / (tp * ep-free part)).
    virtual_shards: V, the number of pieces every sharded layer is ALWAYS computed as, whatever tp
        is; fixed by the run config and identical on the rollout and the trainer side. tp must divide
        V. V = 1 is today's single-process arithmetic exactly. Log-probs are bitwise equal across
        every tp that divides V (and every ep) for the same V; they are NOT equal across different V.
    backend: "gloo", "nccl" or "auto" (nccl when CUDA is available).
    reduce: "tree" (all-gather the V partials, fixed-order tree sum: layout-independent bits) or
        "allreduce" (sum the local partials, then a plain all-reduce as in Megatron: fewer bytes, but
        the bits depend on the degree; kept as the negative control and the cost baseline).
    """

    tp: int = 1
    ep: int = 1
    dp: int = 0
    virtual_shards: int = 1
    backend: str = "auto"
    reduce: str = "tree"

    def validate(self) -> "ParallelConfig":
        for name in ("tp", "ep", "virtual_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp < 0:
            raise ValueError(f"ParallelConfig.dp must be >= 0 (0 = derived from the world size), got {self.dp}")
        if self.virtual_shards % self.tp:
            raise ValueError(f"ParallelConfig: tp={self.tp} must divide virtual_shards={self.virtual_shards} "
                             "(every rank computes V/tp whole virtual shards)")
        if self.reduce not in ("tree", "allreduce"):
            raise ValueError(f"ParallelConfig.reduce must be 'tree' or 'allreduce', got {self.reduce!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"ParallelConfig.backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        return self

    @property
    def shards_per_rank(self) -> int:
        return self.virtual_shards // self.tp

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass
class _State:
    cfg: ParallelConfig
    owns_process_group: bool
    source: str  # "megatron-core" or "torch.distributed" (fallback when megatron-core is not installed)
    tp_group: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None


_STATE: _State | None = None


# ---------------------------------------------------------------------- CPU shims for megatron-core
class CPURNGTracker:
    """Stand-in for megatron-core's CUDA RNG tracker on CPU: named CPU generator states, forked on demand."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.states[name] = torch.Generator().manual_seed(seed).get_state()

    def is_initialized(self) -> bool:
        return bool(self.states)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not added")
        saved = torch.random.get_rng_state()
        torch.random.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.random.get_rng_state()
            torch.random.set_rng_state(saved)


_CPU_TRACKER = CPURNGTracker()
_SHIMS_INSTALLED = False


def install_cpu_shims() -> None:
    """Patch megatron-core for a CUDA-less process (idempotent; a no-op when CUDA is available)."""
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED or torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mc_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # global memory buffer device
    getter = lambda *args, **kwargs: _CPU_TRACKER  # noqa: E731
    tensor_parallel.get_cuda_rng_tracker = getter  # type: ignore[assignment]
    mc_random.get_cuda_rng_tracker = getter  # type: ignore[assignment]
    _SHIMS_INSTALLED = True
    log.debug("megatron-core CPU shims installed")


# ---------------------------------------------------------------------- init / teardown
def init_parallel(cfg: ParallelConfig, timeout_s: float = 600.0) -> ParallelConfig:
    """Initialise torch.distributed (if the launcher has not) and megatron-core's model-parallel groups.

    Returns the config with ``dp`` resolved. A world of one with tp = ep = 1 needs no launcher."""
    global _STATE
    cfg.validate()
    if _STATE is not None:
        raise RuntimeError("init_parallel: already initialised; call destroy_parallel() first")
    owns = False
    if not dist.is_initialized():
        backend = cfg.resolved_backend()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        kwargs = {}
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
        owns = True
    world = dist.get_world_size()
    if world % cfg.tp or world % cfg.ep:
        raise ValueError(f"world size {world} is not divisible by tp={cfg.tp} and ep={cfg.ep}")
    dp = world // cfg.tp
    if cfg.dp and cfg.dp != dp:
        raise ValueError(f"ParallelConfig.dp={cfg.dp} but world {world} / tp {cfg.tp} = {dp}")
    try:
        if os.environ.get("ZMRL_PARALLEL_GROUPS") == "torch":  # tests: exercise the fallback
            raise ImportError("ZMRL_PARALLEL_GROUPS=torch")
        groups = _megatron_groups(cfg)
        source = "megatron-core"
    except ImportError as e:  # e.g. a GPU box without the wheel: same layout, plain torch.distributed groups
        log.warning("megatron-core is not importable (%s): building the same groups with torch.distributed", e)
        groups = _plain_groups(cfg, world)
        source = "torch.distributed"
    _STATE = _State(dataclasses.replace(cfg, dp=dp), owns, source, *groups)
    log.info("parallel: world %d, tp %d, ep %d, dp %d, V %d (rank %d: tp rank %d, ep rank %d)", world, cfg.tp,
             cfg.ep, dp, cfg.virtual_shards, dist.get_rank(), tp_rank(), ep_rank())
    return _STATE.cfg


def _megatron_groups(cfg: ParallelConfig):
    from megatron.core import parallel_state as ps

    if not torch.cuda.is_available():
        install_cpu_shims()
    # Experts are never tensor-split here (expert_tensor_parallel_size=1): an expert's GEMMs are small
    # and run whole on the rank that owns it; megatron-core then forms EP groups of `ep` ranks.
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, expert_model_parallel_size=cfg.ep,
                                 expert_tensor_parallel_size=1)
    return (ps.get_tensor_model_parallel_group() if cfg.tp > 1 else None,
            ps.get_expert_model_parallel_group() if cfg.ep > 1 else None,
            ps.get_data_parallel_group())


def _plain_groups(cfg: ParallelConfig, world: int):
    """megatron-core's layout for pp = cp = etp = 1: TP and EP groups are blocks of consecutive ranks,
    DP groups the ranks with the same TP rank. Every rank creates every group (new_group is collective)."""
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup | None] = {"tp": None, "ep": None, "dp": None}
    for kind, size in (("tp", cfg.tp), ("ep", cfg.ep)):
        for start in range(0, world, size):
            g = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size and size > 1:
                mine[kind] = g
    for t in range(cfg.tp):
        g = dist.new_group(list(range(t, world, cfg.tp)))
        if rank % cfg.tp == t:
            mine["dp"] = g
    return mine["tp"], mine["ep"], mine["dp"]


def destroy_parallel() -> None:
    """Tear down the megatron-core groups (and the process group if ``init_parallel`` created it)."""
    global _STATE
    if _STATE is None:
        return
    if _STATE.source == "megatron-core":
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    if _STATE.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = None


def is_initialized() -> bool:
    return _STATE is not None


def get_config() -> ParallelConfig | None:
    return None if _STATE is None else _STATE.cfg


# ---------------------------------------------------------------------- accessors
def tp_group() -> dist.ProcessGroup | None:
    """The tensor-parallel group, or None when not initialised or of size one (no communication)."""
    return None if _STATE is None else _STATE.tp_group


def ep_group() -> dist.ProcessGroup | None:
    return None if _STATE is None else _STATE.ep_group


def dp_group() -> dist.ProcessGroup | None:
    return None if _STATE is None else _STATE.dp_group


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def tp_rank() -> int:
    return _rank(tp_group())


def ep_rank() -> int:
    return _rank(ep_group())


def dp_rank() -> int:
    return _rank(dp_group())
