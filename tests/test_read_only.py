"""The read-only check's digest (difftest/run/read_only.py): what it detects, and its GPU
kernel's sums (difftest/primitives/_word_sums_triton.py) equal to torch's."""

from __future__ import annotations

import pytest
import torch

from difftest.machine import devices
from difftest.run.read_only import WIDTH, digest


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_changed_word_or_two_offsetting_ones_change_the_digest() -> None:
    """One word changed changes its row and its column sum; two words of one row changed by
    opposite amounts leave the row sum and change two column sums; a view at an odd byte
    offset and a tail shorter than a word are read too."""
    buffer = torch.randint(-2**62, 2**62, (3 * WIDTH + 5,), dtype=torch.int64)
    taken = digest(buffer)
    assert _same(taken, digest(buffer.clone()))
    one = buffer.clone()
    one[WIDTH + 7] += 1
    assert not _same(taken, digest(one))
    offset = buffer.clone()
    offset[3] += 5
    offset[9] -= 5
    assert torch.equal(digest(offset)[0], taken[0]) and not _same(taken, digest(offset))
    raw = torch.arange(8 * WIDTH + 11, dtype=torch.int32).view(torch.uint8)[1:]
    changed = raw.clone()
    changed[-1] ^= 1  # the last byte, past the last whole word
    assert not _same(digest(raw), digest(changed))


@pytest.mark.skipif(not devices.interpreted(),
                    reason="Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
def test_the_gpu_kernel_sums_as_torch_does() -> None:
    """Row and column sums of int64 grids, wrapping modulo 2**64 as torch's, for row counts
    below one tile, between tiles, and over more programs than the kernel starts."""
    from difftest.primitives._word_sums_triton import word_sums

    generator = torch.Generator().manual_seed(3)
    for rows, width in ((1, 16), (13, 64), (8 * 1024 + 37, 16), (300, 1024)):
        grid = torch.randint(-2**63, 2**63 - 1, (rows, width), dtype=torch.int64,
                             generator=generator)
        row_sums, column_sums = word_sums(grid)
        assert torch.equal(row_sums, grid.sum(dim=1))
        assert torch.equal(column_sums, grid.sum(dim=0))
    empty = torch.zeros((0, 16), dtype=torch.int64)
    assert [t.shape for t in word_sums(empty)] == [(0,), (16,)]
