"""One MiniMax-M3 sparse decode case: a small, frozen, JSON-serialisable description.

A case holds only numbers and names. Every tensor is generated from it (see
:mod:`difftest.inputs`), so the same case is bit-identical on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from difftest.dtypes import FP8_DTYPES, KV_DTYPES, QUERY_DTYPES

CASE_SCHEMA = "difftest.case/1"
BLOCK_SIZE = 128
PAGE_SIZE = 16
HEAD_DIM = 128
KV_LAYOUTS: tuple[str, ...] = ("LBHNC", "LHBNC")
DISTRIBUTIONS: tuple[str, ...] = ("normal", "uniform", "outliers")
MAX_NUM_BLOCKS = 1 << 20
MAX_BATCH = 4096
MAX_SEQ_LEN = 1 << 20
MAX_TOPK = 64
MAX_Q_HEADS = 64
MAX_DECODE_QUERY_LEN = 4
MAX_LOGICAL_BLOCK = MAX_SEQ_LEN // BLOCK_SIZE
SCALE_RANGE = (1e-6, 1e6)
SOFTCAP_RANGE = (1e-3, 1e4)
# Kernel-mode fields and their "off" values. A field at its default is left out of the
# content (and so of the case id and the JSON), so cases written before the field existed
# keep their ids and load unchanged.
MODE_DEFAULTS: dict[str, Any] = {"softcap": 0.0, "sliding_window": 0, "canary": False}


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
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(int(s) for s in self.seq_lens))
        object.__setattr__(
            self, "block_tables", tuple(tuple(int(b) for b in row) for row in self.block_tables)
        )
        object.__setattr__(
            self, "selections", tuple(tuple(int(b) for b in row) for row in self.selections)
        )
        for name in ("k_scale", "v_scale", "softmax_scale", "softcap"):
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
        """Number of query rows (``batch * decode_query_len``)."""
        return self.batch * self.decode_query_len

    @property
    def topk(self) -> int:
        """Lanes per query row."""
        return len(self.selections[0])

    @property
    def is_fp8(self) -> bool:
        """Whether the KV cache is stored in fp8."""
        return self.kv_dtype in FP8_DTYPES

    @property
    def pages_per_side(self) -> int:
        """16-token pages on one side (K or V) of a 128-token block."""
        return self.block_size // self.page_size

    @property
    def block_page_stride(self) -> int:
        """Page ids one block spans: 16 when K and V sides are packed (LBHNC), else 8."""
        return self.pages_per_side * (2 if self.kv_layout == "LBHNC" else 1)

    @property
    def k_view_pages(self) -> int:
        """Length of the page-16 K view (untrimmed)."""
        return self.num_blocks * self.block_page_stride

    @property
    def v_view_pages(self) -> int:
        """Length of the page-16 V view (half a block shorter than K when packed)."""
        offset = self.pages_per_side if self.kv_layout == "LBHNC" else 0
        return self.k_view_pages - offset

    @property
    def max_page_id(self) -> int:
        """The highest page id a valid selection of the last physical block can produce."""
        return (self.num_blocks - 1) * self.block_page_stride + self.pages_per_side - 1

    @property
    def kernel_modes(self) -> tuple[str, ...]:
        """The kernel modes this case switches on (``"softcap"``, ``"sliding_window"``): a
        backend that cannot run one must declare the case unsupported."""
        return tuple(m for m in ("softcap", "sliding_window") if getattr(self, m))

    @cached_property
    def case_id(self) -> str:
        """Stable content id: a hash of every field but ``name``."""
        payload = json.dumps(self._content(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def request_of_row(self, row: int) -> int:
        """The request a query row belongs to."""
        return row // self.decode_query_len

    def abs_pos(self, row: int) -> int:
        """Absolute position of a query row's token (negative for padded requests)."""
        req = self.request_of_row(row)
        return self.seq_lens[req] - self.decode_query_len + row % self.decode_query_len

    # ----- serialisation ----------------------------------------------------------------
    def _content(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("name")
        for mode, off in MODE_DEFAULTS.items():
            if data[mode] == off:
                data.pop(mode)
        data["seq_lens"] = list(self.seq_lens)
        data["block_tables"] = [list(r) for r in self.block_tables]
        data["selections"] = [list(r) for r in self.selections]
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


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CaseError(name, f"= {value!r}", f"integer {low}..{high}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise CaseError(name, f"= {value!r}", ", ".join(allowed))


def validate(case: Case) -> None:
    """Raise :class:`CaseError` naming the first field outside its allowed range."""
    _check_int("num_kv_heads", case.num_kv_heads, 1, 1)
    _check_int("head_dim", case.head_dim, HEAD_DIM, HEAD_DIM)
    _check_int("page_size", case.page_size, PAGE_SIZE, PAGE_SIZE)
    _check_int("block_size", case.block_size, BLOCK_SIZE, BLOCK_SIZE)
    _check_int("num_blocks", case.num_blocks, 1, MAX_NUM_BLOCKS)
    _check_int("num_q_heads", case.num_q_heads, 1, MAX_Q_HEADS)
    _check_int("decode_query_len", case.decode_query_len, 1, MAX_DECODE_QUERY_LEN)
    _check_int("seed", case.seed, 0, 2**63 - 1)
    _check_choice("query_dtype", case.query_dtype, QUERY_DTYPES)
    _check_choice("kv_dtype", case.kv_dtype, KV_DTYPES)
    _check_choice("kv_layout", case.kv_layout, KV_LAYOUTS)
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
    if not 1 <= case.batch <= MAX_BATCH:
        raise CaseError("seq_lens", f"has {case.batch} requests", f"1..{MAX_BATCH} requests")
    if len(case.block_tables) != case.batch:
        raise CaseError("block_tables", f"has {len(case.block_tables)} rows",
                        f"one per request ({case.batch})")
    owner: dict[int, tuple[int, int]] = {}
    for r, (seq_len, table) in enumerate(zip(case.seq_lens, case.block_tables, strict=True)):
        if seq_len != 0:
            _check_int(f"seq_lens[{r}]", seq_len, case.decode_query_len, MAX_SEQ_LEN)
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
        raise CaseError("selections", f"has {len(case.selections)} rows",
                        f"batch * decode_query_len = {case.total_q}")
    topk = len(case.selections[0])
    if not 1 <= topk <= MAX_TOPK:
        raise CaseError("selections[0]", f"has {topk} lanes", f"1..{MAX_TOPK} lanes (top-k)")
    for n, row in enumerate(case.selections):
        if len(row) != topk:
            raise CaseError(f"selections[{n}]", f"has {len(row)} lanes",
                            f"top-k = {topk} like row 0")
        for lane, blk in enumerate(row):
            if not (blk == -1 or 0 <= blk < MAX_LOGICAL_BLOCK):
                raise CaseError(f"selections[{n}][{lane}]", f"= {blk}",
                                f"-1 (padding) or a logical block 0..{MAX_LOGICAL_BLOCK - 1}")
    if case.max_page_id >= case.v_view_pages:
        raise CaseError("num_blocks", f"gives page id {case.max_page_id} beyond the V view "
                        f"({case.v_view_pages} pages)", "page ids below the V view length")
