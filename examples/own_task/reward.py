"""The reward of the "shout" task: the share of the answer's letters that are right, position by
position (over the longer of answer and completion, so extra letters cost too)."""


def score(completion: str, row: dict) -> float:
    target, answer = row["answer"], completion.strip()
    right = sum(a == t for a, t in zip(answer, target))
    return right / max(len(target), len(answer), 1)
