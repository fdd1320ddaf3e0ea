"""Which kernel runs: auto's rule, every refusal's message, the FA3/FA4 activation, the
options of `upipe train/plan/bench`, and the planner's backward workspace per kernel.

No GPU here: a CUDA device is named (`torch.device("cuda")`, never touched) and its compute
capability and cuDNN version are patched in; FA3/FA4 are the stand-ins of
flash_impl_emulation.py."""

from __future__ import annotations

import logging

import flash_impl_emulation
import pytest
import torch
from workers import make_qkv

from upipe import kernels, kernels_select
from upipe.kernels_cuda import backward_workspace_bytes
from upipe.kernels_select import auto_kernel, kernel_problem

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def gpu(monkeypatch):
    """`gpu(major, minor, cudnn=...)` sets the pretend GPU; the caches forgotten around it."""

    def set_gpu(major, minor, cudnn=91100):
        monkeypatch.setattr(kernels_select, "device_capability", lambda d: (major, minor))
        monkeypatch.setattr(kernels_select, "cudnn_version", lambda: cudnn)
        kernels_select.forget()

    kernels_select.forget()
    monkeypatch.setattr(kernels_select, "flash_attn_version", lambda: None)
    yield set_gpu
    flash_impl_emulation.restore()


@pytest.mark.parametrize(
    "cap,packages,dtype,d,documents,want",
    [
        ((9, 0), ("fa3", "fa4"), BF16, 128, False, "fa3"),  # H100/H200: FA3 first
        ((9, 0), ("fa4",), BF16, 128, False, "cudnn"),  # no FA3: cuDNN before FA4
        ((9, 0), (), torch.float16, 128, False, "cudnn"),
        ((9, 0), (), BF16, 256, False, "cudnn"),  # d up to 256 on Hopper (cuDNN 9.11)
        ((9, 0), (), BF16, 128, True, "flash"),  # documents: a varlen kernel
        ((9, 0), ("fa3",), BF16, 128, True, "fa3"),  # ... which FA3 has
        ((10, 0), ("fa3", "fa4"), BF16, 128, False, "fa4"),  # B200: FA4
        ((10, 0), (), BF16, 128, False, "cudnn"),
        ((10, 0), (), BF16, 192, False, "flash"),  # over cuDNN's 128 there: FA2
        ((10, 0), (), BF16, 264, False, "efficient"),  # over FA2's 256 too
        ((8, 0), (), BF16, 128, False, "flash"),  # A100: FA2
        ((7, 5), (), BF16, 64, False, "efficient"),  # FA2 needs sm80
        ((9, 0), ("fa3",), torch.float32, 128, False, "efficient"),  # fp32: the only one
    ],
)
def test_auto_rule(gpu, cap, packages, dtype, d, documents, want):
    gpu(*cap)
    with flash_impl_emulation.packages(packages):
        assert auto_kernel(CUDA, dtype, d, documents=documents) == want


def test_auto_on_cpu_and_elsewhere():
    assert auto_kernel(CPU, BF16, 64) == "cpu"
    with pytest.raises(ValueError, match="no attention kernel for device type 'meta'"):
        auto_kernel(torch.device("meta"), BF16, 64)


def test_auto_prefers_the_flash_attn_package_on_ampere(gpu, monkeypatch):
    gpu(8, 0)
    monkeypatch.setattr(kernels_select, "flash_attn_version", lambda: (2, 7))
    assert auto_kernel(CUDA, BF16, 128) == "flash_attn"
    monkeypatch.setattr(kernels_select, "flash_attn_version", lambda: (2, 6))
    kernels_select.forget()
    assert auto_kernel(CUDA, BF16, 128) == "flash"


def test_auto_skips_a_broken_cudnn(gpu):
    gpu(9, 0, cudnn=91001)
    assert auto_kernel(CUDA, BF16, 128) == "flash"
    gpu(9, 0, cudnn=91000)  # d > 128 on Hopper needs cuDNN >= 9.10 in the forward
    assert kernel_problem("cudnn", CUDA, BF16, 256).startswith("backend='cudnn': cuDNN 91000")


def test_auto_logs_its_choice_once(gpu, caplog):
    gpu(9, 0)
    with caplog.at_level(logging.INFO, logger="upipe.kernels"):
        for _ in range(3):
            assert kernels.default_backend(CUDA, BF16) == "cudnn"
    lines = [r.getMessage() for r in caplog.records if r.name == "upipe.kernels"]
    assert lines == ["upipe: attention kernel 'cudnn' for bfloat16 on cuda (sm90, head dim None)"]


