"""Byte-level text for language models: a tokenizer that needs no download and token streams
of BBC News split by article."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ._bbc import load_bbc_news, stratified_split


@dataclass(frozen=True)
class ByteTokenizer:
    """Tokens are the UTF-8 bytes of a text (0–255) plus one separator, ``eot`` = 256, put
    between documents. ``decode(encode(t)) == t`` for every string."""

    eot: int = 256

    @property
    def vocab_size(self) -> int:
        return self.eot + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of byte tokens; separators become newlines. Raises ``ValueError`` on an id
        outside the vocabulary or bytes that are not UTF-8."""
        ids = list(ids)
        bad = next((i for i in ids if not 0 <= i <= self.eot), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the byte vocabulary (0..{self.eot})")
        return bytes(10 if i == self.eot else i for i in ids).decode("utf-8")

    def stream(self, texts: Sequence[str]) -> Tensor:
        """One int64 stream (N,) of the texts' tokens, each text followed by ``eot``."""
        parts = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
        sep = np.array([self.eot], dtype=np.int64)
        joined = [a for p in parts for a in (p, sep)]
        return torch.from_numpy(np.concatenate(joined) if joined else np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class TextSplit:
    """BBC News as token streams, split by article: ``train``, ``val``, ``test`` (int64 (N,)),
    the article indices of each split (into :func:`load_bbc_news`'s order) and the tokenizer."""

    train: Tensor
    val: Tensor
    test: Tensor
    articles: dict[str, list[int]]
    tokenizer: ByteTokenizer


def load_bbc_text(fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), seed: int = 0) -> TextSplit:
    """The 2,225 BBC News articles as byte tokens, each article in exactly one of train /
    validation / test (stratified by class, fractions per class, fixed by `seed`)."""
    texts, labels, _ = load_bbc_news()
    idx = stratified_split(labels, dict(zip(("train", "val", "test"), fractions, strict=True)), seed=seed)
    tok = ByteTokenizer()
    streams = {k: tok.stream([texts[i] for i in v]) for k, v in idx.items()}
    return TextSplit(**streams, articles=idx, tokenizer=tok)


def random_windows(stream: Tensor, batch: int, length: int,
                   generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """`batch` windows of `length` + 1 tokens at uniformly random offsets: inputs (batch,
    length) and next-token targets (batch, length)."""
    if stream.numel() < length + 1:
        raise ValueError(f"a stream of {stream.numel()} tokens is shorter than one window ({length + 1})")
    start = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
    win = stream[start[:, None] + torch.arange(length + 1)]
    return win[:, :-1], win[:, 1:]


def sequential_windows(stream: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The stream cut into consecutive non-overlapping windows (every token but the first is
    a target exactly once, up to a remainder shorter than a window): (n, length) each."""
    n = (stream.numel() - 1) // length
    x = stream[: n * length].view(n, length)
    y = stream[1 : n * length + 1].view(n, length)
    return x, y
