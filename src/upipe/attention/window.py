"""Sliding-window attention as kernel calls whose work is proportional to the window.

Legend: B batch, M query rows, N keys of a block, u query heads, k kv heads, d head dim,
w the window.

Query i sees key j iff 0 <= i - j < w (causal; j = i - w + 1 .. i, as transformers'
`sliding_window`). Positions are global: a block holds rows at positions q0 .. q0+M-1 and
keys at k0 .. k0+N-1. Row i's visible keys within the block are the interval

    lo(i) = max(k0, i - w + 1)  ..  hi(i) = min(k0 + N - 1, i)        (empty if lo > hi)

and lo, hi are piecewise linear in i with slope 0 or 1. `band_calls` cuts the rows into
tiles where both have one slope each (breakpoints i = k0 + w - 1 and i = k0 + N - 1; rows
with no key are left out) and, where both slopes are 1, tiles of at most w - 1 rows. A tile
of rows r0 .. r1-1 then is at most three ordinary kernel calls:
    upper  (hi slope 1): rows r0..r1-1, keys r0..r1-1, causal (the diagonal);
    lower  (lo slope 1): rows r0..r1-1, keys r0-w+1..r1-w: row i sees j >= i - w + 1, the
           upper triangle with its diagonal -- a causal call on both reversed (`FLIPPED`);
    core:  the keys between them, which every row of the tile sees (non-causal).
With tiles of w - 1 rows the upper and lower keys are disjoint and the core is empty, so
a diagonal block of S rows costs about S / (w - 1) * 2 calls and S * w scores: the band's
own area, not S^2 / 2. A one-row tile is one non-causal call over lo .. hi.

Partial results are merged by their log-sum-exp in fp32 (`merge_`), as ring attention
does; a row no call covers keeps out 0 and lse -inf (no contribution to a later merge).
Backward runs each call's kernel backward with the *final* out and lse rows (each call's
P = exp(scale q k^T - lse) is then that block of the full softmax) and adds its dq, dk,
dv in fp32.

The kernels that take a mask (`kernels.MASK_KERNELS`: torch's CPU flash kernel and the
float64 reference) run the band instead as one call per tile of T = `MASKED_ROWS` rows,
over the keys its rows see (r0 - w + 1 .. r1 - 1) with an additive mask (`band_mask`, one
per call of `forward` / `backward`, each tile a view of it): T (T + w - 1) scores a tile,
w + T - 1 per row, every row in exactly one call -- no merge, out written in q's dtype, dq
written, not summed. The CPU kernel skips no block of a masked call, and of a causal one
only whole 512-key blocks past a query block's last row (aten/src/ATen/native/cpu/
FlashAttentionKernel.cpp, `cpu_flash_attention`: kvSplitSize 512, qSplitSize 256 / 64 /
32 by the call's query length), so the tiled calls' two triangles of w - 1 = 1,023 rows
cost 1.5 w per row there (their 512-key blocks on the diagonal computed whole) where the
masked tiles cost (1 + 127 / w) w = 1.12 w, in one call per 128 rows instead of two calls
and two merges per 1,023. (The op refuses a boolean mask; the mask is fp32, fp64 for fp64
queries: `kernels.attention_forward`.)

torch's FlashAttention-2 kernel ("flash", fp16/bf16) has the window natively (flash_api.cpp
`mha_varlen_fwd` / `mha_varlen_bwd` `window_size_left` / `window_size_right`), reached
through the varlen form of the op (`_flash_attention_backward`'s dense form cannot be
called from Python: its cum_seq arguments are not optional), so a diagonal block is one
varlen call with window_size_left = w - 1, window_size_right = 0 (`varlen.WINDOWED`), and
the kernel skips the tiles outside the band itself. The kernel is resolved as for
documents, so `auto` takes it where it would take cuDNN (which has no window). Off-diagonal
blocks (a ring step's keys before its rows) and every other kernel (cpu, efficient,
cudnn, flash_attn, and fa3 / fa4, whose windowed contracts are not emulated yet) use the
tiled calls above.
"""

from __future__ import annotations

import torch

from upipe.attention import varlen
from upipe.kernels import (
    MASK_KERNELS,
    acc_dtype,
    attention_backward,
    attention_forward,
    prepare_kernel,
)

FULL, CAUSAL, FLIPPED = "full", "causal", "flipped"
MASKED_ROWS = 128  # rows of one masked call (module doc)


