/*
 * A stand-in for libhccl.so and libnccl.so on CPU, so the ctypes bindings of tandem_hw run in CI.
 *
 * It exports the same C symbols with the same ABI (argument types, enum values, the 4108-byte
 * HcclRootInfo, the 128-byte ncclUniqueId passed by value) and implements the collectives over
 * host memory: among the threads of one process (HcclCommInitAll / ncclCommInitAll) and among
 * processes of one machine (root info / unique id naming a POSIX shared-memory segment).
 * Streams are opaque handles; the last one each communicator saw is kept so tests can check
 * which stream a call went out on. Reductions run in rank order, so results are deterministic.
 * Every wait has a deadline (TANDEM_STANDIN_TIMEOUT_S, default 60 s): a missing rank fails the
 * call, it never hangs.
 *
 * The rules it enforces are the libraries' own, transcribed from their headers, documentation
 * and (HCCL) open source, never from the bindings it serves:
 *
 *   HCCL  hccl.h / hccl_types.h as vendored by Ascend/pytorch (third_party/hccl/inc/hccl,
 *         as of commit 9df03631); CANN 8.5 HCCL API reference (HcclAllReduce,
 *         HcclReduceScatter, HcclAllGather, HcclBroadcast, HcclCommInitAll, HcclCommDestroy);
 *         CANN HCCL open source (2024) op_base.cc: argument checks, HcclGetErrorString.
 *   ACL   acl_base.h error codes; aclrtSetDevice sets the calling thread's device.
 *   NCCL  nccl.h(.in) of NVIDIA/nccl 2.20 (ncclNumTypes = 10), src/init.cc ncclGetErrorString.
 *
 * What it adds for tests only (TandemStandin*): the stream, device and rank each communicator
 * recorded, how many communicators are alive, how many HCCL calls are in flight per device.
 * Its own diagnostics go to stderr; the libraries' error strings stay the libraries'.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define STANDIN_VERSION 2
#define MAX_RANKS 16
#define MAX_DEVICES 64
#define NAME_BYTES 64
#define MAGIC "TNDMSTND"

/* ---- the shared clique: header, then one data slot per rank ---- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t nranks;      /* 0 until the first rank joins */
    int32_t joined;
    int32_t attached;    /* communicators still using this mapping (in-process cliques) */
    int32_t arrived;
    uint32_t generation;
    int32_t broken;      /* a rank timed out or aborted: every later call fails */
    uint64_t slot_bytes;
} header_t;

typedef struct {
    header_t *h;
    size_t map_bytes;
    int shared_mapping;  /* 1: one mapping for all comms of this process (InitAll) */
    int rank;
    int nranks;
    int device;
    int aborted;
    uintptr_t last_stream;
} comm_t;

typedef struct {
    char magic[8];
    char name[NAME_BYTES];
} unique_id_t;

/* Outcomes of the shared code; each API maps them to its own result codes. */
enum { ST_OK = 0, ST_PARA, ST_PTR, ST_MEMORY, ST_INTERNAL, ST_NOT_SUPPORT, ST_TIMEOUT, ST_SYSCALL,
       ST_RUNTIME };

static int live_comms = 0;

static uint64_t slot_bytes_from_env(void) {
    const char *text = getenv("TANDEM_STANDIN_SLOT_BYTES");
    uint64_t value = text ? strtoull(text, NULL, 10) : 0;
    return value ? value : (64ull << 20);
}

static int timeout_s(void) {
    const char *text = getenv("TANDEM_STANDIN_TIMEOUT_S");
    int value = text ? atoi(text) : 0;
    return value > 0 ? value : 60;
}

static size_t mapping_bytes(uint64_t slot_bytes, int nranks) {
    return sizeof(header_t) + 64 + slot_bytes * (uint64_t)nranks;
}

static char *slot(header_t *h, int rank) {
    return (char *)h + sizeof(header_t) + 64 + h->slot_bytes * (uint64_t)rank;
}

static void init_header(header_t *h, uint64_t slot_bytes) {
    pthread_mutexattr_t ma;
    pthread_condattr_t ca;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&h->mu, &ma);
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    /* Deadlines on the monotonic clock: a step of the wall clock (an NTP correction, a VM
       resumed) between reading the time and waiting must neither expire a wait at once nor
       stretch it by the step. */
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->cv, &ca);
    h->nranks = 0;
    h->joined = 0;
    h->attached = 0;
    h->arrived = 0;
    h->generation = 0;
    h->broken = 0;
    h->slot_bytes = slot_bytes;
}

