"""An offline rollout engine in the style of vLLM's ``LLM.generate`` / nano-vllm.

Continuous batching with chunked prefill under a token budget, a paged cache shared by every MLA
layer (latent + FP8 index keys per block row) with per-request KDA state, prefix caching by block
hash (latents, index keys and the KDA snapshot at the block end), preemption by recompute, and
``n > 1`` samples forked from the prompt's blocks. Every token runs through the same model modules
and batch-invariant ops as the trainer, and sampling noise depends only on (seed, sample index
within the request, position), so a request's tokens and log-probs do not depend on what else ran
with it or on its request id. A request without a seed gets one drawn here, recorded on its output.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import typing
from collections import deque
from dataclasses import dataclass, field

import torch

from zmrl.kernels_batch_invariant import Numerics, apply_numerics, current_numerics, get_mode, numerics_scope
from zmrl.kernels_batch_invariant._dispatch import Mode
from zmrl.model import ModelCache
from zmrl.model.context import KDASeqState, SequenceState
from zmrl.model.kda import KimiDeltaAttention

from .block_manager import BlockManager, block_hash
from .graph_runner import DECODE_GRAPH_MODES, DecodeGraphRunner
from .sampling import SamplingParams, sample

log = logging.getLogger(__name__)

KERNEL_MODES: tuple[str, ...] = typing.get_args(Mode)  # ("bitwise", "fast")


def _as_token_list(tokens) -> list:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


@dataclass
class EngineConfig:
    block_size: int = 64
    num_blocks: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
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

    def validate(self) -> "EngineConfig":
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.latent_format not in ("native", "fp8"):
            raise ValueError(f"EngineConfig.latent_format must be 'native' or 'fp8', got {self.latent_format!r}")
        if self.kernel_mode is not None and self.kernel_mode not in KERNEL_MODES:
            raise ValueError(f"EngineConfig.kernel_mode must be None (follow the process mode) or one of "
                             f"{', '.join(map(repr, KERNEL_MODES))} ('bitwise' = rollout/trainer log-prob parity), "
                             f"got {self.kernel_mode!r}")
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ValueError(f"EngineConfig.decode_graphs must be one of {', '.join(map(repr, DECODE_GRAPH_MODES))}, "
                             f"got {self.decode_graphs!r}")
        return self


def _resolve_decode_graphs(setting: str, model) -> str:
    """``EngineConfig.decode_graphs`` for this model: "auto" becomes "cuda" on a GPU, else "off".

    Models sharded by zmrl.parallel decode eagerly: their collectives and the expert-parallel dispatch
    (host offsets per rank) are not capture-safe yet, so "auto" turns graphs off and a forced mode is refused.
    """
    sharded = getattr(model, "parallel_config", None) is not None
    if setting == "auto":
        return "cuda" if model.device.type == "cuda" and not sharded else "off"
    if setting != "off" and sharded:
        raise ValueError(f"EngineConfig.decode_graphs={setting!r} is not supported for a model sharded by "
                         "zmrl.parallel (tensor/expert parallel): use 'auto' or 'off'")
    return setting


@dataclass
class RolloutOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    # [len(token_ids)] float32, on the model's device: log_softmax(logits / T)[token] (raw logits at T = 0)
    logprobs: torch.Tensor
    finish_reason: str  # "stop" | "length" | "error"
    temperature: float = 1.0
    seed: int = 0  # the request's seed: the one it gave, or the one the engine drew (replaying with it repeats)
    sample_index: int = 0  # j of the request's n samples (the sampler's key)
    weights_version: int = 0
    num_preemptions: int = 0
    error: str | None = None


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    fork_ids: list[str] = field(default_factory=list)  # siblings to fork when the prompt is done (n > 1)
    sample_index: int = 0  # j of the request's n samples: the sampler's key, with params.seed
    output: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    seq: SequenceState = field(default_factory=SequenceState)
    hashes: list[int] = field(default_factory=list)  # hashes of this request's computed full blocks
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens) without building the list (hot path: called for every request every step)."""
        return len(self.prompt) + len(self.output)

    def token_at(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    @property
    def num_computed(self) -> int:
        return self.seq.num_tokens


class RolloutEngine:
    def __init__(self, model, config: EngineConfig | None = None):
        self.model = model.eval()
        self.config = (config or EngineConfig()).validate()
        mcfg = model.config
        self.max_model_len = self.config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        self.block_size = self.config.block_size
        self.blocks = BlockManager(self.config.num_blocks, self.block_size, self.config.enable_prefix_caching)
        decode_graphs = _resolve_decode_graphs(self.config.decode_graphs, model)
        graphs = decode_graphs != "off"
        # With decode graphs the store has one more page than the block manager hands out: the scratch page
        # that a padded batch's dummy rows write to.
        self.cache = ModelCache(mcfg, num_pages=self.config.num_blocks + graphs, page_size=self.block_size,
                                dtype=model.dtype, device=model.device, latent_format=self.config.latent_format)
        self.graphs = (DecodeGraphRunner(
            model, self.cache.store, scratch_page=self.config.num_blocks, max_num_seqs=self.config.max_num_seqs,
            max_pages=min(self.config.num_blocks, -(-self.max_model_len // self.block_size)),
            mode=decode_graphs, latent_format=self.config.latent_format,  # type: ignore[arg-type]
        ) if graphs else None)
        # Keys of the per-request KDA states: the layer index, or (layer, virtual shard) for a model
        # sharded by zmrl.parallel (each shard of heads keeps its own state).
        self.kda_layers = [m.layer_idx for m in model.modules() if isinstance(m, KimiDeltaAttention)]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished: list[RolloutOutput] = []
        self._ids: set[str] = set()
        self.weights_version = 0
        self.num_steps = self.num_preemptions = 0
        # The engine's numerics: the process's contract, with the configured kernel mode applied to the
        # whole process (so a trainer in this process follows); None = follow the process at every step.
        self.numerics: Numerics | None = None
        if self.config.kernel_mode is not None:
            self.numerics = current_numerics().replace(kernel_mode=self.config.kernel_mode)
            apply_numerics(self.numerics)
        if get_mode() != "bitwise":
            log.warning("rollout engine in %r kernel mode: rollout/trainer log-probs are not expected to be "
                        "bitwise equal", get_mode())
        self._mode_warned = False

    # ------------------------------------------------------------------ requests
    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(params).__name__}")
        if len(prompt) == 0:
            raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range for vocab_size={vocab} (allowed 0..{vocab - 1})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the limit is max_model_len - 1 = {self.max_model_len - 1}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None) -> None:
        params = sampling or SamplingParams()
        prompt = _as_token_list(prompt_token_ids)
        self._validate(prompt, params)
        if params.seed is None:  # drawn here and recorded on the outputs: replaying with it repeats the tokens
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        ids = [str(request_id)] if params.n == 1 else [f"{request_id}-{j}" for j in range(params.n)]
        dup = [i for i in ids if i in self._ids]
        if dup:
            raise ValueError(f"request id {dup[0]!r} is already in use by an unfinished request")
        self._ids.update(ids)
        req = Request(ids[0], prompt, params, fork_ids=ids[1:])
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        if -(-longest // self.block_size) > self.config.num_blocks:
            msg = (f"request {req.request_id!r} needs up to {longest} tokens = {-(-longest // self.block_size)} blocks "
                   f"of {self.block_size}, but the cache has only num_blocks={self.config.num_blocks}")
            for j, rid in enumerate(ids):
                self._finish(Request(rid, prompt, params, sample_index=j), "error", error=msg)
            return
        self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None,
                 request_ids: list[str] | None = None, use_tqdm: bool = False) -> list[RolloutOutput]:
        """Run every prompt to completion; outputs in prompt order (n > 1: samples of a prompt together)."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = request_ids or [str(i) for i in range(len(prompts))]
        for p, sp in zip(prompts, params):  # validate everything before anything runs
            self._validate(_as_token_list(p), sp)
        order: dict[str, int] = {}
        for i, (rid, p, sp) in enumerate(zip(ids, prompts, params)):
            self.add_request(rid, p, sp)
            for j in range(sp.n):
                order[rid if sp.n == 1 else f"{rid}-{j}"] = len(order)
        outs: list[RolloutOutput] = []
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="rollout", unit="seq")
        while self.has_unfinished_requests():
            done = self.step()
            outs.extend(done)
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return sorted(outs, key=lambda o: order.get(o.request_id, len(order)))

    def update_weights(self, lora_state: dict[str, torch.Tensor] | None = None) -> int:
        """Push new weights into the live engine without rebuilding it or its cache.

        ``lora_state`` (``zmrl.lora.lora_state_dict`` of the trainer's model) is copied into the
        engine's model; pass None when the trainer updated this very model object in place. Cached
        prefixes are dropped (their values belong to the old weights). Returns the new version."""
        if self.waiting or self.running:
            raise RuntimeError("update_weights with unfinished requests: their caches hold old-weight values")
        if lora_state is not None:
            from zmrl.lora import load_lora_state_dict

            load_lora_state_dict(self.model, lora_state)
        self.weights_version += 1
        self.blocks.reset_prefix_cache()
        return self.weights_version

    # ------------------------------------------------------------------ scheduling
    def _blocks_needed(self, req: Request, n: int) -> int:
        return max(0, -(-(req.num_computed + n) // self.block_size) - len(req.seq.pages))

    def _grow(self, req: Request, n: int) -> None:
        req.seq.pages.extend(self.blocks.allocate(self._blocks_needed(req, n)))

    def _preempt(self, req: Request) -> None:
        """Free everything the request holds; it recomputes prompt + output so far when rescheduled."""
        self.blocks.release(req.seq.pages)
        req.seq.reset()
        if self.graphs is not None:
            self.graphs.release(req.request_id)
        req.hashes = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        log.debug("preempted %s at %d tokens", req.request_id, len(req.tokens))

    def _full_block_hashes(self, tokens: list[int], n_blocks: int, start: list[int]) -> list[int]:
        hashes = list(start)
        bs = self.block_size
        for b in range(len(hashes), n_blocks):
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[b * bs:(b + 1) * bs], self.weights_version))
        return hashes

    def _apply_prefix_cache(self, req: Request) -> None:
        if not self.config.enable_prefix_caching:
            return
        # At least the last token must be computed: its logits are needed for sampling.
        n_full = (len(req.tokens) - 1) // self.block_size
        hashes = self._full_block_hashes(req.tokens, n_full, [])
        blocks, snapshot = self.blocks.match_prefix(hashes)
        if not blocks:
            return
        self.blocks.share(blocks)
        req.seq.pages = list(blocks)
        req.seq.num_tokens = len(blocks) * self.block_size
        req.seq.kda = {layer: KDASeqState(conv=conv.clone(), state=state.clone())
                       for layer, (state, conv) in snapshot.items()}
        req.hashes = hashes[: len(blocks)]

    def _schedule(self) -> list[tuple[Request, int]]:
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            preempted_self = False
            while self._blocks_needed(req, n) > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            self._grow(req, n)
            batch.append((req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed == 0 and not req.seq.pages:
                self._apply_prefix_cache(req)
            n = min(req.num_tokens - req.num_computed, budget)
            if self._blocks_needed(req, n) > self.blocks.num_free:
                if req.seq.pages:  # give prefix-cache references back while it waits
                    self.blocks.release(req.seq.pages)
                    req.seq.reset()
                    req.hashes = []
                break
            self._grow(req, n)
            self.waiting.popleft()
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        return batch

    # ------------------------------------------------------------------ execution
    def step(self) -> list[RolloutOutput]:
        """Schedule and run one forward; returns the requests that finished in this step."""
        batch = self._schedule()
        if batch:
            self._run(batch)
            self.num_steps += 1
        elif self.waiting and not self.running:
            raise RuntimeError("scheduler made no progress with an empty running set (this is a bug)")
        out, self._finished = self._finished, []
        return out

    def _run(self, batch: list[tuple[Request, int]]) -> None:
        mode = self.config.kernel_mode
        if self.numerics is None:  # follow the process's numerics
            with torch.no_grad():
                self._run_batch(batch)
            return
        if current_numerics() != self.numerics and not self._mode_warned:
            # someone changed the process mode after the engine was built: the engine keeps its own,
            # a trainer in this process now runs another one
            log.warning("process numerics are %s (kernel mode %r) but this engine was configured with kernel mode %r; "
                        "the engine keeps %r, a trainer in this process will not match it",
                        current_numerics(), get_mode(), mode, mode)
            self._mode_warned = True
        with torch.no_grad(), numerics_scope(self.numerics):
            self._run_batch(batch)

    def _run_batch(self, batch: list[tuple[Request, int]]) -> None:
        decode = self._graph_decodes(batch)
        in_graph = {id(r) for r in decode}
        eager = [(r, n) for r, n in batch if id(r) not in in_graph]
        ready: list[Request] = []  # requests whose next token gets sampled, in the order of ``parts``' rows
        parts: list[torch.Tensor] = []
        if eager:
            reqs, logits = self._forward_eager(eager)
            ready += reqs
            parts.append(logits)
        if decode:
            logits = self.graphs.run(decode)
            for r in decode:
                r.seq.num_tokens += 1
                if self.config.enable_prefix_caching and r.num_computed % self.block_size == 0:
                    self.graphs.snapshot(r)
                self._register_blocks(r)
            ready += decode
            parts.append(logits)
        if ready:
            self._sample(ready, parts[0] if len(parts) == 1 else torch.cat(parts))

    def _graph_decodes(self, batch: list[tuple[Request, int]]) -> list[Request]:
        """The batch's decode rows (one token, the last one) when the graph runner takes them."""
        if self.graphs is None:
            return []
        decode = [r for r, n in batch if n == 1 and r.num_computed == r.num_tokens - 1]
        return decode if self.graphs.accepts(decode) else []

    def _forward_eager(self, batch: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor]:
        """Varlen forward of any mix of prefill chunks and decodes; logits of the rows that finished their tokens."""
        if self.graphs is not None:
            for r, _ in batch:
                self.graphs.evict(r)
        reqs = [r for r, _ in batch]
        lens = [n for _, n in batch]
        ctx = self.cache.context([r.seq for r in reqs], lens, record_snapshots=self.config.enable_prefix_caching,
                                 allocate=False)
        ids = torch.tensor([r.token_at(i) for r, n in batch for i in range(r.num_computed, r.num_computed + n)],
                           dtype=torch.int64, device=self.model.device)
        hidden = self.model(ids, ctx)
        for r, n in batch:
            r.seq.num_tokens += n
            self._register_blocks(r)
        rows = [j for j, r in enumerate(reqs) if r.num_computed == r.num_tokens]
        if not rows:
            return [], hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        last = ctx.cu_seqlens[1:][torch.tensor(rows, device=ctx.cu_seqlens.device)] - 1
        return [reqs[j] for j in rows], self.model.compute_logits(hidden[last])

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample each request's next token from its logits row (forking n > 1 requests first)."""
        samplers: list[tuple[Request, int]] = []  # (request, row of logits)
        for row, r in enumerate(reqs):
            samplers.append((r, row))
            if r.fork_ids:
                samplers.extend((child, row) for child in self._fork(r))
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        ok = [(r, row) for r, row in samplers if finite[row]]
        for r, row in samplers:
            if not finite[row]:
                self._drop(r, "error", error=f"non-finite logits for request {r.request_id!r} at position {len(r.tokens)}")
        if not ok:
            return
        tokens, lps = sample(logits[[row for _, row in ok]], [r.params for r, _ in ok], [r.sample_index for r, _ in ok],
                             [r.num_tokens for r, _ in ok])
        for (r, _), t, lp in zip(ok, tokens.tolist(), lps):
            r.output.append(t)
            r.logprobs.append(lp.reshape(1))
            p = r.params
            if t in p.stop_token_ids:
                self._drop(r, "stop")
            elif len(r.output) >= p.max_tokens or r.num_tokens >= self.max_model_len:
                self._drop(r, "length")

    def _register_blocks(self, r: Request) -> None:
        """Publish the request's newly completed full blocks (with their KDA snapshots) for prefix caching."""
        if not self.config.enable_prefix_caching:
            return
        n_full = r.num_computed // self.block_size
        if n_full <= len(r.hashes):
            return
        first_new = len(r.hashes)
        r.hashes = self._full_block_hashes(r.tokens, n_full, r.hashes)
        for b in range(first_new, n_full):
            end = (b + 1) * self.block_size
            snap = {}
            for layer in self.kda_layers:
                st = r.seq.kda.get(layer)
                if st is None or end not in st.snapshots:
                    return  # computed before snapshots were recorded: leave it unpublished
                snap[layer] = st.snapshots[end]
            self.blocks.register(r.seq.pages[b], r.hashes[b], snap)

    def _fork(self, parent: Request) -> list[Request]:
        """Siblings of an n > 1 request share the prompt's full blocks and copy its partial last block."""
        children = []
        if self.graphs is not None:
            self.graphs.evict(parent)  # the children copy its KDASeqState
        for j, cid in enumerate(parent.fork_ids, start=parent.sample_index + 1):
            child = Request(cid, parent.prompt, parent.params, sample_index=j)
            n_full = parent.num_computed // self.block_size
            partial = parent.num_computed % self.block_size != 0
            if partial and self.blocks.num_free == 0:
                self.waiting.appendleft(child)  # no block to copy into: it recomputes (or hits the prefix cache)
                continue
            shared = parent.seq.pages[:n_full]
            self.blocks.share(shared)
            pages = list(shared)
            if partial:
                (new,) = self.blocks.allocate(1)
                self.cache.store.copy_page(parent.seq.pages[n_full], new)
                pages.append(new)
            child.seq = SequenceState(kda={k: v.clone() for k, v in parent.seq.kda.items()},
                                      num_tokens=parent.num_computed, pages=pages)
            child.hashes = list(parent.hashes)
            self.running.append(child)
            children.append(child)
        parent.fork_ids = []
        return children

    def _drop(self, r: Request, reason: str, error: str | None = None) -> None:
        self.blocks.release(r.seq.pages)
        r.seq.reset()
        if self.graphs is not None:
            self.graphs.release(r.request_id)
        if r in self.running:
            self.running.remove(r)
        self._finish(r, reason, error)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        self._ids.discard(r.request_id)
        # on the model's device, like the trainer's log-probs (torch.equal needs one device)
        lp = torch.cat(r.logprobs) if r.logprobs else torch.zeros(0, dtype=torch.float32, device=self.model.device)
        self._finished.append(RolloutOutput(
            request_id=r.request_id, prompt_token_ids=list(r.prompt), token_ids=list(r.output), logprobs=lp,
            finish_reason=reason, temperature=r.params.temperature, seed=r.params.seed, sample_index=r.sample_index,
            weights_version=self.weights_version, num_preemptions=r.num_preemptions, error=error,
        ))
