"""CPU emulation of torch's FA3 / FA4 flash impls: stand-in packages, and the contract of
the aten flash ops while an impl is active.

`torch.nn.attention.activate_flash_attention_impl("FA3" | "FA4")` (torch 2.13,
torch/nn/attention/_registry.py) imports the impl's package and registers Python kernels on
the CUDA key of four aten ops -- `_scaled_dot_product_flash_attention(_backward)` and the
varlen `_flash_attention_forward/_backward` (`_fa3.py` / `_fa4.py` `_fa*_register_kernels`).
On CPU that registration is inert, so this module:

- `install_packages()`: stand-ins that let the real activation run here: a module
  `flash_attn_interface` plus the ops `torch.ops.flash_attn_3.fwd/bwd` that `_fa3_import_module`
  checks for (never called on CPU), and FlashAttention-4's `flash_attn.cute.interface` with
  `_flash_attn_fwd` / `_flash_attn_bwd`, `flash_attn` being a namespace package as flash-attn-4
  leaves it (a spec with no origin);
- `install()`: tells `cuda_emulation` / `varlen_emulation` (whose CPU kernels serve those four
  ops) what the ops do while an impl is active: torch's wrappers, minus the CUDA-device and
  compute-capability checks (the emulated GPU is an sm90/sm100 one), in front of the
  impl's kernel contract:

  FA3 (`_fa3.py`: `_fa3_forward_support_error`, `_fa3_backward_support_error`; FlashAttention-3
  hopper/flash_api.cpp `mha_fwd`, `mha_bwd`): fp16/bf16 (fp8 forward only) alike, no dropout,
  no debug mask; dense 4-D / "ragged query must be 3D"; head dim <= 256 and a multiple of 8;
  kv heads divide query heads; lse fp32 `[B, H, M]` dense, `[H, T]` varlen, read back in
  that contiguous layout; the SDPA backward ignores cum_seq_q (it passes None on).
  FA4 (`_fa4.py`: `_fa4_common_support_error`, `_fa4_forward_support_error`; flash-attention
  flash_attn/cute/interface.py `_flash_attn_fwd` asserts): query fp16/bf16 and k/v alike,
  "head_dim must be less than or equal to 256", "head_dim must be divisible by 8", "num_head
  must be divisible by num_head_kv", int32 contiguous cu_seqlens of shape (batch + 1,),
  lse_shape `(batch, num_head, seqlen_q)` / `(num_head, total_q)`, lse fp32 for the backward.

  Both: causal aligned bottom-right (FlashAttention's convention; the diagonal for equal
  lengths), outputs as torch's wrappers allocate them (SDPA out `empty_like(query)`, dq/dk/dv
  `[B, S, heads, d]` memory), rng state uint64 `[2]` zeros, philox offset uint64 `[]`.
  Numbers are fp32 math on the full score matrix.

`restore()` puts torch's FA2 back (`_registry.restore_flash_attention_impl`) and clears
upipe's caches: activation is process-wide, so every test or worker that activates an impl
restores it when done.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.machinery
import sys
import types

import cuda_emulation
import torch
from cuda_emulation import _HALF, _backward_math, _check, _forward_math, _scale

from upipe import kernels_select

CALLS = collections.Counter()  # (impl, op) -> calls in this process
_FA3_LIB: torch.library.Library | None = None


# --- the math on dense [B, L, h, d] or packed [T, h, d] -------------------------------------


def _spans(q, k, cu_q, cu_k):
    """[(q rows, k rows)] per sequence: dense -> one batch row each; varlen -> cu spans."""
    if cu_q is None:
        return [((b, slice(None)), (b, slice(None))) for b in range(q.shape[0])]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [
        ((slice(a, b),), (slice(c, e),)) for a, b, c, e in zip(cq, cq[1:], ck, ck[1:], strict=False)
    ]


def _heads_first(t):  # [len, h, d] -> [1, h, len, d]
    return t.transpose(0, 1).unsqueeze(0)


def _attend(q, k, v, cu_q, cu_k, scale, causal):
    """(out like q, lse fp32 [B, H, M] dense / [H, T] varlen)."""
    out = torch.empty_like(q)
    dense = cu_q is None
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]) if dense else (q.shape[1], q.shape[0]))
    for qi, ki in _spans(q, k, cu_q, cu_k):
        o, l_ = _forward_math(
            *(_heads_first(t[i]) for t, i in ((q, qi), (k, ki), (v, ki))), scale, causal, True
        )
        out[qi] = o[0].transpose(0, 1).to(q.dtype)
        if dense:
            lse[qi[0]] = l_[0]
        else:
            lse[:, qi[0]] = l_[0]
    return out, lse


def _attend_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal):
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    for qi, ki in _spans(q, k, cu_q, cu_k):
        lse_i = lse[qi[0]][None] if cu_q is None else lse[None, :, qi[0]]
        ts = (dout[qi], q[qi], k[ki], v[ki], out[qi])
        grads = _backward_math(
            *(_heads_first(t) for t in ts[:4]), _heads_first(ts[4]), lse_i, scale, causal, True
        )
        for buf, g, i in zip((dq, dk, dv), grads, (qi, ki, ki), strict=True):
            buf[i] = g[0].transpose(0, 1).to(buf.dtype)
    return dq, dk, dv


def _kernel_checks(q, k, v, cu_q, cu_k, what):
    """The FlashAttention-3 / -4 kernels' own rules (module doc)."""
    _check(q.dtype in _HALF, f"{what}: inputs must be float16 or bfloat16")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, f"{what}: inputs must have the same dtype")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, f"{what}: Input tensor must have contiguous last dimension")
    d, H, G = q.shape[-1], q.shape[-2], k.shape[-2]
    _check(d <= 256, f"{what}: head_dim must be less than or equal to 256")
    _check(d % 8 == 0, f"{what}: head_dim must be divisible by 8")
    _check(H % G == 0, f"{what}: num_head must be divisible by num_head_kv")
    if cu_q is not None:
        for cu in (cu_q, cu_k):
            _check(cu is not None and cu.dtype == torch.int32, f"{what}: cu_seqlens must be int32")
            _check(cu.is_contiguous() and cu.dim() == 1, f"{what}: cu_seqlens must be contiguous")
        _check(cu_k.numel() == cu_q.numel(), f"{what}: cu_seqlens_k must have shape (batch + 1,)")
        _check(cu_q[-1].item() == q.shape[0], f"{what}: cu_seqlens_q must end at total_q")


