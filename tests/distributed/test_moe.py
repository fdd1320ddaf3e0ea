"""The mixture-of-experts MLP (`upipe.model.moe`): the grouped GEMM, routing, the block and
its balance loss against dense float64 references, the memory features, its saved memory
against the closed form, training on 2 gloo ranks against one process, and the planner."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from moe_workers import moe_steps
from plan_workers import assert_simulated_peak_equals_real
from tolerances import grad_errors, rel_err
from train_workers import small_config

from upipe.memory import MemoryTracker
from upipe.memory.model import moe_saved_bytes_per_token
from upipe.model import CausalLM, ModelConfig, get_config
from upipe.model.moe import MoE, RouterStats, grouped_linear, route

TINY_MOE = get_config("tiny-moe")


def test_grouped_linear_equals_a_loop_over_experts():
    """Segments of rows times their expert's matrix, forward and backward, an expert with
    no rows included (its weight gradient is zero)."""
    torch.manual_seed(0)
    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, 6, dtype=torch.float64, requires_grad=True)
    ends = torch.tensor([3, 3, 7, 10])
    y = grouped_linear(x, w, ends)
    bounds = [(0, 3, 0), (3, 7, 2), (7, 10, 3)]
    ref = torch.cat([x[a:b] @ w[e].T for a, b, e in bounds])
    assert rel_err(y, ref) < 1e-12
    g = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    assert rel_err(dx, rx) < 1e-12 and rel_err(dw, rw) < 1e-12
    assert dw[1].abs().max() == 0 and dw.is_contiguous()


@pytest.mark.parametrize("weights", ["softmax", "softmax_renorm", "topk_softmax"])
def test_router_weights(weights):
    torch.manual_seed(0)
    z = torch.randn(7, 6, dtype=torch.float64)
    probs, idx, w = route(z, 2, weights)
    p = torch.softmax(z, -1)
    top = p.topk(2, -1)
    assert torch.equal(idx, top.indices)
    want = {"softmax": top.values, "softmax_renorm": top.values / top.values.sum(-1, True)}
    assert rel_err(w, want.get(weights, want["softmax_renorm"])) < 1e-12  # gpt-oss = renorm
    assert rel_err(probs, p) < 1e-12


def _dense_moe(m: MoE, x_ND, mask_N, coef):
    """The MoE block computed densely (every expert on every token, weighted by the router's
    scattered top-k weights) and its balance loss by the formula, in autograd."""
    E = m.gate.weight.shape[0]
    probs, idx, w = route(m.gate(x_ND), m.k, m.router_weights)
    W_NE = torch.zeros_like(probs).scatter(1, idx, w).to(x_ND.dtype)
    gu, down = m.experts.gate_up_proj, m.experts.down_proj
    y = 0
    for e in range(E):
        gate, up = (x_ND @ gu[e].T).chunk(2, -1)
        y = y + W_NE[:, e : e + 1] * ((F.silu(gate) * up) @ down[e].T)
    if m.shared_expert is not None:
        y = y + m.shared_expert(x_ND)
    c = torch.zeros(E, dtype=torch.float64).scatter_add(
        0, idx.reshape(-1), mask_N.repeat_interleave(m.k)
    )
    n = mask_N.sum()
    aux = E * ((c / n) * ((probs * mask_N[:, None]).sum(0) / n)).sum()
    return y, coef * aux, aux


@pytest.mark.parametrize("weights", ["softmax", "softmax_renorm", "topk_softmax"])
@pytest.mark.parametrize("shared", [0, 24])
def test_block_equals_dense_reference_float64(weights, shared):
    """Output, balance loss and every gradient (router included: through the weights and the
    balance loss) of the grouped-GEMM block against the dense reference; padding (mask 0)
    counts in neither the counts nor the probabilities."""
    cfg = dataclasses.replace(
        TINY_MOE, hidden_size=16, expert_ffn_dim=12, shared_expert_ffn_dim=shared,
        n_experts=5, experts_per_token=2, router_weights=weights,
    )  # fmt: skip
    torch.manual_seed(0)
    m = MoE(cfg).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    g = torch.randn(2, 9, 16, dtype=torch.float64)
    coef = 0.3
    m.stats = RouterStats(1, 5, coef, "cpu")
    y = m(x, mask)
    aux = m.stats.finish()
    params = [x, *m.parameters()]
    got = torch.autograd.grad((y * g).sum(), params)
    y_ref, objective, aux_ref = _dense_moe(m, x.view(-1, 16), mask.view(-1).double(), coef)
    ref = torch.autograd.grad((y_ref.view_as(g) * g).sum() + objective, params)
    assert rel_err(y, y_ref.view_as(y)) < 1e-12
    assert abs(aux.item() - aux_ref.item()) < 1e-6 * aux_ref.item()  # (aux is fp32)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < 1e-10


def test_balance_loss_equals_transformers_for_one_block():
    """One block: Switch/Mixtral's loss as transformers computes it (pooled over blocks,
    which for one block is ours), with and without padding."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    m = MoE(TINY_MOE)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    x = torch.randn(1, 40, TINY_MOE.hidden_size)
    for mask in (None, torch.arange(40)[None] < 31):
        m.stats = RouterStats(1, TINY_MOE.n_experts, 0.0, "cpu")
        m(x, mask)
        ours = m.stats.finish()
        hf = load_balancing_loss_func(
            (m.gate(x[0]),), TINY_MOE.n_experts, TINY_MOE.experts_per_token, mask
        )
        assert abs(ours.item() - hf.item()) < 1e-6, mask


