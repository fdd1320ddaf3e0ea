"""Training data: documents tokenized lazily, packed into one token stream, cut into
fixed-length samples.

Legend: B batch (rows of a batch), S tokens per row (`seq_len`).

Tokenizers: `upipe.train.tokenizers` (`load_tokenizer`). Each document becomes
`encode(text) + [eos_id]`: no BOS, EOS alone separates documents, and the EOS id occurs
nowhere else in the stream, so "input token is EOS" marks exactly a document's end.

Documents come from text files (one document per file), JSON-lines files (one per line, its
"text" field) and Hugging Face datasets saved with `save_to_disk` (a directory; its "text"
column; a `DatasetDict` contributes its "train" split; needs the `datasets` package). The
default corpus is the Python standard library's own source files (`*.py` under
`sysconfig`'s stdlib path, tens of MB on any machine with Python). The file order is
shuffled with the seed (a saved dataset's rows too), so the same seed gives the same stream
on every process, for every strategy and process count. Nothing is tokenized before it is
needed: the stream grows one document at a time up to the furthest token asked for, and a
document's ids depend on that document alone (deterministic whatever the batch order).

Sample i is tokens [i*S, i*S + S + 1) of the stream (repeated end to end when it runs out):
input_ids = its first S tokens, labels = its last S (labels are shifted on the full
sequence, before it is sharded across the context-parallel ranks). Packed documents attend
to each other unless the trainer masks documents, with, per row, the document boundaries of
`PackedTokens.documents` (cu_seqlens) and `mask_document_ends` for the labels.

Bad data: `check_corpus` reads every record of `--data` once, before training, and names the
first that is not a document (an empty, binary or non-UTF-8 file, a JSON line that is not
an object with a "text" string) by file and line; with `skip_bad_records` such records are
left out, by the check and by the stream alike, and counted. The default corpus is read as
it is.

Held-out data: with `eval_fraction` f > 0, a document whose text hashes (BLAKE2b, 64 bits)
below f * 2^64 belongs to the evaluation stream and never to the training stream, so
`eval_batch` never shares a document (nor a duplicate of one) with `batch`. The split does
not depend on the seed, the tokenizer or the file order: every run holds out the same
documents. f = 0 (the default) leaves the training stream exactly as it was before the split
existed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from upipe.loss import IGNORE_INDEX
from upipe.train.tokenizers import Tokenizer, load_tokenizer

# --------------------------------------------------------------------------- documents


def default_corpus() -> list[Path]:
    """The standard library's `*.py` files (site-packages excluded), in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def _is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets`' `save_to_disk` (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "reading a saved Hugging Face dataset needs the `datasets` package: "
            "pip install datasets"
        ) from None
    return datasets


