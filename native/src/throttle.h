/* The compute (SM) limiter's control law: pure arithmetic on numbers handed in, with no I/O, no
 * clock and no globals, so the same code runs in libvgpu.so and in the simulated-GPU test
 * (tests/sm_limit_tracks_target.c). Design and limits: docs/isolation.md, "Compute limit".
 *
 * Actuator: a token bucket per (process, device). A launch costs its thread count
 * (grid x block); the bucket refills at `rate` cost units per second; a launch is admitted
 * while the bucket is not in debt and may take it into debt (so a kernel of any size passes,
 * and the average admitted cost rate is exactly `rate`). Before the first usable measurement the
 * rate is 0 ("probing"): PROBE_LAUNCHES launches are admitted, four times more after each
 * measurement too light to use, so an unknown kernel size cannot queue a long backlog before the
 * controller has a number.
 *
 * Estimator and controller: the bucket remembers what it admitted in each 32 ms of the last
 * four seconds (and when the first and last of it were). A measurement is the container's utilization u over a stated period [from, to]
 * (an NVML sample covers the sample period before its timestamp, and reaches us later); the cost
 * rho admitted in that same period gives the GPU time per cost unit, u / rho, and so the rate
 * that meets the target, rho * target / u. Matching the periods makes the estimate independent
 * of how late samples arrive, which is what makes feedback on NVML's slow, delayed samples
 * settle instead of oscillate. The rate moves a fraction ALPHA of the way there in log space
 * (smoothing the estimate's noise), at most a factor MAX_STEP per measurement.
 *
 * Being multiplicative, the update composes across processes: every process of a container
 * scales its own rate by the same factor, so the container's total scales by that factor,
 * whatever the number of processes. Being based on rho rather than on the rate, it does not wind
 * up while the program uses less than its share. Measurements are pooled until they cover
 * MIN_LAUNCHES launches (or MAX_WINDOW_NS), so that a few long kernels per sample do not turn
 * into a noisy, biased ratio. */
#ifndef HAMIPY_THROTTLE_H
#define HAMIPY_THROTTLE_H

#include <stdint.h>

#define THROTTLE_BUCKET_NS 32000000ULL
#define THROTTLE_BUCKETS 128

struct throttle_bucket {
    uint64_t id;                /* time / THROTTLE_BUCKET_NS + 1; 0 = empty */
    uint64_t first_ns, last_ns; /* the first and last admission in it */
    double cost;
    unsigned launches;
};

struct throttle {
    double target;      /* percent of the GPU, in (0, 100) */
    double rate;        /* admitted cost units per second; 0 = probing */
    double tokens;      /* cost units that may be admitted now; negative = debt */
    uint64_t refill_ns; /* when tokens were last brought up to date */
    struct throttle_bucket history[THROTTLE_BUCKETS]; /* admitted, by time */
    /* measurements pooled so far: utilization x seconds, cost, launches, seconds */
    double pool_util_s, pool_cost, pool_s;
    unsigned pool_launches;
    /* probing: launches allowed, admitted, and since when (monotonic ns) */
    unsigned probe, probed;
    uint64_t probe_ns;
};

/* A limiter for `target_percent` (1..99), probing until its first usable measurement. */
void throttle_init(struct throttle *t, unsigned target_percent, uint64_t now_ns);

/* Asks to launch work of `cost` units at now_ns. Returns 0 when admitted (the cost is taken
 * from the bucket), else how many nanoseconds to wait before asking again. */
uint64_t throttle_admit(struct throttle *t, double cost, uint64_t now_ns);

/* Gives back the cost of a launch admitted at admitted_ns that the driver refused. */
void throttle_refund(struct throttle *t, double cost, uint64_t admitted_ns);

/* A measurement: the container's utilization in percent over [from_ns, to_ns], known at now_ns. */
void throttle_observe(struct throttle *t, double util_percent, uint64_t from_ns, uint64_t to_ns, uint64_t now_ns);

/* Cost of a kernel launch: its thread count (grid x block), at least 1. */
double throttle_kernel_cost(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz);

#endif
