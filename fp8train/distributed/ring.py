"""One ring step's point-to-point transfers, and the compute side waiting for them.

Ring order: group rank r sends to r + 1 and receives from r - 1 (mod size), see
groups.ring_peers. Each step is one send and one receive, issued together through
`torch.distributed.batch_isend_irecv` (NCCL needs a rank's send and receive of one step
grouped, or a ring of blocking sends deadlocks).

CPU (gloo): the transfers run in gloo's threads while the host computes; `wait` blocks the
host until the step's transfers are done.

CUDA (NCCL): the transfers are issued from a side stream. ProcessGroupNCCL runs them on its
own stream, which waits for the stream current at issue time (the side stream, not the
compute stream), and `work.wait()` makes the side stream wait for them; an event recorded
on the side stream then marks the step done. The compute stream waits on that event only
where it reads the received bytes (`wait`), and the host never blocks. Allocator safety:
every tensor handed to a transfer is `record_stream`-ed on the side stream, so its memory
is not reused before the transfer finished even if Python drops it earlier.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .groups import ring_peers


class RingComm:
    """Sends `send` to the next rank and receives `recv` from the previous one, per step."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        self.group = group
        self.next, self.prev = ring_peers(group)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.side = torch.cuda.Stream(device)

    def start(self, send: torch.Tensor, recv: torch.Tensor, *, after_compute: bool = True):
        """Issue one step; returns a handle for `wait`.

        after_compute  (CUDA) the transfers start only after everything queued on the
                       compute stream so far (they read what it wrote). False where the
                       bytes sent were written by an earlier transfer: the side stream's
                       own order covers that, and the transfer need not wait for GEMMs.
        """
        ops = [dist.P2POp(dist.isend, send.view(torch.uint8), self.next, self.group),
               dist.P2POp(dist.irecv, recv.view(torch.uint8), self.prev, self.group)]
        if not self.cuda:
            return dist.batch_isend_irecv(ops)
        if after_compute:
            self.side.wait_stream(self.compute)
        with torch.cuda.stream(self.side):
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # the side stream waits for NCCL's stream; the host does not block
        send.record_stream(self.side)
        recv.record_stream(self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def wait(self, handle) -> None:
        """The compute side may read what the step `handle` received (and reuse what it sent)."""
        if self.cuda:
            self.compute.wait_event(handle)
        else:
            for work in handle:
                work.wait()

    def finish(self) -> None:
        """Everything issued is done before anything later on the compute stream runs."""
        if self.cuda:
            self.compute.wait_stream(self.side)
