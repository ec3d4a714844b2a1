"""Inputs are read-only to backends: finding a backend that wrote into what it was given.

Every backend of a case reads the same tensors: the query and the stored K/V
(:class:`~difftest.inputs.case_data.CaseData`, its segment tables included), the page table and
context lengths, and each cache built (its whole physical buffer, so a write outside the views
shows too). :class:`InputDigests` takes a digest of each before a backend runs and compares
after: a backend that changed one gets the error ``wrote into its inputs`` naming it, and the
runner rebuilds the inputs, so the backends after it are judged on intact ones.

A digest reads every byte on the tensor's device, with no copy: the sums of the tensor's
64-bit words by rows and by columns of a ``[-1, 1024]`` view (sums that wrap rather than
overflow; on a GPU both in one read, :mod:`difftest.primitives._word_sums_triton`). A write
changes a row sum and a column sum unless it changes several words in offsetting ways at
once, which a stray or erroneous write does not. A copy of each input per backend would
double the device memory a production case needs and cost more time (measured:
docs/performance.md, "Read-only inputs").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from difftest.contract.backend import RunInputs

WIDTH = 1024  # words per row of the digest's view


def digest(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row and column sums of ``tensor``'s bytes as 64-bit words (the words short of a
    whole row, and the bytes short of a word, summed as one more row), on its device."""
    data = tensor.detach()
    if not data.is_contiguous() or data.data_ptr() % 8:
        data = data.clone(memory_format=torch.contiguous_format)
    raw = data.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64)
    rows = words.numel() // WIDTH * WIDTH
    grid = words[:rows].view(-1, WIDTH)
    tail = torch.cat((words[rows:], raw[whole:].to(torch.int64)))
    if grid.is_cuda:  # one read of the buffer, not two (the same sums)
        from difftest.primitives._word_sums_triton import word_sums

        row_sums, column_sums = word_sums(grid)
    else:
        row_sums, column_sums = grid.sum(dim=1), grid.sum(dim=0)
    return torch.cat((row_sums, tail.sum().view(1))), column_sums


def shared_tensors(inputs: RunInputs) -> Iterator[tuple[str, torch.Tensor]]:
    """``(what, tensor)`` for every tensor of ``inputs`` that backends share, built so far."""
    data = inputs.data
    yield "the query", data.query
    yield "the stored K", data.k_stored
    yield "the stored V", data.v_stored
    seg = data.segments
    for column in dataclasses.fields(seg):
        yield f"the segment table's {column.name}", getattr(seg, column.name)
    yield "the block ids", data.block_ids
    yield "the written token counts", data.written
    table, ctx = inputs.sparse_table
    yield "the page table", table
    yield "the context lengths", ctx
    for order, views in inputs.built_caches().items():
        yield f"the {order} cache", views.raw


class InputDigests:
    """The digests of a case's shared inputs, each taken when first seen (a cache when it is
    built, before the backend that asked for it runs)."""

    def __init__(self, inputs: RunInputs) -> None:
        self.inputs = inputs
        self._digests: dict[str, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.take()

    def take(self) -> None:
        """Digest the shared tensors not digested yet (a cache built since)."""
        for what, tensor in shared_tensors(self.inputs):
            if what not in self._digests:
                self._digests[what] = (tensor.data_ptr(), digest(tensor))

    def changed(self) -> list[str]:
        """What changed since its digest (a tensor replaced counts as changed)."""
        found = []
        for what, tensor in shared_tensors(self.inputs):
            taken = self._digests.get(what)
            if taken is None:
                continue  # built by the backend that just ran: digested before the next
            pointer, (rows, columns) = taken
            now_rows, now_columns = digest(tensor)
            if pointer != tensor.data_ptr() or not (
                    torch.equal(rows, now_rows) and torch.equal(columns, now_columns)):
                found.append(what)
        return found
