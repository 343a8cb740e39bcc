"""Process groups for tensor parallelism.

Every group numbers its collectives (``sequence``), so that a mismatch between ranks can be
detected; every rank must issue a group's collectives in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.device.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from tandem.collectives.errors import (
        CollectiveAborted,
        CollectiveError,
        CollectiveMismatch,
        CollectiveTimeout,
    )
    from tandem.collectives.inprocess import (
        InProcessCommunicator,
        InProcessGroup,
        create_inprocess_groups,
    )
    from tandem.collectives.process_group import ProcessGroup, ReduceOp
    from tandem.collectives.single import SingleRankGroup
    from tandem.collectives.torch_distributed import (
        Rendezvous,
        TorchDistributedGroup,
        init_distributed,
    )
    from tandem.collectives.two_level import TwoLevelGroup

# Each public name and the module that defines it, imported on first use so that importing
# one submodule does not load the others (see tandem.device.lazy_exports).
_EXPORTS = {
    "CollectiveAborted": "tandem.collectives.errors",
    "CollectiveError": "tandem.collectives.errors",
    "CollectiveMismatch": "tandem.collectives.errors",
    "CollectiveTimeout": "tandem.collectives.errors",
    "InProcessCommunicator": "tandem.collectives.inprocess",
    "InProcessGroup": "tandem.collectives.inprocess",
    "ProcessGroup": "tandem.collectives.process_group",
    "ReduceOp": "tandem.collectives.process_group",
    "Rendezvous": "tandem.collectives.torch_distributed",
    "SingleRankGroup": "tandem.collectives.single",
    "TorchDistributedGroup": "tandem.collectives.torch_distributed",
    "TwoLevelGroup": "tandem.collectives.two_level",
    "create_inprocess_groups": "tandem.collectives.inprocess",
    "init_distributed": "tandem.collectives.torch_distributed",
}

__all__ = [
    "CollectiveAborted",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "InProcessCommunicator",
    "InProcessGroup",
    "ProcessGroup",
    "ReduceOp",
    "Rendezvous",
    "SingleRankGroup",
    "TorchDistributedGroup",
    "TwoLevelGroup",
    "create_inprocess_groups",
    "init_distributed",
]

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
