"""What a disagreeing backend read: simple misreadings that explain its wrong output.

A comparison says what each row *should* have read. For a disagreement, :func:`diagnose`
takes the worst mismatching rows (at most :data:`MAX_ROWS`) and tests simple hypotheses
against the backend's output: each hypothesis rewrites what a row reads (its page ids, its
context length, where the K and V views start in the packed block, the scales, the fp8
format, the softmax scale, the query), the attention of that row is recomputed in float64
from the physical cache under the rewritten read, and the hypothesis explains the row when
the recomputed row matches the backend's row within the same tolerance as the real
comparison (:mod:`difftest.contract.tolerance`); a non-finite element matches a non-finite one.

The recomputation models a paged decode kernel of the case's page size ``P``: token ``i`` of a
row is token ``i % P`` of page ``pages[i // P]`` (a lane past the row's table reads page 0),
K of page ``p`` is page ``p + k_offset`` of the K plane and V page ``p + v_offset`` of the V
plane, as the case's layout object addresses them (:meth:`~difftest.case.layouts.KVLayout.planes`:
LBHNC one plane, ``v_offset`` the K side's pages; LHBNC and split two planes, offset 0); a
page outside the plane reads NaN; query head ``h`` reads KV head ``h // (Hq / Hkv)``; the
window is the case's (:func:`difftest.case.selection.window_start`). It reads the
plain-order cache of :meth:`RunInputs.cache` (built by :mod:`difftest.inputs.kv_cache`), canaries
included: a read of a page no row attends gives NaN, or, where the backend's row is finite and
the cache is e4m3, the value a decoder without NaN encodings gives the NaN byte (+-480 for
e4m3fn, 0 for e4m3fnuz's ``0x80``; the Triton interpreter decodes so). Hypotheses named
after a stride or an offset (``page-stride-8``, ``v-view-offset-7``) carry MiniMax-M3's
numbers (128-token blocks of 16-token pages); on other geometries they apply at that
geometry's strides, and their text gives the numbers.

A prediction explains a row only if, on every element the comparison flagged, it also
removes at least half of the error, so neither a hypothesis that barely changes the read nor
one whose recomputation has a tolerance too loose to mean anything explains a mismatch. A
hypothesis is either a *rule* a kernel would apply to every row (page-id truncation or
stride, the packed sides' offsets, scales, fp8 format, softmax scale, softcap, the window
ignored or its bound off by one, a softmax without its maximum subtracted, query heads
shifted, KV heads interleaved or addressed at the wrong stride, block ids off by one) or
*per row* (:data:`PER_ROW`: token counts, the partial last page dropped, one page or block
read from elsewhere, another request's table or query token); a rule must also leave up to
:data:`MAX_CONTROL_ROWS` agreeing rows agreeing. Ranking: explaining more diagnosed rows,
then on finite values (a non-finite row only says that some NaN canary was read), then rules
before per-row hypotheses, then fewer tokens read differently, then the order of
:data:`HYPOTHESIS_NAMES`; the first line names the hypotheses tied with it on all but that
order ("equally consistent"): the output cannot tell them apart. A NaN read makes a whole
row NaN, so where a diagnosed row is non-finite the backend runs again on
:func:`finite_canaries` (a :class:`Rerun`) and that output is diagnosed instead
(docs/mutation-benchmark.md).

Cost is bounded: each diagnosed row tries at most :data:`MAX_VARIANTS_PER_ROW` rewritten
reads (per-block rewrites on its first :data:`MAX_SEGMENTS` segments), each one or two row
recomputations (the second for e4m3's NaN decoding), plus one per rule and agreeing row. The
result is at most :data:`MAX_LINES` lines, ``explained by: <hypothesis> (<what the row
read>; explains <rows>)`` best first (``partly explained by:`` when it explains only some of
the rows), or ``no simple hypothesis explains it (...)``; :func:`diagnosis_lines` never
raises (a failure is the line ``diagnosis failed: ...``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from difftest.case.selection import window_start
from difftest.case.spec import Case
from difftest.contract.backend import EmptyRowOutput, Reference, RunInputs
from difftest.contract.tolerance import Tolerance
from difftest.inputs import serving_terms
from difftest.inputs.kv_cache import build_cache
from difftest.primitives.dtypes import FP8_DTYPES, finite_max, torch_dtype

MAX_ROWS = 4
MAX_SEGMENTS = 16
MAX_VARIANTS_PER_ROW = 64
MAX_LINES = 3
MAX_OTHER_TOKENS = 4  # a row's other query tokens the other-query-token hypotheses try
MAX_CONTROL_ROWS = 2
PREFIX = "explained by: "
NOTHING = "no simple hypothesis explains it"
FAILED = "diagnosis failed: "
ZERO_WEIGHTED = "canary-weighted-by-zero"  # rows NaN on canaries, right on finite ones
EXPLAINED_SHARE = 0.5  # of the error on each flagged element that a hypothesis must remove
E4M3_NAN_AS_FINITE = {"float8_e4m3fn": 480.0, "float8_e4m3fnuz": 0.0}


@dataclass(frozen=True)
class Read:
    """What one query row reads, as a page-16 kernel addresses it."""

    pages: tuple[int, ...]
    context_len: int
    k_offset: int
    v_offset: int
    k_scale: float
    v_scale: float
    softmax_scale: float
    softcap: float
    sliding_window: int
    kv_dtype: str
    query_row: int
    planes_swapped: bool = False
    head_shift: int = 0  # query head h reads head h + head_shift's query (mod the heads)
    kv_heads: tuple[int, ...] = ()  # the KV head each query head reads (): h // (Hq / Hkv)
    heads_page_major: bool = False  # pages read as [Hkv, P, D] though they are [P, Hkv, D]
    unshifted_softmax: bool = False  # float32 exp(s) without the row's maximum subtracted


@dataclass(frozen=True)
class Variant:
    """One hypothesis applied to one row: the rewritten read, described."""

    hypothesis: str
    text: str
    read: Read


@dataclass(frozen=True)
class Explanation:
    """A hypothesis that explains some diagnosed rows."""

    hypothesis: str
    text: str
    rows: tuple[int, ...]
    finite_rows: int
    changed_tokens: int
    priority: int
    controls: tuple[int, ...] = ()

    def line(self, diagnosed: tuple[int, ...]) -> str:
        """``explained by: <hypothesis> (<detail>)``, naming the rows it explains."""
        rows = ", ".join(map(str, self.rows))
        if len(self.rows) == len(diagnosed):
            scope = (f"row {rows}" if len(diagnosed) == 1
                     else f"all {len(diagnosed)} diagnosed rows ({rows})")
        else:
            scope = (f"row{'s' if len(self.rows) > 1 else ''} {rows} of the "
                     f"{len(diagnosed)} diagnosed")
        if self.controls:
            scope += f", and leaves agreeing row{'s' if len(self.controls) > 1 else ''} " + (
                ", ".join(map(str, self.controls)) + " agreeing")
        weak = "" if self.finite_rows else "; non-finite output: the read includes a NaN"
        lead = PREFIX if len(self.rows) == len(diagnosed) else "partly " + PREFIX
        return f"{lead}{self.hypothesis} ({self.text}; explains {scope}{weak})"


def hypothesis_of(line: str) -> str | None:
    """The hypothesis a diagnosis line names (``None`` for other lines)."""
    for lead in (PREFIX, "partly " + PREFIX):
        if line.startswith(lead):
            return line[len(lead):].split(" (", 1)[0]
    return None


class _RowModel:
    """The physical cache, the query and the tolerance: recomputes one row under a read."""

    def __init__(self, inputs: RunInputs, tolerance: Tolerance,
                 empty_row_output: EmptyRowOutput) -> None:
        self.case = case = inputs.case
        self.inputs = inputs
        self.tolerance = tolerance
        self.empty_row_output = empty_row_output
        raw = inputs.cache("plain").raw
        self.k_plane, self.v_plane = case.layout.planes(raw, case)  # [pages, P, nkv, D]
        self.query = inputs.data.query
        table, _ = inputs.sparse_table
        self.table = table.cpu()
        self.device = raw.device
        self.attended = {s.physical_block for row in inputs.rows for s in row.segments}
        self.unattended = next((b for b in range(case.num_blocks - 1, -1, -1)
                                if b not in self.attended), None)
        self._scale_planes: dict[str, torch.Tensor] = {}

    def base(self, n: int) -> Read:
        """What row ``n`` should read."""
        case = self.case
        return Read(
            pages=tuple(int(p) for p in self.table[n]), context_len=self.inputs.rows[n].context_len,
            k_offset=0, v_offset=case.layout.v_page_offset(case),
            k_scale=case.k_scale, v_scale=case.v_scale, softmax_scale=case.softmax_scale,
            softcap=case.softcap, sliding_window=case.sliding_window, kv_dtype=case.kv_dtype,
            query_row=n)

    def addresses(self, read: Read) -> tuple[torch.Tensor, torch.Tensor]:
        """Plane token addresses ``(k, v)`` of the tokens the read attends (its window's, if
        any), in attend order."""
        ps = self.case.page_size
        ordinal = torch.arange(window_start(read.context_len, read.sliding_window),
                               read.context_len)
        pages = torch.tensor((*read.pages, 0), dtype=torch.int64)
        page = pages[ordinal.div(ps, rounding_mode="floor").clamp(max=len(read.pages))]
        k = (page + read.k_offset) * ps + ordinal % ps
        v = (page + read.v_offset) * ps + ordinal % ps
        return k, v

    def _gather(self, plane: torch.Tensor, address: torch.Tensor, read: Read,
                nan_as_finite: bool) -> torch.Tensor:
        """``[L, nkv, D]`` float64: the plane's (``[pages, P, nkv, D]``) tokens at
        ``address`` (``page * P + slot``), NaN outside the plane."""
        ps = plane.shape[1]
        inside = (address >= 0) & (address < plane.shape[0] * ps)
        index = torch.where(inside, address, 0).to(self.device)
        page, slot = index.div(ps, rounding_mode="floor"), index % ps
        if read.heads_page_major:  # [t, h] read at [f // Hkv, f % Hkv] of the page, f = h P + t
            nkv = plane.shape[2]
            flat = torch.arange(nkv, device=self.device)[None, :] * ps + slot[:, None]
            stored = plane[page[:, None], flat.div(nkv, rounding_mode="floor"), flat % nkv]
        else:
            stored = plane[page, slot]
        if read.kv_dtype != self.case.kv_dtype:
            stored = stored.view(torch_dtype(read.kv_dtype))
        values = stored.to(torch.float64)
        if nan_as_finite and read.kv_dtype in E4M3_NAN_AS_FINITE:
            bits = stored.view(torch.uint8).to(torch.int16)
            finite = E4M3_NAN_AS_FINITE[read.kv_dtype]
            if read.kv_dtype == "float8_e4m3fn":
                decoded = torch.where(bits >= 128, -finite, finite).to(torch.float64)
                values = torch.where((bits & 0x7F) == 0x7F, decoded, values)
            else:
                values = torch.where(bits == 0x80, torch.zeros_like(values), values)
        return torch.where(inside.to(self.device)[:, None, None], values,
                           torch.full_like(values, float("nan")))

    def recompute(self, read: Read, nan_as_finite: bool = False) -> Reference:
        """The float64 output of one row under ``read``, with its tolerance's magnitudes."""
        case = self.case
        shape = (1, case.num_q_heads, case.head_dim)
        ctx = torch.tensor([read.context_len], device=self.device)
        if read.context_len == 0:
            fill = float("nan") if self.empty_row_output is EmptyRowOutput.UNTOUCHED else 0.0
            zero = torch.zeros(shape, dtype=torch.float64, device=self.device)
            return Reference(torch.full_like(zero, fill), zero, zero[..., 0], ctx)
        k_addr, v_addr = self.addresses(read)
        k_plane, v_plane = ((self.v_plane, self.k_plane) if read.planes_swapped
                            else (self.k_plane, self.v_plane))
        k = self._gather(k_plane, k_addr, read, nan_as_finite) * read.k_scale
        v = self._gather(v_plane, v_addr, read, nan_as_finite) * read.v_scale
        if case.kv_quant == "per_token_head":  # the scale caches, read at the same slots
            ps = case.page_size
            k = k * self._token_scales("k", k_addr - read.k_offset * ps)[:, :, None]
            v = v * self._token_scales("v", v_addr - read.v_offset * ps)[:, :, None]
        q = self.query[read.query_row].to(torch.float64)  # [H, D]
        if read.head_shift:
            q = q.roll(-read.head_shift, dims=0)
        out, abs_out = torch.empty_like(q), torch.empty_like(q)
        magnitude = q.new_empty(q.shape[0])
        for kv, heads in self._head_groups(read).items():  # k, v: [L, nkv, D]
            qh, kh, vh = q[heads], k[:, kv], v[:, kv]
            scores = qh @ kh.T * read.softmax_scale  # [heads, L]
            if read.softcap:
                scores = read.softcap * torch.tanh(scores / read.softcap)
            probs = self._weights(self._with_alibi(scores, heads), heads,
                                  read.unshifted_softmax)
            out[heads], abs_out[heads] = probs @ vh, probs @ vh.abs()
            magnitude[heads] = (((qh * qh) @ (kh * kh).T).sqrt() * read.softmax_scale
                                + read.softcap).amax(dim=-1)
        if case.output_scale:  # an fp8 output saturates as the reference's does
            limit = finite_max(case.output_dtype) * case.output_scale
            out = out.clamp(-limit, limit)
        return Reference(out[None], abs_out[None], magnitude[None], ctx)

    def _head_groups(self, read: Read) -> dict[int, list[int]]:
        """The query heads that read each KV head under ``read``."""
        case = self.case
        kv_of = read.kv_heads or tuple(h // case.queries_per_kv
                                       for h in range(case.num_q_heads))
        groups: dict[int, list[int]] = {}
        for h, kv in enumerate(kv_of):
            groups.setdefault(kv, []).append(h)
        return groups

    # ----- serving terms (sinks, ALiBi, per-token-head scales; docs/kernel-modes.md) -----
    def _with_alibi(self, scores: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """``[heads, L]`` logits with the case's ALiBi offsets (``t - (L - 1)`` for the
        ``t``-th token read), as the reference adds them."""
        slopes = serving_terms.alibi_slopes(self.case, self.device)
        if slopes is None:
            return scores
        offset = torch.arange(scores.shape[-1], device=self.device) - (scores.shape[-1] - 1)
        return scores + slopes.to(torch.float64)[heads, None] * offset

    def _weights(self, scores: torch.Tensor, heads: list[int],
                 unshifted: bool) -> torch.Tensor:
        """The weights of ``[heads, L]`` logits, each head's sink in the denominator;
        ``unshifted``: the kernel's float32 exp of the logits themselves (inf past 88.7, 0
        below -104)."""
        sinks = serving_terms.sinks(self.case, self.device)
        sink = None if sinks is None else sinks.to(torch.float64)[heads, None]
        if unshifted:
            weights = scores.float().exp().double()
            total = weights.sum(dim=-1, keepdim=True)
            if sink is not None:
                total = total + sink.float().exp().double()
            return weights / total
        if sink is None:
            return torch.softmax(scores, dim=-1)
        return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[:, :-1]

    def _token_scales(self, side: str, address: torch.Tensor) -> torch.Tensor:
        """``[L, nkv]``: the per-token scales at the scale cache's flat slots ``address``,
        relative to the case's tensor scale (a hypothesis's scale multiplies it); NaN off
        the cache."""
        if side not in self._scale_planes:
            data = self.inputs.data
            scales = data.k_token_scales if side == "k" else data.v_token_scales
            assert scales is not None, "per-token-head case data without its scales"
            pages = self.case.num_blocks * self.case.block_page_stride
            plane = serving_terms.scale_cache(self.case, scales, data.block_ids, pages)
            base = self.case.k_scale if side == "k" else self.case.v_scale
            nkv = self.case.num_kv_heads
            self._scale_planes[side] = plane.reshape(-1, nkv).to(torch.float64) / base
        plane = self._scale_planes[side]
        inside = (address >= 0) & (address < plane.shape[0])
        picked = plane.index_select(0, torch.where(inside, address, 0).to(self.device))
        return torch.where(inside.to(self.device)[:, None], picked,
                           torch.full_like(picked, float("nan")))

    def explains(self, read: Read, actual: torch.Tensor, truth: Reference) -> tuple[bool, bool]:
        """``(explains, finite)``: whether the row under ``read`` explains ``actual`` (the
        backend's row, float64) and whether that rests on finite values.

        ``truth`` is the row's real reference. The prediction explains ``actual`` when it
        matches it within the tolerance of the prediction's magnitudes and, on every element
        the comparison flagged (outside the truth's tolerance), it is non-finite where
        ``actual`` is or removes at least half of the error (:data:`EXPLAINED_SHARE`). The
        second test keeps a loose tolerance from explaining anything: a read of huge values
        (a canary or poison page, a large softcap) makes the logit term of
        :class:`Tolerance` admit almost any output, and a read that barely changes the output
        is within tolerance of the truth as well.
        """
        flagged = self._flagged(truth, actual)
        if not bool(flagged.any()):
            return False, False
        return self._predicts(read, actual, truth, flagged)

    def keeps_agreeing(self, read: Read, actual: torch.Tensor, truth: Reference) -> bool:
        """Whether the row under ``read`` predicts ``actual`` (an agreeing row's output,
        float64) within tolerance and would itself agree with ``truth``: a rule that misreads
        every row must still reproduce the rows that agree. No element is flagged on such a
        row, so :meth:`explains` (which needs an error to explain) cannot judge it, and the
        prediction's own tolerance cannot either: a read of huge values (a canary decoded as
        480) has a tolerance that admits any row."""
        for nan_as_finite in (False, True):
            if nan_as_finite and self.case.kv_dtype not in E4M3_NAN_AS_FINITE:
                break
            predicted = self.recompute(read, nan_as_finite)
            if (self._matches(predicted, actual)
                    and not bool(self._flagged(truth, predicted.output[0]).any())):
                return True
            if bool(torch.isfinite(predicted.output).all()):
                break
        return False

    def _predicts(self, read: Read, actual: torch.Tensor, truth: Reference,
                  flagged: torch.Tensor) -> tuple[bool, bool]:
        predicted = self.recompute(read)
        matched = self._explains(predicted, actual, truth, flagged)
        if (not matched and self.case.kv_dtype in E4M3_NAN_AS_FINITE
                and not bool(torch.isfinite(predicted.output).all())):
            predicted = self.recompute(read, nan_as_finite=True)
            matched = self._explains(predicted, actual, truth, flagged)
        return matched, matched and bool(torch.isfinite(predicted.output).any())

    def _flagged(self, truth: Reference, actual: torch.Tensor) -> torch.Tensor:
        """The elements the comparison judges wrong (as
        :func:`difftest.contract.compare.compare`)."""
        return ~((actual - truth.output[0]).abs() <= self.tolerance.bound(truth)[0])

    def _explains(self, predicted: Reference, actual: torch.Tensor, truth: Reference,
                  flagged: torch.Tensor) -> bool:
        if not self._matches(predicted, actual):
            return False
        expected, wrong = predicted.output[0][flagged], actual[flagged]
        error = (wrong - truth.output[0][flagged]).abs()
        closer = (wrong - expected).abs() <= EXPLAINED_SHARE * error
        return bool((closer | (~torch.isfinite(expected) & ~torch.isfinite(wrong))).all())

    def _matches(self, predicted: Reference, actual: torch.Tensor) -> bool:
        """Every element of ``actual`` within the tolerance of ``predicted``, or non-finite
        where the prediction is."""
        expected = predicted.output[0]
        bound = self.tolerance.bound(predicted)[0]
        both_finite = torch.isfinite(expected) & torch.isfinite(actual)
        close = both_finite & ((actual - expected).abs() <= bound)
        return bool((close | (~torch.isfinite(expected) & ~torch.isfinite(actual))).all())

    def changed_tokens(self, base: Read, read: Read) -> int:
        """How many of the row's token reads ``read`` changes (all, for a change of scale,
        format, softmax or query)."""
        same_math = dataclasses.replace(read, pages=base.pages, context_len=base.context_len,
                                        k_offset=base.k_offset, v_offset=base.v_offset,
                                        planes_swapped=base.planes_swapped)
        if same_math != base:
            return max(base.context_len, read.context_len)
        (bk, bv), (rk, rv) = self.addresses(base), self.addresses(read)
        common = min(len(bk), len(rk))
        differ = (bk[:common] != rk[:common]) | (bv[:common] != rv[:common])
        if read.planes_swapped != base.planes_swapped:
            differ = torch.ones(common, dtype=torch.bool)
        return int(differ.sum()) + abs(len(bk) - len(rk))


# ----- the hypotheses ----------------------------------------------------------------------
Generator = Callable[[_RowModel, int, Read], Iterator[Variant]]


def _first_changed_page(base: Read, pages: tuple[int, ...], ps: int) -> str:
    used = -(-base.context_len // ps)
    for old, new in zip(base.pages[:used], pages[:used], strict=True):
        if old != new:
            return f"page {old} read as {new}"
    return "no page changed"


def _renumbered(name: str, text: Callable[[Case], str], rewrite: Callable[[Case, int], int],
                applies: Callable[[Case], bool] = lambda c: True) -> Generator:
    def generate(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
        case = model.case
        if not applies(case):
            return
        pages = tuple(rewrite(case, p) for p in base.pages)
        used = -(-base.context_len // case.page_size)
        if pages[:used] != base.pages[:used]:
            detail = _first_changed_page(base, pages, case.page_size)
            yield Variant(name, f"{text(case)}: row {n} {detail}",
                          dataclasses.replace(base, pages=pages))
    return generate


def _segment_pages(model: _RowModel, base: Read, blocks: dict[int, int]) -> tuple[int, ...]:
    """``base``'s pages with each segment ``s`` of ``blocks`` (its lane of 8 pages) read from
    physical block ``blocks[s]``."""
    case = model.case
    pages = list(base.pages)
    for s, block in blocks.items():
        start = s * case.pages_per_side
        pages[start: start + case.pages_per_side] = [
            block * case.block_page_stride + j for j in range(case.pages_per_side)]
    return tuple(pages)


def _neighbour_blocks(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    for s, seg in enumerate(model.inputs.rows[n].segments[:MAX_SEGMENTS]):
        for other, why in ((seg.physical_block + 1, "the next block"),
                           (seg.physical_block - 1, "the previous block")):
            if 0 <= other < case.num_blocks:
                pages = _segment_pages(model, base, {s: other})
                yield Variant("neighbouring-block",
                              f"row {n} read physical block {other} instead of "
                              f"{seg.physical_block} ({why})",
                              dataclasses.replace(base, pages=pages))


def _block_zero(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    for s, seg in enumerate(model.inputs.rows[n].segments[:MAX_SEGMENTS]):
        if seg.physical_block != 0:
            yield Variant("block-0", f"row {n} read physical block 0 instead of "
                          f"{seg.physical_block}",
                          dataclasses.replace(base, pages=_segment_pages(model, base, {s: 0})))


def _blocks_shifted(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    segments = model.inputs.rows[n].segments
    for delta in (1, -1):
        blocks = [s.physical_block + delta for s in segments]
        if not segments or not all(0 <= b < case.num_blocks for b in blocks):
            continue
        pages = _segment_pages(model, base, dict(enumerate(blocks)))
        yield Variant(f"block-ids-{'plus' if delta > 0 else 'minus'}-1",
                      f"every physical block id off by {delta:+d}: row {n} read blocks "
                      f"{blocks[0]}.. instead of {segments[0].physical_block}..",
                      dataclasses.replace(base, pages=pages))


def _unattended_page(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    used = -(-base.context_len // case.page_size)
    table = case.block_tables[model.inputs.rows[n].request]
    stale = [b for b in table if b not in model.attended][-2:]  # ids its indexer left out
    blocks = dict.fromkeys([*reversed(stale), model.unattended])
    choices = [("page-from-unattended-block", b, "a page no row attends (block {b}'s page 0, "
                "a canary)") for b in blocks if b is not None]
    choices.append(("page-from-null-block", 0, "block 0's page 0 (the null block)"))
    for name, block, what in choices:
        if used == 0:
            continue
        for slot in sorted({0, used - 1}):
            pages = list(base.pages)
            if pages[slot] == block * case.block_page_stride:
                continue
            pages[slot] = block * case.block_page_stride
            yield Variant(name, f"row {n} read its page {slot} (id {base.pages[slot]}) from "
                          + what.format(b=block), dataclasses.replace(base, pages=tuple(pages)))


def _packed_sides(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    side = case.pages_per_side
    if _packed(case):
        options = [("k-read-from-v-side", "K read from the V side of each packed block",
                    {"k_offset": side}),
                   ("v-read-from-k-side", "V read from the K side of each packed block",
                    {"v_offset": 0}),
                   ("kv-sides-swapped", "K and V sides of each packed block swapped",
                    {"k_offset": side, "v_offset": 0})]
        options += [(name, f"the packed V view starts {o} pages into each block instead of "
                     f"{side}", {"v_offset": o})
                    for name, o in (("v-view-offset-7", side - 1), ("v-view-offset-9", side + 1))]
    else:
        options = [("kv-sides-swapped", "K and V planes swapped", {"planes_swapped": True})]
    for name, text, change in options:
        yield Variant(name, f"{text} (row {n})", dataclasses.replace(base, **change))


def _other_request_table(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    row = model.inputs.rows[n]
    for other, table in enumerate(case.block_tables):
        if other == row.request or not row.segments:
            continue
        if any(s.block >= len(table) for s in row.segments):
            continue
        pages = _segment_pages(model, base, {s: table[seg.block]
                                             for s, seg in enumerate(row.segments)})
        yield Variant("other-request-table", f"row {n} (request {row.request}) read its "
                      f"blocks through request {other}'s block table",
                      dataclasses.replace(base, pages=pages))


def _other_query_token(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    rows = case.request_rows(case.request_of_row(n))
    # the request's last and first tokens, then the nearest ones (a prefill-like request
    # has up to 128: they must not use up the row's variants)
    others = sorted((m for m in rows if m != n),
                    key=lambda m: (m != rows[-1], m != rows[0], abs(m - n)))
    for m in others[:MAX_OTHER_TOKENS]:
        other = model.base(m)
        yield Variant("other-query-token-selection", f"row {n} read what row {m} (query token "
                      f"{case.query_token(m)} of its request) selects",
                      dataclasses.replace(base, pages=other.pages,
                                          context_len=other.context_len))
        yield Variant("other-query-token-query", f"row {n} computed with row {m}'s query",
                      dataclasses.replace(base, query_row=m))


def _scales(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    if not case.is_fp8:
        return
    k, v = case.k_scale, case.v_scale
    options = [("kv-scales-swapped", "K and V scales swapped", v, k),
               ("kv-scales-missing", "K and V read without their scales", 1.0, 1.0),
               ("k-scale-missing", "K read without its scale", 1.0, v),
               ("v-scale-missing", "V read without its scale", k, 1.0),
               ("kv-scales-applied-twice", "K and V scales applied twice", k * k, v * v)]
    for name, text, ks, vs in options:
        if (ks, vs) != (k, v):
            yield Variant(name, f"{text} (k_scale {ks:g}, v_scale {vs:g} instead of {k:g}, "
                          f"{v:g})", dataclasses.replace(base, k_scale=ks, v_scale=vs))


def _fp8_format(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    for other in FP8_DTYPES:
        if case.is_fp8 and other != case.kv_dtype:
            yield Variant(f"fp8-read-as-{other}", f"{case.kv_dtype} cache bytes decoded as "
                          f"{other}", dataclasses.replace(base, kv_dtype=other))


def _token_counts(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    length = base.context_len
    yield Variant("context-plus-1", f"row {n} read {length + 1} tokens instead of {length} "
                  "(context length one too long)",
                  dataclasses.replace(base, context_len=length + 1))
    if length >= 1:
        yield Variant("context-minus-1", f"row {n} read {length - 1} tokens instead of {length} "
                      "(the last token dropped)",
                      dataclasses.replace(base, context_len=length - 1))
    partial = length % model.case.page_size
    if partial:
        yield Variant("last-partial-page-dropped", f"row {n} read {length - partial} tokens "
                      f"instead of {length} (the partial last page of {partial} tokens dropped: "
                      "whole pages only)", dataclasses.replace(base, context_len=length - partial))
    segments = model.inputs.rows[n].segments
    if len(segments) >= 1:
        last = segments[-1]
        yield Variant("last-block-dropped", f"row {n} read {length - last.tokens} tokens "
                      f"instead of {length} (its last selected block, {last.tokens} tokens of "
                      f"physical block {last.physical_block}, dropped)",
                      dataclasses.replace(base, context_len=length - last.tokens))


def _softmax(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    scale = case.softmax_scale
    default = case.head_dim ** -0.5
    options = [("softmax-scale-missing", "softmax scale 1 (missing)", 1.0),
               ("softmax-scale-applied-twice", "softmax scale applied twice", scale * scale),
               ("softmax-scale-default", f"the default softmax scale 1/sqrt({case.head_dim})",
                default)]
    for name, text, value in options:
        if value != scale:
            yield Variant(name, f"{text}: {value:.6g} instead of {scale:.6g}",
                          dataclasses.replace(base, softmax_scale=value))
    if case.softcap:
        yield Variant("softcap-ignored", f"the logit softcap {case.softcap:g} not applied",
                      dataclasses.replace(base, softcap=0.0))
    window = case.sliding_window
    if window:
        yield Variant("sliding-window-ignored", f"the sliding window {window} not applied",
                      dataclasses.replace(base, sliding_window=0))
        for name, other in (("sliding-window-plus-1", window + 1),
                            ("sliding-window-minus-1", window - 1)):
            if other:
                yield Variant(name, f"the last {other} tokens attended instead of the "
                              f"window's {window} (its bound off by one)",
                              dataclasses.replace(base, sliding_window=other))
    yield Variant("softmax-unshifted", "exp of the logits without the row's maximum "
                  "subtracted (float32: infinite past 88.7, zero below -103)",
                  dataclasses.replace(base, unshifted_softmax=True))


def _heads(model: _RowModel, n: int, base: Read) -> Iterator[Variant]:
    case = model.case
    heads, nkv, group = case.num_q_heads, case.num_kv_heads, case.queries_per_kv
    for name, shift, other in (("query-heads-shifted", 1, "h+1"),
                               ("query-heads-shifted-back", -1, "h-1")):
        if heads > 1:  # head h computed as head h + shift: its query and its KV head
            kv_heads = tuple((h + shift) % heads // group for h in range(heads))
            yield Variant(name, f"query head h computed as head {other} (its query and KV "
                          "head)", dataclasses.replace(
                              base, head_shift=shift, kv_heads=kv_heads if nkv > 1 else ()))
    if nkv > 1 and group > 1:
        yield Variant("kv-heads-interleaved", f"query head h read KV head h % {nkv} instead of "
                      f"h // {group} (GQA groups interleaved)", dataclasses.replace(
                          base, kv_heads=tuple(h % nkv for h in range(case.num_q_heads))))
    if nkv > 1:
        yield Variant("kv-heads-page-major", f"pages read as [{nkv} KV heads, "
                      f"{case.page_size} tokens, D] though they are [tokens, KV heads, D] "
                      "(the KV head stride of an HND cache)",
                      dataclasses.replace(base, heads_page_major=True))


def _packed(case: Case) -> bool:
    """Whether the case's layout holds K and V sides in one plane of page ids (LBHNC)."""
    return case.layout.v_page_offset(case) > 0


def _one_side_stride(case: Case, p: int) -> int:
    """Page id ``p`` at the block stride of one side (packed: ``block * P_side + j``)."""
    return p // case.block_page_stride * case.pages_per_side + p % case.block_page_stride


def _two_side_stride(case: Case, p: int) -> int:
    """Page id ``p`` at the block stride of two sides (``block * 2 P_side + j``)."""
    return p // case.pages_per_side * 2 * case.pages_per_side + p % case.pages_per_side


HYPOTHESES: tuple[Generator, ...] = (
    _renumbered("page-stride-8", lambda c: f"page ids at block stride {c.pages_per_side} "
                f"instead of {c.block_page_stride} (block*{c.pages_per_side}+j)",
                _one_side_stride, _packed),
    _renumbered("page-stride-16", lambda c: f"page ids at block stride "
                f"{2 * c.pages_per_side} instead of {c.pages_per_side} "
                f"(block*{2 * c.pages_per_side}+j)", _two_side_stride,
                lambda c: not _packed(c)),
    _renumbered("page-id-mod-2**16", lambda c: "page ids truncated to 16 bits",
                lambda c, p: p & 0xFFFF),
    _renumbered("page-id-mod-2**15", lambda c: "page ids truncated to 15 bits",
                lambda c, p: p & 0x7FFF),
    _token_counts,
    _packed_sides,
    _scales,
    _fp8_format,
    _softmax,
    _heads,
    _other_query_token,
    _unattended_page,
    _neighbour_blocks,
    _block_zero,
    _blocks_shifted,
    _other_request_table,
)
# Hypotheses about one row's reads; every other one is a rule a kernel applies to all rows.
PER_ROW: frozenset[str] = frozenset({
    "context-plus-1", "context-minus-1", "last-block-dropped", "last-partial-page-dropped",
    "page-from-unattended-block",
    "page-from-null-block", "neighbouring-block", "block-0", "other-request-table",
    "other-query-token-selection", "other-query-token-query"})
# Every hypothesis, in tie-break order (rules of page ids first).
HYPOTHESIS_NAMES: tuple[str, ...] = (
    "page-stride-8", "page-stride-16", "page-id-mod-2**16", "page-id-mod-2**15",
    "context-plus-1", "context-minus-1", "last-block-dropped", "last-partial-page-dropped",
    "k-read-from-v-side", "v-read-from-k-side", "kv-sides-swapped", "v-view-offset-7",
    "v-view-offset-9", "kv-scales-swapped", "kv-scales-missing", "k-scale-missing",
    "v-scale-missing", "kv-scales-applied-twice", *(f"fp8-read-as-{d}" for d in FP8_DTYPES),
    "softmax-scale-missing", "softmax-scale-applied-twice", "softmax-scale-default",
    "softcap-ignored", "sliding-window-ignored", "sliding-window-plus-1",
    "sliding-window-minus-1", "softmax-unshifted", "query-heads-shifted",
    "query-heads-shifted-back", "kv-heads-interleaved", "kv-heads-page-major",
    "page-from-unattended-block",
    "page-from-null-block", "neighbouring-block", "block-0", "block-ids-plus-1",
    "block-ids-minus-1", "other-request-table", "other-query-token-selection",
    "other-query-token-query", ZERO_WEIGHTED,
)


def _variants(model: _RowModel, n: int) -> Iterator[Variant]:
    """Row ``n``'s rewritten reads, at most :data:`MAX_VARIANTS_PER_ROW` distinct ones. A
    read two hypotheses make (a dropped one-token block is one token fewer) comes once per
    hypothesis: each gets the credit (the caller recomputes it once)."""
    base = model.base(n)
    reads = {base}
    named: set[tuple[str, Read]] = set()
    for generate in HYPOTHESES:
        for variant in generate(model, n, base):
            if variant.read == base or (variant.hypothesis, variant.read) in named:
                continue
            if variant.read not in reads:
                if len(reads) > MAX_VARIANTS_PER_ROW:
                    return
                reads.add(variant.read)
            named.add((variant.hypothesis, variant.read))
            yield variant


def _rule_read(model: _RowModel, n: int, hypothesis: str) -> Read | None:
    """What rule ``hypothesis`` makes row ``n`` read, ``None`` where it changes nothing."""
    base = model.base(n)
    for generate in HYPOTHESES:
        for variant in generate(model, n, base):
            if variant.hypothesis == hypothesis and variant.read != base:
                return variant.read
    return None


def _row_reference(truth: Reference, n: int, device: torch.device) -> Reference:
    return Reference(*(t[n: n + 1].to(device) for t in (
        truth.output, truth.abs_output, truth.logit_magnitude, truth.context_lens)))


def _agreeing_rows(actual: torch.Tensor, truth: Reference, tolerance: Tolerance) -> list[int]:
    """Attended rows whose every element is within tolerance (at most MAX_CONTROL_ROWS)."""
    got = actual.detach().to(device=truth.output.device, dtype=torch.float64)
    within = ((got - truth.output).abs() <= tolerance.bound(truth)).flatten(1).all(dim=1)
    ok = within & (truth.context_lens.to(within.device) > 0)
    return [int(n) for n in ok.nonzero().flatten()[:MAX_CONTROL_ROWS]]


def _explanations(model: _RowModel, actual: torch.Tensor, truth: Reference,
                  rows: tuple[int, ...]) -> tuple[list[Explanation], int]:
    """The hypotheses that explain some of ``rows`` (rules checked on agreeing rows), ranked
    best first, and how many rewritten reads were recomputed."""
    found: dict[str, Explanation] = {}
    tried = 0
    for n in rows:
        got = actual[n].detach().to(device=model.device, dtype=torch.float64)
        correct = _row_reference(truth, n, model.device)
        base = model.base(n)
        judged: dict[Read, tuple[bool, bool]] = {}
        for variant in _variants(model, n):
            if variant.read not in judged:
                tried += 1
                judged[variant.read] = model.explains(variant.read, got, correct)
            matched, finite = judged[variant.read]
            if not matched:
                continue
            changed = model.changed_tokens(base, variant.read)
            old = found.get(variant.hypothesis)
            if old is None:
                found[variant.hypothesis] = Explanation(
                    variant.hypothesis, variant.text, (n,), int(finite), changed,
                    HYPOTHESIS_NAMES.index(variant.hypothesis))
            elif n not in old.rows:
                found[variant.hypothesis] = dataclasses.replace(
                    old, rows=(*old.rows, n), finite_rows=old.finite_rows + int(finite),
                    changed_tokens=old.changed_tokens + changed)
    controls = _agreeing_rows(actual, truth, model.tolerance)
    for name, explanation in list(found.items()):
        if name in PER_ROW:
            continue
        for c in controls:
            read = _rule_read(model, c, name)
            got = actual[c].detach().to(device=model.device, dtype=torch.float64)
            if read is not None and not model.keeps_agreeing(
                    read, got, _row_reference(truth, c, model.device)):
                del found[name]
                break
        else:
            found[name] = dataclasses.replace(explanation, controls=tuple(controls))
    return sorted(found.values(), key=lambda e: (*_evidence(e), e.priority)), tried


def _evidence(e: Explanation) -> tuple[int, int, bool, int]:
    return -len(e.rows), -min(e.finite_rows, 1), e.hypothesis in PER_ROW, e.changed_tokens


def _lines(ranked: list[Explanation], rows: tuple[int, ...]) -> list[str]:
    lines = [e.line(rows) for e in ranked[:MAX_LINES]]
    tied = [e.hypothesis for e in ranked[1:] if _evidence(e) == _evidence(ranked[0])]
    if tied:
        lines[0] = lines[0][:-1] + f"; equally consistent: {', '.join(tied)})"
    return lines


@dataclass(frozen=True)
class Rerun:
    """How to run the disagreeing backend again, on inputs of the same case whose caches
    hold other bytes (:func:`finite_canaries`)."""

    run: Callable[[RunInputs], object]
    in_page_orders: tuple[str, ...]


def finite_canaries(inputs: RunInputs, in_page_orders: tuple[str, ...]) -> RunInputs:
    """``inputs`` with fresh caches in ``in_page_orders`` (and ``plain``, which the
    recomputation reads) whose every NaN, canary or guard, is replaced by a finite value:
    one value per 16-token page, differing between pages (both in-page orders hold a page's
    elements in the same span of the buffer, so they agree on it). A kernel's read of a
    wrong page then gives a number that says which page it was."""
    case = inputs.case
    caches = {}
    for order in dict.fromkeys(("plain", *in_page_orders)):
        views = build_cache(case, inputs.data, inputs.rows, order)
        pages = views.raw.view(-1, case.page_size * case.num_kv_heads * case.head_dim)
        index = torch.arange(pages.shape[0], device=pages.device)
        code = index * 40503 % 65536 // 512  # 128 codes, neighbouring pages far apart
        value = (1 + code % 8 / 8) * 2.0 ** (code // 8 % 4 - 2)  # 0.25 .. 3.75
        value = torch.where(code >= 64, -value, value).to(pages.dtype)[:, None]
        pages.copy_(torch.where(pages.isnan(), value.expand_as(pages), pages))
        caches[order] = views
    probe = copy.copy(inputs)  # shares the data, rows and tables already built
    probe._caches, probe.pool, probe.calls = caches, None, []
    return probe


def _rerun_lines(inputs: RunInputs, rerun: Rerun, truth: Reference, rows: tuple[int, ...],
                 tolerance: Tolerance, empty_row_output: EmptyRowOutput) -> list[str] | None:
    """The diagnosis of the backend run again on :func:`finite_canaries` inputs, ``None``
    where that says nothing (no output, or no hypothesis explains it)."""
    probe = finite_canaries(inputs, rerun.in_page_orders)
    again = rerun.run(probe)
    if not isinstance(again, torch.Tensor) or again.shape != truth.output.shape:
        return None
    model = _RowModel(probe, tolerance, empty_row_output)
    still = [n for n in rows if bool(model._flagged(
        _row_reference(truth, n, model.device),
        again[n].detach().to(device=model.device, dtype=torch.float64)).any())]
    if not still:
        listed = ", ".join(map(str, rows))
        rows_agree = f"rows {listed} agree" if len(rows) > 1 else f"row {listed} agrees"
        return [f"{PREFIX}{ZERO_WEIGHTED} ({rows_agree} when the pages and slots no row attends "
                "hold finite values instead of NaN: the kernel loads what the row does not "
                "attend and gives it zero weight)"]
    ranked, _ = _explanations(model, again, truth, rows)
    if not ranked:
        return None
    return [line[:-1] + "; on a rerun with finite canaries)" for line in _lines(ranked, rows)]


def diagnose(inputs: RunInputs, actual: torch.Tensor, truth: Reference, rows: tuple[int, ...],
             tolerance: Tolerance, empty_row_output: EmptyRowOutput,
             rerun: Rerun | None = None) -> list[str]:
    """Lines naming the hypotheses that explain the backend's ``actual`` output on ``rows``
    (the worst disagreeing rows; at most :data:`MAX_ROWS` are used), best first; ``truth`` is
    the reference the comparison used.

    A rule (a hypothesis not in :data:`PER_ROW`: a kernel would misread every row so) must
    also leave up to :data:`MAX_CONTROL_ROWS` agreeing rows agreeing, else it is dropped;
    rules rank before per-row hypotheses of equal evidence. Where a diagnosed row is
    non-finite (a NaN read makes every element NaN, so every hypothesis that reads some NaN
    predicts it alike) and ``rerun`` is given, the backend runs again on
    :func:`finite_canaries` inputs and that output is diagnosed instead, if anything explains
    it.
    """
    rows = tuple(dict.fromkeys(rows))[:MAX_ROWS]
    if not rows:
        return [f"{NOTHING}: no attended row disagrees (only rows of context length 0)"]
    if rerun is not None and not bool(torch.isfinite(actual[list(rows)]).all()):
        try:
            again = _rerun_lines(inputs, rerun, truth, rows, tolerance, empty_row_output)
        except Exception:  # the rerun is extra evidence; its failure leaves the first run's
            again = None
        if again:
            return again
    ranked, tried = _explanations(_RowModel(inputs, tolerance, empty_row_output), actual,
                                  truth, rows)
    if not ranked:
        return [f"{NOTHING} ({tried} rewritten reads of rows "
                f"{', '.join(map(str, rows))} tried)"]
    return _lines(ranked, rows)


def diagnosis_lines(inputs: RunInputs, actual: torch.Tensor, truth: Reference,
                    rows: tuple[int, ...], tolerance: Tolerance,
                    empty_row_output: EmptyRowOutput,
                    rerun: Rerun | None = None) -> tuple[str, ...]:
    """:func:`diagnose`, with any exception turned into the line ``diagnosis failed: ...``."""
    try:
        return tuple(diagnose(inputs, actual, truth, rows, tolerance, empty_row_output, rerun))
    except Exception as exc:  # a diagnosis never turns a result into an error
        return (f"{FAILED}{type(exc).__name__}: {exc}",)
