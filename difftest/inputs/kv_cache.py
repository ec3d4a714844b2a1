"""The physical KV cache of a case, built as vLLM lays it out, and its page views.

Which bytes go where is the case's layout object's (:mod:`difftest.case.layouts`: MiniMax-M3's
LBHNC and LHBNC caches, vLLM's split K/V cache): its raw buffer, the
``[n, 2, block_size, nkv, D]`` view writers write through, and the K and V page views a
kernel receives in each in-page order (``plain`` token-major pages, ``shuffled`` AITER
pages). This module decides what is written: data, poison and NaN canaries.

Canaries: every page that no query row attends is NaN, so a backend reading a wrong page
produces NaN instead of a plausible number. Slots of an attended page past the owning
request's written tokens hold a large finite poison, as do page 0 of each side of physical
block 0 (vLLM's null block), which kernels legitimately load for padded lanes and multiply
by zero. A case with ``canary`` set goes further: every slot of an attended block that no
row reads (:func:`difftest.case.selection.read_slots`: outside every row's window, past the
written tokens) is NaN, so a kernel that loads such a slot and multiplies it by a zero weight
is caught too.

Reuse: :func:`build_cache` fills a fresh buffer per case; a session's :class:`CachePool` keeps
one buffer per (layout, order) and rewrites only the blocks that differ (the same bytes; on a
GPU its attended blocks are written by one fused Triton kernel per side,
:mod:`difftest.inputs._kv_cache_triton`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from difftest.case.layouts import IN_PAGE_ORDERS
from difftest.case.selection import SparseRow
from difftest.case.spec import Case
from difftest.inputs.case_data import CaseData

__all__ = ["IN_PAGE_ORDERS", "POISON", "CachePool", "CacheViews", "PooledCacheModified",
           "build_cache", "write_attended"]

POISON = 192.0  # finite in every KV dtype, e4m3fnuz (max 240) included


@dataclass(frozen=True)
class CacheViews:
    """A physical cache and the K and V page views a kernel receives (K untrimmed)."""

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
    """``[attended, block_size]`` bool: the slots some row reads (each segment's attended
    tokens, :class:`~difftest.inputs.case_data.Segments`)."""
    seg = data.segments
    slot = torch.arange(case.block_size, device=seg.first.device)
    read = (slot >= seg.first[..., None]) & (slot < seg.tokens[..., None])  # [rows, width, B]
    count = torch.zeros((data.written.numel(), case.block_size), dtype=torch.int32,
                        device=seg.first.device)
    count.index_add_(0, seg.slots.flatten(), read.flatten(0, 1).to(torch.int32))
    return count > 0


def _attended_sides(case: Case, data: CaseData) -> torch.Tensor:
    """``[attended, 2, B, nkv, D]`` token-major sides of the attended blocks (ascending id):
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
    """Rewrite token-major pages of ``[blocks, 2, B, nkv, D]`` sides into AITER's order."""
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

    What rows attend comes from ``data.segments`` (the tables
    :func:`difftest.inputs.case_data.generate` made from ``rows``), so the build is tensor work on
    the data's device, no host copies.
    """
    case.layout.check_order(in_page_order)
    device = data.k_stored.device
    # The buffer is allocated in its layout's order and written through the layout's
    # [n, 2, B, nkv, D] view, not built block-major and copied (540 MB, 1.5 s on a CPU).
    raw = _base_buffer(case, data.k_stored.dtype, device)
    sides = case.layout.sides(raw, case)
    # Page order does not matter for uniform pages, so only attended blocks are shuffled.
    attended = _attended_sides(case, data)
    if attended.shape[0]:
        if in_page_order == "shuffled":
            attended = _shuffle(attended, case)
        sides[data.block_ids] = attended
    return _views(case, raw, in_page_order)


def _views(case: Case, raw: torch.Tensor, in_page_order: str) -> CacheViews:
    """The page views of ``raw`` (the case layout's
    :meth:`~difftest.case.layouts.KVLayout.views`)."""
    k, v = case.layout.views(raw, case, in_page_order)
    return CacheViews(case.kv_layout, in_page_order, raw, k, v, case.block_page_stride,
                      case.layout.v_page_offset(case))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its element size (bit moves never touch a NaN payload)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


@functools.cache
def _bits(value: float, dtype: torch.dtype) -> int:
    """The bit pattern of ``value`` in ``dtype``, as its integer view's value (once per pair:
    four small CPU tensors a case cost more host time than the restore's fill)."""
    return int(_ints(torch.full((1,), value, dtype=dtype))[0])


