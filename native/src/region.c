/* The container's shared region: limits, per-process usage slots, and the lock around them.
 *
 * The limits written into the region are for its readers (the monitor, HAMi's tools); every
 * process enforces its own, read from the limits file (settings.c), since any process of the
 * container can write the region.
 *
 * Every accounting change happens under the region lock: an in-process mutex (threads share one
 * open file description, so the file lock alone would not exclude them) plus an OFD write lock on
 * the `sem` bytes of the file (see hamipy/region.h), which the kernel releases if the holder
 * dies. Readers that only want a number (memory queries, the monitor) take no lock: they read
 * slots under each slot's seqlock. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "vgpu.h"

#define RECLAIM_INTERVAL_NS 1000000000ULL
#define SEQ_READ_TRIES 10000

static struct {
    pthread_once_t once;
    pthread_mutex_t mu;
    struct hami_region *r;
    int fd;
    char path[4096];
    int slot;
    uint64_t limit[HAMI_MAX_DEVICES]; /* this process's memory limits (0: none) */
    uint64_t last_reclaim_ns;
    /* CUDA device ordinal / NVML handle -> region index caches (-2 = not looked up yet). */
    int cuda_index[64];
    nvmlDevice_t nvml_handle[HAMI_MAX_DEVICES];
    int nvml_index[HAMI_MAX_DEVICES];
} g = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER, .fd = -1, .slot = -1};

/* Set once this process's host pid has been learned from NVML (vgpu_pidprobe_end). */
static int hostpid_learned;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* ---- the lock */

static void lock_file(int fd, short type) {
    if (fd < 0) return;
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = HAMI_REGION_LOCK_OFFSET,
                       .l_len = HAMI_REGION_LOCK_LEN, .l_pid = 0};
    while (fcntl(fd, F_OFD_SETLKW, &fl) == -1) {
        if (errno == EINTR) continue;
        LOGE("region lock (F_OFD_SETLKW) failed: %s", strerror(errno));
        return;
    }
}

static void region_lock(void) {
    pthread_mutex_lock(&g.mu);
    lock_file(g.fd, F_WRLCK);
    if (g.r != NULL) g.r->owner_pid = (uint64_t)getpid();
}

static void region_unlock(void) {
    if (g.r != NULL) g.r->owner_pid = 0;
    lock_file(g.fd, F_UNLCK);
    pthread_mutex_unlock(&g.mu);
}

/* ---- slots: seqlock writers and readers */

static void slot_write_begin(struct hami_proc_slot *s) {
    uint64_t seq = __atomic_load_n(&s->seqlock, __ATOMIC_RELAXED);
    /* A writer that died mid-write left it odd: step to the next odd value all the same. */
    __atomic_store_n(&s->seqlock, (seq | 1) + ((seq & 1) ? 2 : 0), __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void slot_write_end(struct hami_proc_slot *s) {
    uint64_t seq = __atomic_load_n(&s->seqlock, __ATOMIC_RELAXED);
    __atomic_store_n(&s->seqlock, seq + 1, __ATOMIC_RELEASE);
}

/* used[idx].total of a live slot, 0 for a free one; consistent under the seqlock. */
static uint64_t slot_usage(const struct hami_proc_slot *s, int idx) {
    for (int tries = 0; tries < SEQ_READ_TRIES; tries++) {
        uint64_t before = __atomic_load_n(&s->seqlock, __ATOMIC_ACQUIRE);
        if (before & 1) continue;
        int32_t status = __atomic_load_n(&s->status, __ATOMIC_RELAXED);
        uint64_t total = __atomic_load_n(&s->used[idx].total, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&s->seqlock, __ATOMIC_RELAXED) == before) return status != 0 ? total : 0;
    }
    /* A writer died mid-write; the slot is reclaimed at the next reservation. */
    return s->status != 0 ? s->used[idx].total : 0;
}

static uint64_t container_usage(int idx) {
    uint64_t sum = 0;
    int n = __atomic_load_n(&g.r->proc_num, __ATOMIC_ACQUIRE);
    if (n < 0 || n > HAMI_MAX_PROCS) n = HAMI_MAX_PROCS;
    for (int i = 0; i < n; i++) sum += slot_usage(&g.r->procs[i], idx);
    return sum;
}

/* Start time of a process (field 22 of /proc/<pid>/stat), 0 if unknown; *zombie set if it has exited. */
static uint64_t proc_start_time(pid_t pid, int *zombie) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    *zombie = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] == '\0') return 0;
    p += 2; /* state, field 3 */
    *zombie = (*p == 'Z' || *p == 'X');
    for (int field = 3; field < 22 && p != NULL; field++) {
        p = strchr(p, ' ');
        if (p != NULL) p++;
    }
    return p == NULL ? 0 : strtoull(p, NULL, 10);
}

