"""Make this example's data and checkpoint: `python -m examples.own_task.prepare [--out DIR]`.

Task: "shout" — the user sends a lowercase word, the assistant answers it in capitals. Prompts are
chat messages (`task.chat_template = true` renders them with the tokenizer's template); the reward
module gets the decoded answer and the row, whose `answer` column holds the capitals.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from examples.checkpoint import char_tokenizer, main, write_example
from streamrl.models.hf import quiet_transformers

LETTERS = "abcdef"
HERE = Path(__file__).parent


def rows(words: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": word}], "answer": word.upper()} for word in words]


def prepare(out: Path, seed: int = 0) -> None:
    quiet_transformers()
    words = ["".join(w) for w in itertools.product(LETTERS, repeat=3)]
    random.Random(seed).shuffle(words)
    held_out, train = words[:24], words[24:]  # the held-out words are never trained on
    write_example(out, {"train": rows(train), "eval": rows(held_out)},
                  char_tokenizer(LETTERS + LETTERS.upper(), chat_template=True), seed)


if __name__ == "__main__":
    main(prepare, __doc__, HERE)
