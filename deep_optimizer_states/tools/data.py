"""Training data for ``dos train``: text that needs no download, as a flat stream of token ids.

Sources, in order of preference of the caller: the user's own text files (``--data FILE...``), else the source
text of the Python standard library (``*.py`` under ``sysconfig.get_paths()["stdlib"]``, sorted by path,
``site-packages`` left out, read up to a size limit). Text is tokenized at the byte level (vocab 256) unless a
tokenizer is given. The last ``eval_fraction`` of the stream is held out for evaluation.

Batches are a pure function of (seed, step, micro-batch index): a resumed run, in any process, sees exactly
the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

BYTE_VOCAB = 256
MB = 1 << 20


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Every ``*.py`` file of the standard library (without site-packages and caches), sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_texts(files: Sequence[str | os.PathLike], limit_bytes: int | None = None) -> list[bytes]:
    """The files' bytes, in order, stopping once ``limit_bytes`` are read (the last file is cut)."""
    parts, size = [], 0
    for f in files:
        data = Path(f).read_bytes()
        if limit_bytes is not None and size + len(data) > limit_bytes:
            data = data[:max(0, limit_bytes - size)]
        if data:
            parts.append(data)
            size += len(data) + 1
        if limit_bytes is not None and size >= limit_bytes:
            break
    return parts


class TokenData:
    """A token stream split into a training part and a held-out tail, with batches by step index.

    ``batch(step, micro)`` draws ``micro_batch`` windows of ``seq + 1`` tokens at offsets from a generator
    seeded with (seed, step, micro) alone, so it does not depend on what ran before in the process.
    ``eval_batches()`` are fixed, non-overlapping windows of the held-out part.
    """

    def __init__(self, tokens: torch.Tensor, vocab_size: int, seq: int, micro_batch: int, seed: int = 0,
                 eval_fraction: float = 0.05, description: str = "",
                 decode: Callable[[list[int]], str] | None = None,
                 encode: Callable[[str], list[int]] | None = None):
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        split = int(len(tokens) * (1 - eval_fraction))
        self.train, self.held_out = tokens[:split], tokens[split:]
        for name, part in (("training", self.train), ("held-out", self.held_out)):
            if len(part) < seq + 2:
                raise ValueError(f"the {name} part has {len(part)} tokens, fewer than --seq + 2 = {seq + 2}: "
                                 "give more text or a shorter --seq")
        if int(tokens.max()) >= vocab_size:
            raise ValueError(f"token id {int(tokens.max())} does not fit a vocabulary of {vocab_size}")
        self.vocab_size, self.seq, self.micro_batch, self.seed = vocab_size, seq, micro_batch, seed
        self.description = description
        self._decode = decode or (lambda ids: bytes(ids).decode("utf-8", errors="replace"))
        self._encode = encode or (lambda text: list(text.encode("utf-8")))
        digest = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()
        self.fingerprint = f"{len(tokens)}:{digest[:16]}"

    # ---- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes, seq: int, micro_batch: int, **kw) -> "TokenData":
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return cls(tokens, BYTE_VOCAB, seq, micro_batch, **kw)

    @classmethod
    def from_tokenizer(cls, texts: Iterable[str], tokenizer: Any, seq: int, micro_batch: int, **kw) -> "TokenData":
        """Texts encoded one by one with a Hugging Face tokenizer (no special tokens), joined by its EOS if any."""
        ids: list[int] = []
        sep = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
        for text in texts:
            ids.extend(tokenizer.encode(text, add_special_tokens=False))
            ids.extend(sep)
        vocab = max(len(tokenizer), max(ids, default=0) + 1)
        return cls(torch.tensor(ids, dtype=torch.int64), vocab, seq, micro_batch,
                   decode=lambda t: tokenizer.decode(t), encode=lambda s: tokenizer.encode(s, add_special_tokens=False),
                   **kw)

    # ---- batches -----------------------------------------------------------------------------------------
    def batch(self, step: int, micro: int = 0) -> torch.Tensor:
        """The ``micro``-th micro-batch of optimizer step ``step``: (micro_batch, seq + 1) int64 token ids."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_009 + micro)
        starts = torch.randint(0, len(self.train) - self.seq - 1 + 1, (self.micro_batch,), generator=gen)
        return torch.stack([self.train[s:s + self.seq + 1] for s in starts.tolist()]).to(torch.int64)

    def eval_batches(self, limit: int | None = None) -> list[torch.Tensor]:
        """Non-overlapping windows of the held-out part, ``micro_batch`` to a batch, at most ``limit`` batches."""
        n = (len(self.held_out) - 1) // self.seq
        windows = [self.held_out[i * self.seq:i * self.seq + self.seq + 1] for i in range(n)]
        batches = [torch.stack(windows[i:i + self.micro_batch]).to(torch.int64)
                   for i in range(0, len(windows), self.micro_batch)]
        return batches[:limit] if limit is not None else batches

    def state(self, step: int) -> dict:
        """What a checkpoint records of the data position (batches depend on these alone)."""
        return {"step": step, "seed": self.seed, "seq": self.seq, "micro_batch": self.micro_batch,
                "fingerprint": self.fingerprint}

    def check_state(self, state: dict) -> list[str]:
        """How ``state`` (from a checkpoint) differs from this data; empty when resuming here is exact."""
        mine = self.state(state.get("step", 0))
        return [f"{k}: checkpoint {state.get(k)!r}, now {mine[k]!r}" for k in mine if state.get(k) != mine[k]]

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)


def load_text_data(files: Sequence[str] | None, seq: int, micro_batch: int, seed: int = 0,
                   limit_mb: float = 8.0, tokenizer: Any = None, eval_fraction: float = 0.05) -> TokenData:
    """``files`` (all of each), or the standard library's source up to ``limit_mb``; byte-level unless a
    ``tokenizer`` is given."""
    if files:
        chosen, limit, what = [Path(f) for f in files], None, None
    else:
        chosen, limit = stdlib_files(), int(limit_mb * MB)
        what = f"Python {sysconfig.get_python_version()} standard library source"
    parts = read_texts(chosen, limit)
    size = sum(len(p) for p in parts) / MB
    desc = (what or "your text") + f": {len(parts)} file(s), {size:.1f} MB"
    if tokenizer is None:  # files joined by a newline
        return TokenData.from_bytes(b"\n".join(parts), seq, micro_batch, seed=seed, eval_fraction=eval_fraction,
                                    description=desc + ", byte-level")
    texts = [p.decode("utf-8", errors="replace") for p in parts]  # each file encoded alone, joined by EOS
    return TokenData.from_tokenizer(texts, tokenizer, seq, micro_batch, seed=seed, eval_fraction=eval_fraction,
                                    description=desc + ", the model's tokenizer")
