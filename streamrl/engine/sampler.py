"""A batched KV-cache sampler over any Hugging Face causal LM, with in-flight weight updates.

```
 prompts ─left-pad─► prefill (logits of the last position only)
                        │
   ┌────────────────────▼─────────────────────────────────────┐
   │ sample token t from logits computed by weights version v │ stamp v on token t
   │ decode-step boundary: refresh() may load newer weights   │ (the KV cache is kept)
   │ forward token t ──► logits for t + 1                     │
   └──────────── until every row hit a stop token or max_new_tokens
```
The log-prob recorded for a token is that of the distribution it was actually drawn from (after
temperature and top-p), and its version is the version of the weights that computed its logits, so
the trainer's importance weights are exact even when the weights change mid-sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine.generation import Generation


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the sampling distribution: temperature, then the smallest top-p set (always ≥ 1 token)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logprobs
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)


class TorchSampler:
    def __init__(self, model: torch.nn.Module, *, pad_id: int, stop_ids: Sequence[int], max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0):
        if not stop_ids:
            raise ValueError("the sampler needs at least one stop token id")
        self.model = model
        self.pad_id = pad_id
        self._stop_ids = sorted(set(stop_ids))
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _generator(self, device: torch.device) -> torch.Generator:
        """One seeded generator per device the model has been on (CUDA sampling needs a CUDA generator)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    def _prefill_inputs(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every row's last token is at the same column
            ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], refresh: Callable[[], int] | int = 0, *,
                 samples_per_prompt: int = 1, greedy: bool = False) -> Generation:
        """Sample `samples_per_prompt` responses per prompt (rows ordered prompt by prompt).

        The prompts are prefilled once and their KV cache repeated for the samples. `refresh` is
        called at every decode-step boundary and returns the version of the weights now in the model
        (it may load newer ones first); an int means fixed weights. Finished rows are dropped from
        the batch as they accumulate, so long tails do not pay for short answers.
        """
        current = refresh if callable(refresh) else (lambda: refresh)
        ids, mask = self._prefill_inputs(prompts)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        version = current()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                         use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :]
        if samples_per_prompt > 1:
            cache.batch_repeat_interleave(samples_per_prompt)
            logits = logits.repeat_interleave(samples_per_prompt, dim=0)
            mask = mask.repeat_interleave(samples_per_prompt, dim=0)
            positions = positions.repeat_interleave(samples_per_prompt, dim=0)
        rows = logits.shape[0]
        next_position = positions[:, -1:] + 1

        device = ids.device
        generator, stop_ids = self._generator(device), torch.tensor(self._stop_ids, device=device)
        tokens = torch.full((rows, self.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, self.max_new_tokens), dtype=torch.float32, device=device)
        versions = torch.zeros((rows, self.max_new_tokens), dtype=torch.int32, device=device)
        lengths = torch.full((rows,), self.max_new_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        active = torch.arange(rows, device=device)  # the original row of each row still in the batch
        for step in range(self.max_new_tokens):
            if greedy:
                dist = torch.log_softmax(logits.float(), dim=-1)
                token = dist.argmax(dim=-1)
            else:
                dist = nucleus_logprobs(logits, self.temperature, self.top_p)
                token = torch.multinomial(dist.exp(), 1, generator=generator).squeeze(-1)
            tokens[active, step] = token
            logprobs[active, step] = dist.gather(-1, token[:, None]).squeeze(-1)
            versions[active, step] = version
            hit = torch.isin(token, stop_ids)
            if bool(hit.any()):
                lengths[active[hit]] = step + 1
                stopped[active[hit]] = True
                if bool(hit.all()):
                    break
                keep = (~hit).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, token, mask, next_position = active[keep], token[keep], mask[keep], next_position[keep]
            if step + 1 == self.max_new_tokens:
                break
            version = current()  # the decode-step boundary: newer weights may be loaded here
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype, device=device)], dim=1)
            out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                             cache=cache, use_cache=True)
            logits = out.logits[:, -1, :]
            next_position = next_position + 1
        return _flatten(tokens.cpu(), logprobs.cpu(), versions.cpu(), lengths.cpu(), stopped.cpu())


def _flatten(tokens: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor, lengths: torch.Tensor,
             stopped: torch.Tensor) -> Generation:
    keep = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).numpy()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths.numpy(), out=offsets[1:])
    return Generation(
        tokens=tokens.numpy()[keep].astype(np.int32),
        offsets=offsets,
        logprobs=logprobs.numpy()[keep],
        versions=versions.numpy()[keep],
        finish=np.where(stopped.numpy(), STOP, LENGTH).astype(np.int8),
    )