def test_an_active_impl_is_what_auto_uses(gpu):
    gpu(9, 0)
    with flash_impl_emulation.packages(("fa3", "fa4")):
        kernels.prepare_kernel("fa4", CUDA, BF16, 128)  # activates FA4 process-wide
        assert torch.nn.attention.current_flash_attention_impl() == "FA4"
        assert auto_kernel(CUDA, BF16, 128) == "fa4"  # not fa3: FA4 is active
        kernels.prepare_kernel("fa4", CUDA, BF16, 128)  # once: a no-op now
        for other in ("fa3", "flash"):
            with pytest.raises(ValueError, match=f"backend='{other}' needs .* but FA4 is active"):
                kernels.check_kernel(other, CUDA, BF16, 128)
    assert torch.nn.attention.current_flash_attention_impl() is None  # (restored)


@pytest.mark.parametrize(
    "kernel,cap,cudnn,dtype,d,message",
    [
        ("fa3", (9, 0), 91100, BF16, 128, "needs FlashAttention-3's flash_attn_interface module"),
        ("fa4", (10, 0), 91100, BF16, 128, r"needs the flash-attn-4 package \(pip install"),
        ("cudnn", (9, 0), 91100, torch.float32, 64, "takes fp16/bf16 inputs, got torch.float32"),
        ("flash", (9, 0), 91100, torch.float32, 64, "use backend='efficient'"),
        ("efficient", (9, 0), 91100, torch.float64, 64, "takes fp32, fp16 or bf16 inputs"),
        ("cudnn", (9, 0), 8907, BF16, 64, r"needs cuDNN >= 9.0 \(torch has 8907\)"),
        ("cudnn", (9, 0), None, BF16, 64, "needs torch built with cuDNN"),
        ("cudnn", (9, 0), 91000, BF16, 64, "known bugs in the fp16/bf16 attention backward"),
        ("cudnn", (10, 0), 91100, BF16, 192, "takes head dims up to 128 on sm100, got 192"),
        ("cudnn", (12, 8), 91100, BF16, 64, "runs on sm80..sm121"),
        ("flash", (10, 0), 91100, BF16, 260, "takes head dims up to 256 on sm100, got 260"),
        ("flash", (7, 5), 91100, BF16, 64, "needs an sm80 or newer GPU, this one is sm75"),
        ("flash_attn", (8, 0), 91100, BF16, 64, r"flash-attn package >= 2.7 \(not installed\)"),
    ],
)
def test_kernel_refused_with_the_fix(gpu, kernel, cap, cudnn, dtype, d, message):
    gpu(*cap, cudnn=cudnn)
    assert kernel_problem(kernel, CUDA, dtype, d) is not None
    with pytest.raises(ValueError, match=message):
        kernels.check_kernel(kernel, CUDA, dtype, d)


def test_fa3_fa4_need_torchs_impl_and_their_gpu(gpu, monkeypatch):
    gpu(10, 0)
    with flash_impl_emulation.packages():
        assert kernel_problem("fa4", CUDA, BF16, 128) is None
        assert "runs on sm9x GPUs, this one is sm100" in kernel_problem("fa3", CUDA, BF16, 128)
        monkeypatch.setattr(kernels_select, "torch_flash_impls", lambda: ("FA4",))
        message = kernel_problem("fa3", CUDA, BF16, 128)
        assert f"which this torch ({torch.__version__}) does not offer" in message
        assert "(its impls: ['FA4'])" in message


def test_cpu_tensors_skip_the_device_checks():
    """On CPU tensors the CUDA ops' dispatch decides (in the tests: their emulations), so
    neither cuDNN's presence nor a compute capability is asked for; packages and limits are."""
    assert kernel_problem("cudnn", CPU, BF16, 256) is None  # the loosest limit: 256
    assert "head dims up to 256, got 264" in kernel_problem("cudnn", CPU, BF16, 264)
    assert "flash_attn_interface" in kernel_problem("fa3", CPU, BF16, 64)
    with pytest.raises(ValueError, match="backend='cpu' runs CPU tensors, got cuda"):
        kernels.check_kernel("cpu", CUDA, BF16, 64)
    with pytest.raises(ValueError, match="unknown attention backend 'tpu'"):
        kernels.check_kernel("tpu", CPU, BF16, 64)


