/* A fake libnvidia-ml.so.1 for machines without a GPU: enough NVML for pynvml discovery (count,
 * handles, UUID, name, memory, PCI bus id, NUMA node, minor number, processes, versions), for
 * the GPUs' topology (P2P levels, NVLinks and their remote ends) and for health watching (XID
 * events for GPUs the configuration marks unhealthy). Memory usage and
 * process lists come from the state shared with the fake libcuda. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"
#include "hamipy/export.h"
#include "nvml_types.h"

#define NVML_ERROR_DRIVER_NOT_LOADED_ 9
#define NVML_ERROR_FUNCTION_NOT_FOUND_ 13

struct nvml_dev {
    int index;
};

static struct {
    pthread_mutex_t mu;
    int refs;
    struct fake_config cfg;
    struct fake_state *st;
    struct nvml_dev devs[FAKE_MAX_GPUS];
} N = {.mu = PTHREAD_MUTEX_INITIALIZER};

struct event_set {
    unsigned long long watched[FAKE_MAX_GPUS];
    int delivered[FAKE_MAX_GPUS];
};

static nvmlReturn_t init(void) {
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&N.mu);
    if (N.refs == 0) {
        if (fake_config_load(&N.cfg) != 0 || (N.st = fake_state_attach(&N.cfg, 0)) == NULL) {
            rc = (nvmlReturn_t)NVML_ERROR_DRIVER_NOT_LOADED_;
        } else {
            for (int i = 0; i < FAKE_MAX_GPUS; i++) N.devs[i].index = i;
        }
    }
    if (rc == NVML_SUCCESS) N.refs++;
    pthread_mutex_unlock(&N.mu);
    return rc;
}

HAMI_EXPORT nvmlReturn_t nvmlInit_v2(void) { return init(); }
HAMI_EXPORT nvmlReturn_t nvmlInit(void);
HAMI_EXPORT nvmlReturn_t nvmlInit(void) { return init(); }
HAMI_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return init();
}

HAMI_EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&N.mu);
    nvmlReturn_t rc = N.refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (N.refs > 0) N.refs--;
    pthread_mutex_unlock(&N.mu);
    return rc;
}

HAMI_EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch ((int)result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED_: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

#define REQUIRE_INIT() \
    if (N.refs == 0) return NVML_ERROR_UNINITIALIZED

/* The configured GPU behind a handle, or NULL. */
static const struct fake_gpu *gpu_of(nvmlDevice_t device, int *index) {
    const struct nvml_dev *d = (const struct nvml_dev *)device;
    if (d < N.devs || d >= N.devs + N.cfg.count) return NULL;
    if (index != NULL) *index = d->index;
    return &N.cfg.gpus[d->index];
}

#define REQUIRE_GPU(dev, idx)                                   \
    REQUIRE_INIT();                                             \
    int idx = 0;                                                \
    const struct fake_gpu *gpu = gpu_of((dev), &idx);           \
    if (gpu == NULL) return NVML_ERROR_INVALID_ARGUMENT

static nvmlReturn_t copy_string(char *out, unsigned int length, const char *text) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    REQUIRE_INIT();
    return copy_string(version, length, N.cfg.driver_version);
}

