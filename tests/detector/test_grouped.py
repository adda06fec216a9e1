"""grouped.dense_groups gives np.unique's distinct ids and indices on every path: ids counted into a
table, ids whose sparse prefixes are numbered first (`stride`), and the sort for the rest."""
from __future__ import annotations

import numpy as np
import pytest

from otel_straggler.detector import grouped


def _unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    distinct, index = np.unique(ids, return_inverse=True)
    return distinct, index.reshape(-1)


def _batch_cells(cohorts: int, codes_per_cohort: int, slots: int, steps: int, seed: int) -> np.ndarray:
    """(code * slots + slot) * steps + step of a batch of cohorts, each using its even codes 2..18
    of codes_per_cohort and 8 of its `slots`: the sparse ids of window_entries' cells."""
    rng = np.random.default_rng(seed)
    codes = [cohort * codes_per_cohort + own for cohort in range(cohorts) for own in range(2, 20, 2)]
    ids = np.array([(code * slots + slot) * steps + step for code in codes for slot in range(8)
                    for step in range(steps)], dtype=np.int64)
    return ids[rng.permutation(ids.size)]


@pytest.mark.parametrize("cohorts", [1, 3, 64])
def test_sparse_prefixes_are_numbered_with_the_same_result(cohorts):
    ids = _batch_cells(cohorts, codes_per_cohort=32, slots=16, steps=10, seed=cohorts)
    stride = 16 * 10
    expected = _unique(ids)
    if cohorts == 64:  # too sparse for the plain table: the prefix path is the one taken
        assert ids.max() - ids.min() + 1 > grouped.DENSE_SPAN_FACTOR * ids.size + grouped.DENSE_SPAN_SLACK
        assert grouped._counted_by_prefix(ids, stride, int(ids.min()), int(ids.max())) is not None
    for found in (grouped._dense_groups(ids, stride), grouped._dense_groups(ids, None)):
        assert found[0].dtype == expected[0].dtype
        np.testing.assert_array_equal(found[0], expected[0])
        np.testing.assert_array_equal(found[1], expected[1])


def test_random_ids_on_every_path_match_np_unique():
    rng = np.random.default_rng(7)
    paths = set()
    for _ in range(400):
        stride = int(rng.integers(1, 400))
        used = rng.choice(np.arange(int(rng.integers(0, 40)), 3000), size=int(rng.integers(1, 60)), replace=False)
        size = int(rng.integers(1, 4000))
        remainder_top = stride if rng.random() < 0.5 else max(1, stride // 4)
        ids = (rng.choice(used, size) * stride + rng.integers(0, remainder_top, size)).astype(np.int64)
        low, high = int(ids.min()), int(ids.max())
        if high - low + 1 <= grouped.DENSE_SPAN_FACTOR * size + grouped.DENSE_SPAN_SLACK:
            paths.add("table")
        elif grouped._counted_by_prefix(ids, stride, low, high) is not None:
            paths.add("prefix")
        else:
            paths.add("sort")
        found, expected = grouped._dense_groups(ids, stride), _unique(ids)
        np.testing.assert_array_equal(found[0], expected[0])
        np.testing.assert_array_equal(found[1], expected[1])
    assert paths == {"table", "prefix", "sort"}


def test_negative_ids_take_the_sort():
    ids = np.array([-5, 1 << 40, -5, 3], dtype=np.int64)
    found, expected = grouped._dense_groups(ids, 7), _unique(ids)
    np.testing.assert_array_equal(found[0], expected[0])
    np.testing.assert_array_equal(found[1], expected[1])


def test_prefixes_spread_too_wide_take_the_sort_without_a_table_of_them():
    ids = np.array([0, 3, (1 << 60) + 5], dtype=np.int64)
    assert grouped._counted_by_prefix(ids, 8, 0, int(ids.max())) is None
    found, expected = grouped._dense_groups(ids, 8), _unique(ids)
    np.testing.assert_array_equal(found[0], expected[0])
    np.testing.assert_array_equal(found[1], expected[1])
