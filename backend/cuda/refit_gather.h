/*
 * What the gather kernel (refit_gather.cu) takes: shared by the kernel and its C caller
 * (refit_copy.c), so both see one layout. Plain C (fixed-width fields only).
 */
#ifndef GPUPOOL_BACKEND_CUDA_REFIT_GATHER_H
#define GPUPOOL_BACKEND_CUDA_REFIT_GATHER_H

#include <stdint.h>

/* Bytes one block copies (a multiple of 16). */
#define GPUPOOL__GATHER_CHUNK (128u * 1024u)
/* Elements one block converts in a cast. */
#define GPUPOOL__GATHER_CAST_CHUNK (16u * 1024u)
/* Copies per launch: the launch's parameters hold them (18 KiB of them; CUDA 12.1 and later
 * take up to 32 KiB of parameters on every GPU CUDA 13 runs on). */
#define GPUPOOL__GATHER_OPS 255

/* One copy: `rows` rows of `width` bytes, dpitch/spitch apart. Blocks first .. first+n-1 do
 * it, n = rows * bpr / rpb: a row of more than CHUNK bytes takes bpr blocks (bpr > 1, rpb 1),
 * shorter rows go rpb to a block (rpb >= 1, bpr 1). A cast counts CAST_CHUNK elements where a
 * copy counts CHUNK bytes. */
typedef struct {
  uint64_t dst, src;
  uint64_t dpitch, spitch;
  uint64_t width, rows; /* width: bytes; for a cast (sk != 0), elements */
  uint64_t first;
  uint32_t rpb, bpr;
  uint8_t sk, dk, sesz, desz; /* a cast: float kinds (refit_convert.h) and element sizes */
  uint32_t pad;
} gpupool__gather_op;

typedef struct {
  uint32_t n, pad;
  gpupool__gather_op op[GPUPOOL__GATHER_OPS];
} gpupool__gather_args;

#endif