static int slot_alive(const struct hami_proc_slot *s) {
    if (s->pid <= 0) return 0;
    if (kill(s->pid, 0) == -1 && errno == ESRCH) return 0;
    int zombie = 0;
    uint64_t started = proc_start_time(s->pid, &zombie);
    if (zombie) return 0;
    uint64_t recorded = s->unused[HAMI_SLOT_STARTTIME];
    return !(started != 0 && recorded != 0 && started != recorded);
}

static void slot_clear(struct hami_proc_slot *s) {
    slot_write_begin(s);
    s->pid = 0;
    s->hostpid = 0;
    memset(s->used, 0, sizeof s->used);
    memset(s->monitorused, 0, sizeof s->monitorused);
    memset(s->device_util, 0, sizeof s->device_util);
    s->unused[0] = s->unused[1] = 0;
    __atomic_store_n(&s->status, HAMI_PROC_EXITED, __ATOMIC_RELAXED);
    slot_write_end(s);
}

static void recount_procs(void) {
    int top = 0;
    for (int i = 0; i < HAMI_MAX_PROCS; i++) {
        if (g.r->procs[i].status != 0) top = i + 1;
    }
    __atomic_store_n(&g.r->proc_num, top, __ATOMIC_RELEASE);
}

/* Frees the slots of processes that are gone (or whose pid now names another process). Locked. */
static void reclaim_dead(void) {
    pid_t self = getpid();
    int n = g.r->proc_num;
    if (n < 0 || n > HAMI_MAX_PROCS) n = HAMI_MAX_PROCS;
    for (int i = 0; i < n; i++) {
        struct hami_proc_slot *s = &g.r->procs[i];
        if (i == g.slot || (s->status == 0 && s->pid == 0 && !(s->seqlock & 1))) continue;
        if (s->status == 0 || s->pid == self || !slot_alive(s)) {
            LOGI("reclaiming region slot %d of pid %d", i, s->pid);
            slot_clear(s);
        }
    }
    recount_procs();
    g.last_reclaim_ns = now_ns();
}

static int hostpid_of_self(void) {
    /* NSpid lists this process's pid from the outermost namespace this /proc can see inwards. */
    FILE *f = fopen("/proc/self/status", "re");
    int pid = (int)getpid();
    if (f == NULL) return pid;
    char line[256];
    while (fgets(line, sizeof line, f) != NULL) {
        if (strncmp(line, "NSpid:", 6) == 0) {
            pid = atoi(line + 6);
            break;
        }
    }
    fclose(f);
    return pid;
}

/* This process's slot, taken on first use. Locked. */
static struct hami_proc_slot *own_slot(void) {
    if (g.slot >= 0) return &g.r->procs[g.slot];
    reclaim_dead();
    for (int i = 0; i < HAMI_MAX_PROCS; i++) {
        struct hami_proc_slot *s = &g.r->procs[i];
        if (s->status != 0) continue;
        int zombie = 0;
        slot_write_begin(s);
        s->pid = (int32_t)getpid();
        s->hostpid = hostpid_of_self();
        memset(s->used, 0, sizeof s->used);
        s->unused[HAMI_SLOT_STARTTIME] = proc_start_time(getpid(), &zombie);
        __atomic_store_n(&s->status, HAMI_PROC_RUNNING, __ATOMIC_RELAXED);
        slot_write_end(s);
        g.slot = i;
        recount_procs();
        LOGD("took region slot %d", i);
        return s;
    }
    LOGE("region %s has no free process slot (%d in use)", g.path, HAMI_MAX_PROCS);
    return NULL;
}

/* ---- devices */

static void format_uuid(const CUuuid *u, char *out, size_t len) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int nvml_ready;

static void nvml_start(void) {
    /* NVML counts nvmlInit calls, so ours stays valid whatever the program does with its own. */
    nvmlInit_v2_fn init = REAL(nvmlInit_v2);
    nvml_ready = init != NULL && init() == NVML_SUCCESS;
}

static int nvml_up(void) {
    pthread_once(&nvml_once, nvml_start);
    return nvml_ready;
}