def _check_lse(lse, q, cu_q, what):
    want = (q.shape[0], q.shape[2], q.shape[1]) if cu_q is None else (q.shape[1], q.shape[0])
    _check(lse.dtype == torch.float32, f"{what}: logsumexp dtype must be float32")
    _check(
        tuple(lse.shape) == want and lse.is_contiguous(),
        f"{what}: the kernel reads lse as contiguous fp32 {list(want)} (unchecked on CUDA); got "
        f"{list(lse.shape)} strides {list(lse.stride())}",
    )


# --- torch's wrappers (torch/nn/attention/_fa3.py, _fa4.py), minus the CUDA checks ---------


def _support(impl, query, dropout_p, return_debug_mask, cum_seq_q, backward=False):
    """`_fa3_*_support_error` / `_fa4_*_support_error` (the device checks left out)."""
    where = f"{impl} {'SDPA' if cum_seq_q is None else 'flash_attention'} "
    where += "backward" if backward else "forward"
    if dropout_p != 0.0:
        raise RuntimeError(f"{where} unsupported: dropout_p must be 0")
    if return_debug_mask:
        raise RuntimeError(f"{where} unsupported: return_debug_mask must be False")
    if query.dtype not in _HALF:
        raise RuntimeError(f"{where} unsupported: query dtype must be float16 or bfloat16")
    if cum_seq_q is None and query.dim() != 4:
        raise RuntimeError(f"{where} unsupported: dense query must be 4D")
    if cum_seq_q is not None and query.dim() != 3:
        raise RuntimeError(f"{where} unsupported: ragged query must be 3D")


def _aux(q):
    return (
        torch.zeros(2, dtype=torch.uint64),
        torch.zeros((), dtype=torch.uint64),
        torch.empty(0, dtype=q.dtype),
    )


