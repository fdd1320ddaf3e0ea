"""upipe.jax on 4 simulated CPU devices: against the float64 reference, against the PyTorch
ops on the same inputs, what backward keeps, XLA's temp memory, and bad input.

JAX runs in a one-process `LocalCluster` of its own (`jax_workers`): XLA fixes the device
count when JAX starts, and this process runs the PyTorch tests. Without the `jax` extra
(which `make test` installs) the module is skipped.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerances import TOL, rel_err

pytest.importorskip("jax")

from jax_workers import (  # noqa: E402
    JAX_ENV,
    C,
    error,
    functional,
    kernel,
    layer,
    layer_residual_bytes,
    temp_bytes,
)
from workers import make_qkv, module_reference, reference, run_module

from upipe.heads import valid_heads_per_stage
from upipe.launch import LocalCluster

FWD, BWD = TOL[torch.float32]["fwd"], TOL[torch.float32]["bwd"]
EXACT = 1e-12  # float64 runs: the algorithm adds nothing to the rounding of float64
PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def jax_run():
    """`jax_run(fn, *args)`: fn(0, 1, *args) in the JAX process (timeouts, tracebacks)."""
    cluster = LocalCluster(1, timeout_s=300, env=JAX_ENV)
    cluster.start()
    yield lambda fn, *args: cluster.run(fn, *args)[0]
    cluster.close()


def _check(got, ref, tol):
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert rel_err(torch.from_numpy(a), r) < tol, name


@pytest.mark.parametrize(
    "shape,kwargs",
    [  # several blocks, GQA; a block length that divides S only as 5, non-causal, MQA
        (dict(B=2, S=48, H=4, G=2, d=8), dict(block_size=16)),
        (dict(B=1, S=50, H=3, G=1, d=4), dict(block_size=8, causal=False)),
    ],
)
def test_kernel_is_exact_in_float64(jax_run, shape, kwargs):
    ref = reference(*make_qkv(**shape), causal=kwargs.get("causal", True))
    _check(jax_run(kernel, shape, kwargs), ref, EXACT)


@pytest.mark.parametrize("H,G", [(8, 2), (8, 8)])  # G < C (kv heads replicated); two rounds
def test_ops_are_exact_in_float64(jax_run, H, G):
    shape = dict(B=2, S=32, H=H, G=G, d=8)
    ref = reference(*make_qkv(**shape))
    for strategy, kwargs in (("ulysses", {}), ("upipe", {"heads_per_stage": C})):
        got = jax_run(functional, strategy, shape, {**kwargs, "block_size": 16}, "float64")
        _check(got, ref, EXACT)


def _valid(strategy, H, G, U):
    even = H % G == 0 and H % C == 0 and (G % C == 0 or C % G == 0)
    return even and (strategy == "ulysses" or (U or C) in valid_heads_per_stage(H, G, C))


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    strategy=st.sampled_from(["ulysses", "upipe"]),
    H=st.sampled_from([4, 6, 8, 12, 16]),
    G=st.sampled_from([1, 2, 3, 4, 8]),
    U=st.one_of(st.none(), st.integers(1, 16)),
    B=st.integers(1, 2),
    L=st.integers(2, 9),
    d=st.sampled_from([4, 8]),
    causal=st.booleans(),
    block_size=st.sampled_from([4, 512]),
)
def test_property_right_answer_or_clear_error(
    jax_run, strategy, H, G, U, B, L, d, causal, block_size
):
    """fp32 on 4 devices vs the float64 reference, or a ValueError for what it does not do."""
    shape = dict(B=B, S=L * C, H=H, G=G, d=d)
    kwargs = dict(causal=causal, block_size=block_size)
    if strategy == "upipe":
        kwargs["heads_per_stage"] = U
    if not _valid(strategy, H, G, U):
        qkv = [(B, L * C, H, d), (B, L * C, G, d), (B, L * C, G, d)]
        kind, message = jax_run(error, f"functional:{strategy}", qkv, kwargs)
        assert kind == "ValueError", message
        assert any(f"({n})" in message for n in (H, G, C, U)), message  # names the numbers
        return
    got = jax_run(functional, strategy, shape, kwargs)
    _check(got, reference(*make_qkv(**shape), causal=causal), BWD)


LAYER_CASES = [  # (H, G, B, strategy, U): G < C, two rounds of U = 2C, MHA Ulysses
    (8, 2, 1, "upipe", 4),
    (16, 4, 2, "upipe", 8),
    (8, 8, 1, "ulysses", None),
]


@pytest.mark.parametrize("H,G,B,strategy,U", LAYER_CASES)
def test_layer_matches_reference_and_pytorch(jax_run, clusters, H, G, B, strategy, U):
    """The JAX layer (fp32, 4 devices) vs the float64 layer, and vs upipe's PyTorch
    `ContextParallelAttention` (fp32, 4 gloo ranks) on the same weights and inputs."""
    cfg = dict(B=B, S=64, dim=32, num_heads=H, num_kv_heads=G, head_dim=8)
    kwargs = {"strategy": strategy, "heads_per_stage": U}
    got = jax_run(layer, cfg, {**kwargs, "block_size": 16})
    ref = module_reference(cfg)
    ranks = clusters(C).run(run_module, cfg, kwargs)
    torch_run = {
        "y": torch.cat([r["y"] for r in ranks], 1),
        "dx": torch.cat([r["dx"] for r in ranks], 1),
        **{n: sum(r[n] for r in ranks) for n in PARAMS},  # rank contributions sum up
    }
    for name in ("y", "dx", *PARAMS):
        jax_value = torch.from_numpy(got[name])
        assert rel_err(jax_value, ref[name]) < (FWD if name == "y" else BWD), name
        assert rel_err(jax_value, torch_run[name]) < (FWD if name == "y" else BWD), name


def test_upipe_backward_keeps_only_inputs_output_and_lse(jax_run):
    """`POLICY`: x, the weights, cos/sin, every stage's attention output (one [B, S, H, d] in
    all) and the fp32 log-sum-exp -- whatever U; Ulysses keeps more."""
    B, S, D, H, G, d = 1, 64, 32, 8, 2, 8
    cfg = dict(B=B, S=S, dim=D, num_heads=H, num_kv_heads=G, head_dim=8)
    E = 4
    params = (2 * H * d * D + 2 * G * d * D) * E
    expected = B * S * D * E + params + 2 * B * S * d * E + B * S * H * d * E + B * H * S * 4
    for U in (4, 8):
        assert jax_run(layer_residual_bytes, cfg, {"heads_per_stage": U}) == expected, U
    assert jax_run(layer_residual_bytes, cfg, {"strategy": "ulysses"}) > 2 * expected


@pytest.mark.slow
def test_temp_memory_falls_with_heads_per_stage(jax_run):
    """XLA's temp bytes per device of the jitted layer forward+backward, compiled (not run)
    at the benchmark shape (docs/jax.md: 0.474 of Ulysses' at U = C, 0.754 at U = 2C)."""
    cfg = dict(B=1, S=16384, dim=512, num_heads=16, num_kv_heads=16, head_dim=32)
    ulysses = jax_run(temp_bytes, cfg, {"strategy": "ulysses"})
    upipe = {U: jax_run(temp_bytes, cfg, {"heads_per_stage": U}) for U in (C, 2 * C)}
    assert upipe[C] < 0.55 * ulysses, (upipe, ulysses)
    assert upipe[C] < upipe[2 * C] < ulysses, (upipe, ulysses)


QKV = [(1, 16, 8, 8), (1, 16, 2, 8), (1, 16, 2, 8)]


@pytest.mark.parametrize(
    "call,args,kwargs,words",
    [
        ("functional:upipe", QKV, {"heads_per_stage": 6}, ["(6)", "multiple", "[4, 8]"]),
        ("functional:upipe", QKV, {"heads_per_stage": 16}, ["(16)", "divide", "[4, 8]"]),
        ("functional:upipe", [(1, 16, 6, 8), (1, 16, 6, 8), (1, 16, 6, 8)], {}, ["(4)", "(6)"]),
        ("functional:ulysses", [(1, 16, 12, 8), *[(1, 16, 3, 8)] * 2], {}, ["(3)", "(4)"]),
        ("functional:ulysses", [(1, 16, 8, 8), *[(1, 16, 3, 8)] * 2], {}, ["(3)", "(8)"]),
        ("functional:ulysses", [(1, 16, 8, 8), *[(1, 12, 2, 8)] * 2], {}, ["differ"]),
        ("layer", "strategy", {"strategy": "ring"}, ["'ring'", "ulysses"]),
        ("layer", "shapes", {}, ["q_proj [H*d, D]", "D = 32"]),
    ],
)
def test_bad_input_raises_value_error(jax_run, call, args, kwargs, words):
    """While tracing, before any collective: the same error on every device and host."""
    if call == "layer":
        cfg = dict(B=1, S=16, dim=32, num_heads=8, num_kv_heads=2, head_dim=8)
        shapes = {"q_proj": (64, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 64)}
        if args == "shapes":
            shapes["o_proj"] = (64, 32)
        args = (cfg, shapes)
    kind, message = jax_run(error, call, args, kwargs)
    assert kind == "ValueError", message
    assert all(w in message for w in words), message
