/*
 * What the C benchmarks share: dying with the reason (prefixed with BENCH_PROG, which the
 * including file defines first), checking CUDA and gpupool calls, a non-blocking stream on
 * GPU 0, and "BENCH key value" lines for tools/gpu-bench.sh.
 */
#ifndef GPUPOOL_BENCH_UTIL_H
#define GPUPOOL_BENCH_UTIL_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_harness.h"
#include "gpupool/gpupool.h"

#ifndef BENCH_PROG
#error "define BENCH_PROG (the program's name, for error messages) before including bench_util.h"
#endif

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, BENCH_PROG " (pid %d): ", (int)getpid());
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  exit(1);
}

#define CK(call)                                                                            \
  do {                                                                                      \
    cudaError_t ck_e = (call);                                                              \
    if (ck_e != cudaSuccess)                                                                \
      die("%s: %s: %s", #call, cudaGetErrorName(ck_e), cudaGetErrorString(ck_e));           \
  } while (0)

#define GP(call)                                                                            \
  do {                                                                                      \
    int gp_rc = (call);                                                                     \
    if (gp_rc < 0)                                                                          \
      die("%s: %s: %s", #call, gpupool_err_name(gp_rc), gpupool_last_error());              \
  } while (0)

static inline cudaStream_t new_stream(void) {
  cudaStream_t s;
  CK(cudaSetDevice(0));
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

static inline void report(const char *key, double v) { gh_say("BENCH %s %.3f", key, v); }

/* A CUDA call's error, by the call's result and what it was. */
static inline void bench_ck(cudaError_t e, const char *what) {
  if (e != cudaSuccess)
    die("%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* A line of a markdown table: to stdout, and to table too when it is open. */
static inline void bench_row(FILE *table, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline void bench_row(FILE *table, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  if (table) {
    va_start(ap, fmt);
    vfprintf(table, fmt, ap);
    va_end(ap);
  }
}

static inline double bench_median(double *v, int n) { return gh_percentile(v, (size_t)n, 50); }

#endif
