"""The same collective checks for every group kind; run by the tests in threads or processes.

Every rank r contributes tensors derived from r; each check compares with the value a flat
group of ``size`` ranks must produce. Not a test module itself (no test_ prefix).
"""

from __future__ import annotations

import torch

from tandem.collectives import ProcessGroup, ReduceOp


def contribution(rank: int, shape: tuple[int, ...] = (4, 6)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g)


def run_checks(group: ProcessGroup, rounds: int = 5) -> None:
    rank, size = group.rank, group.size
    everyone = [contribution(r) for r in range(size)]
    for _ in range(rounds):
        x = contribution(rank)
        group.all_reduce(x)
        assert torch.allclose(x, sum(everyone[1:], everyone[0].clone()), atol=1e-6), "sum"

        x = contribution(rank)
        group.all_reduce(x, ReduceOp.MAX)
        assert torch.equal(x, torch.stack(everyone).amax(0)), "max"

        gathered = group.all_gather(contribution(rank), dim=1)
        assert torch.equal(gathered, torch.cat(everyone, dim=1)), "all_gather"

        big = torch.cat([contribution(rank)] * size, dim=0)
        mine = group.reduce_scatter(big)
        total = sum(
            (torch.cat([e] * size, 0) for e in everyone[1:]), torch.cat([everyone[0]] * size, 0)
        )
        assert torch.allclose(mine, total.chunk(size, 0)[rank], atol=1e-6), "reduce_scatter"

        for root in range(size):
            x = contribution(rank)
            group.broadcast(x, root=root)
            assert torch.equal(x, everyone[root]), "broadcast"
        group.barrier()