/* Fills uuids/device_num: NVML order when NVML is there (the wire's "by NVML index"), else CUDA's. */
static void enumerate_devices(struct hami_region *r) {
    unsigned count = 0;
    if (nvml_up() && REAL(nvmlDeviceGetCount_v2) != NULL && REAL(nvmlDeviceGetCount_v2)(&count) == NVML_SUCCESS) {
        for (unsigned i = 0; i < count && i < HAMI_MAX_DEVICES; i++) {
            nvmlDevice_t dev = NULL;
            if (REAL(nvmlDeviceGetHandleByIndex_v2)(i, &dev) != NVML_SUCCESS ||
                REAL(nvmlDeviceGetUUID)(dev, r->uuids[i], HAMI_UUID_LEN) != NVML_SUCCESS)
                snprintf(r->uuids[i], HAMI_UUID_LEN, "unknown-%u", i);
        }
        r->device_num = count > HAMI_MAX_DEVICES ? HAMI_MAX_DEVICES : count;
        return;
    }
    int n = 0;
    if (REAL(cuInit) == NULL || REAL(cuInit)(0) != CUDA_SUCCESS || REAL(cuDeviceGetCount)(&n) != CUDA_SUCCESS) n = 0;
    for (int i = 0; i < n && i < HAMI_MAX_DEVICES; i++) {
        CUdevice dev = 0;
        CUuuid uuid;
        if (REAL(cuDeviceGet)(&dev, i) == CUDA_SUCCESS && REAL(cuDeviceGetUuid)(&uuid, dev) == CUDA_SUCCESS)
            format_uuid(&uuid, r->uuids[i], HAMI_UUID_LEN);
    }
    r->device_num = (uint64_t)(n > HAMI_MAX_DEVICES ? HAMI_MAX_DEVICES : n);
}

static void init_contents(struct hami_region *r) {
    uint64_t mem[HAMI_MAX_DEVICES], sm[HAMI_MAX_DEVICES];
    vgpu_env_limits(mem, sm);
    memset(r, 0, sizeof *r);
    r->major_version = HAMI_REGION_MAJOR;
    r->minor_version = HAMI_REGION_MINOR;
    sem_init(&r->sem, 1, 1);
    sem_init(&r->sem_postinit, 1, 1);
    enumerate_devices(r);
    memcpy(r->limit, mem, sizeof mem);
    memcpy(r->sm_limit, sm, sizeof sm);
    r->sm_init_flag = 1;
    r->priority = vgpu_env_priority();
    r->utilization_switch = 1;
    __atomic_store_n(&r->initialized_flag, HAMI_REGION_MAGIC, __ATOMIC_RELEASE);
}

static void use_private_region(void) {
    void *mem = mmap(NULL, sizeof(struct hami_region), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        LOGE("cannot map a private region: %s", strerror(errno));
        abort();
    }
    if (g.fd >= 0) close(g.fd);
    g.fd = -1;
    g.r = mem;
    init_contents(g.r);
    LOGW("limits hold for this process only (no shared region)");
}

