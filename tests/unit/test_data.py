"""upipe.train.data and upipe.train.tokenizers: tokenizers, the packed stream, document
boundaries, held-out data and saved Hugging Face datasets. Tokenizers are trained here on a
few strings; nothing is downloaded."""

from __future__ import annotations

import json

import pytest
import torch

from upipe.loss import IGNORE_INDEX
from upipe.train.data import PackedTokens, corpus_files, held_out, mask_document_ends
from upipe.train.tokenizers import EOS, ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = [f"document {i}: " + "the quick brown fox jumps " * (i % 7) for i in range(60)]
TEXTS[5] = ""  # an empty document is just its EOS
TEXTS[9] = "contains <|endoftext|> as text, and ünïcödé"


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture
def corpus(tmp_path):
    """Three JSON-lines files of 20 documents each."""
    d = tmp_path / "corpus"
    d.mkdir()
    for k in range(3):
        write_jsonl(d / f"part{k}.jsonl", TEXTS[20 * k : 20 * k + 20])
    return str(d)


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    """A byte-level BPE trained on TEXTS, saved as tokenizer.json + tokenizer_config.json."""
    pytest.importorskip("tokenizers")  # (the `train` extra)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS, trainer)
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return d


def split_documents(stream, eos):
    """The documents (id tuples, EOS dropped) of a token stream that ends with an EOS."""
    docs, start = [], 0
    for i in (stream == eos).nonzero().flatten().tolist():
        docs.append(tuple(stream[start:i].tolist()))
        start = i + 1
    return docs


def expected_cu(input_ids_S, eos):
    """cu_seqlens from first principles: a boundary right after every EOS inside the row."""
    S = input_ids_S.numel()
    inner = [p + 1 for p in (input_ids_S == eos).nonzero().flatten().tolist() if p + 1 < S]
    return torch.tensor([0, *inner, S], dtype=torch.int32)


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.eos_id) == (257, EOS)
    assert tok.encode("é".encode()).tolist() == [0xC3, 0xA9]
    assert tok.encode(b"").numel() == 0


def test_hf_tokenizer_from_dir_and_file(hf_tokenizer_dir):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    for spec in (hf_tokenizer_dir, hf_tokenizer_dir / "tokenizer.json"):
        tok = load_tokenizer(str(spec))
        assert isinstance(tok, HFTokenizer)
        assert tok.eos_id == ref.token_to_id("<|endoftext|>")
        assert tok.vocab_size == ref.get_vocab_size() == 320
        text = "the quick brown fox"
        assert tok.encode(text.encode()).tolist() == ref.encode(text).ids
    # the EOS string inside a document is plain text, never the EOS id
    ids = tok.encode(TEXTS[9].encode())
    assert tok.eos_id not in ids.tolist() and ids.numel() > 10


def test_hf_tokenizer_eos_from_special_tokens_map(hf_tokenizer_dir):
    (hf_tokenizer_dir / "tokenizer_config.json").unlink()
    (hf_tokenizer_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<pad>", "lstrip": False}})
    )
    assert load_tokenizer(str(hf_tokenizer_dir)).eos_id == 1


