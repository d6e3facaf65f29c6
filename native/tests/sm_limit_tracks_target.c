/* The compute limiter's control law (src/throttle.c) against a simulated GPU, in simulated time.
 *
 *   sm_limit_tracks_target <scenario>     scenarios: the list in main()
 *
 * The model, stepped every 100 us:
 *  - Processes launch kernels asynchronously into one stream each, as fast as they can (greedy)
 *    or at an offered fraction of the GPU; a launch costs 5 us of host time, and the host blocks
 *    while 16 launches are in flight (the driver's queue). Kernel times vary +/-25 % at random.
 *  - The GPU time-slices: processes with queued work share it equally, and time one leaves
 *    unused goes to the others (work-conserving).
 *  - NVML samples every process's share of GPU time every 167 ms (or 1 s) in whole percents
 *    (in one scenario late and noisy).
 *  - Each process of a limited container polls every 50 ms, as the interposer's watcher thread
 *    does; on new samples it sums them over the container's processes (capped at 100) and hands
 *    the sum to throttle_observe with the period they cover (from the newest sample seen before
 *    to the newest now). Launches ask throttle_admit and wait what it says.
 *
 * For each checked interval it prints one line:
 *   check <name> container=<c> target=<t> mean=<mean %> settle_s=<s> peak=<max 1-s %>
 * where mean is over the second half of the interval, settle_s is the time from the start of
 * the interval until the 1-second utilization enters target +/- 5 and stays there (-1: never),
 * and peak is the highest 1-second utilization in the interval. tests/native/test_compute_limit.py
 * asserts on them. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/throttle.h"

#define STEP_NS 100000ULL
#define HOST_LAUNCH_NS 5000ULL
#define QUEUE_DEPTH 16
#define POLL_NS 50000000ULL
#define WINDOW_NS 1000000000ULL
#define MAX_PROCS 8
#define MAX_CONTAINERS 4
#define MAX_SAMPLES 4096
#define SETTLE_BAND 5.0

struct proc {
    int container;
    double kernel_ns; /* GPU time of one kernel with the GPU to itself */
    double threads;   /* grid x block of one kernel */
    double offered;   /* fraction of the GPU the program asks for; 0 = greedy */
    int depth;        /* launches in flight before the host blocks */
    /* state */
    double queued_ns;
    int inflight;
    double head_left_ns;
    uint64_t host_ready_ns;
    uint64_t next_due_ns;
    double busy_sample_ns; /* GPU time in the current NVML sample period */
    struct throttle t;
    int limited;
    uint64_t next_poll_ns;
    int seen_samples;
    uint64_t seen_until_ns; /* end of the period of the newest sample seen */
};

struct sample {
    uint64_t at_ns;      /* end of the period it covers (NVML's timestamp) */
    uint64_t visible_ns; /* when a poll first sees it */
    int proc;
    unsigned util;
};

struct sim {
    uint64_t now;
    int nprocs, ncontainers;
    struct proc p[MAX_PROCS];
    unsigned limit[MAX_CONTAINERS];
    uint64_t sample_ns, next_sample_ns;
    uint64_t sample_delay_ns; /* how long after its period a sample becomes visible */
    double noise;             /* +/- this many points of uniform noise on every sample */
    struct sample samples[MAX_SAMPLES];
    int nsamples;
    /* per container: GPU time per 100 ms bucket, for 1-second windows */
    double *bucket[MAX_CONTAINERS];
    size_t nbuckets;
    uint64_t rng;
};

static double uniform(struct sim *s) {
    s->rng = s->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(s->rng >> 11) / (double)(1ULL << 53);
}

static void sim_init(struct sim *s, double seconds, uint64_t sample_ns) {
    memset(s, 0, sizeof *s);
    s->sample_ns = sample_ns;
    s->next_sample_ns = sample_ns;
    s->nbuckets = (size_t)(seconds * 10) + 1;
    for (int c = 0; c < MAX_CONTAINERS; c++) s->bucket[c] = calloc(s->nbuckets, sizeof(double));
    s->rng = 0x9E3779B97F4A7C15ULL;
}

