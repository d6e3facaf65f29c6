/* Compute (SM) limiting: every kernel launch path goes through here.
 *
 * cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel and cuGraphLaunch, each with its
 * per-thread-default-stream (_ptsz) twin, reached by symbol, dlsym or cuGetProcAddress (hooks.c).
 *
 * What a launch does, in order (docs/wire-format.md#interposer-environment and #region-file;
 * docs/isolation.md):
 *  1. Priority feedback. The monitor sets the region's recent_kernel to -1 while a container of
 *     higher priority has run on the GPU recently: launches wait until it is >= 0 again (unless
 *     GPU_CORE_UTILIZATION_POLICY=disable). A launch then marks the container active for the
 *     monitor: recent_kernel = 2, last_kernel_time = now (epoch seconds).
 *  2. The limit. A device with 0 < SM limit < 100 (the process's own, settings.c) is limited when the policy is
 *     `force`, or when it is anything but `disable` and the region's utilization_switch is 1
 *     (the monitor sets it while the GPU is shared). A limited launch asks the device's throttle
 *     (throttle.c) and sleeps as long as it says.
 *  3. Measurement. A watcher thread, started with the first limited launch, reads NVML's
 *     per-process utilization samples of each limited device every WATCH_NS, sums those of the
 *     container's processes (the region's slots) and hands the sum to the throttle. It also
 *     publishes this process's own share in its slot (device_util[i].sm_util) for the monitor.
 *
 * The fast path. In a process with no limit on any device, or with the policy `disable`, a
 * launch costs three loads and their branches before the driver's function: the region pointer
 * that setup publishes for exactly that case, recent_kernel, which is 2 (marked, not blocked)
 * nearly always, and the driver's function pointer. Anything else takes the slow path above;
 * launches into a stream that is being captured into a graph are not limited (the graph is, when
 * it is launched). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "throttle.h"
#include "vgpu.h"

enum policy { POLICY_DEFAULT, POLICY_FORCE, POLICY_DISABLE };

/* recent_kernel after a launch: what HAMi's monitor counts down from (2 -> 1: active, -> 0: idle). */
#define ACTIVE_MARK 2
/* How often a launch blocked by priority looks again. */
#define BLOCKED_POLL_NS 10000000ULL
/* Watcher period while limited launches happen, and when none has for IDLE_AFTER_NS. */
#define WATCH_NS 50000000ULL
#define WATCH_IDLE_NS 500000000ULL
#define IDLE_AFTER_NS 2000000000ULL
/* The longest a throttled launch sleeps before asking again. */
#define MAX_SLEEP_NS 20000000ULL
/* A graph launch's cost: its kernels are not visible from the exec handle, so it counts as one
 * large kernel; the feedback finds the rate whatever the true size (docs/isolation.md). */
#define GRAPH_COST 1048576.0
#define WATCH_SAMPLES 512
/* How long NVML may report samples, none of them for this container, before that is reported. */
#define UNATTRIBUTED_NS 2000000000ULL

struct gate {
    pthread_mutex_t mu;
    struct throttle t;
    int live;               /* throttle initialised; read without mu by the watcher */
    uint64_t last_launch_ns;
    unsigned long long seen_us; /* NVML lastSeenTimeStamp */
    nvmlDevice_t nvml;
    uint64_t unattributed_ns; /* since when samples came, none of them ours; 0 = ours came */
    int unattributed_told;
    int nvml_failed;        /* the last poll failed (reported once per run of failures) */
};

static struct {
    /* Published by setup when no launch of this process can be limited: the fast path. */
    struct hami_region *quiet;
    pthread_once_t once;
    struct hami_region *r;
    enum policy policy;
    int armed;
    unsigned limit[HAMI_MAX_DEVICES]; /* percent; 0 = not limited (atomic: the watcher may drop it) */
    struct gate gates[HAMI_MAX_DEVICES];
    pthread_mutex_t watcher_mu;
    int watcher_started;
    uint64_t realtime_offset_ns; /* CLOCK_REALTIME - CLOCK_MONOTONIC, taken at setup */
} L = {.once = PTHREAD_ONCE_INIT, .watcher_mu = PTHREAD_MUTEX_INITIALIZER};

/* The driver's launch functions, resolved by setup (NULL where the driver lacks one); read by the
 * fast path only after quiet() has seen L.quiet, which setup publishes after writing them. */
