"""The Ulysses exchange in JAX: `lax.all_to_all` over a named mesh axis (inside `shard_map`).

Legend: B batch, S full sequence, L = S / C local tokens, n heads (query or kv), d head dim,
C size of the mesh axis. Device c of the axis holds tokens c*L .. (c+1)*L-1.

    seq_to_head:  x_BLnd [B, L, n, d] -> x_BSnd [B, S, n/C, d]
                  device c keeps heads c*n/C .. (c+1)*n/C-1, for all S tokens
    head_to_seq:  x_BSnd [B, S, n/C, d] -> x_BLnd [B, L, n, d]     (the inverse)

An all-to-all is a permutation of blocks, so each is the other's transpose: JAX
differentiates them into the inverse exchange, as `upipe.comm` does by hand.
"""

from __future__ import annotations

from jax import lax


def seq_to_head(x_BLnd, axis_name):
    return lax.all_to_all(x_BLnd, axis_name, split_axis=2, concat_axis=1, tiled=True)


def head_to_seq(x_BSnd, axis_name):
    return lax.all_to_all(x_BSnd, axis_name, split_axis=1, concat_axis=2, tiled=True)
