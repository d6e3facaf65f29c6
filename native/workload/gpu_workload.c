/* gpu-workload: what a CUDA program in a container sees of its GPUs, and how far it gets.
 *
 * The program of the dev cluster's GPU pods (hamipy.devcluster.images). It calls the CUDA driver
 * API as a CUDA application does, linked against libcuda.so.1 (the node's runtime puts the driver
 * in the container; the interposer, loaded by /etc/ld.so.preload, sits in front of it), so what it
 * prints is what the container's limits let an application see and do.
 *
 * Usage: gpu-workload [--chunk-mib N] [--max-mib N] [--kernel-seconds S] [--exit]
 *
 *   --chunk-mib N       allocation size (MiB, default 256)
 *   --max-mib N         allocate at most N MiB per device; below the free figure, try nothing
 *                       past it (default: no bound of its own: fill what cuMemGetInfo reports
 *                       free, then go past it)
 *   --kernel-seconds S  launch kernels for S seconds (a decimal; default 0: none)
 *   --exit              exit after "ready" instead of holding the memory until SIGTERM/SIGINT
 *
 * What it does: creates a context on every device and reports the device (cuMemGetInfo's total
 * and free). Then, on each device in turn, allocates with cuMemAlloc in chunks of N MiB up to the
 * free it was told (the last chunk is what is left, so it reaches that figure exactly), then one
 * chunk past it, and reports what it was granted and the CUresult of the first refusal (a CUDA
 * application meets CUDA_ERROR_OUT_OF_MEMORY there). Then it launches a no-op kernel on every
 * device in turn for S seconds, reports "ready", and holds its memory (the pod stays Running, a
 * monitor sees its usage) until SIGTERM or SIGINT, when it frees everything and exits 0. PID 1 of
 * a container gets no default SIGTERM action, hence the handler.
 *
 * Output, on stdout, flushed line by line: for each fact a human-readable line, then the same
 * fact as one line of JSON after the prefix "HAMIPY-WORKLOAD " (for tests that read kubectl logs):
 *
 *   {"event":"driver","version":12040,"devices":2}
 *   {"event":"device","index":0,"name":"...","uuid":"GPU-...","total":B,"free":B}
 *   {"event":"alloc","index":0,"chunk":B,"reported_free":B,"granted":B,"refused_with":2,
 *    "refused_name":"CUDA_ERROR_OUT_OF_MEMORY","total":B,"free":B}
 *       granted: bytes held; refused_with/refused_name: the first refused allocation's CUresult,
 *       null when none was refused (--max-mib, or a driver that granted even the chunk past the
 *       free figure); total/free: cuMemGetInfo after the allocations
 *   {"event":"kernels","index":0,"seconds":S,"launches":N,"result":0,"result_name":"CUDA_SUCCESS"}
 *       result: the first failed launch's CUresult (the loop stops there), else the synchronize's
 *   {"event":"ready"}
 *   {"event":"exit","signal":15}          signal 0: --exit
 *   {"event":"error","call":"cuInit","result":100,"result_name":"CUDA_ERROR_NO_DEVICE"}
 *       a driver call the program cannot go on without failed; it exits 1
 *
 * Bytes (B) are integers. Bad arguments: usage on stderr, exit 2. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_types.h"

#define MiB (1024ULL * 1024ULL)
#define MAX_DEVICES 64
#define PREFIX "HAMIPY-WORKLOAD "

/* A kernel that does nothing: real PTX, so a real driver JIT-compiles and runs it. */
static const char NOOP_PTX[] = ".version 6.0\n.target sm_50\n.address_size 64\n.visible .entry noop()\n{\n ret;\n}\n";

typedef unsigned long long bytes_t;

struct options {
    bytes_t chunk;
    bytes_t max; /* 0: none */
    double kernel_seconds;
    int exit_when_ready;
};

struct device {
    CUcontext ctx;
    CUfunction kernel;
    CUdeviceptr *chunks;
    size_t nchunks, cap;
    unsigned long long launches;
    CUresult launch_rc;
};

static struct device devices[MAX_DEVICES];
static volatile sig_atomic_t stop_signal;

static void on_signal(int signo) { stop_signal = signo; }

static const char *result_name(CUresult rc) {
    const char *name = NULL;
    if (cuGetErrorName(rc, &name) != CUDA_SUCCESS || name == NULL) return "CUDA_ERROR_UNRECOGNIZED";
    return name;
}

/* The human-readable line of a fact. */
static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
}

/* The JSON line of a fact: fmt is the object's body without braces. */
static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(PREFIX "{", stdout);
    vprintf(fmt, ap);
    fputs("}\n", stdout);
    va_end(ap);
}

/* `text` as the inside of a JSON string (quotes, backslashes and control characters escaped). */
static const char *json_text(const char *text, char *out, size_t size) {
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)text; *p != '\0' && n + 7 < size; p++) {
        if (*p == '"' || *p == '\\') {
            out[n++] = '\\';
            out[n++] = (char)*p;
        } else if (*p < 0x20) {
            n += (size_t)snprintf(out + n, size - n, "\\u%04x", *p);
        } else {
            out[n++] = (char)*p;
        }
    }
    out[n] = '\0';
    return out;
}

