"""Tokenizers (`load_tokenizer`), the `--tokenizer` of `upipe train`:
- bytes (the default, nothing downloaded): ids 0..255 are the UTF-8 bytes, `EOS` = 256, so
  the vocabulary is 257;
- a local Hugging Face tokenizer (`tokenizer.json`, or a directory holding one): read with
  the `tokenizers` library (`HFTokenizer`), EOS = the id of the `eos_token` that the
  directory's `tokenizer_config.json` (or `special_tokens_map.json`) names.
Each document becomes `encode(text) + [eos_id]` (`upipe.train.data`): no BOS, EOS alone
separates documents, and the EOS id occurs nowhere else in the stream (special-token strings
inside a document's text are encoded as plain text), so "input token is EOS" marks exactly a
document's end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

EOS = 256
VOCAB_SIZE = 257


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOS = 256 (vocabulary 257; nothing to download)."""

    vocab_size = VOCAB_SIZE
    eos_id = EOS

    def encode(self, text: bytes) -> torch.Tensor:
        """The ids `[n]` (int32) of one document's text, without the EOS."""
        if not text:
            return torch.empty(0, dtype=torch.int32)
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int32)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A local Hugging Face tokenizer (`tokenizer.json`) run by the `tokenizers` library.

    Why `tokenizers` and not `transformers.AutoTokenizer`: `tokenizer.json` is what every
    current checkpoint ships (Llama 3, Qwen3, Mistral), `tokenizers` reads it alone (no
    `transformers`, no remote code, no network), and its Rust encoder is deterministic and
    fast. A directory with only a SentencePiece `tokenizer.model` can be converted once with
    `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`, which writes `tokenizer.json`.
    """

    def __init__(self, tokenizer, *, eos_id: int, name: str = "tokenizer"):
        self._tokenizer = tokenizer
        # special-token strings in a document are text, not control tokens: the EOS id then
        # marks document ends only (what `mask_document_ends` relies on)
        tokenizer.encode_special_tokens = True
        self.eos_id = eos_id
        self.name = name
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        """Largest id + 1 (ids may have holes; the embedding needs a row for each)."""

    @classmethod
    def from_path(cls, path: str | Path, *, eos_token: str | None = None) -> HFTokenizer:
        """The tokenizer of `path` (`tokenizer.json`, or a directory holding one). EOS:
        `eos_token` if given, else the `eos_token` of `tokenizer_config.json` or
        `special_tokens_map.json` next to it; ValueError if none names one."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                "a Hugging Face tokenizer needs the `tokenizers` package: "
                "pip install tokenizers (or pip install -e '.[hf]')"
            ) from None
        path = Path(path).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            hint = (
                "; it has a SentencePiece tokenizer.model: convert it once with "
                "transformers.AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
                if path.is_dir() and (path / "tokenizer.model").exists()
                else ""
            )
            raise ValueError(f"--tokenizer: no tokenizer.json at {path}{hint}")
        tokenizer = Tokenizer.from_file(str(file))
        eos_token = eos_token or _configured_eos(file.parent)
        if eos_token is None:
            raise ValueError(
                f"--tokenizer {path}: no EOS token (documents are separated by it): put a "
                f'tokenizer_config.json with "eos_token" next to {file.name}, or pass eos_token='
            )
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(
                f"--tokenizer {path}: EOS token {eos_token!r} is not in its vocabulary; "
                "pass eos_token= one of its special tokens"
            )
        return cls(tokenizer, eos_id=eos_id, name=str(path))

    def encode(self, text: bytes) -> torch.Tensor:
        """The ids `[n]` (int32) of one document's UTF-8 text (invalid bytes become U+FFFD),
        without special tokens (no BOS) and without the EOS."""
        enc = self._tokenizer.encode(
            text.decode("utf-8", errors="replace"), add_special_tokens=False
        )
        ids = torch.tensor(enc.ids, dtype=torch.int32)
        if (ids == self.eos_id).any():
            raise ValueError(
                f"{self.name}: plain text encoded to the EOS id {self.eos_id}; documents could "
                "not be told apart (its EOS token must be a special token outside the model vocab)"
            )
        return ids

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _configured_eos(directory: Path) -> str | None:
    """The `eos_token` named by a Hugging Face tokenizer directory's JSON files, or None."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = directory / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token")
            if isinstance(eos, dict):  # an AddedToken written out: {"content": ..., ...}
                eos = eos.get("content")
            if eos:
                return eos
    return None


Tokenizer = ByteTokenizer | HFTokenizer

# What a Hugging Face tokenizer directory holds beside tokenizer.json that transformers'
# AutoTokenizer reads: the special tokens (the EOS upipe trained with among them), added
# tokens, the chat template.
TOKENIZER_SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_tokenizer(spec: str | Path, directory: str | Path) -> list[str]:
    """Copy the Hugging Face tokenizer of `--tokenizer` `spec` (tokenizer.json, or a directory
    holding one) into the model directory `directory`, so that
    `transformers.AutoTokenizer.from_pretrained(directory)` loads the tokenizer the model was
    trained with: its tokenizer.json (as that name) and the `TOKENIZER_SIDE_FILES` next to
    it. Returns the names written; a file that already is the destination is left alone."""
    spec = Path(spec).expanduser()
    file = spec / "tokenizer.json" if spec.is_dir() else spec
    directory = Path(directory).expanduser()
    pairs = [(file, "tokenizer.json")] + [(file.parent / n, n) for n in TOKENIZER_SIDE_FILES]
    written = []
    for src, name in pairs:
        dst = directory / name
        if not src.is_file():
            continue
        if not (dst.exists() and os.path.samefile(src, dst)):
            shutil.copyfile(src, dst)
        written.append(name)
    return written


def load_tokenizer(spec: str | Path | None) -> Tokenizer:
    """`--tokenizer`: None (or "bytes") for the byte tokenizer, else a path for `HFTokenizer`."""
    if spec is None or str(spec) == "bytes":
        return ByteTokenizer()
    return HFTokenizer.from_path(spec)
