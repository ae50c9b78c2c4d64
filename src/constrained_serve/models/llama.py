"""Our own Llama-family model (Llama 2/3, Mistral, SmolLM/SmolLM2, TinyLlama, Qwen2/2.5/3).

Selective batching: every linear, norm and MLP op runs on one flat [num_tokens, hidden]
tensor holding all sequences of the step (prefill chunks and decode tokens mixed); only
attention splits by sequence, over the paged KV cache. The LM head runs only on the rows
that sample (``logits_indices``), never on every prompt token; so do the last layer's
o_proj and MLP (the attention still stores every token's K/V).

Weights use the Hugging Face names so HF checkpoints load as they are; q/k/v and gate/up
are fused into one matmul each at load time (fewer, larger GEMMs are faster on CPU and GPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import dispatch, native_fused
from ..kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArchitecture:
    """The few numbers the forward needs, read from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # on q/k/v
    qk_norm: bool
    o_bias: bool = False  # on o_proj (Llama/Qwen3 attention_bias=True)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Sliding-window attention (Mistral, Qwen2 use_sliding_window): None when off. We attend
    # to the whole context, which is exact only up to the window: the engine caps its
    # context there (see sliding_window_of).
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> "ModelArchitecture":
        mt = config.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model: unsupported model_type {mt!r}; supported: {SUPPORTED_MODEL_TYPES}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        act = getattr(config, "hidden_act", "silu")
        biased = bool(getattr(config, "attention_bias", False))
        if act not in _ACTIVATIONS:
            raise ValueError(f"model: unsupported hidden_act {act!r}; supported: {sorted(_ACTIVATIONS)}")
        return cls(
            model_type=mt,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # As HF's modeling code reads the config: Qwen2 always has q/k/v biases (and no
            # other); Llama and Qwen3 put attention_bias on q/k/v/o, Llama mlp_bias on the MLP;
            # Mistral has none (a stray key in its config.json changes nothing).
            attention_bias=(biased and mt in ("llama", "qwen3")) or mt == "qwen2",
            qk_norm=mt == "qwen3",
            o_bias=biased and mt in ("llama", "qwen3"),
            mlp_bias=bool(getattr(config, "mlp_bias", False)) and mt == "llama",
            hidden_act=act,
            sliding_window=sliding_window_of(config),
        )


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window a config asks for, or None (full attention)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:  # every layer attends fully
        return None
    return int(window) if window else None


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and native_fused.applies(x, self.weight):  # CPU: one pass (fused_cpu.c)
            return native_fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op instead of five
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalize in fp32 like HF does, then cast back (bf16 on GPU).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed by transformers' RoPE init functions so
    every scaling type in the config (linear, llama3, yarn, ...) matches HF exactly."""

    def __init__(self, hf_config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            cos, sin = self._tables(hf_config, head_dim, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @staticmethod
    def _tables(hf_config: PretrainedConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"model: unsupported rope_type {rope_type!r}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(pos, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling

    def tables_for(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of this step's positions, gathered once and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(
        cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]; rotate-half convention (as HF Llama/Qwen)."""
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.arch = arch
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.scale = arch.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """keep: project only these rows' attention outputs (the last layer, see DecoderLayer)."""
        a = self.arch
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        if not a.qk_norm and native_fused.rope_store_applies(qkv, k_cache, v_cache, a.head_dim):
            # CPU: rotary and K/V store in one pass, q rotated in place (fused_cpu.c).
            q = native_fused.rope_store(qkv, cos_sin, a.num_heads, a.num_kv_heads, k_cache, v_cache, meta.slot_mapping)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, a.num_heads, a.head_dim)
            k = k.view(T, a.num_kv_heads, a.head_dim)
            v = v.view(T, a.num_kv_heads, a.head_dim)
            if a.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.apply(cos_sin, q, k)
            dispatch.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = dispatch.paged_attention(q, k_cache, v_cache, meta, self.scale).reshape(T, self.q_size)
        return self.o_proj(o if keep is None else o.index_select(0, keep))


class MLP(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.inter = arch.intermediate_size
        self.act = _ACTIVATIONS[arch.hidden_act]
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and native_fused.applies(gate_up):  # CPU: one pass (fused_cpu.c)
            return self.down_proj(native_fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """keep (the last layer only): the rows that sample. Every row's K/V is stored, but
        only these rows' hidden states are needed past the attention, so the o_proj and the
        MLP run on them alone (llama.cpp does the same for the MLP)."""
        h = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, keep)
        x = (x if keep is None else x.index_select(0, keep)) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder stack + LM head. ``forward`` returns logits for ``logits_indices`` only."""

    def __init__(self, hf_config: PretrainedConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch = ModelArchitecture.from_hf_config(hf_config)
        # Uninitialised on purpose (the loader fills every weight): nn.Embedding's own init,
        # normal_ on the meta device the loader builds on, imports torch._dynamo (~1 s).
        self.embed_tokens = nn.Embedding(
            arch.vocab_size, arch.hidden_size, _weight=torch.empty(arch.vocab_size, arch.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(hf_config, arch.head_dim, max_positions or arch.max_position_embeddings)
        self.packed_head: nn.Module | None = None  # set by pack_for_cpu

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_for_cpu(self) -> None:
        """fp32/bf16 on CPU: every projection and the LM head through oneDNN (see cpu_linear.py).
        A tied head gets its own packed copy; the embedding keeps the dense table for lookups."""
        from .cpu_linear import PackedLinear, pack_linears

        n = pack_linears(self)  # the projections, and an untied lm_head
        self.packed_head = self.lm_head if self.lm_head is not None else PackedLinear(self.embed_tokens.weight)
        logger.info("packed %d linear layers and the LM head for oneDNN", n)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices))

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The final-norm hidden states of the ``logits_indices`` rows (what a CUDA graph
        captures: the LM head runs outside it, so no bucket keeps a [batch, vocab] buffer)."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.tables_for(positions, x.dtype)
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            # The last layer carries on with the rows that sample only (in sampling order).
            x = layer(x, cos_sin, kv, meta, logits_indices if i == last else None)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states ``x``."""
        if self.packed_head is not None:
            return self.packed_head(x).float()
        return F.linear(x, self.lm_head_weight()).float()
