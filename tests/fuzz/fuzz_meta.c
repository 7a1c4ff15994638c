/*
 * Fuzz target: tensor metadata (dtype, shapes, strides, offsets, spans).
 *
 * Input: 4 bytes (little-endian) that size a buffer, then a packed TensorMeta as a client
 * would send it with Publish. Two paths run on it:
 *   - the daemon's: a fresh registry with one host pool, a buffer of that size, Publish with
 *     the metadata (conversion from the wire, span check), then Get, whose BufferDesc must
 *     carry the same metadata back, packed and unpacked again;
 *   - the C API's gpupool_tensor_span, on the metadata converted by hand and on the input's
 *     bytes taken as a raw gpupool_tensor_meta, the way a caller could fill one.
 * Whenever metadata is accepted, its span is recomputed here in 128-bit arithmetic: it must
 * be exact, and within the buffer on the daemon's path.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "fuzz.h"
#include "fuzz_pools.h"
#include "registry.h"
#include "wire.h"

/* The registry takes names resolved once (gpd_name_key), as a request's handler resolves
 * them; an error of the resolution is reported by the call that uses the name. */
/* A publish of c's hold id, found as a handler finds it (gpd_hold_of). */
static int publish_id(gpd_registry *reg, gpd_client *c, uint64_t id, const gpd_rname *name,
                      const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all, uint64_t *version) {
  gpd_hold *h;
  int rc = gpd_hold_of(reg, c, id, &h);
  return rc ? rc : gpd_publish(reg, c, h, name, meta, share_gid, share_all, version);
}

static const gpd_rname *rn(gpd_registry *reg, gpd_client *c, const char *name) {
  static gpd_rname ring[8];
  static unsigned next;
  gpd_rname *r = &ring[next++ % 8];
  gpd_name_key(reg, c, name, r);
  return r;
}

static gpd_config cfg;
static gpupool__backend *be;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  static const char *const pools[] = {"name=t,kind=host,capacity=32M,slab=4M", NULL};
  gpd_config_defaults(&cfg);
  fuzz_host_pools(&cfg, pools, &be);
  return 0;
}

typedef unsigned __int128 u128;
#define HUGE_SPAN ((u128)1 << 100)

/* The bytes a tensor reaches from the buffer start, computed wide (saturating at HUGE_SPAN);
 * -1 when the description is not one of a tensor at all. */
static int reference_span(const gpupool_tensor_meta *m, u128 *out) {
  u128 numel = 1, maxidx = 0, item;
  if (m->ndim < 0 || m->ndim > GPUPOOL_MAX_NDIM || m->dtype_bits == 0 || m->dtype_lanes == 0 ||
      ((u128)m->dtype_bits * m->dtype_lanes) % 8)
    return -1;
  item = (u128)m->dtype_bits * m->dtype_lanes / 8;
  for (int i = 0; i < m->ndim; i++) {
    if (m->shape[i] < 0)
      return -1;
    numel = numel * (u128)m->shape[i];
    if (numel > HUGE_SPAN)
      numel = HUGE_SPAN;
  }
  if (numel == 0) {
    *out = m->byte_offset;
    return 0;
  }
  for (int i = 0; i < m->ndim; i++) {
    u128 st;
    if (!m->strides_present) {
      maxidx = numel - 1;
      break;
    }
    if (m->strides[i] < 0)
      return -1;
    st = (u128)m->strides[i];
    maxidx += (u128)(m->shape[i] - 1) * st;
    if (maxidx > HUGE_SPAN)
      maxidx = HUGE_SPAN;
  }
  *out = (maxidx + 1) * item + m->byte_offset;
  if (*out > HUGE_SPAN)
    *out = HUGE_SPAN;
  return 0;
}

/* gpupool_tensor_span may refuse more than it must (an overflow it meets on the way), but
 * what it accepts must be a tensor, and the span it gives must be the exact one. */
static void check_span(const gpupool_tensor_meta *m, const char *what) {
  int err = 1;
  uint64_t span = gpupool_tensor_span(m, &err);
  u128 ref;
  if (err != 0)
    return;
  if (reference_span(m, &ref) != 0)
    fuzz_fail("%s: gpupool_tensor_span accepted metadata that describes no tensor", what);
  if (ref != span)
    fuzz_fail("%s: gpupool_tensor_span says %llu bytes, the tensor reaches %llu%s", what,
              (unsigned long long)span, (unsigned long long)ref, ref > UINT64_MAX ? " (more than 64 bits)" : "");
}

