"""The node's per-iteration statistics: named columns, packed and read back by name."""

import pytest
import torch

from skiptrain.runtime.node.stats import IterationStats


def _row(loss: float, norms: list[float], digest: int) -> IterationStats:
    s = IterationStats()
    s.add("loss_sum", loss)
    s.add("norms", torch.tensor(norms))
    s.add("ckpt_digest", digest)
    return s


def test_columns_read_back_by_name_as_a_plain_reference_would():
    rows = [_row(1.5, [1.0, 2.0, 3.0], 7), _row(2.5, [0.5, 0.0, 1.0], 9)]
    table = rows[0].table([r.packed() for r in rows], nodes=[3, 5])
    assert table.sum("loss_sum") == 4.0
    assert table["norms"].shape == (2, 3)
    assert table["norms"].sum(0).tolist() == [1.5, 2.0, 4.0]
    assert table.of_node("ckpt_digest") == {3: 7.0, 5: 9.0}
    assert table.max("ckpt_digest") == 9.0
    assert "norms" in table and "drift" not in table


def test_a_vector_column_of_width_one_stays_a_vector():
    s = IterationStats()
    s.add("v", torch.tensor([4.0]))
    s.add("x", 2.0)
    table = s.table([s.packed()], nodes=[0])
    assert table["v"].shape == (1, 1) and table["x"].shape == (1,)


def test_a_name_added_twice_is_refused():
    s = IterationStats()
    s.add("a", 1.0)
    with pytest.raises(KeyError):
        s.add("a", 2.0)
