/*
 * A stand-in for libhccl.so and libnccl.so on CPU, so the ctypes bindings of tandem_hw run in CI.
 *
 * It exports the same C symbols with the same ABI (argument types, enum values, the 4108-byte
 * HcclRootInfo, the 128-byte ncclUniqueId passed by value) and implements the collectives over
 * host memory: among the threads of one process (HcclCommInitAll / ncclCommInitAll) and among
 * processes of one machine (root info / unique id naming a POSIX shared-memory segment).
 * Streams are opaque handles: a null one is refused like the real libraries refuse it, and the
 * last one each communicator saw is kept so tests can check which stream a call went out on.
 * Reductions run in rank order, so results are deterministic. Every wait has a deadline
 * (TANDEM_STANDIN_TIMEOUT_S, default 60 s): a missing rank fails the call, it never hangs.
 *
 * It keeps the ACL runtime's per-thread device (aclrtSetDevice: "sets the compute device in the
 * calling thread", CANN aclrtSetDevice reference; torch.npu.set_device reaches it on a card)
 * and refuses, as HCCL does, the entry points that read it on a thread without one (CANN HCCL
 * open source (2024) op_base.cc: hrtGetDeviceRefresh -> aclrtGetDevice -> HCCL_E_RUNTIME).
 * One HCCL collective call may be in flight per device ("One device cannot call multiple
 * collective operation APIs at a time", CANN HcclCommInitAll constraints): a second one fails.
 * For tests only (TandemStandin*): what each communicator recorded, how many are alive, how
 * many HCCL calls are in flight per device.
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
#define MAX_DEVICES 64
#define MAX_RANKS 16
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

enum { ST_OK = 0, ST_PARA, ST_PTR, ST_MEMORY, ST_INTERNAL, ST_NOT_SUPPORT, ST_TIMEOUT, ST_SYSCALL };

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
    clock_gettime(CLOCK_REALTIME, &deadline);
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
            if (pthread_cond_timedwait(&h->cv, &h->mu, &deadline) == ETIMEDOUT) {
                h->broken = 1;
                pthread_cond_broadcast(&h->cv);
            }
        }
    }
    int broken = h->broken && generation == h->generation;
    pthread_mutex_unlock(&h->mu);
    return broken ? ST_TIMEOUT : ST_OK;
}

/* ---- data types: the operations that move bytes take any type; reductions take these ---- */

typedef enum { T_I8, T_U8, T_I32, T_I64, T_F32, T_F64, T_OTHER } ctype_t;
typedef enum { OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_BAD } op_t;

#define REDUCE_LOOP(T)                                                        \
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

static void reduce_into(void *dst, const void *src, uint64_t count, ctype_t type, op_t op) {
    switch (type) {
    case T_I8: REDUCE_LOOP(int8_t); break;
    case T_U8: REDUCE_LOOP(uint8_t); break;
    case T_I32: REDUCE_LOOP(int32_t); break;
    case T_I64: REDUCE_LOOP(int64_t); break;
    case T_F32: REDUCE_LOOP(float); break;
    case T_F64: REDUCE_LOOP(double); break;
    default: break;
    }
}

/* ---- the four collectives, shared by both APIs ---- */

typedef enum { K_ALL_REDUCE, K_ALL_GATHER, K_REDUCE_SCATTER, K_BROADCAST, K_BARRIER } kind_t;