HAMI_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    REQUIRE_INIT();
    if (version == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *version = N.cfg.cuda_version;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    return nvmlSystemGetCudaDriverVersion(version);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    REQUIRE_INIT();
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned)N.cfg.count;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count);
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    REQUIRE_INIT();
    if (device == NULL || index >= (unsigned)N.cfg.count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)&N.devs[index];
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device);
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    REQUIRE_INIT();
    if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < N.cfg.count; i++) {
        if (strcmp(N.cfg.gpus[i].uuid, uuid) == 0) {
            *device = (nvmlDevice_t)&N.devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    REQUIRE_GPU(device, idx);
    if (index == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)idx;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    REQUIRE_GPU(device, idx);
    return copy_string(uuid, length, gpu->uuid);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    REQUIRE_GPU(device, idx);
    return copy_string(name, length, gpu->name);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    REQUIRE_GPU(device, idx);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t used = fake_state_used(N.st, idx);
    memory->total = gpu->memory;
    memory->used = used;
    memory->free = used < gpu->memory ? gpu->memory - used : 0;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    REQUIRE_GPU(device, idx);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t used = fake_state_used(N.st, idx);
    memory->total = gpu->memory;
    memory->reserved = 0;
    memory->used = used;
    memory->free = used < gpu->memory ? gpu->memory - used : 0;
    return NVML_SUCCESS;
}

/* The PCI info of bus id `bus` ("00000000:3B:00.0"), as NVML fills it. */
static void fill_pci(nvmlPciInfo_t *pci, const char *bus) {
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus);
    /* The legacy field holds the short form: "0000:3B:00.0" of "00000000:3B:00.0". */
    const char *shortform = strlen(bus) > 12 ? bus + strlen(bus) - 12 : bus;
    size_t n = strlen(shortform);
    memcpy(pci->busIdLegacy, shortform, n < sizeof pci->busIdLegacy ? n : sizeof pci->busIdLegacy - 1);
    unsigned domain = 0, busno = 0, dev = 0, fn = 0;
    if (sscanf(bus, "%x:%x:%x.%x", &domain, &busno, &dev, &fn) == 4) {
        pci->domain = domain;
        pci->bus = busno;
        pci->device = dev;
    }
    pci->pciDeviceId = 0x233010DE;
    pci->pciSubSystemId = 0x16C110DE;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    REQUIRE_GPU(device, idx);
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(pci, gpu->pci);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci);
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    REQUIRE_GPU(device, idx);
    if (minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned)idx;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    REQUIRE_GPU(device, idx);
    if (node == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *node = (unsigned)gpu->numa;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                     unsigned long *nodeSet, int scope) {
    (void)scope;
    REQUIRE_GPU(device, idx);
    if (nodeSet == NULL || nodeSetSize == 0) return NVML_ERROR_INVALID_ARGUMENT;
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    unsigned bits = 8 * sizeof(unsigned long);
    if (gpu->numa >= 0 && (unsigned)gpu->numa < nodeSetSize * bits)
        nodeSet[(unsigned)gpu->numa / bits] |= 1UL << ((unsigned)gpu->numa % bits);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    REQUIRE_GPU(device, idx);
    if (utilization == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = 0;
    utilization->memory = 0;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                                 nvmlProcessInfo_t *infos) {
    REQUIRE_GPU(device, idx);
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned pids[FAKE_MAX_PROCS];
    uint64_t used[FAKE_MAX_PROCS];
    unsigned n = fake_state_procs(N.st, idx, FAKE_MAX_PROCS, pids, used);
    if (infos == NULL || *count < n) {
        *count = n;
        return n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++)
        infos[i] = (nvmlProcessInfo_t){.pid = pids[i] + N.cfg.host_pid_offset, .usedGpuMemory = used[i],
                                       .gpuInstanceId = 0xFFFFFFFFu, .computeInstanceId = 0xFFFFFFFFu};
    *count = n;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                                 nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos);
}

/* ---- per-process utilization: samples of the executed GPU time (see fake.h), taken when asked */

#define SAMPLE_RING 256

static struct {
    uint64_t last_ns[FAKE_MAX_GPUS]; /* when the last sample was taken; 0 = never */
    unsigned npids[FAKE_MAX_GPUS];
    unsigned pids[FAKE_MAX_GPUS][FAKE_MAX_PROCS];
    uint64_t executed[FAKE_MAX_GPUS][FAKE_MAX_PROCS];
    nvmlProcessUtilizationSample_t ring[FAKE_MAX_GPUS][SAMPLE_RING];
    unsigned next[FAKE_MAX_GPUS], filled[FAKE_MAX_GPUS];
} U;

static unsigned long long realtime_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
}

/* Takes the samples of every period that has ended since the last one (one sample per process
 * over all of them). Caller holds N.mu. */
