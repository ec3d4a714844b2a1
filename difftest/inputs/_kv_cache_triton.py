"""The GPU kernel behind :class:`difftest.inputs.kv_cache.CachePool`: the attended blocks of a case,
written straight into the physical cache.

It moves bytes only (integer views of the KV dtype: uint8 for fp8, int16 for 16-bit types), so
the interpreter needs no fp8 types and every value is the stored one bit for bit: per attended
block, side and slot, the stored element if the slot holds data, else the poison's or NaN's
bit pattern, at the slot's plain or shuffled address (:mod:`difftest.inputs.kv_cache`). One program
writes ``BLOCK`` consecutive destination elements of one side of one block and gathers their
sources, so its stores are contiguous. It compiles once per element size, in-page order, side,
canary mode and geometry: the block tables (views at any offset into one packed buffer) are
not specialized on their alignment, nor the poison and NaN bit patterns on their values
(tests/test_kernel_specializations.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from difftest.machine.devices import interpreted


@triton.jit(do_not_specialize=["poison", "nan"],
            do_not_specialize_on_alignment=["ids_ptr", "written_ptr", "reach_ptr", "read_ptr"])
def _attended_side_kernel(out_ptr, src_ptr, ids_ptr, written_ptr, reach_ptr, read_ptr,
                          block_stride, side_offset, poison, nan,
                          NKV: tl.constexpr, D: tl.constexpr, TOKENS: tl.constexpr,
                          PAGE: tl.constexpr, X: tl.constexpr, SHUFFLED: tl.constexpr,
                          IS_V: tl.constexpr, CANARY: tl.constexpr, BLOCK: tl.constexpr):
    a = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # destination element in the side
    side: tl.constexpr = TOKENS * NKV * D
    mask = g < side
    if SHUFFLED:
        page_elems: tl.constexpr = PAGE * NKV * D
        p = g // page_elems
        r = g % page_elems
        h = r // (PAGE * D)
        r = r % (PAGE * D)
        if IS_V:  # page [nkv, 16/x, D, x]
            i = (r // (D * X)) * X + r % X
            d = (r % (D * X)) // X
        else:  # page [nkv, D/x, 16, x]
            i = (r % (PAGE * X)) // X
            d = (r // (PAGE * X)) * X + r % X
        t = p * PAGE + i
        s = (t * NKV + h) * D + d
    else:
        t = g // (NKV * D)
        s = g
    if CANARY:
        read = tl.load(read_ptr + a * TOKENS + t, mask=mask, other=0)
        is_data = read != 0
        filler = tl.zeros([BLOCK], dtype=tl.int32) + nan
    else:
        written = tl.load(written_ptr + a)
        reach = tl.load(reach_ptr + a)
        is_data = (t < written) & (t < reach)
        filler = tl.where(t < reach, tl.zeros([BLOCK], dtype=tl.int32) + poison,
                          tl.zeros([BLOCK], dtype=tl.int32) + nan)
    value = tl.load(src_ptr + a * side + s, mask=mask & is_data, other=0).to(tl.int32)
    value = tl.where(is_data, value, filler)
    base = tl.load(ids_ptr + a) * block_stride + side_offset
    tl.store(out_ptr + base + g, value.to(out_ptr.dtype.element_ty), mask=mask)


def write_attended_triton(raw: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          block_ids: torch.Tensor, written: torch.Tensor, reach: torch.Tensor,
                          read: torch.Tensor | None, *, block_stride: int, v_offset: int,
                          shuffled: bool, page_size: int, poison: int, nan: int) -> None:
    """Write the attended blocks into ``raw`` (an integer view of the cache, whose block
    ``b``'s side ``s`` is the contiguous run at ``b * block_stride + s * v_offset``:
    :meth:`difftest.case.layouts.KVLayout.side_addressing`) from the integer views ``k``/``v``
    (``[attended, B, nkv, D]``); ``read``: the canary mode's read slots ``[attended, B]``
    (else ``None``: data below ``written``, poison below ``reach``, NaN past it);
    ``poison``/``nan``: the bit patterns, as the view's integers."""
    attended, tokens, nkv, d = k.shape
    if not attended:
        return
    side = tokens * nkv * d
    block = triton.next_power_of_2(side)
    if not interpreted():  # the interpreter's cost is per program: there one writes a side
        block = min(4096, block)
    x = 16 // raw.element_size()
    ids = block_ids.to(torch.int64).contiguous()
    written = written.to(torch.int64).contiguous()
    reach = reach.to(torch.int64).contiguous()
    read_mask = read.to(torch.uint8).contiguous() if read is not None else written
    grid = (attended, triton.cdiv(side, block))
    for is_v, src in ((False, k), (True, v)):
        side_offset = v_offset if is_v else 0
        _attended_side_kernel[grid](
            raw, src.contiguous(), ids, written, reach, read_mask, block_stride, side_offset,
            poison, nan, NKV=nkv, D=d, TOKENS=tokens, PAGE=page_size, X=x, SHUFFLED=shuffled,
            IS_V=is_v, CANARY=read is not None, BLOCK=block)
