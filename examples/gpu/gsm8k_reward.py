"""GSM8K's verifiable reward: 1 when the completion's final number equals the reference answer (the
number after `####` in the data set's `answer` column), else 0."""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number after the last `####` if there is one, else the last number in the text."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def score(completion: str, row: dict) -> float:
    expected = final_number(row["answer"])
    given = final_number(completion)
    if expected is None or given is None:
        return 0.0
    try:
        return float(float(given) == float(expected))
    except ValueError:
        return 0.0
