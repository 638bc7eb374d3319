"""Continuous batching over any Hugging Face causal LM, with exact behaviour log-probs and in-flight
weight updates.

```
 add(key, prompt, n) ─► waits for the next step
 step():
   join     the waiting prompts are prefilled together, once per group; each prompt's KV cache and
            next-token logits are repeated for its n samples, left-padded to the running batch's
            width and appended to it
   sample   every row draws its next token from the logits already computed for it (temperature,
            top-p) and is stamped with the version of the weights that computed those logits
   leave    rows that drew a stop token or reached max_new_tokens leave the batch (returned)
   decode   the other rows forward their new token with the weights now in use ─► next logits
 KV columns that only padding uses any more are dropped: the width follows the longest live row
```
The weights may change between steps (`weights.refresh()`, called by the producer): the KV cache is
kept, and each token's log-prob is that of the distribution it was actually drawn from, so the
trainer's importance weights are exact. Random draws are counter-based: a sequence's k-th token uses
a uniform that depends only on (seed, key, index, k), so a sequence gets the same tokens whether it
ran alone or joined a busy batch mid-way (up to float rounding at the edge of a token's interval).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from streamrl.buffer.schema import LENGTH, STOP
from streamrl.engine.base import Sample
from streamrl.engine.local_weights import LocalWeights

_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 arrays (numpy's uint64 arithmetic wraps, as it must)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seed: int, keys: np.ndarray, indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row, a function of (seed, key, index, position) alone."""
    with np.errstate(over="ignore"):
        x = _splitmix64(np.full(len(keys), seed, dtype=np.uint64))
        for part in (keys, indices, positions):
            x = _splitmix64(x ^ part.astype(np.uint64))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


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


