"""Sorting by (group, value) and per-group medians, fast.

`numpy.lexsort` on a million rows costs about 0.8 s on a small cloud core; one int64 sort of a
packed key (group in the high 32 bits, the value's float32 bit pattern in the low 32) costs about
0.1 s. For non-negative floats the IEEE bit pattern orders like the value, and float32 keeps ~7
significant digits, far finer than any threshold here. Values must be finite or +inf and >= 0.
"""
from __future__ import annotations

import threading
from typing import Callable, Hashable, Optional

import numpy as np

MAX_GROUP = (1 << 31) - 1  # group ids must fit the high half of an int64 without its sign bit
MAX_UINT16 = (1 << 16) - 1
# dense_groups counts ids into a table when their range is at most this many times their count, plus this
DENSE_SPAN_FACTOR = 4
DENSE_SPAN_SLACK = 1024
SMALL_WINDOW_ROWS = 2048  # id arrays up to this size have their groupings cached (_StructureCache)


class _StructureCache:
    """Groupings of small windows, by the ids' content. A window's structure (which stages, ranks
    and steps it holds) repeats window after window, and cohort after cohort where they have one
    shape (a TP x PP grid); counting and sorting the same ids again is much of what judging a small
    window costs. Large id arrays are not kept: there the work dwarfs the fixed costs, and copies
    would cost memory. Results are read-only, as they are shared."""

    MAX_IDS = SMALL_WINDOW_ROWS
    MAX_BYTES = 4 << 20  # keys and results together; the oldest go first

    def __init__(self) -> None:
        self._results: dict[tuple, tuple] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # engines of several threads (tests, replays) share it

    def key(self, kind: str, ids: np.ndarray, *extra) -> Optional[tuple]:
        if ids.size > self.MAX_IDS:
            return None
        return (kind, ids.dtype.str, ids.shape, ids.tobytes()) + extra

    def get(self, key: tuple) -> Optional[tuple]:
        return self._results.get(key)

    def put(self, key: tuple, result: tuple) -> tuple:
        for array in result:
            array.flags.writeable = False
        with self._lock:
            if key not in self._results:
                self._results[key] = result
                self._bytes += _size(key, result)
            while self._bytes > self.MAX_BYTES:
                oldest = next(iter(self._results))
                self._bytes -= _size(oldest, self._results.pop(oldest))
        return result


def _size(key: tuple, result: tuple) -> int:
    return len(key[3]) + sum(array.nbytes for array in result)


_structures = _StructureCache()


def cached_structure(kind: str, ids: np.ndarray, compute: Callable[[], tuple], *extra: Hashable) -> tuple:
    """compute(): a tuple of arrays that depends on the content of `ids` (and on `extra`) alone,
    kept for small windows (_StructureCache); read-only."""
    key = _structures.key(kind, ids, *extra)
    if key is None:
        return compute()
    found = _structures.get(key)
    return found if found is not None else _structures.put(key, compute())


def _packed(groups: np.ndarray, values: np.ndarray) -> np.ndarray:
    # `+ 0.0` turns -0.0 into +0.0, whose bit pattern would otherwise sort after every positive value
    value_bits = (values + 0.0).astype(np.float32).view(np.uint32).astype(np.int64)
    return (groups.astype(np.int64) << 32) | value_bits


def run_bounds(sorted_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, run number of each element) of the runs of equal ids in a sorted array."""
    first, starts, ends = _runs(sorted_ids)
    return starts, ends, np.cumsum(first) - 1


def _runs(sorted_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(whether each element starts a run, run starts, run ends) of a sorted array."""
    first = np.empty(sorted_ids.size, dtype=bool)
    first[:1] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = first.nonzero()[0]  # flatnonzero's wrapper costs more than the work on a small window
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1:] = sorted_ids.size
    return first, starts, ends


