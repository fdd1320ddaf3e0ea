"""`upipe train` on real text: document-masked packing, a local Hugging Face tokenizer, Hugging
Face weights in and out -- each against one process or against transformers itself."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tolerances import grad_errors, rel_err
from train_workers import small_config, train_steps

from upipe.train.data import PackedTokens
from upipe.train.tokenizers import load_tokenizer

LOSS_TOL, GRAD_TOL = 1e-5, 2e-5  # as tests/runs/test_train.py: fp32, another reduction order


def _texts(n=200, seed=0):
    """Documents of 1 to 60 words: several per 128-token row, some longer than a shard."""
    rng = random.Random(seed)
    words = ("the", "of", "context", "parallel", "ring", "heads", "stage", "token", "a", "b")
    return [" ".join(rng.choices(words, k=rng.choice((1, 3, 8, 20, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts()))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE (vocabulary 300) trained on the corpus, saved as a Hugging Face
    tokenizer directory; nothing is downloaded."""
    pytest.importorskip("tokenizers")  # (the `train` extra)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_texts(), trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(d)


def _check(res, ref):
    for a, b in zip(res["losses"], ref["losses"], strict=True):
        assert abs(a - b) / abs(b) < LOSS_TOL, (res["losses"], ref["losses"])
    for name, err in grad_errors(res["grads"], ref["grads"]).items():
        assert err < GRAD_TOL, name


def test_the_rows_hold_several_documents(corpus, tokenizer_dir):
    """The fixture is what the tests below need: rows of several documents, one token long
    to longer than a 4-rank shard (32 tokens)."""
    data = PackedTokens(corpus, tokenizer=tokenizer_dir)
    lengths = [int(n) for cu in data.documents(0, 2, 128) for n in cu.diff()]
    assert len(lengths) >= 6 and min(lengths) <= 4 and max(lengths) > 32, lengths


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "kw"),
    [
        (4, {"strategy": "upipe", "fsdp": True}),  # the run: tokenizer, jsonl, FSDP
        (4, {"strategy": "ring"}),
        (4, {"strategy": "usp"}),
        (2, {"strategy": "ulysses", "batch_size": 2}),  # rows packed differently
        (4, {"strategy": "upipe", "seq_len": 125}),  # padded to 128: the padding's document
    ],
)
def test_document_masked_training_equals_one_process(clusters, corpus, tokenizer_dir, world, kw):
    base = dict(data=corpus, tokenizer=tokenizer_dir)
    ref_kw = {k: v for k, v in kw.items() if k in ("batch_size", "seq_len")}
    ref = clusters(1).run(train_steps, small_config(strategy="none", **base, **ref_kw))[0]
    _check(clusters(world).run(train_steps, small_config(**base, **kw))[0], ref)


@pytest.mark.slow
def test_document_mask_is_applied(clusters, corpus, tokenizer_dir):
    """Masking changes the losses (tokens no longer see other documents), and without it
    the run still equals one process."""
    base = dict(data=corpus, tokenizer=tokenizer_dir, document_mask=False)
    ref = clusters(1).run(train_steps, small_config(strategy="none", **base))[0]
    across = clusters(2).run(train_steps, small_config(strategy="upipe", **base))[0]
    _check(across, ref)
    masked_cfg = small_config(strategy="none", **{**base, "document_mask": True})
    masked = clusters(1).run(train_steps, masked_cfg)[0]
    assert abs(masked["losses"][0] - across["losses"][0]) > 1e-3