static int collective(comm_t *c, kind_t kind, const void *send, void *recv, uint64_t count,
                      size_t elem, ctype_t type, op_t op, int root, uintptr_t stream) {
    if (c == NULL || c->h == NULL) return ST_PTR;
    if (stream == 0) return ST_PARA;
    c->last_stream = stream;
    header_t *h = c->h;
    int n = c->nranks;
    if (kind == K_BARRIER) return barrier(h, n);
    if ((kind == K_ALL_REDUCE || kind == K_REDUCE_SCATTER) && (type == T_OTHER || op == OP_BAD))
        return ST_NOT_SUPPORT;
    if (kind == K_BROADCAST && (root < 0 || root >= n)) return ST_PARA;
    if (count > 0 && (send == NULL || recv == NULL)) return ST_PTR;
    uint64_t bytes = count * elem;
    uint64_t posted = kind == K_REDUCE_SCATTER ? bytes * (uint64_t)n : bytes;
    if (posted > h->slot_bytes) return ST_MEMORY;
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
    if (out == NULL) return ST_PTR;
    for (int i = 0; i < ndev; i++)
        for (int j = 0; devices && j < i; j++)
            if (devices[i] == devices[j]) return ST_PARA;
    uint64_t slot_bytes = slot_bytes_from_env();
    size_t bytes = mapping_bytes(slot_bytes, ndev);
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return ST_MEMORY;
    header_t *h = (header_t *)map;
    init_header(h, slot_bytes);
    h->nranks = ndev;
    h->joined = ndev;
    h->attached = ndev;
    for (int i = 0; i < ndev; i++) out[i] = new_comm(h, bytes, 1, i, ndev, devices ? devices[i] : i);
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
    if (c == NULL) return ST_PTR;
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
    if (c == NULL || c->h == NULL) return;
    pthread_mutex_lock(&c->h->mu);
    c->h->broken = 1;
    pthread_cond_broadcast(&c->h->cv);
    pthread_mutex_unlock(&c->h->mu);
    if (!__atomic_exchange_n(&c->aborted, 1, __ATOMIC_SEQ_CST))
        __atomic_sub_fetch(&live_comms, 1, __ATOMIC_SEQ_CST);
}

/* ================================ ACL ================================ */

/* The runtime's per-thread device, and the two calls HCCL relies on. Codes from acl_base.h. */
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

int TandemStandinVersion(void) { return STANDIN_VERSION; }
uintptr_t TandemStandinLastStream(void *comm) { return comm ? ((comm_t *)comm)->last_stream : 0; }
int TandemStandinCommDevice(void *comm) { return comm ? ((comm_t *)comm)->device : -1; }
int TandemStandinCommRank(void *comm) { return comm ? ((comm_t *)comm)->rank : -1; }
int TandemStandinLiveComms(void) { return __atomic_load_n(&live_comms, __ATOMIC_SEQ_CST); }

static int hccl_in_flight[MAX_DEVICES];

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

/* HcclResult values, as in hccl_types.h. */
enum { HCCL_SUCCESS = 0, HCCL_E_PARA = 1, HCCL_E_PTR = 2, HCCL_E_MEMORY = 3, HCCL_E_INTERNAL = 4,
       HCCL_E_NOT_SUPPORT = 5, HCCL_E_SYSCALL = 8, HCCL_E_TIMEOUT = 9, HCCL_E_RUNTIME = 15 };

/* HCCL reads the calling thread's device first in every entry point (hrtGetDeviceRefresh ->
   aclrtGetDevice, failing with HCCL_E_RUNTIME). The stand-in checks it where tandem_hw's own
   threads call: creating and destroying communicators. Collectives come from worker threads
   that the CPU runtime binds, and that runtime has no ACL underneath it to tell. */
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

static int hccl_result(int r) {
    static const int table[] = {HCCL_SUCCESS, HCCL_E_PARA, HCCL_E_PTR, HCCL_E_MEMORY,
                                HCCL_E_INTERNAL, HCCL_E_NOT_SUPPORT, HCCL_E_TIMEOUT,
                                HCCL_E_SYSCALL};
    return table[r];
}

static int hccl_type(int t, size_t *elem, ctype_t *type) {
    /* HcclDataType: INT8 0, INT16 1, INT32 2, FP16 3, FP32 4, INT64 5, UINT64 6, UINT8 7,
       UINT16 8, UINT32 9, FP64 10, BFP16 11. */
    static const size_t sizes[] = {1, 2, 4, 2, 4, 8, 8, 1, 2, 4, 8, 2};
    static const ctype_t types[] = {T_I8, T_OTHER, T_I32, T_OTHER, T_F32, T_I64,
                                    T_OTHER, T_U8, T_OTHER, T_OTHER, T_F64, T_OTHER};
    if (t < 0 || t > 11) return 0;
    *elem = sizes[t];
    *type = types[t];
    return 1;
}