static int add_container(struct sim *s, unsigned limit) {
    s->limit[s->ncontainers] = limit;
    return s->ncontainers++;
}

static int add_proc(struct sim *s, int container, double kernel_ms, double threads, double offered) {
    struct proc *p = &s->p[s->nprocs];
    p->container = container;
    p->kernel_ns = kernel_ms * 1e6;
    p->threads = threads;
    p->offered = offered;
    p->depth = QUEUE_DEPTH;
    p->limited = s->limit[container] != 0;
    if (p->limited) throttle_init(&p->t, s->limit[container], 0);
    /* Watchers of different processes poll at different phases. */
    p->next_poll_ns = (uint64_t)(uniform(s) * POLL_NS);
    return s->nprocs++;
}

static void host_step(struct sim *s, struct proc *p) {
    while (p->host_ready_ns <= s->now) {
        if (p->inflight >= p->depth) return;
        if (p->offered > 0 && p->next_due_ns > s->now) {
            p->host_ready_ns = p->next_due_ns;
            return;
        }
        if (p->limited) {
            uint64_t wait = throttle_admit(&p->t, p->threads, s->now);
            if (wait != 0) {
                p->host_ready_ns = s->now + wait;
                return;
            }
        }
        double k = p->kernel_ns * (0.75 + 0.5 * uniform(s));
        if (p->inflight == 0) p->head_left_ns = k;
        p->queued_ns += k;
        p->inflight++;
        /* The host works through at most one step of launches it fell behind by. */
        if (p->host_ready_ns + STEP_NS < s->now) p->host_ready_ns = s->now - STEP_NS;
        p->host_ready_ns += HOST_LAUNCH_NS;
        if (p->offered > 0) {
            uint64_t gap = (uint64_t)(p->kernel_ns / p->offered);
            p->next_due_ns = (p->next_due_ns + gap > s->now) ? p->next_due_ns + gap : s->now + gap;
        }
    }
}

/* Runs GPU work of p for up to `budget` ns; returns what it used. */
static double run_on_gpu(struct proc *p, double budget) {
    double used = 0;
    while (p->inflight > 0 && budget - used > 1e-9) {
        double run = p->head_left_ns < budget - used ? p->head_left_ns : budget - used;
        p->head_left_ns -= run;
        p->queued_ns -= run;
        used += run;
        if (p->head_left_ns <= 1e-9) {
            p->inflight--;
            /* The next kernel's time is the queue left, split evenly (they were queued whole). */
            p->head_left_ns = p->inflight > 0 ? p->queued_ns / p->inflight : 0;
        }
    }
    if (p->inflight == 0) p->queued_ns = 0;
    return used;
}

static void gpu_step(struct sim *s) {
    double left = STEP_NS;
    int active[MAX_PROCS], n = 0;
    for (int i = 0; i < s->nprocs; i++) {
        if (s->p[i].inflight > 0) active[n++] = i;
    }
    /* Equal shares; what a process cannot use is shared again among the rest. */
    while (n > 0 && left > 1e-9) {
        double share = left / n;
        int still = 0;
        for (int j = 0; j < n; j++) {
            struct proc *p = &s->p[active[j]];
            double used = run_on_gpu(p, share);
            left -= used;
            p->busy_sample_ns += used;
            size_t b = (size_t)(s->now / 100000000ULL);
            if (b < s->nbuckets) s->bucket[p->container][b] += used;
            if (p->inflight > 0) active[still++] = active[j];
        }
        if (still == n) break;
        n = still;
    }
}

