"""Where the time of an RL-shaped rollout goes: per engine step, the wall time, the host time of each engine
phase, the GPU time of the CUDA-graph replays, the GPU busy time and the synchronisations.

    python benchmarks/rollout_profile.py [--prompts 8] [--n 8] [--prompt-len 512] [--max-new 512]
        [--min-new-frac 0.25] [--layers 16] [--max-num-seqs 256] [--max-batched-tokens 16384]
        [--profile-start 16] [--profile-steps 8] [--decode-graphs auto] [--eager-sampling] [--same-prompts]
        [--out FILE.json] [--smoke]

``--profile-start 0 --profile-steps 1`` profiles the prefill step.

The rollout is the one ``benchmarks/rl_step.py --rollout-only`` times: ``--prompts`` random prompts of
``--prompt-len`` tokens, ``--n`` samples each (temperature 1, per-request seeds), each prompt's response length
drawn uniformly from [``--min-new-frac`` x ``--max-new``, ``--max-new``], no stop tokens, prefix caching on,
bench preset in bf16 with rank-32 LoRA, bitwise kernels, ``RolloutEngine.generate``. A warm-up ``generate``
(Triton compilation, graph capture) is followed by the timed one over fresh prompts of the same lengths, as
an RL loop's later steps see them (new problems, the kernels and graphs already built); ``--same-prompts``
times the warm-up's prompts again instead (every prompt block a prefix-cache hit). Every step of the timed
run is recorded:

* ``wall_ms``: ``RolloutEngine.step`` wall clock (its last sync, fetching the sampled tokens, ends it);
* host phases (wall clock of each, nested ones inside their parent): ``schedule``; ``runner`` (all of
  ``ModelRunner.run``) with, inside it, ``decode_inputs`` (``DecodeGraphRunner.run``: static inputs, one
  host->device copy, the replay launch), ``kda_load`` (a sequence's KDA state moved into its pool slot),
  ``kda_snapshot`` (prefix-cache snapshots at 64-token boundaries) and ``eager_forward`` (prefill and mixed
  steps); ``register_blocks``; ``forks``; ``sample`` (``sampler.fetch`` when the decode graph drew the tokens,
  else ``sampler.draw``: the eager draw and its log-probs; both end in the one read-back of the step, so this
  phase includes waiting for the GPU); ``apply`` (appending the draws, finishing); ``graph_sampled`` says
  whether the step's graph drew the tokens (``EngineConfig.sample_in_graph``);
* ``graph_gpu_ms``: GPU time of the step's graph replay (CUDA events around ``CUDAGraph.replay``); the
  ``graph_share`` of decode steps is its sum over their wall time: the rest of a step is host work, eager GPU
  work around the graph (sampling, log-probs, snapshots) and the GPU idling at synchronisations.

Over ``--profile-steps`` decode steps from step ``--profile-start`` of the timed run, ``torch.profiler``
records the GPU busy time (union of kernel and copy intervals), the top kernels, the top host ops, the
CUDA runtime calls that synchronise (``cudaStreamSynchronize``, ``cudaEventSynchronize``,
``cudaDeviceSynchronize``) and the copies by direction (a pageable device->host copy also stalls the host).
Over the same number of steps after that window, ``torch.cuda.set_sync_debug_mode("warn")`` counts the
synchronising calls torch itself reports (``.item()``, ``.tolist()``, ``nonzero``, blocking copies).

``--smoke``: CPU, tiny preset and sizes, the fixed-shape decode path without capture
(``decode_graphs="static"``): checks the script end to end; its host-phase figures are the engine's host
work over a tiny model (GPU figures are absent).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from _common import build_bench_model, default_out, env, pick_device, setup_logging, table, write_json
from zmrl.kernels_batch_invariant import set_mode
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.rollout import engine as engine_module

log = logging.getLogger("benchmarks.rollout_profile")
PHASES = ("schedule", "runner", "decode_inputs", "kda_load", "kda_snapshot", "eager_forward", "register_blocks",
          "forks", "sample", "apply")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


class StepRecorder:
    """Wraps the engine's phases with wall-clock timers and keeps one record per ``RolloutEngine.step``."""

    def __init__(self, engine: RolloutEngine, cuda: bool):
        self.engine, self.cuda = engine, cuda
        self.steps: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.replay_events: list[tuple[int, Any, Any]] = []  # (step, start, end) CUDA events
        self.hooks: dict[int, Callable[[int], None]] = {}  # step index -> called before that step
        self._undo: list[Callable[[], None]] = []

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        had = name in vars(owner)
        original = vars(owner).get(name)
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original) if had else delattr(owner, name))

    def _timed(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.current is not None:
                    ms = self.current["phases"]
                    ms[phase] = ms.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3
        return timed

    def install(self) -> None:
        e = self.engine
        sch, runner = e.scheduler, e.runner
        for obj, name, phase in ((sch, "schedule", "schedule"), (runner, "run", "runner"),
                                 (runner, "_forward_eager", "eager_forward"), (sch, "register_blocks", "register_blocks"),
                                 (sch, "with_forks", "forks"), (sch, "apply", "apply")):
            self._patch(obj, name, self._timed(phase, getattr(obj, name)))
        self._patch(engine_module, "draw", self._timed("sample", engine_module.draw))
        self._patch(engine_module, "fetch", self._timed("sample", engine_module.fetch))
        graphs = runner.graphs
        if graphs is not None:
            self._patch(graphs, "run", self._timed("decode_inputs", self._graph_step(graphs.run)))
            self._patch(graphs, "snapshot", self._timed("kda_snapshot", graphs.snapshot))
            self._patch(graphs.pool, "load", self._timed("kda_load", graphs.pool.load))
            if self.cuda:
                self._patch_replay()
        self._patch(e, "step", self._step(e.step))

    def _graph_step(self, fn: Callable) -> Callable:
        def run(reqs, *args):
            if self.current is not None:
                self.current["graph_rows"] = len(reqs)
                self.current["graph_sampled"] = bool(args) and args[0] is not None
            return fn(reqs, *args)
        return run

    def _patch_replay(self) -> None:
        cls = torch.cuda.CUDAGraph
        original = cls.replay
        rec = self

        def replay(graph):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            original(graph)
            end.record()
            if rec.current is not None:
                rec.replay_events.append((rec.current["step"], start, end))
        cls.replay = replay
        self._undo.append(lambda: setattr(cls, "replay", original))

    def _step(self, fn: Callable) -> Callable:
        def step():
            i = len(self.steps)
            hook = self.hooks.get(i)
            if hook is not None:
                hook(i)
            batch_before = len(self.engine.running) + len(self.engine.waiting)
            self.current = {"step": i, "phases": {}, "graph_rows": 0, "graph_sampled": False, "live": batch_before}
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.current["wall_ms"] = (time.perf_counter() - t0) * 1e3
                self.current["eager"] = "eager_forward" in self.current["phases"]
                self.steps.append(self.current)
                self.current = None
        return step

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def resolve_replays(self) -> None:
        if not self.replay_events:
            return
        torch.cuda.synchronize()
        for i, start, end in self.replay_events:
            s = self.steps[i]
            s["graph_gpu_ms"] = s.get("graph_gpu_ms", 0.0) + start.elapsed_time(end)
        self.replay_events.clear()


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise_profile(prof: Any, steps: int, cuda: bool, top: int) -> dict[str, Any]:
    """Per-step figures of a ``torch.profiler`` window of ``steps`` engine steps."""
    events = prof.events()
    gpu_type = torch.autograd.DeviceType.CUDA
    device = [e for e in events if e.device_type == gpu_type]
    out: dict[str, Any] = {"steps": steps}
    if cuda:
        kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in device:
            k = kernels[e.name]
            k[0] += e.time_range.elapsed_us()
            k[1] += 1
        busy = _union_us([(e.time_range.start, e.time_range.end) for e in device])
        out["gpu_busy_ms_per_step"] = busy / 1e3 / steps
        out["gpu_kernel_sum_ms_per_step"] = sum(v[0] for v in kernels.values()) / 1e3 / steps
        out["top_kernels"] = [{"name": n[:120], "ms_per_step": v[0] / 1e3 / steps, "calls_per_step": v[1] / steps}
                              for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]
        copies: dict[str, int] = defaultdict(int)
        for e in device:
            if e.name.startswith("Memcpy") or e.name.startswith("Memset"):
                copies[e.name] += 1
        out["copies_per_step"] = {k: v / steps for k, v in sorted(copies.items())}
    cpu = [e for e in events if e.device_type != gpu_type]
    out["sync_calls_per_step"] = {n: sum(1 for e in cpu if e.name == n) / steps for n in SYNC_CALLS}
    out["cuda_launches_per_step"] = sum(1 for e in cpu if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                      "cudaGraphLaunch")) / steps
    # host ops dispatched per step outside any other op (what the engine itself calls; a graph replay is one)
    top_level = [e for e in cpu if e.name.startswith("aten::") and
                 (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    out["aten_ops_per_step"] = len(top_level) / steps
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in top_level:
        k = by_op[e.name]
        k[0] += e.cpu_time_total
        k[1] += 1
    out["top_host_ops"] = [{"name": n, "host_ms_per_step": v[0] / 1e3 / steps, "calls_per_step": v[1] / steps}
                           for n, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]]
    return out


@contextlib.contextmanager
def counted_syncs(box: dict[str, Any]) -> Iterator[None]:
    """Count the synchronising CUDA calls torch reports (sync debug mode "warn"), by message."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs: dict[str, int] = defaultdict(int)
    for w in caught:
        text = str(w.message)
        if "synchroniz" in text.lower():
            msgs[text.splitlines()[0][:160]] += 1
    box["by_message"] = dict(msgs)
    box["total"] = sum(msgs.values())


def rollout(engine: RolloutEngine, prompts: list[list[int]], new_lens: list[int], n: int, seed: int) -> list:
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=seed * 100003 + i, n=n) for i, m in enumerate(new_lens)]
    outs = engine.generate(prompts, params)
    if any(o.error for o in outs):
        raise RuntimeError(f"rollout errors: {[o.error for o in outs if o.error][:3]}")
    return outs


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarise_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    decode = [s for s in steps if s["graph_rows"] and not s["eager"]]
    other = [s for s in steps if s not in decode]
    out: dict[str, Any] = {"steps": len(steps), "decode_steps": len(decode), "other_steps": len(other),
                           "wall_s": sum(s["wall_ms"] for s in steps) / 1e3,
                           "decode_wall_s": sum(s["wall_ms"] for s in decode) / 1e3,
                           "other_wall_s": sum(s["wall_ms"] for s in other) / 1e3}
    if decode:
        out["decode_wall_ms_per_step"] = _mean([s["wall_ms"] for s in decode])
        out["decode_wall_ms_median"] = statistics.median(s["wall_ms"] for s in decode)
        graph = [s.get("graph_gpu_ms") for s in decode]
        if all(g is not None for g in graph):
            out["graph_gpu_ms_per_step"] = _mean(graph)  # type: ignore[arg-type]
            out["graph_share"] = sum(graph) / sum(s["wall_ms"] for s in decode)  # type: ignore[arg-type]
        out["decode_phase_ms_per_step"] = {p: sum(s["phases"].get(p, 0.0) for s in decode) / len(decode) for p in PHASES}
    # by live batch: the batch shrinks as requests finish
    rows = []
    for b in sorted({s["graph_rows"] for s in decode}, reverse=True):
        ss = [s for s in decode if s["graph_rows"] == b]
        row = {"batch": b, "steps": len(ss), "wall_ms": _mean([s["wall_ms"] for s in ss])}
        if all("graph_gpu_ms" in s for s in ss):
            row["graph_gpu_ms"] = _mean([s["graph_gpu_ms"] for s in ss])
        for p in ("decode_inputs", "sample", "schedule", "apply", "kda_snapshot"):
            row[f"{p}_ms"] = _mean([s["phases"].get(p, 0.0) for s in ss])
        rows.append(row)
    out["decode_by_batch"] = rows
    out["decode_steps_sampled_in_graph"] = sum(1 for s in decode if s["graph_sampled"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--min-new-frac", type=float, default=0.25)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=16384, help="engine prefill token budget per step")
    ap.add_argument("--decode-graphs", default=None, choices=["auto", "off", "static", "cuda"],
                    help="EngineConfig.decode_graphs (default: auto; static with --smoke)")
    ap.add_argument("--eager-sampling", action="store_true",
                    help="EngineConfig.sample_in_graph=False: sample eagerly after the graph (the comparison)")
    ap.add_argument("--same-prompts", action="store_true",
                    help="time the warm-up's prompts again (prefix-cache hits) instead of fresh ones")
    ap.add_argument("--profile-start", type=int, default=16, help="first profiled step of the timed run")
    ap.add_argument("--profile-steps", type=int, default=8, help="steps under torch.profiler (0: none)")
    ap.add_argument("--top", type=int, default=15, help="kernels / host ops listed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON result (default benchmarks/results/<date>_rollout_profile_<device>.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny sizes: checks the script runs")
    a = ap.parse_args()
    setup_logging()
    for name in ("prompts", "n", "prompt_len", "max_new", "layers", "max_num_seqs", "max_batched_tokens"):
        if getattr(a, name) < 1:
            raise SystemExit(f"rollout_profile.py: --{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not 0 < a.min_new_frac <= 1:
        raise SystemExit(f"rollout_profile.py: --min-new-frac must be in (0, 1], got {a.min_new_frac}")
    if a.profile_start < 0 or a.profile_steps < 0:
        raise SystemExit("rollout_profile.py: --profile-start and --profile-steps must be >= 0")
    dev = pick_device("rollout_profile.py", a.smoke)
    if a.smoke:
        a.prompts, a.n, a.prompt_len, a.max_new, a.profile_start, a.profile_steps = 2, 2, 24, 12, 3, 2
    decode_graphs = a.decode_graphs or ("static" if a.smoke else "auto")
    cuda = dev.type == "cuda"
    t_start = time.perf_counter()
    set_mode("bitwise")
    cfg, model = build_bench_model(a.layers, a.smoke, dev, a.lora_r, a.seed)
    n_seqs = a.prompts * a.n
    per_seq_blocks = -(-(a.prompt_len + a.max_new) // 64)
    engine = RolloutEngine(model, EngineConfig(
        num_blocks=n_seqs * per_seq_blocks + 16, max_num_seqs=min(n_seqs, a.max_num_seqs),
        max_num_batched_tokens=a.max_batched_tokens, enable_prefix_caching=True, kernel_mode="bitwise",
        decode_graphs=decode_graphs, sample_in_graph=not a.eager_sampling))
    g = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    timed_prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    lo = max(1, int(a.min_new_frac * a.max_new))
    new_lens = torch.randint(lo, a.max_new + 1, (a.prompts,), generator=torch.Generator().manual_seed(a.seed)).tolist()
    log.info("model and engine ready in %.1fs (decode graphs: %s)", time.perf_counter() - t_start, decode_graphs)

    t0 = time.perf_counter()
    rollout(engine, prompts, new_lens, a.n, seed=0)  # warm-up: compilation, graph capture, prefix cache
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    log.info("warm-up rollout: %.2f s", warmup_s)

    rec = StepRecorder(engine, cuda)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof_box: dict[str, Any] = {}
    sync_box: dict[str, Any] = {}
    stack = contextlib.ExitStack()
    if a.profile_steps:
        first, last = a.profile_start, a.profile_start + a.profile_steps

        def start_profile(i: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            prof_box["prof"] = torch.profiler.profile(activities=activities)
            prof_box["prof"].start()
            prof_box["first"] = i

        def stop_profile(i: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            prof_box["prof"].stop()
            prof_box["last"] = i
            if cuda:
                stack.enter_context(counted_syncs(sync_box))
                sync_box["first"] = i

        def stop_sync_count(i: int) -> None:
            stack.close()
            sync_box["last"] = i

        rec.hooks[first] = start_profile
        rec.hooks[last] = stop_profile
        if cuda:
            rec.hooks[last + a.profile_steps] = stop_sync_count
    rec.install()
    t0 = time.perf_counter()
    try:
        outs = rollout(engine, prompts if a.same_prompts else timed_prompts, new_lens, a.n, seed=1)
        if cuda:
            torch.cuda.synchronize()
    finally:
        rollout_s = time.perf_counter() - t0
        stack.close()
        if "prof" in prof_box and "last" not in prof_box:  # the rollout ended inside the window
            prof_box["prof"].stop()
            prof_box["last"] = len(rec.steps)
        if "first" in sync_box and "last" not in sync_box:
            sync_box["last"] = len(rec.steps)
        rec.uninstall()
    rec.resolve_replays()
    n_resp = sum(len(o.token_ids) for o in outs)
    result: dict[str, Any] = {"rollout_s": rollout_s, "warmup_rollout_s": warmup_s, "sequences": len(outs),
                              "response_tokens": n_resp, "tok_s": n_resp / rollout_s,
                              **summarise_steps(rec.steps)}
    if "prof" in prof_box:
        window = rec.steps[prof_box["first"]: prof_box["last"]]
        result["profile"] = {**summarise_profile(prof_box["prof"], max(1, len(window)), cuda, a.top),
                             "first_step": prof_box["first"], "batch": [s["graph_rows"] for s in window],
                             "wall_ms_per_step": _mean([s["wall_ms"] for s in window])}
    if sync_box:
        k = max(1, sync_box["last"] - sync_box["first"])
        result["torch_reported_syncs_per_step"] = sync_box.get("total", 0) / k
        result["torch_reported_syncs"] = {"steps": k, "by_message": sync_box.get("by_message", {})}

    out = a.out or default_out("rollout_profile" + ("_smoke" if a.smoke else ""))
    write_json(out, {"benchmark": "rollout_profile", **env(), "preset": "tiny" if a.smoke else "bench",
                     "layers": cfg.num_hidden_layers, "dtype": "bfloat16", "decode_graphs": decode_graphs,
                     "args": vars(a), "result": result, "steps": rec.steps, "wall_s": time.perf_counter() - t_start})
    print(f"\nrollout: {len(outs)} sequences, {n_resp} response tokens in {rollout_s:.2f} s ({n_resp / rollout_s:.0f} tok/s); "
          f"{result['decode_steps']} decode steps ({result['decode_wall_s']:.2f} s; "
          f"{result['decode_steps_sampled_in_graph']} drew inside the graph), {result['other_steps']} other "
          f"({result['other_wall_s']:.2f} s)")
    if result.get("decode_wall_ms_per_step") is not None:
        share = result.get("graph_share")
        print(f"decode step: {result['decode_wall_ms_per_step']:.2f} ms wall"
              + (f", graph replay {result['graph_gpu_ms_per_step']:.2f} ms GPU ({share:.0%} of the wall)" if share else ""))
        print("host phases per decode step (ms, nested ones inside runner): "
              + ", ".join(f"{p} {v:.3f}" for p, v in result["decode_phase_ms_per_step"].items()))
    cols = [("batch", "batch", "d"), ("steps", "steps", "d"), ("wall_ms", "wall ms", ".2f")]
    if cuda:
        cols.append(("graph_gpu_ms", "graph GPU ms", ".2f"))
    cols += [(f"{p}_ms", f"{p} ms", ".3f") for p in ("decode_inputs", "sample", "schedule", "apply", "kda_snapshot")]
    print(table(result["decode_by_batch"], cols))
    p = result.get("profile")
    if p:
        if cuda:
            print(f"\nprofiled steps {p['first_step']}..: wall {p['wall_ms_per_step']:.2f} ms, GPU busy "
                  f"{p['gpu_busy_ms_per_step']:.2f} ms per step; syncs per step {p['sync_calls_per_step']}; "
                  f"copies per step {p['copies_per_step']}")
            print(table(p["top_kernels"], [("name", "kernel", "s"), ("ms_per_step", "ms/step", ".3f"),
                                           ("calls_per_step", "calls/step", ".1f")]))
        print(f"top-level host ops per step: {p['aten_ops_per_step']:.0f}")
        print(table(p["top_host_ops"], [("name", "host op", "s"), ("host_ms_per_step", "ms/step", ".3f"),
                                        ("calls_per_step", "calls/step", ".1f")]))
    if "torch_reported_syncs_per_step" in result:
        print(f"torch-reported synchronising calls per step: {result['torch_reported_syncs_per_step']:.1f} "
              f"{result['torch_reported_syncs']['by_message']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