def _hf_llama(path, vocab_size, **extra):
    import transformers

    config = transformers.LlamaConfig(
        **extra,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.slow
def test_hugging_face_weights_in_and_out(clusters, corpus, tokenizer_dir, tmp_path):
    """--init-from-hf: the first loss is transformers' loss of that model on the first batch;
    --save-hf: transformers loads the trained weights, bit for bit those of the same run
    through the Trainer (and trained: not the initial ones), and the tokenizer it was trained
    with (the same ids; config.json keeps the source model's eos_token_id)."""
    import transformers

    src, out = tmp_path / "hf_in", tmp_path / "hf_out"
    _hf_llama(src, vocab_size=300)
    base = dict(data=corpus, tokenizer=tokenizer_dir, document_mask=False, steps=2)
    cfg = small_config(strategy="upipe", init_from_hf=str(src), save_hf=str(out), **base)
    losses = clusters(4).run(_train, cfg)[0]

    ids, labels = PackedTokens(corpus, tokenizer=tokenizer_dir).batch(0, 1, cfg.seq_len)
    hf = transformers.LlamaForCausalLM.from_pretrained(src).float()
    hf_loss = torch.nn.functional.cross_entropy(hf(input_ids=ids).logits[0], labels[0])
    assert abs(losses[0] - hf_loss.item()) / hf_loss.item() < 1e-5, (losses, hf_loss)

    saved = transformers.LlamaForCausalLM.from_pretrained(out).float().state_dict()
    same = small_config(strategy="upipe", init_from_hf=str(src), **base)
    ref = clusters(4).run(_trained_weights, same)[0]
    assert saved.keys() == ref.keys()
    for name, w in ref.items():
        assert torch.equal(saved[name], w), name
    assert rel_err(saved["lm_head.weight"], hf.state_dict()["lm_head.weight"]) > 1e-3

    trained = load_tokenizer(tokenizer_dir)
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    text = " ".join(_texts(5, seed=1))
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == trained.encode(text.encode()).tolist()
    assert loaded.eos_token_id == trained.eos_id
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == hf.config.eos_token_id


@pytest.mark.slow
def test_save_hf_from_scratch_names_the_training_eos(clusters, corpus, tokenizer_dir, tmp_path):
    """--save-hf without --init-from-hf: config.json's eos_token_id is the id that ended every
    training document (the tokenizer's EOS; with bytes, 256), and the byte tokenizer writes no
    tokenizer files (there is none transformers could load)."""
    trained_eos = load_tokenizer(tokenizer_dir).eos_id
    for tokenizer, eos in ((tokenizer_dir, trained_eos), ("bytes", 256)):
        out = tmp_path / tokenizer.replace("/", "_")
        cfg = small_config(
            strategy="upipe", data=corpus, tokenizer=tokenizer, save_hf=str(out), steps=1
        )
        clusters(2).run(_train, cfg)
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
        assert (out / "tokenizer.json").exists() == (tokenizer != "bytes")


def test_llama31_rope_scaling_from_hugging_face(clusters, corpus, tokenizer_dir, tmp_path):
    """--init-from-hf of a checkpoint with Llama 3.1's "llama3" rope scaling (pre-training
    context 32, so that the 128 tokens use scaled frequencies): upipe's context-parallel
    first loss is transformers' loss of that model on the first batch."""
    import transformers

    src = tmp_path / "hf_in"
    rope = dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32,
    )  # fmt: skip
    # weights large enough that the scaling moves the loss (by 1e-3 relative; 7e-6 at the
    # default initializer_range 0.02, under the tolerance)
    _hf_llama(src, vocab_size=300, rope_parameters=rope, initializer_range=0.3)
    base = dict(data=corpus, tokenizer=tokenizer_dir, document_mask=False, steps=1)
    cfg = small_config(strategy="upipe", init_from_hf=str(src), **base)
    losses = clusters(2).run(_train, cfg)[0]
    ids, labels = PackedTokens(corpus, tokenizer=tokenizer_dir).batch(0, 1, cfg.seq_len)
    hf = transformers.LlamaForCausalLM.from_pretrained(src).float()
    hf_loss = torch.nn.functional.cross_entropy(hf(input_ids=ids).logits[0], labels[0])
    assert abs(losses[0] - hf_loss.item()) / hf_loss.item() < 1e-5, (losses, hf_loss)


def _train(rank, world_size, cfg):
    from upipe.train import train

    return [row["loss"] for row in train(cfg)]


def _trained_weights(rank, world_size, cfg):
    """The masters after cfg.steps steps, by (Hugging Face) parameter name."""
    from upipe.train import Trainer

    trainer = Trainer(cfg, torch.device("cpu"))
    for step in range(cfg.steps):
        trainer.forward_backward(step)
        trainer.optimizer_step()
    return {n: p.detach().clone() for n, p in trainer.master.state_dict().items()}