def dense_groups(groups: np.ndarray, stride: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """(distinct group ids, each row's index into them): for group ids too large to pack. Ids that
    span a range not much wider than their count (steps, stage codes, a small cohort's cells) are
    counted into a table instead of sorted: the same result, without np.unique's sort and its
    fixed cost, which a small window pays a dozen times. stride: where each id is prefix * stride
    plus a remainder below stride, and few of the prefixes in their range are used (the stage codes
    of a batch of cohorts, each using a few of the codes it has room for), the used prefixes are
    numbered first, so that such ids too are counted into a table."""
    distinct, index = cached_structure("dense", groups, lambda: _dense_groups(groups, stride))
    return distinct, index


def _dense_groups(groups: np.ndarray, stride: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    if groups.size and groups.dtype == np.int64:
        low, high = int(groups.min()), int(groups.max())
        if high - low + 1 <= DENSE_SPAN_FACTOR * groups.size + DENSE_SPAN_SLACK:
            return _counted(groups, low, high - low + 1)
        if stride and low >= 0:
            by_prefix = _counted_by_prefix(groups, stride, low, high)
            if by_prefix is not None:
                return by_prefix
    distinct, index = np.unique(groups, return_inverse=True)
    return distinct, index.reshape(-1)


def _counted(groups: np.ndarray, low: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    shifted = groups - low if low else groups
    present = np.bincount(shifted, minlength=span) != 0
    distinct = present.nonzero()[0]
    index = np.cumsum(present)[shifted] - 1
    return distinct + low if low else distinct, index


def _counted_by_prefix(groups: np.ndarray, stride: int, low: int, high: int):
    """_counted of non-negative ids with their used prefixes (id // stride) numbered in order, so
    the table spans the used prefixes only; None where that is still too wide. The numbering keeps
    the ids' order, so distinct ids and indices are np.unique's."""
    first = low // stride
    prefixes = high // stride - first + 1
    if prefixes > DENSE_SPAN_FACTOR * groups.size + DENSE_SPAN_SLACK:  # the prefixes' table as bounded as the ids'
        return None
    prefix = groups // stride
    if first:
        prefix -= first
    used = np.bincount(prefix, minlength=prefixes) != 0
    used_prefixes = used.nonzero()[0]
    span = used_prefixes.size * stride
    if span > DENSE_SPAN_FACTOR * groups.size + DENSE_SPAN_SLACK:  # checked before any id is renumbered
        return None
    # an id's prefix replaced by its number among the used ones: id + (number - prefix) * stride
    shift = (np.cumsum(used) - 1 - np.arange(prefixes) - first) * stride
    distinct, index = _counted(groups + shift[prefix], 0, span)
    distinct_prefix, distinct_remainder = np.divmod(distinct, stride)
    return (used_prefixes[distinct_prefix] + first) * stride + distinct_remainder, index


def order_within_groups(groups: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Permutation sorting rows by group, then value. Groups: 0 <= g <= MAX_GROUP."""
    return np.argsort(_packed(groups, values))


def grouped_medians(groups: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct groups ascending, the median of each group's values)."""
    if groups.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    if groups.size <= _StructureCache.MAX_IDS:
        equal = _equal_medians(groups, values)
        if equal is not None:
            return equal
    if int(groups.max()) > MAX_GROUP:
        distinct, index = dense_groups(groups)
        dense, medians = grouped_medians(index, values)
        return distinct[dense], medians
    packed = np.sort(_packed(groups, values))
    sorted_groups = packed >> 32
    sorted_values = (packed & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)
    _, starts, ends = _runs(sorted_groups)
    sizes = ends - starts
    low = sorted_values[starts + (sizes - 1) // 2]
    high = sorted_values[starts + sizes // 2]
    return sorted_groups[starts], (low + high) / 2.0


def _equal_medians(groups: np.ndarray, values: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """grouped_medians of a small window whose groups all have as many rows (every rank has every
    step): the groups' layout from the structure cache and a row-by-row sort of one matrix, instead
    of a sort of all rows by (group, value). The values are rounded to float32 first, as the packed
    sort has them, so the medians are the same to the bit. None where the groups differ in size, or
    a value is negative or nan (the packed order is that of the values for non-negative ones only)."""
    distinct, index = dense_groups(groups)
    equal = _equal_groups(index, distinct.size)
    if equal is None or not values.min() >= 0:
        return None
    rows = (values + 0.0).astype(np.float32)[equal[1]].reshape(distinct.size, -1).astype(np.float64)
    rows.sort(axis=1)
    size = rows.shape[1]
    return distinct.astype(np.int64, copy=False), (rows[:, (size - 1) // 2] + rows[:, size // 2]) / 2.0


def grouped_medians_signed(groups: np.ndarray, values: np.ndarray,
                           group_count: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """grouped_medians for any finite float64 values (negative ones too) and any int64 groups:
    slower (a lexsort), for the few per-window statistics of deviations. group_count: where the
    ids are known to lie in [0, group_count) (dense_groups' indices, or a subset of them), which
    spares the scans for their bounds."""
    if groups.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    equal = _equal_groups(groups, group_count)
    if equal is not None:
        present, by_group = equal
        rows = values[by_group].reshape(present.size, -1)
        rows.sort(axis=1)
        size = rows.shape[1]
        return present, (rows[:, (size - 1) // 2] + rows[:, size // 2]) / 2
    order = _order_by_group_then_value(groups, values, group_count)
    sorted_groups, sorted_values = groups[order], values[order]
    _, starts, ends = _runs(sorted_groups)
    low = starts + (ends - starts - 1) // 2
    high = starts + (ends - starts) // 2
    return sorted_groups[starts], (sorted_values[low] + sorted_values[high]) / 2


def _fit_uint16(groups: np.ndarray, group_count: Optional[int]) -> bool:
    """Whether every id is in [0, MAX_UINT16]."""
    if group_count is not None:
        return group_count - 1 <= MAX_UINT16
    return int(groups.min()) >= 0 and int(groups.max()) <= MAX_UINT16


def _order_by_group_then_value(groups: np.ndarray, values: np.ndarray,
                               group_count: Optional[int] = None) -> np.ndarray:
    """A permutation sorting by group, then value; ties of both in any order (medians do not see it).
    Group ids that fit 16 bits (dense ids, slots) take a value sort then a stable radix sort by
    group, 2-5x faster than lexsort's two merge sorts."""
    if _fit_uint16(groups, group_count):
        by_value = np.argsort(values)
        return by_value[np.argsort(groups[by_value].astype(np.uint16), kind="stable")]
    return np.lexsort((values, groups))


def _equal_groups(groups: np.ndarray, group_count: Optional[int] = None):
    """(distinct groups ascending, a permutation sorting rows by group) when every group has as
    many rows (a window where every rank has every step) and the ids fit 16 bits; else None. Then
    each group's values are one row of a matrix, sorted row by row: about twice as fast as one
    sort of them all."""
    return cached_structure("equal", groups, lambda: _equal_groups_of(groups, group_count) or (), group_count) or None


def _equal_groups_of(groups: np.ndarray, group_count: Optional[int]):
    if groups.dtype.kind not in "iu" or not _fit_uint16(groups, group_count):
        return None
    counts = np.bincount(groups)
    present = counts.nonzero()[0]
    sizes = counts[present]
    if sizes.min() != sizes.max():
        return None
    return present, np.argsort(groups.astype(np.uint16), kind="stable")
