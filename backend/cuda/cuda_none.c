/*
 * The CUDA backend's daemon half in a build without the CUDA toolkit: every entry refuses
 * with a message that says how to get CUDA support.
 */
#include "cuda.h"
#include "errors.h"

int gpupool__cuda_probe(void) {
  gpupool__err(GPUPOOL_ENOTSUP, "this build of gpupool has no CUDA");
  return 0;
}

int gpupool__cuda_open(gpupool__backend **out) {
  *out = NULL;
  return gpupool__err(GPUPOOL_ENOTSUP,
                      "this gpupoold was built without CUDA (rebuild with the CUDA toolkit "
                      "installed, or run with --backend host)");
}

int gpupool__cuda_default_pools(gpupool__pool_config *pools, int max, int *n) {
  (void)pools;
  (void)max;
  (void)n;
  return gpupool__err(GPUPOOL_ENOTSUP, "this gpupoold was built without CUDA");
}
