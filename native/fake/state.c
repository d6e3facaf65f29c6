/* The fake driver's state shared by all processes using one configuration: how many bytes each
 * live process holds on each fake GPU, so NVML in another process (the device plugin, the
 * monitor) sees real usage and process lists. Entries of dead processes are ignored and reused. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"

#define STATE_MAGIC 0x46414b48u /* bumped when the layout changes */

static int own = -1;
static const struct fake_config *conf; /* maps a device index to its slot in the state */

static int slot(int dev) { return conf != NULL && dev >= 0 && dev < conf->count ? conf->gpus[dev].slot : dev; }

/* The GPU instance a configured device is (a resolved `uuid=MIG-...` line), -1 for a whole GPU. */
static int gi_of(int dev) { return conf != NULL && dev >= 0 && dev < conf->count ? conf->gpus[dev].gi : -1; }
static int ci_of(int dev) { return conf != NULL && dev >= 0 && dev < conf->count ? conf->gpus[dev].ci : -1; }

static uint64_t start_time(pid_t pid, int *gone) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    *gone = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        *gone = errno == ENOENT;
        return 0;
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] == '\0') return 0;
    p += 2;
    *gone = (*p == 'Z' || *p == 'X');
    for (int field = 3; field < 22 && p != NULL; field++) {
        p = strchr(p, ' ');
        if (p != NULL) p++;
    }
    return p == NULL ? 0 : strtoull(p, NULL, 10);
}

static uint64_t pidns_of(const char *proc_dir) {
    char path[320];
    struct stat sb;
    snprintf(path, sizeof path, "%s/ns/pid", proc_dir);
    return stat(path, &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

static uint64_t own_pidns(void) {
    static uint64_t ns;
    if (ns == 0) ns = pidns_of("/proc/self");
    return ns;
}

/* The innermost pid of /proc/<dir>/status's NSpid line: the process's pid in its own namespace. */
static pid_t innermost_pid(const char *proc_dir) {
    char path[320], line[256];
    snprintf(path, sizeof path, "%s/status", proc_dir);
    FILE *f = fopen(path, "re");
    if (f == NULL) return 0;
    pid_t last = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        if (strncmp(line, "NSpid:", 6) != 0) continue;
        char *save = NULL;
        for (char *tok = strtok_r(line + 6, " \t\n", &save); tok != NULL; tok = strtok_r(NULL, " \t\n", &save)) {
            last = (pid_t)atoi(tok);
        }
        break;
    }
    fclose(f);
    return last;
}

/* Whether this process sees every PID namespace: it is in the initial one (the kernel's
 * PROC_PID_INIT_INO). A container's own /proc lists one pid in NSpid too, so that cannot tell. */
static int sees_all(void) { return own_pidns() == 0xEFFFFFFCu; }

/* The pid, as this process sees it, of the process that is `pid` in namespace `ns`; 0 if none is
 * visible here. */
static pid_t visible_pid(uint64_t ns, pid_t pid) {
    DIR *proc = opendir("/proc");
    if (proc == NULL) return 0;
    pid_t found = 0;
    struct dirent *e;
    while (found == 0 && (e = readdir(proc)) != NULL) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        char dir[300];
        snprintf(dir, sizeof dir, "/proc/%.255s", e->d_name);
        if (pidns_of(dir) == ns && innermost_pid(dir) == pid) found = (pid_t)atoi(e->d_name);
    }
    closedir(proc);
    return found;
}

/* 1: entry i's process is alive; 0: it is gone; -1: it lives in a PID namespace this process does
 * not see into (another container's), so it cannot tell. */
static int liveness(const struct fake_state *st, int i, pid_t *seen_as) {
    pid_t pid = st->procs[i].pid;
    *seen_as = pid;
    if (pid <= 0) return 0;
    if (st->procs[i].pidns != 0 && st->procs[i].pidns != own_pidns()) {
        pid = visible_pid(st->procs[i].pidns, pid);
        if (pid == 0) return sees_all() ? 0 : -1;
        *seen_as = pid;
    }
    if (kill(pid, 0) == -1 && errno == ESRCH) return 0;
    int gone = 0;
    uint64_t started = start_time(pid, &gone);
    return !gone && !(started != 0 && st->procs[i].start != 0 && started != st->procs[i].start);
}

/* Entry i counts as a live process (one that cannot be told is counted: its use is real until a
 * process that sees every namespace finds it gone and frees the entry); *seen_as is the pid this
 * process knows it by (the host's pid, as NVML reports, where it can tell). */