static void take_samples(int idx) {
    uint64_t now = fake_now_ns(), period = N.cfg.util_sample_ns;
    unsigned pids[FAKE_MAX_PROCS];
    uint64_t done[FAKE_MAX_PROCS];
    if (U.last_ns[idx] != 0 && now < U.last_ns[idx] + period) return;
    unsigned n = fake_state_executed_all(N.st, idx, FAKE_MAX_PROCS, pids, done);
    if (n > FAKE_MAX_PROCS) n = FAKE_MAX_PROCS;
    if (U.last_ns[idx] != 0) {
        unsigned long long stamp = realtime_us();
        double span = (double)(now - U.last_ns[idx]);
        for (unsigned i = 0; i < n; i++) {
            uint64_t before = 0;
            for (unsigned j = 0; j < U.npids[idx]; j++) {
                if (U.pids[idx][j] == pids[i]) before = U.executed[idx][j];
            }
            double util = (double)(done[i] > before ? done[i] - before : 0) / span * 100.0;
            nvmlProcessUtilizationSample_t *out = &U.ring[idx][U.next[idx]];
            *out = (nvmlProcessUtilizationSample_t){.pid = pids[i] + N.cfg.host_pid_offset, .timeStamp = stamp,
                                                    .smUtil = util > 100 ? 100 : (unsigned)util};
            U.next[idx] = (U.next[idx] + 1) % SAMPLE_RING;
            if (U.filled[idx] < SAMPLE_RING) U.filled[idx]++;
        }
    }
    U.last_ns[idx] = now;
    U.npids[idx] = n;
    memcpy(U.pids[idx], pids, n * sizeof pids[0]);
    memcpy(U.executed[idx], done, n * sizeof done[0]);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                         nvmlProcessUtilizationSample_t *utilization,
                                                         unsigned int *processSamplesCount,
                                                         unsigned long long lastSeenTimeStamp) {
    REQUIRE_GPU(device, idx);
    (void)gpu;
    if (processSamplesCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&N.mu);
    take_samples(idx);
    unsigned n = 0;
    for (unsigned k = 0; k < U.filled[idx]; k++) {
        if (U.ring[idx][k].timeStamp > lastSeenTimeStamp) n++;
    }
    nvmlReturn_t rc = NVML_SUCCESS;
    if (n == 0) {
        rc = NVML_ERROR_NOT_FOUND;
    } else if (utilization == NULL || *processSamplesCount < n) {
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        unsigned out = 0;
        for (unsigned k = 0; k < U.filled[idx]; k++) {
            if (U.ring[idx][k].timeStamp > lastSeenTimeStamp) utilization[out++] = U.ring[idx][k];
        }
    }
    *processSamplesCount = n;
    pthread_mutex_unlock(&N.mu);
    return rc;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending);
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    (void)current, (void)pending;
    REQUIRE_GPU(device, idx);
    return NVML_ERROR_NOT_SUPPORTED;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor);
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    REQUIRE_GPU(device, idx);
    if (major == NULL || minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *major = 9;
    *minor = 0;
    return NVML_SUCCESS;
}