/* `call` is the failed call's source text: the function's name is what comes before "(". */
static void fail(const char *call, CUresult rc) {
    int len = (int)strcspn(call, "(");
    say("error: %.*s returned %s (%d)", len, call, result_name(rc), (int)rc);
    emit("\"event\":\"error\",\"call\":\"%.*s\",\"result\":%d,\"result_name\":\"%s\"", len, call, (int)rc,
         result_name(rc));
    exit(1);
}

#define REQUIRE(call)                          \
    do {                                       \
        CUresult rc_ = (call);                 \
        if (rc_ != CUDA_SUCCESS) fail(#call, rc_); \
    } while (0)

static void usage(const char *program) {
    fprintf(stderr, "usage: %s [--chunk-mib N] [--max-mib N] [--kernel-seconds S] [--exit]\n", program);
    exit(2);
}

static bytes_t parse_mib(const char *program, const char *text) {
    char *end = NULL;
    errno = 0;
    unsigned long long mib = strtoull(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-' || mib == 0 || mib > (1ULL << 30)) {
        fprintf(stderr, "%s: not a positive number of MiB: %s\n", program, text);
        usage(program);
    }
    return mib * MiB;
}

static struct options parse(int argc, char **argv) {
    struct options o = {.chunk = 256 * MiB};
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(arg, "--exit") == 0) {
            o.exit_when_ready = 1;
        } else if (strcmp(arg, "--help") == 0) {
            printf("usage: %s [--chunk-mib N] [--max-mib N] [--kernel-seconds S] [--exit]\n", argv[0]);
            exit(0);
        } else if (value == NULL) {
            usage(argv[0]);
        } else if (strcmp(arg, "--chunk-mib") == 0) {
            o.chunk = parse_mib(argv[0], value), i++;
        } else if (strcmp(arg, "--max-mib") == 0) {
            o.max = parse_mib(argv[0], value), i++;
        } else if (strcmp(arg, "--kernel-seconds") == 0) {
            char *end = NULL;
            o.kernel_seconds = strtod(value, &end);
            if (end == value || *end != '\0' || !(o.kernel_seconds >= 0 && o.kernel_seconds <= 86400)) {
                fprintf(stderr, "%s: not a number of seconds: %s\n", argv[0], value);
                usage(argv[0]);
            }
            i++;
        } else {
            usage(argv[0]);
        }
    }
    return o;
}

