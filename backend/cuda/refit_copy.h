/*
 * The device half of a refit plan's replay (client/refit.c): one 2D copy queued on the
 * caller's stream. Built from refit_copy.c with CUDA, from refit_copy_none.c without.
 */
#ifndef GPUPOOL_BACKEND_CUDA_REFIT_COPY_H
#define GPUPOOL_BACKEND_CUDA_REFIT_COPY_H

#include <stddef.h>

/* Queue `height` rows of `width` bytes from src (rows spitch apart) to dst (dpitch apart) on
 * stream (a cudaStream_t; NULL = the legacy default stream), any of host, device or peer
 * memory (cudaMemcpyDefault). 0, GPUPOOL_EBACKEND with CUDA's message, or GPUPOOL_ENOTSUP in a
 * build without CUDA. */
int gpupool__refit_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                          void *stream);

#endif
