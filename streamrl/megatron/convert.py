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

A pipeline stage converts only what it holds (`Stage`): its run of layers, renumbered from 0, the
embedding on the first stage, the final norm and output layer on the last. A model with tied
embeddings split over stages keeps a copy of the embedding as the last stage's output layer (megatron
-core's own arrangement; the copies' gradients are summed, see `streamrl.megatron.pipeline`).

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
        # What the megatron model builds (SwiGLU, full attention in every layer); a config that differs
        # converted without complaint and computed other logits than the model the engines sample with.
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by the megatron backend (silu)")
        windowed = [kind for kind in getattr(config, "layer_types", None) or [] if kind != "full_attention"]
        if getattr(config, "use_sliding_window", False) or windowed:
            raise ValueError("sliding-window attention is not supported by the megatron backend")
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


@dataclass(frozen=True)
class Stage:
    """The part of the model one pipeline stage holds: layers [first_layer, first_layer + layers), the
    embedding when `pre`, the final norm and output layer when `post`."""

    first_layer: int
    layers: int
    pre: bool
    post: bool

    @classmethod
    def whole(cls, layout: Layout) -> Stage:
        return cls(0, layout.layers, pre=True, post=True)

    @classmethod
    def of(cls, layout: Layout, rank: int, size: int) -> Stage:
        """Pipeline rank `rank` of `size`: an equal share of the layers, in order."""
        if layout.layers % size:
            raise ValueError(f"pipeline parallel size {size} does not divide the model's {layout.layers} layers")
        per_stage = layout.layers // size
        return cls(rank * per_stage, per_stage, pre=rank == 0, post=rank == size - 1)

    def layer_names(self) -> list[tuple[str, str]]:
        """(HF prefix, megatron prefix) of each layer held: global HF index, local megatron index."""
        return [(f"model.layers.{self.first_layer + i}.", f"decoder.layers.{i}.") for i in range(self.layers)]

    def tied_copy(self, layout: Layout) -> bool:
        """This stage holds the output-layer copy of a tied embedding (last stage of several)."""
        return layout.tied and self.post and not self.pre


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


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, *, rank: int = 0, tp: int = 1,
                   stage: Stage | None = None) -> dict[str, torch.Tensor]:
    """The megatron state of tensor-parallel rank `rank` of `tp` (and of pipeline stage `stage`, by
    default the whole model), from a Hugging Face state dict holding at least that stage's tensors."""
    layout.check_tp(tp)
    stage = stage or Stage.whole(layout)
    needed = hf_names(layout, stage) + (["model.embed_tokens.weight"] if stage.tied_copy(layout) else [])
    missing = [name for name in needed if name not in hf]
    if missing:
        raise KeyError(f"the Hugging Face weights lack {missing[:4]}{' …' if len(missing) > 4 else ''}")
    vocab_rows = layout.padded_vocab(tp)

    def vocabulary(name: str) -> torch.Tensor:
        return _shard(_pad_rows(hf[name], vocab_rows), 0, rank, tp)

    out = {}
    if stage.pre:
        out["embedding.word_embeddings.weight"] = vocabulary("model.embed_tokens.weight")
    if stage.post:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not layout.tied:
            out["output_layer.weight"] = vocabulary("lm_head.weight")
        elif stage.tied_copy(layout):
            out["output_layer.weight"] = vocabulary("model.embed_tokens.weight")
    for h, m in stage.layer_names():
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


def megatron_to_hf(shards: list[Mapping[str, torch.Tensor]], layout: Layout, stage: Stage | None = None
                   ) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of `stage` (by default the whole model; tied embeddings once, as
    `model.embed_tokens.weight`, from the first stage) from the megatron states of every
    tensor-parallel rank of that stage, in rank order."""
    tp = len(shards)
    first = shards[0]
    stage = stage or Stage.whole(layout)

    def gathered(name: str, dim: int) -> torch.Tensor:
        return torch.cat([shard[name] for shard in shards], dim=dim)

    out = {}
    if stage.pre:
        out["model.embed_tokens.weight"] = gathered("embedding.word_embeddings.weight", 0)[:layout.vocab].clone()
    if stage.post:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
        if not layout.tied:
            out["lm_head.weight"] = gathered("output_layer.weight", 0)[:layout.vocab].clone()
    for h, m in stage.layer_names():
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


def hf_names(layout: Layout, stage: Stage | None = None) -> list[str]:
    """The Hugging Face names of the tensors `stage` (by default the whole model) exports."""
    stage = stage or Stage.whole(layout)
    names = (["model.embed_tokens.weight"] if stage.pre else []) \
        + (["model.norm.weight"] + ([] if layout.tied else ["lm_head.weight"]) if stage.post else [])
    for h, _ in stage.layer_names():
        names += [h + f"self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [h + f"self_attn.{p}_proj.bias" for p in "qkv"] if layout.qkv_bias else []
        names += [h + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [h + "input_layernorm.weight", h + "post_attention_layernorm.weight"]
    return names
