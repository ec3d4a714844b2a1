"""The peers' way of testing, as a case generator: fixed parameter grids, uniform random tables.

vLLM tests ``unified_attention`` (``tests/kernels/attention/test_triton_unified_attention.py``)
and AITER tests ``pa_decode_gluon`` (``op_tests/triton_tests/test_pa_decode_gluon.py``) by
iterating a fixed grid, reseeding one RNG per grid point and drawing block tables uniformly
from a large block pool. This module maps each grid onto :class:`~difftest.case.spec.Case`, in
the peers' iteration order, keeping every axis our case model has and collapsing the others
(the peers' values below; docs/mutation-benchmark.md lists the mapping):

* vLLM: ``seq_lens`` ``[(1,1328),(5,18),(129,463)]``, ``[(1,523),(1,37),(1,2011)]``
  (fastest axis); ``num_heads`` ``(4,4),(8,2),(5,1)`` (q heads per KV head 1, 4, 5);
  ``NUM_BLOCKS`` ``32768, 2048`` pages of 16 tokens (4096 and 256 blocks of 128);
  ``q_dtype`` ``None`` (bf16 KV) then fp8 (KV fp8 with ``k_scale=0.5``, ``v_scale=0.25``;
  the bf16-query fp8-KV test gives the same points). ``torch.randn`` data, seed 0. Collapsed:
  head size 256, sliding window, soft cap, the 3-D kernel threshold; query lengths map to 1
  (the sparse decode path has one query length per step).
* AITER ``normal_accuracy_test``: head configs ``(5,1),(8,1),(10,1),(16,1)`` (outermost);
  compute types fp8 (q and KV quantised, per-tensor scale ``amax/FP8_MAX`` of ``U(-1,1)``
  data, i.e. ``1/448`` for both sides) then bf16; ``kv_varlen`` False then True
  (``random.randint(query_length, 1027)`` per request, ``random.seed(123)``); query lengths
  1..4; batch sizes 3, 81 (innermost); context length 1027; a pool of
  ``cdiv(max(16384, L), bs) * B`` blocks of ``bs`` tokens, i.e. ``128 * B`` blocks of 128.
  ``uniform_(-1, 1)`` data, seed 123. Collapsed: block sizes 16/64/1024, per-token vs
  per-tensor quantisation, V transposition.

Both peers keep K and V in two tensors with equal block counts, so every case is LHBNC.
Block tables are drawn without replacement (a case's physical blocks are distinct) and the
top-k selection of each query row is a uniformly random set of its causal blocks (top-k 16,
random order, ``-1`` tail), both from a generator reseeded at every grid point, as the peers
reseed per test.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import torch

from difftest.case.spec import BLOCK_SIZE, Case, cdiv

TOPK = 16
VLLM_SEQ_LENS = ((1328, 18, 463), (523, 37, 2011))
VLLM_Q_HEADS = (1, 4, 5)
VLLM_POOLS = (32768 * 16 // BLOCK_SIZE, 2048 * 16 // BLOCK_SIZE)
VLLM_FP8_SCALES = (0.5, 0.25)
VLLM_SEED = 0
AITER_Q_HEADS = (5, 8, 10, 16)
AITER_QUERY_LENGTHS = (1, 2, 3, 4)
AITER_BATCH_SIZES = (3, 81)
AITER_CONTEXT_LENGTH = 1027
AITER_MIN_POOL_TOKENS = 16384
AITER_SEED = 123
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}


def peer_case(seq_lens: tuple[int, ...], decode_query_len: int, num_q_heads: int, pool: int,
              query_dtype: str, kv_dtype: str, k_scale: float, v_scale: float,
              distribution: str, seed: int, name: str) -> Case:
    """A case whose tables and selections come from one generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    needed = [cdiv(s, BLOCK_SIZE) for s in seq_lens]
    chosen = torch.randperm(pool, generator=gen)[: sum(needed)].tolist()
    tables, start = [], 0
    for count in needed:
        tables.append(tuple(chosen[start : start + count]))
        start += count
    selections = []
    for seq_len in seq_lens:
        for i in range(decode_query_len):
            self_blk = (seq_len - decode_query_len + i) // BLOCK_SIZE
            picked = torch.randperm(self_blk + 1, generator=gen)[:TOPK].tolist()
            selections.append(tuple(picked + [-1] * (TOPK - len(picked))))
    return Case(num_blocks=pool, seq_lens=seq_lens, block_tables=tuple(tables),
                selections=tuple(selections), decode_query_len=decode_query_len,
                num_q_heads=num_q_heads, query_dtype=query_dtype, kv_dtype=kv_dtype,
                k_scale=k_scale, v_scale=v_scale, kv_layout="LHBNC",
                distribution=distribution, seed=seed, name=name)


def vllm_unified_grid(query_dtype: str = "bfloat16",
                      fp8_dtype: str = "float8_e4m3fn") -> Iterator[Case]:
    """vLLM's ``test_triton_unified_attn`` grid (24 points), in pytest's order."""
    for fp8 in (False, True):
        kv = fp8_dtype if fp8 else "bfloat16"
        k_scale, v_scale = VLLM_FP8_SCALES if fp8 else (1.0, 1.0)
        for pool in VLLM_POOLS:
            for heads in VLLM_Q_HEADS:
                for lens in VLLM_SEQ_LENS:
                    name = f"vllm[kv={kv},pool={pool},heads={heads},seq_lens={lens}]"
                    yield peer_case(lens, 1, heads, pool, query_dtype, kv, k_scale, v_scale,
                                    "normal", VLLM_SEED, name)


def aiter_gluon_grid(query_dtype: str = "bfloat16", fp8_dtype: str = "float8_e4m3fn",
                     batch_sizes: tuple[int, ...] = AITER_BATCH_SIZES) -> Iterator[Case]:
    """AITER's ``normal_accuracy_test`` grid (128 points), in its loop order.

    ``batch_sizes`` may leave out AITER's 81: one such case (81 requests of 1027 tokens,
    10368 blocks) takes 20 to 80 s per kernel run in Triton's interpreter.
    """
    scale = round(1.0 / FP8_MAX[fp8_dtype], 12)
    for heads in AITER_Q_HEADS:
        for fp8 in (True, False):
            kv = fp8_dtype if fp8 else "bfloat16"
            kv_scale = scale if fp8 else 1.0
            for varlen in (False, True):
                for qlen in AITER_QUERY_LENGTHS:
                    for batch in batch_sizes:
                        lens = _aiter_lengths(batch, qlen, varlen)
                        pool = cdiv(max(AITER_MIN_POOL_TOKENS, AITER_CONTEXT_LENGTH),
                                    BLOCK_SIZE) * batch
                        name = (f"aiter[heads={heads},kv={kv},varlen={varlen},qlen={qlen},"
                                f"batch={batch}]")
                        yield peer_case(lens, qlen, heads, pool, query_dtype, kv, kv_scale,
                                        kv_scale, "uniform", AITER_SEED, name)


def _aiter_lengths(batch: int, qlen: int, varlen: bool) -> tuple[int, ...]:
    if not varlen:
        return (AITER_CONTEXT_LENGTH,) * batch
    rng = random.Random(AITER_SEED)
    return tuple(rng.randint(qlen, AITER_CONTEXT_LENGTH) for _ in range(batch))


BASELINES: dict[str, Callable[..., Iterator[Case]]] = {
    "vllm-grid": vllm_unified_grid,
    "aiter-grid": aiter_gluon_grid,
}
