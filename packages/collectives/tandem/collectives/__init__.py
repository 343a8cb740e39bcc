"""Process groups for tensor parallelism.

Every group numbers its collectives (``sequence``), so that a mismatch between ranks can be
detected; every rank must issue a group's collectives in the same order.
"""

from tandem.collectives.process_group import ProcessGroup, ReduceOp
from tandem.collectives.single import SingleRankGroup

__all__ = ["ProcessGroup", "ReduceOp", "SingleRankGroup"]
