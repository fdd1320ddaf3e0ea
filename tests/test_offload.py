"""Activation offload (`upipe.model.offload`) on the CPU: the offloader's arena is a separate
host tensor, so slicing, copies back, their order and reuse run as on CUDA (only the side
stream, its events and the page-locking are CUDA-only)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import pytest
import torch

from upipe.memory import MemoryTracker
from upipe.model import CausalLM, get_config
from upipe.model.features import activation_checkpoint
from upipe.model.offload import Offloader

B, S, N_LAYERS = 2, 64, 4


def _model(offload: bool, n_layers: int = N_LAYERS) -> CausalLM:
    model = CausalLM(dataclasses.replace(get_config("tiny"), n_layers=n_layers))
    model.init_weights(0)
    model.recompute_blocks = True
    model.offload = Offloader(n_layers) if offload else None
    return model


def _batch(seq_len: int = S):
    ids = torch.randint(0, 257, (B, seq_len), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(seq_len).expand(B, -1)


def test_offload_trains_bit_identically_with_one_exact_arena():
    """Three AdamW steps: same losses and gradients, bit for bit, as checkpointing without
    offload; one arena of exactly n_blocks x B x L x D elements, reused every step, and after
    each backward no slot held."""
    runs = []
    for offload in (False, True):
        model = _model(offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids, pos = _batch()
        losses, grads, arenas = [], [], []
        for _ in range(3):
            loss = model(ids, pos, ids)
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            if offload:
                off = model.offload
                arenas.append((off.arena.data_ptr(), off.arena.nbytes))
                assert off._owner == [None] * N_LAYERS
        runs.append((losses, grads))
    (ref_losses, ref_grads), (losses, grads) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    for g, ref in zip(grads, ref_grads, strict=True):
        assert all(torch.equal(g[n], ref[n]) for n in ref)
    D = get_config("tiny").hidden_size
    assert set(arenas) == {(arenas[0][0], N_LAYERS * B * S * D * 4)}


class _Logged(Offloader):
    def __init__(self, n_blocks, log):
        super().__init__(n_blocks)
        self.log = log

    def load(self, token, index, device):
        self.log.append(("load", index))
        return super().load(token, index, device)


def test_backward_brings_each_block_input_back_twice_around_its_backward():
    """Block i's backward: its input comes back, it recomputes its forward, its backward
    runs, and the input comes back once more for the first norm's backward (the recomputed
    graph keeps no device copy of it in between)."""
    log = []
    model = _model(True)
    model.offload = _Logged(N_LAYERS, log)
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(
            lambda m, a, i=i: log.append(("recompute", i)) if torch.is_grad_enabled() else None
        )
        block.register_full_backward_pre_hook(lambda m, g, i=i: log.append(("backward", i)))
    ids, pos = _batch()
    model(ids, pos, ids).backward()
    expected = []
    for i in reversed(range(N_LAYERS)):
        expected += [("load", i), ("recompute", i), ("backward", i), ("load", i)]
    assert log == expected


def test_arena_follows_the_block_input_shape_exactly():
    """Kept while the block input's shape stays; on a new sequence length the old arena is
    freed and one of the new exact size made."""
    model = _model(True)
    arenas = []
    for seq_len in (S, 2 * S, 2 * S):
        ids, pos = _batch(seq_len)
        model(ids, pos, ids).backward()
        assert model.offload.arena.nbytes == N_LAYERS * B * seq_len * model.config.hidden_size * 4
        arenas.append(weakref.ref(model.offload.arena))
    assert arenas[0]() is None and arenas[1]() is arenas[2]() is model.offload.arena


def test_offload_errors():
    with pytest.raises(ValueError, match="n_blocks must be >= 1"):
        Offloader(0)
    x = torch.randn(B, 8, 4, requires_grad=True)
    with pytest.raises(ValueError, match="block index 2 out of range for 2 blocks"):
        activation_checkpoint(torch.sin, x, offload=Offloader(2), index=2)
    for offload, index in (("cpu", 0), (Offloader(2), None)):
        with pytest.raises(ValueError, match="offload must be an upipe Offloader, with the"):
            activation_checkpoint(torch.sin, x, offload=offload, index=index)
    off = Offloader(1)
    first = activation_checkpoint(torch.sin, x, offload=off, index=0)
    second = activation_checkpoint(torch.cos, x * 2, offload=off, index=0)  # overwrites slot 0
    second.sum().backward()
    with pytest.raises(RuntimeError, match="overwritten by a later forward"):
        first.sum().backward()


def test_no_block_input_stays_on_the_device_through_a_blocks_backward():
    """Measured peak of a step (the arena made by an earlier step), offload + tiled MLP: the
    block input brought back is freed once the block's forward is recomputed (the first
    norm gets it again from the host), so the peak is one [B, L, D] below keeping it."""

    def peak(free_input: bool) -> int:
        model = _model(True)
        model.loss_chunk_tokens = 32  # the blocks' backward, not the logits, sets the peak
        for block in model.model.layers:
            block.mlp.tile_tokens = 64
        ids, pos = _batch(256)
        model(ids, pos, ids).backward()  # allocates the arena
        kept = []
        if not free_input:  # keep every loaded input alive until the step ends
            load = model.offload.load
            model.offload.load = lambda *a: kept.append(load(*a).clone()) or kept[-1]
        with MemoryTracker() as mem:
            model(ids, pos, ids).backward()
        return mem.peak_bytes

    unit = B * 256 * get_config("tiny").hidden_size * 4
    assert peak(False) - peak(True) >= unit


def test_planner_counts_the_arena():
    """The simulated step's host bytes are the offloader's arena: exactly n_layers x B x L x D
    in the training dtype (nothing rounded)."""
    from upipe.planner.step import StepSimulator
    from upipe.train import TrainConfig

    cfg = TrainConfig(
        model="tiny", strategy="ulysses", nproc=2, dtype="bfloat16", activation_checkpoint=True,
        offload=True, plot=None,
    )  # fmt: skip
    with StepSimulator(cfg, 2) as sim:
        m = sim.step(2048)
        arena_bytes = sim.trainers[2].model.offload.arena.nbytes
        assert m.host_peak_bytes == arena_bytes == 2 * 1 * 1024 * 128 * 2  # bf16
        # a shorter step after a longer one: its own arena only (the planner's search
        # simulates lengths in any order; the longer step's arena once counted here)
        sim.step(8192)
        assert sim.step(2048).host_peak_bytes == m.host_peak_bytes


class _FakeStream:
    """Stands in for the CUDA side stream and the compute stream: logs what they are asked;
    events are numbered in the order they are recorded."""

    def __init__(self, name, log):
        self.name, self.log, self.device = name, log, torch.device("cpu")

    def wait_stream(self, other):
        self.log.append((self.name, "waits for", other.name))

    def record_event(self):
        event = sum(entry[1] == "records" for entry in self.log)
        self.log.append((self.name, "records", event))
        return event

    def wait_event(self, event):
        self.log.append((self.name, "waits for event", event))

    def synchronize(self):
        self.log.append(("host", "synchronizes with", self.name))


def test_cuda_calls_in_order(monkeypatch):
    """The stream, event and registration calls the offloader makes on CUDA, with CPU
    tensors and logging stand-ins (the copies themselves are real): every copy on the side
    stream after the compute stream's work, the compute stream waits for an input's copy
    before its block recomputes (and for the second copy before the first norm's backward),
    the arena is registered at its exact size and unregistered
    after the side stream is done, before a new arena is made and when the offloader goes."""
    log = []
    compute = _FakeStream("compute", log)
    cudart = type("cudart", (), {})()
    cudart.cudaHostRegister = lambda ptr, n, flags: log.append(("register", ptr, n, flags))
    cudart.cudaHostUnregister = lambda ptr: log.append(("unregister", ptr))
    side_copy = contextlib.contextmanager(lambda s: (log.append((s.name, "copies")), (yield)))
    for name, fake in [
        ("current_stream", lambda device: compute),
        ("stream", side_copy),
        ("cudart", lambda: cudart),
        ("check_error", lambda res: None),
        ("device", lambda device: contextlib.nullcontext()),
    ]:
        monkeypatch.setattr(torch.cuda, name, fake)
    model = _model(True, n_layers=2)
    off = model.offload
    off._stream = _FakeStream("side", log)  # as a CUDA input would create it
    try:
        for i, block in enumerate(model.model.layers):
            block.register_forward_pre_hook(
                lambda m, a, i=i: log.append(("recompute", i)) if torch.is_grad_enabled() else None
            )
        arenas = []
        for seq_len in (S, 2 * S):
            ids, pos = _batch(seq_len)
            model(ids, pos, ids).backward()
            arenas.append((off.arena.data_ptr(), off.arena.nbytes))
    except BaseException:
        off._unpin.detach()  # not to be called with the real cudart at exit
        raise
    del model, off  # the offloader goes: its arena is unregistered
    n = 2 * B * S * get_config("tiny").hidden_size * 4  # 2 blocks
    assert [nbytes for _, nbytes in arenas] == [n, 2 * n]
    copy = [("side", "waits for", "compute"), ("side", "copies")]

    def step(arena, e):  # events e, e + 1: forward, blocks 0 and 1 to the host; then backward
        back = []
        for block, event in ((1, e + 2), (0, e + 4)):  # each input back twice (see the module)
            back += [*copy, ("side", "records", event), ("compute", "waits for event", event)]
            back += [("recompute", block)]
            back += [*copy, ("side", "records", event + 1)]
            back += [("compute", "waits for event", event + 1)]  # for the norm's backward
        return [
            ("register", *arena, 0),
            *copy, ("side", "records", e), *copy, ("side", "records", e + 1),
            *back,
        ]  # fmt: skip

    def unregister(arena):
        return [("host", "synchronizes with", "side"), ("unregister", arena[0])]

    first, second = arenas
    assert log == step(first, 0) + unregister(first) + step(second, 6) + unregister(second)
