"""The ring exchange of ring attention: every rank sends a block to the next rank and receives
the previous rank's; every function takes its process group explicitly.

Legend: C group size, r this rank's place in the group.

    ring_send_recv:  t [any shape] on rank r -> the tensor of rank (r - 1) mod C, same shape
                     and dtype; C successive shifts bring every rank's block past every rank.

Forward only: not differentiable (ring attention sends its gradients around the ring with
the same primitive, under another tag). One `batch_isend_irecv` per call (an isend to r+1,
an irecv from r-1), asynchronous: the caller computes on its current block meanwhile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingRecv:
    """A pending `ring_send_recv`: `wait()` blocks until both transfers are done and returns
    the received tensor. Holds the sent tensor until then (the transport reads it)."""

    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor):
        self._works, self._sent, self._received = works, sent, received

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], None
        return self._received


def ring_send_recv(t: torch.Tensor, group, *, tag: int = 0) -> RingRecv:
    """Send `t` to the next rank of `group` and receive the previous rank's tensor.

    Forward only (not differentiable). Layout: unchanged -- every rank passes a tensor of
    the same shape and dtype; after k successive shifts rank r holds the tensor that rank
    (r - k) mod C started with. Asynchronous: returns at once, with a `RingRecv` whose
    `wait()` gives the received tensor, so compute can overlap the transfer. `t` must not be
    modified until then. Concurrent exchanges (e.g. K/V blocks and their gradients) need
    distinct `tag`s (gloo matches messages by tag; NCCL keeps issue order). With C = 1 the
    rank receives its own `t`.
    """
    C = dist.get_world_size(group)
    if C == 1:
        return RingRecv([], t, t)
    r = dist.get_rank(group)
    sent = t.contiguous()
    received = torch.empty_like(sent)
    ops = [
        dist.P2POp(dist.isend, sent, dist.get_global_rank(group, (r + 1) % C), group, tag),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (r - 1) % C), group, tag),
    ]
    return RingRecv(dist.batch_isend_irecv(ops), sent, received)
