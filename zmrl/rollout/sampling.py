"""Sampling parameters and the deterministic, batch-invariant sampler of the rollout engine.

A sampled row's (token, log-prob) is a function of that row alone: its logits, its
``SamplingParams`` (with the seed), its key — the sample's index, ``first_sample_index + j`` for
the request's j-th sample (j = 0 .. n-1) — and the absolute position of the token being sampled
(docs/numerics.md, "Sampling"). Nothing depends on the other rows of the step, the batch size or
order, the request id the engine assigned, the thread count, or any global RNG state, so the same
request with the same seed samples the same tokens alone or among any others, and preemption + recompute, a
different arrival order or a replay of the run reproduce every token bit for bit.

Per row, with ``T = params.temperature``:

* ``T == 0`` (greedy): the first index of the maximum logit. top-k / top-p are ignored.
* ``T > 0``: ``z = logits / T`` (the very division ``token_logprobs`` performs). The candidate set
  is the ``top_k`` largest ``z`` (ties -> lower index), cut further to the nucleus: the shortest
  prefix of the tokens ordered by probability (= by ``z``; ties -> lower index) whose cumulative
  probability reaches ``top_p``, probabilities being ``softmax(z)`` over the whole vocabulary
  (not renormalised over the top-k set), accumulated by a fixed-order scan. The token is drawn
  by Gumbel-max, ``argmax over candidates of z + G`` (ties -> lower index), with
  ``G = -log(-log(u))`` and ``u`` a counter-based hash of ``(seed, key, position, vocab index)``.
  A row with ``T > 0`` needs a seed: ``SamplingParams.seed=None`` means "the engine draws one" (and
  records it on the output), so ``sample`` itself refuses None.
  Because the noise of a vocab entry does not depend on the filter, a filter that does not
  exclude the unfiltered winner leaves the drawn token unchanged.
* The recorded log-prob is ``token_logprobs(logits_row, token, T)``: the log-softmax of the
  temperature-scaled logits over the full vocabulary, exactly what the trainer recomputes.
  top-k / top-p restrict the draw, never the recorded value.

Randomness: ``u`` comes from splitmix64 (Steele, Lea & Flood 2014): a per-row state
``h = mix(seed, key, position)`` (Python ints), then for vocab index ``i`` the splitmix64 output
``mix64(h + (i + 1) * GAMMA mod 2^64)``, evaluated with torch int64 ops (wrap-around multiply;
logical shifts by masking). The top 24 bits give ``u = (bits + 0.5) / 2^24`` in (0, 1), computed in
float64 so neither 0 nor 1 is reachable and ``G`` is always finite.
"""
from __future__ import annotations

import functools
import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from zmrl.kernels_batch_invariant._dispatch import invariant_op
from zmrl.kernels_batch_invariant.host import to_device_async
from zmrl.kernels_batch_invariant.logprob import _scaled_logits, token_logprobs
from zmrl.kernels_batch_invariant.reduce import tree_sum
from zmrl.model.context import int64_tensor

__all__ = ["SamplingParams", "derive_seed", "is_plain", "mix_positions", "rollout_seed", "row_states", "sample",
           "pack_sampled", "sample_async", "sample_plain", "sample_scaled", "seed_key_state"]

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64 Weyl increment (odd, ~2^64 / golden ratio)
_MIX1 = 0xBF58476D1CE4E5B9   # splitmix64 finaliser constants
_MIX2 = 0x94D049BB133111EB
_DOMAIN = 0x7A6D726C2D73616D  # b"zmrl-sam": separates this stream from other uses of splitmix64
_U_BITS = 24
_MAX_SAMPLE_INDEX = 1 << 63  # first_sample_index + j stays a valid sampler key (< 2^64) for any n