def _loss_and_grads(model, ids, pos, labels):
    for p in model.parameters():
        p.grad = None
    loss = model(ids, pos, labels) / (labels != -100).sum()
    loss.backward()
    return (
        loss.item(),
        model.router_aux_loss.item(),
        {n: p.grad.clone() for n, p in model.named_parameters()},
    )


@pytest.mark.parametrize(
    "features",
    [{"tile": 16}, {"recompute": 1}, {"recompute": 2, "tile": 20}],
)
def test_memory_features_do_not_change_the_math(features):
    """Tiled MLP (the router on each tile, recomputed in backward), activation checkpointing
    (of each block, and of both blocks as one) and both: the same loss, balance loss and
    gradients (float64)."""
    torch.manual_seed(0)
    model = CausalLM(TINY_MOE).double()
    model.init_weights(0)
    model.double()
    S = 48
    ids, labels = torch.randint(0, 257, (2, S)), torch.randint(0, 257, (2, S))
    labels[1, 40:] = -100  # padding: not in the loss, not in the balance
    pos = torch.arange(S).expand(2, -1)
    ref = _loss_and_grads(model, ids, pos, labels)
    model.recompute_blocks = features.get("recompute", 0)
    for block in model.model.layers:
        block.mlp.tile_tokens = features.get("tile")
    got = _loss_and_grads(model, ids, pos, labels)
    assert abs(got[0] - ref[0]) < 1e-12 and abs(got[1] - ref[1]) < 1e-6
    for name, err in grad_errors(got[2], ref[2]).items():
        assert err < 1e-10, name


def test_dense_model_unchanged_by_the_moe_fields():
    """n_experts=0: the same modules and parameter names as before (checkpoints unchanged)."""
    dense = CausalLM(get_config("tiny"))
    assert "model.layers.0.mlp.gate_proj.weight" in dict(dense.named_parameters())
    assert dense.router_aux_loss is None
    names = dict(CausalLM(TINY_MOE).named_parameters())
    for key in ("gate.weight", "experts.gate_up_proj", "experts.down_proj",
                "shared_expert.gate_proj.weight"):  # fmt: skip
        assert f"model.layers.1.mlp.{key}" in names