static void nvml_step(struct sim *s) {
    if (s->now < s->next_sample_ns) return;
    for (int i = 0; i < s->nprocs; i++) {
        struct proc *p = &s->p[i];
        double exact = p->busy_sample_ns / (double)s->sample_ns * 100.0;
        if (s->noise > 0 && exact > 0) exact += s->noise * (2 * uniform(s) - 1);
        unsigned util = exact <= 0 ? 0 : exact >= 100 ? 100 : (unsigned)exact;
        if (s->nsamples == MAX_SAMPLES) {
            memmove(s->samples, s->samples + MAX_SAMPLES / 2, sizeof(struct sample) * (MAX_SAMPLES / 2));
            s->nsamples = MAX_SAMPLES / 2;
            for (int j = 0; j < s->nprocs; j++)
                s->p[j].seen_samples = s->p[j].seen_samples > MAX_SAMPLES / 2 ? s->p[j].seen_samples - MAX_SAMPLES / 2 : 0;
        }
        s->samples[s->nsamples++] = (struct sample){s->now, s->now + s->sample_delay_ns, i, util};
        p->busy_sample_ns = 0;
    }
    s->next_sample_ns += s->sample_ns;
}

/* The watcher of process p: new samples -> the container's utilization -> throttle_observe. */
static void watcher_step(struct sim *s, struct proc *p) {
    if (!p->limited || s->now < p->next_poll_ns) return;
    p->next_poll_ns += POLL_NS;
    double sum[MAX_PROCS] = {0};
    int count[MAX_PROCS] = {0};
    int k = p->seen_samples;
    uint64_t newest = p->seen_until_ns;
    for (; k < s->nsamples && s->samples[k].visible_ns <= s->now; k++) {
        sum[s->samples[k].proc] += s->samples[k].util;
        count[s->samples[k].proc]++;
        if (s->samples[k].at_ns > newest) newest = s->samples[k].at_ns;
    }
    if (k == p->seen_samples) return;
    p->seen_samples = k;
    double util = 0;
    for (int i = 0; i < s->nprocs; i++) {
        if (s->p[i].container == p->container && count[i] > 0) util += sum[i] / count[i];
    }
    throttle_observe(&p->t, util > 100 ? 100 : util, p->seen_until_ns, newest, s->now);
    p->seen_until_ns = newest;
}

static void run_until(struct sim *s, double seconds) {
    uint64_t end = (uint64_t)(seconds * 1e9);
    while (s->now < end) {
        for (int i = 0; i < s->nprocs; i++) host_step(s, &s->p[i]);
        gpu_step(s);
        s->now += STEP_NS;
        nvml_step(s);
        for (int i = 0; i < s->nprocs; i++) watcher_step(s, &s->p[i]);
    }
}

/* Utilization (%) of a container over the 1-second window ending at bucket b (exclusive). */
static double window_util(const struct sim *s, int c, size_t b) {
    double busy = 0;
    for (size_t i = b - 10; i < b; i++) busy += s->bucket[c][i];
    return busy / (double)WINDOW_NS * 100.0;
}

static void check(const struct sim *s, const char *name, int c, double want, double from_s, double to_s) {
    size_t first = (size_t)(from_s * 10 + 0.5) + 10, last = (size_t)(to_s * 10 + 0.5);
    double settle = -1, peak = 0, mean = 0;
    int in_band_since = -1;
    for (size_t b = first; b <= last; b++) {
        double u = window_util(s, c, b);
        if (u > peak) peak = u;
        if (fabs(u - want) <= SETTLE_BAND) {
            if (in_band_since < 0) in_band_since = (int)b;
        } else {
            in_band_since = -1;
        }
    }
    if (in_band_since >= 0) settle = (in_band_since - 10) / 10.0 - from_s + 1.0;
    double mid = (from_s + to_s) / 2;
    double busy = 0;
    for (size_t b = (size_t)(mid * 10 + 0.5); b < last; b++) busy += s->bucket[c][b];
    mean = busy / ((double)(last - (size_t)(mid * 10 + 0.5)) * 1e8) * 100.0;
    printf("check %s container=%d target=%.0f mean=%.2f settle_s=%.1f peak=%.1f\n", name, c, want, mean, settle,
           peak);
}

/* ---- scenarios */

#define A100_KERNEL_THREADS (432.0 * 256.0) /* 432 blocks of 256 threads */

