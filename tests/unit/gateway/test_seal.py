"""Sealing splits batches to fit the packet limit and never burns a seq."""

from __future__ import annotations

import numpy as np

from shoal.gateway._seal import seal_block
from shoal.loadtest.data import synthetic_block
from shoal.schemas import Encoding, decode_batch, encode_batch


def encoder(encoding: Encoding):
    def encode(block, seq):
        return encode_batch(block, gateway_id="gw", seq=seq, sent_at_ms=1, encoding=encoding)

    return encode


def test_a_batch_that_fits_is_one_part() -> None:
    block = synthetic_block(1000)
    sealed = seal_block(block, first_seq=7, limit_bytes=1 << 20, encode=encoder(Encoding.JSON_ROWS))
    assert [(p.seq, p.rows) for p in sealed.parts] == [(7, 1000)]
    assert sealed.splits == 0


def test_splits_in_halves_until_every_part_fits_a_tiny_limit() -> None:
    block = synthetic_block(5000)
    limit = 4096
    sealed = seal_block(block, first_seq=3, limit_bytes=limit, encode=encoder(Encoding.JSON_ROWS))
    assert all(len(p.payload) <= limit for p in sealed.parts)
    assert [p.seq for p in sealed.parts] == list(range(3, 3 + len(sealed.parts)))
    assert sealed.splits == len(sealed.parts) - 1
    assert sealed.too_large == []
    # Rows stay in order and complete; every payload decodes with its own seq.
    starts = [p.row_start for p in sealed.parts]
    assert starts == sorted(starts)
    assert sum(p.rows for p in sealed.parts) == 5000
    values = np.concatenate(
        [decode_batch(p.payload).frame.get_column("value").to_numpy() for p in sealed.parts]
    )
    np.testing.assert_array_equal(values, block.value)
    assert [decode_batch(p.payload).envelope.seq for p in sealed.parts] == [
        p.seq for p in sealed.parts
    ]


def test_a_row_that_cannot_fit_alone_is_reported_and_others_still_sealed() -> None:
    block = synthetic_block(4)
    sizes = [len(encoder(Encoding.JSON_ROWS)(block.slice(i, i + 1), 0)) for i in range(4)]
    limit = min(sizes) - 1  # no single row fits
    sealed = seal_block(block, first_seq=0, limit_bytes=limit, encode=encoder(Encoding.JSON_ROWS))
    assert sealed.parts == []
    assert sealed.too_large == [0, 1, 2, 3]