static op_t hccl_op(int op) { return op >= 0 && op <= 3 ? (op_t)op : OP_BAD; }

/* The real library does not report a second call on a busy device; the stand-in fails it. */
static int hccl_collective(const char *function, HcclComm comm, kind_t kind, const void *send,
                           void *recv, uint64_t count, size_t elem, ctype_t type, op_t op,
                           int root, uintptr_t stream) {
    comm_t *c = comm;
    if (c == NULL || c->h == NULL) return HCCL_E_PTR;
    if (c->device < 0 || c->device >= MAX_DEVICES) return HCCL_E_PARA;
    if (__atomic_add_fetch(&hccl_in_flight[c->device], 1, __ATOMIC_SEQ_CST) > 1) {
        __atomic_sub_fetch(&hccl_in_flight[c->device], 1, __ATOMIC_SEQ_CST);
        fprintf(stderr, "tandem stand-in: %s on device %d while another collective call is in "
                "flight there (CANN: one device cannot call multiple collective operation APIs "
                "at a time)\n", function, c->device);
        return HCCL_E_INTERNAL;
    }
    int rc = hccl_result(collective(c, kind, send, recv, count, elem, type, op, root, stream));
    __atomic_sub_fetch(&hccl_in_flight[c->device], 1, __ATOMIC_SEQ_CST);
    return rc;
}

const char *HcclGetErrorString(int code) {
    switch (code) {
    case HCCL_SUCCESS: return "HCCL_SUCCESS: success";
    case HCCL_E_PARA: return "HCCL_E_PARA: parameter error";
    case HCCL_E_PTR: return "HCCL_E_PTR: empty pointer";
    case HCCL_E_MEMORY: return "HCCL_E_MEMORY: memory error (stand-in slot too small?)";
    case HCCL_E_INTERNAL: return "HCCL_E_INTERNAL: internal error";
    case HCCL_E_NOT_SUPPORT: return "HCCL_E_NOT_SUPPORT: not support feature";
    case HCCL_E_SYSCALL: return "HCCL_E_SYSCALL: call system interface error";
    case HCCL_E_TIMEOUT: return "HCCL_E_TIMEOUT: timeout";
    case HCCL_E_RUNTIME: return "HCCL_E_RUNTIME: call runtime api fail";
    default: return "HCCL: unknown error";
    }
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
    return hccl_result(init_rank((int)nRanks, (const unique_id_t *)rootInfo, (int)rank, device,
                                 (comm_t **)comm));
}

int HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms) {
    if (hccl_thread_device("HcclCommInitAll") < 0) return HCCL_E_RUNTIME;
    if (devices == NULL) return HCCL_E_PTR;
    return hccl_result(init_all((int)ndev, devices, (comm_t **)comms));
}

int HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, int dataType, int op,
                  HcclComm comm, aclrtStream stream) {
    size_t elem; ctype_t type;
    if (!hccl_type(dataType, &elem, &type)) return HCCL_E_PARA;
    return hccl_collective("HcclAllReduce", comm, K_ALL_REDUCE, sendBuf, recvBuf, count, elem,
                           type, hccl_op(op), 0, (uintptr_t)stream);
}

int HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, int dataType, HcclComm comm,
                  aclrtStream stream) {
    size_t elem; ctype_t type;
    if (!hccl_type(dataType, &elem, &type)) return HCCL_E_PARA;
    return hccl_collective("HcclAllGather", comm, K_ALL_GATHER, sendBuf, recvBuf, sendCount, elem,
                           type, OP_SUM, 0, (uintptr_t)stream);
}

int HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, int dataType, int op,
                      HcclComm comm, aclrtStream stream) {
    size_t elem; ctype_t type;
    if (!hccl_type(dataType, &elem, &type)) return HCCL_E_PARA;
    return hccl_collective("HcclReduceScatter", comm, K_REDUCE_SCATTER, sendBuf, recvBuf,
                           recvCount, elem, type, hccl_op(op), 0, (uintptr_t)stream);
}