static void single(struct sim *s, unsigned target) {
    sim_init(s, 30, 167000000ULL);
    int c = add_container(s, target);
    add_proc(s, c, 2.0, A100_KERNEL_THREADS, 0);
    run_until(s, 30);
    char name[32];
    snprintf(name, sizeof name, "single-%u", target);
    check(s, name, c, target, 0, 30);
}

static void slow_nvml(struct sim *s) {
    sim_init(s, 60, 1000000000ULL);
    int c = add_container(s, 30);
    add_proc(s, c, 2.0, A100_KERNEL_THREADS, 0);
    run_until(s, 60);
    check(s, "slow-nvml", c, 30, 0, 60);
}

static void noisy_nvml(struct sim *s) {
    /* Samples visible only 333 ms after their period, each off by up to +/-5 points. */
    sim_init(s, 30, 167000000ULL);
    s->sample_delay_ns = 333000000ULL;
    s->noise = 5;
    int c = add_container(s, 30);
    add_proc(s, c, 2.0, A100_KERNEL_THREADS, 0);
    run_until(s, 30);
    check(s, "noisy-nvml", c, 30, 0, 30);
}

static void load_step(struct sim *s) {
    /* Greedy, then asking for only 20 % (below the limit: not throttled), then greedy again. */
    sim_init(s, 45, 167000000ULL);
    int c = add_container(s, 50);
    int p = add_proc(s, c, 2.0, A100_KERNEL_THREADS, 0);
    run_until(s, 15);
    check(s, "greedy", c, 50, 0, 15);
    s->p[p].offered = 0.2;
    run_until(s, 30);
    check(s, "light-load", c, 20, 15, 30);
    s->p[p].offered = 0;
    run_until(s, 45);
    check(s, "greedy-again", c, 50, 30, 45);
}

static void block_size_step(struct sim *s) {
    /* The program switches to kernels with 4x the threads per block, which take 4x as long:
     * the cost follows the block size, so the pacing is right from the first launch. */
    sim_init(s, 30, 167000000ULL);
    int c = add_container(s, 30);
    int p = add_proc(s, c, 1.0, A100_KERNEL_THREADS, 0);
    run_until(s, 15);
    check(s, "small-blocks", c, 30, 0, 15);
    s->p[p].kernel_ns *= 4;
    s->p[p].threads *= 4;
    run_until(s, 30);
    check(s, "large-blocks", c, 30, 15, 30);
}

static void kernel_slowdown(struct sim *s) {
    /* Same launches, 4x the GPU time each (e.g. more work per thread): the cost model is now
     * wrong by 4x, and the feedback has to find the new rate. */
    sim_init(s, 30, 167000000ULL);
    int c = add_container(s, 30);
    int p = add_proc(s, c, 1.0, A100_KERNEL_THREADS, 0);
    run_until(s, 15);
    s->p[p].kernel_ns *= 4;
    run_until(s, 30);
    check(s, "kernels-4x-longer", c, 30, 15, 30);
}

static void three_processes(struct sim *s) {
    sim_init(s, 30, 167000000ULL);
    int c = add_container(s, 40);
    add_proc(s, c, 0.5, 64.0 * 128, 0);
    add_proc(s, c, 1.0, A100_KERNEL_THREADS, 0);
    add_proc(s, c, 3.0, 1024.0 * 1024, 0);
    run_until(s, 30);
    check(s, "three-processes", c, 40, 0, 30);
}

static void two_containers(struct sim *s, unsigned a, unsigned b) {
    sim_init(s, 30, 167000000ULL);
    int ca = add_container(s, a), cb = add_container(s, b);
    add_proc(s, ca, 2.0, A100_KERNEL_THREADS, 0);
    add_proc(s, cb, 1.5, A100_KERNEL_THREADS, 0);
    run_until(s, 30);
    char name[48];
    snprintf(name, sizeof name, "containers-%u-%u", a, b);
    check(s, name, ca, a, 0, 30);
    check(s, name, cb, b, 0, 30);
}

