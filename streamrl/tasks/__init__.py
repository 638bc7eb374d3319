"""Tasks: a prompt source and a verifiable reward, behind one small interface.

Prompt ids come from the replay queue's cursor (0, 1, 2, ...); a task maps each id to prompt tokens
deterministically, so a prompt generated again after an abandoned group is the same prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from streamrl.config import TaskSection
    from streamrl.sim.workload import SimWorkload


class Task(Protocol):
    name: str
    stop_token_ids: Sequence[int]

    def prompt(self, prompt_id: int) -> list[int]:
        """Prompt tokens for a training prompt id."""

    def reward(self, prompt_id: int, response_ids: Sequence[int]) -> float:
        """Reward of one response to training prompt `prompt_id` (the tokens generated after the prompt)."""

    def eval_prompts(self, limit: int | None = None) -> list[list[int]]:
        """The held-out prompts, never used for training."""

    def eval_reward(self, index: int, response_ids: Sequence[int]) -> float:
        """Reward of a response to held-out prompt `index`; 1.0 means exactly right."""

    def max_new_tokens(self) -> int:
        """Default generation limit."""


def group_rewards(task: Task, prompt_id: int, responses: Sequence[Sequence[int]]) -> list[float]:
    """The rewards of one prompt's responses: in one call where the task scores groups (`rewards`, a
    file task with a batched reward function), else one `reward` each."""
    rewards = getattr(task, "rewards", None)
    if rewards is not None:
        return list(rewards(prompt_id, responses))
    return [task.reward(prompt_id, response) for response in responses]


def make_task(section: TaskSection, tokenizer: PreTrainedTokenizerBase | None = None, *, seed: int = 0,
              search_path: str | None = None, max_prompt_tokens: int | None = None,
              sim: SimWorkload | None = None) -> Task:
    """The task a config names. File tasks tokenize with the model's tokenizer; with `max_prompt_tokens`
    they tokenize every prompt at once and refuse one that is longer. The sim task needs the workload."""
    if section.kind == "reverse":
        from streamrl.tasks.reverse import ReverseDigits

        return ReverseDigits(section.digits, seed=seed)
    if section.kind == "long_tail":
        from streamrl.tasks.long_tail import ReverseLongTail

        return ReverseLongTail(section.digits, section.max_digits, section.tail, seed=seed)
    if section.kind == "file":
        from streamrl.tasks.files import FileTask

        if tokenizer is None:
            raise ValueError("a file task needs the model's tokenizer")
        return FileTask(section, tokenizer, search_path=search_path, max_prompt_tokens=max_prompt_tokens)
    if section.kind == "sim":
        from streamrl.tasks.sim import SimTask

        if sim is None:
            raise ValueError("the sim task needs the simulated workload")
        return SimTask(sim)
    raise ValueError(f"unknown task kind {section.kind!r}")


__all__ = ["Task", "group_rewards", "make_task"]
