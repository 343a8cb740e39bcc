"""HCCL through ctypes: the function table, the enums, and where libhccl.so is found.

Prototypes and enum values are those of ``hccl.h`` / ``hccl_types.h`` as vendored by the
Ascend PyTorch repository (``third_party/hccl/inc/hccl``; both as of commit 9df03631, April
2026); ``hw/tests/test_prototypes.py`` holds an independent transcription and compares a CANN
install's own headers where ``ASCEND_HOME_PATH`` names one.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import torch

from tandem.collectives import ReduceOp
from tandem_hw.comm_library import CheckedLibrary
from tandem_hw.ctypes_library import CFunction, LibraryNotFound, bind_library

logger = logging.getLogger(__name__)

HcclResult = ctypes.c_int
HcclDataType = ctypes.c_int
HcclReduceOp = ctypes.c_int
HcclComm = ctypes.c_void_p
aclrtStream = ctypes.c_void_p

HCCL_ROOT_INFO_BYTES = 4108


class HcclRootInfo(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * HCCL_ROOT_INFO_BYTES)]


# HcclDataType values.
DATA_TYPES: Mapping[torch.dtype, int] = {
    torch.int8: 0,
    torch.int16: 1,
    torch.int32: 2,
    torch.float16: 3,
    torch.float32: 4,
    torch.int64: 5,
    torch.uint64: 6,
    torch.uint8: 7,
    torch.uint16: 8,
    torch.uint32: 9,
    torch.float64: 10,
    torch.bfloat16: 11,
}

# HcclReduceOp values (PROD = 1, MIN = 3 are not used by the engine).
REDUCE_OPS: Mapping[ReduceOp, int] = {ReduceOp.SUM: 0, ReduceOp.MAX: 2}

FUNCTIONS = (
    # const char *HcclGetErrorString(HcclResult code);
    CFunction("HcclGetErrorString", ctypes.c_char_p, (HcclResult,)),
    # HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
    CFunction("HcclGetRootInfo", HcclResult, (ctypes.POINTER(HcclRootInfo),)),
    # HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo,
    #                                 uint32_t rank, HcclComm *comm);
    CFunction(
        "HcclCommInitRootInfo",
        HcclResult,
        (ctypes.c_uint32, ctypes.POINTER(HcclRootInfo), ctypes.c_uint32, ctypes.POINTER(HcclComm)),
    ),
    # HcclResult HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms);
    CFunction(
        "HcclCommInitAll",
        HcclResult,
        (ctypes.c_uint32, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(HcclComm)),
    ),
    # HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count,
    #     HcclDataType dataType, HcclReduceOp op, HcclComm comm, aclrtStream stream);
    CFunction(
        "HcclAllReduce",
        HcclResult,
        (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            HcclDataType,
            HcclReduceOp,
            HcclComm,
            aclrtStream,
        ),
    ),
    # HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount,
    #     HcclDataType dataType, HcclComm comm, aclrtStream stream);
    CFunction(
        "HcclAllGather",
        HcclResult,
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, HcclDataType, HcclComm, aclrtStream),
    ),
    # HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount,
    #     HcclDataType dataType, HcclReduceOp op, HcclComm comm, aclrtStream stream);
    CFunction(
        "HcclReduceScatter",
        HcclResult,
        (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            HcclDataType,
            HcclReduceOp,
            HcclComm,
            aclrtStream,
        ),
    ),
    # HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType,
    #     uint32_t root, HcclComm comm, aclrtStream stream);
    CFunction(
        "HcclBroadcast",
        HcclResult,
        (ctypes.c_void_p, ctypes.c_uint64, HcclDataType, ctypes.c_uint32, HcclComm, aclrtStream),
    ),
    # HcclResult HcclBarrier(HcclComm comm, aclrtStream stream);
    CFunction("HcclBarrier", HcclResult, (HcclComm, aclrtStream)),
    # HcclResult HcclCommDestroy(HcclComm comm);
    CFunction("HcclCommDestroy", HcclResult, (HcclComm,)),
)

# The stand-in's copy of acl_rt.h's  aclError aclrtSetDevice(int32_t deviceId);
_STANDIN_ACL = (CFunction("aclrtSetDevice", ctypes.c_int, (ctypes.c_int32,)),)

# Where CANN puts libhccl.so, relative to its install root.
_CANN_LIB = Path("lib64") / "libhccl.so"
# Default install roots when set_env.sh was not sourced: CANN 8.5 and later install to
# /usr/local/Ascend/cann, earlier releases to /usr/local/Ascend/ascend-toolkit/latest.
DEFAULT_CANN_ROOTS = (
    Path("/usr/local/Ascend/cann"),
    Path("/usr/local/Ascend/ascend-toolkit/latest"),
)


def find_hccl_library(env: Mapping[str, str] | None = None) -> Path:
    """HCCL_SO_PATH, then the CANN install: ASCEND_HOME_PATH (set by set_env.sh),
    ASCEND_TOOLKIT_HOME, then the default roots of new and old releases."""
    env = os.environ if env is None else env
    explicit = env.get("HCCL_SO_PATH")
    if explicit:
        if not Path(explicit).is_file():
            raise LibraryNotFound(f"HCCL_SO_PATH={explicit} is not a file")
        return Path(explicit)
    roots = [
        env.get("ASCEND_HOME_PATH"),
        env.get("ASCEND_TOOLKIT_HOME"),
        *(str(root) for root in DEFAULT_CANN_ROOTS),
    ]
    tried = []
    for root in roots:
        if not root:
            continue
        candidate = Path(root) / _CANN_LIB
        tried.append(str(candidate))
        if candidate.is_file():
            return candidate
    raise LibraryNotFound(
        "libhccl.so not found (tried " + ", ".join(tried) + "); install CANN and source its "
        "set_env.sh (sets ASCEND_HOME_PATH), or point HCCL_SO_PATH at libhccl.so"
    )


class HcclLibrary(CheckedLibrary):
    name = "hccl"
    has_barrier = True
    error_function = "HcclGetErrorString"
    symbols: ClassVar[Mapping[str, str]] = {
        "all_reduce": "HcclAllReduce",
        "all_gather": "HcclAllGather",
        "reduce_scatter": "HcclReduceScatter",
        "destroy": "HcclCommDestroy",
    }
    data_types = DATA_TYPES
    reduce_ops = REDUCE_OPS

    def __init__(self, path: Path | str | None = None) -> None:
        super().__init__(path if path is not None else find_hccl_library(), FUNCTIONS)
        logger.info("HCCL from %s%s", self.path, " (CPU stand-in)" if self.is_standin else "")
        if self.is_standin:
            # HCCL reads the calling thread's device back from the ACL runtime; on host
            # devices nothing but the stand-in's own aclrtSetDevice can set it.
            acl = bind_library(self.path, "acl", _STANDIN_ACL)

            def set_device(index: int) -> None:
                code = int(acl["aclrtSetDevice"](index))
                if code != 0:
                    raise RuntimeError(f"aclrtSetDevice({index}) failed with {code}")

            self.host_set_device = set_device

    def init_all(self, devices: Sequence[int]) -> list[int]:
        ids = (ctypes.c_int32 * len(devices))(*devices)
        comms = (HcclComm * len(devices))()
        self._call("HcclCommInitAll", len(devices), ids, comms)
        return [int(c or 0) for c in comms]

    def unique_id(self) -> bytes:
        info = HcclRootInfo()
        self._call("HcclGetRootInfo", ctypes.byref(info))
        return ctypes.string_at(ctypes.addressof(info), HCCL_ROOT_INFO_BYTES)

    def init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        if len(unique_id) != HCCL_ROOT_INFO_BYTES:
            raise ValueError(
                f"HCCL root info is {HCCL_ROOT_INFO_BYTES} bytes, got {len(unique_id)}"
            )
        info = HcclRootInfo.from_buffer_copy(unique_id)
        comm = HcclComm()
        self._call("HcclCommInitRootInfo", nranks, ctypes.byref(info), rank, ctypes.byref(comm))
        return int(comm.value or 0)

    def broadcast(
        self, buf: int, count: int, dtype: torch.dtype, root: int, comm: int, stream: int
    ) -> None:
        self._call("HcclBroadcast", buf, count, self._dtype(dtype), root, comm, stream)

    def barrier(self, comm: int, stream: int) -> None:
        self._call("HcclBarrier", comm, stream)

    def abort(self, comm: int) -> bool:
        # HCCL has no abort: a blocked rank returns when HCCL_EXEC_TIMEOUT expires.
        return False
