/*
 * Refit copies in a build without CUDA: device copies cannot run here.
 */
#include "errors.h"
#include "refit_copy.h"

int gpupool__refit_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                          void *stream) {
  (void)dst, (void)dpitch, (void)src, (void)spitch, (void)width, (void)height, (void)stream;
  return gpupool__err(GPUPOOL_ENOTSUP, "refit into device memory needs a build of gpupool with CUDA; this one has "
                      "none (the host backend's targets need no GPUPOOL_REFIT_DEVICE)");
}
