"""Process groups for tensor parallelism.

Every group numbers its collectives (``sequence``), so that a mismatch between ranks can be
detected; every rank must issue a group's collectives in the same order.
"""

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
