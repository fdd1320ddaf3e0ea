"""The training tests' corpus: made-up text from a seeded generator, the same on every
checkout and after every edit.

(Before 2026-12-06 the tests trained on upipe's own sources: every edit changed the data,
and an edit could move a mixture-of-experts token's routing across a near-tie, so that a
curve test failed on code it does not test.)

The text: `DOCUMENTS` documents of sentences of made-up words (two to four syllables of a
fixed alphabet), the words drawn with Zipf weights (the k-th word 1/k as likely as the
first), so that a byte-level model learns the spelling and the frequent words within a few
steps; document lengths from 40 to 4,000 characters, so that a 128-token row holds several
documents' ends and a 4K row several whole documents. Written as JSON lines (one document a
line, its "text" field) to the temporary directory, under a name holding a hash of the
content: written once per machine, atomically (concurrent test workers may race)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path

DOCUMENTS = 120
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def documents(n: int = DOCUMENTS, seed: int = 0) -> list[str]:
    """`n` documents of made-up sentences, the same for the same `n` and `seed`."""
    rng = random.Random(seed)
    words = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))) for _ in range(600)})
    rng.shuffle(words)  # (the Zipf rank: not alphabetical)
    weights = [1 / (rank + 1) for rank in range(len(words))]
    docs = []
    for _ in range(n):
        size, sentences = rng.choice([40, 300, 1000, 4000]), []
        while sum(map(len, sentences)) < size:
            chosen = rng.choices(words, weights, k=rng.randint(3, 12))
            sentences.append(" ".join(chosen).capitalize() + rng.choice([".", ".", "?", "!"]))
        docs.append(" ".join(sentences))
    return docs


def corpus_path() -> str:
    """The corpus as a JSON-lines file (`--data` takes it), written if it is not there."""
    text = "".join(json.dumps({"text": doc}) + "\n" for doc in documents())
    digest = hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    path = Path(tempfile.gettempdir()) / f"upipe-test-corpus-{digest}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_text(text)
        os.replace(tmp, path)
    return str(path)
