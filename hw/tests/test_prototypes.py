"""The bound prototypes, enum values and struct sizes against the C headers.

``EXPECTED`` is transcribed here from the headers, not from the binding:

HCCL: ``hccl.h`` and ``hccl_types.h`` as vendored by Ascend/pytorch under
``third_party/hccl/inc/hccl/`` (both as of commit 9df03631, April 2026); ``aclrtStream`` is
``typedef void *aclrtStream`` (acl_base.h). NCCL: ``src/nccl.h.in`` of NVIDIA/nccl (v2.20.5-1
and master @ 5067397c agree on every prototype and value bound here). Each C type is then
described by what the ABI sees (integer width and signedness, pointer, pointee, struct size;
LP64 Linux), and so is each ctypes type of the binding: a ``c_int`` where the header says
``uint32_t``, or a ``c_uint32`` where it says ``size_t``, fails.

Where a CANN install (``ASCEND_HOME_PATH``) or NCCL headers (``NCCL_INCLUDE``) are present, the
installed header is parsed and compared too.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem_hw import hccl, nccl
from tandem_hw.ctypes_library import CFunction

from tandem.collectives import ReduceOp

# function -> (return type, parameter types), as written in the header.
EXPECTED: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "hccl": {
        "HcclGetErrorString": ("const char *", ("HcclResult",)),
        "HcclGetRootInfo": ("HcclResult", ("HcclRootInfo *",)),
        "HcclCommInitRootInfo": (
            "HcclResult",
            ("uint32_t", "const HcclRootInfo *", "uint32_t", "HcclComm *"),
        ),
        "HcclCommInitAll": ("HcclResult", ("uint32_t", "int32_t *", "HcclComm *")),
        "HcclAllReduce": (
            "HcclResult",
            (
                "void *",
                "void *",
                "uint64_t",
                "HcclDataType",
                "HcclReduceOp",
                "HcclComm",
                "aclrtStream",
            ),
        ),
        "HcclAllGather": (
            "HcclResult",
            ("void *", "void *", "uint64_t", "HcclDataType", "HcclComm", "aclrtStream"),
        ),
        "HcclReduceScatter": (
            "HcclResult",
            (
                "void *",
                "void *",
                "uint64_t",
                "HcclDataType",
                "HcclReduceOp",
                "HcclComm",
                "aclrtStream",
            ),
        ),
        "HcclBroadcast": (
            "HcclResult",
            ("void *", "uint64_t", "HcclDataType", "uint32_t", "HcclComm", "aclrtStream"),
        ),
        "HcclBarrier": ("HcclResult", ("HcclComm", "aclrtStream")),
        "HcclCommDestroy": ("HcclResult", ("HcclComm",)),
    },
    "nccl": {
        "ncclGetErrorString": ("const char *", ("ncclResult_t",)),
        "ncclGetVersion": ("ncclResult_t", ("int *",)),
        "ncclGetUniqueId": ("ncclResult_t", ("ncclUniqueId *",)),
        "ncclCommInitRank": ("ncclResult_t", ("ncclComm_t *", "int", "ncclUniqueId", "int")),
        "ncclCommInitAll": ("ncclResult_t", ("ncclComm_t *", "int", "const int *")),
        "ncclAllReduce": (
            "ncclResult_t",
            (
                "const void *",
                "void *",
                "size_t",
                "ncclDataType_t",
                "ncclRedOp_t",
                "ncclComm_t",
                "cudaStream_t",
            ),
        ),
        "ncclAllGather": (
            "ncclResult_t",
            ("const void *", "void *", "size_t", "ncclDataType_t", "ncclComm_t", "cudaStream_t"),
        ),
        "ncclReduceScatter": (
            "ncclResult_t",
            (
                "const void *",
                "void *",
                "size_t",
                "ncclDataType_t",
                "ncclRedOp_t",
                "ncclComm_t",
                "cudaStream_t",
            ),
        ),
        "ncclBroadcast": (
            "ncclResult_t",
            (
                "const void *",
                "void *",
                "size_t",
                "ncclDataType_t",
                "int",
                "ncclComm_t",
                "cudaStream_t",
            ),
        ),
        "ncclCommDestroy": ("ncclResult_t", ("ncclComm_t",)),
        "ncclCommAbort": ("ncclResult_t", ("ncclComm_t",)),
    },
}

# Enum values of hccl_types.h / nccl.h, and the torch dtype each one carries.
HCCL_DATA_TYPE = {
    "HCCL_DATA_TYPE_INT8": 0,
    "HCCL_DATA_TYPE_INT16": 1,
    "HCCL_DATA_TYPE_INT32": 2,
    "HCCL_DATA_TYPE_FP16": 3,
    "HCCL_DATA_TYPE_FP32": 4,
    "HCCL_DATA_TYPE_INT64": 5,
    "HCCL_DATA_TYPE_UINT64": 6,
    "HCCL_DATA_TYPE_UINT8": 7,
    "HCCL_DATA_TYPE_UINT16": 8,
    "HCCL_DATA_TYPE_UINT32": 9,
    "HCCL_DATA_TYPE_FP64": 10,
    "HCCL_DATA_TYPE_BFP16": 11,
}
HCCL_REDUCE_OP = {
    "HCCL_REDUCE_SUM": 0,
    "HCCL_REDUCE_PROD": 1,
    "HCCL_REDUCE_MAX": 2,
    "HCCL_REDUCE_MIN": 3,
}
NCCL_DATA_TYPE = {
    "ncclInt8": 0,
    "ncclUint8": 1,
    "ncclInt32": 2,
    "ncclUint32": 3,
    "ncclInt64": 4,
    "ncclUint64": 5,
    "ncclFloat16": 6,
    "ncclFloat32": 7,
    "ncclFloat64": 8,
    "ncclBfloat16": 9,
}
NCCL_RED_OP = {"ncclSum": 0, "ncclProd": 1, "ncclMax": 2, "ncclMin": 3, "ncclAvg": 4}
TORCH_NAMES: dict[str, dict[torch.dtype, str]] = {
    "hccl": {
        torch.int8: "HCCL_DATA_TYPE_INT8",
        torch.int16: "HCCL_DATA_TYPE_INT16",
        torch.int32: "HCCL_DATA_TYPE_INT32",
        torch.float16: "HCCL_DATA_TYPE_FP16",
        torch.float32: "HCCL_DATA_TYPE_FP32",
        torch.int64: "HCCL_DATA_TYPE_INT64",
        torch.uint64: "HCCL_DATA_TYPE_UINT64",
        torch.uint8: "HCCL_DATA_TYPE_UINT8",
        torch.uint16: "HCCL_DATA_TYPE_UINT16",
        torch.uint32: "HCCL_DATA_TYPE_UINT32",
        torch.float64: "HCCL_DATA_TYPE_FP64",
        torch.bfloat16: "HCCL_DATA_TYPE_BFP16",
    },
    "nccl": {
        torch.int8: "ncclInt8",
        torch.uint8: "ncclUint8",
        torch.int32: "ncclInt32",
        torch.uint32: "ncclUint32",
        torch.int64: "ncclInt64",
        torch.uint64: "ncclUint64",
        torch.float16: "ncclFloat16",
        torch.float32: "ncclFloat32",
        torch.float64: "ncclFloat64",
        torch.bfloat16: "ncclBfloat16",
    },
}
OP_NAMES = {
    "hccl": {ReduceOp.SUM: "HCCL_REDUCE_SUM", ReduceOp.MAX: "HCCL_REDUCE_MAX"},
    "nccl": {ReduceOp.SUM: "ncclSum", ReduceOp.MAX: "ncclMax"},
}
ENUMS = {"hccl": (HCCL_DATA_TYPE, HCCL_REDUCE_OP), "nccl": (NCCL_DATA_TYPE, NCCL_RED_OP)}
STRUCT_BYTES = {"HcclRootInfo": 4108, "ncclUniqueId": 128}

# What the ABI sees of each named C type on LP64 Linux.
Shape = tuple[Any, ...]
INT = {"int": 4, "int32_t": 4, "uint32_t": 4, "uint64_t": 8, "size_t": 8}
UNSIGNED = {"uint32_t", "uint64_t", "size_t"}
# Enums: int-compatible and signed (every enumerator fits in int).
ENUM_TYPES = {
    "HcclResult",
    "HcclDataType",
    "HcclReduceOp",
    "ncclResult_t",
    "ncclDataType_t",
    "ncclRedOp_t",
}
# typedef void *HcclComm; typedef void *aclrtStream; typedef struct ncclComm *ncclComm_t;
# typedef struct CUstream_st *cudaStream_t.
OPAQUE_POINTERS = {"HcclComm", "aclrtStream", "ncclComm_t", "cudaStream_t"}


def c_shape(text: str) -> Shape:
    text = " ".join(text.replace("const", " ").replace("*", " * ").split())
    if text == "char *":
        return ("string",)
    if text == "void *":
        return ("pointer",)
    if text.endswith(" *"):
        return ("pointer to", c_shape(text[:-2]))
    if text in INT:
        return ("int", INT[text], text not in UNSIGNED)
    if text in ENUM_TYPES:
        return ("int", 4, True)
    if text in OPAQUE_POINTERS:
        return ("pointer",)
    if text in STRUCT_BYTES:
        return ("struct", STRUCT_BYTES[text])
    raise KeyError(f"no ABI description for C type {text!r}")


def ctypes_shape(kind: Any) -> Shape:
    if kind is ctypes.c_char_p:
        return ("string",)
    if kind is ctypes.c_void_p:
        return ("pointer",)
    if isinstance(kind, type) and issubclass(kind, ctypes._Pointer):
        return ("pointer to", ctypes_shape(kind._type_))
    if isinstance(kind, type) and issubclass(kind, ctypes.Structure):
        return ("struct", ctypes.sizeof(kind))
    signed = kind(-1).value < 0
    return ("int", ctypes.sizeof(kind), signed)


def _bound(name: str) -> dict[str, CFunction]:
    functions = hccl.FUNCTIONS if name == "hccl" else nccl.FUNCTIONS
    return {fn.name: fn for fn in functions}


@pytest.mark.parametrize("name", ["hccl", "nccl"])
def test_bound_prototypes_match_the_headers(name: str) -> None:
    bound = _bound(name)
    assert set(bound) == set(EXPECTED[name])
    for function, (restype, params) in EXPECTED[name].items():
        fn = bound[function]
        assert len(fn.argtypes) == len(params), f"{function}: argument count"
        assert ctypes_shape(fn.restype) == c_shape(restype), f"{function}: return type"
        for index, (kind, param) in enumerate(zip(fn.argtypes, params, strict=True)):
            assert ctypes_shape(kind) == c_shape(param), (
                f"{function} argument {index}: bound as {kind.__name__}, header says {param}"
            )


def test_structs_have_the_header_sizes() -> None:
    assert ctypes.sizeof(hccl.HcclRootInfo) == 4108 == hccl.HCCL_ROOT_INFO_BYTES
    assert ctypes.sizeof(nccl.NcclUniqueId) == 128 == nccl.NCCL_UNIQUE_ID_BYTES


@pytest.mark.parametrize("name", ["hccl", "nccl"])
def test_enum_values_match_the_headers(name: str) -> None:
    module: Any = hccl if name == "hccl" else nccl
    data_types, ops = ENUMS[name]
    assert {d: data_types[n] for d, n in TORCH_NAMES[name].items()} == dict(module.DATA_TYPES)
    assert {op: ops[n] for op, n in OP_NAMES[name].items()} == dict(module.REDUCE_OPS)


# ---- the installed headers, where there are some ----


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def parse_prototype(header: str, function: str) -> tuple[str, tuple[str, ...]]:
    """(return type, parameter types) of ``function`` in C source, names dropped."""
    text = _strip_comments(header)
    found = re.search(
        rf"(?:^|[;}}\n])\s*(?:extern\s+)?([A-Za-z_][\w\s\*]*?)\s*(?<![\w]){function}\s*"
        rf"\(([^)]*)\)\s*;",
        text,
    )
    if found is None:
        raise LookupError(f"{function} is not declared")
    params = []
    for param in found.group(2).split(","):
        param = " ".join(param.replace("*", " * ").split())
        if param in ("", "void"):
            continue
        words = param.split(" ")
        # Drop the parameter's name: the last word, unless the type is all there is.
        if len(words) > 1 and re.fullmatch(r"[A-Za-z_]\w*", words[-1]):
            words = words[:-1]
        params.append(" ".join(words))
    return " ".join(found.group(1).replace("*", " * ").split()), tuple(params)


def parse_enum(header: str, name: str) -> dict[str, int]:
    text = _strip_comments(header)
    block = re.search(rf"typedef\s+enum\s*\w*\s*\{{(.*?)\}}\s*{name}\s*;", text, flags=re.S)
    if block is None:
        raise LookupError(f"enum {name} is not declared")
    return {
        key: int(value, 0)
        for key, value in re.findall(r"(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))", block.group(1))
    }


def _same(a: str, b: str) -> bool:
    return c_shape(a) == c_shape(b)


def _compare_with_header(name: str, header: str, enums: dict[str, dict[str, int]]) -> None:
    for function, (restype, params) in EXPECTED[name].items():
        found_restype, found_params = parse_prototype(header, function)
        assert _same(found_restype, restype), f"{function}: header returns {found_restype}"
        assert len(found_params) == len(params), f"{function}: header has {found_params}"
        for index, (found, expected) in enumerate(zip(found_params, params, strict=True)):
            assert _same(found, expected), f"{function} argument {index}: header has {found}"
    for enum, values in enums.items():
        declared = parse_enum(header, enum)
        assert {k: declared[k] for k in values} == values, enum


SAMPLE_HEADER = """
/** @brief AllReduce operator. (comment with HcclAllReduce(int) inside) */
extern HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count,
    HcclDataType dataType, HcclReduceOp op, HcclComm comm, aclrtStream stream);