int HcclBroadcast(void *buf, uint64_t count, int dataType, uint32_t root, HcclComm comm,
                  aclrtStream stream) {
    size_t elem; ctype_t type;
    if (!hccl_type(dataType, &elem, &type)) return HCCL_E_PARA;
    return hccl_collective("HcclBroadcast", comm, K_BROADCAST, buf, buf, count, elem, type,
                           OP_SUM, (int)root, (uintptr_t)stream);
}

int HcclBarrier(HcclComm comm, aclrtStream stream) {
    return hccl_collective("HcclBarrier", comm, K_BARRIER, NULL, NULL, 0, 1, T_U8, OP_SUM, 0,
                           (uintptr_t)stream);
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

/* ncclResult_t values, as in nccl.h. */
enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
       ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6 };

static int nccl_result(int r) {
    static const int table[] = {ncclSuccess, ncclInvalidArgument, ncclInvalidArgument,
                                ncclSystemError, ncclInternalError, ncclInvalidUsage,
                                ncclRemoteError, ncclSystemError};
    return table[r];
}

static int nccl_type(int t, size_t *elem, ctype_t *type) {
    /* ncclDataType_t: Int8 0, Uint8 1, Int32 2, Uint32 3, Int64 4, Uint64 5, Float16 6,
       Float32 7, Float64 8, Bfloat16 9. */
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    static const ctype_t types[] = {T_I8, T_U8, T_I32, T_OTHER, T_I64,
                                    T_OTHER, T_OTHER, T_F32, T_F64, T_OTHER};
    if (t < 0 || t > 9) return 0;
    *elem = sizes[t];
    *type = types[t];
    return 1;
}

static op_t nccl_op(int op) { return op >= 0 && op <= 3 ? (op_t)op : OP_BAD; }

const char *ncclGetErrorString(int result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error (stand-in: shm, memory or slot size)";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
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
    return nccl_result(init_all(ndev, devlist, (comm_t **)comms));
}

int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                  ncclComm_t comm, cudaStream_t stream) {
    size_t elem; ctype_t type;
    if (!nccl_type(datatype, &elem, &type)) return ncclInvalidArgument;
    return nccl_result(collective(comm, K_ALL_REDUCE, sendbuff, recvbuff, count, elem, type,
                                  nccl_op(op), 0, (uintptr_t)stream));
}

int ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype,
                  ncclComm_t comm, cudaStream_t stream) {
    size_t elem; ctype_t type;
    if (!nccl_type(datatype, &elem, &type)) return ncclInvalidArgument;
    return nccl_result(collective(comm, K_ALL_GATHER, sendbuff, recvbuff, sendcount, elem, type,
                                  OP_SUM, 0, (uintptr_t)stream));
}

int ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, int datatype,
                      int op, ncclComm_t comm, cudaStream_t stream) {
    size_t elem; ctype_t type;
    if (!nccl_type(datatype, &elem, &type)) return ncclInvalidArgument;
    return nccl_result(collective(comm, K_REDUCE_SCATTER, sendbuff, recvbuff, recvcount, elem,
                                  type, nccl_op(op), 0, (uintptr_t)stream));
}

int ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root,
                  ncclComm_t comm, cudaStream_t stream) {
    size_t elem; ctype_t type;
    if (!nccl_type(datatype, &elem, &type)) return ncclInvalidArgument;
    return nccl_result(collective(comm, K_BROADCAST, sendbuff, recvbuff, count, elem, type,
                                  OP_SUM, root, (uintptr_t)stream));
}

int ncclCommDestroy(ncclComm_t comm) { return nccl_result(destroy(comm)); }

/* Releases every rank blocked in this clique. The memory stays mapped: another thread may
   still be inside a call on this communicator, and the stand-in would rather leak a few bytes
   than read freed memory. */
int ncclCommAbort(ncclComm_t comm) {
    if (comm == NULL) return ncclInvalidArgument;
    abort_comm(comm);
    return ncclSuccess;
}
