/* This process's live allocations: (kind, pointer or handle) -> device, size, context.
 *
 * A free looks its pointer up here to know what to give back; a pointer that is not here was
 * allocated before the interposer saw it (or by a path we do not count), and its free reaches the
 * driver with no accounting change, so counters never underflow. Open addressing, linear probing,
 * tombstones; grows at 50 % load. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

struct slot {
    uint64_t key;
    uint8_t kind; /* 0 empty, 0xff tombstone, else enum vgpu_kind */
    struct vgpu_record rec;
};

#define TOMBSTONE 0xff

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct slot *table;
static size_t capacity, used_slots, live;

static size_t hash(uint64_t key, uint8_t kind) {
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h ^ (h >> 29));
}

static struct slot *find(uint64_t key, uint8_t kind) {
    if (capacity == 0) return NULL;
    for (size_t i = hash(key, kind) & (capacity - 1), n = 0; n < capacity; i = (i + 1) & (capacity - 1), n++) {
        if (table[i].kind == 0) return NULL;
        if (table[i].kind == kind && table[i].key == key) return &table[i];
    }
    return NULL;
}

static int insert(uint64_t key, uint8_t kind, const struct vgpu_record *rec);

static int grow(void) {
    size_t old_capacity = capacity;
    struct slot *old = table;
    size_t next = capacity == 0 ? 1024 : capacity * 2;
    struct slot *fresh = calloc(next, sizeof *fresh);
    if (fresh == NULL) return -1;
    table = fresh;
    capacity = next;
    used_slots = live = 0;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].kind != 0 && old[i].kind != TOMBSTONE) insert(old[i].key, old[i].kind, &old[i].rec);
    }
    free(old);
    return 0;
}

static int insert(uint64_t key, uint8_t kind, const struct vgpu_record *rec) {
    if ((used_slots + 1) * 2 > capacity && grow() != 0) return -1;
    struct slot *existing = find(key, kind);
    if (existing != NULL) {
        existing->rec = *rec;
        return 0;
    }
    for (size_t i = hash(key, kind) & (capacity - 1);; i = (i + 1) & (capacity - 1)) {
        if (table[i].kind == 0 || table[i].kind == TOMBSTONE) {
            if (table[i].kind == 0) used_slots++;
            table[i] = (struct slot){.key = key, .kind = kind, .rec = *rec};
            live++;
            return 0;
        }
    }
}

void vgpu_track_add(enum vgpu_kind kind, uint64_t key, const struct vgpu_record *rec) {
    pthread_mutex_lock(&mu);
    if (insert(key, (uint8_t)kind, rec) != 0) LOGE("out of host memory tracking an allocation");
    pthread_mutex_unlock(&mu);
}

int vgpu_track_remove(enum vgpu_kind kind, uint64_t key, struct vgpu_record *out) {
    pthread_mutex_lock(&mu);
    struct slot *s = find(key, (uint8_t)kind);
    if (s != NULL) {
        *out = s->rec;
        s->kind = TOMBSTONE;
        live--;
    }
    pthread_mutex_unlock(&mu);
    return s != NULL;
}

void vgpu_track_drop_context(CUcontext ctx, uint64_t freed[HAMI_MAX_DEVICES]) {
    memset(freed, 0, sizeof(uint64_t) * HAMI_MAX_DEVICES);
    if (ctx == NULL) return;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < capacity; i++) {
        struct slot *s = &table[i];
        if (s->kind == 0 || s->kind == TOMBSTONE || s->rec.ctx != ctx) continue;
        if (s->rec.idx >= 0 && s->rec.idx < HAMI_MAX_DEVICES) freed[s->rec.idx] += s->rec.bytes;
        s->kind = TOMBSTONE;
        live--;
    }
    pthread_mutex_unlock(&mu);
}

void vgpu_track_reset_after_fork(void) {
    pthread_mutex_init(&mu, NULL);
    free(table);
    table = NULL;
    capacity = used_slots = live = 0;
}
