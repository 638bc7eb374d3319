"""A small causal LM saved in Hugging Face format, built here (nothing is downloaded): a standard
Qwen2 architecture config with random weights, and a character tokenizer with a chat template.

Any Hugging Face checkpoint directory works the same way in `model.path`; this one is small enough
for a CPU to train in minutes. The tokenizer has one token per character the task uses, plus the
special tokens of its chat template, which `task.chat_template = true` renders prompts with.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# ChatML-like: each message is <|role|>content<|end|>; the model answers after <|assistant|> and stops at <eos>
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def char_tokenizer(chars: str, *, chat_template: bool = False) -> PreTrainedTokenizerFast:
    specials = [PAD, BOS, EOS, *(CHAT_TOKENS if chat_template else ())]
    vocab = {token: i for i, token in enumerate([*specials, *dict.fromkeys(chars)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters back to back (without it, decoded alone: "2 1")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=PAD, clean_up_tokenization_spaces=False)
    if chat_template:
        tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_checkpoint(directory: str | Path, tokenizer: PreTrainedTokenizerFast, *, hidden: int = 64, layers: int = 2,
                    heads: int = 4, intermediate: int = 256, positions: int = 64, seed: int = 0) -> Path:
    """Random weights for `tokenizer`'s vocabulary, saved with it in `directory`."""
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=intermediate,
                         max_position_embeddings=positions, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    directory = Path(directory)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_example(out: Path, splits: dict[str, list[dict]], tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> None:
    """`out/data/<split>.jsonl` for each split and `out/checkpoint/`, and say so."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        (out / "data" / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    save_checkpoint(out / "checkpoint", tokenizer, seed=seed)
    counts = ", ".join(f"{len(rows)} {name}" for name, rows in splits.items())
    print(f"wrote {counts} prompts to {out / 'data'} and a Hugging Face checkpoint to {out / 'checkpoint'}")


def main(prepare: Callable[[Path], None], doc: str, here: Path) -> None:
    """An example's `prepare.py` command line: `--out DIR` (default: the example's own folder)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=here, help="where data/ and checkpoint/ go (default: here)")
    prepare(parser.parse_args().out)
