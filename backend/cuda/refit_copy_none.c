/*
 * Refit copies in a build without CUDA: device copies cannot run here.
 */
#include "errors.h"
#include "refit_copy.h"

int gpupool__refit_copy_many(const gpupool__refit_op *ops, size_t n, void *stream, size_t *gathered) {
  (void)ops, (void)n, (void)stream;
  *gathered = 0;
  return gpupool__err(GPUPOOL_ENOTSUP, "refit into device memory needs a build of gpupool with CUDA; this one has "
                      "none (the host backend's targets need no GPUPOOL_REFIT_DEVICE)");
}

int gpupool__refit_device_casts(void) {
  return 0;
}

int gpupool__refit_ptr_device(const void *p) {
  (void)p;
  return -1;
}

int gpupool__refit_stream_device(void *stream) {
  (void)stream;
  return -1;
}
