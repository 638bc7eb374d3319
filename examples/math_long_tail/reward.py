"""The reward of the subtraction task, for a whole group in one call (`batched = True`): the answer
is the completion's leading digits; each is checked against the difference, position by position,
over the longer of the two (a missing or extra digit costs as much as a wrong one)."""

import re


def digits_right(completion: str, answer: str) -> float:
    given = re.match(r"\d*", completion.strip()).group()
    right = sum(a == b for a, b in zip(given, answer))
    return right / max(len(answer), len(given), 1)


def score(completions: list[str], row: dict) -> list[float]:
    return [digits_right(c, row["answer"]) for c in completions]


score.batched = True
