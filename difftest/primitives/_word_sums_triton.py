"""The GPU kernel behind :func:`difftest.run.read_only.digest`: a grid of 64-bit words'
row sums and column sums in one read of it.

torch sums the rows and the columns of a ``[-1, width]`` int64 view in two reductions, each
reading the whole buffer (on an H100 about 1.3 ms each for a production case's 1.8 GB
cache). Here each program reads a run of rows once, writes their row sums and keeps its
column sums; the programs' column sums are added by torch (a few MB). Sums wrap modulo 2**64
in both, so the values are torch's (tests/test_read_only.py). It compiles once per width:
the row count and the rows per program are run-time values, and the buffer is not
specialized on its alignment (tests/test_kernel_specializations.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 8  # rows read per step of a program
_PROGRAMS = 1024  # at most this many programs, each with its own column sums


@triton.jit(do_not_specialize=["rows", "rows_per_program"],
            do_not_specialize_on_alignment=["words_ptr"])
def _word_sums_kernel(words_ptr, row_sums_ptr, column_parts_ptr, rows, rows_per_program,
                      WIDTH: tl.constexpr, TILE: tl.constexpr):
    program = tl.program_id(0)
    columns = tl.arange(0, WIDTH)
    acc = tl.zeros([WIDTH], dtype=tl.int64)
    first = program.to(tl.int64) * rows_per_program
    for step in range(0, rows_per_program, TILE):
        r = first + step + tl.arange(0, TILE)
        inside = r < rows
        tile = tl.load(words_ptr + r[:, None] * WIDTH + columns[None, :], mask=inside[:, None],
                       other=0)
        tl.store(row_sums_ptr + r, tl.sum(tile, axis=1), mask=inside)
        acc += tl.sum(tile, axis=0)
    tl.store(column_parts_ptr + program * WIDTH + columns, acc)


def word_sums(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grid.sum(dim=1), grid.sum(dim=0))`` of a contiguous int64 ``[rows, width]`` grid
    (``width`` a power of two), reading it once."""
    rows, width = grid.shape
    if rows == 0:
        return grid.sum(dim=1), grid.sum(dim=0)
    programs = min(_PROGRAMS, triton.cdiv(rows, _TILE))
    per_program = triton.cdiv(triton.cdiv(rows, programs), _TILE) * _TILE
    programs = triton.cdiv(rows, per_program)
    row_sums = torch.empty(rows, dtype=torch.int64, device=grid.device)
    parts = torch.empty((programs, width), dtype=torch.int64, device=grid.device)
    _word_sums_kernel[(programs,)](grid, row_sums, parts, rows, per_program, WIDTH=width,
                                   TILE=_TILE)
    return row_sums, parts.sum(dim=0)
