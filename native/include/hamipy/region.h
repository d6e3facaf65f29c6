/* The shared region file, HAMi-core v1.2 layout (docs/wire-format.md#region-file).
 *
 * One file per container, mmap'ed MAP_SHARED by every CUDA process of the container and read
 * by the monitor. The layout is HAMi's byte for byte, so HAMi's monitor can read our files; the
 * offsets below are pinned with _Static_assert and mirrored by hamipy.protocol.region.
 *
 * Two things are ours, both invisible to a HAMi reader:
 *  - The region lock is an OFD (open file description) write lock on the bytes of `sem`
 *    (HAMI_REGION_LOCK_OFFSET/LEN), taken with fcntl(F_OFD_SETLKW). The kernel drops it when the
 *    holder dies, so a process killed while holding it never blocks the others (HAMi #2500).
 *    `sem` itself is initialised (sem_init, pshared, value 1) but never waited on.
 *  - unused[HAMI_SLOT_STARTTIME] of a slot holds the owner's start time (field 22 of
 *    /proc/<pid>/stat), so a slot whose pid was reused by another process is still reclaimed.
 *
 * Slot writers follow a seqlock: increment `seqlock` to an odd value, write the slot, increment
 * it to the next even value. Readers retry while it is odd or changed across their read. */
#ifndef HAMIPY_REGION_H
#define HAMIPY_REGION_H

#include <semaphore.h>
#include <stddef.h>
#include <stdint.h>

#define HAMI_REGION_MAGIC 19920718
#define HAMI_REGION_MAJOR 1
#define HAMI_REGION_MINOR 2
#define HAMI_MAX_DEVICES 16
#define HAMI_MAX_PROCS 1024
#define HAMI_UUID_LEN 96
#define HAMI_REGION_FILE_SIZE 2008953 /* the struct plus one byte, as upstream writes it */
#define HAMI_REGION_DEFAULT_PATH "/tmp/cudevshr.cache"
#define HAMI_REGION_LOCK_OFFSET 24
#define HAMI_REGION_LOCK_LEN 32
#define HAMI_SLOT_STARTTIME 0

enum hami_proc_status { HAMI_PROC_EXITED = 0, HAMI_PROC_RUNNING = 1, HAMI_PROC_SUSPENDED = 2 };

struct hami_device_memory {
    uint64_t context_size;
    uint64_t module_size;
    uint64_t data_size;
    uint64_t offset;
    uint64_t total;
    uint64_t unused[3];
};

struct hami_device_util {
    uint64_t dec_util;
    uint64_t enc_util;
    uint64_t sm_util;
    uint64_t unused[3];
};

struct hami_proc_slot {
    int32_t pid;     /* in the container's PID namespace */
    int32_t hostpid; /* best effort: see docs/isolation.md */
    struct hami_device_memory used[HAMI_MAX_DEVICES];
    uint64_t monitorused[HAMI_MAX_DEVICES];
    struct hami_device_util device_util[HAMI_MAX_DEVICES];
    int32_t status;
    uint64_t seqlock;
    uint64_t unused[2];
};

struct hami_region {
    int32_t initialized_flag;
    uint32_t major_version;
    uint32_t minor_version;
    int32_t sm_init_flag;
    uint64_t owner_pid;
    sem_t sem;
    uint64_t device_num;
    char uuids[HAMI_MAX_DEVICES][HAMI_UUID_LEN];
    uint64_t limit[HAMI_MAX_DEVICES];
    uint64_t sm_limit[HAMI_MAX_DEVICES];
    struct hami_proc_slot procs[HAMI_MAX_PROCS];
    int32_t proc_num;
    int32_t utilization_switch;
    int32_t recent_kernel;
    int32_t priority;
    uint64_t last_kernel_time;
    sem_t sem_postinit;
};

_Static_assert(sizeof(sem_t) == 32, "sem_t is 32 bytes on x86_64 glibc");
_Static_assert(sizeof(struct hami_device_memory) == 64, "device memory entry");
_Static_assert(sizeof(struct hami_device_util) == 48, "device util entry");
_Static_assert(offsetof(struct hami_proc_slot, pid) == 0, "slot.pid");
_Static_assert(offsetof(struct hami_proc_slot, hostpid) == 4, "slot.hostpid");
_Static_assert(offsetof(struct hami_proc_slot, used) == 8, "slot.used");
_Static_assert(offsetof(struct hami_proc_slot, monitorused) == 1032, "slot.monitorused");
_Static_assert(offsetof(struct hami_proc_slot, device_util) == 1160, "slot.device_util");
_Static_assert(offsetof(struct hami_proc_slot, status) == 1928, "slot.status");
_Static_assert(offsetof(struct hami_proc_slot, seqlock) == 1936, "slot.seqlock");
_Static_assert(offsetof(struct hami_proc_slot, unused) == 1944, "slot.unused");
_Static_assert(sizeof(struct hami_proc_slot) == 1960, "slot size");
_Static_assert(offsetof(struct hami_region, initialized_flag) == 0, "initialized_flag");
_Static_assert(offsetof(struct hami_region, major_version) == 4, "major_version");
_Static_assert(offsetof(struct hami_region, minor_version) == 8, "minor_version");
_Static_assert(offsetof(struct hami_region, sm_init_flag) == 12, "sm_init_flag");
_Static_assert(offsetof(struct hami_region, owner_pid) == 16, "owner_pid");
_Static_assert(offsetof(struct hami_region, sem) == HAMI_REGION_LOCK_OFFSET, "sem");
_Static_assert(offsetof(struct hami_region, device_num) == 56, "device_num");
_Static_assert(offsetof(struct hami_region, uuids) == 64, "uuids");
_Static_assert(offsetof(struct hami_region, limit) == 1600, "limit");
_Static_assert(offsetof(struct hami_region, sm_limit) == 1728, "sm_limit");
_Static_assert(offsetof(struct hami_region, procs) == 1856, "procs");
_Static_assert(offsetof(struct hami_region, proc_num) == 2008896, "proc_num");
_Static_assert(offsetof(struct hami_region, utilization_switch) == 2008900, "utilization_switch");
_Static_assert(offsetof(struct hami_region, recent_kernel) == 2008904, "recent_kernel");
_Static_assert(offsetof(struct hami_region, priority) == 2008908, "priority");
_Static_assert(offsetof(struct hami_region, last_kernel_time) == 2008912, "last_kernel_time");
_Static_assert(offsetof(struct hami_region, sem_postinit) == 2008920, "sem_postinit");
_Static_assert(sizeof(struct hami_region) == 2008952, "region size");
_Static_assert(HAMI_REGION_FILE_SIZE == sizeof(struct hami_region) + 1, "file size");

#endif
