"""Each private torch API upipe relies on (`upipe.torch_private`) still behaves as upipe
expects: a torch upgrade that changes one fails here first."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from upipe import torch_private as tp
from upipe.memory.simulate import fake_process_group
from upipe.mesh import make_mesh


def test_fake_tensors():
    with tp.FakeTensorMode():
        t = torch.empty(1 << 40)  # a TiB, allocated nowhere
        assert isinstance(t, tp.FakeTensor) and t.shape == (1 << 40,)
        with tp.unset_fake_temporarily():
            assert not isinstance(torch.zeros(1), tp.FakeTensor)


def test_dispatch_mode_sees_operators():
    seen = []

    class Log(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        torch.ones(2) + 1
    assert "aten.add.Tensor" in seen
    assert not tp.is_traceable_wrapper_subclass(torch.ones(1))


def test_saved_tensor_hooks_query():
    assert not tp.saved_tensor_hooks_active()
    with torch.autograd.graph.save_on_cpu():
        assert tp.saved_tensor_hooks_active()
    assert not tp.saved_tensor_hooks_active()


def test_graph_task_id_only_inside_backward():
    ids = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: ids.append(tp.current_graph_task_id()))
    assert tp.current_graph_task_id() == -1
    y.sum().backward()
    assert ids and ids[0] != -1


def test_flatten_mesh_and_the_fake_backend():
    """The fake process group is the public `init_process_group("fake")`; a mesh flattens
    into one group over all its ranks."""
    with fake_process_group(4) as group:
        assert dist.get_backend(group) == "fake" and dist.get_world_size(group) == 4
        mesh = make_mesh(ulysses=2, ring=2)
        flat = tp.flatten_mesh(mesh["ring", "ulysses"])
        assert flat.size() == 4 and dist.get_world_size(flat.get_group()) == 4


def test_process_groups_are_the_live_groups():
    """The default group, then also a mesh's groups until they are destroyed."""
    with fake_process_group(4) as world:
        assert tp.process_groups() == [world]
        mesh = make_mesh(ulysses=2, ring=2)
        made = [g for g in tp.process_groups() if g is not world]
        assert {mesh["ring"].get_group(), mesh["ulysses"].get_group()} <= set(made)
        for group in made:
            dist.destroy_process_group(group)
        assert tp.process_groups() == [world]
    assert tp.process_groups() == []


# --- the supported releases and the gates ---------------------------------------------------


@pytest.mark.parametrize(
    "version, release",
    [
        ("2.11.0+cu130", (2, 11)),
        ("2.13.0+cpu", (2, 13)),
        ("2.15.0", (2, 15)),
        ("2.16.0a0+git1a2b3c4", (2, 16)),
        ("10.0.1", (10, 0)),
    ],
)
def test_torch_version_parsing(version, release):
    assert tp.torch_version(version) == release


def test_torch_version_refuses_what_is_no_version():
    with pytest.raises(ValueError, match="'nightly'"):
        tp.torch_version("nightly")


def test_supported_releases_match_pyproject():
    """`SUPPORTED` is pyproject's `torch>=2.11,<2.16`, and this torch is inside it."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (torch_req,) = [r for r in project["project"]["dependencies"] if r.startswith("torch")]
    (a, b), (c, d) = tp.SUPPORTED
    assert torch_req == f"torch>={a}.{b},<{c}.{d + 1}"
    assert tp.unsupported_torch() is None, torch.__version__


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.15.0+cu132", "2.15.7"])
def test_releases_inside_the_range(version):
    assert tp.unsupported_torch(version) is None


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0a0+git1a2b3c4", "3.0.0"])
def test_releases_outside_the_range_name_it(version):
    message = tp.unsupported_torch(version)
    assert message.startswith(f"torch {version} is untested")
    assert "supports torch 2.11 to 2.15" in message and "'torch>=2.11,<2.16'" in message


def test_every_private_import_resolves():
    for name, (module, attr) in tp._IMPORTS.items():
        assert getattr(tp, name) is getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize(
    "version, says",
    [("2.13.0", "please report it"), ("2.16.0", "torch 2.16.0 is untested with upipe")],
)
def test_a_private_import_this_torch_lacks_fails_clearly(monkeypatch, version, says):
    """Inside the range the error asks for a report; outside, it names the range."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setitem(tp._IMPORTS, "Moved", ("torch.utils._no_such_module", "Moved"))
    with pytest.raises(ImportError, match=f"torch.utils._no_such_module.Moved, which torch "
                       f"{re.escape(version)} lacks") as err:  # fmt: skip
        from upipe.torch_private import Moved  # noqa: F401
    assert says in str(err.value) and "supports torch 2.11 to 2.15" in str(err.value)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        tp.Nothing  # noqa: B018


