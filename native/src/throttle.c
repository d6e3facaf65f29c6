/* The compute limiter's control law (see throttle.h for the design). */
#include "throttle.h"

#include <math.h>
#include <string.h>

/* Fraction of the way (in log space) the rate moves towards the one a measurement asks for: the
 * estimate does not depend on the rate, so any value in (0, 1] converges; 0.5 halves the noise
 * of a single estimate and still closes 97 % of a gap in five measurements. */
#define ALPHA 0.5
/* The most the rate changes on one measurement (a factor): a sample distorted by a burst or a
 * stall cannot throw the rate far. */
#define MAX_STEP 4.0
/* Budget that may be saved up while idle, in seconds of the current rate. */
#define BURST_S 0.05
/* Utilization below this (percent) is taken as this: NVML reports whole percents. */
#define UTIL_FLOOR 1.0
/* Measurements are pooled until they cover this many launches, or MAX_WINDOW_NS. */
#define MIN_LAUNCHES 8
#define MAX_WINDOW_NS 2000000000ULL
/* Probing: launches admitted before the first usable measurement, and how long probing waits
 * for one before admitting more anyway (so missing measurements never stop a program). */
#define PROBE_LAUNCHES 16
#define PROBE_STALL_NS 2000000000ULL
#define PROBE_WAIT_NS 1000000ULL

static void clear_pool(struct throttle *t) {
    t->pool_util_s = t->pool_cost = t->pool_s = 0;
    t->pool_launches = 0;
}

void throttle_init(struct throttle *t, unsigned target_percent, uint64_t now_ns) {
    memset(t, 0, sizeof *t);
    t->target = target_percent;
    t->refill_ns = now_ns;
    t->probe = PROBE_LAUNCHES;
    t->probe_ns = now_ns;
}

static void refill(struct throttle *t, uint64_t now_ns) {
    if (now_ns <= t->refill_ns) return;
    if (t->rate > 0) {
        t->tokens += t->rate * (double)(now_ns - t->refill_ns) * 1e-9;
        double cap = t->rate * BURST_S;
        if (t->tokens > cap) t->tokens = cap;
    }
    t->refill_ns = now_ns;
}

static void remember(struct throttle *t, double cost, int launches, uint64_t at_ns) {
    uint64_t id = at_ns / THROTTLE_BUCKET_NS + 1;
    struct throttle_bucket *b = &t->history[id % THROTTLE_BUCKETS];
    if (b->id != id) *b = (struct throttle_bucket){.id = id, .first_ns = at_ns, .last_ns = at_ns};
    if (at_ns < b->first_ns) b->first_ns = at_ns;
    if (at_ns > b->last_ns) b->last_ns = at_ns;
    b->cost += cost;
    if (launches < 0 && b->launches > 0) b->launches--;
    if (launches > 0) b->launches++;
    if (b->cost < 0) b->cost = 0;
}

uint64_t throttle_admit(struct throttle *t, double cost, uint64_t now_ns) {
    refill(t, now_ns);
    if (t->rate > 0) {
        if (t->tokens < 0) return (uint64_t)(-t->tokens / t->rate * 1e9) + 1;
        t->tokens -= cost;
    } else if (t->probed >= t->probe) {
        if (now_ns < t->probe_ns + PROBE_STALL_NS) return PROBE_WAIT_NS;
        /* No usable measurement came: probe on with more, so the program keeps going. */
        t->probe *= 4;
        t->probed = 0;
        t->probe_ns = now_ns;
    }
    if (t->rate <= 0) t->probed++;
    remember(t, cost, 1, now_ns);
    return 0;
}

void throttle_refund(struct throttle *t, double cost, uint64_t admitted_ns) {
    if (t->rate > 0) t->tokens += cost;
    if (t->rate <= 0 && t->probed > 0) t->probed--;
    remember(t, -cost, -1, admitted_ns);
}

/* Cost and launches admitted in (from, to], spreading each bucket evenly between its first and
 * last admission (so consecutive periods split a bucket without losing or doubling any of it). */
static void admitted(const struct throttle *t, uint64_t from, uint64_t to, double *cost, double *launches) {
    *cost = *launches = 0;
    uint64_t first = from / THROTTLE_BUCKET_NS + 1, last = to / THROTTLE_BUCKET_NS + 1;
    if (last - first >= THROTTLE_BUCKETS) first = last - THROTTLE_BUCKETS + 1;
    for (uint64_t id = first; id <= last; id++) {
        const struct throttle_bucket *b = &t->history[id % THROTTLE_BUCKETS];
        if (b->id != id) continue;
        double share;
        if (b->last_ns == b->first_ns) {
            share = (b->first_ns > from && b->first_ns <= to) ? 1 : 0;
        } else {
            uint64_t lo = from > b->first_ns ? from : b->first_ns, hi = to < b->last_ns ? to : b->last_ns;
            share = hi > lo ? (double)(hi - lo) / (double)(b->last_ns - b->first_ns) : 0;
        }
        *cost += b->cost * share;
        *launches += b->launches * share;
    }
}

void throttle_observe(struct throttle *t, double util_percent, uint64_t from_ns, uint64_t to_ns, uint64_t now_ns) {
    if (to_ns <= from_ns) return;
    double cost = 0, launches = 0, seconds = (double)(to_ns - from_ns) * 1e-9;
    admitted(t, from_ns, to_ns, &cost, &launches);
    t->pool_util_s += util_percent * seconds;
    t->pool_cost += cost;
    t->pool_s += seconds;
    t->pool_launches += (unsigned)(launches + 0.5);
    if (t->pool_launches < MIN_LAUNCHES && t->pool_s * 1e9 < (double)MAX_WINDOW_NS) return;

    double util = t->pool_util_s / t->pool_s, rho = t->pool_cost / t->pool_s;
    unsigned pooled = t->pool_launches;
    clear_pool(t);
    refill(t, now_ns);
    if (pooled == 0 || rho <= 0) return; /* idle: nothing to learn */
    if (t->rate <= 0) {
        if (util >= UTIL_FLOOR) {
            /* First usable measurement: go straight to the estimate, with an empty bucket. */
            t->rate = rho * t->target / util;
            t->tokens = 0;
        } else if (t->probed >= t->probe) {
            t->probe *= 4;
            t->probed = 0;
            t->probe_ns = now_ns;
        }
        return;
    }
    double wanted = rho * t->target / (util < UTIL_FLOOR ? UTIL_FLOOR : util);
    if (wanted > t->rate * MAX_STEP) wanted = t->rate * MAX_STEP;
    if (wanted < t->rate / MAX_STEP) wanted = t->rate / MAX_STEP;
    t->rate *= pow(wanted / t->rate, ALPHA);
}

double throttle_kernel_cost(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
    double threads = (double)gx * gy * gz * bx * by * bz;
    return threads < 1 ? 1 : threads;
}