static struct {
    cuLaunchKernel_fn kernel;
    cuLaunchKernel_ptsz_fn kernel_ptsz;
    cuLaunchKernelEx_fn ex;
    cuLaunchKernelEx_ptsz_fn ex_ptsz;
    cuLaunchCooperativeKernel_fn coop;
    cuLaunchCooperativeKernel_ptsz_fn coop_ptsz;
    cuGraphLaunch_fn graph;
    cuGraphLaunch_ptsz_fn graph_ptsz;
} real;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static unsigned long long realtime_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
}

/* NVML stamps samples with CLOCK_REALTIME microseconds; the throttle counts in CLOCK_MONOTONIC. */
static uint64_t monotonic_of(unsigned long long realtime_us_stamp) {
    uint64_t offset = __atomic_load_n(&L.realtime_offset_ns, __ATOMIC_RELAXED);
    uint64_t ns = (uint64_t)realtime_us_stamp * 1000ULL;
    return ns > offset ? ns - offset : 0;
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ULL), .tv_nsec = (long)(ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

static enum policy parse_policy(void) {
    const char *text = vgpu_setting("GPU_CORE_UTILIZATION_POLICY");
    if (text == NULL) return POLICY_DEFAULT;
    if (strcasecmp(text, "force") == 0) return POLICY_FORCE;
    if (strcasecmp(text, "disable") == 0) return POLICY_DISABLE;
    return POLICY_DEFAULT;
}

static void setup(void) {
    L.realtime_offset_ns = realtime_us() * 1000ULL - now_ns();
    L.r = vgpu_region_map();
    L.policy = parse_policy();
    /* This process's own limits, not the region's copy: any process of the container can write
     * the region. */
    uint64_t mem[HAMI_MAX_DEVICES], sm[HAMI_MAX_DEVICES];
    vgpu_env_limits(mem, sm);
    for (int i = 0; i < HAMI_MAX_DEVICES; i++) {
        uint64_t limit = sm[i];
        L.limit[i] = (limit > 0 && limit < 100 && L.policy != POLICY_DISABLE) ? (unsigned)limit : 0;
        if (L.limit[i] != 0) L.armed = 1;
        if (L.limit[i] != 0 && (uint64_t)i < L.r->device_num) {
            LOGI("device %d: SM limit %u%% (policy %s)", i, L.limit[i],
                 L.policy == POLICY_FORCE ? "force" : "default: while utilization_switch is 1");
        }
        pthread_mutex_init(&L.gates[i].mu, NULL);
    }
    real.kernel = REAL(cuLaunchKernel);
    real.kernel_ptsz = REAL(cuLaunchKernel_ptsz);
    real.ex = REAL(cuLaunchKernelEx);
    real.ex_ptsz = REAL(cuLaunchKernelEx_ptsz);
    real.coop = REAL(cuLaunchCooperativeKernel);
    real.coop_ptsz = REAL(cuLaunchCooperativeKernel_ptsz);
    real.graph = REAL(cuGraphLaunch);
    real.graph_ptsz = REAL(cuGraphLaunch_ptsz);
    if (!L.armed) __atomic_store_n(&L.quiet, L.r, __ATOMIC_RELEASE);
}

/* The fast path's test: set up, nothing limited, and this container already marked active. */
static inline int quiet(void) {
    const struct hami_region *r = __atomic_load_n(&L.quiet, __ATOMIC_ACQUIRE);
    return __builtin_expect(r != NULL, 1) &&
           __builtin_expect(__atomic_load_n(&r->recent_kernel, __ATOMIC_RELAXED) >= ACTIVE_MARK, 1);
}

/* Step 1: wait while a higher-priority container has the GPU, then mark this one active. */
static void mark_active(void) {
    struct hami_region *r = L.r;
    int32_t seen = __atomic_load_n(&r->recent_kernel, __ATOMIC_RELAXED);
    while (seen < ACTIVE_MARK) {
        if (seen < 0) {
            if (L.policy == POLICY_DISABLE) return; /* not ours to clear: the monitor's block stays */
            sleep_ns(BLOCKED_POLL_NS);
            seen = __atomic_load_n(&r->recent_kernel, __ATOMIC_RELAXED);
            continue;
        }
        if (__atomic_compare_exchange_n(&r->recent_kernel, &seen, ACTIVE_MARK, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            break;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME_COARSE, &ts);
    uint64_t now_s = (uint64_t)ts.tv_sec;
    if (__atomic_load_n(&r->last_kernel_time, __ATOMIC_RELAXED) < now_s)
        __atomic_store_n(&r->last_kernel_time, now_s, __ATOMIC_RELAXED);
}

/* ---- the watcher: NVML samples -> the container's utilization -> the throttles */

static void watch_device(int idx) {
    struct gate *g = &L.gates[idx];
    nvmlDeviceGetProcessUtilization_fn sample = REAL(nvmlDeviceGetProcessUtilization);
    static nvmlProcessUtilizationSample_t buf[WATCH_SAMPLES]; /* the watcher thread's own */
    unsigned n = WATCH_SAMPLES;
    nvmlReturn_t rc = sample(g->nvml, buf, &n, g->seen_us);
    if (rc == NVML_ERROR_NOT_FOUND) return; /* no samples since the last poll */
    if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
        g->seen_us = realtime_us(); /* more than the buffer holds: skip them, the next poll is small */
        return;
    }
    if (rc != NVML_SUCCESS) {
        if (rc == NVML_ERROR_NOT_SUPPORTED) {
            LOGE("device %d: NVML has no per-process utilization here; the SM limit cannot be enforced", idx);
            __atomic_store_n(&L.limit[idx], 0, __ATOMIC_RELAXED);
        } else if (!g->nvml_failed) {
            LOGW("device %d: nvmlDeviceGetProcessUtilization failed (%d); the SM limit waits for samples", idx,
                 (int)rc);
        }
        g->nvml_failed = 1;
        return;
    }
    g->nvml_failed = 0;
    if (n > WATCH_SAMPLES) n = WATCH_SAMPLES;
    static int pids[HAMI_MAX_PROCS];
    static double sum[HAMI_MAX_PROCS];
    static unsigned count[HAMI_MAX_PROCS];
    int own = -1, npids = vgpu_container_pids(pids, HAMI_MAX_PROCS, &own);
    memset(sum, 0, sizeof(double) * (size_t)npids);
    memset(count, 0, sizeof(unsigned) * (size_t)npids);
    unsigned long long newest = g->seen_us;
    int fresh = 0, ours = 0;
    for (unsigned i = 0; i < n; i++) {
        if (buf[i].timeStamp <= g->seen_us) continue;
        fresh = 1;
        if (buf[i].timeStamp > newest) newest = buf[i].timeStamp;
        for (int p = 0; p < npids; p++) {
            if ((unsigned)pids[p] == buf[i].pid) {
                sum[p] += buf[i].smUtil;
                count[p]++;
                ours = 1;
                break;
            }
        }
    }
    if (!fresh) return;
    /* A process's samples since the last poll are averaged (a poll can see several); the
     * container's utilization is the sum over its processes, capped at the whole GPU. */
    double util = 0;
    for (int p = 0; p < npids; p++) {
        if (count[p] > 0) util += sum[p] / count[p];
    }
    if (util > 100) util = 100;
    uint64_t now = now_ns();
    if (ours) {
        g->unattributed_ns = 0;
    } else if (g->unattributed_ns == 0) {
        g->unattributed_ns = now;
    } else if (now - g->unattributed_ns >= UNATTRIBUTED_NS && !g->unattributed_told) {
        LOGW("device %d: NVML reports no utilization for this container's processes; the SM limit acts "
             "as if the container used nothing (is the slots' hostpid right?)", idx);
        g->unattributed_told = 1;
    }
    /* The samples cover the time since the newest one of the previous poll. */
    pthread_mutex_lock(&g->mu);
    throttle_observe(&g->t, util, monotonic_of(g->seen_us), monotonic_of(newest), now);
    double rate = g->t.rate;
    pthread_mutex_unlock(&g->mu);
    LOGD("device %d: container at %.1f%% over %.0f ms, rate %.4g/s", idx, util, (double)(newest - g->seen_us) / 1e3,
         rate);
    g->seen_us = newest;
    if (own >= 0) vgpu_set_sm_util(idx, count[own] > 0 ? (uint64_t)(sum[own] / count[own] + 0.5) : 0);
}

static void *watcher(void *arg) {
    (void)arg;
    for (;;) {
        uint64_t now = now_ns();
        int busy = 0;
        for (int i = 0; i < HAMI_MAX_DEVICES; i++) {
            struct gate *g = &L.gates[i];
            if (!__atomic_load_n(&g->live, __ATOMIC_ACQUIRE) || __atomic_load_n(&L.limit[i], __ATOMIC_RELAXED) == 0)
                continue;
            if (now - __atomic_load_n(&g->last_launch_ns, __ATOMIC_RELAXED) < IDLE_AFTER_NS) busy = 1;
            watch_device(i);
        }
        sleep_ns(busy ? WATCH_NS : WATCH_IDLE_NS);
    }
    return NULL;
}

static void start_watcher(void) {
    pthread_mutex_lock(&L.watcher_mu);
    if (!L.watcher_started) {
        /* The program's signals are not the watcher's business. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t tid;
        int rc = pthread_create(&tid, &attr, watcher, NULL);
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0) LOGE("cannot start the SM limit watcher thread: %s", strerror(rc));
        L.watcher_started = 1;
    }
    pthread_mutex_unlock(&L.watcher_mu);
}

/* The device's gate, set up on its first limited launch; NULL when the limit cannot be measured. */
static struct gate *open_gate(int idx) {
    struct gate *g = &L.gates[idx];
    if (__atomic_load_n(&g->live, __ATOMIC_ACQUIRE)) return g;
    nvmlDevice_t dev = vgpu_nvml_handle(idx);
    if (dev == NULL || REAL(nvmlDeviceGetProcessUtilization) == NULL) {
        LOGE("device %d: no NVML utilization to measure with; the SM limit cannot be enforced", idx);
        __atomic_store_n(&L.limit[idx], 0, __ATOMIC_RELAXED);
        return NULL;
    }
    vgpu_region_join(); /* the watcher finds the container's processes in the slots */
    pthread_mutex_lock(&g->mu);
    if (!g->live) {
        throttle_init(&g->t, L.limit[idx], now_ns());
        g->nvml = dev;
        g->seen_us = realtime_us();
        g->last_launch_ns = now_ns();
        __atomic_store_n(&g->live, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g->mu);
    start_watcher();
    return g;
}

/* ---- the slow path */

struct ticket {
    struct gate *gate; /* NULL: not throttled */
    double cost;
    uint64_t admitted_ns;
};

/* Whether launches into the stream are being captured into a graph (they run when the graph is
 * launched, and are limited then). The legacy default stream cannot be captured, and asking about
 * it while another stream captures in global mode is an error, so it is not asked about. */
static int capturing(CUstream stream, int per_thread) {
    cuStreamIsCapturing_fn is_capturing = REAL(cuStreamIsCapturing);
    if (stream == NULL && per_thread) stream = CU_STREAM_PER_THREAD;
    if (is_capturing == NULL || stream == NULL || stream == (CUstream)0x1) return 0;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    return is_capturing(stream, &status) == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* The slow path before a launch of `cost` into `stream`: priority, then the limit. */
static struct ticket launch_begin(double cost, CUstream stream, int per_thread) {
    struct ticket tk = {NULL, 0, 0};
    pthread_once(&L.once, setup);
    mark_active();
    if (!L.armed) return tk;
    int idx = vgpu_current_index();
    if (idx < 0 || idx >= HAMI_MAX_DEVICES || __atomic_load_n(&L.limit[idx], __ATOMIC_RELAXED) == 0) return tk;
    if (L.policy != POLICY_FORCE && __atomic_load_n(&L.r->utilization_switch, __ATOMIC_RELAXED) != 1) return tk;
    if (capturing(stream, per_thread)) return tk;
    struct gate *g = open_gate(idx);
    if (g == NULL) return tk;
    for (;;) {
        uint64_t now = now_ns();
        pthread_mutex_lock(&g->mu);
        uint64_t wait = throttle_admit(&g->t, cost, now);
        __atomic_store_n(&g->last_launch_ns, now, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&g->mu);
        if (wait == 0) {
            tk.admitted_ns = now;
            break;
        }
        sleep_ns(wait < MAX_SLEEP_NS ? wait : MAX_SLEEP_NS);
    }
    tk.gate = g;
    tk.cost = cost;
    return tk;
}

static void launch_end(struct ticket tk, CUresult rc) {
    if (tk.gate == NULL || rc == CUDA_SUCCESS) return;
    pthread_mutex_lock(&tk.gate->mu);
    throttle_refund(&tk.gate->t, tk.cost, tk.admitted_ns);
    pthread_mutex_unlock(&tk.gate->mu);
}

static void launch_atfork_child(void) {
    /* The child is a new process: no watcher thread, fresh gates (its own measurements). */
    pthread_mutex_init(&L.watcher_mu, NULL);
    L.watcher_started = 0;
    for (int i = 0; i < HAMI_MAX_DEVICES; i++) {
        pthread_mutex_init(&L.gates[i].mu, NULL);
        L.gates[i].live = 0;
    }
}

__attribute__((constructor)) static void launch_setup_fork(void) { pthread_atfork(NULL, NULL, launch_atfork_child); }

/* ---- the wrappers: the fast path, else the driver's function between launch_begin and launch_end */

#define LAUNCH_KERNEL(name, field, ptsz)                                                                    \
    HAMI_EXPORT CUresult name(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
                              unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,          \
                              void **params, void **extra) {                                                   \
        name##_fn fn;                                                                                          \
        if (quiet() && (fn = real.field) != NULL)                                                              \
            return fn(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);                               \
        if ((fn = REAL(name)) == NULL) return CUDA_ERROR_NOT_SUPPORTED;                                        \
        struct ticket tk = launch_begin(throttle_kernel_cost(gx, gy, gz, bx, by, bz), stream, ptsz);           \
        CUresult rc = fn(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);                            \
        launch_end(tk, rc);                                                                                    \
        return rc;                                                                                             \
    }
LAUNCH_KERNEL(cuLaunchKernel, kernel, 0)
LAUNCH_KERNEL(cuLaunchKernel_ptsz, kernel_ptsz, 1)

#define LAUNCH_COOPERATIVE(name, field, ptsz)                                                               \
    HAMI_EXPORT CUresult name(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
                              unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,          \
                              void **params) {                                                                 \
        name##_fn fn;                                                                                          \
        if (quiet() && (fn = real.field) != NULL) return fn(f, gx, gy, gz, bx, by, bz, shared, stream, params); \
        if ((fn = REAL(name)) == NULL) return CUDA_ERROR_NOT_SUPPORTED;                                        \
        struct ticket tk = launch_begin(throttle_kernel_cost(gx, gy, gz, bx, by, bz), stream, ptsz);           \
        CUresult rc = fn(f, gx, gy, gz, bx, by, bz, shared, stream, params);                                   \
        launch_end(tk, rc);                                                                                    \
        return rc;                                                                                             \
    }
LAUNCH_COOPERATIVE(cuLaunchCooperativeKernel, coop, 0)
LAUNCH_COOPERATIVE(cuLaunchCooperativeKernel_ptsz, coop_ptsz, 1)

#define LAUNCH_EX(name, field, ptsz)                                                                       \
    HAMI_EXPORT CUresult name(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {   \
        name##_fn fn;                                                                                      \
        if (quiet() && (fn = real.field) != NULL) return fn(config, f, params, extra);                     \
        if ((fn = REAL(name)) == NULL) return CUDA_ERROR_NOT_SUPPORTED;                                    \
        double cost = config == NULL ? 1                                                                   \
                                     : throttle_kernel_cost(config->gridDimX, config->gridDimY,            \
                                                            config->gridDimZ, config->blockDimX,           \
                                                            config->blockDimY, config->blockDimZ);         \
        struct ticket tk = launch_begin(cost, config == NULL ? NULL : config->hStream, ptsz);              \
        CUresult rc = fn(config, f, params, extra);                                                        \
        launch_end(tk, rc);                                                                                \
        return rc;                                                                                         \
    }
LAUNCH_EX(cuLaunchKernelEx, ex, 0)
LAUNCH_EX(cuLaunchKernelEx_ptsz, ex_ptsz, 1)

#define LAUNCH_GRAPH(name, field, ptsz)                                    \
    HAMI_EXPORT CUresult name(CUgraphExec exec, CUstream stream) {         \
        name##_fn fn;                                                      \
        if (quiet() && (fn = real.field) != NULL) return fn(exec, stream); \
        if ((fn = REAL(name)) == NULL) return CUDA_ERROR_NOT_SUPPORTED;    \
        struct ticket tk = launch_begin(GRAPH_COST, stream, ptsz);         \
        CUresult rc = fn(exec, stream);                                    \
        launch_end(tk, rc);                                                \
        return rc;                                                         \
    }
LAUNCH_GRAPH(cuGraphLaunch, graph, 0)
LAUNCH_GRAPH(cuGraphLaunch_ptsz, graph_ptsz, 1)
