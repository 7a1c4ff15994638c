/*
 * The host backend's descriptor and its slab export format (see host.h).
 */
#include <stdio.h>

#include "host.h"

#include "errors.h"
#include "gpupool.pb-c.h"

static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

uint32_t gpupool__host_export_encode(const gpupool__host_export *e, uint8_t *out) {
  put_u64(out, e->offset);
  put_u64(out + 8, e->size);
  return GPUPOOL__HOST_EXPORT_LEN;
}

int gpupool__host_export_decode(const uint8_t *data, size_t len, gpupool__host_export *e) {
  if (len != GPUPOOL__HOST_EXPORT_LEN)
    return gpupool__err(GPUPOOL_EPROTO, "host slab export data has %zu bytes, expected %d", len,
                        GPUPOOL__HOST_EXPORT_LEN);
  e->offset = get_u64(data);
  e->size = get_u64(data + 8);
  return 0;
}

static int host_probe(void) { return 1; }

static const char *host_refuse_kind(gpupool_mem_kind kind) {
  (void)kind;
  return "the daemon runs the host backend (start with --backend cuda on a GPU machine, or set "
         "kind = host)";
}

static int host_default_pools(gpupool__pool_config *pools, int max, int *n) {
  gpupool__pool_config *p;
  if (*n >= max)
    return 0;
  p = &pools[(*n)++];
  gpupool__pool_config_init(p);
  snprintf(p->name, sizeof p->name, "default");
  p->kind = GPUPOOL_MEM_HOST;
  return 0;
}

const gpupool__backend_desc gpupool__backend_host = {
    .kind = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST,
    .name = "host",
    .what = "memfd shared memory",
    .mem_kinds = 1u << GPUPOOL_MEM_HOST,
    .default_mem_kind = GPUPOOL_MEM_HOST,
    .default_slab_size = 64ull << 20,
    .default_capacity = 1ull << 30,
    .refuse_kind = host_refuse_kind,
    .probe = host_probe,
    .open = gpupool__host_open,
    .default_pools = host_default_pools,
    .client = &gpupool__host_client_ops,
    .pool_fd_maps_all = 0, /* no pool fd: each slab is its own memfd */
    .pool_keeps_memory = 0,
    .every_pool_survives = 1,
};