def test_kernels_refuse_before_any_collective(clusters):
    """A kernel that cannot run is refused on every rank, by the validation before the
    first all-to-all (the same message everywhere; nothing hangs)."""
    import kernel_workers

    for rank, got in enumerate(clusters(2).run(kernel_workers.call_with_backend, "fa3")):
        assert got[0] == "ValueError" and "flash_attn_interface" in got[1], (rank, got)


# --- the options --------------------------------------------------------------------------


def test_train_option_refuses_a_cuda_kernel_on_cpu():
    from upipe.train.config import TrainConfig, validate

    assert validate(TrainConfig(), 4) is None  # auto on CPU: the CPU kernel
    problem = validate(TrainConfig(attention_kernel="cudnn"), 4)
    assert problem == (
        "--attention-kernel cudnn runs on CUDA (--device cuda); on CPU leave it at auto "
        "(the CPU kernel)"
    )


def test_bench_and_plan_take_the_option():
    from upipe.bench import BenchConfig
    from upipe.bench import validate as bench_validate
    from upipe.cli import build_parser

    assert "runs on CUDA" in bench_validate(BenchConfig(attention_kernel="fa3"), 4)
    parser = build_parser()
    for command in ("train", "plan", "bench"):
        ns = parser.parse_args([command, "--attention-kernel", "cudnn"])
        assert ns.attention_kernel == "cudnn", command
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--attention-kernel", "fa5"])


# --- the planner's charge -----------------------------------------------------------------


def test_backward_workspace_closed_forms():
    """B = 1, S = 1024, H = 32, G = 8, d = 128, bf16 (Llama3-8B's heads at 1K tokens)."""
    args = (1, 1024, 1024, 32, 8, 128, 2)
    dq_accum = 4 * 32 * 1024 * 128  # fp32 [B, H, S, d]: 16 MiB
    assert backward_workspace_bytes("flash", *args) == dq_accum + 2 * 2 * 1024 * 32 * 128
    assert backward_workspace_bytes("auto", *args) == backward_workspace_bytes("flash", *args)
    assert backward_workspace_bytes("cudnn", *args) == dq_accum + 4 * 32 * 1024
    assert backward_workspace_bytes("fa3", *args) == dq_accum + 8 * 32 * 1024 + 8 * 8 * 1024 * 128
    mha = (1, 1024, 1024, 32, 32, 128, 2)  # no GQA: no expanded / fp32 dk, dv
    assert backward_workspace_bytes("flash", *mha) == dq_accum
    assert backward_workspace_bytes("fa4", *mha) == dq_accum + 8 * 32 * 1024


def test_step_tracker_charges_the_chosen_kernel():
    """The planner's tracker adds the kernel's workspace while the attention backward runs:
    the peaks of the same backward differ by exactly the workspaces' difference."""
    from upipe.planner.step import StepTracker

    q, k, v, dout = (t.bfloat16() for t in make_qkv(B=1, S=256, H=8, G=2, d=64))
    peaks = {}
    for kernel in ("flash", "cudnn", "fa3"):
        with StepTracker(cuda_workspaces=True, attention_kernel=kernel) as mem:
            out, lse = kernels.attention_forward(q, k, v)
            kernels.attention_backward(dout, q, k, v, out, lse)
            del out, lse
        peaks[kernel] = mem.peak_bytes
    ws = {k: backward_workspace_bytes(k, 1, 256, 256, 8, 2, 64, 2) for k in peaks}
    assert peaks["flash"] - peaks["cudnn"] == ws["flash"] - ws["cudnn"]
    assert peaks["flash"] - peaks["fa3"] == ws["flash"] - ws["fa3"]


def test_cudnn_ops_checked_against_the_arguments_upipe_passes(monkeypatch):
    """`torch_private.cudnn_sdpa_ops`: the schema gate (a torch that reorders the cuDNN
    ops' arguments fails there, naming the op, instead of misreading one)."""
    from upipe import torch_private

    assert torch_private.cudnn_lse_dims() == 4  # [B, H, S, 1], from torch 2.13's meta kernel
    forward, backward = torch_private.cudnn_sdpa_ops()
    assert forward is torch.ops.aten._scaled_dot_product_cudnn_attention.default
    assert backward is torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    name = "_scaled_dot_product_cudnn_attention"
    swapped = (("query", "value", "key"), ("scale",))  # as if a torch had reordered them
    monkeypatch.setitem(torch_private._ATEN_ARGS, name, swapped)
    torch_private.aten_op.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=f"aten::{name} takes .*needs updating"):
            torch_private.cudnn_sdpa_ops()
    finally:
        torch_private.aten_op.cache_clear()