def test_hf_tokenizer_errors(hf_tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "nothing"))
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"")
    with pytest.raises(ValueError, match="save_pretrained"):
        load_tokenizer(str(tmp_path / "sp"))
    with pytest.raises(ValueError, match="not in its vocabulary"):
        HFTokenizer.from_path(hf_tokenizer_dir, eos_token="<|im_end|>")
    (hf_tokenizer_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no EOS token"):
        load_tokenizer(str(hf_tokenizer_dir))


# --------------------------------------------------------------------------- the stream


def test_byte_stream_is_documents_plus_eos(corpus):
    data = PackedTokens(corpus, seed=1)
    files = corpus_files(corpus)
    assert sorted(data.files) == files and data.files != files  # shuffled by the seed
    n = sum(len(t.encode()) + 1 for t in TEXTS)
    docs = split_documents(data.tokens(0, n), EOS)
    order = [json.loads(line)["text"] for f in data.files for line in f.read_text().splitlines()]
    assert docs == [tuple(t.encode()) for t in order]
    assert torch.equal(data.tokens(n, 2 * n), data.tokens(0, n))  # repeats end to end
    ids_BS, labels_BS = data.batch(3, 2, 40)
    assert ids_BS.shape == labels_BS.shape == (2, 40) and ids_BS.dtype == torch.long
    assert torch.equal(ids_BS[0], data.tokens(240, 280))
    assert torch.equal(labels_BS[1], data.tokens(281, 321))


def test_hf_stream_is_lazy_and_deterministic(corpus, hf_tokenizer_dir):
    tok = load_tokenizer(str(hf_tokenizer_dir))
    calls = []
    encode = tok.encode
    tok.encode = lambda text: calls.append(text) or encode(text)
    data = PackedTokens(corpus, seed=2, tokenizer=tok)
    assert data.vocab_size == 320 and data.eos_id == tok.eos_id
    late = data.batch(1, 2, 16)
    assert 0 < len(calls) < 10  # only the documents that reach token 65 were tokenized
    # the same batches in another order, from a fresh stream with the tokenizer by path
    other = PackedTokens(corpus, seed=2, tokenizer=str(hf_tokenizer_dir))
    early = other.batch(0, 2, 16)
    assert all(torch.equal(a, b) for a, b in zip(other.batch(1, 2, 16), late, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(data.batch(0, 2, 16), early, strict=True))
    n = sum(encode(t.encode()).numel() + 1 for t in TEXTS)
    docs = split_documents(data.tokens(0, n), tok.eos_id)
    assert sorted(docs) == sorted(tuple(encode(t.encode()).tolist()) for t in TEXTS)


@pytest.mark.parametrize("seq_len", [1, 7, 64, 300])
def test_documents_match_the_eos_positions(corpus, seq_len):
    data = PackedTokens(corpus, seed=0)
    for index in range(6):
        ids_BS, labels_BS = data.batch(index, 3, seq_len)
        cus = data.documents(index, 3, seq_len)
        assert len(cus) == 3
        masked_BS = mask_document_ends(ids_BS, labels_BS, data.eos_id)
        for b, cu in enumerate(cus):
            assert cu.dtype == torch.int32
            assert torch.equal(cu, expected_cu(ids_BS[b], EOS))
            assert (cu[1:] > cu[:-1]).all() and cu[0] == 0 and cu[-1] == seq_len
            # masked: the last token of every document that ends inside the row
            ends = set((cu[1:-1] - 1).tolist())
            if ids_BS[b, -1] == EOS:
                ends.add(seq_len - 1)
            is_masked = masked_BS[b] == IGNORE_INDEX
            assert set(is_masked.nonzero().flatten().tolist()) == ends
            assert torch.equal(masked_BS[b][~is_masked], labels_BS[b][~is_masked])


def test_documents_cut_by_the_row_edges(tmp_path):
    # documents of 3 bytes + EOS: the stream is period 4
    data = PackedTokens(str(write_jsonl(tmp_path / "d.jsonl", ["abc"] * 4)), seed=0)
    assert data.documents(0, 1, 4)[0].tolist() == [0, 4]  # row = one whole document
    assert data.documents(0, 1, 6)[0].tolist() == [0, 4, 6]
    # row 1 of length 6 starts at token 6 ('c', EOS, 'a', ...): a cut document, then one
    assert data.documents(1, 1, 6)[0].tolist() == [0, 2, 6]
    assert data.documents(0, 2, 5)[1].tolist() == [0, 3, 5]  # starts at 5: 'b','c',EOS|'a','b'
    ids, labels = data.batch(0, 1, 4)
    assert mask_document_ends(ids, labels, EOS).tolist() == [[98, 99, 256, IGNORE_INDEX]]


def test_mask_document_ends_checks_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        mask_document_ends(torch.zeros(2, 3), torch.zeros(2, 4), EOS)


# --------------------------------------------------------------------------- held-out data


def test_eval_split_is_disjoint_and_covers_the_corpus(corpus):
    fraction = 0.25
    data = PackedTokens(corpus, seed=0, eval_fraction=fraction)
    expected_eval = {t for t in TEXTS if held_out(t.encode(), fraction)}
    assert 0 < len(expected_eval) < len(TEXTS)  # the fixture exercises both sides
    n_train = sum(len(t.encode()) + 1 for t in TEXTS if t not in expected_eval)
    n_eval = sum(len(t.encode()) + 1 for t in expected_eval)
    train = {bytes(d).decode() for d in split_documents(data.tokens(0, n_train), EOS)}
    held = {bytes(d).decode() for d in split_documents(data._held_out().tokens(0, n_eval), EOS)}
    assert held == expected_eval and train == set(TEXTS) - expected_eval
    # batches: every eval row's tokens come from held-out documents only
    ids_BS, labels_BS = data.eval_batch(2, 2, 16)
    assert torch.equal(ids_BS[0], data._held_out().tokens(64, 80))
    cu = data.eval_documents(2, 2, 16)[0]
    assert torch.equal(cu, expected_cu(ids_BS[0], EOS))
    # the split depends on neither the seed nor the tokenizer: the same documents held out
    other = PackedTokens(corpus, seed=5, eval_fraction=fraction)
    held5 = {bytes(d).decode() for d in split_documents(other._held_out().tokens(0, n_eval), EOS)}
    assert held5 == expected_eval


def test_eval_split_errors(corpus, tmp_path):
    with pytest.raises(ValueError, match="eval_fraction > 0"):
        PackedTokens(corpus).eval_batch(0, 1, 8)
    with pytest.raises(ValueError, match=r"\[0, 1\), got 1.5"):
        PackedTokens(corpus, eval_fraction=1.5)
    one = str(write_jsonl(tmp_path / "one.jsonl", ["x"]))
    side = held_out(b"x", 0.5)
    data = PackedTokens(one, eval_fraction=0.5)
    with pytest.raises(ValueError, match="no text outside" if side else "no document"):
        (data.batch if side else data.eval_batch)(0, 1, 8)


def test_eval_fraction_zero_keeps_the_stream(corpus):
    a, b = PackedTokens(corpus, seed=4), PackedTokens(corpus, seed=4, eval_fraction=0.0)
    assert torch.equal(a.tokens(0, 2000), b.tokens(0, 2000))


# --------------------------------------------------------------------------- datasets


def test_saved_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")  # (the `train` extra)

    ds = datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))})
    ds.save_to_disk(str(tmp_path / "ds"))
    other = datasets.Dataset.from_dict({"text": ["not used"]})
    datasets.DatasetDict({"train": ds, "test": other}).save_to_disk(str(tmp_path / "dd"))
    n = sum(len(t.encode()) + 1 for t in TEXTS)
    streams = {}
    for name in ("ds", "dd"):
        assert corpus_files(str(tmp_path / name)) == [tmp_path / name]
        data = PackedTokens(str(tmp_path / name), seed=3)
        streams[name] = [bytes(d).decode() for d in split_documents(data.tokens(0, n), EOS)]
    assert streams["ds"] == streams["dd"]  # a DatasetDict contributes its "train" split
    assert sorted(streams["ds"]) == sorted(TEXTS) and streams["ds"] != TEXTS  # rows shuffled
    again = PackedTokens(str(tmp_path / "ds"), seed=3).tokens(0, n)
    assert [bytes(d).decode() for d in split_documents(again, EOS)] == streams["ds"]
    # a saved dataset is one source among others, also inside a directory
    mixed = f"{tmp_path / 'ds'},{write_jsonl(tmp_path / 'x.jsonl', ['extra'])}"
    assert len(PackedTokens(mixed).files) == 2
    assert corpus_files(str(tmp_path)) == [tmp_path / "dd", tmp_path / "ds", tmp_path / "x.jsonl"]


