"""What an engine hands back for a batch of prompts: responses as flat buffers (numpy, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Generation:
    """Responses as flat buffers: row i is `tokens[offsets[i]:offsets[i + 1]]` (stop token included)."""

    tokens: np.ndarray  # int32
    offsets: np.ndarray  # int64, [N + 1]
    logprobs: np.ndarray  # float32, behaviour log-prob per token
    versions: np.ndarray  # int32, policy version per token
    finish: np.ndarray  # int8: STOP or LENGTH per row

    def response(self, row: int) -> np.ndarray:
        return self.tokens[self.offsets[row]:self.offsets[row + 1]]