# ----------------------------------------------------------------------------- parameters


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated on construction; ints/floats are normalised to Python
    ``int``/``float`` and ``stop_token_ids`` to a tuple.

    temperature: 0 = greedy, else the softmax temperature (finite, > 0).
    top_p: nucleus mass in (0, 1]; 1 = off.       top_k: -1 = off, else >= 1.
    max_tokens: generated-token limit (>= 1).     stop_token_ids: ids that end the request.
    seed: int >= 0, or None (the engine draws one and records it on the output). With the sample
    index and the position it fixes every draw, wherever the request sits in a batch.
    n: samples per prompt; sample j draws with key ``first_sample_index + j``, so the n samples differ.
    first_sample_index: the sample index of this request's first sample (default 0). A request with
    ``n`` samples draws exactly what ``n`` one-sample requests with the same seed and
    ``first_sample_index`` 0 .. n-1 draw, so a group can be sent as one request or one per sample.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    first_sample_index: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(float(t)) or float(t) < 0:
            raise _bad("temperature", t, "a finite number >= 0 (0 means greedy)")
        p = self.top_p
        if not _is_real(p) or not 0.0 < float(p) <= 1.0:  # NaN fails the comparison too
            raise _bad("top_p", p, "a number with 0 < top_p <= 1 (1 disables nucleus filtering)")
        k = self.top_k
        if not _is_int(k) or not (k == -1 or k >= 1):
            raise _bad("top_k", k, "-1 (off) or an int >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "an int >= 1")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an int >= 1")
        if not _is_int(self.first_sample_index) or not 0 <= self.first_sample_index < _MAX_SAMPLE_INDEX:
            raise _bad("first_sample_index", self.first_sample_index, "an int in [0, 2^63)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise _bad("seed", self.seed, "None (the engine draws one) or an int >= 0")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise _bad("stop_token_ids", stops, "a sequence of token ids (ints >= 0)")
        stops = tuple(stops)
        bad = [s for s in stops if not _is_int(s) or s < 0]
        if bad:
            raise _bad("stop_token_ids", self.stop_token_ids, f"ints >= 0 (bad entry {bad[0]!r})")
        for name, value in (("temperature", float(t) + 0.0), ("top_p", float(p)), ("top_k", int(k)),
                            ("max_tokens", int(self.max_tokens)), ("n", int(self.n)),
                            ("first_sample_index", int(self.first_sample_index)),
                            ("seed", None if self.seed is None else int(self.seed)),
                            ("stop_token_ids", tuple(int(s) for s in stops))):  # + 0.0: -0.0 -> 0.0
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from a base seed and labels (e.g. step and prompt index): blake2b of their text,
    the same in every process. Requests given one seed share their noise; derived seeds do not."""
    text = ":".join(map(str, (seed, *parts))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8, person=b"zmrl-sd").digest(), "big") >> 1


def rollout_seed(base_seed: int, weights_step: int, prompt_ids: Sequence[int]) -> int:
    """The seed of an RL rollout's samples of one prompt: a function of the run's seed, the weights they
    sample from (``weights_step``: the number of updates those weights have had) and the prompt's tokens.

    The sample's index within the prompt's group is the sampler's key (``SamplingParams.first_sample_index
    + j``), not part of the seed, so a group sent as one request with ``n`` samples (zmrl's RL loop) and
    as ``n`` one-sample requests with ``first_sample_index`` 0 .. n-1 (verl's rollout, zmrl/integrations/
    verl/rollout.py) sample the same tokens. Nothing else enters: not the prompt's place in the batch,
    the request id, the rollout worker or the arrival order."""
    return derive_seed(base_seed, "rollout", int(weights_step), ",".join(str(int(t)) for t in prompt_ids))


# ----------------------------------------------------------------------------- counter-based noise


def _mix64(x: int) -> int:
    """splitmix64 finaliser on a Python int in [0, 2^64)."""
    x ^= x >> 30
    x = (x * _MIX1) & _M64
    x ^= x >> 27
    x = (x * _MIX2) & _M64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    """[0, 2^64) -> the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> sign-extends)."""
    return (x >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64_t(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors holding uint64 bit patterns (multiplication wraps)."""
    x = x ^ _shr(x, 30)  # the first op copies; the rest work in place (no autograd on ints)
    x.mul_(_signed(_MIX1))
    x ^= _shr(x, 27)
    x.mul_(_signed(_MIX2))
    x ^= _shr(x, 31)
    return x


