"""Errors a collective raises instead of hanging."""


class CollectiveError(RuntimeError):
    """A collective could not complete."""


class CollectiveMismatch(CollectiveError):
    """Ranks issued different collectives at the same sequence number of one group."""


class CollectiveTimeout(CollectiveError):
    """Some ranks never arrived at a collective."""


class CollectiveAborted(CollectiveError):
    """The communicator was aborted (another rank failed)."""
