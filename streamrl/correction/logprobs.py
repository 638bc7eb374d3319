"""Token log-probabilities and entropy from logits, chunked over the sequence.

A full float32 log-softmax over [batch, time, vocab] costs 4·B·T·V bytes (16 × 1024 × 152k ≈ 10 GB).
Here at most `chunk` positions are expanded at a time; `logsumexp` and the gathered logit are all that
is kept. Gradients flow through each chunk, so memory in the backward pass is bounded the same way
(each chunk's softmax is recomputed from its logits slice, not stored as a [B, T, V] tensor).
"""

from __future__ import annotations

import torch


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(target) = logit[target] - logsumexp(logits), with a chunked backward.

    The backward needs softmax(logits) one chunk at a time: d/dlogits = onehot(target) - softmax.
    Autograd through a plain loop would keep every chunk's float32 softmax alive until backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, temperature: float) -> torch.Tensor:
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_targets = targets.reshape(-1)
        out = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device)
        for start in range(0, flat_logits.shape[0], chunk):
            rows = flat_logits[start:start + chunk].float() / temperature
            picked = rows.gather(1, flat_targets[start:start + chunk, None]).squeeze(1)
            out[start:start + chunk] = picked - torch.logsumexp(rows, dim=-1)
        ctx.save_for_backward(logits, targets)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets = ctx.saved_tensors
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_targets = targets.reshape(-1)
        flat_grad = grad_out.reshape(-1)
        grad = torch.empty_like(flat_logits)
        for start in range(0, flat_logits.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            rows = flat_logits[start:stop].float() / ctx.temperature
            g = flat_grad[start:stop, None].float() / ctx.temperature  # d(logit / T) / d logit = 1 / T
            block = -torch.softmax(rows, dim=-1) * g
            block.scatter_add_(1, flat_targets[start:stop, None], g)
            grad[start:stop] = block.to(grad.dtype)
        return grad.view_as(logits), None, None, None


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
