/* A CUDA process on the fake driver's device 0, which a test makes a MIG device (a `uuid=MIG-...`
 * configuration line or CUDA_VISIBLE_DEVICES=MIG-...): prints what the driver says of it and
 * whether an allocation fits.
 *   mig_device_memory <MiB>   prints "uuid=<MIG-...> total=<MiB> free=<MiB> rc=<code>"; exits 0 when
 *                             the allocation succeeded, 2 when the driver refused it */
#include <string.h>

#include "common.h"

int main(int argc, char **argv) {
    CHECK(argc == 2);
    unsigned long long mib = strtoull(argv[1], NULL, 10);
    CUcontext ctx = test_context();
    (void)ctx;
    CUdevice dev = 0;
    size_t total = 0, free_bytes = 0;
    CUuuid uuid;
    CHECK_RC(cuCtxGetDevice(&dev), CUDA_SUCCESS);
    CHECK_RC(cuDeviceTotalMem_v2(&total, dev), CUDA_SUCCESS);
    CHECK_RC(cuDeviceGetUuid(&uuid, dev), CUDA_SUCCESS);
    CUdeviceptr p = 0;
    CUresult rc = cuMemAlloc_v2(&p, mib * MiB);
    CHECK_RC(cuMemGetInfo_v2(&free_bytes, &total), CUDA_SUCCESS);
    const unsigned char *b = (const unsigned char *)uuid.bytes;
    printf("uuid=%02x%02x%02x%02x total=%llu free=%llu rc=%d\n", b[0], b[1], b[2], b[3],
           (unsigned long long)(total / MiB), (unsigned long long)(free_bytes / MiB), (int)rc);
    return rc == CUDA_SUCCESS ? 0 : 2;
}
