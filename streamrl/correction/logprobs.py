"""Token log-probabilities and entropy from logits, chunked over the sequence.

A full float32 log-softmax over [batch, time, vocab] costs 4·B·T·V bytes (16 × 1024 × 152k ≈ 10 GB).
Here at most `chunk` positions are expanded at a time; `logsumexp` and the gathered logit are all that
is kept. Gradients flow through each chunk, so memory in the backward pass is bounded the same way
(each chunk's softmax is recomputed from its logits slice, not stored as a [B, T, V] tensor).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(target) = logit[target] - logsumexp(logits), with a chunked backward.

    The backward needs softmax(logits) one chunk at a time: d/dlogits = onehot(target) - softmax.
    Autograd through a plain loop would keep every chunk's float32 softmax alive until backward. Chunks
    are views of the logits as given: the trainer's `logits[:, :-1]` is not contiguous, and flattening
    it (`reshape(-1, V)`) copied all of it, in the forward pass and again in the backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, temperature: float) -> torch.Tensor:
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        for rows_at in _blocks(targets.shape, chunk):
            rows = _scaled(logits[rows_at], temperature)
            picked = rows.gather(1, targets[rows_at][:, None]).squeeze(1)
            out[rows_at] = picked - torch.logsumexp(rows, dim=-1)
        ctx.save_for_backward(logits, targets)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for rows_at in _blocks(targets.shape, ctx.chunk):
            g = grad_out[rows_at][:, None].float() / ctx.temperature  # d(logit / T) / d logit = 1 / T
            block = torch.softmax(_scaled(logits[rows_at], ctx.temperature), dim=-1)
            block.mul_(-g)  # in place: each chunk's [rows, V] is allocated once
            block.scatter_add_(1, targets[rows_at][:, None], g)
            grad[rows_at] = block
        return grad, None, None, None


def _blocks(positions: torch.Size, chunk: int) -> Iterator[tuple]:
    """Index tuples that each select at most `chunk` consecutive positions along the last of `positions`
    (the logits' dimensions before the vocabulary): a [rows, V] view, never a copy."""
    *outer, inner = positions
    for prefix in itertools.product(*(range(n) for n in outer)):
        for start in range(0, inner, chunk):
            yield (*prefix, slice(start, start + chunk))


def _scaled(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """`rows / temperature` in float32, with no copy of float32 rows at temperature 1."""
    rows = rows.float()
    return rows if temperature == 1.0 else rows / temperature


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 1024, *,
                   temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[..., target] for logits [..., V] and integer targets [...], in
    float32. The division happens in float32, as the sampler's does: bf16 logits divided in bf16 are
    rounded again, which put up to 0.18 nats between the trainer's log-probs and the sampler's at T = 0.6."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if targets.dim() == 0:  # one position
        return token_logprobs(logits[None], targets[None], chunk, temperature=temperature)[0]
    return _ChunkedTokenLogprobs.apply(logits, targets.long(), chunk, float(temperature))


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) per position, [...], float32, chunked; for metrics (no grad)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk):
        rows = flat[start:start + chunk].float()
        logp = torch.log_softmax(rows, dim=-1)
        out[start:start + chunk] = -(logp.exp() * logp).sum(-1)
    return out.view(logits.shape[:-1])
