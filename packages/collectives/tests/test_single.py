import pytest
import torch

from tandem.collectives import ProcessGroup, ReduceOp, SingleRankGroup


def test_single_rank_group_is_identity_and_counts() -> None:
    group: ProcessGroup = SingleRankGroup()
    x = torch.arange(6.0).reshape(2, 3)
    assert group.all_reduce(x, ReduceOp.MAX) is x
    assert torch.equal(group.all_gather(x, dim=1), x)
    assert torch.equal(group.reduce_scatter(x), x)
    assert torch.equal(group.broadcast(x, root=0), x)
    group.barrier()
    assert (group.rank, group.size, group.sequence) == (0, 1, 5)


def test_single_rank_group_rejects_foreign_root() -> None:
    with pytest.raises(ValueError, match="out of range"):
        SingleRankGroup().broadcast(torch.zeros(1), root=1)
