"""Per-rank peak memory of one attention layer's forward+backward, in closed form (and the
activations a mixture-of-experts MLP saves, `moe_saved_bytes_per_token`).

Unit: one `[B, L, H*d]` tensor in the input dtype (E bytes/element) -- `[B, L, D]` when
D = H*d. The region is the layer's forward and backward as a training step runs it: x, dy
and the parameters exist before it (not counted); the output y is held by the caller
through backward (counted); parameter gradients, cos/sin and every buffer are counted.
Symbols: r = G/H, s = U/H (one stage's share of the heads), k kv heads per rank per round,
kv = C*k/H (one round's kv buffer over all S tokens), n_s stages per round,
w = D/(B*L) (one [H*d, D] weight matrix), c = 2/H (cos and sin), lse = 4/(E*d) (all log-sum-
exps, fp32), y = D/(H*d), a = 4/E (an fp32 accumulator; 1 for fp32 inputs).

Ulysses (peak: right after the kernel backward, all in head layout at once):
    y + dout (1) + saved q, out (2) + saved k, v (2r) + lse + dout_h (1) + dq (1)
      + dk, dv (2r) + dW_o (w) + c                        =  y + 5 + 4r + lse + w + c
UPipe, fused module (peak: at a stage's kernel backward):
    y + [outputs still to use + projection gradients waiting, or dx] + kv buffers (2 kv)
      + dk/dv accumulators (2 kv, once a round has more than one stage) + q, out, dout, dq
      of the stage (4s) + the kernel's dk, dv (2 kv) + weight gradients (2w + 2wr) + c
      + remaining lse
The bracket is what `fused._DxAccumulator` keeps at about 1 unit (y + 1 is the floor: the
layer's output and the saved attention output, or dx, cannot go away); everything else
scales with s = U/H or with kv = C*k/H, so it shrinks as the stage gets smaller.
`upipe_peak_units` walks the stage schedule to evaluate the bracket exactly.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    B: int
    """Batch."""
    L: int
    """Local tokens per rank."""
    D: int
    """Model width."""
    H: int
    """Query heads."""
    G: int
    """Key/value heads."""
    d: int
    """Head dim."""
    C: int
    """Context-parallel group size."""
    elem_bytes: int = 4
    """Bytes per element of the inputs (4 fp32, 2 bf16)."""

    @property
    def unit_bytes(self) -> int:
        """Bytes of one [B, L, H*d] tensor."""
        return self.B * self.L * self.H * self.d * self.elem_bytes


def _common(sh: LayerShape):
    w = sh.D / (sh.B * sh.L)
    return {
        "y": sh.D / (sh.H * sh.d),
        "r": sh.G / sh.H,
        "w": w,
        "c": 2 / sh.H,
        "lse": 4 / (sh.elem_bytes * sh.d),
        "a": 4 / sh.elem_bytes,
    }


def ulysses_peak_units(sh: LayerShape) -> float:
    """Peak of the Ulysses module (projections, RoPE, `ulysses_attention`, o_proj)."""
    m = _common(sh)
    return m["y"] + 5 + 4 * m["r"] + m["lse"] + m["w"] + m["c"]


def upipe_peak_units(sh: LayerShape, U: int) -> float:
    """Peak of the fused UPipe module with `U` heads per stage (see the module doc)."""
    m = _common(sh)
    H, C, a = sh.H, sh.C, m["a"]
    Gv = max(sh.G, C)
    gv, u = H // Gv, U // C
    k, up = max(1, u // gv), min(u, gv)
    n_s, n_r = gv // up, Gv // (C * k)
    s, kv = U / H, C * k / H
    fixed = m["y"] + 2 * m["w"] + 2 * m["w"] * a * m["r"] + m["c"]
    # round kv buffers + at the kernel: stage q/out/dout/dq and dk/dv; or while dout is sent:
    # q, out (head layout), dout (sequence layout) and its send and receive buffers
    stage = 2 * kv + max(4 * s + 2 * kv, 5 * s)
    peak, waiting, dx, done = 0.0, 0.0, 0.0, 0
    for _ in range(n_r):
        for j in range(n_s):
            done += 1
            out_left = 1 - done * s  # this stage's output is freed once sent
            acc = 2 * kv * a if j > 0 else 0.0
            lse_left = m["lse"] * (1 - (done - 1) * s)
            peak = max(peak, fixed + out_left + waiting + dx + acc + stage + lse_left)
            if dx:
                continue  # dq folded into dx at once
            waiting += s
        if not dx:
            waiting += 2 * kv  # the round's dk, dv in the sequence layout
            if waiting >= a:  # dx (fp32) is built at the end of the round
                dx, waiting = a, 0.0
    return peak


def moe_saved_bytes_per_token(
    *,
    D: int,
    E: int,
    K: int,
    F: int,
    F_shared: int = 0,
    elem_bytes: int = 4,
    router_weights="softmax_renorm",
) -> int:
    """Bytes one token leaves saved for backward in a mixture-of-experts MLP
    (`upipe.model.moe.MoE` inside a model call: its input and output not counted), e the
    activations' element bytes, K experts per token of width F, E experts, a shared expert
    of width F_s:

        4 E            the router's probabilities (fp32; softmax's output, the balance sum)
      + 32 K           int64 indices: the top-k, the sort order, its token and row maps
      + r              top-k weights: 4 K + 4 renormalised (w and its sum), 4 K topk_softmax
                       (its softmax's output), 0 for plain softmax
      + e K            the weights in sorted order, cast to e (4 K if e = 4: no cast)
      + e K D          the gathered tokens (gate_up's input)
      + 5 e K F        gate_up's output (2), silu(gate), silu * up, times w (down's input)
      + 4 e F_s        the shared expert: gate, up, silu(gate), its product
      + 4              the balance mask (fp32)

    plus 8 E bytes per call (the segment ends). Qwen3-30B-A3B in bf16 (D 2048, E 128, K 8,
    F 768): 92.8 KiB per token, 23x its [D] activation; a dense SwiGLU of the same active
    width would keep 4 e K F = 48 KiB. Checked against the tracker by
    `tests/distributed/test_moe.py`; the tiled MLP keeps none of it beyond one tile."""
    e = elem_bytes
    r = {"softmax": 0, "softmax_renorm": 4 * K + 4, "topk_softmax": 4 * K}[router_weights]
    return 4 * E + 32 * K + r + e * K + e * K * D + 5 * e * K * F + 4 * e * F_shared + 4
