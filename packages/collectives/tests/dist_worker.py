"""A torch.distributed rank for the tests: ``python dist_worker.py MODE RANK WORLD PORT``.

MODE flat: the world is one TorchDistributedGroup. MODE two-level: each process is a node
running LOCAL threads (argv[5]); node leaders form the torch.distributed world.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch.distributed

sys.path.insert(0, str(Path(__file__).parent))

from collective_checks import run_checks

from tandem.collectives import (
    Rendezvous,
    TorchDistributedGroup,
    TwoLevelGroup,
    create_inprocess_groups,
    init_distributed,
)


def main() -> None:
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    init_distributed(Rendezvous("127.0.0.1", port, world, rank), backend="gloo", timeout_s=60)
    inter = TorchDistributedGroup("gloo")
    if mode == "flat":
        run_checks(inter)
    else:
        local_size = int(sys.argv[5])
        locals_ = create_inprocess_groups(local_size, timeout_s=60)
        errors: list[BaseException] = []

        def rank_thread(local_rank: int) -> None:
            try:
                group = TwoLevelGroup(
                    locals_[local_rank], inter if local_rank == 0 else None, rank, world
                )
                run_checks(group)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)
                locals_[0].communicator.abort(str(exc))

        threads = [threading.Thread(target=rank_thread, args=(i,)) for i in range(local_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    # Tear the world down explicitly: gloo aborts if left to interpreter exit.
    inter.barrier()
    torch.distributed.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
