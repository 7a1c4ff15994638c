/*
 * DLPack export of a held buffer (gpupool/dlpack.h).
 *
 * Owns the translation from a buffer's tensor description (or its raw bytes) to a DLTensor,
 * and the exchange objects themselves: each is one heap block holding the managed struct
 * followed by its shape and strides, so the deleter has exactly one thing to free besides
 * the hold it releases. The hold travels with the object: whoever ends up owning the DLPack
 * tensor (a framework, usually) decides when the memory may go back to the pool.
 */
#include "gpupool/dlpack.h"

#include <stdlib.h>
#include <string.h>

#include "errors.h"

_Static_assert(sizeof(DLManagedTensorVersioned) % sizeof(int64_t) == 0,
               "shape and strides follow the struct and must stay 8-byte aligned");
_Static_assert(sizeof(DLManagedTensor) % sizeof(int64_t) == 0,
               "shape and strides follow the struct and must stay 8-byte aligned");

/* What both exchange forms need: the device, the element type and the geometry. */
typedef struct {
  DLDevice device;
  DLDataType dtype;
  int32_t ndim;
  int64_t shape[GPUPOOL_MAX_NDIM];
  int64_t strides[GPUPOOL_MAX_NDIM];
  void *data;
} dl_desc;

static int fill_device(const gpupool_buffer *b, DLDevice *dev) {
  switch (gpupool_buffer_kind(b)) {
    case GPUPOOL_MEM_DEVICE:
      dev->device_type = kDLCUDA;
      dev->device_id = gpupool_buffer_device(b);
      if (dev->device_id < 0)
        return gpupool__err(GPUPOOL_EMETA,
                            "buffer %llu is device memory without a device ordinal; the "
                            "daemon's pool description is inconsistent (restart gpupoold)",
                            (unsigned long long)gpupool_buffer_id(b));
      return 0;
    case GPUPOOL_MEM_HOST_NUMA:
      /* Pinned host memory the GPU can reach: CUDA-aware consumers may use it from kernels,
       * CPU consumers read it in place. */
      dev->device_type = kDLCUDAHost;
      dev->device_id = 0;
      return 0;
    case GPUPOOL_MEM_HOST:
      dev->device_type = kDLCPU;
      dev->device_id = 0;
      return 0;
  }
  return gpupool__err(GPUPOOL_EMETA,
                      "buffer %llu has memory kind %d, which DLPack cannot name; update "
                      "libgpupool-client to the daemon's version",
                      (unsigned long long)gpupool_buffer_id(b), (int)gpupool_buffer_kind(b));
}

/* Build the description of b, checking that it fits in the buffer. */
static int describe(const gpupool_buffer *b, dl_desc *d) {
  gpupool_tensor_meta m;
  size_t size = gpupool_buffer_size(b);
  uint64_t span;
  int err = 0;
  int rc;
  int32_t i;

  memset(d, 0, sizeof(*d));
  rc = fill_device(b, &d->device);
  if (rc < 0)
    return rc;

  rc = gpupool_buffer_tensor(b, &m);
  if (rc == GPUPOOL_ENOENT) {
    /* Published without a description (or never published): the bytes themselves. */
    memset(&m, 0, sizeof(m));
    m.dtype_code = GPUPOOL_DTYPE_UINT;
    m.dtype_bits = 8;
    m.dtype_lanes = 1;
    m.ndim = 1;
    m.shape[0] = (int64_t)size;
  } else if (rc < 0) {
    return rc;
  }

  if (m.ndim < 0 || m.ndim > GPUPOOL_MAX_NDIM)
    return gpupool__err(GPUPOOL_EMETA,
                        "buffer %llu has a tensor description with %d dimensions; DLPack "
                        "export handles 0..%d (republish it with a valid description)",
                        (unsigned long long)gpupool_buffer_id(b), (int)m.ndim,
                        GPUPOOL_MAX_NDIM);
  if (m.dtype_lanes == 0 || m.dtype_bits == 0)
    return gpupool__err(GPUPOOL_EMETA,
                        "buffer %llu has an element type of %u bits x %u lanes; DLPack "
                        "needs both non-zero (republish it with a valid dtype)",
                        (unsigned long long)gpupool_buffer_id(b), m.dtype_bits,
                        m.dtype_lanes);

  span = gpupool_tensor_span(&m, &err);
  if (err < 0)
    return gpupool__err(GPUPOOL_EMETA,
                        "buffer %llu has a tensor description that does not describe memory "
                        "(bad shape, strides or offset); republish it with a valid one",
                        (unsigned long long)gpupool_buffer_id(b));
  if (span > size)
    return gpupool__err(GPUPOOL_EMETA,
                        "buffer %llu is %zu bytes but its tensor description spans %llu; "
                        "republish it with a description that fits",
                        (unsigned long long)gpupool_buffer_id(b), size,
                        (unsigned long long)span);

  d->dtype.code = m.dtype_code;
  d->dtype.bits = m.dtype_bits;
  d->dtype.lanes = m.dtype_lanes;
  d->ndim = m.ndim;
  for (i = 0; i < m.ndim; i++)
    d->shape[i] = m.shape[i];
  if (m.strides_present) {
    for (i = 0; i < m.ndim; i++)
      d->strides[i] = m.strides[i];
  } else {
    /* Always give strides: DLPack 1.2 makes them mandatory and some consumers already
     * dereference them without checking for NULL. */
    int64_t s = 1;
    for (i = m.ndim - 1; i >= 0; i--) {
      d->strides[i] = s;
      s *= m.shape[i] > 0 ? m.shape[i] : 1;
    }
  }
  /* Element 0 goes in data and byte_offset stays 0: the convention CuPy, PyTorch and NumPy
   * follow on export, so consumers that ignore byte_offset still read the right bytes. */
  d->data = (uint8_t *)gpupool_buffer_ptr(b) + m.byte_offset;
  return 0;
}

