"""The training corpus as token sequences: stdlib sources + pydoc topics, tokenized once and cached.

    corpus = load_corpus(tokenizer_dir, corpus_bytes=2_000_000, pydoc=True)
    data = PackedData(corpus, seq_len=256, val_percent=2.0)
    batch = data.train_batch(step, batch_size=8, seed=0)      # [8, 256] int64, a pure function of the step

Every document (one stdlib file, one pydoc topic) ends with the tokenizer's EOS and goes to the
train or the held-out split by a hash of its name, so the split does not move when the corpus grows.
Each split is one token stream chopped into `seq_len` windows. Batches are a pure function of
(seed, step), which is what makes resuming a run bit-identical.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from research_lm.harness.corpus import corpus_hash, pydoc_topics, stdlib_dir, stdlib_files


@dataclass
class Corpus:
    tokens: torch.Tensor  # [num_tokens] int32, every document followed by EOS
    offsets: torch.Tensor  # [num_docs + 1] int64: document i is tokens[offsets[i]:offsets[i + 1]]
    names: list[str]  # per document: "stdlib/<relative path>" or "pydoc/<topic>"
    corpus_hash: str  # research_lm.harness.corpus.corpus_hash of the stdlib files
    pydoc_hash: str | None  # sha256[:16] over the pydoc topics used, None without them
    num_chars: int

    def describe(self) -> dict[str, object]:
        return {"corpus_hash": self.corpus_hash, "pydoc_hash": self.pydoc_hash, "corpus_docs": len(self.names),
                "corpus_chars": self.num_chars, "corpus_tokens": int(self.tokens.numel())}


def _documents(corpus_bytes: int | None, pydoc: bool) -> tuple[list[tuple[str, str]], str, str | None]:
    files = stdlib_files(limit_bytes=corpus_bytes)
    root = stdlib_dir()
    docs = [(f"stdlib/{p.relative_to(root)}", p.read_text(encoding="utf-8")) for p in files]
    pydoc_hash = None
    if pydoc:
        topics = pydoc_topics()
        h = hashlib.sha256()
        for name, text in topics.items():
            h.update(name.encode())
            h.update(text.encode())
            docs.append((f"pydoc/{name}", text))
        pydoc_hash = h.hexdigest()[:16]
    return docs, corpus_hash(files), pydoc_hash


def _cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "research_lm" / "tokens"


def _tokenizer_hash(tokenizer_dir: Path, tokenizer) -> str:
    source = tokenizer_dir / "tokenizer.json"
    data = source.read_bytes() if source.is_file() else str(sorted(tokenizer.get_vocab().items())).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def load_corpus(tokenizer_dir: str | Path, *, corpus_bytes: int | None = None, pydoc: bool = True,
                cache_dir: str | None = None) -> Corpus:
    """Tokenize the corpus with the tokenizer in `tokenizer_dir` (cached by corpus and tokenizer hash)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no EOS token to separate documents")
    docs, stdlib_hash, pydoc_hash = _documents(corpus_bytes, pydoc)
    key = f"{stdlib_hash}-{pydoc_hash or 'nopydoc'}-{_tokenizer_hash(Path(tokenizer_dir), tokenizer)}"
    cache = _cache_root(cache_dir) / f"{key}.pt"
    num_chars = sum(len(text) for _, text in docs)
    if cache.is_file():
        state = torch.load(cache, map_location="cpu", weights_only=True)
        return Corpus(state["tokens"], state["offsets"], list(state["names"]), stdlib_hash, pydoc_hash, num_chars)
    ids = tokenizer([text for _, text in docs], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    lengths = torch.tensor([len(x) + 1 for x in ids], dtype=torch.int64)
    tokens = torch.tensor([t for x in ids for t in (*x, eos)], dtype=torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    names = [name for name, _ in docs]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    torch.save({"tokens": tokens, "offsets": offsets, "names": names}, tmp)
    tmp.replace(cache)
    return Corpus(tokens, offsets, names, stdlib_hash, pydoc_hash, num_chars)


def _is_val(name: str, val_percent: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < val_percent * 100


class PackedData:
    """Train / held-out splits of a `Corpus`, packed into `[num_seqs, seq_len]` windows."""

    def __init__(self, corpus: Corpus, seq_len: int, val_percent: float):
        is_val = [_is_val(n, val_percent) for n in corpus.names]
        # Tiny corpora (tests, CPU presets): hold out documents from the end until one window fits,
        # keeping at least one window for training.
        lengths = (corpus.offsets[1:] - corpus.offsets[:-1]).tolist()
        for i in reversed(range(len(is_val))):
            if sum(n for n, v in zip(lengths, is_val) if v) >= seq_len:
                break
            is_val[i] = True
        train, val = self._split(corpus, is_val)
        if train.numel() < seq_len:
            raise ValueError(f"the corpus ({corpus.tokens.numel()} tokens) is too small for one training "
                             f"sequence of {seq_len} tokens plus a held-out one; raise train.corpus_bytes")
        self.seq_len = seq_len
        self.train = train[: train.numel() // seq_len * seq_len].view(-1, seq_len)  # [num_train, seq_len]
        self.val = val[: val.numel() // seq_len * seq_len].view(-1, seq_len)  # [num_val, seq_len]
        self.train_tokens = train  # [num_train_tokens] int32, the whole train stream (token statistics)
        self.num_val_docs = sum(is_val)
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    @staticmethod
    def _split(corpus: Corpus, is_val: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        parts: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for i, v in enumerate(is_val):
            parts[v].append(corpus.tokens[corpus.offsets[i]: corpus.offsets[i + 1]])
        empty = torch.zeros(0, dtype=torch.int32)
        return (torch.cat(parts[False]) if parts[False] else empty), (torch.cat(parts[True]) if parts[True] else empty)

    def train_batch(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """`[batch_size, seq_len]` int64: epoch e visits the windows in `randperm` order seeded by (seed, e)."""
        n = self.train.shape[0]
        rows = []
        for i in range(step * batch_size, (step + 1) * batch_size):
            epoch, j = divmod(i, n)
            rows.append(int(self._perm(seed, epoch)[j]))
        return self.train[rows].long()

    def _perm(self, seed: int, epoch: int) -> torch.Tensor:
        key = (seed, epoch)
        if key not in self._perms:
            self._perms = {key: torch.randperm(self.train.shape[0],
                                               generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))}
        return self._perms[key]

    def val_batches(self, batch_size: int, num_batches: int) -> list[torch.Tensor]:
        """The first `num_batches` held-out batches (fewer when the split is small), int64."""
        rows = self.val[: batch_size * num_batches].long()
        return [rows[i: i + batch_size] for i in range(0, rows.shape[0], batch_size)]
