"""Pipeline parallelism for the megatron trainer: a one-forward-one-backward (1F1B) schedule over the
trainer's pipeline-parallel group, and the gradient sums pipeline stages need.

```
 stage 0:  F0 F1 F2 ·· B0 F3 B1 ·· B2 B3        warm-up: P − 1 − p forwards, then forward/backward in turn
 stage 1:     F0 F1 B0 F2 B1 F3 B2 ·· B3        (p = this stage, P = stages); at most P − p micro-batches'
 stage 2:        F0 B0 F1 B1 F2 B2 F3 B3         activations are held, whatever the micro-batch count
 forward: receive [w, n, hidden] from p − 1 ─► this stage's layers ─► send to p + 1 (last: the loss)
 backward: receive the output's gradient from p + 1 ─► backward ─► send the input's gradient to p − 1
```
Micro-batches vary in shape (rows × longest row, see `streamrl.trainer.step.micro_batches`),
but every rank of the trainer cuts the same ones from the same batch, so each stage knows the shape of
every tensor it receives and no shapes are exchanged. megatron-core's own schedules cannot run without
CUDA (they allocate their token counters on "cuda"); this one runs the same on gloo and NCCL, so the
CPU parity tests cover the code that runs on GPUs. Sends and receives of one exchange go out together
(`batch_isend_irecv`), in megatron-core's pairing, so neighbouring stages never wait on each other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state


@dataclass(frozen=True)
class PipelineGroup:
    """This rank's place in its pipeline: stage `rank` of `size`, the global ranks of its neighbours."""

    rank: int
    size: int
    previous: int
    next: int

    @classmethod
    def current(cls) -> PipelineGroup:
        return cls(rank=parallel_state.get_pipeline_model_parallel_rank(),
                   size=parallel_state.get_pipeline_model_parallel_world_size(),
                   previous=parallel_state.get_pipeline_model_parallel_prev_rank(),
                   next=parallel_state.get_pipeline_model_parallel_next_rank())

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


# forward(i, received) → this stage's output of micro-batch i: hidden states to send on, or (last stage)
# a scalar loss to start the backward pass from (or any tensor when forward only).
Forward = Callable[[int, torch.Tensor | None], torch.Tensor]


class Schedule:
    """Run micro-batches through this rank's stage; `shapes[i]` is the [w, n, hidden] activation of
    micro-batch i between stages."""

    def __init__(self, group: PipelineGroup, shapes: Sequence[tuple[int, ...]], *, device: torch.device,
                 dtype: torch.dtype):
        self.group, self.shapes, self.device, self.dtype = group, list(shapes), device, dtype

    def _exchange(self, send_next: torch.Tensor | None = None, send_previous: torch.Tensor | None = None,
                  receive_previous: int | None = None, receive_next: int | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One round of sends and receives with the neighbours; `receive_*` name the micro-batch whose
        activation (from the previous stage) or gradient (from the next) arrives. Returns them."""
        ops = []
        from_previous = from_next = None
        if send_previous is not None:
            ops.append(dist.P2POp(dist.isend, send_previous.contiguous(), self.group.previous))
        if receive_previous is not None:
            from_previous = torch.empty(self.shapes[receive_previous], device=self.device, dtype=self.dtype,
                                        requires_grad=True)
            ops.append(dist.P2POp(dist.irecv, from_previous, self.group.previous))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.group.next))
        if receive_next is not None:
            from_next = torch.empty(self.shapes[receive_next], device=self.device, dtype=self.dtype)
            ops.append(dist.P2POp(dist.irecv, from_next, self.group.next))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return from_previous, from_next

    def _receive_input(self, i: int) -> torch.Tensor | None:
        return None if self.group.first else self._exchange(receive_previous=i)[0]

    def forward_only(self, forward: Forward) -> list[torch.Tensor]:
        """Every micro-batch forward, no gradients; the last stage returns the outputs, the others []."""
        outputs = []
        with torch.no_grad():
            for i in range(len(self.shapes)):
                received = self._receive_input(i)
                output = forward(i, None if received is None else received.detach())
                if self.group.last:
                    outputs.append(output)
                else:
                    self._exchange(send_next=output)
        return outputs

    def forward_backward(self, forward: Forward) -> None:
        """Forward and backward of every micro-batch in 1F1B order; gradients accumulate in `.grad`."""
        count = len(self.shapes)
        warmup = min(self.group.size - self.group.rank - 1, count)
        held: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()  # (input, output) awaiting backward
        backward_index = 0

        def run_forward(i: int, received: torch.Tensor | None) -> torch.Tensor:
            output = forward(i, received)
            held.append((received, output))
            return output

        def run_backward(output_grad: torch.Tensor | None) -> torch.Tensor | None:
            nonlocal backward_index
            received, output = held.popleft()
            backward_index += 1
            torch.autograd.backward(output, grad_tensors=output_grad)  # the last stage's loss: None
            return None if received is None else received.grad

        for i in range(warmup):
            output = run_forward(i, self._receive_input(i))
            self._exchange(send_next=None if self.group.last else output)
        received = self._receive_input(warmup) if warmup < count else None
        for i in range(warmup, count):
            output = run_forward(i, received)
            if self.group.last:
                output_grad = None
            else:  # send this forward's output, take the oldest held one's gradient
                output_grad = self._exchange(send_next=output, receive_next=backward_index)[1]
            input_grad = run_backward(output_grad)
            more = i + 1 < count
            received = self._exchange(send_previous=input_grad,
                                      receive_previous=i + 1 if more and not self.group.first else None)[0]
        while held:  # cool-down: the warm-up's backward passes
            output_grad = None if self.group.last else self._exchange(receive_next=backward_index)[1]
            self._exchange(send_previous=run_backward(output_grad))


def sum_tied_embedding_grads(model: torch.nn.Module, *, tied: bool) -> None:
    """A tied embedding split over stages lives twice, as the first stage's embedding and the last
    stage's output layer: their gradients are summed over the embedding group (those two ranks) so
    both copies take the same step, as megatron-core's `finalize_model_grads` does."""
    if not tied or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    if parallel_state.is_pipeline_first_stage():
        weight = model.embedding.word_embeddings.weight
    else:
        weight = model.output_layer.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())