def row_state(seed: int, key: int, position: int) -> int:
    """The per-row counter state from (seed, key = sample index, position), in [0, 2^64). Seeds wider
    than 64 bits are folded in 64-bit limbs."""
    return _mix64((_seed_key_state(seed, key) ^ position) + _GAMMA & _M64)


@functools.lru_cache(maxsize=1 << 16)
def _seed_key_state(seed: int, key: int) -> int:
    """row_state before the position is mixed in: the same for every token a request samples (cached, the
    sampler computes one row state per sequence per decode step)."""
    h = _mix64(((seed & _M64) ^ _DOMAIN) + _GAMMA & _M64)
    rest = seed >> 64
    while rest:
        h = _mix64((h ^ (rest & _M64)) + _GAMMA & _M64)
        rest >>= 64
    return _mix64((h ^ key) + _GAMMA & _M64)


def mix_positions(seed_key_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``row_state`` from the rows' ``seed_key_state`` (int64 bit patterns [R]) and the positions being sampled
    [R] (< 2^63), by int64 tensor ops on any device (exact integer arithmetic: the same bits everywhere); the
    decode graph runs it on the device from the positions it already holds."""
    x = seed_key_states ^ positions
    x.add_(_signed(_GAMMA))
    return _mix64_t(x)


def seed_key_state(params: "SamplingParams", key: int) -> int:
    """The int64 bit pattern of the row state's per-request part (``mix_positions`` adds the position); 0 for
    a greedy request, which draws no noise, and for one without a seed yet (it cannot be drawn: ``sample``
    refuses it; the engine gives every request a seed)."""
    return 0 if params.greedy or params.seed is None else _signed(_seed_key_state(params.seed, key))


def _uniform_bits(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """24 random bits for every (row, vocab index). states: [R] int64 bit patterns; index: [R, N]
    int64 vocab ids. Returns [R, N] int64 in [0, 2^24)."""
    x = (index + 1).mul_(_signed(_GAMMA)).add_(states[:, None])
    return _shr(_mix64_t(x), 64 - _U_BITS)


def _gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """bits [...] int64 in [0, 2^24) -> Gumbel(0, 1) noise, float64. u = (bits + 0.5) / 2^24 lies in
    [2^-25, 1 - 2^-25] exactly (float64), so -log(u) > 0 and G is finite (|G| < 18)."""
    u = bits.to(torch.float64).add_(0.5).mul_(2.0 ** -_U_BITS)  # exact in float64
    return u.log_().neg_().log_().neg_()


def _gumbel(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _gumbel_from_bits(_uniform_bits(states, index))


# ----------------------------------------------------------------------------- fixed-order pieces


def _inclusive_scan(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum over the last dim with a fixed (Hillis-Steele) order: element i is
    always the same bracketing of x[..., :i+1], whatever the other rows, the batch size or the
    length of the scanned prefix (so a scan of x[..., :P] is bitwise a prefix of the full scan).
    Not necessarily monotone under rounding; callers look for the first index reaching a level."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        x = torch.cat([x[..., :shift], x[..., shift:] + x[..., :-shift]], dim=-1)
        shift *= 2
    return x


def _first_index(mask: torch.Tensor, index: torch.Tensor, none: int) -> torch.Tensor:
    """Smallest ``index`` where ``mask`` holds, per row (``none`` where it never does)."""
    return torch.where(mask, index, none).amin(dim=-1)


def _order_key(z: torch.Tensor) -> torch.Tensor:
    """[R, V] fp32 -> [R, V] int64 keys, distinct within a row, whose descending order is the
    order (z desc, index asc): the fp32 bits made order-preserving (negative floats have their
    magnitude bits flipped; -0.0 is first turned into +0.0 so it ties with it), then the index
    reversed in the low 32 bits. topk over distinct keys has only one correct answer."""
    b = (z + 0.0).contiguous().view(torch.int32)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    rev = (1 << 32) - 1 - torch.arange(z.shape[-1], device=z.device)
    return (b.to(torch.int64) << 32).add_(rev)


class _SortedPrefix:
    """The first ``width`` vocab ids of each row in (z desc, index asc) order, for growing widths."""

    def __init__(self, z: torch.Tensor):
        self.z = z
        self.key = _order_key(z) if z.dtype == torch.float32 else None
        self.full: torch.Tensor | None = None

    def __call__(self, width: int) -> torch.Tensor:
        if self.key is not None and width < self.z.shape[-1]:
            return self.key.topk(width, dim=-1, sorted=True).indices
        if self.full is None:  # whole rows (or fp64): a stable sort has one correct answer too
            self.full = torch.sort(self.z, dim=-1, descending=True, stable=True).indices
        return self.full[:, :width]


def _candidate_counts(zf: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      prefix: _SortedPrefix) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the best tokens each row may draw from: min(top_k, nucleus size), where the
    nucleus is the shortest prefix (in (z desc, index asc) order) whose fixed-order cumulative
    softmax(z) mass reaches top_p. zf [R, V]; top_k [R] int64 (<= V); top_p [R] in zf's dtype.
    Returns (counts [R] int64, order [R, W]): the sorted prefix, W >= every count.

    The nucleus is found by scanning a growing sorted prefix (1024, doubling). A scan of a prefix
    is bitwise a prefix of the full scan, so the counts do not depend on how far this batch looked.
    """
    r, v = zf.shape
    count = top_k.clone()
    nuc = (top_p < 1).nonzero().squeeze(-1)
    # top-k-only rows need exactly their k sorted ids; nucleus rows start from min(k, 1024).
    need = [k if p >= 1 else min(k, 1024) for k, p in zip(top_k.tolist(), top_p.tolist())]
    width = min(v, max(need))
    if not nuc.numel():
        return count, prefix(width)
    zn = zf.index_select(0, nuc)
    # softmax over the full vocab, built like token_logprobs' normaliser: exact max, tree_sum.
    e = torch.exp(zn - zn.amax(dim=-1, keepdim=True))
    prob = e / tree_sum(e, dim=-1, keepdim=True)
    kn, pn = top_k.index_select(0, nuc), top_p.index_select(0, nuc)
    while True:
        order = prefix(width)
        cum = _inclusive_scan(prob.gather(-1, order.index_select(0, nuc)))
        reached = cum >= pn[:, None]
        resolved = reached.any(dim=-1) | (kn <= width)
        if width == v or bool(resolved.all()):
            break
        width = min(v, 2 * width)
    pos = torch.arange(width, device=zf.device).expand_as(reached)
    size = (_first_index(reached, pos, v) + 1).clamp(max=v)
    count[nuc] = torch.minimum(kn, size)
    return count, order


def _draw_unfiltered(z: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over the whole vocabulary: the lowest-index argmax of ``z + G`` per row (z [R, V])."""
    r, v = z.shape
    idx = torch.arange(v, device=z.device).expand(r, v)
    score = _gumbel(states, idx).add_(z)  # float64
    return _first_index(score == score.amax(dim=-1, keepdim=True), idx, v)


@invariant_op
def sample_scaled(z: torch.Tensor, states: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draw from temperature-scaled logits, row-invariant.

    z: [R, V] scaled logits (fp32, or fp64), finite. states: [R] int64 (bit patterns of
    ``row_state``). top_k: [R] int64, V or more = off. top_p: [R] float, 1 = off (compared in z's
    dtype). Returns [R] int64 token ids: per row, the lowest-index argmax of ``z + G`` (float64)
    over the candidates, G the row's counter-based Gumbel noise at each vocab id.
    """
    r, v = z.shape
    out = torch.empty(r, dtype=torch.int64, device=z.device)
    if r == 0:
        return out
    top_k = top_k.clamp(max=v)
    top_p = top_p.to(z.dtype)
    filtered = (top_k < v) | (top_p < 1)

    plain = (~filtered).nonzero().squeeze(-1)
    if plain.numel():
        out[plain] = _draw_unfiltered(z.index_select(0, plain), states.index_select(0, plain))

    rows = filtered.nonzero().squeeze(-1)
    if rows.numel():
        zf = z.index_select(0, rows)
        count, order = _candidate_counts(zf, top_k.index_select(0, rows), top_p.index_select(0, rows),
                                         _SortedPrefix(zf))
        # Candidates are each row's first `count` sorted ids; the noise is that of their vocab ids,
        # so the draw does not depend on the filter beyond which ids it admits.
        cand = order[:, :int(count.max())]
        score = _gumbel(states.index_select(0, rows), cand).add_(zf.gather(-1, cand))  # float64
        keep = torch.arange(cand.shape[-1], device=z.device)[None, :] < count[:, None]
        score = score.masked_fill_(~keep, -math.inf)
        out[rows] = _first_index(score == score.amax(dim=-1, keepdim=True), cand, v)
    return out


# ----------------------------------------------------------------------------- the sampler


def _raise_nonfinite(x: torch.Tensor, rows: list[int], keys: Sequence[int], positions: Sequence[int],
                     temperature: float | None) -> None:
    """Raise a ValueError naming the first batch row of ``x`` (whose rows are batch rows ``rows``)
    with a NaN/Inf value (``temperature`` set: the value overflowed when divided by it). Returns
    if ``x`` is all finite."""
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return
    r = int(bad.any(dim=-1).nonzero()[0, 0])
    col = int(bad[r].nonzero()[0, 0])
    b = rows[r]
    where = f"logits row {b} (key {keys[b]}, position {positions[b]})"
    if temperature is None:
        raise ValueError(f"sample: {where} has a non-finite value {float(x[r, col])} at vocab index {col}; "
                         "NaN/Inf logits cannot be sampled")
    raise ValueError(f"sample: {where} overflows to {float(x[r, col])} at vocab index {col} when divided by "
                     f"temperature {temperature}; NaN/Inf logits cannot be sampled")


def _check_args(logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[int],
                positions: Sequence[int], vocab_size: int | None) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"sample: logits must be a [B, V] floating-point tensor, got {got}")
    b, v = logits.shape
    if not len(params) == len(keys) == len(positions) == b:
        raise ValueError(f"sample: logits has {b} rows but got {len(params)} params, {len(keys)} keys and "
                         f"{len(positions)} positions (one each per row)")
    # Per-row checks run for every sampled token: the all-valid case is decided with a few passes over plain
    # ints, the loops below (which name the first bad row) run only when it is not.
    plain_ints = all(type(x) is int for x in keys) and all(type(x) is int for x in positions)  # noqa: E721
    if not (all(isinstance(p, SamplingParams) and (p.seed is not None or p.greedy) for p in params) and plain_ints
            and (not b or (min(keys) >= 0 and max(keys) <= _M64 and min(positions) >= 0
                           and max(positions) < 1 << 63))):
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sample: params[{i}] must be a SamplingParams, got {type(p).__name__}")
        for i, k in enumerate(keys):
            if not _is_int(k) or not 0 <= k <= _M64:
                raise ValueError(f"sample: keys[{i}] must be an int in [0, 2^64) (the sample index), got {k!r}")
        for i, p in enumerate(params):
            if p.seed is None and not p.greedy:
                raise ValueError(f"sample: params[{i}].seed is None; a sampled row needs a seed (RolloutEngine draws "
                                 "one for a request without one)")
        for i, pos in enumerate(positions):
            if not _is_int(pos) or not 0 <= pos < 1 << 63:
                raise ValueError(f"sample: positions[{i}] must be an int >= 0, got {pos!r}")
    if vocab_size is not None and (not _is_int(vocab_size) or not 1 <= vocab_size <= v):
        raise ValueError(f"sample: vocab_size must be an int in [1, {v}] (the logits width), got {vocab_size!r}")
    if v == 0:
        raise ValueError("sample: logits have an empty vocabulary dimension")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """The logits' compute dtype at temperature 0 (what ``_scaled_logits`` upcasts to): fp64 stays, else fp32."""
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def pack_sampled(tokens: torch.Tensor, logprobs: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """[3, B] float64: token ids, log-probs, finite flags (1.0 / 0.0), each exact in float64 (ids < 2^53): what the
    engine fetches in its one device->host copy per step (``sampler.fetch``)."""
    return torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64), finite.to(torch.float64)])