def test_saved_dataset_errors(tmp_path):
    datasets = pytest.importorskip("datasets")

    datasets.Dataset.from_dict({"content": ["a"]}).save_to_disk(str(tmp_path / "nocol"))
    with pytest.raises(ValueError, match=r"no \"text\" column \(columns: \['content'\]\)"):
        PackedTokens(str(tmp_path / "nocol")).batch(0, 1, 4)
    ds = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "notrain"))
    with pytest.raises(ValueError, match=r"no \"train\" split \(\['validation'\]\)"):
        PackedTokens(str(tmp_path / "notrain")).batch(0, 1, 4)


def test_hf_tokenizer_agrees_with_transformers(hf_tokenizer_dir):
    """The ids are those transformers' tokenizer of the same directory gives (no special
    tokens added), so a checkpoint sees the tokens it was trained on."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    tok = load_tokenizer(str(hf_tokenizer_dir))
    assert tok.eos_id == ref.eos_token_id
    for text in TEXTS[:12]:
        if "<|endoftext|>" in text:
            continue  # transformers would encode it as the EOS; upipe as text (see the module)
        assert tok.encode(text.encode()).tolist() == ref.encode(text, add_special_tokens=False)


def test_copy_tokenizer_writes_what_autotokenizer_reads(tmp_path):
    """`copy_tokenizer`: from a directory, tokenizer.json and the side files that exist; from a
    tokenizer.json under another name, that file as tokenizer.json with its side files; onto
    itself, nothing is copied (and nothing fails)."""
    from upipe.train.tokenizers import copy_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"a": 1}')
    (src / "tokenizer_config.json").write_text('{"eos_token": "<e>"}')
    (src / "chat_template.jinja").write_text("{{ x }}")
    (src / "vocab.txt").write_text("not copied")
    out = tmp_path / "out"
    out.mkdir()
    assert copy_tokenizer(src, out) == [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ]
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer_config.json").read_text() == '{"eos_token": "<e>"}'

    (src / "tokenizer.json").rename(src / "my.json")
    other = tmp_path / "other"
    other.mkdir()
    assert copy_tokenizer(src / "my.json", other)[0] == "tokenizer.json"
    assert (other / "tokenizer.json").read_text() == '{"a": 1}'

    assert copy_tokenizer(out, out) == [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ]
    assert (out / "tokenizer.json").read_text() == '{"a": 1}'