static int alive_as(struct fake_state *st, int i, pid_t *seen_as) {
    int live = liveness(st, i, seen_as);
    if (live == 0 && st->procs[i].pid > 0 && st->procs[i].pidns != 0 && st->procs[i].pidns != own_pidns())
        memset(&st->procs[i], 0, sizeof st->procs[i]); /* gone for good: nobody else could tell */
    return live != 0;
}

static int alive(struct fake_state *st, int i) {
    pid_t seen_as = 0;
    return alive_as(st, i, &seen_as);
}

static void lock(struct fake_state *st) {
    if (pthread_mutex_lock(&st->mu) == EOWNERDEAD) pthread_mutex_consistent(&st->mu);
}

static void unlock(struct fake_state *st) { pthread_mutex_unlock(&st->mu); }

struct fake_state *fake_state_attach(const struct fake_config *cfg, int claim) {
    conf = cfg;
    int fd = open(cfg->state_path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        fprintf(stderr, "hami-py fake driver: cannot open state %s: %s\n", cfg->state_path, strerror(errno));
        return NULL;
    }
    (void)fchmod(fd, 0666);
    flock(fd, LOCK_EX);
    struct stat sb;
    if (fstat(fd, &sb) == 0 && (size_t)sb.st_size < sizeof(struct fake_state) &&
        ftruncate(fd, sizeof(struct fake_state)) != 0) {
        flock(fd, LOCK_UN);
        close(fd);
        return NULL;
    }
    struct fake_state *st = mmap(NULL, sizeof *st, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (st == MAP_FAILED) {
        flock(fd, LOCK_UN);
        close(fd);
        return NULL;
    }
    if (st->magic != STATE_MAGIC) {
        memset(st, 0, sizeof *st);
        pthread_mutexattr_t attr;
        pthread_mutexattr_init(&attr);
        pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&st->mu, &attr);
        pthread_mutexattr_destroy(&attr);
        fake_mig_apply_config(st, cfg);
        st->magic = STATE_MAGIC;
    }
    flock(fd, LOCK_UN);
    close(fd);
    if (claim) {
        lock(st);
        pid_t self = getpid();
        int gone = 0;
        for (int i = 0; i < FAKE_MAX_PROCS && own < 0; i++) {
            /* Its own entry of an earlier attach, or a free one: another container's process may
             * have the same pid in its own namespace. */
            int mine = st->procs[i].pid == self && (st->procs[i].pidns == 0 || st->procs[i].pidns == own_pidns());
            if (mine || !alive(st, i)) {
                memset(&st->procs[i], 0, sizeof st->procs[i]);
                st->procs[i].pid = self;
                st->procs[i].start = start_time(self, &gone);
                st->procs[i].pidns = own_pidns();
                own = i;
            }
        }
        unlock(st);
        if (own < 0) fprintf(stderr, "hami-py fake driver: no free process entry in %s\n", cfg->state_path);
    }
    return st;
}

int fake_state_charge(struct fake_state *st, int dev, uint64_t bytes, uint64_t physical) {
    int gi = gi_of(dev), ci = ci_of(dev);
    dev = slot(dev);
    if (own < 0) return -1;
    lock(st);
    uint64_t used = 0;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        uint64_t held = gi < 0 ? st->procs[i].used[dev] : st->procs[i].gi_used[dev][gi];
        if (held != 0 && (i == own || alive(st, i))) used += held;
    }
    int rc = (bytes > physical || used > physical - bytes) ? -1 : 0;
    if (rc == 0) {
        st->procs[own].used[dev] += bytes;
        if (gi >= 0) {
            st->procs[own].gi_used[dev][gi] += bytes;
            st->procs[own].gi_ci[dev][gi] = (uint8_t)ci;
        }
    }
    unlock(st);
    return rc;
}

void fake_state_uncharge(struct fake_state *st, int dev, uint64_t bytes) {
    int gi = gi_of(dev);
    dev = slot(dev);
    if (own < 0) return;
    lock(st);
    uint64_t *used = &st->procs[own].used[dev];
    *used = *used > bytes ? *used - bytes : 0;
    if (gi >= 0) {
        used = &st->procs[own].gi_used[dev][gi];
        *used = *used > bytes ? *used - bytes : 0;
    }
    unlock(st);
}

void fake_state_leave(struct fake_state *st) {
    if (own < 0) return;
    lock(st);
    memset(&st->procs[own], 0, sizeof st->procs[own]);
    unlock(st);
    own = -1;
}

uint64_t fake_state_used(struct fake_state *st, int dev) {
    int gi = gi_of(dev);
    dev = slot(dev);
    uint64_t used = 0;
    lock(st);
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        uint64_t held = gi < 0 ? st->procs[i].used[dev] : st->procs[i].gi_used[dev][gi];
        if (held != 0 && alive(st, i)) used += held;
    }
    unlock(st);
    return used;
}