static int barrier(header_t *h, int n) {
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_s();
    pthread_mutex_lock(&h->mu);
    if (h->broken) {
        pthread_mutex_unlock(&h->mu);
        return ST_TIMEOUT;
    }
    uint32_t generation = h->generation;
    if (++h->arrived == n) {
        h->arrived = 0;
        h->generation++;
        pthread_cond_broadcast(&h->cv);
    } else {
        while (generation == h->generation && !h->broken) {
            /* The last rank can arrive as the wait expires: the barrier is complete then, and
               breaking the clique would fail every later call on it. */
            if (pthread_cond_timedwait(&h->cv, &h->mu, &deadline) == ETIMEDOUT &&
                generation == h->generation) {
                h->broken = 1;
                pthread_cond_broadcast(&h->cv);
            }
        }
    }
    int broken = h->broken && generation == h->generation;
    pthread_mutex_unlock(&h->mu);
    return broken ? ST_TIMEOUT : ST_OK;
}

/* ---- element arithmetic ---- */

typedef enum { T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, T_F16, T_BF16, T_F32,
               T_F64 } ctype_t;
typedef enum { OP_SUM, OP_PROD, OP_MAX, OP_MIN } op_t;

/* IEEE binary16 <-> binary32, round to nearest even: what torch's c10::Half does, so a
   half-precision sum here rounds exactly like ``a += b`` on a torch tensor. */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {
            int shift = -1;
            do {
                shift++;
                mant <<= 1;
            } while (!(mant & 0x400u));
            bits = sign | ((uint32_t)(112 - shift) << 23) | ((mant & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t mant = x & 0x7fffffu;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    /* A carry out of the mantissa rolls into the exponent, up to infinity: still correct. */
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
    return (uint16_t)(sign | half);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static float apply_f(float a, float b, op_t op) {
    switch (op) {
    case OP_SUM: return a + b;
    case OP_PROD: return a * b;
    case OP_MAX: return b > a ? b : a;
    default: return b < a ? b : a;
    }
}

/* Integers wrap like the device's two's-complement adders (U is the unsigned twin of T, so
   overflow is defined in C). */
#define REDUCE_INT(T, U)                                                      \
    do {                                                                      \
        T *d = (T *)dst;                                                      \
        const T *s = (const T *)src;                                          \
        for (uint64_t i = 0; i < count; i++) {                                \
            switch (op) {                                                     \
            case OP_SUM: d[i] = (T)((U)d[i] + (U)s[i]); break;                \
            case OP_PROD: d[i] = (T)((U)d[i] * (U)s[i]); break;               \
            case OP_MAX: d[i] = s[i] > d[i] ? s[i] : d[i]; break;             \
            default: d[i] = s[i] < d[i] ? s[i] : d[i]; break;                 \
            }                                                                 \
        }                                                                     \
    } while (0)

#define REDUCE_FLOAT(T)                                                       \
    do {                                                                      \
        T *d = (T *)dst;                                                      \
        const T *s = (const T *)src;                                          \
        for (uint64_t i = 0; i < count; i++) {                                \
            switch (op) {                                                     \
            case OP_SUM: d[i] = d[i] + s[i]; break;                           \
            case OP_PROD: d[i] = d[i] * s[i]; break;                          \
            case OP_MAX: d[i] = s[i] > d[i] ? s[i] : d[i]; break;             \
            default: d[i] = s[i] < d[i] ? s[i] : d[i]; break;                 \
            }                                                                 \
        }                                                                     \
    } while (0)

#define REDUCE_HALF(TO_F, FROM_F)                                             \
    do {                                                                      \
        uint16_t *d = (uint16_t *)dst;                                        \
        const uint16_t *s = (const uint16_t *)src;                            \
        for (uint64_t i = 0; i < count; i++)                                  \
            d[i] = FROM_F(apply_f(TO_F(d[i]), TO_F(s[i]), op));               \
    } while (0)

static void reduce_into(void *dst, const void *src, uint64_t count, ctype_t type, op_t op) {
    switch (type) {
    case T_I8: REDUCE_INT(int8_t, uint8_t); break;
    case T_U8: REDUCE_INT(uint8_t, uint8_t); break;
    case T_I16: REDUCE_INT(int16_t, uint16_t); break;
    case T_U16: REDUCE_INT(uint16_t, uint16_t); break;
    case T_I32: REDUCE_INT(int32_t, uint32_t); break;
    case T_U32: REDUCE_INT(uint32_t, uint32_t); break;
    case T_I64: REDUCE_INT(int64_t, uint64_t); break;
    case T_U64: REDUCE_INT(uint64_t, uint64_t); break;
    case T_F16: REDUCE_HALF(f16_to_f32, f32_to_f16); break;
    case T_BF16: REDUCE_HALF(bf16_to_f32, f32_to_bf16); break;
    case T_F32: REDUCE_FLOAT(float); break;
    case T_F64: REDUCE_FLOAT(double); break;
    }
}

static size_t elem_size(ctype_t type) {
    switch (type) {
    case T_I8: case T_U8: return 1;
    case T_I16: case T_U16: case T_F16: case T_BF16: return 2;
    case T_I32: case T_U32: case T_F32: return 4;
    default: return 8;
    }
}

/* ---- the four collectives, shared by both APIs (arguments already checked) ---- */

typedef enum { K_ALL_REDUCE, K_ALL_GATHER, K_REDUCE_SCATTER, K_BROADCAST, K_BARRIER } kind_t;

static int collective(comm_t *c, kind_t kind, const void *send, void *recv, uint64_t count,
                      ctype_t type, op_t op, int root, uintptr_t stream) {
    c->last_stream = stream;
    header_t *h = c->h;
    int n = c->nranks;
    if (kind == K_BARRIER) return barrier(h, n);
    uint64_t bytes = count * elem_size(type);
    uint64_t posted = kind == K_REDUCE_SCATTER ? bytes * (uint64_t)n : bytes;
    if (posted > h->slot_bytes) {
        fprintf(stderr, "tandem stand-in: %llu bytes exceed the %llu-byte slot "
                "(TANDEM_STANDIN_SLOT_BYTES)\n", (unsigned long long)posted,
                (unsigned long long)h->slot_bytes);
        return ST_MEMORY;
    }
    if (kind != K_BROADCAST || c->rank == root) memcpy(slot(h, c->rank), send, posted);
    int rc = barrier(h, n);
    if (rc != ST_OK) return rc;
    switch (kind) {
    case K_ALL_REDUCE:
        memcpy(recv, slot(h, 0), bytes);
        for (int r = 1; r < n; r++) reduce_into(recv, slot(h, r), count, type, op);
        break;
    case K_REDUCE_SCATTER:
        memcpy(recv, slot(h, 0) + bytes * (uint64_t)c->rank, bytes);
        for (int r = 1; r < n; r++)
            reduce_into(recv, slot(h, r) + bytes * (uint64_t)c->rank, count, type, op);
        break;
    case K_ALL_GATHER:
        for (int r = 0; r < n; r++) memcpy((char *)recv + bytes * (uint64_t)r, slot(h, r), bytes);
        break;
    case K_BROADCAST:
        memcpy(recv, slot(h, root), bytes);
        break;
    default:
        break;
    }
    /* Nobody posts the next collective's data before every rank has read this one's. */
    return barrier(h, n);
}

/* ---- communicator creation ---- */

static comm_t *new_comm(header_t *h, size_t bytes, int shared, int rank, int nranks, int device) {
    comm_t *c = calloc(1, sizeof(comm_t));
    if (c == NULL) return NULL;
    c->h = h;
    c->map_bytes = bytes;
    c->shared_mapping = shared;
    c->rank = rank;
    c->nranks = nranks;
    c->device = device;
    __atomic_add_fetch(&live_comms, 1, __ATOMIC_SEQ_CST);
    return c;
}

static int init_all(int ndev, const int32_t *devices, comm_t **out) {
    if (ndev <= 0 || ndev > MAX_RANKS) return ST_PARA;
    if (out == NULL || devices == NULL) return ST_PTR;
    for (int i = 0; i < ndev; i++) {
        if (devices[i] < 0 || devices[i] >= MAX_DEVICES) return ST_PARA;
        for (int j = 0; j < i; j++)
            if (devices[i] == devices[j]) return ST_PARA;
    }
    uint64_t slot_bytes = slot_bytes_from_env();
    size_t bytes = mapping_bytes(slot_bytes, ndev);
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return ST_MEMORY;
    header_t *h = (header_t *)map;
    init_header(h, slot_bytes);
    h->nranks = ndev;
    h->joined = ndev;
    h->attached = ndev;
    for (int i = 0; i < ndev; i++) out[i] = new_comm(h, bytes, 1, i, ndev, devices[i]);
    return ST_OK;
}

static unsigned long long id_counter = 0;

static int new_unique_id(unique_id_t *id) {
    if (id == NULL) return ST_PTR;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    memset(id, 0, sizeof(*id));
    memcpy(id->magic, MAGIC, 8);
    snprintf(id->name, NAME_BYTES, "/tandem-standin-%d-%llu-%ld", (int)getpid(),
             __atomic_add_fetch(&id_counter, 1, __ATOMIC_SEQ_CST), (long)now.tv_nsec);
    uint64_t slot_bytes = slot_bytes_from_env();
    int fd = shm_open(id->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return ST_SYSCALL;
    size_t bytes = mapping_bytes(slot_bytes, MAX_RANKS);
    /* Sparse: pages cost memory only once a rank writes its slot. */
    if (ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        shm_unlink(id->name);
        return ST_SYSCALL;
    }
    void *map = mmap(NULL, sizeof(header_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        shm_unlink(id->name);
        return ST_MEMORY;
    }
    init_header((header_t *)map, slot_bytes);
    munmap(map, sizeof(header_t));
    return ST_OK;
}

static int init_rank(int nranks, const unique_id_t *id, int rank, int device, comm_t **out) {
    if (out == NULL || id == NULL) return ST_PTR;
    if (memcmp(id->magic, MAGIC, 8) != 0) return ST_PARA;
    if (nranks <= 0 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) {
        /* The clique can never form: do not leave its segment behind. */
        shm_unlink(id->name);
        return ST_PARA;
    }
    int fd = shm_open(id->name, O_RDWR, 0600);
    if (fd < 0) return ST_SYSCALL;
    size_t bytes = mapping_bytes(slot_bytes_from_env(), MAX_RANKS);
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return ST_MEMORY;
    header_t *h = (header_t *)map;
    pthread_mutex_lock(&h->mu);
    int ok = h->nranks == 0 || h->nranks == nranks;
    if (ok) {
        h->nranks = nranks;
        h->joined++;
    }
    pthread_mutex_unlock(&h->mu);
    if (!ok) {
        munmap(map, bytes);
        return ST_PARA;
    }
    int rc = barrier(h, nranks);
    if (rank == 0 || rc != ST_OK) shm_unlink(id->name);
    if (rc != ST_OK) {
        munmap(map, bytes);
        return rc;
    }
    *out = new_comm(h, bytes, 0, rank, nranks, device);
    return ST_OK;
}

static int destroy(comm_t *c) {
    if (c->shared_mapping) {
        pthread_mutex_lock(&c->h->mu);
        int last = --c->h->attached == 0;
        pthread_mutex_unlock(&c->h->mu);
        if (last) munmap(c->h, c->map_bytes);
    } else {
        munmap(c->h, c->map_bytes);
    }
    if (!c->aborted) __atomic_sub_fetch(&live_comms, 1, __ATOMIC_SEQ_CST);
    free(c);
    return ST_OK;
}

/* An aborted communicator is gone as far as its owner is concerned (ncclCommAbort "frees
   resources associated with communicator object"), so it stops counting as alive. */
static void abort_comm(comm_t *c) {
    pthread_mutex_lock(&c->h->mu);
    c->h->broken = 1;
    pthread_cond_broadcast(&c->h->cv);
    pthread_mutex_unlock(&c->h->mu);
    if (!__atomic_exchange_n(&c->aborted, 1, __ATOMIC_SEQ_CST))
        __atomic_sub_fetch(&live_comms, 1, __ATOMIC_SEQ_CST);
}

/* ================================ ACL ================================ */

/* The runtime's per-thread device: aclrtSetDevice "sets the compute device in the calling
   thread" (CANN aclrtSetDevice reference), and torch.npu.set_device reaches it. The stand-in
   exports the two calls HCCL relies on, so whatever binds a host thread to a device the way
   torch_npu binds it to an NPU is visible here. Codes from acl_base.h. */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_RT_INVALID_DEVICEID 107001
#define ACL_ERROR_RT_CONTEXT_NULL 107002

static __thread int32_t thread_device = -1;

int aclrtSetDevice(int32_t deviceId) {
    if (deviceId < 0 || deviceId >= MAX_DEVICES) return ACL_ERROR_RT_INVALID_DEVICEID;
    thread_device = deviceId;
    return ACL_SUCCESS;
}

int aclrtGetDevice(int32_t *deviceId) {
    if (deviceId == NULL) return ACL_ERROR_INVALID_PARAM;
    if (thread_device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    *deviceId = thread_device;
    return ACL_SUCCESS;
}

/* ---- helpers only the stand-in has: tests read what the binding passed ---- */

static int hccl_in_flight[MAX_DEVICES];

int TandemStandinVersion(void) { return STANDIN_VERSION; }
uintptr_t TandemStandinLastStream(void *comm) { return comm ? ((comm_t *)comm)->last_stream : 0; }
int TandemStandinCommDevice(void *comm) { return comm ? ((comm_t *)comm)->device : -1; }
int TandemStandinCommRank(void *comm) { return comm ? ((comm_t *)comm)->rank : -1; }
int TandemStandinLiveComms(void) { return __atomic_load_n(&live_comms, __ATOMIC_SEQ_CST); }
int TandemStandinInFlight(int device) {
    if (device < 0 || device >= MAX_DEVICES) return -1;
    return __atomic_load_n(&hccl_in_flight[device], __ATOMIC_SEQ_CST);
}

/* With TANDEM_STANDIN_REPORT_LEAKS set, a process that exits with communicators alive says so:
   the end-to-end tests read it to see that shutdown destroyed every one. */
__attribute__((destructor)) static void report_leaks(void) {
    int live = TandemStandinLiveComms();
    if (live > 0 && getenv("TANDEM_STANDIN_REPORT_LEAKS"))
        fprintf(stderr, "tandem stand-in: %d communicator(s) never destroyed\n", live);
}

/* ================================ HCCL ================================ */

typedef void *HcclComm;
typedef void *aclrtStream;
typedef struct { char internal[4108]; } HcclRootInfo;

/* HcclResult values, hccl_types.h. */
enum { HCCL_SUCCESS = 0, HCCL_E_PARA = 1, HCCL_E_PTR = 2, HCCL_E_MEMORY = 3, HCCL_E_INTERNAL = 4,
       HCCL_E_NOT_SUPPORT = 5, HCCL_E_NOT_FOUND = 6, HCCL_E_UNAVAIL = 7, HCCL_E_SYSCALL = 8,
       HCCL_E_TIMEOUT = 9, HCCL_E_OPEN_FILE_FAILURE = 10, HCCL_E_TCP_CONNECT = 11,
       HCCL_E_ROCE_CONNECT = 12, HCCL_E_TCP_TRANSFER = 13, HCCL_E_ROCE_TRANSFER = 14,
       HCCL_E_RUNTIME = 15, HCCL_E_DRV = 16, HCCL_E_PROFILING = 17, HCCL_E_CCE = 18,
       HCCL_E_NETWORK = 19, HCCL_E_AGAIN = 20, HCCL_E_REMOTE = 21 };

static int hccl_result(int r) {
    static const int table[] = {HCCL_SUCCESS, HCCL_E_PARA, HCCL_E_PTR, HCCL_E_MEMORY,
                                HCCL_E_INTERNAL, HCCL_E_NOT_SUPPORT, HCCL_E_TIMEOUT,
                                HCCL_E_SYSCALL, HCCL_E_RUNTIME};
    return table[r];
}

/* The support matrix, in one place: HcclDataType value -> element, and which operations take
   it on Atlas A2 / A3 (CANN 8.5 HCCL API reference):
     HcclAllReduce, HcclReduceScatter: int8, int16, int32, int64, float16, float32, bfp16;
       "prod" does not support int16 or bfp16.
     HcclAllGather, HcclBroadcast: int8, uint8, int16, uint16, int32, uint32, int64, uint64,
       float16, float32, float64, bfp16.
   Values past BFP16 (INT128, HIF8, FP8*) are in newer headers but in none of these lists. */
typedef struct {
    ctype_t type;
    int reduce;    /* HcclAllReduce / HcclReduceScatter take it */
    int prod;      /* ... with HCCL_REDUCE_PROD too */
} hccl_type_row;

static const hccl_type_row HCCL_TYPES[] = {
    /* INT8   0 */ {T_I8, 1, 1},
    /* INT16  1 */ {T_I16, 1, 0},
    /* INT32  2 */ {T_I32, 1, 1},
    /* FP16   3 */ {T_F16, 1, 1},
    /* FP32   4 */ {T_F32, 1, 1},
    /* INT64  5 */ {T_I64, 1, 1},
    /* UINT64 6 */ {T_U64, 0, 0},
    /* UINT8  7 */ {T_U8, 0, 0},
    /* UINT16 8 */ {T_U16, 0, 0},
    /* UINT32 9 */ {T_U32, 0, 0},
    /* FP64  10 */ {T_F64, 0, 0},
    /* BFP16 11 */ {T_BF16, 1, 0},
};
#define HCCL_TYPE_COUNT ((int)(sizeof(HCCL_TYPES) / sizeof(HCCL_TYPES[0])))

/* HCCL reads the calling thread's device (hrtGetDeviceRefresh -> aclrtGetDevice) and fails
   with HCCL_E_RUNTIME without one, first thing, before any argument check, in these entry
   points of CANN HCCL's open-source op_base.cc (2024, zhuxy-USTC/HCCL mirror, commit
   3a845e5c): HcclGetRootInfo, HcclCommInitAll, HcclCommInitRootInfo (through its Inner),
   HcclAllReduce, HcclAllGather, HcclReduceScatter, HcclBroadcast, HcclBarrier and
   HcclCommDestroy; the API reference's samples call aclrtSetDevice on each thread before any
   of them (CANN "HcclCommInitRootInfo initialization" sample). HcclGetErrorString does not.
   The stand-in checks the same calls at the same point. The device itself is only read, never
   compared with the communicator's, as op_base.cc does. */
static int hccl_thread_device(const char *function) {
    int32_t device;
    if (aclrtGetDevice(&device) != ACL_SUCCESS) {
        fprintf(stderr, "tandem stand-in: %s: [Get][DeviceRefresh] rtGet device fail, please "
                "make sure that device is set. return[%d]\n", function,
                ACL_ERROR_RT_CONTEXT_NULL);
        return -1;
    }
    return device;
}

/* "One device cannot call multiple collective operation APIs at a time" (CANN HcclCommInitAll
   constraints). The real library does not report it; the stand-in fails the second call. */
static int hccl_enter(comm_t *c, const char *function) {
    if (__atomic_add_fetch(&hccl_in_flight[c->device], 1, __ATOMIC_SEQ_CST) > 1) {
        __atomic_sub_fetch(&hccl_in_flight[c->device], 1, __ATOMIC_SEQ_CST);
        fprintf(stderr, "tandem stand-in: %s on device %d while another collective call is in "
                "flight there (CANN: one device cannot call multiple collective operation APIs "
                "at a time)\n", function, c->device);
        return 0;
    }
    return 1;
}

static void hccl_leave(comm_t *c) {
    __atomic_sub_fetch(&hccl_in_flight[c->device], 1, __ATOMIC_SEQ_CST);
}

/* The checks of op_base.cc, in its order: the calling thread's device; count 0 succeeds at once; null comm or buffer;
   data type (HcomCheckDataType); null stream; reduction op (HcomCheckReductionOp); data type
   for the op (the support matrix); root inside the clique (HcomCheckUserRank). */
static int hccl_call(const char *function, kind_t kind, void *send, void *recv, uint64_t count,
                     int data_type, int op, uint32_t root, HcclComm comm, aclrtStream stream) {
    if (hccl_thread_device(function) < 0) return HCCL_E_RUNTIME;
    if (count == 0 && kind != K_BARRIER) return HCCL_SUCCESS;
    comm_t *c = comm;
    if (c == NULL) return HCCL_E_PTR;
    if (kind != K_BARRIER && (send == NULL || recv == NULL)) return HCCL_E_PTR;
    if (data_type < 0 || data_type >= HCCL_TYPE_COUNT) return HCCL_E_NOT_SUPPORT;
    if (stream == NULL) return HCCL_E_PTR;
    const hccl_type_row *row = &HCCL_TYPES[data_type];
    if (kind == K_ALL_REDUCE || kind == K_REDUCE_SCATTER) {
        if (op < 0 || op > 3) return HCCL_E_NOT_SUPPORT;
        if (!row->reduce || (op == 1 && !row->prod)) return HCCL_E_NOT_SUPPORT;
    }
    if (kind == K_BROADCAST && root >= (uint32_t)c->nranks) return HCCL_E_PARA;
    if (!hccl_enter(c, function)) return HCCL_E_INTERNAL;
    int rc = collective(c, kind, send, recv, count, row->type, (op_t)(op & 3), (int)root,
                        (uintptr_t)stream);
    hccl_leave(c);
    return hccl_result(rc);
}

/* HcclGetErrorString of op_base.cc: its strings, "unknow error" past the table. */
const char *HcclGetErrorString(int code) {
    static const char *const strings[] = {
        "no error", "parameter error", "empty pointer", "memory error", "internal error",
        "not support feature", "not found specific resource", "resource unavailable",
        "call system interface error", "timeout", "open file fail", "tcp connect fail",
        "roce connect fail", "tcp transfer fail", "roce transfer fail", "call runtime api fail",
        "call driver api fail", "call profiling api fail", "call cce api fail",
        "call network api fail", "try again", "error cqe"};
    if (code < 0 || code >= (int)(sizeof(strings) / sizeof(strings[0]))) return "unknow error";
    return strings[code];
}

int HcclGetRootInfo(HcclRootInfo *rootInfo) {
    if (hccl_thread_device("HcclGetRootInfo") < 0) return HCCL_E_RUNTIME;
    return hccl_result(new_unique_id((unique_id_t *)rootInfo));
}

/* The communicator lives on the calling thread's device, as the real one does. */
int HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                         HcclComm *comm) {
    if (rootInfo == NULL) return HCCL_E_PTR;
    int device = hccl_thread_device("HcclCommInitRootInfo");
    if (device < 0) return HCCL_E_RUNTIME;
    if (nRanks == 0 || rank >= nRanks) return HCCL_E_PARA;
    return hccl_result(init_rank((int)nRanks, (const unique_id_t *)rootInfo, (int)rank, device,
                                 (comm_t **)comm));
}

int HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms) {
    if (hccl_thread_device("HcclCommInitAll") < 0) return HCCL_E_RUNTIME;
    if (ndev == 0) return HCCL_E_PARA;
    if (comms == NULL || devices == NULL) return HCCL_E_PTR;
    return hccl_result(init_all((int)ndev, devices, (comm_t **)comms));
}

int HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, int dataType, int op,
                  HcclComm comm, aclrtStream stream) {
    return hccl_call("HcclAllReduce", K_ALL_REDUCE, sendBuf, recvBuf, count, dataType, op, 0,
                     comm, stream);
}

int HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, int dataType, HcclComm comm,
                  aclrtStream stream) {
    return hccl_call("HcclAllGather", K_ALL_GATHER, sendBuf, recvBuf, sendCount, dataType, 0, 0,
                     comm, stream);
}

int HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, int dataType, int op,
                      HcclComm comm, aclrtStream stream) {
    return hccl_call("HcclReduceScatter", K_REDUCE_SCATTER, sendBuf, recvBuf, recvCount, dataType,
                     op, 0, comm, stream);
}

int HcclBroadcast(void *buf, uint64_t count, int dataType, uint32_t root, HcclComm comm,
                  aclrtStream stream) {
    return hccl_call("HcclBroadcast", K_BROADCAST, buf, buf, count, dataType, 0, root, comm,
                     stream);
}

int HcclBarrier(HcclComm comm, aclrtStream stream) {
    return hccl_call("HcclBarrier", K_BARRIER, NULL, NULL, 0, 4, 0, 0, comm, stream);
}

/* Needs a device on the calling thread like every entry point; a null comm is skipped with
   success (op_base.cc: "An empty comm given, skip destroy."). */
int HcclCommDestroy(HcclComm comm) {
    if (hccl_thread_device("HcclCommDestroy") < 0) return HCCL_E_RUNTIME;
    if (comm == NULL) return HCCL_SUCCESS;
    return hccl_result(destroy(comm));
}

/* ================================ NCCL ================================ */

typedef void *ncclComm_t;
typedef void *cudaStream_t;
typedef struct { char internal[128]; } ncclUniqueId;

/* ncclResult_t values, nccl.h. */
enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
       ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7 };

