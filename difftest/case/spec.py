"""One MiniMax-M3 sparse decode case: a small, frozen, JSON-serialisable description.

A case holds only numbers and names. Every tensor is generated from it (see
:mod:`difftest.inputs.case_data`), so the same case is bit-identical on every machine.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from difftest.case.layouts import LAYOUTS, KVLayout
from difftest.primitives.dtypes import FP8_DTYPES, KV_DTYPES, QUERY_DTYPES

CASE_SCHEMA = "difftest.case/1"
# its JSON Schema (package data): the fields and their ranges that need no other field
CASE_JSON_SCHEMA = Path(__file__).with_name("case.schema.json")
BLOCK_SIZE = 128
PAGE_SIZE = 16
HEAD_DIM = 128
KV_LAYOUTS: tuple[str, ...] = ("LBHNC", "LHBNC")  # MiniMax-M3's (the sparse family's)
ALL_LAYOUTS: tuple[str, ...] = tuple(LAYOUTS)  # difftest.case.layouts: vLLM's split cache too
HEAD_DIMS: tuple[int, ...] = (64, 80, 96, 128, 256)
MAX_KV_HEADS = 8
DISTRIBUTIONS: tuple[str, ...] = ("normal", "uniform", "outliers")
MAX_NUM_BLOCKS = 1 << 20
MAX_BATCH = 4096
MAX_SEQ_LEN = 1 << 20
MAX_TOPK = 64
MAX_Q_HEADS = 64
MAX_DECODE_QUERY_LEN = 4
MAX_QUERY_LEN = 128  # a prefill-like request's query tokens (``query_lens``)
SPLIT_K_SEGMENTS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # vLLM: 16 (64 on SM120)
MAX_SEQ_THRESHOLD_3D = 1 << 20
SCALE_RANGE = (1e-6, 1e6)
SOFTCAP_RANGE = (1e-3, 1e4)
# Kernel-mode fields and their "off" values. A field at its default is left out of the
# content (and so of the case id and the JSON), so cases written before the field existed
# keep their ids and load unchanged. ``Case.mode_off(field)`` is the case with one mode off
# (``query_lens`` off also drops the rows it added).
MODE_DEFAULTS: dict[str, Any] = {"softcap": 0.0, "sliding_window": 0, "canary": False,
                                 "q_scale": 0.0, "query_lens": (), "split_k_segments": 0,
                                 "seq_threshold_3d": 0, "dense": False}
# the modes a backend must run to run the case (canaries change only the data)
KERNEL_MODE_FIELDS: tuple[str, ...] = ("softcap", "sliding_window", "q_scale", "query_lens",
                                       "split_k_segments", "dense")


# MiniMax-M3's cache geometry: the sparse family's, and all the M3 sparse decodes run
MODEL_GEOMETRY: dict[str, Any] = {"head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                                  "page_size": PAGE_SIZE, "num_kv_heads": 1}


class CaseError(ValueError):
    """A case field is outside its allowed range; the message names both."""

    def __init__(self, field_name: str, problem: str, allowed: str) -> None:
        self.field = field_name
        self.problem = problem
        self.allowed = allowed
        super().__init__(f"{field_name}: {problem} (allowed: {allowed})")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


@dataclass(frozen=True)
class Case:
    """A decode step: requests, their block tables, top-k selections, dtypes and a data seed.

    ``selections`` has one row per query token (``batch * decode_query_len`` rows, request-major,
    as the indexer emits them) of ``topk`` logical 128-token block ids, ``-1`` for padding.
    ``seq_lens`` include the request's ``decode_query_len`` query tokens; ``0`` is a padded
    request. ``block_tables[r][l]`` is the physical block holding logical block ``l`` of
    request ``r``.

    Kernel modes (off by default): ``softcap`` caps each scaled logit ``s`` to
    ``softcap * tanh(s / softcap)``; ``sliding_window = W`` lets a row attend only the last
    ``W`` tokens of its attended sequence (its own token included; over the compacted sparse
    context, which is the absolute positions when a row selects all its blocks in order).
    ``canary`` fills every KV slot of an attended block that no row reads (outside every
    row's window, past the written tokens) with NaN instead of data or finite poison.
    ``q_scale > 0`` stores the query in the KV's fp8 dtype as ``fp8(real / q_scale)``
    (saturated), so the real query is ``stored * q_scale`` (vLLM's per-tensor q descale);
    the output stays in ``query_dtype``. ``query_lens`` (one per request, 1..128, with
    ``decode_query_len`` 1) gives each request its own number of query tokens, request-major
    rows, the last ``query_lens[r]`` positions of the request: prefill-like rows mixed with
    decode rows. ``split_k_segments = S`` hands ``unified_attention`` split-K scratch of ``S``
    segments and ``seq_threshold_3d``, so vLLM chooses its 3-D kernel or the 2-D one by shape.
    ``dense`` declares every row to select exactly its causal blocks ``0..own`` in order (then
    ``-1``), so a kernel runs each request as one sequence over its block table (paged
    attention, not a sparse table); with ``dense`` off the same selections are a sparse case
    that happens to select everything.

    Geometry (docs/geometry.md): ``block_size`` tokens per cache block and ``page_size``
    tokens per kernel page, as ``kv_layout`` (:mod:`difftest.case.layouts`) allows them;
    ``head_dim`` one of :data:`HEAD_DIMS`; ``num_kv_heads`` 1..8 with ``num_q_heads`` a
    multiple of it (GQA: query head ``h`` reads KV head ``h // (num_q_heads / num_kv_heads)``).
    """

    num_blocks: int
    seq_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    selections: tuple[tuple[int, ...], ...]
    decode_query_len: int = 1
    num_q_heads: int = 16
    num_kv_heads: int = 1
    head_dim: int = HEAD_DIM
    page_size: int = PAGE_SIZE
    block_size: int = BLOCK_SIZE
    query_dtype: str = "float16"
    kv_dtype: str = "float16"
    k_scale: float = 1.0
    v_scale: float = 1.0
    softmax_scale: float = HEAD_DIM**-0.5
    kv_layout: str = "LBHNC"
    distribution: str = "normal"
    seed: int = 0
    softcap: float = 0.0
    sliding_window: int = 0
    canary: bool = False
    q_scale: float = 0.0
    query_lens: tuple[int, ...] = ()
    split_k_segments: int = 0
    seq_threshold_3d: int = 0
    dense: bool = False
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(int(s) for s in self.seq_lens))
        object.__setattr__(
            self, "block_tables", tuple(tuple(int(b) for b in row) for row in self.block_tables)
        )
        object.__setattr__(
            self, "selections", tuple(tuple(int(b) for b in row) for row in self.selections)
        )
        object.__setattr__(self, "query_lens", tuple(int(n) for n in self.query_lens))
        for name in ("k_scale", "v_scale", "softmax_scale", "softcap", "q_scale"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.sliding_window is None:
            object.__setattr__(self, "sliding_window", 0)
        validate(self)

    # ----- derived geometry -------------------------------------------------------------
    @property
    def batch(self) -> int:
        """Number of requests."""
        return len(self.seq_lens)

    @property
    def total_q(self) -> int:
        """Number of query rows (``batch * decode_query_len``, or ``sum(query_lens)``)."""
        return sum(self.query_lens) if self.query_lens else self.batch * self.decode_query_len

    def query_len(self, request: int) -> int:
        """Query tokens (rows) of a request."""
        return self.query_lens[request] if self.query_lens else self.decode_query_len

    @cached_property
    def _row_starts(self) -> tuple[int, ...]:
        starts, at = [], 0
        for r in range(self.batch):
            starts.append(at)
            at += self.query_len(r)
        return tuple(starts)

    def request_rows(self, request: int) -> range:
        """The query rows of a request (request-major)."""
        start = self._row_starts[request]
        return range(start, start + self.query_len(request))

    @property
    def topk(self) -> int:
        """Lanes per query row."""
        return len(self.selections[0])

    @property
    def is_fp8(self) -> bool:
        """Whether the KV cache is stored in fp8."""
        return self.kv_dtype in FP8_DTYPES

    @property
    def layout(self) -> KVLayout:
        """The cache layout object of ``kv_layout`` (:mod:`difftest.case.layouts`)."""
        return LAYOUTS[self.kv_layout]

    @property
    def pages_per_side(self) -> int:
        """Pages on one side (K or V) of a block (8: 128-token blocks of 16-token pages)."""
        return self.layout.pages_per_side(self)

    @property
    def block_page_stride(self) -> int:
        """Page ids one block spans (16 when K and V sides are packed, LBHNC; else 8)."""
        return self.layout.block_page_stride(self)

    @property
    def k_view_pages(self) -> int:
        """Length of the K page view (untrimmed)."""
        return self.layout.k_view_pages(self)

    @property
    def v_view_pages(self) -> int:
        """Length of the V page view (half a block shorter than K when packed)."""
        return self.layout.v_view_pages(self)

    @property
    def max_page_id(self) -> int:
        """The highest page id a valid selection of the last physical block can produce."""
        return self.layout.max_page_id(self)

    @property
    def queries_per_kv(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_logical_block(self) -> int:
        """The highest logical block a selection may name (``MAX_SEQ_LEN`` tokens)."""
        return MAX_SEQ_LEN // self.block_size - 1

    @property
    def kernel_modes(self) -> tuple[str, ...]:
        """The kernel modes this case switches on (of :data:`KERNEL_MODE_FIELDS`: softcap,
        sliding window, fp8 queries, query lengths, split-K): a backend that cannot run one
        must declare the case unsupported."""
        return tuple(m for m in KERNEL_MODE_FIELDS if getattr(self, m) != MODE_DEFAULTS[m])

    def mode_off(self, mode: str) -> Case:
        """This case with one kernel-mode field at its default. ``query_lens`` off keeps each
        request's last query row (its decode token), so the selections stay row for row;
        ``split_k_segments`` off also clears ``seq_threshold_3d``."""
        if mode not in MODE_DEFAULTS:
            raise CaseError("mode", f"= {mode!r}", ", ".join(MODE_DEFAULTS))
        if mode == "query_lens" and self.query_lens:
            rows = tuple(self.selections[self.request_rows(r)[-1]] for r in range(self.batch))
            return self.replace(query_lens=(), decode_query_len=1, selections=rows)
        if mode == "split_k_segments":
            return self.replace(split_k_segments=0, seq_threshold_3d=0)
        return self.replace(**{mode: MODE_DEFAULTS[mode]})

    def outside_model_geometry(self) -> str | None:
        """``None`` at MiniMax-M3's geometry (:data:`MODEL_GEOMETRY`, an LBHNC or LHBNC
        cache), else the fields that differ, e.g. ``"head_dim 96, kv_layout split"``: a
        backend that runs the model's geometry only says so with this."""
        differ = [f"{name} {getattr(self, name)}" for name, value in MODEL_GEOMETRY.items()
                  if getattr(self, name) != value]
        if self.kv_layout not in KV_LAYOUTS:
            differ.append(f"kv_layout {self.kv_layout}")
        return ", ".join(differ) or None

    @cached_property
    def case_id(self) -> str:
        """Stable content id: a hash of every field but ``name``."""
        payload = json.dumps(self._content(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def request_of_row(self, row: int) -> int:
        """The request a query row belongs to."""
        if not self.query_lens:
            return row // self.decode_query_len
        return bisect.bisect_right(self._row_starts, row) - 1

    def query_token(self, row: int) -> int:
        """Which of its request's query tokens a row is (0 = the earliest)."""
        return row - self._row_starts[self.request_of_row(row)]

    def abs_pos(self, row: int) -> int:
        """Absolute position of a query row's token (negative for padded requests)."""
        req = self.request_of_row(row)
        return self.seq_lens[req] - self.query_len(req) + self.query_token(row)

    # ----- serialisation ----------------------------------------------------------------
    def _content(self) -> dict[str, Any]:
        """Every field but ``name`` in field order, modes at their off value left out, tuples
        as (fresh) lists. Built field by field: ``dataclasses.asdict`` deep-copied every
        table entry (8192 at production shape, 3-20 ms per call)."""
        data: dict[str, Any] = {}
        for name in _CONTENT_FIELDS:
            value = getattr(self, name)
            if name in MODE_DEFAULTS and value == MODE_DEFAULTS[name]:
                continue
            if name in ("block_tables", "selections"):
                value = [list(row) for row in value]
            elif isinstance(value, tuple):
                value = list(value)
            data[name] = value
        return data

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with schema tag and id."""
        return {"schema": CASE_SCHEMA, "id": self.case_id, "name": self.name, **self._content()}

    def to_json(self) -> str:
        """JSON text of :meth:`to_dict`, one field per line."""
        items = sorted(self.to_dict().items())
        body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in items)
        return "{\n" + body + "\n}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        """Inverse of :meth:`to_dict`; validates, and rejects unknown fields by name."""
        data = dict(data)
        schema = data.pop("schema", CASE_SCHEMA)
        if schema != CASE_SCHEMA:
            raise CaseError("schema", f"is {schema!r}", repr(CASE_SCHEMA))
        stated_id = data.pop("id", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CaseError(unknown[0], "is not a case field", ", ".join(sorted(known)))
        case = cls(**data)
        if stated_id is not None and stated_id != case.case_id:
            raise CaseError("id", f"{stated_id} does not match the content ({case.case_id})",
                            "the id computed from the fields, or no id")
        return case

    @classmethod
    def from_json(cls, text: str) -> Case:
        """Parse :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> Case:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_CONTENT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Case)
                                        if f.name != "name")


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CaseError(name, f"= {value!r}", f"integer {low}..{high}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise CaseError(name, f"= {value!r}", ", ".join(allowed))


def validate(case: Case) -> None:
    """Raise :class:`CaseError` naming the first field outside its allowed range."""
    _validate_geometry(case)
    _check_int("decode_query_len", case.decode_query_len, 1, MAX_DECODE_QUERY_LEN)
    _check_int("seed", case.seed, 0, 2**63 - 1)
    _check_choice("query_dtype", case.query_dtype, QUERY_DTYPES)
    _check_choice("kv_dtype", case.kv_dtype, KV_DTYPES)
    _check_choice("distribution", case.distribution, DISTRIBUTIONS)
    for name in ("k_scale", "v_scale"):
        value = getattr(case, name)
        if case.is_fp8:
            low, high = SCALE_RANGE
            if not (math.isfinite(value) and low <= value <= high):
                raise CaseError(name, f"= {value!r}", f"finite {low:g}..{high:g} for fp8 KV")
        elif value != 1.0:
            raise CaseError(name, f"= {value!r} with kv_dtype {case.kv_dtype}",
                            "1.0 (scales apply to fp8 KV only)")
    if not (math.isfinite(case.softmax_scale) and case.softmax_scale > 0):
        raise CaseError("softmax_scale", f"= {case.softmax_scale!r}", "finite and > 0")
    low, high = SOFTCAP_RANGE
    if case.softcap != 0.0 and not (math.isfinite(case.softcap) and low <= case.softcap <= high):
        raise CaseError("softcap", f"= {case.softcap!r}", f"0 (off) or finite {low:g}..{high:g}")
    window = case.sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= MAX_SEQ_LEN:
        raise CaseError("sliding_window", f"= {window!r}", f"0 (off) or integer 1..{MAX_SEQ_LEN}")
    if not isinstance(case.canary, bool):
        raise CaseError("canary", f"= {case.canary!r}", "true or false")
    _validate_new_modes(case)
    if not 1 <= case.batch <= MAX_BATCH:
        raise CaseError("seq_lens", f"has {case.batch} requests", f"1..{MAX_BATCH} requests")
    if len(case.block_tables) != case.batch:
        raise CaseError("block_tables", f"has {len(case.block_tables)} rows",
                        f"one per request ({case.batch})")
    owner: dict[int, tuple[int, int]] = {}
    for r, (seq_len, table) in enumerate(zip(case.seq_lens, case.block_tables, strict=True)):
        if seq_len != 0:
            _check_int(f"seq_lens[{r}]", seq_len, case.query_len(r), MAX_SEQ_LEN)
        needed = cdiv(seq_len, case.block_size)
        if len(table) != needed:
            raise CaseError(f"block_tables[{r}]", f"has {len(table)} blocks for seq_len {seq_len}",
                            f"exactly cdiv(seq_len, {case.block_size}) = {needed}")
        for lb, pb in enumerate(table):
            name = f"block_tables[{r}][{lb}]"
            if not 0 <= pb < case.num_blocks:
                raise CaseError(name, f"= {pb} is outside the cache",
                                f"0..{case.num_blocks - 1} (num_blocks = {case.num_blocks})")
            if pb in owner:
                r0, l0 = owner[pb]
                raise CaseError(name, f"= {pb} is already block_tables[{r0}][{l0}]",
                                "each physical block holds one logical block")
            owner[pb] = (r, lb)
    if len(case.selections) != case.total_q:
        rows = "sum(query_lens)" if case.query_lens else "batch * decode_query_len"
        raise CaseError("selections", f"has {len(case.selections)} rows",
                        f"{rows} = {case.total_q}")
    topk = len(case.selections[0])
    if not 1 <= topk <= MAX_TOPK:
        raise CaseError("selections[0]", f"has {topk} lanes", f"1..{MAX_TOPK} lanes (top-k)")
    for n, row in enumerate(case.selections):
        if len(row) != topk:
            raise CaseError(f"selections[{n}]", f"has {len(row)} lanes",
                            f"top-k = {topk} like row 0")
        for lane, blk in enumerate(row):
            if not (blk == -1 or 0 <= blk <= case.max_logical_block):
                raise CaseError(f"selections[{n}][{lane}]", f"= {blk}",
                                f"-1 (padding) or a logical block 0..{case.max_logical_block}")
    if not isinstance(case.dense, bool):
        raise CaseError("dense", f"= {case.dense!r}", "true or false")
    if case.dense:
        _validate_dense(case)
    if case.max_page_id >= case.v_view_pages:
        raise CaseError("num_blocks", f"gives page id {case.max_page_id} beyond the V view "
                        f"({case.v_view_pages} pages)", "page ids below the V view length")


def _validate_geometry(case: Case) -> None:
    """The cache geometry: layout, head size, heads, block and page sizes, cache size."""
    _check_choice("kv_layout", case.kv_layout, ALL_LAYOUTS)
    if case.head_dim not in HEAD_DIMS or isinstance(case.head_dim, bool):
        raise CaseError("head_dim", f"= {case.head_dim!r}", ", ".join(map(str, HEAD_DIMS)))
    _check_int("num_kv_heads", case.num_kv_heads, 1, MAX_KV_HEADS)
    _check_int("num_q_heads", case.num_q_heads, 1, MAX_Q_HEADS)
    if case.num_q_heads % case.num_kv_heads:
        raise CaseError("num_q_heads", f"= {case.num_q_heads} with num_kv_heads "
                        f"{case.num_kv_heads}", "a multiple of num_kv_heads (GQA groups)")
    _check_int("page_size", case.page_size, 1, MAX_SEQ_LEN)
    _check_int("block_size", case.block_size, 1, MAX_SEQ_LEN)
    problem = case.layout.check(case)
    if problem is not None:
        raise CaseError(*problem)
    _check_int("num_blocks", case.num_blocks, 1, MAX_NUM_BLOCKS)


def _validate_dense(case: Case) -> None:
    """Every row of a dense case selects its causal blocks in order, then ``-1``."""
    for n, lanes in enumerate(case.selections):
        abs_pos = case.abs_pos(n)
        own = abs_pos // case.block_size + 1 if abs_pos >= 0 else 0
        if own > len(lanes):
            raise CaseError(f"selections[{n}]", f"has {len(lanes)} lanes for {own} causal blocks "
                            "in a dense case", f"at least {own} lanes (top-k)")
        expected = tuple(range(own)) + (-1,) * (len(lanes) - own)
        if lanes != expected:
            raise CaseError(f"selections[{n}]", f"= {list(lanes)} in a dense case",
                            f"its causal blocks in order, then -1: {list(expected)}")


def _validate_new_modes(case: Case) -> None:
    """fp8 queries, query lengths and split-K (their fields' ranges; the rows come later)."""
    q_scale = case.q_scale
    if q_scale != 0.0:
        low, high = SCALE_RANGE
        if not (math.isfinite(q_scale) and low <= q_scale <= high):
            raise CaseError("q_scale", f"= {q_scale!r}", f"0 (off) or finite {low:g}..{high:g}")
        if not case.is_fp8:
            raise CaseError("q_scale", f"= {q_scale!r} with kv_dtype {case.kv_dtype}",
                            "0 (off): fp8 queries are stored in the KV's fp8 dtype, so they "
                            "need an fp8 kv_dtype")
    if case.query_lens:
        if case.decode_query_len != 1:
            raise CaseError("decode_query_len", f"= {case.decode_query_len} with query_lens",
                            "1 (query_lens gives every request's query length)")
        if len(case.query_lens) != case.batch:
            raise CaseError("query_lens", f"has {len(case.query_lens)} entries",
                            f"one per request ({case.batch}), or none")
        for r, n in enumerate(case.query_lens):
            _check_int(f"query_lens[{r}]", n, 1, MAX_QUERY_LEN)
    segments = case.split_k_segments
    if segments != 0 and (isinstance(segments, bool) or segments not in SPLIT_K_SEGMENTS):
        raise CaseError("split_k_segments", f"= {segments!r}",
                        f"0 (off: no split-K scratch) or one of "
                        f"{', '.join(map(str, SPLIT_K_SEGMENTS))}")
    threshold = case.seq_threshold_3d
    if segments == 0 and threshold != 0:
        raise CaseError("seq_threshold_3d", f"= {threshold!r} with split_k_segments 0",
                        "0 (the threshold belongs to split-K scratch)")
    if segments:
        _check_int("seq_threshold_3d", threshold, 0, MAX_SEQ_THRESHOLD_3D)
