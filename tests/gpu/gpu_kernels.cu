/*
 * Kernels for the GPU tests and the benchmark: a spin kernel that keeps a stream busy (so a
 * consumer that does not wait on the producer's ready event reads unwritten memory), a
 * position-dependent fill, a kernel that keeps rewriting a buffer for a while, a mismatch
 * counter and a bandwidth read. Host wrappers have C
 * linkage; see gpu_kernels.h.
 */
#include "gpu_kernels.h"

#include <cuda_runtime.h>

static __host__ __device__ __forceinline__ uint32_t pattern(uint64_t i, uint32_t seed) {
  uint32_t x = (uint32_t)i * 2654435761u ^ seed ^ (uint32_t)(i >> 32) * 0x9e3779b9u;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return x;
}

static __device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t ns) {
  uint64_t start = global_ns();
  while (global_ns() - start < ns)
    __nanosleep(1000);
}

__global__ void fill_kernel(uint32_t *p, size_t n, uint32_t seed) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = pattern(i, seed);
}

__global__ void scribble_kernel(uint32_t *p, size_t n, uint32_t seed, uint64_t ns) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  uint64_t start = global_ns();
  while (global_ns() - start < ns)
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
      p[i] = pattern(i, seed);
}

__global__ void check_kernel(const uint32_t *p, size_t n, uint32_t seed,
                             unsigned long long *bad) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned long long mine = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    mine += p[i] != pattern(i, seed);
  if (mine)
    atomicAdd(bad, mine);
}

__global__ void read_kernel(const uint4 *p, size_t n, unsigned long long *sink) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  uint32_t acc = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  /* Practically never true, but the compiler cannot know: the loads must happen. */
  if (acc == 0x9e3779b9u)
    *sink = acc;
}

/* Enough blocks to fill any current GPU several times over; loops stride the rest. */
static int grid_for(size_t n) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  size_t blocks = (n + 255) / 256;
  size_t cap = (size_t)sms * 8;
  if (blocks > cap)
    blocks = cap;
  return blocks ? (int)blocks : 1;
}

extern "C" uint32_t gk_pattern(uint64_t i, uint32_t seed) { return pattern(i, seed); }

extern "C" int gk_spin(void *stream, unsigned us) {
  spin_kernel<<<1, 1, 0, (cudaStream_t)stream>>>((uint64_t)us * 1000u);
  return (int)cudaGetLastError();
}

extern "C" int gk_fill(void *ptr, size_t bytes, uint32_t seed, void *stream) {
  if (bytes % 4)
    return (int)cudaErrorInvalidValue;
  size_t n = bytes / 4;
  fill_kernel<<<grid_for(n), 256, 0, (cudaStream_t)stream>>>((uint32_t *)ptr, n, seed);
  return (int)cudaGetLastError();
}

extern "C" int gk_scribble(void *ptr, size_t bytes, uint32_t seed, unsigned us, void *stream) {
  if (bytes % 4)
    return (int)cudaErrorInvalidValue;
  size_t n = bytes / 4;
  /* A few blocks: the kernel stays resident for its whole duration without starving others. */
  scribble_kernel<<<8, 256, 0, (cudaStream_t)stream>>>((uint32_t *)ptr, n, seed, (uint64_t)us * 1000u);
  return (int)cudaGetLastError();
}

extern "C" int gk_count_mismatches(const void *ptr, size_t bytes, uint32_t seed, void *stream,
                                   unsigned long long *mismatches) {
  cudaStream_t s = (cudaStream_t)stream;
  unsigned long long *bad = NULL;
  cudaError_t e;
  if (bytes % 4)
    return (int)cudaErrorInvalidValue;
  size_t n = bytes / 4;
  e = cudaMallocAsync((void **)&bad, sizeof(*bad), s);
  if (e != cudaSuccess)
    return (int)e;
  e = cudaMemsetAsync(bad, 0, sizeof(*bad), s);
  if (e == cudaSuccess) {
    check_kernel<<<grid_for(n), 256, 0, s>>>((const uint32_t *)ptr, n, seed, bad);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(mismatches, bad, sizeof(*bad), cudaMemcpyDeviceToHost, s);
  cudaError_t f = cudaFreeAsync(bad, s);
  if (e == cudaSuccess)
    e = f;
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(s);
  return (int)e;
}

extern "C" int gk_read(const void *ptr, size_t bytes, void *stream, unsigned long long *sink) {
  if (bytes % 16)
    return (int)cudaErrorInvalidValue;
  size_t n = bytes / 16;
  read_kernel<<<grid_for(n), 256, 0, (cudaStream_t)stream>>>((const uint4 *)ptr, n, sink);
  return (int)cudaGetLastError();
}