def _directory_sources(root: Path) -> list[Path]:
    """The files under `root` (hidden files skipped) in sorted order, except that a saved
    dataset inside it is one source (its directory, where its first file was), not its
    Arrow files."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    datasets = {
        p.parent
        for p in files
        if p.name in ("dataset_dict.json", "state.json") and _is_saved_dataset(p.parent)
    }
    sources = []
    for p in files:
        top = next((d for d in reversed(p.parents) if d in datasets), None)
        if top is None:
            sources.append(p)
        elif not sources or sources[-1] != top:
            _import_datasets()
            sources.append(top)
    return sources


def corpus_files(spec: str | None) -> list[Path]:
    """The sources of `--data` (comma-separated files or directories; a directory saved by
    `datasets` is one source; None: the default corpus); ValueError naming the entry that
    does not exist or holds nothing."""
    if spec is None:
        return default_corpus()
    files = []
    for part in spec.split(","):
        path = Path(part).expanduser()
        if path.is_dir() and _is_saved_dataset(path):
            _import_datasets()
            files.append(path)
        elif path.is_dir():
            files += _directory_sources(path)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"--data: {part!r} is neither a file nor a directory")
    if not files:
        raise ValueError(f"--data {spec!r} holds no files")
    return files


def _train_split(path: Path):
    """The saved dataset at `path` (a DatasetDict: its "train" split); ValueError naming
    what is missing."""
    datasets = _import_datasets()
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f'--data {path}: the DatasetDict has no "train" split ({list(ds)})')
        ds = ds["train"]
    if "text" not in ds.column_names:
        raise ValueError(f'--data {path}: no "text" column (columns: {ds.column_names})')
    return ds


def _dataset_documents(
    path: Path, seed: int, on_bad: str, rows_per_read: int = 1024
) -> Iterator[bytes]:
    """The "text" column of a saved dataset (its "train" split), rows shuffled by `seed`;
    a row whose text is not a string raises (on_bad "raise") or is left out."""
    try:
        ds = _train_split(path).select_columns(["text"])
    except ValueError:
        if on_bad == "skip":  # the whole source is bad (`check_corpus` counted it)
            return
        raise
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))
    for first in range(0, len(ds), rows_per_read):
        rows = order[first : first + rows_per_read].tolist()
        for row, text in zip(rows, ds[rows]["text"], strict=True):
            if isinstance(text, str):
                yield text.encode()
            elif on_bad == "raise":
                raise ValueError(f'--data {path}: row {row} has a "text" of type {type(text)}')


def _dataset_check(path: Path) -> tuple[int, list[str]]:
    """(rows with a text, one line per row without) of a saved dataset, from the column's
    type and null count (Arrow metadata: no row is read)."""
    ds = _train_split(path)
    if getattr(ds.features["text"], "dtype", None) not in ("string", "large_string"):
        raise ValueError(
            f'--data {path}: the "text" column holds {ds.features["text"]}, not strings'
        )
    nulls = ds.data.column("text").null_count
    return len(ds) - nulls, [f"{path}: a row with no text (null)"] * nulls


def _utf8(data: bytes, where: str, *, one_line: bool = False) -> str | None:
    """What keeps `data` from being UTF-8 text, in words naming the place (`one_line`: data
    is one line, so the place is a column); None if it is text."""
    nul = data.find(b"\0")
    if nul >= 0:
        return f"{where}: binary, not text (a NUL byte at offset {nul})"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        place = f"column {e.start - line_start + 1}"
        if not one_line:
            line = data.count(b"\n", 0, e.start) + 1
            place = f"line {line}, {place}"
        return f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at {place})"
    return None


def _json_text(line: bytes, where: str) -> tuple[bytes | None, str | None]:
    """(the UTF-8 "text" of one JSON line, None) or (None, what is wrong with it)."""
    line = line.rstrip(b"\r\n")
    problem = _utf8(line, where, one_line=True)
    if problem:
        return None, problem
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"{where}: not JSON ({e.msg}: column {e.colno})"
    if not isinstance(record, dict) or "text" not in record:
        what = f"keys {list(record)[:5]}" if isinstance(record, dict) else type(record).__name__
        return None, f'{where}: expected a JSON object with a "text" string, got {what}'
    text = record["text"]
    if not isinstance(text, str):
        return None, f'{where}: "text" is {type(text).__name__} {text!r:.40}, not a string'
    try:
        return text.encode(), None
    except UnicodeEncodeError as e:
        return None, f'{where}: "text" holds an unpaired surrogate at character {e.start}'


def _records(path: Path) -> Iterator[tuple[bytes | None, str | None]]:
    """The documents of a text or JSON-lines file, each (its UTF-8 text, None), or (None,
    what is wrong, naming the file and line) for a record that is not a document: an empty
    or binary or non-UTF-8 file, a JSON line that is not an object with a "text" string,
    a JSON-lines file with no line, a file that cannot be read."""
    try:
        if path.suffix in (".jsonl", ".ndjson"):
            found = False
            with path.open("rb") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        found = True
                        yield _json_text(line, f"{path}:{n}")
            if not found:
                yield None, f"{path}: no JSON line (empty file)"
        else:
            data = path.read_bytes()
            yield (None, f"{path}: empty file") if not data else (data, _utf8(data, str(path)))
    except OSError as e:
        yield None, f"{path}: cannot be read ({e.strerror or e})"


def _documents(path: Path, seed: int = 0, on_bad: str = "raise") -> Iterator[bytes]:
    """The documents of one source as UTF-8 bytes: each JSON line's "text", a saved
    dataset's rows, or the whole file. A bad record (`_records`): ValueError naming it
    (`on_bad` "raise"), left out ("skip"), or, for a whole file, read as the bytes it holds
    ("keep": the default corpus, whose few empty and non-UTF-8 files are part of its fixed
    stream)."""
    if path.is_dir():
        yield from _dataset_documents(path, seed, on_bad)
    elif on_bad == "keep":
        yield path.read_bytes()
    else:
        for text, problem in _records(path):
            if problem is None:
                yield text
            elif on_bad == "raise":
                raise ValueError(problem)


@dataclasses.dataclass
class CorpusCheck:
    """What `check_corpus` read."""

    sources: int
    documents: int
    skipped: list[str]
    """One line per bad record left out ("file:line: what is wrong")."""


def check_corpus(spec: str, *, skip_bad: bool = False) -> CorpusCheck:
    """Read every record of `--data` once, before training, so that bad data stops a run
    before its first step rather than when (or never) the stream reaches it: every file
    readable, UTF-8 text (no NUL byte), not empty; every JSON line an object with a "text"
    string; a saved dataset's "text" column strings, none missing. The first bad record is
    a ValueError naming its file and line and the fix; with `skip_bad` bad records are
    left out (as the stream then leaves them out) and listed in the result. No document at
    all is a ValueError either way."""
    sources = corpus_files(spec)
    documents, skipped = 0, []
    for path in sources:
        if path.is_dir():
            try:
                found, bad = _dataset_check(path)
            except ValueError as e:
                found, bad = 0, [str(e).removeprefix("--data ")]
        else:
            found, bad = 0, []
            for _, problem in _records(path):
                found += problem is None
                bad += [problem] if problem else []
        documents += found
        if bad and not skip_bad:
            raise ValueError(
                f"--data: {bad[0]}; fix or remove it, or pass --skip-bad-records to leave "
                "bad records out"
            )
        skipped += bad
    if not documents:
        first = f" ({len(skipped)} bad records left out, the first: {skipped[0]})"
        raise ValueError(f"--data {spec!r} holds no document" + (first if skipped else ""))
    return CorpusCheck(sources=len(sources), documents=documents, skipped=skipped)


def held_out(text: bytes, fraction: float) -> bool:
    """Whether a document belongs to the evaluation split: its 64-bit BLAKE2b hash is below
    `fraction` * 2^64 (depends on the text alone: duplicates fall on the same side)."""
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


def mask_document_ends(
    input_ids_BS: torch.Tensor, labels_BS: torch.Tensor, eos_id: int
) -> torch.Tensor:
    """`labels_BS` with -100 (ignored by the loss) wherever the input is a document's last
    token, i.e. its EOS: that token's label is the first token of the *next* document, which
    a model attending within documents cannot predict. Exactly the positions `cu[i] - 1` for
    every inner boundary `cu[i]` of `PackedTokens.documents`, plus S - 1 when a document
    ends exactly at the row's end (its next token lies outside the row). Apply it on the
    full `[B, S]` batch, before sharding."""
    if input_ids_BS.shape != labels_BS.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids_BS.shape)} and labels {tuple(labels_BS.shape)} differ"
        )
    return labels_BS.masked_fill(input_ids_BS == eos_id, IGNORE_INDEX)


# --------------------------------------------------------------------------- the stream


class _Growing:
    """A 1-D tensor that grows by appending, its storage doubling (amortised O(1) per item)."""

    def __init__(self, dtype: torch.dtype):
        self._data = torch.empty(1 << 12, dtype=dtype)
        self.size = 0

    def append(self, values: torch.Tensor) -> None:
        need = self.size + values.numel()
        if need > self._data.numel():
            grown = torch.empty(max(need, 2 * self._data.numel()), dtype=self._data.dtype)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : need] = values
        self.size = need

    def view(self) -> torch.Tensor:
        return self._data[: self.size]


class _Stream:
    """Documents `keep` accepts, from `sources` in order (repeated end to end), tokenized one
    at a time as the stream grows; `ends` holds each document's end offset (exclusive)."""

    def __init__(
        self, sources, tokenizer, *, seed: int, keep: Callable | None, empty: str, on_bad: str
    ):
        self._sources, self._tokenizer, self._seed = sources, tokenizer, seed
        self._on_bad = on_bad
        self._keep, self._empty = keep, empty
        self._tokens = _Growing(torch.int32)
        self._ends = _Growing(torch.int64)
        self._docs = self._cycle()

    def _cycle(self) -> Iterator[bytes]:
        while True:
            found = False
            for source in self._sources:
                for doc in _documents(source, self._seed, self._on_bad):
                    if self._keep is None or self._keep(doc):
                        found = True
                        yield doc
            if not found:
                raise ValueError(self._empty)

    def _read_until(self, n: int) -> None:
        eos = torch.tensor([self._tokenizer.eos_id], dtype=torch.int32)
        while self._tokens.size < n:
            self._tokens.append(self._tokenizer.encode(next(self._docs)))
            self._tokens.append(eos)
            self._ends.append(torch.tensor([self._tokens.size]))

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) of the stream (LongTensor)."""
        self._read_until(stop)
        return self._tokens.view()[start:stop].long()

    def boundaries(self, start: int, seq_len: int) -> torch.Tensor:
        """cu_seqlens `[0, e1, ..., seq_len]` (int32) of the documents in [start, start + S)."""
        self._read_until(start + seq_len + 1)
        ends = self._ends.view()
        lo = int(torch.searchsorted(ends, start, right=True))
        hi = int(torch.searchsorted(ends, start + seq_len, right=False))
        inner = ends[lo:hi] - start
        return torch.cat([inner.new_zeros(1), inner, inner.new_full((1,), seq_len)]).int()

    def batch(self, index: int, batch_size: int, seq_len: int):
        first = index * batch_size
        rows = [
            self.tokens((first + b) * seq_len, (first + b + 1) * seq_len + 1)
            for b in range(batch_size)
        ]
        tokens_BS1 = torch.stack(rows)
        return tokens_BS1[:, :-1].contiguous(), tokens_BS1[:, 1:].contiguous()

    def documents(self, index: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        first = index * batch_size
        return [self.boundaries((first + b) * seq_len, seq_len) for b in range(batch_size)]


class PackedTokens:
    """The token stream of a corpus, read lazily up to the furthest token asked for.

    `tokenizer`: a tokenizer object, a path (see `load_tokenizer`) or None (bytes).
    `eval_fraction`: the share of documents held out for `eval_batch` (see the module doc).
    `skip_bad_records`: leave out the records of `data` that are not documents (see
    `check_corpus`) instead of raising a ValueError naming the first when the stream
    reaches it. The default corpus is read as it is (its bytes, empty files included).
    """

    def __init__(
        self,
        data: str | None = None,
        *,
        seed: int = 0,
        tokenizer: Tokenizer | str | Path | None = None,
        eval_fraction: float = 0.0,
        skip_bad_records: bool = False,
    ):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if tokenizer is None or isinstance(tokenizer, str | Path):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.eval_fraction = eval_fraction
        self.files = corpus_files(data)
        random.Random(seed).shuffle(self.files)
        on_bad = "keep" if data is None else "skip" if skip_bad_records else "raise"
        train_keep = None
        if eval_fraction > 0:
            train_keep = lambda doc: not held_out(doc, eval_fraction)
        self._train = _Stream(
            self.files, tokenizer, seed=seed, keep=train_keep, on_bad=on_bad,
            empty="the corpus holds no text" + (
                f" outside the held-out eval_fraction={eval_fraction}; lower it"
                if eval_fraction else ""
            ),
        )  # fmt: skip
        self._eval = None
        if eval_fraction > 0:
            self._eval = _Stream(
                self.files, tokenizer, seed=seed, on_bad=on_bad,
                keep=lambda doc: held_out(doc, eval_fraction),
                empty=f"no document of the corpus is held out at eval_fraction={eval_fraction}"
                "; raise it (or add documents)",
            )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (size the model's embedding from it)."""
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        """The id that ends every document."""
        return self.tokenizer.eos_id

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) of the training stream (LongTensor)."""
        return self._train.tokens(start, stop)

    def batch(self, index: int, batch_size: int, seq_len: int):
        """Batch `index` of `batch_size` samples: input_ids, labels, both [batch_size, S]."""
        return self._train.batch(index, batch_size, seq_len)

    def documents(self, index: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        """Per row of `batch(index, batch_size, seq_len)`, the cu_seqlens (int32) of its
        documents: `[0, e1, ..., S]`, where each inner `e` is the row position right after a
        document's EOS; a document cut by the row's start or end counts as one inside it."""
        return self._train.documents(index, batch_size, seq_len)

    def _held_out(self):
        if self._eval is None:
            raise ValueError(
                "no held-out data: PackedTokens(..., eval_fraction=0.0); pass an "
                "eval_fraction > 0 (e.g. 0.01) to hold out that share of documents"
            )
        return self._eval

    def eval_batch(self, index: int, batch_size: int, seq_len: int):
        """Like `batch`, from the held-out documents (never in a training batch); the
        held-out stream repeats end to end like the training one."""
        return self._held_out().batch(index, batch_size, seq_len)

    def eval_documents(self, index: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        """Like `documents`, for `eval_batch`."""
        return self._held_out().documents(index, batch_size, seq_len)
