"""Matrix products into fp32 accumulators from half-precision operands.

The fused UPipe op (`upipe.attention.fused`) sums per-stage products into one fp32 buffer
(the output y, the input gradient dx), so that H / U stages of bf16 products lose nothing
to bf16 rounding between stages:

    acc32 += a @ b        a [N, K], b [K, M] in bf16/fp16 (or fp32), acc32 [N, M] fp32

On CUDA, casting a and b to fp32 first would run the GEMM on CUDA cores (fp32 GEMMs use
tensor cores only with TF32 enabled) and copy a, a [N, U*d] stage tensor, to fp32 each
time. CUDA's `out_dtype=` GEMM (`aten::addmm.dtype_out`, torch >= 2.9, CUDA only) instead
multiplies the bf16 operands on tensor cores with fp32 accumulation and adds into the fp32
output in place (beta = 1): FLOPs 2*N*K*M at bf16 tensor-core rate, bytes moved
2*(N*K + K*M) + 2*4*N*M, no temporary. On CPU (no such kernel; no tensor cores) the
operands are cast, which rounds nothing (bf16 -> fp32 is exact).
"""

from __future__ import annotations

import torch


def addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, tensor_cores: bool):
    """In place: acc += a @ b in acc's dtype (fp32 or wider). `tensor_cores`: use CUDA's
    out_dtype GEMM for half-precision operands (the caller runs CUDA kernels)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif tensor_cores:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