static void same_meta(const Gpupool__Wire__TensorMeta *a, const Gpupool__Wire__TensorMeta *b) {
  if (!b || !b->present || a->dtype_code != b->dtype_code || a->dtype_bits != b->dtype_bits ||
      a->dtype_lanes != b->dtype_lanes || a->n_shape != b->n_shape || a->n_strides != b->n_strides ||
      a->byte_offset != b->byte_offset ||
      (a->n_shape && memcmp(a->shape, b->shape, a->n_shape * sizeof *a->shape)) ||
      (a->n_strides && memcmp(a->strides, b->strides, a->n_strides * sizeof *a->strides)))
    fuzz_fail("Get returned other tensor metadata than was published");
}

/* Publish, then Get: what comes back must be what went in, and must fit. */
static void daemon_path(uint64_t asked, const Gpupool__Wire__TensorMeta *w) {
  uv_loop_t loop;
  gpd_registry reg;
  gpd_client cl;
  gpd_hold *h = NULL, *g = NULL;
  gpupool_tensor_meta m;
  u128 ref;

  uv_loop_init(&loop);
  if (gpd_registry_init(&reg, &loop, &cfg, be) != 0)
    fuzz_fail("registry: %s", gpupool__errmsg());
  memset(&cl, 0, sizeof cl); /* no lease: as a connection closed before it got one */
  cl.uid = 1000;
  gpd_client_init(&reg, &cl);
  if (gpd_allocate(&reg, &cl, gpd_pool_find(&reg, "t", 0), asked, 0, &h) != 0)
    fuzz_fail("allocating %llu bytes: %s", (unsigned long long)asked, gpupool__errmsg());
  {
    /* The daemon's publish and the client's conversion are the same check: they must agree. */
    gpupool_tensor_meta conv;
    int published = publish_id(&reg, &cl, h->id, rn(&reg, &cl, "t"), w, 0, 0, NULL) == 0;
    int converts = !w->present || gpupool__wire_meta_from(w, asked, &conv) == 0;
    if (published != converts)
      fuzz_fail("publish %s metadata the client's conversion %s", published ? "accepted" : "refused",
                converts ? "accepts" : "refuses");
    if (published)
      gpd_unpublish(&reg, &cl, rn(&reg, &cl, "t"));
  }
  if (publish_id(&reg, &cl, h->id, rn(&reg, &cl, "t"), w, 0, 0, NULL) == 0 && w->present) {
    gpd_desc_storage ds;
    Gpupool__Wire__BufferDesc *back;
    uint8_t *buf;
    size_t len;
    if (gpupool__wire_meta_convert(w, &m) != 0)
      fuzz_fail("the daemon accepted metadata that has no C form");
    if (reference_span(&m, &ref) != 0 || ref > asked)
      fuzz_fail("the daemon accepted a tensor that does not fit its %llu-byte buffer", (unsigned long long)asked);
    if (gpd_get(&reg, &cl, rn(&reg, &cl, "t"), 1, 0, &g, NULL) != 0)
      fuzz_fail("get after publish: %s", gpupool__errmsg());
    gpd_fill_desc(&reg, &cl, g, rn(&reg, &cl, "t"), &ds);
    len = gpupool__wire__buffer_desc__get_packed_size(&ds.desc);
    buf = malloc(len ? len : 1);
    if (!buf)
      fuzz_fail("out of memory");
    gpupool__wire__buffer_desc__pack(&ds.desc, buf);
    back = gpupool__wire__buffer_desc__unpack(NULL, len, buf);
    free(buf);
    if (!back)
      fuzz_fail("the daemon's BufferDesc does not unpack");
    same_meta(w, back->tensor);
    gpupool__wire__buffer_desc__free_unpacked(back, NULL);
  }
  gpd_client_drop(&reg, &cl);
  gpd_registry_close(&reg);
  uv_run(&loop, UV_RUN_DEFAULT);
  if (uv_loop_close(&loop) != 0)
    fuzz_fail("the loop still has handles after the registry was closed");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  Gpupool__Wire__TensorMeta *w;
  gpupool_tensor_meta raw, m;
  uint64_t asked;

  if (size >= sizeof raw) {
    memcpy(&raw, data, sizeof raw);
    check_span(&raw, "raw gpupool_tensor_meta");
  }
  if (size < 4)
    return 0;
  /* 1 byte to 24 MiB: small buffers, slab-sized ones and dedicated slabs. */
  asked = ((uint64_t)data[0] | (uint64_t)data[1] << 8 | (uint64_t)data[2] << 16 | (uint64_t)data[3] << 24) %
              (24ull << 20) + 1;
  w = gpupool__wire__tensor_meta__unpack(NULL, size - 4, data + 4);
  if (!w)
    return 0;
  if (gpupool__wire_meta_convert(w, &m) == 0)
    check_span(&m, "metadata from the wire");
  daemon_path(asked, w);
  gpupool__wire__tensor_meta__free_unpacked(w, NULL);
  return 0;
}
