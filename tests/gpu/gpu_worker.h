/*
 * What the GPU checks' worker processes share: dying with the reason (a gpupool or a CUDA
 * error, naming the worker's role), a non-blocking stream on a device, and waiting for a
 * command line from the driver on stdin.
 */
#ifndef GPUPOOL_GPU_WORKER_H
#define GPUPOOL_GPU_WORKER_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

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