def draw(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row; a token of probability 0 is never drawn."""
    cdf = logprobs.exp().double().cumsum(dim=-1)
    total = cdf[:, -1]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # a uniform rounded up to 1 stays inside
    target = torch.minimum(uniforms.to(cdf) * total, below_total).unsqueeze(-1)
    # A row whose distribution is not finite (NaN logits) finds no place in its cdf: a token in the vocabulary
    # all the same, whose NaN log-prob the engine refuses (an index past it fails in `gather`, on a GPU as a
    # device-side assert that poisons the process).
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


class _Row:
    __slots__ = ("key", "index", "tokens", "logprobs", "versions")

    def __init__(self, key: int, index: int):
        self.key, self.index = key, index
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []


class TorchEngine:
    def __init__(self, weights: LocalWeights, *, pad_id: int, stop_ids: Sequence[int], max_new_tokens: int,
                 capacity: int = 256, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                 greedy: bool = False):
        if not stop_ids:
            raise ValueError("the engine needs at least one stop token id")
        if max_new_tokens < 1 or capacity < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) and capacity ({capacity}) must be >= 1")
        check_plain_cache(weights.model.config)  # not at the first join into a running batch, mid-run
        self.weights = weights
        self.pad_id, self.max_new_tokens, self.capacity = pad_id, max_new_tokens, capacity
        self.temperature, self.top_p, self.seed, self.greedy = temperature, top_p, seed, greedy
        self._stop_ids = sorted(set(stop_ids))
        self._joins: list[tuple[int, list[int], int]] = []
        self._rows: list[_Row] = []  # the running batch, in cache order
        self._cache: DynamicCache | None = None
        self._mask = self._positions = self._logits = self._logit_versions = None
        self._tokens: torch.Tensor | None = None  # drawn by `_sample`, forwarded by `_decode`
        self._keyword_of: tuple[torch.nn.Module | None, str] = (None, "")  # (model, its cache keyword)
        self.last_step_s = 0.0
        self.generated_tokens = 0

    @property
    def model(self) -> torch.nn.Module:
        return self.weights.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def active(self) -> int:
        # Read by the producer's admit thread while the decode loop joins groups: `_joins` first. `_join`
        # extends `_rows` before it shrinks `_joins`, so this order may count a joining group twice for a
        # moment, never not at all (rows first undercounted it: the queue granted slots the engine lacked).
        joins = self._joins
        return len(self._rows) + sum(n for _, _, n in joins)

    def add(self, key: int, prompt: Sequence[int], n: int) -> None:
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.active + n > self.capacity:
            raise ValueError(f"engine full: {self.active} + {n} sequences > capacity {self.capacity}")
        if any(k == key for k, _, _ in self._joins) or any(r.key == key for r in self._rows):
            raise ValueError(f"group {key} is already running")
        self._joins.append((key, list(prompt), n))

    @torch.no_grad()
    def step(self) -> list[Sample]:
        started = time.perf_counter()
        if self._joins:
            self._join()
        if not self._rows:
            raise RuntimeError("step() with no active sequence")
        finished = self._sample()
        if self._rows:
            self._decode()
        self.last_step_s = time.perf_counter() - started
        return finished

    def cancel(self, key: int) -> None:
        self._joins = [j for j in self._joins if j[0] != key]
        keep = [i for i, row in enumerate(self._rows) if row.key != key]
        if len(keep) < len(self._rows):
            self._keep(keep)

    def abort(self) -> None:
        self._joins.clear()
        self._keep([])

    def lost(self) -> list[int]:
        return []

    def close(self) -> None:
        self.abort()

    # ---- the phases of a step ------------------------------------------------------------------------
    def _join(self) -> None:
        # `_joins` is cleared only after the rows are in the batch (see `active`)
        joins = list(self._joins)
        device, width = self.device, max(len(p) for _, p, _ in joins)
        ids = torch.full((len(joins), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(joins), width), dtype=torch.long)
        for i, (_, prompt, _) in enumerate(joins):  # left padding: every prompt ends in the last column
            ids[i, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(cache, input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        _check_filled(cache, width, self._keyword_of[1])
        # each prompt's state, once per sample: the prefix was computed once for the group
        repeat = torch.repeat_interleave(torch.arange(len(joins), device=device),
                                         torch.tensor([n for _, _, n in joins], device=device))
        cache.batch_select_indices(repeat)
        state = (cache, mask[repeat], positions[repeat, -1:] + 1, out.logits[repeat, -1, :],
                 torch.full((len(repeat),), self.weights.version, dtype=torch.int32, device=device))
        rows = [_Row(key, index) for key, _, n in joins for index in range(n)]
        if self._cache is None:
            self._cache, self._mask, self._positions, self._logits, self._logit_versions = state
        else:
            running = (self._cache, self._mask, self._positions, self._logits, self._logit_versions)
            self._cache, self._mask, self._positions, self._logits, self._logit_versions = _concat(running, state)
        self._rows = self._rows + rows
        self._joins = self._joins[len(joins):]

    def _sample(self) -> list[Sample]:
        logits = self._logits
        if self.greedy:
            dist = torch.log_softmax(logits.float(), dim=-1)
            tokens = dist.argmax(dim=-1)
        else:
            dist = nucleus_logprobs(logits, self.temperature, self.top_p)
            uniforms = counter_uniforms(self.seed, np.array([r.key for r in self._rows]),
                                        np.array([r.index for r in self._rows]),
                                        np.array([len(r.tokens) for r in self._rows]))
            tokens = draw(dist, torch.from_numpy(uniforms).to(dist.device))
        chosen = dist.gather(-1, tokens[:, None]).squeeze(-1)
        self.generated_tokens += len(self._rows)
        stop = torch.isin(tokens, torch.tensor(self._stop_ids, device=tokens.device))
        self._tokens = tokens
        finished, keep = [], []
        for i, (row, token, logprob, version, stopped) in enumerate(zip(
                self._rows, tokens.tolist(), chosen.tolist(), self._logit_versions.tolist(), stop.tolist())):
            if math.isnan(logprob):
                raise FloatingPointError(f"weights version {version} computed non-finite logits for sequence "
                                         f"{row.key}/{row.index} at token {len(row.tokens)}: the policy diverged")
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            if stopped or len(row.tokens) >= self.max_new_tokens:
                finished.append(Sample(row.key, row.index, np.asarray(row.tokens, np.int32),
                                       np.asarray(row.logprobs, np.float32), np.asarray(row.versions, np.int32),
                                       STOP if stopped else LENGTH))
            else:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._keep(keep)
        return finished

    def _decode(self) -> None:
        ones = torch.ones((len(self._rows), 1), dtype=self._mask.dtype, device=self._mask.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        out = self._forward(self._cache, input_ids=self._tokens[:, None], attention_mask=self._mask,
                            position_ids=self._positions)
        self._logits = out.logits[:, -1, :]
        self._logit_versions.fill_(self.weights.version)
        self._positions = self._positions + 1
        self._tokens = None
        self._trim()

    def _forward(self, cache: DynamicCache, **inputs: torch.Tensor | int):
        # the keyword is looked up once per model, not per step; `refresh` may swap in another model (the
        # double-buffered receiver alternates two), so the lookup is redone when the model changes
        model = self.model
        if self._keyword_of[0] is not model:
            self._keyword_of = (model, cache_keyword(model))
        return model(**inputs, **{self._keyword_of[1]: cache}, use_cache=True)

    # ---- the batch's tensors -------------------------------------------------------------------------
    def _keep(self, rows: list[int]) -> None:
        """Only `rows` (batch indices) stay in the batch."""
        if not rows:
            self._rows, self._cache = [], None
            self._mask = self._positions = self._logits = self._logit_versions = self._tokens = None
            return
        index = torch.tensor(rows, device=self._mask.device)
        self._rows = [self._rows[i] for i in rows]
        self._cache.batch_select_indices(index)
        self._mask, self._positions = self._mask[index], self._positions[index]
        self._logits, self._logit_versions = self._logits[index], self._logit_versions[index]
        if self._tokens is not None:
            self._tokens = self._tokens[index]
        self._trim()

    def _trim(self) -> None:
        """Drop leading columns that no live row uses (left padding of rows that have left)."""
        used = self._mask.any(dim=0)
        lead = int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
        if lead:
            self._mask = self._mask[:, lead:]
            for layer in _layers(self._cache):
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model.forward` takes its KV cache by: `cache` from transformers 5.24 on, `past_key_values`
    before (5.24 renamed it; `past_key_values` is deprecated there, to be removed in 5.40).

    Each release's models declare one name and take the other into **kwargs unused, so it must be the
    declared one. `inspect.signature` follows the `functools.wraps` chain of the forward's decorators
    (`deprecate_kwarg`, `can_return_tuple`, ...) to the declared parameters. A forward that declares
    neither (a wrapper passing **kwargs on) gets `past_key_values`, which 5.0 to 5.39 all take (5.24 on
    renamed by `deprecate_kwarg`); `_check_filled` catches a forward that drops it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _check_filled(cache: DynamicCache, width: int, keyword: str) -> None:
    """The prefill wrote its `width` positions into our cache, or decoding would silently run without context.

    A forward that takes the cache under another name than `keyword` puts it into its **kwargs and ignores
    it. A shape read, once per join: nothing per decode step."""
    filled = cache.get_seq_length()
    if filled != width:
        raise RuntimeError(
            f"the model did not fill the KV cache passed as `{keyword}=` ({filled} of {width} prompt positions; "
            f"transformers {transformers.__version__}): the engine passes it as `cache=` to a forward that "
            "declares `cache` (transformers >= 5.24), else as `past_key_values=` (earlier 5.x); a custom "
            "model's forward must take it under one of these names and fill it")


def check_plain_cache(config: Any) -> None:
    """Refuse a model whose KV cache the engine cannot cut and join (rows join and leave a running
    batch): one with sliding-window layers (Mistral, Gemma 2/3, Qwen2 with use_sliding_window)."""
    _layers(DynamicCache(config=config))


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = cache.layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(f"continuous batching needs a plain KV cache; this model's has {kinds} layers "
                         "(sliding-window attention is not supported by the torch engine)")
    return layers


def _concat(a: tuple, b: tuple) -> tuple:
    """Two batches' (cache, mask, positions, logits, versions) as one, left-padded to a common width."""
    cache_a, mask_a, *rest_a = a
    cache_b, mask_b, *rest_b = b
    width = max(mask_a.shape[1], mask_b.shape[1])
    pad_a, pad_b = width - mask_a.shape[1], width - mask_b.shape[1]
    for layer_a, layer_b in zip(_layers(cache_a), _layers(cache_b)):
        layer_a.keys = torch.cat([F.pad(layer_a.keys, (0, 0, pad_a, 0)), F.pad(layer_b.keys, (0, 0, pad_b, 0))])
        layer_a.values = torch.cat([F.pad(layer_a.values, (0, 0, pad_a, 0)),
                                    F.pad(layer_b.values, (0, 0, pad_b, 0))])
    mask = torch.cat([F.pad(mask_a, (pad_a, 0)), F.pad(mask_b, (pad_b, 0))])
    return (cache_a, mask, *(torch.cat([x, y]) for x, y in zip(rest_a, rest_b)))
