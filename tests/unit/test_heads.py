"""`upipe.heads`: the head rules in their callers' words, and the plans its callers take from
it (the planner's candidates, the DeepSpeed drop-in's stages, the benchmark's skips). No
process is spawned; the plans' exactness is tests/distributed/test_uneven_heads.py's."""

import importlib.util

import pytest

from upipe import heads


def test_rules_in_the_callers_words():
    assert heads.kv_problem(8, 4) is None
    assert (
        heads.kv_problem(8, 3)
        == "kv heads (3) must divide query heads (8); valid kv heads: [1, 2, 4, 8]"
    )
    assert heads.kv_problem(8, 0, query="--heads", kv="--kv-heads").startswith(
        "--kv-heads (0) must divide --heads (8)"
    )
    assert heads.few_heads_problem(4, 4) is None
    msg = heads.few_heads_problem(2, 4, size="ulysses size", query="num_heads")
    assert msg.startswith("num_heads (2) must be at least the ulysses size (4)")
    assert "use a size of at most 2, or ring attention" in msg
    cli = heads.few_heads_problem(8, 16, size="ulysses size", whole="--strategy ring", model="tiny")
    assert cli == (
        "tiny has 8 heads, fewer than the ulysses size 16; use a size of at most 8, "
        "or --strategy ring"
    )


@pytest.mark.parametrize(
    "H,G,C,uneven,even_ulysses",
    [
        (32, 8, 8, False, True),
        (32, 4, 8, False, False),
        (28, 4, 8, True, False),
        (12, 3, 4, True, False),
    ],
)
def test_even_and_uneven_splits(H, G, C, uneven, even_ulysses):
    assert heads.is_uneven(H, G, C) is uneven
    assert heads.even_ulysses(H, G, C) is even_ulysses
    assert (heads.even_problem(H, G, C) is not None) is uneven
    assert (heads.ulysses_split(H, G, C, 0) is None) is even_ulysses


def test_even_problem_lists_the_sizes_that_work():
    assert heads.even_problem(28, 4, 8) == (
        "the group size (8) must divide the query heads (28); use a size in [1, 2, 4, 7, 14, 28]"
    )
    assert heads.even_problem(12, 3, 4, size="mesh axis size").endswith(
        "use a size in [1, 3, 6, 12]"
    )


def test_drop_in_stages():
    """Stage s: query heads s*U ..; each rank the kv heads of its U / C (the drop-in's plan)."""
    assert heads.contiguous_stages(8, 4, 4, 4) == [(0, [0, 0, 1, 1]), (4, [2, 2, 3, 3])]
    assert heads.contiguous_stages(8, 4, 4, 8) == [(0, [0, 1, 2, 3])]
    assert heads.contiguous_stages(8, 8, 2, None) == [
        (0, [0, 1]),
        (2, [2, 3]),
        (4, [4, 5]),
        (6, [6, 7]),
    ]
    with pytest.raises(ValueError, match=r"heads_per_stage \(6\) must be a multiple.*: \[4, 8\]"):
        heads.contiguous_stages(8, 4, 4, 6)
    with pytest.raises(ValueError, match=r"kv heads G \(3\) must divide the query heads H \(8\)"):
        heads.contiguous_stages(8, 3, 4, None)


def test_planner_candidates():
    assert heads.stage_candidates(32, 8) == (8, 16)
    assert heads.stage_candidates(12, 8) == (8,)
    # USP's ulysses size: gcd(GPUs, kv heads), halved where it would take every GPU
    assert [heads.usp_ulysses_size(n, G) for n, G in ((8, 8), (16, 8), (8, 2), (1, 8))] == [
        4,
        8,
        2,
        1,
    ]


def test_bench_model_methods_use_each_sides_rule():
    """`upipe bench --whole-model`: upipe's methods take any head counts the library takes (uneven
    splits included); ALST's need its even split, the drop-in its contiguous stages."""
    from upipe.bench.model import ModelMethod

    for name in ("upipe", "upipe-ulysses", "upipe-full", "upipe-train"):
        assert ModelMethod(name).problem(H=28, G=4, C=8) is None, name
        assert "--heads (4) must be at least the number of ranks (8)" in ModelMethod(name).problem(
            H=4, G=4, C=8
        )
    for name in ("alst", "alst-full", "upipe-dropin"):  # (or: deepspeed is not installed)
        assert ModelMethod(name).problem(H=28, G=4, C=8) is not None, name
    if importlib.util.find_spec("deepspeed") is not None:
        assert ModelMethod("alst").problem(H=32, G=4, C=8) is None
        assert "(8) must divide the query heads (28)" in ModelMethod("alst").problem(H=28, G=4, C=8)
    assert (
        ModelMethod("upipe")
        .problem(H=8, G=3, C=2)
        .startswith("upipe: --kv-heads (3) must divide --heads (8)")
    )