ncclResult_t pncclAllGather(const void* sendbuff, void* recvbuff, int sendcount);
ncclResult_t  ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
extern const char *HcclGetErrorString(HcclResult code);
typedef enum {
    HCCL_REDUCE_SUM = 0,    /**< sum */
    HCCL_REDUCE_MAX = 2,    // max
    HCCL_REDUCE_RESERVED = 255
} HcclReduceOp;
"""


def test_the_header_parser_reads_declarations_as_written() -> None:
    assert parse_prototype(SAMPLE_HEADER, "HcclAllReduce") == EXPECTED["hccl"]["HcclAllReduce"]
    assert parse_prototype(SAMPLE_HEADER, "ncclAllGather") == (
        "ncclResult_t",
        ("const void *", "void *", "size_t", "ncclDataType_t", "ncclComm_t", "cudaStream_t"),
    )
    assert parse_prototype(SAMPLE_HEADER, "HcclGetErrorString") == ("const char *", ("HcclResult",))
    assert parse_enum(SAMPLE_HEADER, "HcclReduceOp") == {
        "HCCL_REDUCE_SUM": 0,
        "HCCL_REDUCE_MAX": 2,
        "HCCL_REDUCE_RESERVED": 255,
    }
    with pytest.raises(LookupError):
        parse_prototype(SAMPLE_HEADER, "HcclBroadcast")


def _installed(env: str, *relative: str) -> list[Path]:
    root = os.environ.get(env)
    if not root:
        pytest.skip(f"{env} is not set (no installed headers to compare)")
    paths = [Path(root, *r.split("/")) for r in relative]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        pytest.skip(f"{env}={root} has no {', '.join(missing)}")
    return paths


def test_the_installed_hccl_headers_agree() -> None:
    paths = _installed("ASCEND_HOME_PATH", "include/hccl/hccl.h", "include/hccl/hccl_types.h")
    header = "\n".join(p.read_text(errors="replace") for p in paths)
    _compare_with_header(
        "hccl", header, {"HcclDataType": HCCL_DATA_TYPE, "HcclReduceOp": HCCL_REDUCE_OP}
    )
    size = re.search(r"HCCL_ROOT_INFO_BYTES\s*=\s*(\d+)", header)
    assert size is not None and int(size.group(1)) == STRUCT_BYTES["HcclRootInfo"]


def test_the_installed_nccl_header_agrees() -> None:
    (path,) = _installed("NCCL_INCLUDE", "nccl.h")
    header = path.read_text(errors="replace")
    _compare_with_header(
        "nccl", header, {"ncclDataType_t": NCCL_DATA_TYPE, "ncclRedOp_t": NCCL_RED_OP}
    )
    size = re.search(r"#define\s+NCCL_UNIQUE_ID_BYTES\s+(\d+)", header)
    assert size is not None and int(size.group(1)) == STRUCT_BYTES["ncclUniqueId"]