static void fill_tensor(DLTensor *t, const dl_desc *d, int64_t *shape, int64_t *strides) {
  if (d->ndim > 0) {
    memcpy(shape, d->shape, sizeof(int64_t) * (size_t)d->ndim);
    memcpy(strides, d->strides, sizeof(int64_t) * (size_t)d->ndim);
  }
  t->data = d->data;
  t->device = d->device;
  t->ndim = d->ndim;
  t->dtype = d->dtype;
  t->shape = shape;
  t->strides = strides;
  t->byte_offset = 0;
}

/* Deleters: manager_ctx is the hold, the block itself is the only allocation. The hold is
 * cleared before release so a deleter run twice by a faulty consumer cannot release it
 * twice through the same (not yet reused) block. */
static void deleter_versioned(DLManagedTensorVersioned *self) {
  gpupool_buffer *b;

  if (self == NULL)
    return;
  b = self->manager_ctx;
  self->manager_ctx = NULL;
  if (b != NULL)
    (void)gpupool_release(b, NULL);
  free(self);
}

static void deleter_legacy(DLManagedTensor *self) {
  gpupool_buffer *b;

  if (self == NULL)
    return;
  b = self->manager_ctx;
  self->manager_ctx = NULL;
  if (b != NULL)
    (void)gpupool_release(b, NULL);
  free(self);
}

/* One allocation for a managed tensor struct of `head` bytes followed by its shape and strides
 * arrays (head is a multiple of 8, so they are aligned; at least one entry each, so they are
 * valid pointers even for 0-d tensors). NULL with a message on failure. */
static void *new_block(size_t head, const dl_desc *d, int64_t **shape, int64_t **strides) {
  size_t n = d->ndim > 0 ? (size_t)d->ndim : 1;
  char *p = calloc(1, head + 2 * n * sizeof(int64_t));
  if (p == NULL) {
    gpupool__err(GPUPOOL_ENOMEM, "cannot allocate a DLPack tensor of %d dimensions", (int)d->ndim);
    return NULL;
  }
  *shape = (int64_t *)(void *)(p + head);
  *strides = *shape + n;
  return p;
}

int gpupool_buffer_to_dlpack_versioned(gpupool_buffer *b, DLManagedTensorVersioned **out) {
  DLManagedTensorVersioned *mt = NULL;
  dl_desc d;
  int64_t *shape, *strides;
  int rc;

  if (b == NULL || out == NULL)
    return gpupool__err(GPUPOOL_EINVAL,
                        "gpupool_buffer_to_dlpack_versioned: buffer and out must be non-NULL");
  *out = NULL;
  rc = describe(b, &d);
  if (rc < 0)
    goto fail;

  mt = new_block(sizeof(*mt), &d, &shape, &strides);
  if (mt == NULL) {
    rc = GPUPOOL_ENOMEM;
    goto fail;
  }
  mt->version.major = DLPACK_MAJOR_VERSION;
  mt->version.minor = DLPACK_MINOR_VERSION;
  mt->manager_ctx = b;
  mt->deleter = deleter_versioned;
  mt->flags = gpupool_buffer_read_only(b) ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
  fill_tensor(&mt->dl_tensor, &d, shape, strides);
  *out = mt;
  return 0;

fail:
  free(mt);
  return rc;
}

int gpupool_buffer_to_dlpack(gpupool_buffer *b, DLManagedTensor **out) {
  DLManagedTensor *mt = NULL;
  dl_desc d;
  int64_t *shape, *strides;
  int rc;

  if (b == NULL || out == NULL)
    return gpupool__err(GPUPOOL_EINVAL,
                        "gpupool_buffer_to_dlpack: buffer and out must be non-NULL");
  *out = NULL;
  if (gpupool_buffer_read_only(b)) {
    rc = gpupool__err(GPUPOOL_ERDONLY,
                      "buffer %llu is held read-only and a pre-1.0 DLManagedTensor cannot "
                      "say so; use gpupool_buffer_to_dlpack_versioned() (DLPack >= 1.0 "
                      "consumers) or get the buffer without GPUPOOL_READ_ONLY",
                      (unsigned long long)gpupool_buffer_id(b));
    goto fail;
  }
  rc = describe(b, &d);
  if (rc < 0)
    goto fail;

  mt = new_block(sizeof(*mt), &d, &shape, &strides);
  if (mt == NULL) {
    rc = GPUPOOL_ENOMEM;
    goto fail;
  }
  mt->manager_ctx = b;
  mt->deleter = deleter_legacy;
  fill_tensor(&mt->dl_tensor, &d, shape, strides);
  *out = mt;
  return 0;

fail:
  free(mt);
  return rc;
}
