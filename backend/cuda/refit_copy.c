/*
 * Refit copies on the GPU: a plan's copies (client/refit.c) replayed as cudaMemcpy2DAsync on
 * the engine's stream. cudaMemcpyDefault lets unified addressing tell where each end lies
 * (the engine's GPU, a trainer's GPU over peer access, pinned or pageable host memory).
 */
#include <cuda_runtime_api.h>

#include "errors.h"
#include "refit_copy.h"

int gpupool__refit_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                          void *stream) {
  cudaError_t e;
  if (height == 1)
    e = cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, (cudaStream_t)stream);
  else
    e = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, (cudaStream_t)stream);
  if (e != cudaSuccess)
    return gpupool__err(GPUPOOL_EBACKEND, "refit copy of %zu x %zu bytes: %s (%s)", height, width,
                        cudaGetErrorString(e), cudaGetErrorName(e));
  return 0;
}
