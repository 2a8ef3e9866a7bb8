"""Rollout and trainer on separate resource groups of a Ray cluster, through placement groups.

The layout follows verl's resource pools: each *role* (``rollout``, ``trainer``) gets one Ray placement
group, one bundle per worker (``{"GPU": num_gpus, "CPU": num_cpus}``), and each worker is a Ray actor
pinned to its own bundle with ``PlacementGroupSchedulingStrategy``. Ray gives a ``num_gpus`` actor its
own ``CUDA_VISIBLE_DEVICES``, so every worker sees its GPU as ``cuda:0``; the rollout group and the
trainer group never share a device.

Data flow of one RL step (the driver is the process running ``RLRunner``)::

    driver --prompt shards-------------------------> rollout workers (data-parallel engines, in parallel)
    driver <--token ids + recorded log-probs (CPU)-- rollout workers
    driver: rewards, advantages
    driver --samples + advantages------------------> trainer: parity recompute, optimiser step
    trainer --LoRA state (an ObjectRef)------------> every rollout worker, through the object store

Each prompt keeps its global request id when the step's prompts are split over several rollout
workers, and sampling randomness derives from (seed, request id, position) only, so a run with N
rollout workers samples bitwise the same tokens as a run with one.

Every actor sets up its process before it builds its worker (``ActorEnv``): the driver's numerics contract
(kernel mode, dot precisions, CPU GEMM mode, thread count: both sides must run the same ops with the same
numerics, or parity is lost; the driver compares their fingerprints before the first step) and the device.
``RayCluster.close`` kills the actors, removes the placement groups and, when it started Ray itself,
shuts Ray down; the runner calls it at the end of a run and on any error.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from zmrl.kernels_batch_invariant.numerics import Numerics, apply_numerics, current_numerics, fingerprint

if TYPE_CHECKING:
    from .config import DistributedSection, RoleSection

log = logging.getLogger(__name__)

ROLES: tuple[str, ...] = ("rollout", "trainer")


def _loopback_only() -> None:
    """Make the Ray that the runner starts listen on the loopback interface only.

    Ray rewrites a loopback ``_node_ip_address`` to the machine's reachable address and its servers then
    listen on every interface; its own switch for single-machine Ray (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
    off: the node address is localhost) keeps the GCS, raylets and workers on 127.0.0.1. The variable is
    read when ray is imported, so the imported constant is set as well; the processes Ray starts inherit
    the variable. A multi-node cluster is started with ``ray start`` and joined through ray_address."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


class ClusterError(RuntimeError):
    """The Ray cluster cannot host the requested groups, or a worker cannot use what it was given;
    the message says what was asked for and what is there."""


# ---------------------------------------------------------------------------------------- process set-up
@dataclass(frozen=True)
class ActorEnv:
    """What a worker process must look like before its worker is built (the same on both sides)."""

    device: str = "cpu"  # "cuda": the actor's own GPU (Ray sets CUDA_VISIBLE_DEVICES), seen as cuda:0
    # The driver's numerics contract (kernel mode, dot precisions, CPU GEMM mode, thread count), applied
    # in the actor with zmrl.kernels_batch_invariant.apply_numerics; None = the defaults.
    numerics: Numerics | None = None

    def apply(self) -> None:
        if self.device == "cpu" and not torch.cuda.is_initialized():  # (is_available() would read the env)
            # A CPU worker on a GPU node holds no GPU: hide them all (the CUDA driver reads this when it
            # is first used), whatever Ray's policy for num_gpus=0 actors is.
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        apply_numerics(self.numerics or Numerics())
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ClusterError(f"worker on {socket.gethostname()} was given device {self.device!r} but torch sees "
                                   f"no CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                                   f"torch {torch.__version__} built with CUDA {torch.version.cuda})")
            torch.cuda.set_device(0)  # the only device Ray left visible to this actor


def process_info() -> dict[str, Any]:
    """Where this process runs and how it is set up (for logs and tests)."""
    info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "torch_threads": torch.get_num_threads(),
                            "kernel_mode": current_numerics().kernel_mode, "numerics": fingerprint().digest,
                            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "placement_group_id": None, "node_id": None, "gpu_ids": []}
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            info.update(placement_group_id=ctx.get_placement_group_id(), node_id=ctx.get_node_id(),
                        gpu_ids=[str(g) for g in ray.get_gpu_ids()])
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        info["cuda_device"] = torch.cuda.get_device_name(torch.cuda.current_device())
    return info


