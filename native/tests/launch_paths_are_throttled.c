/* Kernel launches of every kind, as a program of a container would make them:
 *
 *   launch_paths_are_throttled loop <path> <seconds> <from>
 *       launches as fast as it can by <path> for <seconds>, then prints
 *       "util=<percent> launches=<n> sm_util=<percent>": util is the fake GPU time its launches
 *       executed from second <from> to the end, as a percentage of that wall time
 *       (fakecuda_executed_ns); sm_util is what its region slot says (device_util[0].sm_util).
 *   launch_paths_are_throttled capture <count>
 *       captures <count> launches of cuLaunchKernel into a graph (cuStreamBeginCapture_v2 ...
 *       cuStreamEndCapture) and prints "captured=<count> ms=<wall time of the captures>".
 *   launch_paths_are_throttled refused
 *       launches by every path with a configuration the driver refuses (an empty grid, a NULL
 *       graph) and checks that the driver's error comes back; prints "ok".
 *   launch_paths_are_throttled once <path>
 *       prints "launching", launches once and prints "launched rc=<code>"; then once more for
 *       every line read on stdin, until it closes.
 *   launch_paths_are_throttled bench <count>
 *       times <count> launches of an empty kernel through cuLaunchKernel and prints
 *       "ns_per_launch=<ns>" (tests/bench/bench_launch.py). On a real GPU the kernel is real
 *       (embedded PTX); over the fake driver the launch takes no GPU time.
 *
 * <path> is the driver function: cuLaunchKernel is called by its exported symbol; the others
 * are looked up with cuGetProcAddress_v2 (cudaVersion 12000, the _ptsz ones with the per-thread
 * default stream flag), as cudart and PyTorch do. Graph launches use a made-up exec handle, which
 * only the fake driver accepts. A kernel is 16 blocks of 256 threads. */
#define _GNU_SOURCE
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

unsigned long long fakecuda_executed_ns(int dev);

typedef CUresult (*kernel_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void **);
typedef CUresult (*ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*graph_fn)(CUgraphExec, CUstream);

static const char NOOP_PTX[] = ".version 6.0\n.target sm_50\n.address_size 64\n.visible .entry noop()\n{\n ret;\n}\n";

#define GRID 16
#define BLOCK 256

struct launcher {
    const char *path;
    CUfunction kernel;
    void *fn;
    enum { KERNEL, COOP, EX, GRAPH } kind;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static struct launcher make_launcher(const char *path) {
    struct launcher l = {.path = path};
    CUmodule module = NULL;
    CHECK_RC(cuModuleLoadData(&module, NOOP_PTX), CUDA_SUCCESS);
    CHECK_RC(cuModuleGetFunction(&l.kernel, module, "noop"), CUDA_SUCCESS);
    size_t len = strlen(path);
    int ptsz = len > 5 && strcmp(path + len - 5, "_ptsz") == 0;
    char base[64];
    snprintf(base, sizeof base, "%.*s", (int)(ptsz ? len - 5 : len), path);
    if (strcmp(base, "cuLaunchKernel") == 0) l.kind = KERNEL;
    else if (strcmp(base, "cuLaunchCooperativeKernel") == 0) l.kind = COOP;
    else if (strcmp(base, "cuLaunchKernelEx") == 0) l.kind = EX;
    else if (strcmp(base, "cuGraphLaunch") == 0) l.kind = GRAPH;
    else {
        fprintf(stderr, "unknown path %s\n", path);
        exit(2);
    }
    if (strcmp(path, "cuLaunchKernel") == 0) {
        l.fn = (void *)&cuLaunchKernel;
    } else {
        CUdriverProcAddressQueryResult status;
        cuuint64_t flags = ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
        CHECK_RC(cuGetProcAddress_v2(base, &l.fn, 12000, flags, &status), CUDA_SUCCESS);
    }
    CHECK(l.fn != NULL);
    return l;
}

static CUresult launch(const struct launcher *l) {
    switch (l->kind) {
    case KERNEL: return ((kernel_fn)l->fn)(l->kernel, GRID, 1, 1, BLOCK, 1, 1, 0, NULL, NULL, NULL);
    case COOP: return ((coop_fn)l->fn)(l->kernel, GRID, 1, 1, BLOCK, 1, 1, 0, NULL, NULL);
    case EX: {
        CUlaunchConfig config = {.gridDimX = GRID, .gridDimY = 1, .gridDimZ = 1, .blockDimX = BLOCK,
                                 .blockDimY = 1, .blockDimZ = 1};
        return ((ex_fn)l->fn)(&config, l->kernel, NULL, NULL);
    }
    case GRAPH: return ((graph_fn)l->fn)((CUgraphExec)(uintptr_t)0x6a000, NULL);
    }
    return CUDA_ERROR_UNKNOWN;
}

static int loop(const char *path, double seconds, double from) {
    test_context();
    struct launcher l = make_launcher(path);
    uint64_t start = now_ns(), from_ns = start + (uint64_t)(from * 1e9), end = start + (uint64_t)(seconds * 1e9);
    uint64_t t0 = 0, e0 = 0;
    unsigned long long launches = 0;
    for (uint64_t now = start; now < end; now = now_ns()) {
        if (t0 == 0 && now >= from_ns) {
            t0 = now;
            e0 = fakecuda_executed_ns(0);
        }
        CHECK_RC(launch(&l), CUDA_SUCCESS);
        launches++;
    }
    uint64_t t1 = now_ns(), e1 = fakecuda_executed_ns(0);
    CHECK(t0 != 0);
    unsigned long long sm_util = 0;
    const struct hami_region *r = test_region();
    for (int i = 0; i < r->proc_num; i++) {
        if (r->procs[i].status != 0 && r->procs[i].pid == getpid()) sm_util = r->procs[i].device_util[0].sm_util;
    }
    printf("util=%.1f launches=%llu sm_util=%llu\n", (double)(e1 - e0) / (double)(t1 - t0) * 100.0, launches,
           sm_util);
    return 0;
}

static int refused(void) {
    static const char *const paths[] = {"cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx",
                                         "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel",
                                         "cuLaunchCooperativeKernel_ptsz", "cuGraphLaunch", "cuGraphLaunch_ptsz"};
    test_context();
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        struct launcher l = make_launcher(paths[i]);
        CUlaunchConfig empty = {.gridDimX = 0, .gridDimY = 1, .gridDimZ = 1, .blockDimX = BLOCK, .blockDimY = 1,
                                .blockDimZ = 1};
        CUresult rc = CUDA_SUCCESS;
        switch (l.kind) {
        case KERNEL: rc = ((kernel_fn)l.fn)(l.kernel, 0, 1, 1, BLOCK, 1, 1, 0, NULL, NULL, NULL); break;
        case COOP: rc = ((coop_fn)l.fn)(l.kernel, 0, 1, 1, BLOCK, 1, 1, 0, NULL, NULL); break;
        case EX: rc = ((ex_fn)l.fn)(&empty, l.kernel, NULL, NULL); break;
        case GRAPH: rc = ((graph_fn)l.fn)(NULL, NULL); break;
        }
        if (rc != CUDA_ERROR_INVALID_VALUE) {
            fprintf(stderr, "%s: rc=%d, want %d\n", paths[i], (int)rc, (int)CUDA_ERROR_INVALID_VALUE);
            return 1;
        }
    }
    printf("ok\n");
    return 0;
}

