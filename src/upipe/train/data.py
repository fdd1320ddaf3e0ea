"""Training data: documents packed into one token stream, cut into fixed-length samples.

Tokenizer: bytes (ids 0..255) plus `EOS` (256) after every document, so the vocabulary is
257 and nothing is downloaded. Documents come from text files (one document per file) or
JSON-lines files (one document per line, its "text" field); the default corpus is the
Python standard library's own source files (`*.py` under `sysconfig`'s stdlib path, tens of
MB on any machine with Python). The document order is shuffled with the seed, so the same
seed gives the same stream on every process, for every strategy and process count.

Sample i is tokens [i*S, i*S + S + 1) of the stream (repeated end to end when it runs out):
input_ids = its first S tokens, labels = its last S (labels are shifted on the full
sequence, before it is sharded across the context-parallel ranks). Packed documents attend
to each other (no document mask); positions run 0..S-1 per sample.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import torch

EOS = 256
VOCAB_SIZE = 257


def default_corpus() -> list[Path]:
    """The standard library's `*.py` files (site-packages excluded), in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def corpus_files(spec: str | None) -> list[Path]:
    """The files of `--data` (comma-separated files or directories; None: the default
    corpus); ValueError naming the entry that does not exist or holds nothing."""
    if spec is None:
        return default_corpus()
    files = []
    for part in spec.split(","):
        path = Path(part).expanduser()
        if path.is_dir():
            files += sorted(
                p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
            )
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"--data: {part!r} is neither a file nor a directory")
    if not files:
        raise ValueError(f"--data {spec!r} holds no files")
    return files


def _documents(path: Path):
    """The documents of one file as bytes: each JSON line's "text", or the whole file."""
    if path.suffix in (".jsonl", ".ndjson"):
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"].encode()
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(
                            f'{path}:{n}: expected a JSON object with a "text" string ({e})'
                        ) from None
    else:
        yield path.read_bytes()


class PackedTokens:
    """The token stream of a corpus, read lazily up to the furthest token asked for."""

    def __init__(self, data: str | None = None, *, seed: int = 0):
        self.files = corpus_files(data)
        random.Random(seed).shuffle(self.files)
        self._chunks: list[torch.Tensor] = []
        self._length = 0
        self._next_file = 0

    def _read_until(self, n: int) -> None:
        while self._length < n:
            if self._next_file == len(self.files):
                if self._length == 0:
                    raise ValueError("the corpus holds no text")
                self._next_file = 0  # wrap around: the stream repeats
            for doc in _documents(self.files[self._next_file]):
                ids = torch.frombuffer(bytearray(doc + b"\0"), dtype=torch.uint8).long()
                ids[-1] = EOS
                self._chunks.append(ids)
                self._length += ids.numel()
            self._next_file += 1

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) of the stream (LongTensor)."""
        self._read_until(stop)
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0][start:stop]

    def batch(self, index: int, batch_size: int, seq_len: int):
        """Batch `index` of `batch_size` samples: input_ids, labels, both [batch_size, S]."""
        first = index * batch_size
        rows = [
            self.tokens((first + b) * seq_len, (first + b + 1) * seq_len + 1)
            for b in range(batch_size)
        ]
        tokens_BS1 = torch.stack(rows)
        return tokens_BS1[:, :-1].contiguous(), tokens_BS1[:, 1:].contiguous()
