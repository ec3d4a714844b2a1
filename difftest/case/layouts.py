"""The KV cache layouts as objects: each owns its addressing, its raw buffer and its views.

A layout answers, for a cache geometry (:class:`Geometry`: blocks, block and page sizes, KV
heads, head size): which geometries it holds (:meth:`KVLayout.check`), how page ids address
its blocks (``block * block_page_stride + j``, the V view starting ``v_page_offset`` pages
in), the physical buffer's shape, the ``[n, 2, block_size, nkv, D]`` view of it that cache
writers write through (:meth:`KVLayout.sides`), the same bytes as one row of 8-byte words per
block (:meth:`KVLayout.block_words`, which the pool restores and checks), the K and V page
views a kernel receives in each in-page order it offers (:meth:`KVLayout.views`), and the
untrimmed plain planes those views are cut from (:meth:`KVLayout.planes`, which the diagnosis
reads through page ids and offsets).

* ``LBHNC`` (MiniMax-M3's production cache): ``[n, 2, B, nkv*D]``; each block holds its K
  side then its V side, so one page id ``block * 2B/P + j`` addresses both sides and the V
  view starts ``B/P`` pages in (8 pages shorter than K at 128-token blocks of 16-token
  pages).
* ``LHBNC``: a K plane and a V plane ``[2, n, B, nkv*D]``, page id ``block * B/P + j``. At
  ``P == B`` its shuffled views are AITER's 5-D ``[n, nkv, D/x, B, x]`` and
  ``[n, nkv, B/x, D, x]`` caches (vLLM's ``ROCM_AITER_UNIFIED_ATTN`` shuffled layout,
  ``kv_cache.unbind(0)`` then reshaped).
* ``split``: vLLM's own cache (``TRITON_ATTN``, ``ROCM_ATTN``, ``ROCM_AITER_FA``,
  ``ROCM_AITER_UNIFIED_ATTN`` unshuffled) ``[n, nkv, B, 2*D]``, K and V split from the last
  dimension (``kv_cache.transpose(1, 2).split(D, -1)``): strided ``[n, B, nkv, D]`` views
  whose pages are the blocks (``P == B``).

In-page order: ``plain`` pages are token-major ``[P, nkv, D]``; ``shuffled`` pages are
AITER's K ``[nkv, D/x, P, x]`` and V ``[nkv, P/x, D, x]``, ``x = 16 // itemsize``.

A new layout is one subclass here (and one entry of :data:`LAYOUTS`), plus the views of the
backends that read it; the cache builders (:mod:`difftest.inputs.kv_cache`) and the case model
(:mod:`difftest.case.spec`) go through these objects only.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

IN_PAGE_ORDERS: tuple[str, ...] = ("plain", "shuffled")
PAGE_UNIT = 16  # every page and block size is a multiple of 16 tokens (vLLM's MultipleOf(16))
MAX_BLOCK_SIZE = 512


class Geometry(Protocol):
    """The numbers a layout needs of a case (a :class:`difftest.case.spec.Case` has them)."""

    num_blocks: int
    block_size: int
    page_size: int
    num_kv_heads: int
    head_dim: int


class KVLayout:
    """One physical KV cache layout. Subclasses set ``name``, ``in_page_orders`` and
    ``fused_writer`` and implement the addressing, the raw shape and the views."""

    name: str = ""
    in_page_orders: tuple[str, ...] = IN_PAGE_ORDERS
    # whether difftest.inputs._kv_cache_triton's fused writer addresses it (else the torch writer
    # runs)
    fused_writer: bool = True

    def check(self, g: Geometry) -> tuple[str, str, str] | None:
        """``(field, problem, allowed)`` if ``g`` is no geometry of this layout, else None:
        pages a multiple of 16 tokens, blocks a whole number of pages up to 512 tokens."""
        if g.page_size % PAGE_UNIT or not PAGE_UNIT <= g.page_size <= MAX_BLOCK_SIZE:
            return ("page_size", f"= {g.page_size!r} in layout {self.name}",
                    f"a multiple of {PAGE_UNIT} in {PAGE_UNIT}..{MAX_BLOCK_SIZE}")
        if g.block_size % g.page_size or not g.page_size <= g.block_size <= MAX_BLOCK_SIZE:
            return ("block_size", f"= {g.block_size!r} with page_size {g.page_size} in layout "
                    f"{self.name}", f"a multiple of page_size up to {MAX_BLOCK_SIZE}")
        return None

    def pages_per_side(self, g: Geometry) -> int:
        """Pages on one side (K or V) of a block."""
        return g.block_size // g.page_size

    def block_page_stride(self, g: Geometry) -> int:
        """Page ids one block spans."""
        return self.pages_per_side(g)

    def v_page_offset(self, g: Geometry) -> int:
        """Pages the V view starts after the K view's first page."""
        return 0

    def k_view_pages(self, g: Geometry) -> int:
        """Length of the K page view."""
        return g.num_blocks * self.block_page_stride(g)

    def v_view_pages(self, g: Geometry) -> int:
        """Length of the V page view."""
        return self.k_view_pages(g) - self.v_page_offset(g)

    def max_page_id(self, g: Geometry) -> int:
        """The highest page id of the last physical block's pages."""
        return (g.num_blocks - 1) * self.block_page_stride(g) + self.pages_per_side(g) - 1

    def raw_shape(self, g: Geometry) -> tuple[int, ...]:
        """The physical buffer's shape."""
        raise NotImplementedError

    def raw_bytes(self, g: Geometry, itemsize: int) -> int:
        """The physical buffer's size in bytes for elements of ``itemsize`` bytes."""
        return math.prod(self.raw_shape(g)) * itemsize

    def sides(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """``[n, 2, B, nkv, D]``: block, side (K, V), token, KV head, dim, over ``raw``'s bytes
        (a view: writing into it writes the cache)."""
        raise NotImplementedError

    def block_words(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """``raw``'s bytes as int64 words with the block first (``[n, ...]``, a view)."""
        raise NotImplementedError

    def side_addressing(self, g: Geometry) -> tuple[int, int]:
        """``(block stride, V offset)`` in elements, for the fused writer (a layout whose
        sides are contiguous ``[B, nkv, D]`` runs: block ``b``'s side ``s`` starts at
        ``b * stride + s * offset``)."""
        raise NotImplementedError(f"layout {self.name} has no contiguous sides")

    def views(self, raw: torch.Tensor, g: Geometry,
              in_page_order: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V page views a kernel receives (K untrimmed; V ``v_page_offset`` pages
        in): plain ``[pages, P, nkv, D]`` (:meth:`planes`, V trimmed), shuffled K
        ``[pages, nkv, D/x, P, x]`` and V ``[pages, nkv, P/x, D, x]``."""
        self.check_order(in_page_order)
        if in_page_order == "plain":
            k, v = self.planes(raw, g)
            return k, v[self.v_page_offset(g):]
        return self._shuffled_views(raw, g)

    def planes(self, raw: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain K and V planes ``[pages, P, nkv, D]`` (views of ``raw``), both untrimmed:
        page id ``p`` is page ``p`` of the K plane and page ``p + v_page_offset`` of the V
        plane (LBHNC: one plane holding both sides)."""
        raise NotImplementedError

    def check_order(self, in_page_order: str) -> None:
        """Raise ``ValueError`` unless this layout has pages in ``in_page_order``."""
        if in_page_order not in self.in_page_orders:
            raise ValueError(f"layout {self.name} has no {in_page_order!r} pages (in-page "
                             f"orders: {', '.join(self.in_page_orders)})")

    def _shuffled_views(self, raw: torch.Tensor,
                        g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"layout {self.name} has no shuffled pages")


def _plain_pages(src: torch.Tensor, g: Geometry, count: int) -> torch.Tensor:
    """``[count, P, nkv, D]``: contiguous pages of ``P`` tokens."""
    return src.view(count, g.page_size, g.num_kv_heads, g.head_dim)


def _shuffled_pages(k_src: torch.Tensor, v_src: torch.Tensor, g: Geometry, count: int,
                    v_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled page views of contiguous sides whose ``count`` pages are ``P`` tokens each."""
    nkv, d, ps = g.num_kv_heads, g.head_dim, g.page_size
    x = 16 // k_src.element_size()
    return (k_src.view(count, nkv, d // x, ps, x),
            v_src.view(count, nkv, ps // x, d, x)[v_offset:])


class Packed(KVLayout):
    """LBHNC: ``[n, 2, B, nkv*D]``, each block's K side then its V side."""

    name = "LBHNC"

    def block_page_stride(self, g: Geometry) -> int:
        """Both sides' pages: ``2 B / P``."""
        return 2 * self.pages_per_side(g)

    def v_page_offset(self, g: Geometry) -> int:
        """The K side's pages: ``B / P``."""
        return self.pages_per_side(g)

    def raw_shape(self, g: Geometry) -> tuple[int, ...]:
        """``[n, 2, B, nkv*D]``."""
        return (g.num_blocks, 2, g.block_size, g.num_kv_heads * g.head_dim)

    def sides(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """``raw`` itself, its channels split into heads."""
        return raw.unflatten(-1, (g.num_kv_heads, g.head_dim))

    def block_words(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """``[n, 2, words]``."""
        return raw.view(g.num_blocks, 2, -1).view(torch.int64)

    def side_addressing(self, g: Geometry) -> tuple[int, int]:
        """Blocks two sides apart, V one side after K."""
        side = g.block_size * g.num_kv_heads * g.head_dim
        return 2 * side, side

    def planes(self, raw: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """One plane, both sides: ``raw`` as ``2 n B / P`` pages."""
        pages = _plain_pages(raw, g, g.num_blocks * self.block_page_stride(g))
        return pages, pages

    def _shuffled_views(self, raw: torch.Tensor,
                        g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        count = g.num_blocks * self.block_page_stride(g)
        return _shuffled_pages(raw, raw, g, count, self.v_page_offset(g))


class Planes(KVLayout):
    """LHBNC: ``[2, n, B, nkv*D]``, a K plane and a V plane."""

    name = "LHBNC"

    def raw_shape(self, g: Geometry) -> tuple[int, ...]:
        """``[2, n, B, nkv*D]``."""
        return (2, g.num_blocks, g.block_size, g.num_kv_heads * g.head_dim)

    def sides(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """The planes transposed to block-major."""
        return raw.unflatten(-1, (g.num_kv_heads, g.head_dim)).transpose(0, 1)

    def block_words(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """``[n, 2, words]`` (a transposed view)."""
        return raw.view(2, g.num_blocks, -1).view(torch.int64).transpose(0, 1)

    def side_addressing(self, g: Geometry) -> tuple[int, int]:
        """Blocks one side apart, V one plane after K."""
        side = g.block_size * g.num_kv_heads * g.head_dim
        return side, g.num_blocks * side

    def planes(self, raw: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """The K plane and the V plane as pages."""
        count = g.num_blocks * self.block_page_stride(g)
        return _plain_pages(raw[0], g, count), _plain_pages(raw[1], g, count)

    def _shuffled_views(self, raw: torch.Tensor,
                        g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        count = g.num_blocks * self.block_page_stride(g)
        return _shuffled_pages(raw[0], raw[1], g, count, 0)


class Split(KVLayout):
    """vLLM's cache ``[n, nkv, B, 2*D]``: K and V of one head and token side by side."""

    name = "split"
    in_page_orders = ("plain",)
    fused_writer = False

    def check(self, g: Geometry) -> tuple[str, str, str] | None:
        """Blocks of 16..512 tokens (a multiple of 16) that are their own pages."""
        problem = super().check(g)
        if problem is None and g.page_size != g.block_size:
            return ("page_size", f"= {g.page_size} with block_size {g.block_size} in layout "
                    f"{self.name}", "page_size = block_size (vLLM's kernels page by block)")
        return problem

    def raw_shape(self, g: Geometry) -> tuple[int, ...]:
        """``[n, nkv, B, 2*D]``."""
        return (g.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim)

    def sides(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """``[n, nkv, B, 2, D]`` permuted to ``[n, 2, B, nkv, D]``."""
        return raw.unflatten(-1, (2, g.head_dim)).permute(0, 3, 2, 1, 4)

    def block_words(self, raw: torch.Tensor, g: Geometry) -> torch.Tensor:
        """``[n, words]``: a block is contiguous."""
        return raw.view(g.num_blocks, -1).view(torch.int64)

    def planes(self, raw: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided ``[n, B, nkv, D]`` views of each token's first and second ``D`` channels
        (``raw[0]`` is block 0, not K)."""
        both = raw.transpose(1, 2)  # [n, B, nkv, 2D]
        return both[..., : g.head_dim], both[..., g.head_dim:]


LAYOUTS: dict[str, KVLayout] = {layout.name: layout for layout in (Packed(), Planes(), Split())}
