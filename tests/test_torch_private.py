"""Each private torch API upipe relies on (`upipe.torch_private`) still behaves as upipe
expects: a torch upgrade that changes one fails here first."""

from __future__ import annotations

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
