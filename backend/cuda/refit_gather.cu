/*
 * The gather kernel of refit replays (refit_copy.c): many copies of one device's memory into
 * the same device's memory in one launch. A plan of a model is a thousand copies or more,
 * most of them small (norms, biases, per-layer slices); one cudaMemcpy2DAsync each pays the
 * copy engine's per-copy cost a thousand times, one launch of this kernel pays it once.
 *
 * Built with nvcc into a fatbin embedded in the library (CMake runs nvcc and bin2c), loaded
 * with cudaLibraryLoadData: the rest of gpupool stays C compiled by the C compiler.
 *
 * Each launch gets up to GATHER_OPS copies by value (the launch's parameters: no device memory
 * to allocate, upload or keep alive). Copy i is done by blocks first[i] .. first[i+1]-1: a 1D
 * copy in CHUNK-byte pieces, a 2D copy in runs of rows of about CHUNK bytes. The widest load
 * and store every address, width and pitch of a copy allows (16, 8, 4, 2 or 1 bytes) is used.
 * Keep refit_gather.h's layout in step with the structs here.
 */
#include <stdint.h>

#include "refit_convert.h"
#include "refit_gather.h"

template <typename T>
__device__ static void copy_rows(char *dst, const char *src, uint64_t dpitch, uint64_t spitch, uint64_t r0,
                                 uint64_t nrows, uint64_t c0, uint64_t c1) {
  /* Rows r0 .. r0+nrows-1, bytes c0 .. c1-1 of each, T at a time (all multiples of sizeof(T)).
   * A block's share is at most CHUNK bytes of data, so its indices fit 32 bits. */
  const uint32_t w = (uint32_t)((c1 - c0) / sizeof(T));
  const uint32_t total = w * (uint32_t)nrows;
  dst += r0 * dpitch + c0;
  src += r0 * spitch + c0;
  for (uint32_t k = threadIdx.x; k < total; k += blockDim.x) {
    uint32_t r = k / w, c = k - r * w;
    ((T *)(dst + r * dpitch))[c] = ((const T *)(src + r * spitch))[c];
  }
}

/* A cast: rows r0 .. r0+nrows-1, elements e0 .. e1-1 of each, converted one by one (the host's
 * conversions, refit_convert.h: the same bits as a cast on the host). */
__device__ static void cast_rows(const gpupool__gather_op *o, char *dst, const char *src, uint64_t r0,
                                 uint64_t nrows, uint64_t e0, uint64_t e1) {
  const uint32_t w = (uint32_t)(e1 - e0), total = w * (uint32_t)nrows;
  dst += r0 * o->dpitch + e0 * o->desz;
  src += r0 * o->spitch + e0 * o->sesz;
  for (uint32_t k = threadIdx.x; k < total; k += blockDim.x) {
    uint32_t r = k / w, c = k - r * w;
    gpupool__fstore(dst + r * o->dpitch + (uint64_t)c * o->desz, o->dk,
                    gpupool__fload(src + r * o->spitch + (uint64_t)c * o->sesz, o->sk));
  }
}

extern "C" __global__ void gpupool_refit_gather(const __grid_constant__ gpupool__gather_args a) {
  uint32_t lo = 0, hi = a.n;
  const uint64_t b = blockIdx.x;
  /* The copy this block works on: the last whose first block is <= b. */
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    if (a.op[mid].first <= b)
      lo = mid;
    else
      hi = mid;
  }
  const gpupool__gather_op *o = &a.op[lo];
  const uint64_t k = b - o->first;
  char *dst = (char *)(uintptr_t)o->dst;
  const char *src = (const char *)(uintptr_t)o->src;
  const uint64_t chunk = o->sk ? GPUPOOL__GATHER_CAST_CHUNK : GPUPOOL__GATHER_CHUNK;
  uint64_t r0, nrows, c0, c1;
  if (o->bpr > 1) {
    r0 = k / o->bpr;
    nrows = 1;
    c0 = (k % o->bpr) * chunk;
    c1 = c0 + chunk < o->width ? c0 + chunk : o->width;
  } else {
    r0 = k * o->rpb;
    nrows = r0 + o->rpb < o->rows ? o->rpb : o->rows - r0;
    c0 = 0;
    c1 = o->width;
  }
  if (r0 >= o->rows || c1 <= c0 || nrows == 0)
    return;
  if (o->sk) {
    cast_rows(o, dst, src, r0, nrows, c0, c1);
    return;
  }
  uint64_t m = (uint64_t)(uintptr_t)dst | (uint64_t)(uintptr_t)src | c0 | c1;
  if (o->rows > 1)
    m |= o->dpitch | o->spitch;
  if ((m & 15) == 0)
    copy_rows<uint4>(dst, src, o->dpitch, o->spitch, r0, nrows, c0, c1);
  else if ((m & 7) == 0)
    copy_rows<uint2>(dst, src, o->dpitch, o->spitch, r0, nrows, c0, c1);
  else if ((m & 3) == 0)
    copy_rows<uint32_t>(dst, src, o->dpitch, o->spitch, r0, nrows, c0, c1);
  else if ((m & 1) == 0)
    copy_rows<uint16_t>(dst, src, o->dpitch, o->spitch, r0, nrows, c0, c1);
  else
    copy_rows<uint8_t>(dst, src, o->dpitch, o->spitch, r0, nrows, c0, c1);
}
