"""Real text with no download: byte-level tokens from the Python standard library's own
source files, which every Python installation has.

Files are split into train and validation by a hash of their path relative to the stdlib
root (deterministic across machines with the same Python version), each split is one byte
tensor (files joined by a blank line), and batches are random windows drawn on the tensor's
device with a seeded generator, so loading costs one gather per step.
"""
from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

VOCAB_SIZE = 256  # bytes


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Path] = None) -> List[Path]:
    """Every .py file of the standard library (not site-packages), sorted by relative path."""
    root = root or stdlib_root()
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts and f.is_file()]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def is_validation(relative_path: str, val_per_mille: int) -> bool:
    """A file's split, from a CRC of its relative path: stable across runs and machines."""
    return zlib.crc32(relative_path.encode()) % 1000 < val_per_mille


@dataclass
class ByteCorpus:
    """Train and validation byte streams (uint8 tensors) and the files behind each."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: List[str]
    val_files: List[str]

    @classmethod
    def from_stdlib(cls, val_per_mille: int = 50, max_bytes: Optional[int] = None, root: Optional[Path] = None,
                    device=None) -> "ByteCorpus":
        """val_per_mille: share of files (per 1000) held out for validation; max_bytes caps
        each split (files are taken in sorted order until the cap), for small machines."""
        if not 0 < val_per_mille < 1000:
            raise ValueError(f"val_per_mille must be in (0, 1000), got {val_per_mille}")
        root = root or stdlib_root()
        parts = {True: [], False: []}
        names = {True: [], False: []}
        sizes = {True: 0, False: 0}
        for f in stdlib_files(root):
            rel = f.relative_to(root).as_posix()
            val = is_validation(rel, val_per_mille)
            if max_bytes is not None and sizes[val] >= max_bytes:
                continue
            data = f.read_bytes() + b"\n\n"
            parts[val].append(data)
            names[val].append(rel)
            sizes[val] += len(data)
        if not parts[False] or not parts[True]:
            raise RuntimeError(f"no Python sources found under {root} for both splits")

        def stream(chunks):
            t = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
            return t[:max_bytes].to(device) if max_bytes is not None else t.to(device)
        return cls(stream(parts[False]), stream(parts[True]), names[False], names[True])

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64 on the corpus device: random
        windows of the split, targets shifted by one byte. `generator` lives on that device."""
        data = {"train": self.train, "val": self.val}[split]
        if data.numel() <= seq_len + 1:
            raise ValueError(f"{split} split has {data.numel()} bytes, too few for seq_len={seq_len}")
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size, 1), generator=generator,
                               device=data.device)
        idx = starts + torch.arange(seq_len + 1, device=data.device)  # (B, T + 1)
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]


__all__ = ["VOCAB_SIZE", "ByteCorpus", "stdlib_files", "stdlib_root", "is_validation"]
