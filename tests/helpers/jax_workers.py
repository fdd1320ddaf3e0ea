"""What tests/distributed/test_jax.py runs in a process of its own: JAX with C = 4 simulated CPU
devices.

XLA reads the device count when JAX first starts its backend, so the pytest process (which
runs the PyTorch tests) never imports JAX: the test starts a one-process `LocalCluster`
(its timeouts and tracebacks) with `JAX_ENV`, and these functions import JAX inside. The
inputs are `workers`' (torch generators), so the PyTorch runs see the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch
from workers import make_module_inputs, make_qkv, make_weights

C = 4
JAX_ENV = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={C}", "JAX_PLATFORMS": "cpu"}
AXIS = "cp"
PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _jax():
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 runs; float32 inputs stay float32
    if jax.device_count() != C:
        raise RuntimeError(f"expected {C} CPU devices (XLA_FLAGS), got {jax.devices()}")
    return jax


def _sharded(jax, fn, n_args, n_replicated=0):
    """fn(*replicated, *sequence-sharded) under shard_map over a 1-D mesh of C devices, and a
    function putting an array on the mesh (`put(a, sharded=True)`)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((C,), (AXIS,))
    seq = P(None, AXIS)
    specs = (P(),) * n_replicated + (seq,) * (n_args - n_replicated)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=seq)

    def put(a, sharded=True):
        return jax.device_put(a, jax.NamedSharding(mesh, seq if sharded else P()))

    return mapped, put


def functional(rank, world_size, strategy, shape, kwargs, dtype="float32"):
    """Forward+backward of `upipe.jax`'s `{strategy}_attention` on 4 devices with workers'
    q, k, v, dout; returns full-sequence (out, dq, dk, dv) as float64 numpy arrays."""
    jax = _jax()
    import upipe.jax as uj

    fn = getattr(uj, f"{strategy}_attention")
    mapped, put = _sharded(jax, lambda q, k, v: fn(q, k, v, axis_name=AXIS, **kwargs), 3)
    q, k, v, dout = (put(t.double().numpy().astype(dtype)) for t in make_qkv(**shape))

    def loss(q, k, v):
        out = mapped(q, k, v)
        return (out * dout).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(t, dtype=np.float64) for t in (out, *grads)]


def kernel(rank, world_size, shape, kwargs):
    """The local kernel on one device in float64: (out, dq, dk, dv) for workers' inputs."""
    jax = _jax()
    from upipe.jax.kernel import attention

    q, k, v, dout = (jax.numpy.asarray(t.double().numpy()) for t in make_qkv(**shape))
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, **kwargs), q, k, v)
    return [np.asarray(t) for t in (out, *vjp(dout))]


def _layer_inputs(jax, cfg, dtype):
    """workers' x, dy, positions and weights, as `dtype` numpy arrays (positions int32)."""
    x, dy, pos = make_module_inputs(**cfg, dtype=torch.float64)
    weights = make_weights(cfg, dtype=torch.float64)
    params = {n: weights[n].numpy().astype(dtype) for n in PARAMS}
    return x.numpy().astype(dtype), dy.numpy().astype(dtype), pos.numpy().astype(np.int32), params


def _layer(jax, cfg, kwargs):
    import upipe.jax as uj

    def fn(params, x, pos):
        d = cfg["head_dim"]
        return uj.attention_layer(params, x, pos, axis_name=AXIS, head_dim=d, **kwargs)

    return _sharded(jax, fn, 3, n_replicated=1)


def layer(rank, world_size, cfg, kwargs, dtype="float32"):
    """Forward+backward of `upipe.jax.attention_layer` on 4 devices with workers' x, dy and
    weights (`cfg` as `workers.module_reference`'s); returns y, dx and the parameters'
    gradients (summed over the devices by shard_map) as float64 numpy arrays."""
    jax = _jax()
    mapped, put = _layer(jax, cfg, kwargs)
    x, dy, pos, params = _layer_inputs(jax, cfg, dtype)
    x, dy, pos = put(x), put(dy), put(pos)
    params = {n: put(w, sharded=False) for n, w in params.items()}

    def loss(params, x):
        y = mapped(params, x, pos)
        return (y * dy).sum(), y

    (_, y), (dparams, dx) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    out = {"y": y, "dx": dx, **dparams}
    return {n: np.asarray(t, dtype=np.float64) for n, t in out.items()}


def layer_residual_bytes(rank, world_size, cfg, kwargs):
    """Bytes of the floating-point residuals the layer's backward keeps (fp32): the leaves of
    `jax.vjp`'s closure are exactly those residuals (traced for their shapes only)."""
    jax = _jax()
    mapped, put = _layer(jax, cfg, kwargs)
    x, _, pos, params = _layer_inputs(jax, cfg, "float32")
    x, pos = put(x), put(pos)
    params = {n: put(w, sharded=False) for n, w in params.items()}

    def residuals(params, x):
        return jax.tree.leaves(jax.vjp(lambda params, x: mapped(params, x, pos), params, x)[1])

    floating = jax.numpy.floating
    leaves = jax.eval_shape(residuals, params, x)
    return sum(t.size * t.dtype.itemsize for t in leaves if jax.numpy.issubdtype(t.dtype, floating))


def temp_bytes(rank, world_size, cfg, kwargs):
    """XLA's temp bytes per device of the layer's jitted forward+backward, compiled for
    abstract inputs (nothing runs)."""
    jax = _jax()
    from jax.sharding import PartitionSpec as P

    mapped, _ = _layer(jax, cfg, kwargs)
    mesh = jax.make_mesh((C,), (AXIS,))
    B, S, D, H, G, d = (cfg[n] for n in ("B", "S", "dim", "num_heads", "num_kv_heads", "head_dim"))

    def spec(shape, sharded=True, dtype="float32"):
        sharding = jax.NamedSharding(mesh, P(None, AXIS) if sharded else P())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    w = {"q_proj": (H * d, D), "k_proj": (G * d, D), "v_proj": (G * d, D), "o_proj": (D, H * d)}
    params = {n: spec(s, sharded=False) for n, s in w.items()}

    def loss(params, x, dy, pos):
        return (mapped(params, x, pos) * dy).sum()

    args = (params, spec((B, S, D)), spec((B, S, D)), spec((B, S), dtype="int32"))
    compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def error(rank, world_size, call, args, kwargs):
    """(exception type name, message) of a bad call, or None; `call` "functional:<strategy>"
    with q, k, v shapes `args`, or "layer" with (cfg, parameter shapes)."""
    jax = _jax()
    zeros = jax.numpy.zeros
    try:
        if call == "layer":
            cfg, shapes = args
            mapped, put = _layer(jax, cfg, kwargs)
            x = put(zeros((cfg["B"], cfg["S"], cfg["dim"]), "float32"))
            pos = put(zeros((cfg["B"], cfg["S"]), "int32"))
            params = {n: put(zeros(s, "float32"), sharded=False) for n, s in shapes.items()}
            jax.eval_shape(mapped, params, x, pos)  # traces: validation runs, nothing else
        else:
            import upipe.jax as uj

            fn = getattr(uj, call.split(":")[1] + "_attention")
            mapped, put = _sharded(jax, lambda q, k, v: fn(q, k, v, axis_name=AXIS, **kwargs), 3)
            jax.eval_shape(mapped, *(put(zeros(s, "float32")) for s in args))
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None
