"""Hugging Face Qwen2 / Llama weights ⇄ megatron-core GPTModel weights, one tensor-parallel shard at a time.

| Hugging Face (per layer `model.layers.i.`)       | megatron-core (`decoder.layers.i.`)         | TP split      |
|--------------------------------------------------|---------------------------------------------|---------------|
| `self_attn.{q,k,v}_proj.weight` (+ `.bias`)      | `self_attention.linear_qkv.weight` (+ bias) | query groups  |
| `self_attn.o_proj.weight`                        | `self_attention.linear_proj.weight`         | input dim     |
| `mlp.gate_proj.weight`, `mlp.up_proj.weight`     | `mlp.linear_fc1.weight`                     | each half     |
| `mlp.down_proj.weight`                           | `mlp.linear_fc2.weight`                     | input dim     |
| `input_layernorm`, `post_attention_layernorm`    | `input_layernorm`, `pre_mlp_layernorm`      | replicated    |
| `model.embed_tokens`, `lm_head` (untied)        | `embedding.word_embeddings`, `output_layer` | vocabulary    |
| `model.norm`                                     | `decoder.final_layernorm`                   | replicated    |

The fused QKV is laid out per query group — the group's query heads, then its key head, then its value
head — so a tensor-parallel rank holds whole groups. The fused fc1 holds [gate; up] on every rank,
each half that rank's slice. The vocabulary is padded with zero rows to a multiple of the TP size
(the padded logits are masked before any softmax, see `streamrl.megatron.model`). Pure tensor code:
no megatron-core import, so the round trip is tested anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = ("qwen2", "llama")


@dataclass(frozen=True)
class Layout:
    """The shapes a conversion needs, read from a Hugging Face config."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, config: Any) -> Layout:
        kind = getattr(config, "model_type", None)
        if kind not in SUPPORTED:
            raise ValueError(f"model_type {kind!r}: the megatron backend converts {', '.join(SUPPORTED)} models")
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias = true is not supported by the megatron backend")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        qkv_bias = kind == "qwen2" or bool(getattr(config, "attention_bias", False))
        if kind == "llama" and qkv_bias:
            raise ValueError("llama attention_bias = true (a bias on o_proj too) is not supported")
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   ffn=config.intermediate_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=qkv_bias)

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp

    def check_tp(self, tp: int) -> None:
        """Tensor parallelism splits whole query groups, attention heads and FFN columns."""
        for what, count in (("key/value heads", self.groups), ("attention heads", self.heads),
                            ("intermediate_size", self.ffn)):
            if count % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide {what} = {count}")


def _layer(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def _shard(tensor: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    return tensor.chunk(tp, dim=dim)[rank].clone()


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[groups × (q heads per group + 2) × head_dim, ...] from HF's separate projections."""
    rest = q.shape[1:]
    per_group = layout.heads // layout.groups
    q = q.reshape(layout.groups, per_group * layout.head_dim, *rest)
    k = k.reshape(layout.groups, layout.head_dim, *rest)
    v = v.reshape(layout.groups, layout.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    per_group = layout.heads // layout.groups
    grouped = qkv.reshape(layout.groups, (per_group + 2) * layout.head_dim, *rest)
    q, k, v = grouped.split([per_group * layout.head_dim, layout.head_dim, layout.head_dim], dim=1)
    return (q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone())


def _pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])]) if rows > table.shape[0] \
        else table


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, *, rank: int = 0, tp: int = 1
                   ) -> dict[str, torch.Tensor]:
    """The megatron state of tensor-parallel rank `rank` of `tp`, from a Hugging Face state dict."""
    layout.check_tp(tp)
    missing = [name for name in _hf_names(layout) if name not in hf]
    if missing:
        raise KeyError(f"the Hugging Face weights lack {missing[:4]}{' …' if len(missing) > 4 else ''}")
    vocab_rows = layout.padded_vocab(tp)
    out = {"embedding.word_embeddings.weight": _shard(_pad_rows(hf["model.embed_tokens.weight"], vocab_rows), 0,
                                                      rank, tp),
           "decoder.final_layernorm.weight": hf["model.norm.weight"].clone()}
    if not layout.tied:
        out["output_layer.weight"] = _shard(_pad_rows(hf["lm_head.weight"], vocab_rows), 0, rank, tp)
    for i in range(layout.layers):
        h, m = _layer(i)
        attn = h + "self_attn."
        qkv = _fuse_qkv(hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], layout)
        out[m + "self_attention.linear_qkv.weight"] = _shard(qkv, 0, rank, tp)
        if layout.qkv_bias:
            bias = _fuse_qkv(hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], layout)
            out[m + "self_attention.linear_qkv.bias"] = _shard(bias, 0, rank, tp)
        out[m + "self_attention.linear_proj.weight"] = _shard(hf[attn + "o_proj.weight"], 1, rank, tp)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_shard(hf[h + "mlp.gate_proj.weight"], 0, rank, tp),
                                                      _shard(hf[h + "mlp.up_proj.weight"], 0, rank, tp)])
        out[m + "mlp.linear_fc2.weight"] = _shard(hf[h + "mlp.down_proj.weight"], 1, rank, tp)
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
    return out


def megatron_to_hf(shards: list[Mapping[str, torch.Tensor]], layout: Layout) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (tied embeddings once, as `model.embed_tokens.weight`) from the
    megatron states of every tensor-parallel rank, in rank order."""
    tp = len(shards)
    first = shards[0]

    def gathered(name: str, dim: int) -> torch.Tensor:
        return torch.cat([shard[name] for shard in shards], dim=dim)

    out = {"model.embed_tokens.weight": gathered("embedding.word_embeddings.weight", 0)[:layout.vocab].clone(),
           "model.norm.weight": first["decoder.final_layernorm.weight"].clone()}
    if not layout.tied:
        out["lm_head.weight"] = gathered("output_layer.weight", 0)[:layout.vocab].clone()
    for i in range(layout.layers):
        h, m = _layer(i)
        attn = h + "self_attn."
        q, k, v = _split_qkv(gathered(m + "self_attention.linear_qkv.weight", 0), layout)
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        if layout.qkv_bias:
            q, k, v = _split_qkv(gathered(m + "self_attention.linear_qkv.bias", 0), layout)
            out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
        out[attn + "o_proj.weight"] = gathered(m + "self_attention.linear_proj.weight", 1)
        halves = [shard[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for shard in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([gate for gate, _ in halves])
        out[h + "mlp.up_proj.weight"] = torch.cat([up for _, up in halves])
        out[h + "mlp.down_proj.weight"] = gathered(m + "mlp.linear_fc2.weight", 1)
        out[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"].clone()
        out[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"].clone()
    if tp > 1:
        _check_replicas(shards)
    return out


def _check_replicas(shards: list[Mapping[str, torch.Tensor]]) -> None:
    """Replicated tensors (the norms) must agree across ranks, or the ranks have drifted apart."""
    for name, tensor in shards[0].items():
        if name.endswith("layernorm.weight") and not all(torch.equal(tensor, s[name]) for s in shards[1:]):
            raise ValueError(f"{name} differs between tensor-parallel ranks")


def _hf_names(layout: Layout) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if layout.tied else ["lm_head.weight"])
    for i in range(layout.layers):
        h = f"model.layers.{i}."
        names += [h + f"self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [h + f"self_attn.{p}_proj.bias" for p in "qkv"] if layout.qkv_bias else []
        names += [h + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [h + "input_layernorm.weight", h + "post_attention_layernorm.weight"]
    return names
