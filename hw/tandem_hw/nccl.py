"""NCCL through ctypes, the CUDA twin of ``hccl.py``: the same shape, the prototypes and enum
values of ``nccl.h`` (NVIDIA/nccl ``src/nccl.h.in``, v2.20.5-1; unchanged on master @ 5067397c);
``hw/tests/test_prototypes.py`` checks them, against installed headers where ``NCCL_INCLUDE``
names them."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import torch

from tandem.collectives import ReduceOp
from tandem_hw.comm_library import CheckedLibrary
from tandem_hw.ctypes_library import CFunction, LibraryNotFound

logger = logging.getLogger(__name__)

ncclResult_t = ctypes.c_int
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p

NCCL_UNIQUE_ID_BYTES = 128


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


# ncclDataType_t values.
DATA_TYPES: Mapping[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.uint32: 3,
    torch.int64: 4,
    torch.uint64: 5,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}

# ncclRedOp_t values (ncclProd = 1, ncclMin = 3, ncclAvg = 4 are not used by the engine).
REDUCE_OPS: Mapping[ReduceOp, int] = {ReduceOp.SUM: 0, ReduceOp.MAX: 2}

_COLLECTIVE_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ncclDataType_t)

FUNCTIONS = (
    # const char *ncclGetErrorString(ncclResult_t result);
    CFunction("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    # ncclResult_t ncclGetVersion(int *version);
    CFunction("ncclGetVersion", ncclResult_t, (ctypes.POINTER(ctypes.c_int),)),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
    CFunction("ncclGetUniqueId", ncclResult_t, (ctypes.POINTER(NcclUniqueId),)),
    # ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
    # (the id is passed by value: 128 bytes on the stack)
    CFunction(
        "ncclCommInitRank",
        ncclResult_t,
        (ctypes.POINTER(ncclComm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int),
    ),
    # ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist);
    CFunction(
        "ncclCommInitAll",
        ncclResult_t,
        (ctypes.POINTER(ncclComm_t), ctypes.c_int, ctypes.POINTER(ctypes.c_int)),
    ),
    # ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    CFunction(
        "ncclAllReduce", ncclResult_t, (*_COLLECTIVE_ARGS, ncclRedOp_t, ncclComm_t, cudaStream_t)
    ),
    # ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
    #     ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
    CFunction("ncclAllGather", ncclResult_t, (*_COLLECTIVE_ARGS, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    CFunction(
        "ncclReduceScatter",
        ncclResult_t,
        (*_COLLECTIVE_ARGS, ncclRedOp_t, ncclComm_t, cudaStream_t),
    ),
    # ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
    #     ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    CFunction(
        "ncclBroadcast", ncclResult_t, (*_COLLECTIVE_ARGS, ctypes.c_int, ncclComm_t, cudaStream_t)
    ),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    CFunction("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    CFunction("ncclCommAbort", ncclResult_t, (ncclComm_t,)),
)


def find_nccl_library(env: Mapping[str, str] | None = None) -> Path | str:
    """NCCL_SO_PATH, then the nvidia-nccl wheel torch depends on, then the loader's search."""
    env = os.environ if env is None else env
    explicit = env.get("NCCL_SO_PATH")
    if explicit:
        if not Path(explicit).is_file():
            raise LibraryNotFound(f"NCCL_SO_PATH={explicit} is not a file")
        return Path(explicit)
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "lib" / "libnccl.so.2"
            if candidate.is_file():
                return candidate
    found = ctypes.util.find_library("nccl")
    if found:
        return found
    raise LibraryNotFound(
        "libnccl.so not found (no NCCL_SO_PATH, no nvidia-nccl wheel, nothing on the loader's "
        "path); install NCCL or point NCCL_SO_PATH at libnccl.so.2"
    )


class NcclLibrary(CheckedLibrary):
    name = "nccl"
    has_barrier = False
    error_function = "ncclGetErrorString"
    symbols: ClassVar[Mapping[str, str]] = {
        "all_reduce": "ncclAllReduce",
        "all_gather": "ncclAllGather",
        "reduce_scatter": "ncclReduceScatter",
        "destroy": "ncclCommDestroy",
    }
    data_types = DATA_TYPES
    reduce_ops = REDUCE_OPS

    def __init__(self, path: Path | str | None = None) -> None:
        super().__init__(path if path is not None else find_nccl_library(), FUNCTIONS)
        logger.info("NCCL %s from %s", self.version(), self.path)

    def version(self) -> int:
        value = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(value))
        return value.value

    def init_all(self, devices: Sequence[int]) -> list[int]:
        ids = (ctypes.c_int * len(devices))(*devices)
        comms = (ncclComm_t * len(devices))()
        self._call("ncclCommInitAll", comms, len(devices), ids)
        return [int(c or 0) for c in comms]

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)

    def init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(
                f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}"
            )
        comm = ncclComm_t()
        # By value: ctypes copies the 128 bytes onto the stack as the C ABI wants.
        uid = NcclUniqueId.from_buffer_copy(unique_id)
        self._call("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        return int(comm.value or 0)

    def broadcast(
        self, buf: int, count: int, dtype: torch.dtype, root: int, comm: int, stream: int
    ) -> None:
        self._call("ncclBroadcast", buf, buf, count, self._dtype(dtype), root, comm, stream)

    def barrier(self, comm: int, stream: int) -> None:
        raise NotImplementedError("NCCL has no barrier; the group reduces one element instead")

    def abort(self, comm: int) -> bool:
        self._call("ncclCommAbort", comm)
        return True