def _greedy(z: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum."""
    v = z.shape[-1]
    col = torch.arange(v, device=z.device).expand_as(z)
    return _first_index(z == z.amax(dim=-1, keepdim=True), col, v)


def _finite_rows(z: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, x, finite [R] bool) with the rows whose scaled logits ``z`` are not all finite replaced by zeros in
    both (``x``: the unscaled logits the log-prob op reads): no NaN reaches the argmax or the log-prob's gather,
    and no host test is needed. A finite row keeps its values exactly."""
    ok = torch.isfinite(z).all(dim=-1)
    keep, same = ok[:, None], z is x
    z = torch.where(keep, z, 0.0)
    return z, (z if same else torch.where(keep, x, 0.0)), ok


def sample_plain(logits: torch.Tensor, temperature: float, states: torch.Tensor) -> torch.Tensor:
    """The whole-batch draw of ``sample_async`` for rows that share one temperature and filter nothing (no top-k,
    no top-p), from device inputs only, so a CUDA graph can capture it: ``logits`` [B, V] (contiguous),
    ``states`` [B] int64 (``row_states`` / ``mix_positions``; ignored when greedy). Returns ``pack_sampled``'s
    [3, B]. The same ops as ``sample_async``, so the same bits."""
    z = _upcast(logits) if temperature == 0.0 else _scaled_logits(logits, temperature, check=False)
    z, x, ok = _finite_rows(z, logits)
    tok = _greedy(z) if temperature == 0.0 else _draw_unfiltered(z, states)
    return pack_sampled(tok, token_logprobs(x, tok, temperature, check=False), ok)


def is_plain(params: SamplingParams) -> bool:
    """Greedy, or samples from the whole vocabulary (no top-k, no top-p): ``sample_plain`` can draw it."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0)


def row_states(params: Sequence[SamplingParams], keys: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """``row_state`` of many rows at once, as int64 bit patterns [B] on the host (0 for a greedy row, which draws
    no noise): the positions are mixed in by tensor ops (``mix_positions``) instead of one Python ``_mix64`` per
    row."""
    return mix_positions(int64_tensor([seed_key_state(p, k) for p, k in zip(params, keys)]), int64_tensor(positions))


def _sample_groups(x: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[int], positions: Sequence[int],
                   checked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The draw and the log-probs of every row of ``x`` [B, V] (arguments already checked). ``checked``: raise a
    ValueError naming the first row with non-finite scaled logits (host reads of device values). Otherwise no
    host synchronisation on the usual path (no top-k / top-p): rows whose scaled logits are not all finite are
    flagged in the returned mask [B] bool and draw from zeros instead (their token and log-prob mean nothing);
    a finite row's values are the same either way."""
    bsz, v = x.shape
    dev = x.device
    tokens = torch.empty(bsz, dtype=torch.int64, device=dev)
    logprobs = torch.empty(bsz, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=dev)
    finite = None if checked else torch.empty(bsz, dtype=torch.bool, device=dev)
    if bsz == 0:
        return tokens, logprobs, finite

    # Rows that share a temperature are scaled together with a Python-scalar division: exactly the
    # op token_logprobs applies (an elementwise op, so grouping does not change any row's bits).
    groups: dict[float, list[int]] = {}
    for b, p in enumerate(params):
        groups.setdefault(p.temperature, []).append(b)
    for temp, rows in groups.items():
        # one temperature for the whole (contiguous) batch, the usual rollout step: no gather, no scatter back
        whole = len(rows) == bsz and x.is_contiguous()
        idx = None if whole else to_device_async(int64_tensor(rows), dev)
        xg = x if whole else x.index_select(0, idx)
        if temp == 0.0:
            z = _upcast(xg)
            if checked and not bool(torch.isfinite(z).all()):
                _raise_nonfinite(z, rows, keys, positions, None)
        elif checked:
            try:
                z = _scaled_logits(xg, temp)
            except ValueError:  # name the batch row (and say whether the division overflowed)
                _raise_nonfinite(xg, rows, keys, positions, None)
                _raise_nonfinite(xg.to(torch.float32) / temp, rows, keys, positions, temp)
                raise
        else:
            z = _scaled_logits(xg, temp, check=False)
        if not checked:
            z, xg, ok = _finite_rows(z, xg)
            if whole:
                finite.copy_(ok)
            else:
                finite[idx] = ok
        if temp == 0.0:
            tok = _greedy(z)
        else:
            ps = [params[b] for b in rows]
            states = to_device_async(row_states(ps, [keys[b] for b in rows], [positions[b] for b in rows]), dev)
            if all(map(is_plain, ps)):  # no filter: what sample_scaled does for such rows
                tok = _draw_unfiltered(z, states)
            else:
                top_k = to_device_async(int64_tensor([p.top_k if p.top_k > 0 else v for p in ps]), dev)
                top_p = to_device_async(torch.tensor([p.top_p for p in ps], dtype=torch.float64), dev)
                tok = sample_scaled(z, states, top_k, top_p)
        lp = token_logprobs(xg, tok, temp, check=checked)
        if whole:
            tokens.copy_(tok)
            logprobs.copy_(lp)
        else:
            tokens[idx] = tok
            logprobs[idx] = lp.to(logprobs.dtype)
    return tokens, logprobs, finite


@torch.no_grad()
def sample_async(logits: torch.Tensor, params: list[SamplingParams], keys: list[int], positions: list[int],
                 vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample`` without reading anything back to the host (on the usual path: rows without top-k / top-p, whose
    candidate widths depend on the logits): (token_ids [B], logprobs [B], finite [B] bool). A row whose
    temperature-scaled logits are not all finite is flagged False instead of raising, and its token and log-prob
    are meaningless; every other row's are ``sample``'s, bit for bit. The rollout engine fetches all three in
    one transfer."""
    _check_args(logits, params, keys, positions, vocab_size)
    x = logits if vocab_size is None else logits[:, :vocab_size]
    tokens, logprobs, finite = _sample_groups(x, params, keys, positions, checked=False)
    assert finite is not None
    return tokens, logprobs, finite


@torch.no_grad()
def sample(logits: torch.Tensor, params: list[SamplingParams], keys: list[int], positions: list[int],
           vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and record its log-prob.

    logits: [B, V] (fp32; bf16/fp16 are upcast the way ``token_logprobs`` upcasts them), one row
    per request sampling this step. params[b], keys[b] (the row's sample index within its request) and
    positions[b] (absolute position of the token being sampled: len(prompt) + len(generated))
    describe row b. vocab_size: if given, only the first ``vocab_size`` columns are the vocabulary
    (padding columns are ignored for the draw *and* the recorded log-prob; the trainer must slice
    the same way). Returns (token_ids [B] int64, logprobs [B] fp32), with
    ``logprobs[b] == token_logprobs(logits[b, :vocab_size], token_ids[b], params[b].temperature)``
    bit for bit. Row b's outputs depend only on (logits[b], params[b], keys[b], positions[b]).
    Raises ValueError for NaN/Inf logits (naming the row) and malformed arguments. Runs without
    autograd: the recorded log-probs are data, the trainer recomputes them with gradients.
    """
    _check_args(logits, params, keys, positions, vocab_size)
    x = logits if vocab_size is None else logits[:, :vocab_size]
    tokens, logprobs, _ = _sample_groups(x, params, keys, positions, checked=True)
    return tokens, logprobs