def _make_impl(impl):
    def run_forward(q, k, v, cu_q, cu_k, scale, causal):
        CALLS[(impl, "forward" if cu_q is None else "varlen forward")] += 1
        if impl == "FA4":  # the stand-in package's entry point, as torch's wrapper calls it
            return sys.modules["flash_attn.cute.interface"]._flash_attn_fwd(
                q,
                k,
                v,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                softmax_scale=scale,
                causal=causal,
                return_lse=True,
            )
        _kernel_checks(q, k, v, cu_q, cu_k, "FA3 mha_fwd")
        return _attend(q, k, v, cu_q, cu_k, _scale(scale, q.shape[-1]), causal)

    def run_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal):
        CALLS[(impl, "backward" if cu_q is None else "varlen backward")] += 1
        if impl == "FA4":
            return sys.modules["flash_attn.cute.interface"]._flash_attn_bwd(
                q,
                k,
                v,
                out,
                dout,
                lse.contiguous(),
                softmax_scale=scale,
                causal=causal,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
            )
        _kernel_checks(q, k, v, cu_q, cu_k, "FA3 mha_bwd")
        _check_lse(lse, q, cu_q, "FA3 mha_bwd")
        return _attend_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, _scale(scale, q.shape[-1]), causal
        )

    def sdpa_forward(
        query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
    ):
        _support(impl, query, dropout_p, return_debug_mask, None)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out_bshd, lse = run_forward(q, k, v, None, None, scale, is_causal)
        out = torch.empty_like(query)  # "output with query's strides (BHSD layout)"
        out.copy_(out_bshd.transpose(1, 2))
        return (out, lse.contiguous(), None, None, query.size(2), key.size(2), *_aux(query))

    def sdpa_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        philox_seed,
        philox_offset,
        *,
        scale=None,
    ):
        _support(impl, query, dropout_p, False, None, backward=True)
        _check(
            logsumexp.dtype == torch.float32,
            f"{impl} SDPA backward unsupported: logsumexp dtype must be float32",
        )
        # the SDPA backward passes cum_seq None on whatever it got (dense attention)
        ts = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
        dq, dk, dv = run_backward(*ts, logsumexp, None, None, scale, is_causal)
        return tuple(g.transpose(1, 2) for g in (dq, dk, dv))

    def varlen_forward(
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        *,
        scale=None,
        window_size_left=None,
        window_size_right=None,
        seqused_k=None,
        alibi_slopes=None,
        block_table=None,
        num_splits=None,
    ):
        _check(
            all(x is None for x in (seqused_k, alibi_slopes, block_table)),
            "flash_impl_emulation: seqused_k, alibi_slopes and block_table are not emulated",
        )
        _support(impl, query, dropout_p, return_debug_mask, cum_seq_q)
        out, lse = run_forward(query, key, value, cum_seq_q, cum_seq_k, scale, is_causal)
        return out, lse.contiguous(), *_aux(query)

    def varlen_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng_state,
        unused,
        *,
        scale=None,
        window_size_left=None,
        window_size_right=None,
    ):
        _support(impl, query, dropout_p, False, cum_seq_q, backward=True)
        _check(
            logsumexp.dtype == torch.float32,
            f"{impl} flash_attention backward unsupported: logsumexp dtype must be float32",
        )
        return run_backward(
            grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, scale, is_causal
        )

    return {
        "sdpa_forward": sdpa_forward,
        "sdpa_backward": sdpa_backward,
        "varlen_forward": varlen_forward,
        "varlen_backward": varlen_backward,
    }


# --- FlashAttention-4's entry points (the stand-in flash_attn.cute.interface) -------------


def _fa4_fwd(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    return_lse=False,
    out=None,
    **unused,
):
    _kernel_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, "flash_attn.cute _flash_attn_fwd")
    o, lse = _attend(
        q, k, v, cu_seqlens_q, cu_seqlens_k, _scale(softmax_scale, q.shape[-1]), causal
    )
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


def _fa4_bwd(
    q,
    k,
    v,
    out,
    dout,
    lse,
    softmax_scale=None,
    causal=False,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    **unused,
):
    what = "flash_attn.cute _flash_attn_bwd"
    _kernel_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, what)
    _check_lse(lse, q, cu_seqlens_q, what)
    return _attend_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        _scale(softmax_scale, q.shape[-1]),
        causal,
    )


# --- installing -----------------------------------------------------------------------------


def _module(name, package=False, **attrs):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        m.__path__ = []
    m.__dict__.update(attrs)
    return m


def package_modules(which=("fa3", "fa4")) -> dict[str, types.ModuleType]:
    """The stand-in modules by name (module doc), for `sys.modules`."""
    global _FA3_LIB
    mods = {}
    if "fa3" in which:
        if _FA3_LIB is None:  # what torch's _fa3_import_module checks for
            _FA3_LIB = torch.library.Library("flash_attn_3", "DEF")
            _FA3_LIB.define("fwd(Tensor q) -> Tensor")
            _FA3_LIB.define("bwd(Tensor q) -> Tensor")
        mods["flash_attn_interface"] = _module("flash_attn_interface")
    if "fa4" in which:
        mods["flash_attn"] = _module("flash_attn", package=True)  # a namespace package
        mods["flash_attn.cute"] = _module("flash_attn.cute", package=True)
        mods["flash_attn.cute.interface"] = _module(
            "flash_attn.cute.interface", _flash_attn_fwd=_fa4_fwd, _flash_attn_bwd=_fa4_bwd
        )
    return mods


def install_packages(which=("fa3", "fa4")) -> None:
    """Make the stand-ins importable for the rest of this process (a worker)."""
    sys.modules.update(package_modules(which))
    kernels_select.forget()


@contextlib.contextmanager
def packages(which=("fa3", "fa4")):
    """The stand-ins importable within the block (the test process); restored after, and the
    impl too."""
    mods = package_modules(which)
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    kernels_select.forget()
    try:
        yield
    finally:
        restore()
        for name, m in saved.items():
            if m is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = m
        kernels_select.forget()


def install() -> None:
    """Serve the four aten flash ops per the active impl (cuda_emulation / varlen_emulation
    dispatch to these while `torch.nn.attention.current_flash_attention_impl()` names one)."""
    import varlen_emulation

    cuda_emulation.install()
    varlen_emulation.install()
    for impl in ("FA3", "FA4"):
        cuda_emulation.REROUTED.setdefault(impl, _make_impl(impl))


def restore() -> None:
    """Torch's own FA2 again in this process, and upipe's choices forgotten."""
    from torch.nn.attention import _registry

    _registry.restore_flash_attention_impl(_raise_warn=False)
    kernels_select.forget()