@functools.cache
def _word(value: float, dtype: torch.dtype) -> int:
    """``value``'s bit pattern in ``dtype`` repeated over 8 bytes, as an int64."""
    repeated = torch.full((8 // dtype.itemsize,), _bits(value, dtype),
                          dtype=_INT_OF_SIZE[dtype.itemsize])
    return int(repeated.view(torch.int64)[0])


def write_attended(case: Case, data: CaseData, raw: torch.Tensor, in_page_order: str,
                   triton: bool) -> None:
    """Write the attended blocks of ``case`` into ``raw`` (its layout's buffer), each block
    whole, with the bytes :func:`build_cache` gives them.

    ``triton``: one fused kernel per side (:mod:`difftest.inputs._kv_cache_triton`; the GPU
    path, or the interpreter in tests) instead of the torch stack, masks and index copy (the
    CPU path), for the layouts it addresses (:attr:`~difftest.case.layouts.KVLayout.fused_writer`).
    """
    if not data.block_ids.numel():
        return
    layout, dtype = case.layout, data.k_stored.dtype
    # the constants _attended_sides makes, so the same bits
    poison, nan = _bits(POISON, dtype), _bits(float("nan"), dtype)
    ints, canary = _ints(raw), case.canary
    if triton and layout.fused_writer:
        from difftest.inputs._kv_cache_triton import write_attended_triton

        block_stride, v_offset = layout.side_addressing(case)
        write_attended_triton(
            ints, _ints(data.k_stored), _ints(data.v_stored), data.block_ids, data.written,
            data.written if canary else _reach(case, data),
            _read_slots(case, data) if canary else None, block_stride=block_stride,
            v_offset=v_offset, shuffled=in_page_order == "shuffled",
            page_size=case.page_size, poison=poison, nan=nan)
        return
    # _attended_sides on integer views, one select per side (vectorised, where fp8 is not),
    # copied through a shuffled view of the destination instead of a shuffled copy
    n, nkv, d, ps, bs = (case.num_blocks, case.num_kv_heads, case.head_dim, case.page_size,
                         case.block_size)
    ids, device = data.block_ids, ints.device
    tokens = torch.arange(bs, device=device).view(1, -1)
    if canary:
        is_data = _read_slots(case, data)
        fill = torch.full((1, bs), nan, dtype=ints.dtype, device=device)
    else:
        reach = _reach(case, data).view(-1, 1)
        is_data = (tokens < data.written.view(-1, 1)) & (tokens < reach)
        fill = torch.where(tokens < reach, torch.tensor(poison, dtype=ints.dtype),
                           torch.tensor(nan, dtype=ints.dtype))
    blocks = layout.sides(ints, case)  # [n, 2, B, nkv, D]
    x, pages = 16 // raw.element_size(), bs // ps
    for side, stored in enumerate((data.k_stored, data.v_stored)):
        sides = torch.where(is_data[:, :, None, None], _ints(stored), fill[:, :, None, None])
        dest, lead = blocks[:, side], sides.shape[0]
        if in_page_order == "plain":
            dest.index_copy_(0, ids, sides)
        elif side == 0:  # pages [nkv, D/x, P, x]
            src = sides.view(lead, pages, ps, nkv, d // x, x).permute(0, 1, 3, 4, 2, 5)
            dest.view(n, pages, nkv, d // x, ps, x).index_copy_(0, ids, src)
        else:  # pages [nkv, P/x, D, x]
            src = sides.view(lead, pages, ps // x, x, nkv, d).permute(0, 1, 4, 2, 5, 3)
            dest.view(n, pages, nkv, ps // x, d, x).index_copy_(0, ids, src)


@dataclass
class _Slot:
    key: tuple[object, ...]
    raw: torch.Tensor
    wrote: torch.Tensor  # the block ids the last build wrote (int64, on the device)
    check: int = 0  # the next chunk of blocks to verify


def _raw_bytes(case: Case, dtype: torch.dtype) -> int:
    return case.layout.raw_bytes(case, dtype.itemsize)


def _holds(spare: torch.Tensor, case: Case, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``spare``'s memory can hold ``case``'s buffer in ``dtype`` on ``device``."""
    return (spare.device == device
            and spare.numel() * spare.element_size() >= _raw_bytes(case, dtype))


def _base_buffer(case: Case, dtype: torch.dtype, device: torch.device,
                spare: torch.Tensor | None = None) -> torch.Tensor:
    """A physical buffer in its base state: NaN, with poison on page 0 of block 0's sides.
    In the memory of ``spare`` (which the caller found large enough, :func:`_holds`) when
    given: that spares the CPU faulting in fresh pages (0.1-0.75 s at 8235 blocks)."""
    shape = case.layout.raw_shape(case)
    if spare is not None:
        raw = spare.view(-1).view(torch.uint8)[:_raw_bytes(case, dtype)].view(dtype).view(shape)
        raw.fill_(float("nan"))
    else:
        raw = torch.full(shape, float("nan"), dtype=dtype, device=device)
    case.layout.sides(raw, case)[0, :, : case.page_size] = POISON
    return raw


class PooledCacheModified(RuntimeError):
    """Bytes of a pooled cache outside the blocks its last build wrote have changed."""


class CachePool:
    """Physical cache buffers kept across a session's cases, one per (layout, in-page order).

    :func:`build_cache` fills a whole fresh buffer with NaN each time (at production shape
    1.8 GB per order: most of the framework's device time per case, and freeing it costs the
    CPU ~0.4 s). A pool keeps the buffer and, before the next case, restores only what the last
    case wrote (its attended blocks, and block 0 to NaN with poison on page 0 of each side),
    then writes the new case's attended blocks whole (on a GPU with one fused Triton kernel,
    :func:`write_attended`). The cache a backend sees is bit-identical to a fresh
    :func:`build_cache` (``tests/test_cache_reuse.py``). A slot is dropped when anything that
    fixes its buffer changes (blocks, dtype, dims, device), so at most one buffer per
    (layout, order) is held; its memory is refilled for the new buffer when large enough.

    The views of one build are valid until the next build of the same slot: a pooled
    :class:`~difftest.contract.backend.RunInputs` must not be read after the next case starts.

    The risk a fresh buffer did not have: a backend writing into its input cache outside the
    attended blocks would leave bytes there for later cases (today they would reach only the
    later backends of the same case). Guards: :func:`difftest.run.runner.run_case` clears the pool
    after a case in which a backend failed (errored, crashed or disagreed), and each restore
    verifies one of ``check_chunks`` rotating chunks of blocks 1.. to be NaN again (all of the
    buffer every ``check_chunks`` cases, 1/64 of the fill's bytes read per case): a changed
    byte drops the buffer and raises :class:`PooledCacheModified`, which the runner reports as
    that case's cache-building error.
    """

    def __init__(self, triton: bool | None = None, check_chunks: int = 64) -> None:
        """``triton``: write with the Triton kernel (default: on CUDA devices only)."""
        self.triton = triton
        self.check_chunks = max(1, check_chunks)
        self._slots: dict[tuple[str, str], _Slot] = {}

    def clear(self) -> None:
        """Drop every buffer (the next build of each slot starts from a fresh fill)."""
        self._slots.clear()

    def buffers(self) -> int:
        """How many buffers the pool holds."""
        return len(self._slots)

    def held_bytes(self) -> int:
        """Bytes of the buffers the pool holds (reused or refilled by the next builds)."""
        return sum(slot.raw.numel() * slot.raw.element_size() for slot in self._slots.values())

    def cache(self, case: Case, data: CaseData, in_page_order: str) -> CacheViews:
        """The cache of ``case`` in ``in_page_order``, in the pool's buffer: the bytes of
        ``build_cache(case, data, rows, in_page_order)``."""
        case.layout.check_order(in_page_order)
        device = data.k_stored.device
        dtype = data.k_stored.dtype
        slot_id = (case.kv_layout, in_page_order)
        key = (case.num_blocks, dtype, case.block_size, case.page_size, case.num_kv_heads,
               case.head_dim, device)
        slot = self._slots.get(slot_id)
        spare = None
        if slot is not None and slot.key != key:
            spare = self._slots.pop(slot_id).raw  # its memory is refilled if large enough
            slot = None
        try:
            if slot is None:
                if spare is not None and not _holds(spare, case, dtype, device):
                    spare = None  # freed before the new buffer is allocated
                slot = _Slot(key, _base_buffer(case, dtype, device, spare),
                             torch.empty(0, dtype=torch.int64, device=device))
                spare = None
            else:
                self._restore(case, slot)
            self._slots[slot_id] = slot
            write_attended(case, data, slot.raw, in_page_order,
                           device.type == "cuda" if self.triton is None else self.triton)
            slot.wrote = data.block_ids
        except BaseException:
            self._slots.pop(slot_id, None)  # a half-written buffer is never reused
            raise
        return _views(case, slot.raw, in_page_order)

    def _restore(self, case: Case, slot: _Slot) -> None:
        """Put back the base state where the last build wrote, and verify one chunk."""
        raw, ints = slot.raw, _ints(slot.raw)
        fill, poison = _bits(float("nan"), raw.dtype), _bits(POISON, raw.dtype)
        blocks = case.layout.sides(ints, case)  # [n, 2, B, nkv, D]
        # the same bytes as 8-byte words, block first: an eighth of the elements to fill and
        # compare (a block's side is B * c elements, B a multiple of 16: whole words)
        n = case.num_blocks
        words = case.layout.block_words(ints, case)
        fill_word = _word(float("nan"), raw.dtype)
        if slot.wrote.numel():
            words.index_fill_(0, slot.wrote, fill_word)
        blocks[0] = fill
        blocks[0, :, : case.page_size] = poison
        per = -(-(n - 1) // self.check_chunks)
        lo = 1 + slot.check * per
        slot.check = (slot.check + 1) % self.check_chunks
        if lo < n and bool((words[lo: lo + per] != fill_word).any()):
            raise PooledCacheModified(
                f"the pooled {case.kv_layout} cache has non-NaN bytes in blocks "
                f"{lo}..{min(n, lo + per) - 1}, outside every block its builds wrote: a backend "
                f"of an earlier case (at most {self.check_chunks} cases back) wrote into its "
                "input cache; the buffer is dropped and rebuilt fresh")
