"""Token sequences as the trie and the partition take them: validated private int64 copies, big-endian uint32
sort keys (byte order = lexicographic order of the ids), and the longest common prefix of lexicographic
neighbours."""

from __future__ import annotations

import array
import sys
from typing import Any

import numpy as np

MAX_ID = 2**32  # token ids must be < 2**32 (they are encoded as uint32 for sorting)

# array.array typecode for a C uint32; 'I' is 4 bytes on every mainstream platform.
_U32 = "I" if array.array("I").itemsize == 4 else "L"
_LITTLE_ENDIAN = sys.byteorder == "little"


def convert(item: Any, i: int, min_length: int = 2) -> tuple[np.ndarray, bytes]:
    """Validate sequence ``i`` (at least ``min_length`` tokens: 2 for the trie, a prompt token and a scored
    one; 0 for a partition); return (private int64 copy, big-endian uint32 bytes)."""
    # Fast path for plain lists/tuples of Python ints: array.array('I') converts in C
    # and rejects floats, strings, negatives and ids >= 2**32 by raising.  A list that
    # starts with a bool goes to the slow path, which rejects all-bool lists (numpy
    # infers dtype bool) -- like numpy, a list mixing bools into ints is taken as ints.
    if type(item) in (list, tuple) and len(item) >= max(min_length, 1) and type(item[0]) is not bool:
        try:
            buf = array.array(_U32, item)
        except (TypeError, OverflowError, ValueError):
            pass  # fall through; the slow path says what is wrong
        else:
            arr = np.frombuffer(buf, dtype=np.uint32).astype(np.int64)
            if _LITTLE_ENDIAN:
                buf.byteswap()
            return arr, buf.tobytes()
    arr = _to_numpy(item, i)
    _check_array(arr, i, min_length)
    arr = np.array(arr, dtype=np.int64, copy=True)  # never share memory with the caller
    return arr, arr.astype(">u4").tobytes()


def _to_numpy(item: Any, i: int) -> np.ndarray:
    """Turn one sequence into a numpy array without judging it yet."""
    if _is_torch_tensor(item):
        dt = item.dtype
        if dt.is_floating_point or dt.is_complex or dt == _torch().bool:
            raise ValueError(f"sequence {i} has dtype {dt}; token ids must be integers")
        t = item.detach().cpu()
        try:
            return t.numpy()
        except TypeError:  # an integer dtype numpy cannot view directly
            return t.to(dtype=_torch().int64).numpy()
    if type(item) in (list, tuple) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in item
    ):
        # All ints, but the fast path refused them (out of range, or too short).  Keep
        # them as Python ints: numpy would turn e.g. [1, 2**64 - 1] into float64.
        return np.array([int(v) for v in item], dtype=object)
    try:
        return np.asarray(item)
    except (ValueError, TypeError) as e:
        raise ValueError(f"sequence {i} could not be turned into a 1-D integer array: {e}") from None


def _check_array(arr: np.ndarray, i: int, min_length: int) -> None:
    """Raise ValueError unless ``arr`` is a valid 1-D array of at least ``min_length`` token ids."""
    if arr.dtype.kind == "O" and arr.ndim == 1 and all(type(v) is int for v in arr.tolist()):
        # Python ints (possibly beyond int64/uint64): check them as ints.
        vals = arr.tolist()
        if len(vals) < min_length:
            raise ValueError(_too_short(i, len(vals)))
        if not vals:
            return
        if min(vals) < 0:
            raise ValueError(f"sequence {i} has a negative token id ({min(vals)})")
        if max(vals) >= MAX_ID:
            raise ValueError(f"sequence {i} has a token id >= 2**32 ({max(vals)})")
        return
    if arr.ndim == 1 and arr.shape[0] < min_length:  # first: numpy gives [] the dtype float64
        raise ValueError(_too_short(i, arr.shape[0]))
    if arr.ndim == 1 and arr.shape[0] == 0:
        return
    if arr.dtype.kind not in "iu":
        raise ValueError(f"sequence {i} has dtype {arr.dtype}; token ids must be integers")
    if arr.ndim != 1:
        raise ValueError(f"sequence {i} must be 1-D, got shape {tuple(arr.shape)}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"sequence {i} has a negative token id ({lo})")
    if hi >= MAX_ID:
        raise ValueError(f"sequence {i} has a token id >= 2**32 ({hi})")


def _too_short(i: int, n: int) -> str:
    return f"sequence {i} has {n} token(s); a sequence needs at least 2 (a prompt token and a scored token)"


def _is_torch_tensor(item: Any) -> bool:
    """True for a torch.Tensor, without importing torch unless it is already loaded."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(item, torch.Tensor)


def _torch() -> Any:
    import torch

    return torch


# ---------------------------------------------------------------------- LCP


def neighbour_lcp(seqs: list[np.ndarray], lengths: np.ndarray, order: list[int]) -> list[int]:
    """``lcp[k]`` = longest common prefix of ``seqs[order[k-1]]`` and ``seqs[order[k]]``.

    ``lcp[0]`` is 0.  Each pair is one vectorised comparison over the shorter length.
    """
    lens = lengths.tolist()
    out = [0] * len(order)
    prev = seqs[order[0]]
    lp = lens[order[0]]
    for k in range(1, len(order)):
        s = order[k]
        cur = seqs[s]
        lc = lens[s]
        m = lp if lp < lc else lc
        if m == 0:  # an empty sequence (partitions take them)
            prev, lp = cur, lc
            continue
        neq = prev[:m] != cur[:m]
        j = int(neq.argmax())  # first mismatch, or 0 when there is none
        out[k] = j if neq[j] else m
        prev, lp = cur, lc
    return out