static int nccl_result(int r) {
    static const int table[] = {ncclSuccess, ncclInvalidArgument, ncclInvalidArgument,
                                ncclSystemError, ncclInternalError, ncclInvalidUsage,
                                ncclRemoteError, ncclSystemError, ncclUnhandledCudaError};
    return table[r];
}

/* ncclDataType_t Int8 0 .. Bfloat16 9: every reduction takes every type. ncclAvg (4),
   user-built ops and the fp8 types of NCCL >= 2.24 are not modelled. */
static const ctype_t NCCL_TYPES[] = {T_I8, T_U8, T_I32, T_U32, T_I64, T_U64, T_F16, T_F32,
                                     T_F64, T_BF16};
#define NCCL_TYPE_COUNT ((int)(sizeof(NCCL_TYPES) / sizeof(NCCL_TYPES[0])))

/* A null stream is CUDA's legacy default stream, which NCCL takes. */
static int nccl_call(kind_t kind, const void *send, void *recv, size_t count, int data_type,
                     int op, int root, ncclComm_t comm, cudaStream_t stream) {
    comm_t *c = comm;
    if (c == NULL) return ncclInvalidArgument;
    if (data_type < 0 || data_type >= NCCL_TYPE_COUNT) return ncclInvalidArgument;
    if ((kind == K_ALL_REDUCE || kind == K_REDUCE_SCATTER) && (op < 0 || op > 3))
        return ncclInvalidArgument;
    if (kind == K_BROADCAST && (root < 0 || root >= c->nranks)) return ncclInvalidArgument;
    if (count > 0 && (send == NULL || recv == NULL)) return ncclInvalidArgument;
    return nccl_result(collective(c, kind, send, recv, count, NCCL_TYPES[data_type], (op_t)(op & 3),
                                  root, (uintptr_t)stream));
}

