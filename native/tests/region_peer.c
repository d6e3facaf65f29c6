/* One process of a container, driven by tests/native/test_region.py:
 *   region_peer alloc <MiB>        allocate, print "rc=<code>", exit 0 (ok) or 2 (refused)
 *   region_peer hold <MiB>         allocate, print "held", keep it until stdin closes, then free
 *   region_peer hold_lock <MiB>    allocate, then take the region lock as the interposer does
 *                                  (OFD write lock on the sem bytes), print "locked", block forever */
#define _GNU_SOURCE
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

int main(int argc, char **argv) {
    CHECK(argc == 3);
    unsigned long long mib = strtoull(argv[2], NULL, 10);
    test_context();
    CUdeviceptr p = 0;
    CUresult rc = mib != 0 ? cuMemAlloc_v2(&p, mib * MiB) : CUDA_SUCCESS;
    if (strcmp(argv[1], "alloc") == 0) {
        printf("rc=%d used=%llu\n", (int)rc, (unsigned long long)test_container_usage(0));
        return rc == CUDA_SUCCESS ? 0 : 2;
    }
    CHECK_RC(rc, CUDA_SUCCESS);
    if (strcmp(argv[1], "hold") == 0) {
        printf("held\n");
        fflush(stdout);
        char buf[64];
        while (read(STDIN_FILENO, buf, sizeof buf) > 0) {
        }
        if (p != 0) CHECK_RC(cuMemFree_v2(p), CUDA_SUCCESS);
        return 0;
    }
    if (strcmp(argv[1], "hold_lock") == 0) {
        int fd = open(getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE"), O_RDWR);
        CHECK(fd >= 0);
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = HAMI_REGION_LOCK_OFFSET,
                           .l_len = HAMI_REGION_LOCK_LEN, .l_pid = 0};
        CHECK(fcntl(fd, F_OFD_SETLKW, &fl) == 0);
        printf("locked\n");
        fflush(stdout);
        for (;;) pause();
    }
    return 2;
}