class WorkerHost:
    """The body of every Ray actor: set up the process (``ActorEnv``), then build and host one worker.

    A generic host (instead of ``ray.remote(RolloutWorker)``) keeps the worker classes plain Python: the
    same classes run in-process in the single-process loop."""

    def __init__(self, role: str, rank: int, bundle_index: int, env: ActorEnv, cls: type,
                 args: Sequence[Any], kwargs: dict[str, Any]):
        env.apply()
        self.role, self.rank, self.bundle_index, self.env = role, rank, bundle_index, env
        self.worker = cls(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def info(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "bundle_index": self.bundle_index, "device": self.env.device,
                **process_info()}


# ---------------------------------------------------------------------------------------- handles
class WorkerHandle(Protocol):
    """How the loop talks to a worker wherever it lives: ``submit`` starts a call and returns something
    ``gather`` resolves; ``call`` is submit + resolve."""

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...


@dataclass
class Done:
    """The result of a call that already ran (in-process)."""

    value: Any


class LocalHandle:
    """A worker in this process; calls run at once, in order."""

    def __init__(self, worker: Any):
        self.worker = worker

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Done:
        args = tuple(a.value if isinstance(a, Done) else a for a in args)  # a previous call's result
        return Done(getattr(self.worker, method)(*args, **kwargs))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.submit(method, *args, **kwargs).value


class RayHandle:
    """A worker in a Ray actor (a ``WorkerHost``). ``submit`` returns an ObjectRef; passing one as an
    argument of another call hands the data over through the object store without the driver."""

    def __init__(self, actor: Any, role: str, rank: int):
        import ray

        self.ray, self.actor, self.role, self.rank = ray, actor, role, rank

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.actor.call.remote(method, *args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.ray.get(self.submit(method, *args, **kwargs))


def gather(pending: Sequence[Any]) -> list[Any]:
    """Resolve what ``submit`` returned (in order); Ray refs are fetched together, so calls on different
    actors run in parallel."""
    refs = [p for p in pending if not isinstance(p, Done)]
    fetched: list[Any] = []
    if refs:
        import ray

        fetched = ray.get(refs)
    it = iter(fetched)
    return [p.value if isinstance(p, Done) else next(it) for p in pending]


def shard(n_items: int, n_workers: int) -> list[range]:
    """Contiguous, nearly equal slices of ``range(n_items)``, one per worker (empty ones dropped); the
    concatenation of the shards' outputs is in the original order."""
    base, extra = divmod(n_items, max(n_workers, 1))
    out, start = [], 0
    for w in range(n_workers):
        size = base + (1 if w < extra else 0)
        if size:
            out.append(range(start, start + size))
        start += size
    return out


# ---------------------------------------------------------------------------------------- the cluster
def bundle_of(spec: "RoleSection") -> dict[str, float]:
    """One worker's bundle; zero entries are left out (Ray refuses bundles of zeros only)."""
    bundle: dict[str, float] = {}
    if spec.num_cpus:
        bundle["CPU"] = float(spec.num_cpus)
    if spec.num_gpus:
        bundle["GPU"] = float(spec.num_gpus)
    return bundle


def check_resources(roles: dict[str, "RoleSection"], totals: dict[str, float],
                    nodes: list[dict[str, float]]) -> None:
    """Refuse, before anything is reserved, groups that the cluster can never host: more CPUs/GPUs in
    all than it has, or a bundle bigger than any one node (a bundle lives on a single node)."""
    for res in ("CPU", "GPU"):
        need = sum(bundle_of(s).get(res, 0.0) * s.workers for s in roles.values())
        have = float(totals.get(res, 0.0))
        if need > have + 1e-9:
            per_role = ", ".join(f"{r}: {s.workers} x {bundle_of(s).get(res, 0.0):g}" for r, s in roles.items())
            keys = " / ".join(f"distributed.{r}.{'num_gpus' if res == 'GPU' else 'num_cpus'}" for r in roles)
            raise ClusterError(f"the recipe asks for {need:g} {res} ({per_role}; keys {keys} and "
                               f"distributed.<role>.workers) but the Ray cluster has {have:g} {res}"
                               + (" (no GPU is visible to Ray: run on a GPU node, or set num_gpus=0 to run on CPU)"
                                  if res == "GPU" and not have else ""))
    for role, spec in roles.items():
        b = bundle_of(spec)
        if nodes and not any(all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items()) for n in nodes):
            raise ClusterError(f"distributed.{role}: one worker's bundle {b} does not fit on any node of the "
                               f"cluster (nodes: {[{k: n.get(k, 0.0) for k in ('CPU', 'GPU')} for n in nodes]})")


@dataclass
class RoleGroup:
    """One role's placement group and the actors pinned to its bundles (rank i on bundle i)."""

    role: str
    placement_group: Any
    handles: list[RayHandle] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)

    @property
    def placement_group_id(self) -> str:
        return self.placement_group.id.hex()