/* ---- topology: P2P levels and NVLinks, as configured (fake.h) */

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                             nvmlGpuTopologyLevel_t *pathInfo) {
    REQUIRE_GPU(device1, idx);
    (void)gpu;
    int other = 0;
    if (gpu_of(device2, &other) == NULL || pathInfo == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *pathInfo = (nvmlGpuTopologyLevel_t)(other == idx ? NVML_TOPOLOGY_INTERNAL : fake_p2p_level(&N.cfg, idx, other));
    return NVML_SUCCESS;
}

/* The configured link `link` of a GPU (with `remote`, only an enabled one: a disabled link has no
 * remote end); *rc says why there is none: INVALID_ARGUMENT past NVML_NVLINK_MAX_LINKS or past
 * the GPU's links, NOT_SUPPORTED on a GPU without NVLink or for a disabled link's remote end. */
static const struct fake_link *nvlink_of(const struct fake_gpu *gpu, unsigned link, const void *out, int remote,
                                         nvmlReturn_t *rc) {
    *rc = NVML_SUCCESS;
    if (out == NULL || link >= NVML_NVLINK_MAX_LINKS) *rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (gpu->nvlinks <= 0) *rc = NVML_ERROR_NOT_SUPPORTED;
    else if (link >= (unsigned)gpu->nvlinks) *rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (remote && gpu->links[link].end == FAKE_LINK_OFF) *rc = NVML_ERROR_NOT_SUPPORTED;
    return *rc == NVML_SUCCESS ? &gpu->links[link] : NULL;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive) {
    REQUIRE_GPU(device, idx);
    nvmlReturn_t rc;
    const struct fake_link *l = nvlink_of(gpu, link, isActive, 0, &rc);
    if (l != NULL) *isActive = l->end == FAKE_LINK_OFF ? NVML_FEATURE_DISABLED : NVML_FEATURE_ENABLED;
    return rc;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                             nvmlPciInfo_t *pci) {
    REQUIRE_GPU(device, idx);
    nvmlReturn_t rc;
    const struct fake_link *l = nvlink_of(gpu, link, pci, 1, &rc);
    if (l != NULL) fill_pci(pci, l->remote);
    return rc;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci);
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                             nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType) {
    REQUIRE_GPU(device, idx);
    nvmlReturn_t rc;
    const struct fake_link *l = nvlink_of(gpu, link, pNvLinkDeviceType, 1, &rc);
    if (l != NULL)
        *pNvLinkDeviceType = l->end == FAKE_LINK_SWITCH ? NVML_NVLINK_DEVICE_TYPE_SWITCH : NVML_NVLINK_DEVICE_TYPE_GPU;
    return rc;
}

/* ---- health: XID events for unhealthy GPUs */

HAMI_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    REQUIRE_INIT();
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct event_set *es = calloc(1, sizeof *es);
    if (es == NULL) return NVML_ERROR_MEMORY;
    *set = (nvmlEventSet_t)es;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    REQUIRE_GPU(device, idx);
    if (eventTypes == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = nvmlEventTypeXidCriticalError;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                                  nvmlEventSet_t set) {
    REQUIRE_GPU(device, idx);
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if ((eventTypes & ~(unsigned long long)nvmlEventTypeXidCriticalError) != 0) return NVML_ERROR_NOT_SUPPORTED;
    ((struct event_set *)set)->watched[idx] |= eventTypes;
    return NVML_SUCCESS;
}

/* Re-reads the health fields of the configuration file (a test may rewrite it at run time). */
static void refresh_health(void) {
    struct fake_config fresh;
    if (N.cfg.path[0] == '\0' || fake_config_load(&fresh) != 0) return;
    pthread_mutex_lock(&N.mu);
    for (int i = 0; i < N.cfg.count && i < fresh.count; i++) {
        N.cfg.gpus[i].healthy = fresh.gpus[i].healthy;
        N.cfg.gpus[i].xid = fresh.gpus[i].xid;
    }
    pthread_mutex_unlock(&N.mu);
}

HAMI_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    REQUIRE_INIT();
    struct event_set *es = (struct event_set *)set;
    if (es == NULL || data == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        refresh_health();
        for (int i = 0; i < N.cfg.count; i++) {
            if ((es->watched[i] & nvmlEventTypeXidCriticalError) && !N.cfg.gpus[i].healthy && !es->delivered[i]) {
                es->delivered[i] = 1;
                *data = (nvmlEventData_t){.device = (nvmlDevice_t)&N.devs[i],
                                          .eventType = nvmlEventTypeXidCriticalError,
                                          .eventData = N.cfg.gpus[i].xid,
                                          .gpuInstanceId = 0xFFFFFFFFu,
                                          .computeInstanceId = 0xFFFFFFFFu};
                return NVML_SUCCESS;
            }
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        long elapsed = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (elapsed >= (long)timeoutms) return NVML_ERROR_TIMEOUT;
        long wait = (long)timeoutms - elapsed < 50 ? (long)timeoutms - elapsed : 50;
        struct timespec pause = {0, wait * 1000000L};
        nanosleep(&pause, NULL);
    }
}

HAMI_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    REQUIRE_INIT();
    free(set);
    return NVML_SUCCESS;
}