static void format_uuid(const CUuuid *uuid, char out[64]) {
    const unsigned char *b = (const unsigned char *)uuid->bytes;
    snprintf(out, 64, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static void report_device(int index, CUdevice dev) {
    char name[256], escaped[1600], uuid_text[64];
    CUuuid uuid;
    size_t free_bytes = 0, total = 0;
    REQUIRE(cuDeviceGetName(name, sizeof name, dev));
    REQUIRE(cuDeviceGetUuid_v2(&uuid, dev));
    format_uuid(&uuid, uuid_text);
    REQUIRE(cuCtxCreate_v2(&devices[index].ctx, 0, dev));
    REQUIRE(cuMemGetInfo_v2(&free_bytes, &total));
    say("device %d: %s %s, total %llu MiB, free %llu MiB", index, name, uuid_text, (bytes_t)total / MiB,
        (bytes_t)free_bytes / MiB);
    emit("\"event\":\"device\",\"index\":%d,\"name\":\"%s\",\"uuid\":\"%s\",\"total\":%llu,\"free\":%llu", index,
         json_text(name, escaped, sizeof escaped), uuid_text, (bytes_t)total, (bytes_t)free_bytes);
    /* The module is loaded before the memory is taken: on a full GPU a real driver may not find
     * room for it afterwards. */
    CUmodule module = NULL;
    REQUIRE(cuModuleLoadData(&module, NOOP_PTX));
    REQUIRE(cuModuleGetFunction(&devices[index].kernel, module, "noop"));
}

/* One allocation of `bytes` on the current context; CUDA_SUCCESS or the driver's refusal. */
static CUresult take(struct device *d, bytes_t bytes) {
    if (d->nchunks == d->cap) {
        size_t cap = d->cap != 0 ? d->cap * 2 : 64;
        CUdeviceptr *grown = realloc(d->chunks, cap * sizeof *grown);
        if (grown == NULL) abort();
        d->chunks = grown;
        d->cap = cap;
    }
    CUdeviceptr ptr = 0;
    CUresult rc = cuMemAlloc_v2(&ptr, (size_t)bytes);
    if (rc == CUDA_SUCCESS) d->chunks[d->nchunks++] = ptr;
    return rc;
}

static void allocate(int index, const struct options *o) {
    struct device *d = &devices[index];
    size_t free_before = 0, free_after = 0, total = 0;
    REQUIRE(cuCtxSetCurrent(d->ctx));
    REQUIRE(cuMemGetInfo_v2(&free_before, &total));
    bytes_t reported_free = free_before;
    bytes_t target = o->max != 0 && o->max < reported_free ? o->max : reported_free;
    bytes_t granted = 0;
    CUresult refused = CUDA_SUCCESS;
    while (granted < target && refused == CUDA_SUCCESS) {
        bytes_t bytes = target - granted < o->chunk ? target - granted : o->chunk;
        refused = take(d, bytes);
        if (refused == CUDA_SUCCESS) granted += bytes;
    }
    /* Past the reported figure: the limit's own test. Not under --max-mib below it. */
    if (refused == CUDA_SUCCESS && target == reported_free) {
        refused = take(d, o->chunk);
        if (refused == CUDA_SUCCESS) granted += o->chunk;
    }
    REQUIRE(cuMemGetInfo_v2(&free_after, &total));
    char refused_with[16] = "null", refused_name[64] = "null";
    if (refused != CUDA_SUCCESS) {
        say("device %d: granted %llu MiB (%llu bytes) of %llu MiB reported free; the next allocation was refused "
            "with %s (%d)",
            index, granted / MiB, granted, reported_free / MiB, result_name(refused), (int)refused);
        snprintf(refused_with, sizeof refused_with, "%d", (int)refused);
        snprintf(refused_name, sizeof refused_name, "\"%s\"", result_name(refused));
    } else {
        say("device %d: granted %llu MiB (%llu bytes) of %llu MiB reported free; nothing was refused", index,
            granted / MiB, granted, reported_free / MiB);
    }
    emit("\"event\":\"alloc\",\"index\":%d,\"chunk\":%llu,\"reported_free\":%llu,\"granted\":%llu,"
         "\"refused_with\":%s,\"refused_name\":%s,\"total\":%llu,\"free\":%llu",
         index, o->chunk, reported_free, granted, refused_with, refused_name, (bytes_t)total, (bytes_t)free_after);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Launches on every device in turn until `seconds` pass, a launch fails or a signal comes. */
static void run_kernels(int count, double seconds) {
    double end = now_s() + seconds;
    int failed = 0;
    while (!failed && stop_signal == 0 && now_s() < end) {
        for (int i = 0; i < count && !failed; i++) {
            struct device *d = &devices[i];
            REQUIRE(cuCtxSetCurrent(d->ctx));
            d->launch_rc = cuLaunchKernel(d->kernel, 16, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL);
            if (d->launch_rc == CUDA_SUCCESS) d->launches++;
            else failed = 1;
        }
    }
    for (int i = 0; i < count; i++) {
        struct device *d = &devices[i];
        REQUIRE(cuCtxSetCurrent(d->ctx));
        CUresult rc = d->launch_rc != CUDA_SUCCESS ? d->launch_rc : cuCtxSynchronize();
        say("device %d: %llu kernel launches in %.1f s, %s (%d)", i, d->launches, seconds, result_name(rc), (int)rc);
        emit("\"event\":\"kernels\",\"index\":%d,\"seconds\":%.3f,\"launches\":%llu,\"result\":%d,\"result_name\":\"%s\"",
             i, seconds, d->launches, (int)rc, result_name(rc));
    }
}

static void release_all(int count) {
    for (int i = 0; i < count; i++) {
        struct device *d = &devices[i];
        if (cuCtxSetCurrent(d->ctx) != CUDA_SUCCESS) continue;
        for (size_t c = 0; c < d->nchunks; c++) cuMemFree_v2(d->chunks[c]);
        free(d->chunks);
        d->chunks = NULL;
        d->nchunks = d->cap = 0;
        cuCtxDestroy_v2(d->ctx);
    }
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct options o = parse(argc, argv);

    /* Signals are blocked outside sigsuspend, so one that comes before the wait is not lost. */
    sigset_t blocked, waiting;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    int version = 0, count = 0;
    REQUIRE(cuInit(0));
    REQUIRE(cuDriverGetVersion(&version));
    REQUIRE(cuDeviceGetCount(&count));
    if (count > MAX_DEVICES) count = MAX_DEVICES;
    say("driver: CUDA %d, %d device(s)", version, count);
    emit("\"event\":\"driver\",\"version\":%d,\"devices\":%d", version, count);

    for (int i = 0; i < count; i++) {
        CUdevice dev = 0;
        REQUIRE(cuDeviceGet(&dev, i));
        report_device(i, dev);
    }
    for (int i = 0; i < count; i++) allocate(i, &o);
    if (o.kernel_seconds > 0) run_kernels(count, o.kernel_seconds);

    sigprocmask(SIG_BLOCK, &blocked, &waiting);
    if (o.exit_when_ready) {
        say("ready: exiting (--exit)");
    } else {
        say("ready: holding the memory until SIGTERM");
    }
    emit("\"event\":\"ready\"");
    while (!o.exit_when_ready && stop_signal == 0) sigsuspend(&waiting);

    int signo = (int)stop_signal;
    release_all(count);
    say("exit: %s", signo != 0 ? strsignal(signo) : "done");
    emit("\"event\":\"exit\",\"signal\":%d", signo);
    return 0;
}