def check_window(window, causal) -> None:
    """A ValueError unless `window` is None or a positive int with causal attention."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window must be a positive int (token i sees keys i-window+1 .. i) or None, got "
            f"{window!r}"
        )
    if not causal:
        raise ValueError(f"window={window} needs causal=True (sliding windows look back only)")


def reaches(q0: int, M: int, k0: int, N: int, window) -> bool:
    """Whether a causal `window` lets any row at q0 .. q0+M-1 see a key at k0 .. k0+N-1
    (True without a window: the caller's mask decides)."""
    return window is None or (k0 <= q0 + M - 1 and q0 - (k0 + N - 1) < window)


def limits(q0: int, M: int, k0: int, N: int, window) -> bool:
    """Whether `window` excludes a key some row of the block would otherwise see."""
    return window is not None and (q0 + M - 1) - k0 >= window


def band_calls(q0: int, M: int, k0: int, N: int, w: int) -> list[tuple[slice, slice, str]]:
    """The kernel calls (row slice, key slice, kind) of the block (module doc), local to
    the block: kind FULL (every row sees every key), CAUSAL (equal lengths, the diagonal)
    or FLIPPED (equal lengths; row m sees key n iff n >= m)."""
    k1 = k0 + N  # keys k0 .. k1-1
    first, last = max(q0, k0), min(q0 + M, k1 + w - 1)  # rows that see a key
    if first >= last:
        return []
    cuts = sorted({first, last, *(c for c in (k0 + w - 1, k1 - 1) if first < c < last)})
    calls = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        lo_slides, hi_slides = a >= k0 + w - 1, a < k1 - 1
        step = max(1, w - 1) if lo_slides and hi_slides else b - a
        for r0 in range(a, b, step):
            r1 = min(b, r0 + step)
            rows = slice(r0 - q0, r1 - q0)
            if r1 - r0 == 1:  # one row: its keys lo .. hi at once
                lo, hi = max(k0, r0 - w + 1), min(k1 - 1, r0)
                calls.append((rows, slice(lo - k0, hi + 1 - k0), FULL))
                continue
            core_lo, core_hi = k0, k1 - 1
            if lo_slides:
                calls.append((rows, slice(r0 - w + 1 - k0, r1 - w + 1 - k0), FLIPPED))
                core_lo = r1 - w + 1
            if hi_slides:
                calls.append((rows, slice(r0 - k0, r1 - k0), CAUSAL))
                core_hi = r0 - 1
            if core_lo <= core_hi:
                calls.append((rows, slice(core_lo - k0, core_hi + 1 - k0), FULL))
    return calls


def masked_tiles(q0: int, M: int, k0: int, N: int, w: int, rows: int) -> list[tuple]:
    """The masked calls of the block (module doc): (row slice, key slice, the first key's
    column in `band_mask`), local to the block, for tiles of at most `rows` of the rows that
    see a key, each over the keys its rows see."""
    k1 = k0 + N
    first, last = max(q0, k0), min(q0 + M, k1 + w - 1)  # rows that see a key
    tiles = []
    for r0 in range(first, last, rows):
        r1 = min(last, r0 + rows)
        lo, hi = max(k0, r0 - w + 1), min(k1 - 1, r1 - 1)
        tiles.append((slice(r0 - q0, r1 - q0), slice(lo - k0, hi + 1 - k0), lo - (r0 - w + 1)))
    return tiles


def band_mask(rows: int, w: int, device, dtype=torch.float32) -> torch.Tensor:
    """`[rows, rows + w - 1]` of `dtype`: row r of a tile over keys from its first row's
    r0 - w + 1 on sees column c iff r <= c <= r + w - 1 (0), else -inf."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(rows + w - 1, device=device)[None, :]
    seen = (c >= r) & (c <= r + w - 1)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def _tile_mask(band, rows: slice, keys: slice, col: int) -> torch.Tensor:
    return band[: rows.stop - rows.start, col : col + keys.stop - keys.start]


def merge_(out_BMud, lse_BuM, part_BMud, part_lse_BuM) -> None:
    """In place: (out, lse) <- the softmax-weighted combination of (out, lse) and the part:
    lse' = logaddexp(lse, lse_p), out' = exp(lse - lse') out + exp(lse_p - lse') out_p
    (out and lse in fp32; a row with lse -inf on both sides stays out 0, lse -inf)."""
    new_BuM = torch.logaddexp(lse_BuM, part_lse_BuM)
    safe_BuM = torch.where(torch.isinf(new_BuM), 0.0, new_BuM)  # -inf - -inf would be nan
    w_old = torch.exp(lse_BuM - safe_BuM).transpose(1, 2).unsqueeze(-1)  # [B, M, u, 1]
    w_part = torch.exp(part_lse_BuM - safe_BuM).transpose(1, 2).unsqueeze(-1)
    out_BMud.mul_(w_old).add_(part_BMud * w_part)
    lse_BuM.copy_(new_BuM)


def block_forward(q, k, v, *, q0, k0, causal, window, softmax_scale, backend):
    """A block's (out, lse): the plain kernel call (`causal`: the diagonal block) where the
    window excludes no key of it, else `forward`. Callers skip blocks `reaches` rules out."""
    if limits(q0, q.shape[1], k0, k.shape[1], window):
        return forward(
            q, k, v, q0=q0, k0=k0, window=window, softmax_scale=softmax_scale, backend=backend
        )
    return attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend)


def block_backward(dout, q, k, v, out, lse, *, q0, k0, causal, window, softmax_scale, backend):
    """(dq, dk, dv) of `block_forward`."""
    kw = dict(softmax_scale=softmax_scale, backend=backend)
    if limits(q0, q.shape[1], k0, k.shape[1], window):
        return backward(dout, q, k, v, out, lse, q0=q0, k0=k0, window=window, **kw)
    return attention_backward(dout, q, k, v, out, lse, causal=causal, **kw)


def _flip(*ts):
    return tuple(t.flip(1) for t in ts)


def _kernel(q, backend, diagonal):
    """(the kernel, whether it runs the window natively): resolved as for documents, where
    auto prefers the varlen flash kernel (`upipe.attention.documents`)."""
    kernel = prepare_kernel(backend, q.device, q.dtype, q.shape[-1], documents=True)
    return kernel, diagonal and varlen.use_varlen(kernel, window=True)


def forward(q, k, v, *, q0, k0, window, softmax_scale, backend):
    """(out `[B, M, u, d]`, lse `[B, u, M]`) of rows at q0.. over keys at k0.. under the
    causal `window` (module doc); rows that see no key get out 0 and lse -inf."""
    M, N = q.shape[1], k.shape[1]
    kernel, native = _kernel(q, backend, q0 == k0 and M == N)
    if native:
        bounds = (0, M)
        return varlen.forward(
            q, k, v, bounds, causal=True, softmax_scale=softmax_scale, window=window
        )
    acc, (B, _, u, d) = acc_dtype(q.dtype), q.shape
    kw = dict(softmax_scale=softmax_scale, backend=kernel)
    lse_BuM = torch.full((B, u, M), float("-inf"), dtype=acc, device=q.device)
    if kernel in MASK_KERNELS:
        out_BMud = torch.zeros(B, M, u, d, dtype=q.dtype, device=q.device)
        band = band_mask(MASKED_ROWS, window, q.device, acc)
        for rows, keys, col in masked_tiles(q0, M, k0, N, window, MASKED_ROWS):
            mask = _tile_mask(band, rows, keys, col)
            out_BMud[:, rows], lse_BuM[:, :, rows] = attention_forward(
                q[:, rows], k[:, keys], v[:, keys], causal=False, mask=mask, **kw
            )
        return out_BMud, lse_BuM
    out_BMud = torch.zeros(B, M, u, d, dtype=acc, device=q.device)
    for rows, keys, kind in band_calls(q0, M, k0, N, window):
        qs, ks, vs = q[:, rows], k[:, keys], v[:, keys]
        if kind == FLIPPED:
            part, part_lse = attention_forward(*_flip(qs, ks, vs), causal=True, **kw)
            part, part_lse = part.flip(1), part_lse.flip(-1)
        else:
            part, part_lse = attention_forward(qs, ks, vs, causal=kind == CAUSAL, **kw)
        merge_(out_BMud[:, rows], lse_BuM[:, :, rows], part, part_lse)
        del part, part_lse
    return out_BMud.to(q.dtype), lse_BuM


def backward(dout, q, k, v, out, lse, *, q0, k0, window, softmax_scale, backend):
    """(dq, dk, dv) of `forward` from its (final) out and lse."""
    M, N = q.shape[1], k.shape[1]
    kernel, native = _kernel(q, backend, q0 == k0 and M == N)
    if native:
        return varlen.backward(
            dout, q, k, v, out, lse, (0, M), causal=True, softmax_scale=softmax_scale, window=window
        )
    acc = acc_dtype(q.dtype)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros_like(dk)
    kw = dict(softmax_scale=softmax_scale, backend=kernel)
    if kernel in MASK_KERNELS:  # (each row in one call: dq is written, not summed)
        dq = torch.zeros_like(q)
        band = band_mask(MASKED_ROWS, window, q.device, acc)
        for rows, keys, col in masked_tiles(q0, M, k0, N, window, MASKED_ROWS):
            mask = _tile_mask(band, rows, keys, col)
            args = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows])
            dq[:, rows], gk, gv = attention_backward(
                *args, lse[:, :, rows].contiguous(), causal=False, mask=mask, **kw
            )
            dk[:, keys] += gk
            dv[:, keys] += gv
            del gk, gv
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    for rows, keys, kind in band_calls(q0, M, k0, N, window):
        args = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows])
        lse_rows = lse[:, :, rows]
        if kind == FLIPPED:
            grads = attention_backward(
                *_flip(*args), lse_rows.flip(-1).contiguous(), causal=True, **kw
            )
            grads = _flip(*grads)
        else:
            grads = attention_backward(*args, lse_rows.contiguous(), causal=kind == CAUSAL, **kw)
        for acc_t, sl, g in zip((dq, dk, dv), (rows, keys, keys), grads, strict=True):
            acc_t[:, sl] += g
        del grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
