"""Tokenizers: UTF-8 bytes by default, or Hugging Face `tokenizers` (a byte-level BPE trained here, or a
`tokenizer.json` loaded from disk).

Both kinds satisfy the `Tokenizer` protocol: `vocab_size`, `eos_id` (the token that ends every document),
`encode(text) -> int32 ids` and `decode(ids) -> text`. `build_tokenizer` picks one from `DataConfig.tokenizer`.
The `tokenizers` package is imported only when a Hugging Face tokenizer is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from moelab.config import DataConfig
from moelab.errors import DataError

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "build_tokenizer", "EOS_TOKENS"]

# End-of-document tokens we recognise in a loaded tokenizer.json, in the order we look for them: ours, then the
# spellings of GPT-2, Llama 3 and SentencePiece models.
EOS_TOKENS = ("<eos>", "<|endoftext|>", "<|end_of_text|>", "</s>")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int  # ids lie in [0, vocab_size)
    eos_id: int  # appended after every document

    def encode(self, text: str) -> np.ndarray:
        """The int32 ids of `text`, without any special token."""
        ...

    def decode(self, ids: Any) -> str:
        """The text of `ids`; end-of-document tokens are left out."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text; a Hugging Face tokenizer runs them on every core."""
        ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 for end of document: no training, no files, any text."""

    vocab_size: ClassVar[int] = 257
    eos_id: ClassVar[int] = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Any) -> str:
        """Decode ids; a byte sequence that is not valid UTF-8 (a model's sample may be) decodes to U+FFFD."""
        ids = np.asarray(ids).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"byte tokenizer ids lie in [0, {self.vocab_size}); got {ids.min()} to {ids.max()}.")
        return ids[ids != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` protocol.

    Build one with `HFTokenizer.train_bpe(documents, vocab_size)` or `HFTokenizer.load(path)`; `save(path)`
    writes a `tokenizer.json` that `load` reads back.
    """

    def __init__(self, tokenizer: Any, source: str = "a tokenizer") -> None:
        """Wrap `tokenizer`; `source` names it in errors. Raises DataError if it has none of `EOS_TOKENS`."""
        self._tokenizer = tokenizer
        ids = [tokenizer.token_to_id(token) for token in EOS_TOKENS]
        found = [i for i in ids if i is not None]
        if not found:
            raise DataError(
                f"{source} has no end-of-document token; add one of {', '.join(EOS_TOKENS)} as a special token."
            )
        self.eos_id: int = found[0]
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def train_bpe(cls, documents: Iterable[str], vocab_size: int) -> HFTokenizer:
        """Train a byte-level BPE (GPT-2 style) with an `<eos>` special token.

        Args:
            documents: the training text; keep held-out documents out so evaluation stays honest.
            vocab_size: the most ids to learn, >= 257 (256 bytes and `<eos>`). A small corpus may stop short of
                it: read the result's `vocab_size`.
        """
        from tokenizers import Tokenizer as _Tokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tokenizer = _Tokenizer(models.BPE())
        # No prefix space: decode(encode(text)) must give back `text` exactly.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
            show_progress=False,
        )
        tokenizer.train_from_iterator(documents, trainer)
        return cls(tokenizer, source="the trained BPE")

    @classmethod
    def load(cls, path: str | Path) -> HFTokenizer:
        """Read a `tokenizer.json`; a missing or unreadable file raises DataError naming it."""
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        if not path.is_file():
            raise DataError(f"data.tokenizer: file {path} does not exist; give the path of a tokenizer.json, "
                            "or use 'byte' or 'bpe'.")
        try:
            tokenizer = _Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise DataError(f"data.tokenizer: file {path} is not a valid tokenizer.json ({e}); save one with "
                            "tokenizers' Tokenizer.save.") from e
        return cls(tokenizer, source=f"data.tokenizer: file {path}")

    def save(self, path: str | Path) -> None:
        self._tokenizer.save(str(path))

    def encode(self, text: str) -> np.ndarray:
        # No special tokens: the corpus appends eos itself, and a loaded tokenizer may add BOS/CLS otherwise.
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips the offsets we never read; Rust threads over the batch (TOKENIZERS_PARALLELISM).
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Any) -> str:
        return self._tokenizer.decode(np.asarray(ids).ravel().tolist(), skip_special_tokens=True)


def build_tokenizer(cfg: DataConfig, documents: dict[str, list[str]]) -> Tokenizer:
    """The tokenizer `cfg.tokenizer` names: `"byte"`, `"bpe"` (trained on `documents`) or a tokenizer.json path.

    Args:
        cfg: the data config.
        documents: training documents per domain; only `"bpe"` reads them.
    """
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        return HFTokenizer.train_bpe((doc for docs in documents.values() for doc in docs), cfg.bpe_vocab_size)
    return HFTokenizer.load(cfg.tokenizer)