/* The bytes entry i holds on the slot, its GPU instance in *gi and compute instance in *ci (~0u
 * when on the whole GPU); want_gi/want_ci < 0 match any. */
static uint64_t held_at(const struct fake_state *st, int i, int slot_, int want_gi, int want_ci, unsigned *gi,
                        unsigned *ci) {
    *gi = *ci = ~0u;
    if (want_gi < 0) {
        for (int g = 0; g < FAKE_MAX_GIS; g++) {
            if (st->procs[i].gi_used[slot_][g] != 0) {
                *gi = (unsigned)g;
                *ci = st->procs[i].gi_ci[slot_][g];
            }
        }
        return st->procs[i].used[slot_];
    }
    uint64_t held = st->procs[i].gi_used[slot_][want_gi];
    if (held == 0 || (want_ci >= 0 && st->procs[i].gi_ci[slot_][want_gi] != (uint8_t)want_ci)) return 0;
    *gi = (unsigned)want_gi;
    *ci = st->procs[i].gi_ci[slot_][want_gi];
    return held;
}

unsigned fake_state_procs_at(struct fake_state *st, int slot_, int want_gi, int want_ci, unsigned max, unsigned *pids,
                             uint64_t *used, unsigned *gis, unsigned *cis) {
    unsigned n = 0;
    if (slot_ < 0 || slot_ >= FAKE_MAX_GPUS || want_gi >= FAKE_MAX_GIS) return 0;
    lock(st);
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        pid_t seen_as = 0;
        unsigned gi = 0, ci = 0;
        uint64_t held = held_at(st, i, slot_, want_gi, want_ci, &gi, &ci);
        if (held == 0 || !alive_as(st, i, &seen_as)) continue;
        if (n < max) {
            pids[n] = (unsigned)seen_as;
            used[n] = held;
            if (gis != NULL) gis[n] = gi;
            if (cis != NULL) cis[n] = ci;
        }
        n++;
    }
    unlock(st);
    return n;
}

unsigned fake_state_procs(struct fake_state *st, int dev, unsigned max, unsigned *pids, uint64_t *used) {
    return fake_state_procs_at(st, slot(dev), gi_of(dev), -1, max, pids, used, NULL, NULL);
}

void fake_state_lock(struct fake_state *st) { lock(st); }
void fake_state_unlock(struct fake_state *st) { unlock(st); }

int fake_state_busy_locked(struct fake_state *st, int slot_, int want_gi, int want_ci) {
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        unsigned gi = 0, ci = 0;
        if (held_at(st, i, slot_, want_gi, want_ci, &gi, &ci) != 0 && alive(st, i)) return 1;
    }
    return 0;
}

uint64_t fake_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

uint64_t fake_state_launch(struct fake_state *st, int dev, uint64_t ns, uint64_t queue_ns) {
    dev = slot(dev);
    if (own < 0) return 0;
    lock(st);
    uint64_t now = fake_now_ns(), wait = 0;
    uint64_t *until = &st->procs[own].until_ns[dev];
    if (*until > now + queue_ns) {
        wait = *until - now - queue_ns;
    } else {
        *until = (*until > now ? *until : now) + ns;
        st->procs[own].queued_ns[dev] += ns;
    }
    unlock(st);
    return wait;
}

/* Executed GPU time of entry i: everything queued minus what is still ahead of now. */
static uint64_t executed(const struct fake_state *st, int i, int dev, uint64_t now) {
    uint64_t ahead = st->procs[i].until_ns[dev] > now ? st->procs[i].until_ns[dev] - now : 0;
    uint64_t queued = st->procs[i].queued_ns[dev];
    return queued > ahead ? queued - ahead : 0;
}

uint64_t fake_state_executed(struct fake_state *st, int dev) {
    dev = slot(dev);
    if (own < 0) return 0;
    lock(st);
    uint64_t done = executed(st, own, dev, fake_now_ns());
    unlock(st);
    return done;
}

unsigned fake_state_executed_all(struct fake_state *st, int dev, unsigned max, unsigned *pids, uint64_t *done) {
    dev = slot(dev);
    unsigned n = 0;
    lock(st);
    uint64_t now = fake_now_ns();
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        pid_t seen_as = 0;
        if (st->procs[i].queued_ns[dev] == 0 || !alive_as(st, i, &seen_as)) continue;
        if (n < max) {
            pids[n] = (unsigned)seen_as;
            done[n] = executed(st, i, dev, now);
        }
        n++;
    }
    unlock(st);
    return n;
}
