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

/* GPU-instance, compute-instance and MIG-device handles: (configured GPU, GI id, CI id), checked
 * against the shared state at each call (an instance destroyed meanwhile makes them invalid). */
struct mig_ref {
    int dev, gi, ci;
};

static struct {
    pthread_mutex_t mu;
    int refs;
    struct fake_config cfg;
    struct fake_state *st;
    struct nvml_dev devs[FAKE_MAX_GPUS];
    struct mig_ref gis[FAKE_MAX_GPUS][FAKE_MAX_GIS];
    struct mig_ref cis[FAKE_MAX_GPUS][FAKE_MAX_GIS][FAKE_MAX_CIS];
    struct mig_ref migs[FAKE_MAX_GPUS][FAKE_MAX_GIS][FAKE_MAX_CIS];
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
            fake_mig_resolve(&N.cfg, N.st);
            for (int i = 0; i < FAKE_MAX_GPUS; i++) {
                N.devs[i].index = i;
                for (int g = 0; g < FAKE_MAX_GIS; g++) {
                    N.gis[i][g] = (struct mig_ref){i, g, -1};
                    for (int c = 0; c < FAKE_MAX_CIS; c++)
                        N.cis[i][g][c] = N.migs[i][g][c] = (struct mig_ref){i, g, c};
                }
            }
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
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
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

/* A live MIG device behind a MIG-device handle (its parent's MIG state in *m), or NULL. */
static const struct mig_ref *mig_device_of(nvmlDevice_t device, struct fake_mig_gpu *m,
                                           const struct fake_gi_profile **profile);
static nvmlReturn_t mig_device_memory(const struct mig_ref *r, const struct fake_gi_profile *p,
                                      unsigned long long *total, unsigned long long *used);

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
    for (int i = 0; strncmp(uuid, "MIG-", 4) == 0 && i < N.cfg.count; i++) {
        struct fake_mig_gpu m;
        fake_mig_snapshot(N.st, N.cfg.gpus[i].slot, &m);
        for (int g = 0; g < FAKE_MAX_GIS; g++) {
            for (int c = 0; m.gis[g].live && c < FAKE_MAX_CIS; c++) {
                if (m.gis[g].cis[c].live && strcmp(m.gis[g].cis[c].uuid, uuid) == 0) {
                    *device = (nvmlDevice_t)&N.migs[i][g][c];
                    return NVML_SUCCESS;
                }
            }
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
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = N.refs == 0 ? NULL : mig_device_of(device, &m, &p);
    if (r != NULL) return copy_string(uuid, length, m.gis[r->gi].cis[r->ci].uuid);
    REQUIRE_GPU(device, idx);
    return copy_string(uuid, length, gpu->uuid);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = N.refs == 0 ? NULL : mig_device_of(device, &m, &p);
    if (r != NULL) {
        char text[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
        snprintf(text, sizeof text, "%.60s MIG %s", N.cfg.gpus[r->dev].name, p->name);
        return copy_string(name, length, text);
    }
    REQUIRE_GPU(device, idx);
    return copy_string(name, length, gpu->name);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = N.refs == 0 ? NULL : mig_device_of(device, &m, &p);
    if (r != NULL) {
        if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
        mig_device_memory(r, p, &memory->total, &memory->used);
        memory->free = memory->total - memory->used;
        return NVML_SUCCESS;
    }
    REQUIRE_GPU(device, idx);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t used = fake_state_used(N.st, idx);
    memory->total = gpu->memory;
    memory->used = used;
    memory->free = used < gpu->memory ? gpu->memory - used : 0;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = N.refs == 0 ? NULL : mig_device_of(device, &m, &p);
    if (r != NULL) {
        if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
        if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        mig_device_memory(r, p, &memory->total, &memory->used);
        memory->reserved = 0;
        memory->free = memory->total - memory->used;
        return NVML_SUCCESS;
    }
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

/* A GPU in MIG mode has no GPU-wide utilization (real NVML answers NOT_SUPPORTED). */
static int mig_enabled(const struct fake_gpu *gpu) {
    if (fake_mig_model_of(gpu) == NULL) return 0;
    struct fake_mig_gpu m;
    fake_mig_snapshot(N.st, gpu->slot, &m);
    return m.current == NVML_DEVICE_MIG_ENABLE;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    REQUIRE_GPU(device, idx);
    if (utilization == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (mig_enabled(gpu)) return NVML_ERROR_NOT_SUPPORTED;
    utilization->gpu = 0;
    utilization->memory = 0;
    return NVML_SUCCESS;
}

/* Processes with memory on a slot (gi < 0: the whole GPU, each with the instance it runs on). */
static nvmlReturn_t running(int slot, int gi, int ci, unsigned int *count, nvmlProcessInfo_t *infos) {
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned pids[FAKE_MAX_PROCS], gis[FAKE_MAX_PROCS], cis[FAKE_MAX_PROCS];
    uint64_t used[FAKE_MAX_PROCS];
    unsigned n = fake_state_procs_at(N.st, slot, gi, ci, FAKE_MAX_PROCS, pids, used, gis, cis);
    if (infos == NULL || *count < n) {
        *count = n;
        return n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++)
        infos[i] = (nvmlProcessInfo_t){.pid = pids[i] + N.cfg.host_pid_offset, .usedGpuMemory = used[i],
                                       .gpuInstanceId = gis[i], .computeInstanceId = cis[i]};
    *count = n;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                                 nvmlProcessInfo_t *infos) {
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = N.refs == 0 ? NULL : mig_device_of(device, &m, &p);
    if (r != NULL) return running(N.cfg.gpus[r->dev].slot, r->gi, r->ci, count, infos);
    REQUIRE_GPU(device, idx);
    return running(gpu->slot, gpu->gi, gpu->ci, count, infos);
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
    if (processSamplesCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (mig_enabled(gpu)) return NVML_ERROR_NOT_SUPPORTED;
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

/* ---- MIG (mig.c keeps the profile tables and the instances in the shared state) */

/* A configured MIG-capable GPU behind a parent handle, its model and MIG state; *rc says why not. */
static const struct fake_mig_model *mig_parent(nvmlDevice_t device, int *idx, struct fake_mig_gpu *m,
                                               nvmlReturn_t *rc) {
    *rc = NVML_SUCCESS;
    const struct fake_gpu *gpu = N.refs == 0 ? NULL : gpu_of(device, idx);
    if (N.refs == 0) *rc = NVML_ERROR_UNINITIALIZED;
    else if (gpu == NULL) *rc = NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_mig_model *model = gpu == NULL ? NULL : fake_mig_model_of(gpu);
    if (gpu != NULL && model == NULL) *rc = NVML_ERROR_NOT_SUPPORTED;
    if (model != NULL) fake_mig_snapshot(N.st, gpu->slot, m);
    return model;
}

/* As mig_parent, and MIG mode must be on (instance calls answer NOT_SUPPORTED otherwise). */
static const struct fake_mig_model *mig_enabled_parent(nvmlDevice_t device, int *idx, struct fake_mig_gpu *m,
                                                       nvmlReturn_t *rc) {
    const struct fake_mig_model *model = mig_parent(device, idx, m, rc);
    if (model != NULL && m->current != NVML_DEVICE_MIG_ENABLE) {
        *rc = NVML_ERROR_NOT_SUPPORTED;
        return NULL;
    }
    return model;
}

/* The live instance behind a handle of one of N's arrays (GI: ci < 0), with its parent's state. */
static const struct mig_ref *live_ref(const struct mig_ref *r, struct fake_mig_gpu *m,
                                      const struct fake_gi_profile **profile) {
    if (r == NULL || N.refs == 0 || r->dev >= N.cfg.count) return NULL;
    const struct fake_mig_model *model = fake_mig_model_of(&N.cfg.gpus[r->dev]);
    if (model == NULL) return NULL;
    fake_mig_snapshot(N.st, N.cfg.gpus[r->dev].slot, m);
    const struct fake_mig_gi *gi = &m->gis[r->gi];
    if (!gi->live || (r->ci >= 0 && !gi->cis[r->ci].live)) return NULL;
    if (profile != NULL) *profile = &model->profiles[gi->profile];
    return r;
}

#define IN_ARRAY(ptr, array) \
    ((const char *)(ptr) >= (const char *)(array) && (const char *)(ptr) < (const char *)(array) + sizeof(array))

static const struct mig_ref *gi_of_handle(nvmlGpuInstance_t h, struct fake_mig_gpu *m,
                                          const struct fake_gi_profile **profile) {
    return IN_ARRAY(h, N.gis) ? live_ref((const struct mig_ref *)h, m, profile) : NULL;
}

static const struct mig_ref *ci_of_handle(nvmlComputeInstance_t h, struct fake_mig_gpu *m,
                                          const struct fake_gi_profile **profile) {
    return IN_ARRAY(h, N.cis) ? live_ref((const struct mig_ref *)h, m, profile) : NULL;
}

static const struct mig_ref *mig_device_of(nvmlDevice_t device, struct fake_mig_gpu *m,
                                           const struct fake_gi_profile **profile) {
    return IN_ARRAY(device, N.migs) ? live_ref((const struct mig_ref *)device, m, profile) : NULL;
}

static nvmlReturn_t mig_device_memory(const struct mig_ref *r, const struct fake_gi_profile *p,
                                      unsigned long long *total, unsigned long long *used) {
    unsigned pids[FAKE_MAX_PROCS];
    uint64_t bytes[FAKE_MAX_PROCS];
    unsigned n = fake_state_procs_at(N.st, N.cfg.gpus[r->dev].slot, r->gi, -1, FAKE_MAX_PROCS, pids, bytes, NULL, NULL);
    *total = p->memory_mb << 20;
    *used = 0;
    for (unsigned i = 0; i < n && i < FAKE_MAX_PROCS; i++) *used += bytes[i];
    if (*used > *total) *used = *total;
    return NVML_SUCCESS;
}

/* Declares idx, m (the GPU's MIG state) and model for a parent handle, or returns lookup's code. */
#define REQUIRE_MIG_PARENT(device, lookup)                                        \
    int idx = 0;                                                                  \
    struct fake_mig_gpu m;                                                        \
    nvmlReturn_t rc;                                                              \
    const struct fake_mig_model *model = lookup((device), &idx, &m, &rc);         \
    if (model == NULL) return rc;                                                 \
    (void)model

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    REQUIRE_MIG_PARENT(device, mig_parent);
    if (currentMode == NULL || pendingMode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *currentMode = m.current;
    *pendingMode = m.pending;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus) {
    REQUIRE_MIG_PARENT(device, mig_parent);
    if (activationStatus == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int activation = NVML_SUCCESS;
    rc = (nvmlReturn_t)fake_mig_set_mode(N.st, N.cfg.gpus[idx].slot, mode, &activation);
    *activationStatus = (nvmlReturn_t)activation;
    return rc;
}

static void fill_profile_name(char *out, size_t len, const struct fake_gi_profile *p) {
    snprintf(out, len, "MIG %s", p->name);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_t *info) {
    REQUIRE_MIG_PARENT(device, mig_parent);
    if (info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_gi_profile *p = fake_mig_profile_by_index(model, profile);
    if (p == NULL) return profile < 0x12 ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    *info = (nvmlGpuInstanceProfileInfo_t){.id = p->id, .isP2pSupported = 0, .sliceCount = p->slices,
                                           .instanceCount = p->instances, .multiprocessorCount = p->sms,
                                           .copyEngineCount = p->copy_engines, .decoderCount = p->decoders,
                                           .encoderCount = p->encoders, .jpegCount = p->jpegs, .ofaCount = p->ofas,
                                           .memorySizeMB = p->memory_mb};
    return NVML_SUCCESS;
}

/* _v2 and _v3 have the same size; the version word tells them apart. */
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                              nvmlGpuInstanceProfileInfo_v2_t *info) {
    nvmlGpuInstanceProfileInfo_t v1;
    if (info != NULL && info->version != nvmlGpuInstanceProfileInfo_v2 &&
        info->version != nvmlGpuInstanceProfileInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t rc = nvmlDeviceGetGpuInstanceProfileInfo(device, profile, info == NULL ? NULL : &v1);
    if (rc != NVML_SUCCESS) return rc;
    int idx = 0;
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = fake_mig_profile_by_index(mig_parent(device, &idx, &m, &rc), profile);
    if (info->version == nvmlGpuInstanceProfileInfo_v3) {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)(void *)info;
        *v3 = (nvmlGpuInstanceProfileInfo_v3_t){
            .version = nvmlGpuInstanceProfileInfo_v3, .id = v1.id, .sliceCount = v1.sliceCount,
            .instanceCount = v1.instanceCount, .multiprocessorCount = v1.multiprocessorCount,
            .copyEngineCount = v1.copyEngineCount, .decoderCount = v1.decoderCount, .encoderCount = v1.encoderCount,
            .jpegCount = v1.jpegCount, .ofaCount = v1.ofaCount, .memorySizeMB = v1.memorySizeMB};
        fill_profile_name(v3->name, sizeof v3->name, p);
        return NVML_SUCCESS;
    }
    *info = (nvmlGpuInstanceProfileInfo_v2_t){
        .version = nvmlGpuInstanceProfileInfo_v2, .id = v1.id, .isP2pSupported = v1.isP2pSupported,
        .sliceCount = v1.sliceCount, .instanceCount = v1.instanceCount, .multiprocessorCount = v1.multiprocessorCount,
        .copyEngineCount = v1.copyEngineCount, .decoderCount = v1.decoderCount, .encoderCount = v1.encoderCount,
        .jpegCount = v1.jpegCount, .ofaCount = v1.ofaCount, .memorySizeMB = v1.memorySizeMB};
    fill_profile_name(info->name, sizeof info->name, p);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                       nvmlGpuInstancePlacement_t *placements,
                                                                       unsigned int *count) {
    REQUIRE_MIG_PARENT(device, mig_parent);
    const struct fake_gi_profile *p = fake_mig_profile_by_id(model, profileId);
    if (p == NULL || count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (placements == NULL) {
        *count = p->nstarts;
        return NVML_SUCCESS;
    }
    if (*count < p->nstarts) {
        *count = p->nstarts;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < p->nstarts; i++) placements[i] = (nvmlGpuInstancePlacement_t){p->starts[i], p->size};
    *count = p->nstarts;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                                   unsigned int *count) {
    REQUIRE_MIG_PARENT(device, mig_enabled_parent);
    const struct fake_gi_profile *p = fake_mig_profile_by_id(model, profileId);
    if (p == NULL || count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = fake_mig_gi_capacity(&m, model, p);
    return NVML_SUCCESS;
}

static nvmlReturn_t create_gi(nvmlDevice_t device, unsigned int profileId, int start, nvmlGpuInstance_t *gpuInstance) {
    REQUIRE_MIG_PARENT(device, mig_parent);
    if (gpuInstance == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned id = 0;
    rc = (nvmlReturn_t)fake_mig_create_gi(N.st, N.cfg.gpus[idx].slot, &N.cfg.gpus[idx], profileId, start, &id);
    if (rc == NVML_SUCCESS) *gpuInstance = (nvmlGpuInstance_t)&N.gis[idx][id];
    return rc;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                     nvmlGpuInstance_t *gpuInstance) {
    return create_gi(device, profileId, -1, gpuInstance);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                                  const nvmlGpuInstancePlacement_t *placement,
                                                                  nvmlGpuInstance_t *gpuInstance) {
    if (placement == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int idx = 0;
    struct fake_mig_gpu m;
    nvmlReturn_t rc;
    const struct fake_gi_profile *p = fake_mig_profile_by_id(mig_parent(device, &idx, &m, &rc), profileId);
    if (p != NULL && placement->size != p->size) return NVML_ERROR_INVALID_ARGUMENT;
    return create_gi(device, profileId, placement->start > 7 ? 99 : (int)placement->start, gpuInstance);
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct mig_ref *r = gi_of_handle(gpuInstance, &m, NULL);
    if (r == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return (nvmlReturn_t)fake_mig_destroy_gi(N.st, N.cfg.gpus[r->dev].slot, (unsigned)r->gi);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                                   nvmlGpuInstance_t *gpuInstances, unsigned int *count) {
    REQUIRE_MIG_PARENT(device, mig_enabled_parent);
    const struct fake_gi_profile *p = fake_mig_profile_by_id(model, profileId);
    if (p == NULL || count == NULL || gpuInstances == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    for (int g = 0; g < FAKE_MAX_GIS; g++) {
        if (m.gis[g].live && &model->profiles[m.gis[g].profile] == p) gpuInstances[n++] = (nvmlGpuInstance_t)&N.gis[idx][g];
    }
    *count = n;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                      nvmlGpuInstance_t *gpuInstance) {
    REQUIRE_MIG_PARENT(device, mig_enabled_parent);
    if (gpuInstance == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (id >= FAKE_MAX_GIS || !m.gis[id].live) return NVML_ERROR_NOT_FOUND;
    *gpuInstance = (nvmlGpuInstance_t)&N.gis[idx][id];
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = gi_of_handle(gpuInstance, &m, &p);
    if (r == NULL || info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *info = (nvmlGpuInstanceInfo_t){.device = (nvmlDevice_t)&N.devs[r->dev], .id = (unsigned)r->gi,
                                    .profileId = p->id,
                                    .placement = {m.gis[r->gi].start, m.gis[r->gi].size}};
    return NVML_SUCCESS;
}

/* The compute-instance profile `profile` of a GI: its slices and SMs; NOT_SUPPORTED when it does not fit. */
static nvmlReturn_t ci_profile(nvmlGpuInstance_t gpuInstance, unsigned profile, unsigned engProfile,
                               nvmlComputeInstanceProfileInfo_t *info, char *name, size_t len) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = gi_of_handle(gpuInstance, &m, &p);
    if (r == NULL || info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED) return NVML_ERROR_NOT_SUPPORTED;
    unsigned slices = fake_mig_ci_slices(p->slices, profile);
    if (slices == 0) return NVML_ERROR_NOT_SUPPORTED;
    *info = (nvmlComputeInstanceProfileInfo_t){.id = profile, .sliceCount = slices,
                                               .instanceCount = p->slices / slices,
                                               .multiprocessorCount = p->sms / p->slices * slices,
                                               .sharedCopyEngineCount = p->copy_engines,
                                               .sharedDecoderCount = p->decoders, .sharedEncoderCount = p->encoders,
                                               .sharedJpegCount = p->jpegs, .sharedOfaCount = p->ofas};
    if (slices == p->slices) snprintf(name, len, "MIG %s", p->name);
    else snprintf(name, len, "MIG %uc.%s", slices, p->name);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance,
                                                                      unsigned int profile, unsigned int engProfile,
                                                                      nvmlComputeInstanceProfileInfo_t *info) {
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    return ci_profile(gpuInstance, profile, engProfile, info, name, sizeof name);
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance,
                                                                       unsigned int profile, unsigned int engProfile,
                                                                       nvmlComputeInstanceProfileInfo_v2_t *info) {
    if (info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlComputeInstanceProfileInfo_v2 && info->version != nvmlComputeInstanceProfileInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlComputeInstanceProfileInfo_t v1;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    nvmlReturn_t rc = ci_profile(gpuInstance, profile, engProfile, &v1, name, sizeof name);
    if (rc != NVML_SUCCESS) return rc;
    unsigned version = info->version;
    if (version == nvmlComputeInstanceProfileInfo_v3) ((nvmlComputeInstanceProfileInfo_v3_t *)(void *)info)->capabilities = 0;
    info->version = version;
    info->id = v1.id;
    info->sliceCount = v1.sliceCount;
    info->instanceCount = v1.instanceCount;
    info->multiprocessorCount = v1.multiprocessorCount;
    info->sharedCopyEngineCount = v1.sharedCopyEngineCount;
    info->sharedDecoderCount = v1.sharedDecoderCount;
    info->sharedEncoderCount = v1.sharedEncoderCount;
    info->sharedJpegCount = v1.sharedJpegCount;
    info->sharedOfaCount = v1.sharedOfaCount;
    snprintf(info->name, sizeof info->name, "%s", name);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t gpuInstance,
                                                                            unsigned int profileId,
                                                                            unsigned int *count) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = gi_of_handle(gpuInstance, &m, &p);
    if (r == NULL || count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (fake_mig_ci_slices(p->slices, profileId) == 0) return NVML_ERROR_NOT_SUPPORTED;
    *count = fake_mig_ci_capacity(&m.gis[r->gi], p->slices, profileId);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                              nvmlComputeInstance_t *computeInstance) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct mig_ref *r = gi_of_handle(gpuInstance, &m, NULL);
    if (r == NULL || computeInstance == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned id = 0;
    nvmlReturn_t rc =
        (nvmlReturn_t)fake_mig_create_ci(N.st, N.cfg.gpus[r->dev].slot, (unsigned)r->gi, profileId, &id);
    if (rc == NVML_SUCCESS) *computeInstance = (nvmlComputeInstance_t)&N.cis[r->dev][r->gi][id];
    return rc;
}

HAMI_EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct mig_ref *r = ci_of_handle(computeInstance, &m, NULL);
    if (r == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    return (nvmlReturn_t)fake_mig_destroy_ci(N.st, N.cfg.gpus[r->dev].slot, (unsigned)r->gi, (unsigned)r->ci);
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                            nvmlComputeInstance_t *computeInstances,
                                                            unsigned int *count) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = gi_of_handle(gpuInstance, &m, &p);
    if (r == NULL || count == NULL || computeInstances == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (fake_mig_ci_slices(p->slices, profileId) == 0) return NVML_ERROR_NOT_SUPPORTED;
    unsigned n = 0;
    for (int c = 0; c < FAKE_MAX_CIS; c++) {
        const struct fake_mig_ci *ci = &m.gis[r->gi].cis[c];
        if (ci->live && ci->profile == profileId)
            computeInstances[n++] = (nvmlComputeInstance_t)&N.cis[r->dev][r->gi][c];
    }
    *count = n;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                               nvmlComputeInstance_t *computeInstance) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct mig_ref *r = gi_of_handle(gpuInstance, &m, NULL);
    if (r == NULL || computeInstance == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (id >= FAKE_MAX_CIS || !m.gis[r->gi].cis[id].live) return NVML_ERROR_NOT_FOUND;
    *computeInstance = (nvmlComputeInstance_t)&N.cis[r->dev][r->gi][id];
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                       nvmlComputeInstanceInfo_t *info) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct mig_ref *r = ci_of_handle(computeInstance, &m, NULL);
    if (r == NULL || info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_mig_ci *ci = &m.gis[r->gi].cis[r->ci];
    *info = (nvmlComputeInstanceInfo_t){.device = (nvmlDevice_t)&N.devs[r->dev],
                                        .gpuInstance = (nvmlGpuInstance_t)&N.gis[r->dev][r->gi],
                                        .id = (unsigned)r->ci, .profileId = ci->profile,
                                        .placement = {ci->start, ci->size}};
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                                    nvmlComputeInstanceInfo_t *info) {
    return nvmlComputeInstanceGetInfo_v2(computeInstance, info);
}

/* ---- MIG devices: one per compute instance, in (GPU instance id, compute instance id) order */

HAMI_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    if (isMigDevice == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (mig_device_of(device, &m, NULL) != NULL) {
        *isMigDevice = 1;
        return NVML_SUCCESS;
    }
    if (gpu_of(device, NULL) == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t mig_ids(nvmlDevice_t device, unsigned int *id, int compute) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct mig_ref *r = mig_device_of(device, &m, NULL);
    if (id == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (r == NULL) return gpu_of(device, NULL) != NULL ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    *id = (unsigned)(compute ? r->ci : r->gi);
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    return mig_ids(device, id, 0);
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return mig_ids(device, id, 1);
}

#define MAX_MIG_DEVICES 7

/* Zero when the GPU has no MIG or has it off, as real NVML answers. */
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    REQUIRE_GPU(device, idx);
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = mig_enabled(gpu) ? MAX_MIG_DEVICES : 0;
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                             nvmlDevice_t *migDevice) {
    REQUIRE_MIG_PARENT(device, mig_enabled_parent);
    if (migDevice == NULL || index >= MAX_MIG_DEVICES) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    for (int g = 0; g < FAKE_MAX_GIS; g++) {
        for (int c = 0; m.gis[g].live && c < FAKE_MAX_CIS; c++) {
            if (m.gis[g].cis[c].live && n++ == index) {
                *migDevice = (nvmlDevice_t)&N.migs[idx][g][c];
                return NVML_SUCCESS;
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct mig_ref *r = mig_device_of(migDevice, &m, NULL);
    if (r == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)&N.devs[r->dev];
    return NVML_SUCCESS;
}

/* A MIG device: its compute instance's SMs and slices, its GPU instance's engines and memory; a
 * whole GPU: its largest profile's (or, without MIG, 108 SMs and no slices). */
HAMI_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    REQUIRE_INIT();
    struct fake_mig_gpu m;
    const struct fake_gi_profile *p = NULL;
    const struct mig_ref *r = mig_device_of(device, &m, &p);
    if (attributes == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (r != NULL) {
        const struct fake_mig_ci *ci = &m.gis[r->gi].cis[r->ci];
        *attributes = (nvmlDeviceAttributes_t){.multiprocessorCount = p->sms / p->slices * ci->size,
                                               .sharedCopyEngineCount = p->copy_engines,
                                               .sharedDecoderCount = p->decoders,
                                               .sharedEncoderCount = p->encoders, .sharedJpegCount = p->jpegs,
                                               .sharedOfaCount = p->ofas, .gpuInstanceSliceCount = p->slices,
                                               .computeInstanceSliceCount = ci->size, .memorySizeMB = p->memory_mb};
        return NVML_SUCCESS;
    }
    REQUIRE_GPU(device, idx);
    const struct fake_gi_profile *whole = fake_mig_profile_by_index(fake_mig_model_of(gpu), NVML_GPU_INSTANCE_PROFILE_7_SLICE);
    *attributes = (nvmlDeviceAttributes_t){.multiprocessorCount = whole != NULL ? whole->sms : 108,
                                           .sharedCopyEngineCount = whole != NULL ? whole->copy_engines : 7,
                                           .gpuInstanceSliceCount = whole != NULL ? 7 : 0,
                                           .computeInstanceSliceCount = whole != NULL ? 7 : 0,
                                           .memorySizeMB = gpu->memory >> 20};
    return NVML_SUCCESS;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    return nvmlDeviceGetAttributes_v2(device, attributes);
}
