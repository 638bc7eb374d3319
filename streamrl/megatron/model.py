"""A megatron-core `GPTModel` with the architecture of a Hugging Face Qwen2 / Llama config, and the
token log-probs of a batch computed vocabulary-parallel (each tensor-parallel rank holds a slice of
the logits; the full vocabulary is never gathered).

Call after `streamrl.megatron.parallel.initialize` (and `streamrl.megatron.cpu.use_cpu` without CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from streamrl.megatron.convert import Layout, Stage


def rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the Hugging Face config names no rope_theta")
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {parameters['rope_type']!r} is not supported by the megatron backend")
    return float(theta)


def transformer_config(config: Any, layout: Layout) -> TransformerConfig:
    """Qwen2 / Llama in megatron-core's terms: RMSNorm, SwiGLU, RoPE, grouped-query attention, no
    linear biases but (Qwen2) the QKV bias. Local (non-Transformer-Engine) modules, float32, no fusions,
    so the same model runs on CPU and GPU."""
    return TransformerConfig(
        num_layers=layout.layers, hidden_size=layout.hidden, num_attention_heads=layout.heads,
        num_query_groups=layout.groups, kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, use_cpu_initialization=True, params_dtype=torch.float32, bf16=False, fp16=False)


def block_spec(stage: Stage) -> TransformerBlockSubmodules:
    """This stage's layers and final norm, all local modules. Given a layer spec alone, megatron-core
    picks the final norm by what happens to be installed (Transformer Engine's norm when it imports,
    apex's, which refuses RMSNorm, when only apex does): naming it keeps the model the same everywhere."""
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    return TransformerBlockSubmodules(layer_specs=[layer] * stage.layers, layer_norm=WrappedTorchNorm)


def build_model(config: Any) -> tuple[GPTModel, Layout, Stage]:
    """An untrained GPTModel for this rank's pipeline stage (load weights with `load_state_dict` from
    `convert`). Over several stages a tied embedding is built untied, its last-stage copy marked
    `shared` (megatron-core's own attribute: counted once in the gradient norm) and kept equal to the
    first stage's by summing their gradients (`streamrl.megatron.pipeline.sum_tied_embedding_grads`):
    megatron-core's own tying across stages moves the weight to CUDA, so it cannot run on CPU."""
    layout = Layout.from_hf(config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    layout.check_tp(tp)
    stage = Stage.of(layout, parallel_state.get_pipeline_model_parallel_rank(),
                     parallel_state.get_pipeline_model_parallel_world_size())
    model = GPTModel(config=transformer_config(config, layout), transformer_layer_spec=block_spec(stage),
                     vocab_size=layout.padded_vocab(tp), max_sequence_length=config.max_position_embeddings,
                     pre_process=stage.pre, post_process=stage.post, position_embedding_type="rope",
                     rotary_base=rope_theta(config),
                     share_embeddings_and_output_weights=layout.tied and stage.pre and stage.post,
                     parallel_output=True)
    if stage.tied_copy(layout):
        model.output_layer.weight.shared = True
    if torch.cuda.is_available():
        model.cuda()  # built on the CPU (use_cpu_initialization): the weights are loaded over it anyway
    return model, layout, stage


def attention_inputs(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and the causal mask of right-padded rows (a causal mask is enough: padding follows
    every real token)."""
    n, width = input_ids.shape
    positions = torch.arange(width, device=input_ids.device).expand(n, width)
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=input_ids.device), diagonal=1)
    return positions, causal[None, None]


def token_logprobs(model: GPTModel, layout: Layout, input_ids: torch.Tensor, *, temperature: float = 1.0
                   ) -> torch.Tensor:
    """[n, w − 1] log-probs of tokens 1..w−1 of right-padded rows, on a model that is one whole stage."""
    return logits_logprobs(model(input_ids, *attention_inputs(input_ids)), layout, input_ids, temperature=temperature)


def logits_logprobs(logits: torch.Tensor, layout: Layout, input_ids: torch.Tensor, *, temperature: float = 1.0
                    ) -> torch.Tensor:
    """[n, w − 1] log-probs of tokens 1..w−1 from this TP rank's [n, w, vocab / tp] logits.
    Vocabulary-parallel: the padded vocabulary rows are masked out."""
    # [w − 1, n, vocab / tp], megatron's order; divided in float32 as the sampler does (bf16 logits divided
    # in bf16 are rounded again: up to 0.18 nats off at T = 0.6)
    logits = logits[:, :-1].transpose(0, 1).float() / temperature
    shard = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * shard
    padded = torch.arange(first, first + shard, device=logits.device) >= layout.vocab
    if padded.any():
        logits = logits.masked_fill(padded, float("-inf"))
    targets = input_ids[:, 1:].transpose(0, 1).contiguous()
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), targets).transpose(0, 1)


def release_scratch(*models: torch.nn.Module, device: str | torch.device = "cpu") -> None:
    """Free what `Module.to` leaves on the device after a model's parameters and buffers have moved
    (colocated, the GPU goes to the sglang servers): tensors megatron-core keeps as plain attributes
    (the rotary embedding moves its inverse frequencies onto the GPU at the first forward), the rotary
    tables its `forward` caches (an `lru_cache` on the class, whatever instance), and the global scratch
    buffer attention scores are computed in (its size grows with batch × heads × length²). Each comes
    back by itself at the next forward."""
    for model in models:
        for module in model.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor):
                    setattr(module, name, value.to(device))
    RotaryEmbedding.forward.cache_clear()
    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:  # created by initialize_model_parallel
        parallel_state.get_global_memory_buffer().buffer.clear()


def held_tensors(*models: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the models and megatron-core hold for them, by where it is held: parameters,
    buffers, plain tensor attributes of their modules, the global scratch buffer. (The rotary cache's
    entries cannot be listed: `RotaryEmbedding.forward.cache_info()` counts them.)"""
    found = []
    for i, model in enumerate(models):
        for module_name, module in model.named_modules():
            for name, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False),
                                *vars(module).items()]:
                if isinstance(value, torch.Tensor):
                    found.append((f"model {i} {module_name}.{name}", value))
    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:
        found += [(f"global memory buffer {key}", tensor)
                  for key, tensor in parallel_state.get_global_memory_buffer().buffer.items()]
    return found
