/*
 * The device half of a refit plan's replay (client/refit.c): the plan's copies queued on the
 * caller's stream. Built from refit_copy.c with CUDA, from refit_copy_none.c without.
 */
#ifndef GPUPOOL_BACKEND_CUDA_REFIT_COPY_H
#define GPUPOOL_BACKEND_CUDA_REFIT_COPY_H

#include <stddef.h>

/* One copy: `rows` rows of `width` bytes from src (rows spitch apart) to dst (dpitch apart).
 * gather: the caller knows both ends lie in device memory of the stream's device (the gather
 * kernel may do it); 0: anywhere (host, device, peer memory: cudaMemcpyDefault).
 * A cast (sk, dk: refit_convert.h's float kinds, not GPUPOOL__FK_NONE) converts each element:
 * then `width` counts elements (of sesz bytes in src, desz in dst), and only the gather
 * kernel does it. */
typedef struct {
  void *dst;
  const void *src;
  size_t dpitch, spitch, width, rows;
  int gather;
  int sk, dk;
  size_t sesz, desz;
} gpupool__refit_op;

/* Queue the n copies on stream (a cudaStream_t; NULL = the legacy default stream), in any
 * order among themselves (their targets are disjoint): those marked gather in as few launches
 * of the gather kernel as they fit (unless GPUPOOL_REFIT_GATHER=0, or the kernel cannot run
 * here: then said once on stderr), the others one cudaMemcpy2DAsync each. *gathered: how many
 * went through the kernel. 0, GPUPOOL_EBACKEND with CUDA's message, GPUPOOL_ENOTSUP in a build
 * without CUDA or for a cast the kernel cannot do (across devices, host memory, no kernel):
 * then nothing was queued. */
int gpupool__refit_copy_many(const gpupool__refit_op *ops, size_t n, void *stream, size_t *gathered);

/* 1: this build has the gather kernel, which casts in device memory; 0: device casts fail. */
int gpupool__refit_device_casts(void);

/* The device ordinal of the device memory at p; -1 for any other memory (or no CUDA). */
int gpupool__refit_ptr_device(const void *p);

/* The device of stream (NULL: the calling thread's current device); -1 when CUDA cannot say. */
int gpupool__refit_stream_device(void *stream);

#endif
