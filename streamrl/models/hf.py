"""Load a Hugging Face causal LM for sampling or training (its weights move as numpy arrays: see
`streamrl.weights.arrays`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


def quiet_transformers() -> None:
    """No download/progress bars or info logs from transformers in run output (nothing is downloaded)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def default_device() -> torch.device:
    """CUDA when this process sees a GPU (Ray shows an actor only the GPUs it reserved), else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_policy(path: str | Path, *, train: bool = False, dtype: str = "float32",
                attention: str = "eager") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from a local directory. The defaults (float32, eager attention) are the
    fastest for small models on CPU (`model.dtype`, `model.attention`). A model to train is held in
    float32 whatever `dtype` says: its weights are the optimizer's master copy (`autocast` runs the
    arithmetic in `dtype`)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)")
    check_dtype_supported(dtype)
    held = torch.float32 if train else getattr(torch, dtype)
    config = AutoConfig.from_pretrained(path)
    if train:
        _without_dropout(config)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=held, attn_implementation=attention)
    model.train(train)
    if train:
        for module in model.modules():  # dropout a model builds whatever its config says
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if not train:
        model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _without_dropout(config: PretrainedConfig) -> None:
    """A policy is trained without dropout (and layer drop): the engines sample in eval mode, so with it
    θ differed from the behaviour log-prob even for tokens the trainer's own weights sampled (importance
    ratios ≠ 1), and the no-grad proximal and reference passes were noisy. Qwen2 and Llama default to 0;
    GPT-2, OPT, Phi and others do not. The checkpoints' config.json says so: it is what the policy was
    trained with."""
    for part in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for name, value in part.to_dict().items():
            if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop") or name == "layerdrop"):
                setattr(part, name, 0.0)


def check_dtype_supported(dtype: str) -> None:
    """bfloat16 on a GPU that lacks it (before Ampere) is refused here, where the device is known."""
    if dtype == "bfloat16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ValueError(f"model.dtype = 'bfloat16', but {torch.cuda.get_device_name()} has no bfloat16 support; "
                         "use model.dtype = 'float32'")


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Forward (and so backward) arithmetic in `dtype` over float32 weights; nothing for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))
