"""The physical per-layer KV cache exactly as vLLM lays it out, and its page-16 views.

LBHNC (production): one tensor ``[num_blocks, 2, 128, nkv*D]``; each block holds its K side
(8 pages of 16 tokens) then its V side. The K view numbers all 16 pages of every block, the V
view is the same bytes starting 8 pages in, so V is 8 pages shorter and one page id
``block * 16 + j`` (j < 8) addresses both sides. LHBNC: a K plane and a V plane, each
``[num_blocks, 128, nkv*D]``, equal page counts, page id ``block * 8 + j``.

In-page order: ``plain`` pages are token-major ``[16, nkv, D]`` (what vLLM's Triton kernels
read); ``shuffled`` pages are AITER's K ``[nkv, D/x, 16, x]`` and V ``[nkv, 16/x, D, x]``,
``x = 16 // itemsize``.

Canaries: every page that no query row attends is NaN, so a backend reading a wrong page
produces NaN instead of a plausible number. Slots of an attended page past the owning
request's written tokens hold a large finite poison, as do page 0 of each side of physical
block 0 (vLLM's null block), which kernels legitimately load for padded lanes and multiply
by zero. A case with ``canary`` set goes further: every slot of an attended block that no
row reads (outside every row's sliding window, past the written tokens) is NaN, so a kernel
that loads such a slot and multiplies it by a zero weight is caught too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftest.case import Case
from difftest.inputs import CaseData
from difftest.sparse_table import SparseRow

IN_PAGE_ORDERS: tuple[str, ...] = ("plain", "shuffled")
POISON = 192.0  # finite in every KV dtype, e4m3fnuz (max 240) included


@dataclass(frozen=True)
class CacheViews:
    """A physical cache and the page-16 K and V views a kernel receives (K untrimmed)."""

    layout: str
    in_page_order: str
    raw: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    block_page_stride: int
    v_page_offset: int


def _reach(case: Case, data: CaseData) -> torch.Tensor:
    """``[attended]``: slots of the leading pages some row attends, per block (ascending id)."""
    seg = data.segments
    pages = (seg.tokens + case.page_size - 1) // case.page_size
    reach = torch.zeros_like(data.written)
    return reach.scatter_reduce(0, seg.slots.flatten(), pages.flatten() * case.page_size,
                                "amax")


def _read_slots(case: Case, data: CaseData) -> torch.Tensor:
    """``[attended, block_size]`` bool: the slots some row reads (its window, if any)."""
    seg = data.segments
    first = (seg.context_lens - case.sliding_window if case.sliding_window
             else torch.zeros_like(seg.context_lens))
    start = (first[:, None] - seg.starts).clamp(min=0)  # [rows, width]
    slot = torch.arange(case.block_size, device=start.device)
    read = (slot >= start[..., None]) & (slot < seg.tokens[..., None])  # [rows, width, 128]
    count = torch.zeros((data.written.numel(), case.block_size), dtype=torch.int32,
                        device=start.device)
    count.index_add_(0, seg.slots.flatten(), read.flatten(0, 1).to(torch.int32))
    return count > 0


def _attended_sides(case: Case, data: CaseData) -> torch.Tensor:
    """``[attended, 2, 128, nkv, D]`` token-major sides of the attended blocks (ascending id):
    data where written, poison where not, NaN on pages no row reaches (with ``canary``: data
    where some row reads, NaN everywhere else)."""
    sides = torch.stack((data.k_stored, data.v_stored), dim=1)
    nan = torch.tensor(float("nan"), dtype=sides.dtype, device=sides.device)
    if case.canary:
        return torch.where(_read_slots(case, data)[:, None, :, None, None], sides, nan)
    tokens = torch.arange(case.block_size, device=sides.device).view(1, -1)
    poison = torch.tensor(POISON, dtype=sides.dtype, device=sides.device)
    sides = torch.where((tokens < data.written.view(-1, 1))[:, None, :, None, None], sides,
                        poison)
    return torch.where((tokens < _reach(case, data).view(-1, 1))[:, None, :, None, None],
                       sides, nan)


def _shuffle(sides: torch.Tensor, case: Case) -> torch.Tensor:
    """Rewrite token-major pages of ``[blocks, 2, 128, nkv, D]`` sides into AITER's order."""
    lead = sides.shape[0]
    nkv, d = case.num_kv_heads, case.head_dim
    x = 16 // sides.element_size()
    pages = sides.view(lead, 2, case.pages_per_side, case.page_size, nkv, d)
    k = pages[:, 0].reshape(lead, case.pages_per_side, case.page_size, nkv, d // x, x)
    k = k.permute(0, 1, 3, 4, 2, 5)  # [lead, page, nkv, D/x, 16, x]
    v = pages[:, 1].reshape(lead, case.pages_per_side, case.page_size // x, x, nkv, d)
    v = v.permute(0, 1, 4, 2, 5, 3)  # [lead, page, nkv, 16/x, D, x]
    out = torch.empty_like(sides)
    out_pages = out.view(lead, 2, case.pages_per_side, -1)
    out_pages[:, 0] = k.reshape(lead, case.pages_per_side, -1)
    out_pages[:, 1] = v.reshape(lead, case.pages_per_side, -1)
    return out


def build_cache(
    case: Case, data: CaseData, rows: tuple[SparseRow, ...], in_page_order: str
) -> CacheViews:
    """The physical cache of ``case`` in ``in_page_order`` and its page-16 views.

    What rows attend comes from ``data.segments`` (the tables :func:`difftest.inputs.generate`
    made from ``rows``), so the build is tensor work on the data's device, no host copies.
    """
    if in_page_order not in IN_PAGE_ORDERS:
        raise ValueError(f"in_page_order {in_page_order!r} is not one of {IN_PAGE_ORDERS}")
    n, nkv, d, ps = case.num_blocks, case.num_kv_heads, case.head_dim, case.page_size
    device = data.k_stored.device
    # Page order does not matter for uniform pages, so only attended blocks are shuffled.
    sides = torch.full((n, 2, case.block_size, nkv, d), float("nan"), dtype=data.k_stored.dtype,
                       device=device)
    sides[0, :, : case.page_size] = POISON
    attended = _attended_sides(case, data)
    if attended.shape[0]:
        if in_page_order == "shuffled":
            attended = _shuffle(attended, case)
        sides[data.block_ids] = attended
    c = nkv * d
    if case.kv_layout == "LBHNC":
        raw = sides.reshape(n, 2, case.block_size, c)
        k_src = v_src = raw
        pages_per_block, v_offset = 2 * case.pages_per_side, case.pages_per_side
    else:
        raw = sides.reshape(n, 2, case.block_size, c).transpose(0, 1).contiguous()
        k_src, v_src = raw[0], raw[1]
        pages_per_block, v_offset = case.pages_per_side, 0
    count = n * pages_per_block
    if in_page_order == "plain":
        k = k_src.view(count, ps, nkv, d)
        v = v_src.view(count, ps, nkv, d)[v_offset:]
    else:
        x = 16 // raw.element_size()
        k = k_src.view(count, nkv, d // x, ps, x)
        v = v_src.view(count, nkv, ps // x, d, x)[v_offset:]
    return CacheViews(case.kv_layout, in_page_order, raw, k, v, pages_per_block, v_offset)
