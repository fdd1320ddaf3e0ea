"""Communication apart from the algorithms: each primitive says what it does forward and
backward and how it changes the layout. Every function takes its process group explicitly.

Legend: B batch, S full sequence, L = S / C local tokens, H heads (query or kv), a heads
this rank gets (H / C on an even split), d head dim, C group size.

- `layouts`: which tokens a rank holds ("contiguous" / "zigzag"; 2-D meshes) --
  `shard_sequence` [B, S, ...] -> [B, L, ...], `unshard_sequence` (the inverse, an
  all-gather), `sequence_positions`.
- `exchange`: the head exchange (Ulysses all-to-all), even and uneven head splits, sync and
  async -- `seq_to_head` [B, L, H, d] -> [B, S, a, d] and `head_to_seq` (the inverse; each is
  the other's backward), `HeadExchange` (a group and layout), `Pending` / `Done` /
  `Together` (results of asynchronous exchanges).
- `ring`: `ring_send_recv`, one step of ring attention's block rotation (r -> r+1).
"""

from upipe.comm.exchange import Done, HeadExchange, Pending, Together, head_to_seq, seq_to_head
from upipe.comm.layouts import (
    LAYOUTS,
    check_layout_name,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from upipe.comm.ring import RingRecv, ring_send_recv

__all__ = [
    "LAYOUTS",
    "Done",
    "HeadExchange",
    "Pending",
    "RingRecv",
    "Together",
    "check_layout_name",
    "head_to_seq",
    "ring_send_recv",
    "seq_to_head",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
