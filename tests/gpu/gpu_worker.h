/*
 * What the GPU checks' worker processes share: dying with the reason (a gpupool or a CUDA
 * error, naming the worker's role), a non-blocking stream on a device, filling and publishing
 * a buffer, the orderly end, and waiting for a command line from the driver on stdin.
 */
#ifndef GPUPOOL_GPU_WORKER_H
#define GPUPOOL_GPU_WORKER_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_kernels.h"
#include "gpupool/gpupool.h"

static inline void wdie(const char *role, const char *what, int rc) {
  fprintf(stderr, "worker %s (pid %d): %s: %s (%s): %s\n", role, (int)getpid(), what,
          gpupool_err_name(rc), gpupool_strerror(rc), gpupool_last_error());
  exit(2);
}

static inline void cdie(const char *role, const char *what, int ce) {
  fprintf(stderr, "worker %s (pid %d): %s: %s: %s\n", role, (int)getpid(), what,
          cudaGetErrorName((cudaError_t)ce), cudaGetErrorString((cudaError_t)ce));
  exit(2);
}

static inline cudaStream_t wstream(const char *role, int device) {
  cudaStream_t s;
  int ce = (int)cudaSetDevice(device);
  if (ce)
    cdie(role, "cudaSetDevice", ce);
  ce = (int)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (ce)
    cdie(role, "cudaStreamCreateWithFlags", ce);
  return s;
}

/* Fill bytes of b with seed's pattern behind a spin of spin_us (0: none) and publish b as name,
 * a vector of uint32, all without synchronizing: readers are ordered only by the ready event
 * that publish records in s, behind the spin and the fill. */
static inline void wfill_publish(const char *role, gpupool_buffer *b, size_t bytes, uint32_t seed, unsigned spin_us,
                                 const char *name, cudaStream_t s) {
  gpupool_tensor_meta meta;
  int rc, ce;
  if (spin_us && (ce = gk_spin(s, spin_us)))
    cdie(role, "spin kernel", ce);
  if ((ce = gk_fill(gpupool_buffer_ptr(b), bytes, seed, s)))
    cdie(role, "fill kernel", ce);
  memset(&meta, 0, sizeof(meta));
  meta.dtype_code = GPUPOOL_DTYPE_UINT;
  meta.dtype_bits = 32;
  meta.dtype_lanes = 1;
  meta.ndim = 1;
  meta.shape[0] = (int64_t)(bytes / 4);
  if ((rc = gpupool_buffer_publish(b, name, &meta, s, NULL)) < 0)
    wdie(role, "gpupool_buffer_publish", rc);
}

/* A worker's orderly end: wait for the work on its stream, disconnect, drop the stream. */
static inline void wfinish(const char *role, gpupool_client *c, cudaStream_t s) {
  int ce = (int)cudaStreamSynchronize(s);
  if (ce)
    cdie(role, "cudaStreamSynchronize", ce);
  gpupool_client_disconnect(c);
  (void)cudaStreamDestroy(s);
}

/* Read stdin until a line starting with `want`; exit when stdin closes first. */
static inline void wait_stdin_line(const char *role, const char *want) {
  char line[128];
  for (;;) {
    if (!fgets(line, sizeof(line), stdin)) {
      fprintf(stderr, "worker %s: stdin closed while waiting for %s\n", role, want);
      exit(2);
    }
    if (!strncmp(line, want, strlen(want)))
      return;
  }
}

#endif