@pytest.mark.parametrize("name", ["tiny-moe", "qwen3-30b-a3b"])
def test_num_params_total_and_active(name):
    cfg = get_config(name)
    if name == "tiny-moe":
        assert cfg.num_params() == sum(p.numel() for p in CausalLM(cfg).parameters())
    else:  # the published sizes: 30.5B in all, 3.3B activated
        assert round(cfg.num_params() / 1e9, 1) == 30.5
        assert round(cfg.num_params(active=True) / 1e9, 1) == 3.4  # 3.35B (3.3B w/o embed)
    D, E, K, F = cfg.hidden_size, cfg.n_experts, cfg.experts_per_token, cfg.expert_ffn_dim
    assert cfg.num_params() - cfg.num_params(active=True) == cfg.n_layers * (E - K) * 3 * D * F


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"experts_per_token": 9}, "experts_per_token (9) must be in 1..n_experts (8)"),
        ({"experts_per_token": 0}, "experts_per_token (0) must be in 1..n_experts (8)"),
        ({"expert_ffn_dim": 0}, "expert_ffn_dim must be >= 1"),
        ({"shared_expert_ffn_dim": -1}, "shared_expert_ffn_dim >= 0"),
        ({"router_weights": "sigmoid"}, "router_weights must be one of"),
        ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef must be >= 0"),
    ],
)
def test_bad_config_is_a_clear_error(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(TINY_MOE, **kw)
    ModelConfig(experts_per_token=99)  # dense: the MoE fields are not used


@pytest.mark.parametrize(
    "dtype,shared,weights",
    [
        (torch.float32, 0, "softmax_renorm"),
        (torch.bfloat16, 0, "softmax_renorm"),
        (torch.float32, 96, "softmax"),
        (torch.bfloat16, 96, "topk_softmax"),
    ],
)
def test_saved_memory_equals_closed_form(dtype, shared, weights):
    cfg = dataclasses.replace(TINY_MOE, shared_expert_ffn_dim=shared, router_weights=weights)
    torch.manual_seed(0)
    m = MoE(cfg).to(dtype)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    N = 256
    x = torch.randn(1, N, cfg.hidden_size, dtype=dtype, requires_grad=True)
    m.stats = RouterStats(1, cfg.n_experts, 0.01, "cpu")
    mask = torch.ones(1, N, dtype=torch.bool)
    with MemoryTracker() as mem:
        y = m(x, mask)
        saved = mem.current_bytes - y.untyped_storage().nbytes()
    per_token = moe_saved_bytes_per_token(
        D=cfg.hidden_size, E=cfg.n_experts, K=cfg.experts_per_token, F=cfg.expert_ffn_dim,
        F_shared=shared, elem_bytes=dtype.itemsize, router_weights=weights,
    )  # fmt: skip
    assert saved == N * per_token + 8 * cfg.n_experts


# Training parity, fp32: one step's gradients as close as the dense model's (the same
# tolerance as test_train.py); the loss curve within 1e-6 relative (measured: 7.8e-7).
# The balance loss is a function of the router alone, and Adam moves each router weight by
# about lr whatever its gradient's size, so a reduction-order difference (1e-7) in a
# near-zero router gradient becomes a full step one way or the other: the balance loss
# equals at step 1 (no update yet) within LOSS_TOL and after updates within AUX_TOL
# (measured 2026-12-02: 3.4e-6 and 4.1e-6 at step 3, here and in CI). Such a step can also
# move a token's routing across a near-tie, and then the loss itself jumps: at lr 1e-2 the
# third step's loss differed by 2.2e-5 (the balance loss by 1.2e-4) for one training corpus
# (upipe's own sources, which change with every edit: 2026-12-06); at lr 1e-3 the losses of
# 8 steps stayed within 1e-7 and the balance losses within 1.1e-7, so these runs use it.
LOSS_TOL, GRAD_TOL, AUX_TOL = 1e-6, 2e-5, 5e-5


def _moe_config(**kw):
    """small_config for tiny-moe at lr 1e-3 (the routing near-ties above)."""
    return small_config(**{"model": "tiny-moe", "lr": 1e-3, **kw})


@pytest.fixture(scope="module")
def single(clusters):
    return clusters(1).run(moe_steps, _moe_config(strategy="none"))[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {"strategy": "upipe"},
        {"strategy": "upipe", "fsdp": True, "tiled_mlp": True, "mlp_tile": 16,
         "activation_checkpoint": True},
        {"strategy": "ulysses", "chunked_loss": True, "loss_chunk": 24},
    ],
)  # fmt: skip
def test_training_on_two_ranks_equals_one_process(clusters, single, kw):
    """The balance is over the whole sequence: upipe on 2 gloo ranks (each holding half of
    it) gives the single process's losses, balance losses and gradients."""
    got = clusters(2).run(moe_steps, _moe_config(**kw))[0]
    _assert_same_training(got, single)


