"""Encode a block into batches that fit the packet limit, splitting in halves when needed.

Pure: the encoder is passed in. Seqs are handed out in order and only to batches that fit,
so a split never leaves a gap in the gateway's sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shoal.schemas import Measurements

Encoder = Callable[[Measurements, int], bytes]
"""Encodes a block as the payload of the batch with the given seq."""


@dataclass(frozen=True, slots=True)
class Part:
    """One sealed batch: its seq, its payload and which rows of the block it holds."""

    seq: int
    payload: bytes
    row_start: int
    row_stop: int

    @property
    def rows(self) -> int:
        """Measurements in the batch."""
        return self.row_stop - self.row_start


@dataclass(frozen=True, slots=True)
class Sealed:
    """The outcome of sealing one block.

    Attributes:
        parts: batches that fit, in row order, with consecutive seqs.
        splits: how many times a batch was cut in half to fit.
        too_large: rows that do not fit even alone (0-based, in the block); they were left out.
    """

    parts: list[Part]
    splits: int
    too_large: list[int]


def seal_block(block: Measurements, *, first_seq: int, limit_bytes: int, encode: Encoder) -> Sealed:
    """Encode ``block`` as one batch, or as halves (recursively) until each fits.

    Args:
        block: the measurements, in order.
        first_seq: the seq of the first batch; the others follow without gaps.
        limit_bytes: the largest payload allowed.
        encode: the encoder.
    """
    parts: list[Part] = []
    too_large: list[int] = []
    splits = 0
    seq = first_seq
    stack = [(0, len(block))]
    while stack:
        start, stop = stack.pop()
        payload = encode(block.slice(start, stop), seq)
        if len(payload) <= limit_bytes:
            parts.append(Part(seq, payload, start, stop))
            seq += 1
        elif stop - start <= 1:
            too_large.append(start)
        else:
            middle = (start + stop) // 2
            stack.append((middle, stop))
            stack.append((start, middle))
            splits += 1
    return Sealed(parts, splits, too_large)
