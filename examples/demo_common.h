/*
 * Shared by the demo producer and consumer: the byte pattern of buffer i, and copying
 * to/from the buffer wherever it lives (host memory directly, device memory through CUDA).
 */
#ifndef GPUPOOL_DEMO_COMMON_H
#define GPUPOOL_DEMO_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gpupool/gpupool.h>

#ifdef GPUPOOL_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* Byte j of buffer i: depends on both, so a swapped or shifted buffer is caught. */
static inline uint8_t demo_byte(uint32_t i, uint64_t j) {
  uint64_t x = (j + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)i << 32 | i);
  return (uint8_t)(x >> 56);
}

static inline void demo_fill(uint8_t *p, uint32_t i, uint64_t n) {
  for (uint64_t j = 0; j < n; j++)
    p[j] = demo_byte(i, j);
}

/* Copy n bytes between host memory and a buffer's memory (device or host). */
static inline int demo_copy(void *dst, const void *src, size_t n, const gpupool_buffer *b) {
  if (gpupool_buffer_kind(b) == GPUPOOL_MEM_HOST) {
    memcpy(dst, src, n);
    return 0;
  }
#ifdef GPUPOOL_HAVE_CUDA
  {
    cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyDefault); /* device or pinned host memory */
    if (e != cudaSuccess) {
      fprintf(stderr, "cudaMemcpy: %s\n", cudaGetErrorString(e));
      return -1;
    }
    return 0;
  }
#else
  fprintf(stderr, "buffer is in GPU memory but this demo was built without CUDA\n");
  return -1;
#endif
}

static inline void demo_die(const char *what, int rc) {
  fprintf(stderr, "%s failed: %s (%s): %s\n", what, gpupool_err_name(rc), gpupool_strerror(rc),
          gpupool_last_error());
  exit(1);
}

#endif
