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


def _adamw_steps(model: CausalLM, steps: int, after_step=None):
    """(losses, gradients) of `steps` AdamW steps on one batch; `after_step(model)` after each."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, pos = _batch()
    losses, grads = [], []
    for _ in range(steps):
        loss = model(ids, pos, ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step:
            after_step(model)
    return losses, grads


def _assert_same(ref, run):
    """Bit for bit the same losses and gradients (`_adamw_steps`' results)."""
    (ref_losses, ref_grads), (losses, grads) = ref, run
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    for g, want in zip(grads, ref_grads, strict=True):
        assert all(torch.equal(g[n], want[n]) for n in want)


def test_offload_trains_bit_identically_with_one_exact_arena():
    """Three AdamW steps: same losses and gradients, bit for bit, as checkpointing without
    offload; one arena of exactly n_blocks x B x L x D elements, reused every step, and after
    each backward no slot held."""
    arenas = []

    def arena(model):
        off = model.offload
        arenas.append((off.arena.data_ptr(), off.arena.nbytes))
        assert off._owner == [None] * N_LAYERS

    _assert_same(_adamw_steps(_model(False), 3), _adamw_steps(_model(True), 3, arena))
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
    with pytest.raises(ValueError, match="n_inputs must be >= 1"):
        Offloader(0)
    x = torch.randn(B, 8, 4, requires_grad=True)
    with pytest.raises(ValueError, match="slot index 2 out of range for 2 slots"):
        activation_checkpoint(torch.sin, x, offload=Offloader(2), index=2)
    for offload, index in (("cpu", 0), (Offloader(2), None)):
        with pytest.raises(
            ValueError, match="offload must be an upipe Offloader, with the segment"
        ):
            activation_checkpoint(torch.sin, x, offload=offload, index=index)
    off = Offloader(1)
    first = activation_checkpoint(torch.sin, x, offload=off, index=0)
    second = activation_checkpoint(torch.cos, x * 2, offload=off, index=0)  # overwrites slot 0
    second.sum().backward()
    with pytest.raises(RuntimeError, match="overwritten by a later forward"):
        first.sum().backward()


@pytest.mark.slow
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


@pytest.mark.slow
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


def _segmented(m: int, offload: bool, keep: int) -> CausalLM:
    from upipe.train.parallelize import MemoryFeatures, make_offloader

    model = _model(False)
    model.recompute_blocks = m
    features = MemoryFeatures(activation_checkpoint=True, blocks_per_checkpoint=m, keep_on_gpu=keep)
    model.offload = make_offloader(N_LAYERS, features) if offload else None
    return model


@pytest.mark.parametrize(
    "m, offload, keep", [(2, False, 0), (3, False, 0), (2, True, 0), (3, True, 1), (1, True, 2)]
)
def test_segments_and_kept_inputs_train_bit_identically(m, offload, keep):
    """Checkpoints of m blocks (3: segments of 3 and 1 of the 4 blocks), offloaded or not,
    the last `keep` checkpoints' inputs on the device: two AdamW steps give the same losses
    and gradients, bit for bit, as one block per checkpoint without offload (the same
    kernels on the same inputs, only recomputed more often); the arena holds a slot per
    offloaded checkpoint plus m - 1 scratch slots, and no slot is held after a backward."""
    model = _segmented(m, offload, keep)
    _assert_same(_adamw_steps(_model(False), 2), _adamw_steps(model, 2))
    off = model.offload
    if offload:
        n_inputs = -(-N_LAYERS // m) - keep
        D = get_config("tiny").hidden_size
        assert (off.n_inputs, off.scratch) == (n_inputs, m - 1)
        assert off.arena.nbytes == (n_inputs + m - 1) * B * S * D * 4
        assert off._owner == [None] * (n_inputs + m - 1)


def test_segment_backward_order():
    """Segments of 2 blocks, 4 blocks, offloaded: a segment's backward brings its input back,
    recomputes its first block's output without a graph into the scratch slot (index 2),
    then runs block 2j+1's backward from the scratch slot and block 2j's from its own slot,
    each as a single block's (input back, recompute, backward, input back for the norm)."""
    log = []
    model = _segmented(2, True, 0)
    off = model.offload
    model.offload = _Logged(off.n_inputs, log)
    model.offload.scratch, model.offload.n_slots = off.scratch, off.n_slots
    model.offload._owner = [None] * off.n_slots
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(
            lambda m, a, i=i: log.append(("recompute" if torch.is_grad_enabled() else "run", i))
        )
        block.register_full_backward_pre_hook(lambda m, g, i=i: log.append(("backward", i)))
    ids, pos = _batch()
    model(ids, pos, ids).backward()
    expected = [("run", i) for i in range(N_LAYERS)]  # the forward
    for j in (1, 0):  # segment j: blocks 2j, 2j + 1; slots j and 2 (scratch)
        expected += [("load", j), ("run", 2 * j)]
        expected += [("load", 2), ("recompute", 2 * j + 1), ("backward", 2 * j + 1), ("load", 2)]
        expected += [("load", j), ("recompute", 2 * j), ("backward", 2 * j), ("load", j)]
    assert log == expected


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_segments_in_the_planner(offload):
    """Simulated step, 8 blocks of Llama3-8B's MLP ratio and head_dim, 4 query heads on 2 kv
    heads (few heads: a simulated step costs per operator, and each UPipe stage adds some;
    the block inputs compared here are [B, L, D] whatever the heads), 64K tokens on 2
    ranks, all memory features: checkpoints of 2 blocks keep 4 inputs (+ 1 scratch slot
    with offload) where single blocks keep 8. With offload the host arena shrinks from 8 to
    5 slots and the device peak does not change (the segment's gradient buffer is reused for
    its inner block, see `features._Checkpoint`); without, 4 inputs fewer are saved, and a
    segment's backward holds its second block's input besides: more than 2 [B, L, D] less
    (3.0 here, 2.59 with Llama3-8B's 32 heads of 16: the peaks fall in different places of
    the blocks' backward)."""
    from upipe.planner.step import StepSimulator
    from upipe.train import TrainConfig

    model = dataclasses.replace(
        get_config("llama3-8b"), n_layers=8, hidden_size=512, ffn_dim=1792,
        n_heads=4, n_kv_heads=2, head_dim=128, vocab_size=512,
    )  # fmt: skip
    kw = dict(
        strategy="upipe", nproc=2, dtype="bfloat16", activation_checkpoint=True, offload=offload,
        tiled_mlp=True, mlp_tile=4096, chunked_loss=True, loss_chunk=4096, plot=None,
    )  # fmt: skip
    S, unit = 65536, 32768 * 512 * 2  # one [B, L, D] in bf16
    steps = {}
    for m in (1, 2):
        cfg = TrainConfig(**kw, blocks_per_checkpoint=m)
        with StepSimulator(cfg, 2, model) as sim:
            steps[m] = sim.step(S)
    if offload:
        assert (steps[1].host_peak_bytes, steps[2].host_peak_bytes) == (8 * unit, 5 * unit)
        assert steps[2].peak_bytes == steps[1].peak_bytes
    else:
        assert steps[1].peak_bytes - steps[2].peak_bytes > 2 * unit


def test_segment_and_keep_errors():
    from upipe.train import TrainConfig
    from upipe.train.config import validate

    def problem(**kw):
        return validate(TrainConfig(model="tiny", nproc=2, plot=None, **kw), 2)

    assert problem(blocks_per_checkpoint=2) == (
        "--blocks-per-checkpoint 2 needs --activation-checkpoint"
    )
    assert problem(activation_checkpoint=True, keep_on_gpu=1) == (
        "--keep-on-gpu 1 keeps some offloaded inputs on the GPU: it needs --offload"
    )
    assert "must be >= 1 and --keep-on-gpu >= 0, got 0, 0" in problem(blocks_per_checkpoint=0)
    on = {"activation_checkpoint": True, "offload": True}
    assert problem(**on, keep_on_gpu=1) is None  # tiny: 2 blocks, 2 checkpoints
    assert problem(**on, keep_on_gpu=2) == (
        "--keep-on-gpu 2 keeps all 2 checkpoints (2 blocks / 1 per checkpoint) on the GPU: "
        "use at most 1, or drop --offload"
    )
    with pytest.raises(ValueError, match="a segment of 3 functions recomputes 2 inputs"):
        x = torch.randn(B, 8, 4, requires_grad=True)
        activation_checkpoint([torch.sin] * 3, x, offload=Offloader(1, scratch=1), index=0)
