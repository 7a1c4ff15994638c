/*
 * Element conversions of refit casts (float16, bfloat16, float32, float64 among themselves),
 * one definition for the host's copies (client/refit.c) and the gather kernel's
 * (refit_gather.cu), so a cast gives the same bits wherever it runs. Every value goes through
 * double (float16/bfloat16 through float first); rounding is to nearest, ties to even, as
 * numpy and torch round.
 */
#ifndef GPUPOOL_BACKEND_CUDA_REFIT_CONVERT_H
#define GPUPOOL_BACKEND_CUDA_REFIT_CONVERT_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define GPUPOOL__HD __host__ __device__ static inline
#else
#define GPUPOOL__HD static inline
#endif

/* Float kinds (0: not a float of these four: no cast). */
enum { GPUPOOL__FK_NONE = 0, GPUPOOL__FK_F16, GPUPOOL__FK_BF16, GPUPOOL__FK_F32, GPUPOOL__FK_F64 };

GPUPOOL__HD float gpupool__h2f(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
  float f;
  if (e == 0 && m == 0) {
    u = s;
  } else if (e == 0) {
    e = 113;
    while (!(m & 0x400)) {
      m <<= 1;
      e--;
    }
    u = s | (e << 23) | ((m & 0x3ff) << 13);
  } else if (e == 31) {
    u = s | 0x7f800000u | (m << 13);
  } else {
    u = s | ((e + 112) << 23) | (m << 13);
  }
  memcpy(&f, &u, 4);
  return f;
}

GPUPOOL__HD uint16_t gpupool__f2h(float f) {
  uint32_t x, ax, sign, h, rem;
  memcpy(&x, &f, 4);
  sign = (x >> 16) & 0x8000u;
  ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)
    return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) /* 65520 and up round to infinity */
    return (uint16_t)(sign | 0x7c00u);
  if (ax < 0x38800000u) { /* below 2^-14: a subnormal, in units of 2^-24 */
    float a, v, r;
    uint32_t m;
    memcpy(&a, &ax, 4);
    v = a * 16777216.0f;
    m = (uint32_t)v;
    r = v - (float)m;
    if (r > 0.5f || (r == 0.5f && (m & 1)))
      m++;
    return (uint16_t)(sign | m);
  }
  h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
  rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1)))
    h++;
  return (uint16_t)(sign | h);
}

GPUPOOL__HD float gpupool__bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

GPUPOOL__HD uint16_t gpupool__f2bf(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((x >> 16) | 0x40u); /* a NaN stays a (quiet) NaN */
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* The element at p, of float kind k, as a double. */
GPUPOOL__HD double gpupool__fload(const char *p, int k) {
  uint16_t u;
  float f;
  double d;
  switch (k) {
  case GPUPOOL__FK_F16:
    memcpy(&u, p, 2);
    return gpupool__h2f(u);
  case GPUPOOL__FK_BF16:
    memcpy(&u, p, 2);
    return gpupool__bf2f(u);
  case GPUPOOL__FK_F32:
    memcpy(&f, p, 4);
    return f;
  default:
    memcpy(&d, p, 8);
    return d;
  }
}

/* Store v at p as float kind k. */
GPUPOOL__HD void gpupool__fstore(char *p, int k, double v) {
  uint16_t u;
  float f = (float)v;
  switch (k) {
  case GPUPOOL__FK_F16:
    u = gpupool__f2h(f);
    memcpy(p, &u, 2);
    break;
  case GPUPOOL__FK_BF16:
    u = gpupool__f2bf(f);
    memcpy(p, &u, 2);
    break;
  case GPUPOOL__FK_F32:
    memcpy(p, &f, 4);
    break;
  default:
    memcpy(p, &v, 8);
  }
}

#endif
