"""The functions every script of ``difftest export`` holds, copied by their source.

Each is self-contained (the standard library and torch, which the script imports), so a
script runs where difftest is not installed: :func:`prepare_device` sets what difftest sets
before a Triton kernel's package is imported, :func:`ref_paged_attn` is the float64 reference
over the case's plain page views (in the style of vLLM's test of the same name), and
:func:`differences` says where and how much a kernel's output is off.
"""

from __future__ import annotations

import torch


def prepare_device(device: str) -> None:
    """On the CPU, Triton kernels run in its interpreter and vLLM must see no CUDA device:
    both set before the kernel's package is imported."""
    import os
    import warnings

    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # the interpreter computes masked lanes with numpy (0/0 and log(0) that it discards)
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                module="triton.runtime.interpreter")


def ref_paged_attn(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                   k_scale: float = 1.0, v_scale: float = 1.0, softcap: float = 0.0,
                   sliding_window: int = 0) -> torch.Tensor:
    """float64 attention of every query row ``[rows, heads, dim]`` over its context: the
    first ``context_lens[r]`` tokens of the pages ``block_table[r]`` lists, from caches
    ``[pages, page_size, kv_heads, dim]`` dequantised by ``k_scale``/``v_scale``; only the
    last ``sliding_window`` tokens when set; each logit ``s`` capped to
    ``softcap * tanh(s / softcap)`` when set. Query head ``h`` reads KV head
    ``h // (heads / kv_heads)``; a row of no context is 0."""
    rows, heads, dim = query.shape
    page_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64, device=query.device)
    for row in range(rows):
        tokens = int(context_lens[row])
        if tokens == 0:
            continue
        pages = block_table[row, : (tokens + page_size - 1) // page_size].long()
        k = key_cache[pages].reshape(-1, kv_heads, dim)[:tokens].double() * k_scale
        v = value_cache[pages].reshape(-1, kv_heads, dim)[:tokens].double() * v_scale
        if sliding_window:
            k, v = k[-sliding_window:], v[-sliding_window:]
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        logits = torch.einsum("hd,thd->ht", query[row].double(), k) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        out[row] = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), v)
    return out


def differences(output: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor,
                context_lens: torch.Tensor, empty_rows: str, shown: int = 5) -> list[str]:
    """What is off, one line each (none: the output agrees): elements of rows with context
    whose ``|output - expected|`` exceeds ``tolerance`` (NaN and Inf included), and rows of
    no context that do not hold what the kernel writes there (``empty_rows``: ``zero``, NaN
    for ``untouched`` (the buffer's fill), ``undefined``: not checked); then the worst
    element of each of the ``shown`` worst rows."""
    actual = output.double().cpu()
    expected, tolerance = expected.double().cpu(), tolerance.double().cpu()
    attended = context_lens.cpu() > 0
    error = (actual - expected).abs().nan_to_num(nan=float("inf"))
    ratio = torch.where(attended[:, None, None], error / tolerance, torch.zeros_like(error))
    off = ratio > 1
    lines = []
    if bool(off.any()):
        nonfinite = int((~actual.isfinite() & attended[:, None, None]).sum())
        checked = int(attended.sum()) * actual.shape[1] * actual.shape[2]
        lines.append(f"{int(off.sum())} of {checked} elements of rows with context differ "
                     f"beyond tolerance ({nonfinite} NaN or Inf); greatest |error| "
                     f"{float(error[attended].max()):.4g}, error/tolerance "
                     f"{float(ratio.max()):.4g}")
        worst_rows = ratio.flatten(1).amax(1).argsort(descending=True)[:shown]
        for row in worst_rows.tolist():
            if not bool(off[row].any()):
                break
            head, dim = divmod(int(ratio[row].flatten().argmax()), actual.shape[2])
            lines.append(f"  row {row}, head {head}, dim {dim}: kernel "
                         f"{float(actual[row, head, dim]):.6g}, reference "
                         f"{float(expected[row, head, dim]):.6g}, |error| "
                         f"{float(error[row, head, dim]):.3g}, tolerance "
                         f"{float(tolerance[row, head, dim]):.3g} "
                         f"({int(context_lens[row])} tokens of context)")
    empty = (~attended).nonzero().flatten().tolist()
    if empty_rows == "zero":
        wrong = [r for r in empty if not bool((actual[r] == 0).all())]
    elif empty_rows == "untouched":
        wrong = [r for r in empty if not bool(actual[r].isnan().all())]
    else:
        wrong = []
    if wrong:
        lines.append(f"rows {wrong} have no context and should be {empty_rows} "
                     "(what this kernel writes there)")
    return lines
