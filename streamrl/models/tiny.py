"""The built-in default policy: a tiny Qwen2 causal LM and a character tokenizer, saved in HF format.

Nothing is downloaded: the architecture comes from a config, the weights from a seeded random init,
and the tokenizer is built here from the task's character vocabulary (one token per character, with
`<pad>`, `<bos>` and `<eos>`). The directory it writes loads with `AutoModelForCausalLM` and
`AutoTokenizer` like any other checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from streamrl.config import ModelSection
from streamrl.tasks.reverse import CharVocab


def build_tokenizer(vocab: CharVocab) -> PreTrainedTokenizerFast:
    pad, bos, eos = vocab.tokens[:3]
    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab.tokens)}, unk_token=pad))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters back to back (without it, decoded alone: "2 1")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad, bos_token=bos, eos_token=eos,
                                   unk_token=pad, clean_up_tokenization_spaces=False)


def build_tiny_model(section: ModelSection, directory: str | Path, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen2 model and its tokenizer to `directory`."""
    vocab = CharVocab()
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=section.hidden_size, num_hidden_layers=section.num_layers,
        num_attention_heads=section.num_heads, num_key_value_heads=section.num_heads,
        intermediate_size=section.intermediate_size, max_position_embeddings=section.max_positions,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    directory = Path(directory)
    model.save_pretrained(directory)
    build_tokenizer(vocab).save_pretrained(directory)
    return directory
