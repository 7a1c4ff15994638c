/*
 * Conversions between wire messages and the C structs both sides use, with the checks both
 * sides make: tensor metadata (validated the same way by the daemon when a client publishes
 * it and by the client when the daemon hands it over), memory kinds and names.
 */
#include <inttypes.h>
#include <string.h>

#include "errors.h"
#include "wire.h"

int gpupool__wire_meta_convert(const Gpupool__Wire__TensorMeta *w, gpupool_tensor_meta *m) {
  memset(m, 0, sizeof *m);
  if (w->n_shape > GPUPOOL_MAX_NDIM)
    return gpupool__err(GPUPOOL_EMETA, "tensor has %zu dimensions; the limit is %d", w->n_shape,
                        GPUPOOL_MAX_NDIM);
  if (w->n_strides != 0 && w->n_strides != w->n_shape)
    return gpupool__err(GPUPOOL_EMETA, "tensor has %zu strides for %zu dimensions", w->n_strides,
                        w->n_shape);
  if (w->dtype_code > 255 || w->dtype_bits > 255 || w->dtype_lanes > 65535)
    return gpupool__err(GPUPOOL_EMETA, "dtype (code %u, bits %u, lanes %u) is out of DLPack's range",
                        w->dtype_code, w->dtype_bits, w->dtype_lanes);
  m->dtype_code = (uint8_t)w->dtype_code;
  m->dtype_bits = (uint8_t)w->dtype_bits;
  m->dtype_lanes = (uint16_t)w->dtype_lanes;
  m->ndim = (int32_t)w->n_shape;
  for (size_t i = 0; i < w->n_shape; i++)
    m->shape[i] = w->shape[i];
  m->strides_present = w->n_strides != 0;
  for (size_t i = 0; i < w->n_strides; i++)
    m->strides[i] = w->strides[i];
  m->byte_offset = w->byte_offset;
  return 0;
}

int gpupool__wire_meta_from(const Gpupool__Wire__TensorMeta *w, uint64_t size, gpupool_tensor_meta *m) {
  int rc = gpupool__wire_meta_convert(w, m);
  return rc != 0 ? rc : gpupool__wire_meta_check(m, size);
}

int gpupool__wire_meta_check(const gpupool_tensor_meta *m, uint64_t size) {
  int err;
  uint64_t span = gpupool_tensor_span(m, &err);
  if (err)
    return err;
  if (span > size)
    return gpupool__err(GPUPOOL_EMETA,
                        "tensor spans %" PRIu64 " bytes (offset included) but the buffer has %" PRIu64,
                        span, size);
  return 0;
}

void gpupool__wire_meta_to(const gpupool_tensor_meta *m, Gpupool__Wire__TensorMeta *w) {
  gpupool__wire__tensor_meta__init(w);
  w->present = 1;
  w->dtype_code = m->dtype_code;
  w->dtype_bits = m->dtype_bits;
  w->dtype_lanes = m->dtype_lanes;
  w->n_shape = (size_t)m->ndim;
  w->shape = (int64_t *)m->shape;
  w->n_strides = m->strides_present ? (size_t)m->ndim : 0;
  w->strides = (int64_t *)m->strides;
  w->byte_offset = m->byte_offset;
}

int gpupool__wire_location(gpupool_mem_kind k) {
  switch (k) {
  case GPUPOOL_MEM_HOST: return GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST;
  case GPUPOOL_MEM_DEVICE: return GPUPOOL__WIRE__LOCATION_KIND__LOCATION_DEVICE;
  case GPUPOOL_MEM_HOST_NUMA: return GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST_NUMA;
  }
  return GPUPOOL__WIRE__LOCATION_KIND__LOCATION_UNSPECIFIED;
}

int gpupool__wire_mem_kind(int location, gpupool_mem_kind *out) {
  switch (location) {
  case GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST: *out = GPUPOOL_MEM_HOST; return 0;
  case GPUPOOL__WIRE__LOCATION_KIND__LOCATION_DEVICE: *out = GPUPOOL_MEM_DEVICE; return 0;
  case GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST_NUMA: *out = GPUPOOL_MEM_HOST_NUMA; return 0;
  }
  return gpupool__err(GPUPOOL_EPROTO, "unknown memory location %d from the peer; upgrade both sides "
                      "to the same release", location);
}

/* Names are checked the same way by the client (before sending) and the daemon: the length
 * and control characters here, in the order a refusal names them, then the UTF-8 where the
 * caller has not checked it yet. */
static int check_name_text(const char *name, size_t n) {
  if (n == 0)
    return gpupool__err(GPUPOOL_ENAME, "empty name; names are 1 to %d bytes", GPUPOOL_NAME_MAX);
  if (n > GPUPOOL_NAME_MAX)
    return gpupool__err(GPUPOOL_ENAME, "name of %zu bytes is longer than the limit of %d", n,
                        GPUPOOL_NAME_MAX);
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
      return gpupool__err(GPUPOOL_ENAME, "name contains a control character at byte %zu", i);
  return 0;
}

int gpupool__wire_check_name(const char *name) {
  size_t n = strlen(name), bad;
  int rc = check_name_text(name, n);
  if (rc != 0)
    return rc;
  if (gpupool__wire_utf8_check((const uint8_t *)name, n, &bad) != 0)
    return gpupool__err(GPUPOOL_ENAME, "name is not valid UTF-8 (at byte %zu); names are UTF-8 text", bad);
  return 0;
}

int gpupool__wire_check_utf8_name(const char *name) { return check_name_text(name, strlen(name)); }

int gpupool__wire_publish_shares(const Gpupool__Wire__Publish *m) {
  for (size_t i = 0; i < m->base.n_unknown_fields; i++) {
    const ProtobufCMessageUnknownField *f = &m->base.unknown_fields[i];
    if (f->tag != 5 && f->tag != 6)
      continue;
    if (f->wire_type != PROTOBUF_C_WIRE_TYPE_VARINT)
      return 1; /* not what an old client sent, but no reason to publish either */
    for (size_t j = 0; j < f->len; j++)
      if (f->data[j] & 0x7f)
        return 1; /* a varint is nonzero iff one of its 7-bit groups is */
  }
  return 0;
}