static void beside_unlimited(struct sim *s) {
    sim_init(s, 30, 167000000ULL);
    int ca = add_container(s, 30), cb = add_container(s, 0);
    add_proc(s, ca, 2.0, A100_KERNEL_THREADS, 0);
    add_proc(s, cb, 1.0, A100_KERNEL_THREADS, 0);
    run_until(s, 30);
    check(s, "beside-unlimited", ca, 30, 0, 30);
    check(s, "beside-unlimited", cb, 70, 0, 30);
}

static void neighbour_arrives(struct sim *s) {
    /* A limited container alone, then an unlimited greedy neighbour starts, then leaves. */
    sim_init(s, 45, 167000000ULL);
    int ca = add_container(s, 40), cb = add_container(s, 0);
    add_proc(s, ca, 2.0, A100_KERNEL_THREADS, 0);
    int q = add_proc(s, cb, 1.0, A100_KERNEL_THREADS, 0.0001);
    run_until(s, 15);
    check(s, "alone", ca, 40, 0, 15);
    s->p[q].offered = 0;
    run_until(s, 30);
    check(s, "with-neighbour", ca, 40, 15, 30);
    s->p[q].offered = 0.0001;
    run_until(s, 45);
    check(s, "neighbour-gone", ca, 40, 30, 45);
}

static void no_samples(struct sim *s) {
    /* NVML never delivers a sample: the limiter must not stop the program (it fails open). */
    sim_init(s, 30, 3600000000000ULL);
    int c = add_container(s, 30);
    add_proc(s, c, 2.0, A100_KERNEL_THREADS, 0);
    run_until(s, 30);
    check(s, "no-samples", c, 100, 0, 30);
}

static void kernel_sizes(struct sim *s, const char *name, double kernel_ms, int depth, unsigned target) {
    sim_init(s, 40, 167000000ULL);
    int c = add_container(s, target);
    int p = add_proc(s, c, kernel_ms, A100_KERNEL_THREADS, 0);
    s->p[p].depth = depth;
    run_until(s, 40);
    check(s, name, c, target, 0, 40);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <scenario>\n", argv[0]);
        return 2;
    }
    static struct sim s;
    const char *name = argv[1];
    if (strncmp(name, "single-", 7) == 0) single(&s, (unsigned)atoi(name + 7));
    else if (strcmp(name, "slow-nvml") == 0) slow_nvml(&s);
    else if (strcmp(name, "noisy-nvml") == 0) noisy_nvml(&s);
    else if (strcmp(name, "load-step") == 0) load_step(&s);
    else if (strcmp(name, "block-size-step") == 0) block_size_step(&s);
    else if (strcmp(name, "kernel-slowdown") == 0) kernel_slowdown(&s);
    else if (strcmp(name, "three-processes") == 0) three_processes(&s);
    else if (strcmp(name, "containers-30-60") == 0) two_containers(&s, 30, 60);
    else if (strcmp(name, "containers-10-90") == 0) two_containers(&s, 10, 90);
    else if (strcmp(name, "beside-unlimited") == 0) beside_unlimited(&s);
    else if (strcmp(name, "neighbour-arrives") == 0) neighbour_arrives(&s);
    else if (strcmp(name, "no-samples") == 0) no_samples(&s);
    else if (strcmp(name, "deep-queue") == 0) kernel_sizes(&s, name, 2.0, 1024, 30);
    else if (strcmp(name, "long-kernels") == 0) kernel_sizes(&s, name, 50.0, 16, 30);
    else if (strcmp(name, "long-kernels-10") == 0) kernel_sizes(&s, name, 50.0, 16, 10);
    else if (strcmp(name, "tiny-kernels") == 0) kernel_sizes(&s, name, 0.02, 16, 30);
    else if (strcmp(name, "deep-long") == 0) kernel_sizes(&s, name, 20.0, 1024, 30);
    else {
        fprintf(stderr, "unknown scenario %s\n", name);
        return 2;
    }
    return 0;
}
