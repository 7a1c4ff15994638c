/*
 * The CUDA backend's slab export format, pool access and error helper (see cuda.h).
 */
#include <string.h>

#include "cuda.h"
#include "errors.h"

uint32_t gpupool__cuda_export_encode(const struct cudaMemPoolPtrExportData *e, uint8_t *out) {
  memcpy(out, e, sizeof *e);
  return (uint32_t)sizeof *e;
}

int gpupool__cuda_export_decode(const uint8_t *data, size_t len,
                                struct cudaMemPoolPtrExportData *e) {
  if (len != sizeof *e)
    return gpupool__err(GPUPOOL_EPROTO, "slab export data is %zu bytes, CUDA expects %zu: the "
                        "daemon and this library disagree on the backend; upgrade both to "
                        "the same release", len, sizeof *e);
  memcpy(e, data, sizeof *e);
  return 0;
}

int gpupool__cuda_fail(int code, cudaError_t e, const char *call, int device, const char *fix) {
  (void)cudaGetLastError();
  if (device >= 0)
    return gpupool__err(code, "%s failed on CUDA device %d: %s (%s)%s%s", call, device,
                        cudaGetErrorName(e), cudaGetErrorString(e), fix ? ": " : "",
                        fix ? fix : "");
  return gpupool__err(code, "%s failed: %s (%s)%s%s", call, cudaGetErrorName(e),
                      cudaGetErrorString(e), fix ? ": " : "", fix ? fix : "");
}

cudaError_t gpupool__cuda_pool_access(cudaMemPool_t pool, int device, enum cudaMemAccessFlags flags) {
  struct cudaMemAccessDesc d;
  memset(&d, 0, sizeof(d));
  d.location.type = cudaMemLocationTypeDevice;
  d.location.id = device;
  d.flags = flags;
  return cudaMemPoolSetAccess(pool, &d, 1);
}