def _assert_same_training(got: dict, want: dict) -> None:
    """moe_steps' results equal: losses, balance losses (see AUX_TOL), step 1's gradients."""
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a - b) < LOSS_TOL * abs(b), (got["losses"], want["losses"])
    for step, (a, b) in enumerate(zip(got["aux"], want["aux"], strict=True)):
        assert abs(a - b) < (AUX_TOL if step else LOSS_TOL) * abs(b), (got["aux"], want["aux"])
    for name, err in grad_errors(got["grads"], want["grads"]).items():
        assert err < GRAD_TOL, name


@pytest.mark.slow
def test_data_parallel_is_the_mean_over_calls(clusters):
    """Strategy none on 2 ranks (dp 2, a sequence each) equals one process taking both
    sequences as 2 micro-batches: the balance term is the mean over the step's calls."""
    dp = clusters(2).run(moe_steps, _moe_config(strategy="none"))[0]
    one = clusters(1).run(moe_steps, _moe_config(strategy="none", grad_accum=2))
    _assert_same_training(dp, one[0])


@pytest.mark.slow
def test_simulated_peak_equals_real_run(clusters):
    """The planner's simulation of tiny-moe under fake tensors (experts, router buffers,
    dispatch indices) against a real 2-rank step."""
    cfg = small_config(model="tiny-moe", strategy="upipe", nproc=2)
    assert_simulated_peak_equals_real(clusters, cfg)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"model": "tiny", "router_aux_loss_coef": 0.1}, "--router-aux-loss-coef weighs"),
        ({"model": "tiny-moe", "save_hf": "out"}, "--save-hf: tiny-moe is a mixture-of-experts"),
    ],
)
def test_train_options_an_moe_model_cannot_take(kw, message):
    from upipe.train.config import validate

    assert message in validate(small_config(**kw), 2)


def test_aux_coef_option_replaces_the_presets():
    from upipe.model.hf_checkpoint import hf_config
    from upipe.train.config import model_config, validate

    cfg = small_config(model="tiny-moe", router_aux_loss_coef=0.5)
    assert validate(cfg, 2) is None and model_config(cfg).router_aux_loss_coef == 0.5
    with pytest.raises(ValueError, match="no Hugging Face conversion"):
        hf_config(TINY_MOE, dtype=torch.float32)


@pytest.mark.slow
def test_flop_count_charges_k_experts_per_token():
    """The time model's GEMM FLOPs of a tiny-moe step (6 blocks, 2 ranks, bf16, FSDP) equal
    the closed form: per block forward 2 L D (H + 2G) d + 2 L H d D (attention projections)
    + 2 L D E (router) + 6 L D K F (K experts, not E) + 6 L D F_s (shared), backward twice
    the forward; plus the head (the combine is a sum, no GEMM)."""
    from upipe.planner.timing import count_step
    from upipe.train.config import TrainConfig

    m = dataclasses.replace(TINY_MOE, n_layers=6)
    C, S, unit = 2, 256, 64
    cfg = TrainConfig(
        model="tiny-moe", plot=None, strategy="ulysses", nproc=C, fsdp=True,
        dtype="bfloat16", seq_len=unit,
    )  # fmt: skip
    counts = count_step(cfg, C, m, S, unit=unit, depths=(3, 4))
    D, H, G, d, V = m.hidden_size, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size
    E, K, F_, Fs = m.n_experts, m.experts_per_token, m.expert_ffn_dim, m.shared_expert_ffn_dim
    L = S // C
    attn = 2 * L * D * (H + 2 * G) * d + 2 * L * H * d * D
    mlp = 2 * L * D * E + 6 * L * D * K * F_ + 6 * L * D * Fs
    assert counts["gemm_flops"] == m.n_layers * 3 * (attn + mlp) + 3 * 2 * L * D * V
