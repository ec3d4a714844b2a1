"""Tensor data of a case, generated from the case's seed (bit-identical on every device).

Only physical blocks that some query row attends get data; each token's K and V are drawn once and
stored in the KV dtype. fp8 values are stored as ``cast(real / scale)`` with saturation at the
format's maximum, so small scales push stored values to the fp8 maximum and large scales to
its subnormals. The real value a kernel must see is ``stored * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftest import counter_rng
from difftest.case import Case, cdiv
from difftest.dtypes import finite_max, torch_dtype
from difftest.sparse_table import SparseRow

_QUERY, _KEY, _VALUE = 1, 2, 3


@dataclass(frozen=True)
class CaseData:
    """Stored (quantised) tensors of a case, on the device they were generated on.

    ``k_stored``/``v_stored`` are ``[num_attended, block_size, num_kv_heads, head_dim]`` in the
    KV dtype, one entry per attended physical block, in ascending physical id order;
    ``slot_of`` maps a physical block id to its entry.
    ``valid_tokens[i]`` is how many leading tokens of that block its request wrote.
    """

    query: torch.Tensor
    k_stored: torch.Tensor
    v_stored: torch.Tensor
    physical_blocks: tuple[int, ...]
    valid_tokens: tuple[int, ...]
    slot_of: dict[int, int]


def _draw(seed: int, stream: int, rows: torch.Tensor, row_length: int,
          distribution: str) -> torch.Tensor:
    """Values of ``rows`` of a flat index space, ``[len(rows), row_length]``."""
    if distribution == "normal":
        return counter_rng.normal_rows(seed, stream, rows, row_length)
    index = rows.view(-1, 1) * row_length + torch.arange(row_length, device=rows.device)
    if distribution == "uniform":
        return counter_rng.uniform(seed, stream, index) * 2 - 1
    values = counter_rng.normal_rows(seed, stream, rows, row_length)
    spikes = counter_rng.uniform(seed, 100 + stream, index) < 1 / 64
    return torch.where(spikes, values * 8, values)


def quantize(real: torch.Tensor, dtype_name: str, scale: float) -> torch.Tensor:
    """Store real values in ``dtype_name``; fp8 stores ``real / scale`` saturated."""
    dtype = torch_dtype(dtype_name)
    if dtype_name.startswith("float8"):
        limit = finite_max(dtype_name)
        return (real / scale).clamp(-limit, limit).to(dtype)
    return real.to(dtype)


def generate(case: Case, rows: tuple[SparseRow, ...],
             device: str | torch.device = "cpu") -> CaseData:
    """Generate the query and the K/V of every attended block, bit-identically on any device.

    Blocks no row attends get no data: their pages are NaN canaries in the cache.
    """
    device = torch.device(device)
    per_row = case.num_q_heads * case.head_dim
    q_rows = torch.arange(case.total_q, device=device)
    query = _draw(case.seed, _QUERY, q_rows, per_row, case.distribution)
    written: dict[int, int] = {}
    for seq_len, table in zip(case.seq_lens, case.block_tables, strict=True):
        for lb, pb in enumerate(table):
            written[pb] = min(case.block_size, seq_len - lb * case.block_size)
    blocks = tuple(sorted({seg.physical_block for row in rows for seg in row.segments}))
    per_block = case.block_size * case.num_kv_heads * case.head_dim
    block_ids = torch.tensor(blocks, dtype=torch.int64, device=device)
    shape = (len(blocks), case.block_size, case.num_kv_heads, case.head_dim)
    k_real = _draw(case.seed, _KEY, block_ids, per_block, case.distribution).view(shape)
    v_real = _draw(case.seed, _VALUE, block_ids, per_block, case.distribution).view(shape)
    return CaseData(
        query=query.view(case.total_q, case.num_q_heads, case.head_dim)
        .to(torch_dtype(case.query_dtype)),
        k_stored=quantize(k_real, case.kv_dtype, case.k_scale),
        v_stored=quantize(v_real, case.kv_dtype, case.v_scale),
        physical_blocks=blocks,
        valid_tokens=tuple(written[b] for b in blocks),
        slot_of={b: i for i, b in enumerate(blocks)},
    )


def pages_holding_tokens(tokens: int, page_size: int) -> int:
    """How many pages of a block hold at least one of its first ``tokens`` tokens."""
    return cdiv(tokens, page_size)