static void region_init(void) {
    uint64_t sm_unused[HAMI_MAX_DEVICES];
    vgpu_env_limits(g.limit, sm_unused);
    const char *path = vgpu_setting("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (path == NULL || *path == '\0') path = HAMI_REGION_DEFAULT_PATH;
    snprintf(g.path, sizeof g.path, "%s", path);
    for (int i = 0; i < 64; i++) g.cuda_index[i] = -2;
    for (int i = 0; i < HAMI_MAX_DEVICES; i++) g.nvml_index[i] = -2;
    if (vgpu_settings_broken()) {
        /* Its limits unknown, the process shares nothing with the container's others. */
        pthread_mutex_lock(&g.mu);
        use_private_region();
        pthread_mutex_unlock(&g.mu);
        return;
    }

    g.fd = open(g.path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (g.fd < 0) {
        LOGE("cannot open region %s: %s", g.path, strerror(errno));
        pthread_mutex_lock(&g.mu);
        use_private_region();
        pthread_mutex_unlock(&g.mu);
        return;
    }
    (void)fchmod(g.fd, 0666);
    region_lock();
    struct stat st;
    if (fstat(g.fd, &st) == 0 && st.st_size < HAMI_REGION_FILE_SIZE && ftruncate(g.fd, HAMI_REGION_FILE_SIZE) != 0)
        LOGE("cannot extend region %s: %s", g.path, strerror(errno));
    void *mem = mmap(NULL, HAMI_REGION_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, g.fd, 0);
    if (mem == MAP_FAILED) {
        LOGE("cannot map region %s: %s", g.path, strerror(errno));
        use_private_region();
        region_unlock();
        return;
    }
    struct hami_region *r = mem;
    if (__atomic_load_n(&r->initialized_flag, __ATOMIC_ACQUIRE) != HAMI_REGION_MAGIC) {
        g.r = r;
        init_contents(r);
        LOGI("initialised region %s (%d devices)", g.path, (int)r->device_num);
    } else if (r->major_version != HAMI_REGION_MAJOR || r->minor_version != HAMI_REGION_MINOR) {
        LOGE("region %s has version %u.%u, not %d.%d", g.path, r->major_version, r->minor_version,
             HAMI_REGION_MAJOR, HAMI_REGION_MINOR);
        munmap(mem, HAMI_REGION_FILE_SIZE);
        use_private_region();
    } else {
        g.r = r;
        if (memcmp(g.limit, r->limit, sizeof g.limit) != 0)
            LOGW("the memory limits in region %s differ from this process's; its own apply", g.path);
    }
    region_unlock();
}

static void region_atfork_prepare(void) { pthread_mutex_lock(&g.mu); }
static void region_atfork_parent(void) { pthread_mutex_unlock(&g.mu); }
static void region_atfork_child(void) {
    /* The child is a new process: its own slot, its own open file description (the inherited
     * one is shared with the parent, so it would not exclude it), no inherited records. */
    g.slot = -1;
    hostpid_learned = 0;
    if (g.fd >= 0) {
        int fd = open(g.path, O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            (void)dup3(fd, g.fd, O_CLOEXEC);
            close(fd);
        }
    }
    vgpu_track_reset_after_fork();
    pthread_mutex_unlock(&g.mu);
}

__attribute__((constructor)) static void region_setup_fork(void) {
    pthread_atfork(region_atfork_prepare, region_atfork_parent, region_atfork_child);
}

__attribute__((destructor)) static void region_leave(void) {
    if (g.r == NULL || g.slot < 0 || pthread_mutex_trylock(&g.mu) != 0) return;
    lock_file(g.fd, F_WRLCK);
    slot_clear(&g.r->procs[g.slot]);
    g.slot = -1;
    recount_procs();
    lock_file(g.fd, F_UNLCK);
    pthread_mutex_unlock(&g.mu);
}

static struct hami_region *region(void) {
    pthread_once(&g.once, region_init);
    return g.r;
}

/* ---- device indexes */

/* CUDA gives a device's UUID as 16 bytes, which say nothing of whether it is a GPU or a MIG
 * device; NVML names it GPU-<hex> or MIG-<hex>. Both name the same device when the hex agrees. */
static int same_device(const char *a, const char *b) {
    int prefixed = (strncmp(a, "GPU-", 4) == 0 || strncmp(a, "MIG-", 4) == 0) &&
                   (strncmp(b, "GPU-", 4) == 0 || strncmp(b, "MIG-", 4) == 0);
    return prefixed ? strncmp(a + 4, b + 4, HAMI_UUID_LEN - 4) == 0 : strncmp(a, b, HAMI_UUID_LEN) == 0;
}

static int index_of_uuid(const char *uuid) {
    struct hami_region *r = region();
    uint64_t n = r->device_num > HAMI_MAX_DEVICES ? HAMI_MAX_DEVICES : r->device_num;
    for (uint64_t i = 0; i < n; i++) {
        if (same_device(r->uuids[i], uuid)) return (int)i;
    }
    return -1;
}

int vgpu_cuda_device_index(CUdevice dev) {
    if (dev < 0 || dev >= 64) return -1;
    region();
    int cached = __atomic_load_n(&g.cuda_index[dev], __ATOMIC_RELAXED);
    if (cached != -2) return cached;
    int idx = dev < HAMI_MAX_DEVICES ? dev : -1;
    CUuuid uuid;
    if (REAL(cuDeviceGetUuid) != NULL && REAL(cuDeviceGetUuid)(&uuid, dev) == CUDA_SUCCESS) {
        char text[HAMI_UUID_LEN];
        format_uuid(&uuid, text, sizeof text);
        int found = index_of_uuid(text);
        if (found >= 0) idx = found;
        else LOGW("CUDA device %d (%s) is not in the region; using index %d", dev, text, idx);
    }
    __atomic_store_n(&g.cuda_index[dev], idx, __ATOMIC_RELAXED);
    return idx;
}

int vgpu_current_index(void) {
    CUdevice dev = 0;
    if (REAL(cuCtxGetDevice) == NULL || REAL(cuCtxGetDevice)(&dev) != CUDA_SUCCESS) return -1;
    return vgpu_cuda_device_index(dev);
}

int vgpu_nvml_device_index(nvmlDevice_t dev) {
    region();
    for (int i = 0; i < HAMI_MAX_DEVICES; i++) {
        if (__atomic_load_n(&g.nvml_index[i], __ATOMIC_ACQUIRE) != -2 && g.nvml_handle[i] == dev) return g.nvml_index[i];
    }
    char uuid[HAMI_UUID_LEN];
    if (REAL(nvmlDeviceGetUUID) == NULL || REAL(nvmlDeviceGetUUID)(dev, uuid, sizeof uuid) != NVML_SUCCESS) return -1;
    int idx = index_of_uuid(uuid);
    pthread_mutex_lock(&g.mu);
    for (int i = 0; i < HAMI_MAX_DEVICES; i++) {
        if (g.nvml_index[i] == -2) {
            g.nvml_handle[i] = dev;
            __atomic_store_n(&g.nvml_index[i], idx, __ATOMIC_RELEASE);
            break;
        }
    }
    pthread_mutex_unlock(&g.mu);
    return idx;
}

/* ---- accounting */

static void charge(struct hami_proc_slot *s, int idx, uint64_t bytes, enum vgpu_charge kind, int add) {
    struct hami_device_memory *m = &s->used[idx];
    uint64_t *field = kind == VGPU_CHARGE_CONTEXT ? &m->context_size : &m->data_size;
    slot_write_begin(s);
    if (add) {
        *field += bytes;
    } else {
        *field = *field > bytes ? *field - bytes : 0;
    }
    m->total = m->context_size + m->module_size + m->data_size;
    slot_write_end(s);
}

int vgpu_reserve(int idx, uint64_t bytes, enum vgpu_charge kind, int enforce) {
    if (idx < 0 || idx >= HAMI_MAX_DEVICES) return 0;
    region();
    int rc = 0;
    region_lock();
    struct hami_proc_slot *s = own_slot();
    uint64_t limit = g.limit[idx];
    if (enforce && limit != 0) {
        if (now_ns() - g.last_reclaim_ns > RECLAIM_INTERVAL_NS) reclaim_dead();
        uint64_t used = container_usage(idx);
        if (used + bytes > limit || used + bytes < used) {
            /* Before refusing, make sure no dead process still holds part of the limit. */
            reclaim_dead();
            used = container_usage(idx);
        }
        if (used + bytes > limit || used + bytes < used || s == NULL) {
            LOGI("device %d: refusing %llu bytes (container uses %llu of %llu)", idx,
                 (unsigned long long)bytes, (unsigned long long)used, (unsigned long long)limit);
            rc = -1;
        }
    }
    if (rc == 0 && s != NULL) charge(s, idx, bytes, kind, 1);
    region_unlock();
    return rc;
}

void vgpu_release(int idx, uint64_t bytes, enum vgpu_charge kind) {
    if (idx < 0 || idx >= HAMI_MAX_DEVICES || bytes == 0) return;
    region();
    region_lock();
    if (g.slot >= 0) charge(&g.r->procs[g.slot], idx, bytes, kind, 0);
    region_unlock();
}

void vgpu_mem_view(int idx, uint64_t physical, uint64_t *total, uint64_t *free, uint64_t *used) {
    region();
    uint64_t limit = (idx >= 0 && idx < HAMI_MAX_DEVICES) ? g.limit[idx] : 0;
    uint64_t t = (limit != 0 && limit < physical) ? limit : physical;
    uint64_t u = (idx >= 0 && idx < HAMI_MAX_DEVICES) ? container_usage(idx) : 0;
    *total = t;
    *used = u;
    *free = u < t ? t - u : 0;
}

nvmlDevice_t vgpu_nvml_handle(int idx) {
    struct hami_region *r = region();
    nvmlDevice_t dev = NULL;
    if (idx < 0 || idx >= HAMI_MAX_DEVICES || !nvml_up() || REAL(nvmlDeviceGetHandleByUUID) == NULL ||
        REAL(nvmlDeviceGetHandleByUUID)(r->uuids[idx], &dev) != NVML_SUCCESS)
        return NULL;
    return dev;
}

uint64_t vgpu_nvml_used(int idx) {
    nvmlDevice_t dev = vgpu_nvml_handle(idx);
    nvmlMemory_t mem;
    nvmlDeviceGetMemoryInfo_fn info = REAL(nvmlDeviceGetMemoryInfo);
    if (dev == NULL || info == NULL || info(dev, &mem) != NVML_SUCCESS) return 0;
    return mem.used;
}

/* ---- compute limiting: the region as launch.c sees it */

struct hami_region *vgpu_region_map(void) { return region(); }

void vgpu_region_join(void) {
    region();
    region_lock();
    own_slot();
    region_unlock();
}

int vgpu_container_pids(int *pids, int max, int *own) {
    struct hami_region *r = region();
    int n = 0, top = __atomic_load_n(&r->proc_num, __ATOMIC_ACQUIRE);
    int mine = __atomic_load_n(&g.slot, __ATOMIC_RELAXED);
    if (top < 0 || top > HAMI_MAX_PROCS) top = HAMI_MAX_PROCS;
    *own = -1;
    for (int i = 0; i < top && n < max; i++) {
        const struct hami_proc_slot *s = &r->procs[i];
        if (__atomic_load_n(&s->status, __ATOMIC_RELAXED) == 0) continue;
        int32_t host = __atomic_load_n(&s->hostpid, __ATOMIC_RELAXED);
        int32_t pid = __atomic_load_n(&s->pid, __ATOMIC_RELAXED);
        if (i == mine) *own = n;
        pids[n++] = host != 0 ? host : pid;
    }
    return n;
}

void vgpu_set_sm_util(int idx, uint64_t percent) {
    if (idx < 0 || idx >= HAMI_MAX_DEVICES) return;
    region();
    region_lock();
    if (g.slot >= 0 && g.r->procs[g.slot].device_util[idx].sm_util != percent) {
        struct hami_proc_slot *s = &g.r->procs[g.slot];
        slot_write_begin(s);
        s->device_util[idx].sm_util = percent;
        slot_write_end(s);
    }
    region_unlock();
}

/* The compute processes NVML lists on a device (host pids), up to VGPU_PROBE_PIDS; -1 if unknown. */
static int nvml_compute_pids(int idx, unsigned *pids) {
    nvmlDevice_t dev = vgpu_nvml_handle(idx);
    nvmlProcessInfo_t infos[VGPU_PROBE_PIDS];
    unsigned n = VGPU_PROBE_PIDS;
    nvmlDeviceGetComputeRunningProcesses_v3_fn list = REAL(nvmlDeviceGetComputeRunningProcesses_v3);
    if (list == NULL) list = REAL(nvmlDeviceGetComputeRunningProcesses_v2);
    if (dev == NULL || list == NULL || list(dev, &n, infos) != NVML_SUCCESS) return -1;
    for (unsigned i = 0; i < n; i++) pids[i] = infos[i].pid;
    return (int)n;
}


void vgpu_pidprobe_begin(int idx, struct vgpu_pidprobe *probe) {
    probe->count = __atomic_load_n(&hostpid_learned, __ATOMIC_RELAXED) ? -1 : nvml_compute_pids(idx, probe->pids);
}

void vgpu_pidprobe_end(int idx, const struct vgpu_pidprobe *probe) {
    unsigned after[VGPU_PROBE_PIDS];
    if (probe->count < 0) return;
    int n = nvml_compute_pids(idx, after);
    unsigned fresh = 0;
    int found = 0;
    for (int i = 0; i < n; i++) {
        int seen = 0;
        for (int j = 0; j < probe->count && !seen; j++) seen = probe->pids[j] == after[i];
        if (!seen) {
            fresh = after[i];
            found++;
        }
    }
    /* Exactly one process appeared while this one made its context: that is this process, as the
     * host (and NVML) numbers it. Two or more: another process raced us; learn nothing. */
    if (found != 1) return;
    region();
    region_lock();
    struct hami_proc_slot *s = own_slot();
    if (s != NULL && s->hostpid != (int32_t)fresh) {
        LOGI("host pid %u (container pid %d)", fresh, (int)getpid());
        slot_write_begin(s);
        s->hostpid = (int32_t)fresh;
        slot_write_end(s);
    }
    region_unlock();
    __atomic_store_n(&hostpid_learned, 1, __ATOMIC_RELAXED);
}