static int once(const char *path) {
    test_context();
    struct launcher l = make_launcher(path);
    char line[64];
    printf("launching\n");
    fflush(stdout);
    do {
        printf("launched rc=%d\n", (int)launch(&l));
        fflush(stdout);
    } while (fgets(line, sizeof line, stdin) != NULL);
    return 0;
}

static int capture(unsigned long long count) {
    test_context();
    struct launcher l = make_launcher("cuLaunchKernel");
    CUstream stream = NULL;
    CUgraph graph = NULL;
    CHECK_RC(cuStreamCreate(&stream, 0), CUDA_SUCCESS);
    CHECK_RC(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
    uint64_t start = now_ns();
    for (unsigned long long i = 0; i < count; i++)
        CHECK_RC(((kernel_fn)l.fn)(l.kernel, GRID, 1, 1, BLOCK, 1, 1, 0, stream, NULL, NULL), CUDA_SUCCESS);
    uint64_t elapsed = now_ns() - start;
    CHECK_RC(cuStreamEndCapture(stream, &graph), CUDA_SUCCESS);
    printf("captured=%llu ms=%.1f\n", count, (double)elapsed / 1e6);
    return 0;
}

static int bench(unsigned long long count) {
    test_context();
    struct launcher l = make_launcher("cuLaunchKernel");
    kernel_fn fn = (kernel_fn)l.fn;
    for (int i = 0; i < 1000; i++) CHECK_RC(fn(l.kernel, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), CUDA_SUCCESS);
    uint64_t start = now_ns();
    for (unsigned long long i = 0; i < count; i++) fn(l.kernel, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
    uint64_t elapsed = now_ns() - start;
    CHECK_RC(cuCtxSynchronize(), CUDA_SUCCESS);
    printf("ns_per_launch=%.2f\n", (double)elapsed / (double)count);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "loop") == 0) return loop(argv[2], atof(argv[3]), atof(argv[4]));
    if (argc == 3 && strcmp(argv[1], "once") == 0) return once(argv[2]);
    if (argc == 3 && strcmp(argv[1], "bench") == 0) return bench(strtoull(argv[2], NULL, 10));
    if (argc == 2 && strcmp(argv[1], "refused") == 0) return refused();
    if (argc == 3 && strcmp(argv[1], "capture") == 0) return capture(strtoull(argv[2], NULL, 10));
    fprintf(stderr, "usage: %s loop <path> <seconds> <from> | once <path> | capture <count> | refused | bench <count>\n",
            argv[0]);
    return 2;
}