/* ncclGetErrorString of NCCL 2.20 src/init.cc. */
const char *ncclGetErrorString(int result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

int ncclGetVersion(int *version) {
    if (version == NULL) return ncclInvalidArgument;
    *version = 22000 + STANDIN_VERSION;
    return ncclSuccess;
}

int ncclGetUniqueId(ncclUniqueId *uniqueId) {
    return nccl_result(new_unique_id((unique_id_t *)uniqueId));
}

int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    return nccl_result(init_rank(nranks, (const unique_id_t *)&commId, rank, rank,
                                 (comm_t **)comm));
}

int ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    if (ndev <= 0) return ncclInvalidArgument;
    int32_t first[MAX_RANKS];
    /* "If devlist is NULL, the first ndev CUDA devices are used." */
    if (devlist == NULL) {
        if (ndev > MAX_RANKS) return ncclInvalidArgument;
        for (int i = 0; i < ndev; i++) first[i] = i;
        devlist = first;
    }
    return nccl_result(init_all(ndev, devlist, (comm_t **)comms));
}

int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                  ncclComm_t comm, cudaStream_t stream) {
    return nccl_call(K_ALL_REDUCE, sendbuff, recvbuff, count, datatype, op, 0, comm, stream);
}

int ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype,
                  ncclComm_t comm, cudaStream_t stream) {
    return nccl_call(K_ALL_GATHER, sendbuff, recvbuff, sendcount, datatype, 0, 0, comm, stream);
}

int ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, int datatype,
                      int op, ncclComm_t comm, cudaStream_t stream) {
    return nccl_call(K_REDUCE_SCATTER, sendbuff, recvbuff, recvcount, datatype, op, 0, comm,
                     stream);
}

int ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root,
                  ncclComm_t comm, cudaStream_t stream) {
    return nccl_call(K_BROADCAST, sendbuff, recvbuff, count, datatype, 0, root, comm, stream);
}

/* "if (comm == NULL) return ncclSuccess;" (src/init.cc). */
int ncclCommDestroy(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    return nccl_result(destroy(comm));
}

/* Releases every rank blocked in this clique. The memory stays mapped: another thread may
   still be inside a call on this communicator, and the stand-in would rather leak a few bytes
   than read freed memory. */
int ncclCommAbort(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    abort_comm(comm);
    return ncclSuccess;
}
