/*
 * Kernels for the GPU tests and the benchmark (gpu_kernels.cu), callable from C. Each runs on
 * the given stream (a cudaStream_t as void*, NULL = legacy default stream) of the current
 * device, and returns a cudaError_t as int (0 = cudaSuccess).
 *
 * The test pattern is position-dependent: word i of a buffer filled with seed s is
 * gk_pattern(i, s), so a buffer read too early, from the wrong offset or from a stale
 * allocation does not match.
 */
#ifndef GPUPOOL_TESTS_GPU_KERNELS_H
#define GPUPOOL_TESTS_GPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Word i of the pattern for seed, computed on the CPU (the kernels use the same function):
 * for checking from the host a buffer a kernel filled. */
uint32_t gk_pattern(uint64_t i, uint32_t seed);
/* Occupy the stream for about us microseconds (one thread spinning on the GPU clock). */
int gk_spin(void *stream, unsigned us);
/* Write the pattern for seed over bytes (a multiple of 4) at ptr. */
int gk_fill(void *ptr, size_t bytes, uint32_t seed, void *stream);
/* Keep writing the pattern for seed over bytes (a multiple of 4) at ptr for about us
 * microseconds: work that still touches a buffer long after it was queued. */
int gk_scribble(void *ptr, size_t bytes, uint32_t seed, unsigned us, void *stream);
/* Count words that differ from the pattern; synchronizes the stream to read the count. */
int gk_count_mismatches(const void *ptr, size_t bytes, uint32_t seed, void *stream,
                        unsigned long long *mismatches);
/* Read every byte (a multiple of 16) once; sink is 8 bytes of device memory the kernel
 * writes only when an impossible sum appears, which keeps the loads alive. Does not
 * synchronize. */
int gk_read(const void *ptr, size_t bytes, void *stream, unsigned long long *sink);

#ifdef __cplusplus
}
#endif

#endif
