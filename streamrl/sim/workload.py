"""The simulated workload: a calibrated timing model of an inference engine and a trainer.

```
 producer (continuous batching, up to `sequences_per_producer` at once)
   a group joins:  prefill `prompt_tokens` once (shared prefix), then G sequences decode
   decode step:    decode_base_s + decode_per_seq_s · active  → one token for every active sequence
   lengths:        lognormal, median `median_tokens`, 99th percentile `p99_ratio` × median, ≤ max_tokens
 trainer:  train_s_per_token · response tokens per step (default: calibrated so that training alone
           runs at the rate generation alone does), then the real weight publish of `weights_mb`
```
All times are model seconds; `time_scale` real seconds pass per model second, so a run is short
while the orchestration (Ray calls, Arrow batches, the queue, weight transfers) runs at real speed.
`SimSection` is the run config's `[sim]` section (the timing model); `SimWorkload` adds what the rest
of the config says (producers, G, B), which the calibration needs.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Z_99 = 2.3263478740408408  # standard normal 99th percentile


class SimSection(BaseModel):
    """The simulated engine and trainer (`producers.engine = trainer.backend = task.kind = "sim"`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    sequences_per_producer: int = Field(32, ge=1)
    """Continuous-batching slots of one engine."""
    prompt_tokens: int = Field(128, ge=1)
    median_tokens: float = Field(256, gt=0)
    p99_ratio: float = Field(8.0, ge=1)
    """Tail heaviness: the 99th percentile of response length over the median (1 = every response
    the same length)."""
    max_tokens: int = Field(4096, ge=1)
    decode_base_s: float = Field(0.016, ge=0)
    decode_per_seq_s: float = Field(0.000125, ge=0)
    prefill_per_token_s: float = Field(0.00005, ge=0)
    train_s_per_token: float | None = Field(None, ge=0)
    """None: calibrated to generation alone (`calibrated_train_s_per_token`)."""
    weights_mb: float = Field(32, gt=0)
    time_scale: float = Field(0.1, gt=0)
    vocab_size: int = Field(1024, ge=2)

    @property
    def sigma(self) -> float:
        return math.log(self.p99_ratio) / Z_99

    def sample_lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        lengths = np.rint(self.median_tokens * np.exp(self.sigma * rng.standard_normal(n)))
        return np.clip(lengths, 1, self.max_tokens).astype(np.int64)

    def mean_length(self) -> float:
        """E[min(X, cap)] of the lognormal, in closed form (rounding ignored)."""
        mu, s, cap = math.log(self.median_tokens), self.sigma, self.max_tokens
        if s == 0:
            return min(self.median_tokens, cap)
        phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
        z = (math.log(cap) - mu) / s
        return math.exp(mu + s * s / 2) * phi(z - s) + cap * (1 - phi(z))

    def decode_step_s(self, active: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * active


class SimWorkload(SimSection):
    """The timing model with the run's layout: producers, samples per group, groups per step."""

    producers: int = Field(4, ge=1)
    group_size: int = Field(4, ge=1)
    groups_per_step: int = Field(32, ge=1)

    def generation_tokens_per_s(self, groups: int = 4000, seed: int = 0) -> float:
        """Model-time tokens/s of every engine driven as the producer drives `SimEngine`: a group joins
        when G slots are free (its prompt prefilled once, charged to the next step), a sequence leaves when
        it ends. Slots wait for a whole group's worth to free up, so an engine is not always full: taking it
        as full overstated the rate by ~4% on the pinned workload. Measured over `groups` groups drawn from
        the length distribution, up to the last one's admission (the steady state, not the drain)."""
        rng = np.random.default_rng(seed)
        slots, size = self.sequences_per_producer, self.group_size
        lengths = iter(self.sample_lengths(rng, groups * size).tolist())
        prefill = self.prompt_tokens * self.prefill_per_token_s
        ends: list[int] = []  # the decode step each running sequence ends at
        step, seconds, tokens, admitted = 0, 0.0, 0, 0
        while True:
            owed = 0.0
            while slots - len(ends) >= size and admitted < groups:
                for _ in range(size):
                    heapq.heappush(ends, step + int(next(lengths)))
                owed, admitted = owed + prefill, admitted + 1
            if admitted == groups:
                return self.producers * tokens / seconds
            ahead = ends[0] - step  # decode steps until the next sequence ends: the batch is constant until then
            seconds += owed + ahead * self.decode_step_s(len(ends))
            tokens, step = tokens + ahead * len(ends), ends[0]
            while ends and ends[0] <= step:
                heapq.heappop(ends)

    def calibrated_train_s_per_token(self) -> float:
        if self.train_s_per_token is not None:
            return self.train_s_per_token
        return 1.0 / self.generation_tokens_per_s()

    def schedule_rates(self, batches: int = 400, seed: int = 0) -> dict[str, float]:
        """Model-time trained tokens/s of each schedule without any overhead (the model's own ideal): a
        synchronous step generates a batch, its engines busy until the batch's longest response, then
        trains on it; one-step overlaps the two (the slower of them); streaming runs at the slower of
        generation and training alone. Averaged over `batches` batches drawn from the length distribution."""
        rng = np.random.default_rng(seed)
        per_engine = self.groups_per_step * self.group_size // self.producers
        prefill = self.prompt_tokens * self.prefill_per_token_s * per_engine / self.group_size
        sync = one_step = 0.0
        tokens = 0
        train_s_per_token = self.calibrated_train_s_per_token()
        for _ in range(batches):
            generate, batch_tokens = 0.0, 0
            for _engine in range(self.producers):
                lengths = self.sample_lengths(rng, per_engine)
                batch_tokens += int(lengths.sum())
                active = (lengths[None, :] >= np.arange(1, lengths.max() + 1)[:, None]).sum(axis=1)
                generate = max(generate, prefill + float(np.sum(self.decode_step_s(active))))
            train = batch_tokens * train_s_per_token
            sync, one_step, tokens = sync + generate + train, one_step + max(generate, train), tokens + batch_tokens
        streaming = min(self.generation_tokens_per_s(), 1.0 / train_s_per_token)
        return {"sync": tokens / sync, "one_step": tokens / one_step, "async": streaming}
