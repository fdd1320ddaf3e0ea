"""Which local attention kernels can run here, which one `auto` picks, and FA3/FA4 activation.

`upipe.kernels` runs the kernels; this module answers, for a device, dtype and head dim,
whether a named kernel can run (`kernel_problem`: None, or the message that refuses it)
and which one `auto` takes (`auto_kernel`). Every answer is read from what is installed
and from the device; nothing is imported or activated at import time.

What each kernel needs (d: the head dim after upipe pads it to a multiple of 8; every
kernel here needs d % 8 == 0):

| kernel     | dtypes     | head dim (padded)      | needs                                     |
|------------|------------|------------------------|-------------------------------------------|
| flash      | fp16, bf16 | <= 256                 | sm80+ (torch's FA2); no FA3/FA4 active    |
| efficient  | fp32, half | any                    | every CUDA build                          |
| cudnn      | fp16, bf16 | <= 128; <= 256 on sm90 | cuDNN >= 9.0, not 9.10.0/9.10.1 (and      |
|            |            | with cuDNN >= 9.10     | >= 9.10 for d > 128); sm80..sm121         |
| fa3        | fp16, bf16 | <= 256                 | sm90; module flash_attn_interface; torch's|
|            |            |                        | "FA3" impl                                |
| fa4        | fp16, bf16 | <= 256                 | sm90/sm100; package flash-attn-4          |
|            |            |                        | (flash_attn.cute); torch's "FA4" impl     |
| flash_attn | fp16, bf16 | <= 256                 | the flash-attn package >= 2.7             |

Sources: flash -- torch `aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`
`mha_fwd` ("FlashAttention forward only supports head dimension at most 256") and
`sdp_utils.cpp` `check_flash_attention_hardware_support` (sm80 and later). cudnn --
`sdp_utils.cpp` `can_use_cudnn_attention` ("cuDNN version too old to use cuDNN Attention
(< v9.0.0)"), `check_cudnn_tensor_shapes` (head_dim_limit 128, 256 on sm90 with cuDNN >=
9.10), `check_cudnn_hardware_support` ([sm80, sm121]); cudnn-frontend
`CompositeSDPABackwardNode::pre_validate_node` (backward: d <= 256 on sm90, <= 128 elsewhere;
"not supported on cuDNN 9.10.0/9.10.1 due to known bugs"). fa3/fa4 -- torch
`torch/nn/attention/_fa3.py` `_fa3_common_support_error` ("FA3 requires compute capability
9.0"), `_fa4.py` `_fa4_common_support_error` ("FA4 requires compute capability 9.0 or
10.0"), flash-attention `flash_attn/cute/interface.py` `_flash_attn_fwd` ("head_dim must
be less than or equal to 256"). A kernel that cannot run is refused with a ValueError naming
the package or the limit and the fix (`upipe.kernels.check_kernel`).

`auto` (the default, `backend=None`), first match wins:

    CPU tensors                        -> cpu
    CUDA, fp32                         -> efficient (the only CUDA kernel that takes fp32)
    an FA3/FA4 impl already active     -> fa3 / fa4 (torch's flash ops run it anyway)
    fp16/bf16, sm90 (H100, H200)       -> fa3 if available, else cudnn
    fp16/bf16, sm100/sm103 (B200/B300) -> fa4 if available, else cudnn
    fp16/bf16, other sm80+ (A100, ...) -> flash_attn (>= 2.7) if installed, else flash
    older GPUs                         -> efficient (FA2 needs sm80)
    a kernel over its head-dim limit   -> the next one down the same line (flash, efficient)
    packed documents (`documents=True`): flash instead of cudnn

Why (published figures, predictions for upipe until a GPU check measures them):
FlashAttention-3 (Shah et al., 2024) is 1.5-2x FA2 on H100 (issue 26 quotes ~616 / ~540
TFLOP/s forward / backward causal, against ~335 / ~300 for FA2); PyTorch 2.5's release
notes give cuDNN attention up to 75% over FA2 on H100 (issue 26: ~540 / ~516); NVIDIA's
TransformerEngine prefers FA3 over FA4 on sm90 (FA4's sm90 backward is the less mature
one: `get_attention_backend`), FlashAttention-4 was written for Blackwell, where FA2 and
FA3 have no tuned kernels; on Ampere FA2 is torch's own first choice (`sdp_utils.cpp`
priority order) and cuDNN's attention gains are on Hopper and later. For packed documents
a varlen kernel covers every document in one call, while cuDNN's dense op builds and caches
one execution graph per distinct shape (aten/src/ATen/native/cudnn/MHA.cpp
`run_cudnn_SDP_fprop`, `MHAGraphCache` keyed by sizes and strides): one per document length,
new lengths every step. The choice is logged once per (device, dtype, head dim, documents)
at INFO on the "upipe.kernels" logger.

FA3/FA4 activation is process-wide: `activate("fa3")` calls
`torch.nn.attention.activate_flash_attention_impl("FA3")` once, after which torch's aten
flash ops -- the dense `_scaled_dot_product_flash_attention(_backward)` and the varlen
`_flash_attention_forward/_backward` that upipe calls, and F.scaled_dot_product_attention's
flash path for everyone else in the process -- run FA3 until the process ends; torch's FA2
("flash") is then refused, and so is the other impl. upipe activates at the first kernel call
that needs it, or earlier where the caller says so (`upipe.train.Trainer` does it before
its first step), never at import.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import re

import torch

from upipe import torch_private

log = logging.getLogger("upipe.kernels")

HALF = (torch.float16, torch.bfloat16)
KERNELS = ("auto", "flash", "cudnn", "fa3", "fa4", "flash_attn", "efficient")
"""What `--attention-kernel` takes (`upipe train`, `plan`, `bench`); `auto` is the default."""
CUDA_KERNELS = KERNELS[1:]
FLASH_ATTN_MIN_VERSION = (2, 7)  # the `_flash_attn_backward` keyword arguments upipe passes
CUDNN_MIN_VERSION = 90000
CUDNN_BROKEN_BACKWARD = (91000, 91001)  # cudnn-frontend refuses the fp16/bf16 backward
IMPL = {"fa3": "FA3", "fa4": "FA4"}  # torch.nn.attention's names
IMPL_MAJORS = {"fa3": (9,), "fa4": (9, 10)}  # compute capability majors torch's wrapper takes
_MODULE = {"fa3": "flash_attn_interface", "fa4": "flash_attn.cute"}
_INSTALL = {
    "fa3": "FlashAttention-3's flash_attn_interface module (build it from flash-attention's "
    "hopper/ directory: cd hopper && python setup.py install)",
    "fa4": "the flash-attn-4 package (pip install flash-attn-4), which provides flash_attn.cute",
}


def forget() -> None:
    """Forget what was found installed and every `auto` choice (tests install stand-ins)."""
    for fn in _CACHES:
        fn.cache_clear()


@functools.cache
def flash_attn_version() -> tuple[int, int] | None:
    """flash-attn 2.x's (major, minor), or None when it is not installed. Installing
    flash-attn-4 alone leaves `flash_attn` a namespace package (its `flash_attn/cute` has no
    `flash_attn/__init__.py` next to it, and its distribution is not named flash_attn), so
    a namespace package, or a package without metadata, counts as not installed: 2.x is
    never guessed, and FA4 is detected on its own (`flash_attn.cute`, `kernel_problem`)."""
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):  # a broken install, or a stand-in without a spec
        return None
    if spec is None or spec.origin is None:  # absent, or a namespace package
        return None
    try:
        version = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = re.findall(r"\d+", version)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else None


@functools.cache
def _module_found(name: str) -> bool:
    """Whether `import name` would find a module (its parents are imported, not it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def cudnn_version() -> int | None:
    """torch's cuDNN version (e.g. 91002 for 9.10.2), or None without cuDNN."""
    if not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for any other device (the CUDA-only ops'
    dispatch decides there: no kernel, or in tests an emulation of one)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def torch_flash_impls() -> tuple[str, ...]:
    """The flash impls torch can activate ("FA3", "FA4"); () for a torch without them."""
    return torch_private.flash_impls()


def active_flash_impl() -> str | None:
    """The flash impl active in this process ("FA3" / "FA4"), or None for torch's FA2."""
    return torch_private.active_flash_impl()


def head_dim_limit(kernel: str, capability: tuple[int, int] | None) -> int | None:
    """The largest (padded) head dim `kernel` takes; None for no limit. On a device of
    unknown capability, the largest any device allows."""
    if kernel == "efficient":
        return None
    if kernel == "cudnn" and capability is not None and capability != (9, 0):
        return 128
    if kernel == "cudnn" and capability == (9, 0) and (cudnn_version() or 0) < 91000:
        return 128  # the forward's gate: d > 128 on Hopper needs cuDNN 9.10
    return 256


def _conflict(kernel: str) -> str | None:
    """Why `kernel` cannot run next to the flash impl already active, if it cannot."""
    active, want = active_flash_impl(), IMPL.get(kernel)
    if active is None or active == want or kernel not in ("flash", "fa3", "fa4"):
        return None
    runs = "torch's own FA2 kernels" if want is None else f"the {want} impl"
    return (
        f"backend={kernel!r} needs {runs}, but {active} is active in this process "
        f"(torch.nn.attention.activate_flash_attention_impl, process-wide: an earlier "
        f"backend={active.lower()!r} call activated it); use backend={active.lower()!r}, or "
        f"run {kernel} in another process"
    )


def kernel_problem(kernel: str, device: torch.device, dtype: torch.dtype, head_dim=None):
    """Why `kernel` (a name of `CUDA_KERNELS` but auto) cannot run attention of `dtype` with
    `head_dim` on `device`, as a message naming the limit or the package and the fix; None
    if it can. Packages and limits are checked on every device; cuDNN's presence and the
    compute capability only on a CUDA device (see `device_capability`)."""
    cap = device_capability(device)
    if kernel != "efficient" and dtype not in HALF:
        return (
            f"backend={kernel!r} takes fp16/bf16 inputs, got {dtype}; use backend='efficient' "
            "(torch's memory-efficient kernel) for fp32"
        )
    if kernel == "efficient" and dtype not in (torch.float32, *HALF):
        return f"backend='efficient' takes fp32, fp16 or bf16 inputs, got {dtype}"
    padded = None if head_dim is None else head_dim + (-head_dim) % 8
    limit = head_dim_limit(kernel, cap)
    if padded is not None and limit is not None and padded > limit:
        where = "" if cap is None else f" on sm{cap[0]}{cap[1]}"
        return (
            f"backend={kernel!r} takes head dims up to {limit}{where}, got {head_dim}"
            + (" (cuDNN takes up to 256 on sm90 with cuDNN >= 9.10)" if kernel == "cudnn" else "")
            + "; use backend='flash' (up to 256) or 'efficient' (any)"
        )
    conflict = _conflict(kernel)
    if conflict:
        return conflict
    if kernel in IMPL:
        impl = IMPL[kernel]
        if impl not in torch_flash_impls():
            return (
                f"backend={kernel!r} reroutes torch's flash ops to {impl} with "
                f"torch.nn.attention.activate_flash_attention_impl({impl!r}), which this torch "
                f"({torch.__version__}) does not offer (its impls: "
                f"{list(torch_flash_impls()) or 'none'}); upgrade torch, or use 'cudnn' or 'flash'"
            )
        if not _module_found(_MODULE[kernel]):
            return f"backend={kernel!r} needs {_INSTALL[kernel]}; or use 'cudnn' or 'flash'"
        if cap is not None and cap[0] not in IMPL_MAJORS[kernel]:
            majors = " or ".join(f"sm{m}x" for m in IMPL_MAJORS[kernel])
            return f"backend={kernel!r} runs on {majors} GPUs, this one is sm{cap[0]}{cap[1]}"
    if kernel == "flash_attn":
        fa = flash_attn_version()
        if fa is None or fa < FLASH_ATTN_MIN_VERSION:
            found = "not installed" if fa is None else "version " + ".".join(map(str, fa))
            want = ".".join(map(str, FLASH_ATTN_MIN_VERSION))
            return (
                f"backend='flash_attn' needs the flash-attn package >= {want} ({found}); "
                "install it (pip install flash-attn) or use backend='flash'"
            )
    if cap is not None and kernel in ("flash", "flash_attn", "cudnn") and cap < (8, 0):
        return f"backend={kernel!r} needs an sm80 or newer GPU, this one is sm{cap[0]}{cap[1]}"
    if kernel == "cudnn" and device.type == "cuda":
        return _cudnn_problem(cap)
    return None


def _cudnn_problem(cap) -> str | None:
    version = cudnn_version()
    if version is None:
        return "backend='cudnn' needs torch built with cuDNN; use backend='flash'"
    if version < CUDNN_MIN_VERSION:
        return f"backend='cudnn' needs cuDNN >= 9.0 (torch has {version}); use backend='flash'"
    if version in CUDNN_BROKEN_BACKWARD:
        return (
            f"backend='cudnn': cuDNN {version} has known bugs in the fp16/bf16 attention backward "
            "(cudnn-frontend refuses it); use cuDNN >= 9.10.2, or backend='flash'"
        )
    if cap > (12, 1):
        return f"backend='cudnn' runs on sm80..sm121, this GPU is sm{cap[0]}{cap[1]}"
    return None


def auto_kernel(device: torch.device, dtype: torch.dtype, head_dim=None, *, documents=False):
    """The kernel `auto` picks (module doc), logged once per distinct question."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(
            f"no attention kernel for device type {device.type!r}; use a cpu or cuda tensor, "
            "or backend='reference'"
        )
    return _auto(device, dtype, head_dim, documents, active_flash_impl())


def auto_order(major: int, dtype: torch.dtype, active: str | None = None) -> list[str]:
    """The kernels `auto` tries, in order, on a GPU of compute capability major `major` for
    `dtype` (module doc; `active`: the flash impl already active). The first that can run
    wins (`_auto`); the planner takes the first one torch ships (`upipe.planner.hardware`)."""
    if dtype not in HALF:
        return ["efficient"]
    if active is not None:
        return [active.lower()]
    if major == 9:
        return ["fa3", "cudnn", "flash", "efficient"]
    if major == 10:
        return ["fa4", "cudnn", "flash", "efficient"]
    if major >= 8:
        return ["flash_attn", "flash", "efficient"]
    return ["efficient"]


@functools.cache
def _auto(device, dtype, head_dim, documents, active) -> str:
    ok = lambda k: kernel_problem(k, device, dtype, head_dim) is None  # noqa: E731
    line = auto_order(device_capability(device)[0], dtype, active)
    if documents:
        line = [k for k in line if k != "cudnn"]
    for kernel in line:
        if ok(kernel):
            log.info(
                "upipe: attention kernel %r for %s on %s (sm%s, head dim %s%s)",
                kernel,
                str(dtype)[6:],
                device,
                "".join(map(str, device_capability(device))),
                head_dim,
                ", packed documents" if documents else "",
            )
            return kernel
    raise ValueError(kernel_problem(line[-1], device, dtype, head_dim))


_CACHES = (flash_attn_version, _module_found, cudnn_version, _auto)


def activate(kernel: str) -> None:
    """Make torch's flash ops run `kernel`'s impl ("fa3" / "fa4") in this whole process, once
    (module doc); a no-op if it is active already. ValueError if it cannot (the other impl is
    active, or torch lacks it)."""
    want = IMPL[kernel]
    if active_flash_impl() == want:
        return
    problem = _conflict(kernel)
    if problem:
        raise ValueError(problem)
    torch_private.activate_flash_impl(want)
    log.info(
        "upipe: activated %s process-wide (torch.nn.attention.activate_flash_attention_impl): "
        "torch's flash attention ops run %s in this process from now on",
        want,
        want,
    )
