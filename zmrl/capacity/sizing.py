"""Parameter counts and cache byte math for a ``ModelConfig`` (planning only; builds no tensors).

``weight_shapes`` is the single source of truth: it enumerates every weight tensor the model
modules create (the names of the released checkpoints, docs/model.md, plus the K3 extensions below) and every count here
is a sum over it. A test holds the built tiny model's ``state_dict`` to the same dict.

K3 extensions (the base tensors follow the released names; these are the choices for the rest):

- latent MoE (``moe_latent_size`` = L set): per MoE layer ``mlp.latent_down_proj.weight`` [L, D],
  ``mlp.latent_norm.weight`` [L], ``mlp.latent_up_proj.weight`` [D, L]; routed experts map
  L -> moe_intermediate -> L; the router ``mlp.gate.weight`` stays [E, D] (it reads the full-width
  token); shared experts run in the full width D.
- gated MLA (``mla_use_output_gate``): ``self_attn.g_proj.weight`` [H*v, D].
- full-rank KDA gate (``use_full_rank_gate``): ``self_attn.g_proj.weight`` [H*dk, D] instead of
  ``g_a_proj``/``g_b_proj``.
- block AttnRes (``attn_res_block_size`` set): per layer ``self_attention_res_norm.weight``,
  ``self_attention_res_proj.weight``, ``mlp_res_norm.weight``, ``mlp_res_proj.weight`` [D]; top level
  ``model.output_attn_res_norm.weight``, ``model.output_attn_res_proj.weight`` [D].
- ``lm_head.weight`` is listed only when embeddings are untied (a tied head is the same tensor).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # avoid a runtime import cycle: config.py delegates to this module
    from zmrl.model.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]

# dtype name -> bytes per element (for the short-conv state, which is kept in the model dtype)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

LATENT_FORMATS = ("bf16", "fp8", "nvfp4")
INDEX_FORMATS = ("fp8", "mxfp4")

_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.")


# ---------------------------------------------------------------------------- weight shapes
def _kda_attn(cfg: "ModelConfig", p: str) -> Shapes:
    la = cfg.linear_attn_config
    D, H, dk, W = cfg.hidden_size, la.num_heads, la.head_dim, la.short_conv_kernel_size
    hk = H * dk  # dv == dk: no GVA
    s: Shapes = {}
    for n in ("q", "k", "v"):
        s[f"{p}{n}_proj.weight"] = (hk, D)
        s[f"{p}{n}_conv1d.weight"] = (hk, 1, W)
    s[f"{p}f_a_proj.weight"] = (dk, D)  # low-rank forget gate, rank = head_dim
    s[f"{p}f_b_proj.weight"] = (hk, dk)
    s[f"{p}A_log"] = (H,)
    s[f"{p}dt_bias"] = (hk,)
    s[f"{p}b_proj.weight"] = (H, D)
    if cfg.use_full_rank_gate:
        s[f"{p}g_proj.weight"] = (hk, D)
    else:
        s[f"{p}g_a_proj.weight"] = (dk, D)
        s[f"{p}g_b_proj.weight"] = (hk, dk)
    s[f"{p}o_norm.weight"] = (dk,)  # one weight shared by all heads
    s[f"{p}o_proj.weight"] = (D, hk)
    return s


def _mla_attn(cfg: "ModelConfig", p: str) -> Shapes:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    qk, v = cfg.qk_head_dim, cfg.v_head_dim
    s: Shapes = {}
    if cfg.q_lora_rank is None:
        s[f"{p}q_proj.weight"] = (H * qk, D)
    else:
        s[f"{p}q_a_proj.weight"] = (cfg.q_lora_rank, D)
        s[f"{p}q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        s[f"{p}q_b_proj.weight"] = (H * qk, cfg.q_lora_rank)
    s[f"{p}kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
    s[f"{p}kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    s[f"{p}kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + v), cfg.kv_lora_rank)
    if cfg.mla_use_output_gate:
        s[f"{p}g_proj.weight"] = (H * v, D)
    s[f"{p}o_proj.weight"] = (D, H * v)
    if cfg.has_indexer:
        i = f"{p}indexer."
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        # validate() guarantees q_lora_rank is set when the indexer is
        s[f"{i}wq_b.weight"] = (Hi * Di, cfg.q_lora_rank)
        s[f"{i}wk.weight"] = (Di, D)
        s[f"{i}k_norm.weight"] = (Di,)
        s[f"{i}k_norm.bias"] = (Di,)
        s[f"{i}weights_proj.weight"] = (Hi, D)
    return s


def _glu(p: str, inter: int, width: int) -> Shapes:
    return {
        f"{p}gate_proj.weight": (inter, width),
        f"{p}up_proj.weight": (inter, width),
        f"{p}down_proj.weight": (width, inter),
    }


def _moe(cfg: "ModelConfig", p: str) -> Shapes:
    D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    L = cfg.moe_latent_size
    s: Shapes = {
        f"{p}mlp.gate.weight": (E, D),  # the router reads the full-width token, latent MoE or not
        f"{p}mlp.gate.e_score_correction_bias": (E,),
    }
    width = D
    if L is not None:
        width = L
        s[f"{p}mlp.latent_down_proj.weight"] = (L, D)
        if cfg.latent_moe_use_norm:
            s[f"{p}mlp.latent_norm.weight"] = (L,)
        s[f"{p}mlp.latent_up_proj.weight"] = (D, L)
    for e in range(E):
        s.update(_glu(f"{p}mlp.experts.{e}.", I, width))
    if cfg.n_shared_experts > 0:
        # shared experts run in the full width D even under a latent MoE
        s.update(_glu(f"{p}mlp.shared_experts.", cfg.n_shared_experts * I, D))
    return s


def weight_shapes(cfg: "ModelConfig") -> Shapes:
    """Every weight tensor of the model for ``cfg``: HF-style name -> shape (torch Linear layout
    [out, in]). Exactly the names the model modules register; LoRA adapters are not included."""
    D = cfg.hidden_size
    s: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        s[f"{p}input_layernorm.weight"] = (D,)
        s[f"{p}post_attention_layernorm.weight"] = (D,)
        if cfg.attn_res_block_size is not None:
            for n in ("self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"):
                s[f"{p}{n}.weight"] = (D,)
        if cfg.is_kda_layer(i):
            s.update(_kda_attn(cfg, f"{p}self_attn."))
        else:
            s.update(_mla_attn(cfg, f"{p}self_attn."))
        if cfg.is_moe_layer(i):
            s.update(_moe(cfg, p))
        else:
            s.update(_glu(f"{p}mlp.", cfg.intermediate_size, D))
    s["model.norm.weight"] = (D,)
    if cfg.attn_res_block_size is not None:
        s["model.output_attn_res_norm.weight"] = (D,)
        s["model.output_attn_res_proj.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, D)
    return s


# ---------------------------------------------------------------------------- parameter counts
def _is_active(name: str, top_k: int) -> bool:
    """Routed experts are active only for the ``top_k`` a token picks; all experts of a layer have
    equal shapes, so counting experts 0..top_k-1 gives the per-token active count."""
    m = _EXPERT_RE.search(name)
    return m is None or int(m.group(1)) < top_k


def param_counts(cfg: "ModelConfig") -> tuple[int, int]:
    """(total, active) parameter counts. Active = every non-routed-expert weight (attention,
    indexer, norms, router, shared experts, latent projections, dense MLPs, the full embedding table
    and lm_head) + ``num_experts_per_tok`` routed experts per MoE layer. Embeddings and lm_head are
    counted in both, by the usual convention (a token reads one embedding row, but the table is
    not counted per row)."""
    total = active = 0
    k = cfg.num_experts_per_tok
    for name, shape in weight_shapes(cfg).items():
        n = math.prod(shape)
        total += n
        if _is_active(name, k):
            active += n
    return total, active


@dataclass(frozen=True)
class ParamRow:
    """One component: ``per_layer`` counts (total, active) for one instance, ``count`` instances."""

    component: str
    count: int
    per_layer_total: int
    per_layer_active: int

    @property
    def total(self) -> int:
        return self.count * self.per_layer_total

    @property
    def active(self) -> int:
        return self.count * self.per_layer_active


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _component(rest: str, kda: bool) -> str:
    """Component of a per-layer tensor (``rest`` = name after ``model.layers.{i}.``)."""
    if rest.startswith("self_attn.indexer."):
        return "DSA indexer"
    if rest.startswith("self_attn."):
        return "KDA attention" if kda else "MLA attention"
    if rest.startswith("mlp.experts."):
        return "MoE routed experts"
    if rest.startswith("mlp.shared_experts."):
        return "MoE shared experts"
    if rest.startswith("mlp.gate."):
        return "MoE router"
    if rest.startswith("mlp.latent_"):
        return "MoE latent down/norm/up"
    if rest.startswith("mlp."):
        return "dense MLP"
    return "layer norms + AttnRes"


def param_breakdown(cfg: "ModelConfig") -> list[ParamRow]:
    """``param_counts`` split by component; the rows' totals and actives sum to ``param_counts``.
    Every instance of a per-layer component has the same size (asserted), so a row is exact."""
    k = cfg.num_experts_per_tok
    per: dict[tuple[str, int], list[int]] = {}
    for name, shape in weight_shapes(cfg).items():
        n = math.prod(shape)
        m = _LAYER_RE.match(name)
        if m is None:
            comp, layer = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}.get(
                name, "final norm + output AttnRes"), -1
        else:
            layer = int(m.group(1))
            comp = _component(m.group(2), cfg.is_kda_layer(layer))
        acc = per.setdefault((comp, layer), [0, 0])
        acc[0] += n
        acc[1] += n if _is_active(name, k) else 0
    rows: dict[str, list] = {}
    for (comp, _layer), (t, a) in per.items():
        r = rows.setdefault(comp, [0, t, a])
        if (r[1], r[2]) != (t, a):
            raise AssertionError(f"component {comp!r} differs between layers: {(r[1], r[2])} vs {(t, a)}")
        r[0] += 1
    return [ParamRow(c, n, t, a) for c, (n, t, a) in rows.items()]


def format_param_breakdown(cfg: "ModelConfig") -> str:
    """``param_breakdown`` as a Markdown table (for docs/sizing.md and reports)."""
    lines = ["| component | × | per instance (total) | per instance (active) | total | active |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in param_breakdown(cfg):
        lines.append(f"| {r.component} | {r.count} | {r.per_layer_total:,} | {r.per_layer_active:,} "
                     f"| {r.total:,} | {r.active:,} |")
    total, active = param_counts(cfg)
    lines.append(f"| **sum** | | | | **{total:,}** | **{active:,}** |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- cache bytes
def _check_format(kind: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {kind} cache format {value!r}; allowed: {list(allowed)}")


def kv_bytes_per_token_per_layer(cfg: "ModelConfig", latent: str = "bf16", index: str = "fp8") -> tuple[int, int]:
    """(latent_bytes, index_key_bytes) one token occupies in one MLA(+DSA) layer's cache.

    latent (c_kv of ``kv_lora_rank`` values + ``qk_rope_head_dim`` k_pe values):
      - ``bf16``:  2·(kv_lora + rope)                                  (K3.1 Pro: 1152)
      - ``fp8``:   kv_lora + rope, 1 B each; the per-128 fp32 scales are NOT counted, matching the
                   article's 576 (FlashMLA's paged layout stores 656 B: 512 fp8 + 4×4 B scales +
                   64 bf16 rope)                                        (K3.1 Pro: 576)
      - ``nvfp4``: kv_lora/2 (4-bit values) + kv_lora/16 (one fp8 e4m3 scale per 16) + rope at
                   1 B; the per-tensor fp32 global scale is not per token (K3.1 Pro: 256+32+64 = 352)
    index key (``index_head_dim`` = Di values; 0 when the config has no indexer):
      - ``fp8``:   Di + 4·ceil(Di/128)  (fp32 scale per 128)           (Di=128: 132)
      - ``mxfp4``: ceil(Di/2) + ceil(Di/32)  (e8m0 scale per 32)       (Di=128: 68)
      - a config with ``index_quant: none`` keeps its keys in the model dtype whatever ``index`` says:
                   Di·dtype_bytes (Di=128, bf16: 256)
    The index key is per MLA layer that stores keys (``ModelConfig.index_key_layers``: "shared" indexer
    layers store none).
    """
    _check_format("latent", latent, LATENT_FORMATS)
    _check_format("index", index, INDEX_FORMATS)
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if latent == "bf16":
        lat = 2 * (c + r)
    elif latent == "fp8":
        lat = c + r
    else:
        lat = math.ceil(c / 2) + math.ceil(c / 16) + r
    if not cfg.has_indexer:
        return lat, 0
    di = cfg.index_head_dim
    if cfg.index_quant == "none":
        idx = di * DTYPE_BYTES[cfg.torch_dtype]
    elif index == "fp8":
        idx = di + 4 * math.ceil(di / 128)
    else:
        idx = math.ceil(di / 2) + math.ceil(di / 32)
    return lat, idx


def kda_state_bytes_per_request(cfg: "ModelConfig") -> int:
    """Bytes of KDA recurrent state one request holds (all KDA layers, no parallel split):

        n_kda · ( H·dk·dv·4                      # fp32 delta-rule state S per head
                + (W-1)·3·H·dk·dtype_bytes )      # short-conv tails of q, k, v (last W-1 inputs)

    with dv = dk (no GVA), W = short_conv_kernel_size, dtype_bytes from ``torch_dtype``.
    Chunk-boundary snapshots for prefix caching are extra (one state per cached block end), within the
    engine's ``EngineConfig.prefix_cache_kda_gib``."""
    la = cfg.linear_attn_config
    n_kda = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i))
    H, dk = la.num_heads, la.head_dim
    state = H * dk * dk * 4
    conv = (la.short_conv_kernel_size - 1) * 3 * H * dk * DTYPE_BYTES[cfg.torch_dtype]
    return n_kda * (state + conv)