class RayCluster:
    """Connects to (or starts) Ray, reserves one placement group per role and starts the workers there.

    Use ``close()`` (or ``with``) to release everything; it is safe to call more than once."""

    def __init__(self, dc: "DistributedSection"):
        import ray

        self.ray = ray
        self.dc = dc
        self.groups: dict[str, RoleGroup] = {}
        self._pgs: list[Any] = []  # every group created, ready or not: close() removes them all
        self._actors: list[Any] = []
        self._started_ray = False
        self._closed = False
        self.run_tag = uuid.uuid4().hex[:8]  # names the groups of this runner (several runners may share Ray)
        if not ray.is_initialized():
            if dc.ray_address:
                ray.init(address=dc.ray_address, log_to_driver=False)
            else:
                _loopback_only()
                ray.init(num_cpus=dc.ray_num_cpus, num_gpus=dc.ray_num_gpus, include_dashboard=False,
                         log_to_driver=False)
            self._started_ray = True

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def check(self, roles: dict[str, "RoleSection"]) -> None:
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        check_resources(roles, self.ray.cluster_resources(), nodes)

    def reserve(self, role: str, spec: "RoleSection") -> RoleGroup:
        """Create the role's placement group (``spec.workers`` bundles) and wait for it
        (``placement_timeout_s``): the error says what the cluster has when it cannot be placed."""
        from ray.util.placement_group import placement_group, placement_group_table

        bundle = bundle_of(spec)
        pg = placement_group([dict(bundle) for _ in range(spec.workers)], strategy=spec.strategy,
                             name=f"zmrl-{role}-{self.run_tag}")
        self._pgs.append(pg)  # before waiting: close() removes it even if it never becomes ready
        if not pg.wait(self.dc.placement_timeout_s):
            state = placement_group_table(pg).get("state")
            raise ClusterError(
                f"distributed.{role}: placement group of {spec.workers} x {bundle} ({spec.strategy}) not ready "
                f"after {self.dc.placement_timeout_s:g} s (state {state}); the cluster has "
                f"{self.ray.cluster_resources()} in all and {self.ray.available_resources()} free. Free resources, "
                f"lower distributed.{role}.workers/num_gpus/num_cpus, use strategy PACK, or raise "
                f"distributed.placement_timeout_s")
        group = RoleGroup(role, pg)
        self.groups[role] = group
        return group

    def launch(self, group: RoleGroup, spec: "RoleSection", env: ActorEnv, cls: type, args: Sequence[Any],
               kwargs: dict[str, Any] | None = None) -> RoleGroup:
        """Start one ``WorkerHost(cls(*args, **kwargs))`` per bundle of the group (rank i on bundle i);
        returns at once (``wait_ready`` waits for the constructors)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host = self.ray.remote(WorkerHost)
        for rank in range(spec.workers):
            actor = host.options(
                num_cpus=float(spec.num_cpus), num_gpus=float(spec.num_gpus), max_restarts=0,
                name=f"zmrl-{group.role}-{rank}-{self.run_tag}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group.placement_group, placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=True),
            ).remote(group.role, rank, rank, env, cls, tuple(args), dict(kwargs or {}))
            self._actors.append(actor)
            group.handles.append(RayHandle(actor, group.role, rank))
        return group

    def wait_ready(self) -> None:
        """Wait until every launched worker is built (they load the model in parallel); a constructor's
        error is raised here."""
        groups = [g for g in self.groups.values() if g.handles and not g.infos]
        fetched = iter(self.ray.get([h.actor.info.remote() for g in groups for h in g.handles]))
        for group in groups:
            group.infos = [next(fetched) for _ in group.handles]
            for info in group.infos:
                log.info("%s worker %d: pid %d on %s, placement group %s bundle %d, device %s, GPUs %s, "
                         "%d threads, kernel mode %s", group.role, info["rank"], info["pid"], info["host"],
                         info["placement_group_id"], info["bundle_index"], info["device"], info["gpu_ids"],
                         info["torch_threads"], info["kernel_mode"])

    def start_group(self, role: str, spec: "RoleSection", env: ActorEnv, cls: type,
                    args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> RoleGroup:
        """``reserve`` + ``launch`` + ``wait_ready`` for one role."""
        group = self.launch(self.reserve(role, spec), spec, env, cls, args, kwargs)
        self.wait_ready()
        return group

    def describe(self) -> list[dict[str, Any]]:
        return [info for g in self.groups.values() for info in g.infos]

    @property
    def placement_group_ids(self) -> list[str]:
        return [pg.id.hex() for pg in self._pgs]

    def close(self) -> None:
        """Kill the actors, remove the placement groups, shut Ray down if this object started it."""
        if self._closed:
            return
        self._closed = True
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - teardown goes on whatever one actor does
                log.warning("could not kill an actor: %s", e)
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001
                log.warning("could not remove placement group %s: %s", pg.id.hex(), e)
        self._actors.clear()
        if self._started_ray:
            self.ray.shutdown()
        log.info("released placement groups %s", self.placement_group_ids)