def test_private_attributes_this_torch_lacks_fail_clearly(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(RuntimeError, match=r"torch._C._current_graph_task_id, which torch"):
        tp.current_graph_task_id()
    monkeypatch.delattr(torch.distributed.distributed_c10d, "_world")
    with pytest.raises(RuntimeError, match=r"distributed_c10d._world, which torch"):
        tp.process_groups()
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    with pytest.raises(RuntimeError, match="_top_saved_tensors_default_hooks, which torch"):
        tp.saved_tensor_hooks_active()


def test_flash_impl_registry():
    """torch 2.11 to 2.15 all register FA3 and FA4 (read in 2.11.0, 2.13.0 and 2.15.0);
    none is active in a fresh process."""
    assert {"FA3", "FA4"} <= set(tp.flash_impls())
    assert tp.active_flash_impl() is None


def test_a_torch_without_the_flash_impl_registry(monkeypatch):
    """No registry: no impl offered, none active, fa3 / fa4 refused with the reason, every
    other kernel still chosen."""
    from upipe import kernels_select

    for name in ("list_flash_attention_impls", "current_flash_attention_impl",
                 "activate_flash_attention_impl"):  # fmt: skip
        monkeypatch.delattr(torch.nn.attention, name)
    assert tp.flash_impls() == () and tp.active_flash_impl() is None
    with pytest.raises(RuntimeError, match="activate_flash_attention_impl, which torch"):
        tp.activate_flash_impl("FA3")
    cpu = torch.device("cpu")
    for kernel in ("fa3", "fa4"):
        problem = kernels_select.kernel_problem(kernel, cpu, torch.bfloat16, 64)
        assert "does not offer (its impls: none)" in problem
    assert kernels_select.kernel_problem("cudnn", cpu, torch.bfloat16, 64) is None


def test_every_aten_op_upipe_calls_takes_its_arguments():
    for name in tp._ATEN_ARGS:
        assert tp.aten_op(name) is getattr(torch.ops.aten, name).default


# torch 2.11.0's schema of the varlen flash forward (2.13 added block_table and num_splits)
_FLASH_FORWARD_2_11 = (
    "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, "
    "Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
    "bool return_debug_mask, *, float? scale=None, SymInt? window_size_left=None, "
    "SymInt? window_size_right=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None) -> "
    "(Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, "
    "Tensor debug_attn_mask)"
)


@pytest.mark.parametrize(
    "schema, problem",
    [
        (_FLASH_FORWARD_2_11, None),
        ("aten::f(Tensor query, Tensor key, float p=0., *, float? scale=None) -> Tensor", None),
        ("aten::f(Tensor key, Tensor query, *, float? scale=None) -> Tensor", "takes ('key', "),
        ("aten::f(Tensor query, Tensor key, Tensor bias, *, float? scale=None) -> Tensor",
         "also requires ('bias',)"),
        ("aten::f(Tensor query, Tensor key) -> Tensor", "takes no keyword ('scale',)"),
    ],
)  # fmt: skip
def test_schema_gate(schema, problem):
    parsed = torch._C.parse_schema(schema)
    want = tp._ATEN_ARGS["_flash_attention_forward"] if "flash" in schema else None
    got = tp.schema_problem(parsed, *(want or (("query", "key"), ("scale",))))
    assert got == problem if problem is None else problem in got


def test_an_aten_op_this_torch_lacks(monkeypatch):
    monkeypatch.setitem(tp._ATEN_ARGS, "_no_such_attention", ((), ()))
    with pytest.raises(RuntimeError, match="aten::_no_such_attention, which torch"):
        tp.aten_op("_no_such_attention")
