"""Load a Hugging Face causal LM for sampling or training (its weights move as numpy arrays: see
`streamrl.weights.arrays`)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


def quiet_transformers() -> None:
    """No download/progress bars or info logs from transformers in run output (nothing is downloaded)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def default_device() -> torch.device:
    """CUDA when this process sees a GPU (Ray shows an actor only the GPUs it reserved), else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_policy(path: str | Path, *, train: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (float32, eager attention: fastest for small models on CPU) and tokenizer from a local directory."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.train(train)
    if not train:
        model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
