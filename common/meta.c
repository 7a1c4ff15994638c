/*
 * Tensor metadata validation, shared by the daemon (which refuses bad metadata at publish)
 * and the client library. A tensor's span is the byte offset plus the furthest byte any
 * element can reach; every product and sum is overflow-checked.
 */
#include <stdint.h>

#include "errors.h"

static int mul_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static int add_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_add_overflow(a, b, out); }

uint64_t gpupool_tensor_span(const gpupool_tensor_meta *m, int *err) {
  uint64_t itemsize, bits, numel = 1, maxidx = 0, span;
  int e = GPUPOOL_EMETA;

  if (!m) {
    gpupool__err(e, "no tensor metadata");
    goto fail;
  }
  if (m->ndim < 0 || m->ndim > GPUPOOL_MAX_NDIM) {
    gpupool__err(e, "tensor has %d dimensions; allowed 0..%d", m->ndim, GPUPOOL_MAX_NDIM);
    goto fail;
  }
  if (m->dtype_code > GPUPOOL_DTYPE_BOOL && m->dtype_code != 7 /* kDLFloat8 variants */) {
    gpupool__err(e, "unknown DLPack dtype code %u", m->dtype_code);
    goto fail;
  }
  if (m->dtype_bits == 0 || m->dtype_lanes == 0) {
    gpupool__err(e, "dtype has %u bits and %u lanes; both must be > 0", m->dtype_bits, m->dtype_lanes);
    goto fail;
  }
  bits = (uint64_t)m->dtype_bits * m->dtype_lanes;
  if (bits % 8 != 0) {
    gpupool__err(e, "dtype of %llu bits per element is not a whole number of bytes",
                 (unsigned long long)bits);
    goto fail;
  }
  itemsize = bits / 8;
  for (int i = 0; i < m->ndim; i++) {
    if (m->shape[i] < 0) {
      gpupool__err(e, "shape[%d] = %lld is negative", i, (long long)m->shape[i]);
      goto fail;
    }
    if (!mul_ok(numel, (uint64_t)m->shape[i], &numel)) {
      gpupool__err(e, "tensor element count overflows 64 bits");
      goto fail;
    }
  }
  if (numel == 0) {
    span = m->byte_offset;
    goto ok;
  }
  for (int i = 0; i < m->ndim; i++) {
    int64_t st;
    uint64_t reach;
    if (!m->strides_present) {
      /* C-contiguous: the last element is numel-1 items away. */
      maxidx = numel - 1;
      break;
    }
    st = m->strides[i];
    if (st < 0) {
      gpupool__err(e, "stride[%d] = %lld is negative; negative strides are not supported", i,
                   (long long)st);
      goto fail;
    }
    if (!mul_ok((uint64_t)(m->shape[i] - 1), (uint64_t)st, &reach) ||
        !add_ok(maxidx, reach, &maxidx)) {
      gpupool__err(e, "tensor extent overflows 64 bits");
      goto fail;
    }
  }
  if (!add_ok(maxidx, 1, &span) || !mul_ok(span, itemsize, &span) ||
      !add_ok(span, m->byte_offset, &span)) {
    gpupool__err(e, "tensor extent overflows 64 bits");
    goto fail;
  }
ok:
  if (err)
    *err = 0;
  return span;
fail:
  if (err)
    *err = e;
  return 0;
}
