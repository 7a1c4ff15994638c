/*
 * The backend table, backend selection (auto|cuda|host) and the pool checks every backend
 * shares. Adding a backend: a folder backend/NAME/ with its two halves and descriptor, and
 * one line in the table below.
 */
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "errors.h"
#include "log.h"

#define MIB ((uint64_t)1 << 20)

static const gpupool__backend_desc *const table[] = {&gpupool__backend_host, &gpupool__backend_cuda};
#define NTABLE ((int)(sizeof table / sizeof table[0]))

const gpupool__backend_desc *gpupool__backend_by_name(const char *name) {
  for (int i = 0; i < NTABLE; i++)
    if (!strcmp(table[i]->name, name))
      return table[i];
  return NULL;
}

const gpupool__backend_desc *gpupool__backend_by_kind(int kind) {
  for (int i = 0; i < NTABLE; i++)
    if (table[i]->kind == kind)
      return table[i];
  return NULL;
}

const char *gpupool__backend_names(void) {
  static char names[128];
  if (!names[0]) {
    size_t off = 0;
    for (int i = 0; i < NTABLE; i++)
      off += (size_t)snprintf(names + off, sizeof names - off, "%s%s", i ? ", " : "", table[i]->name);
  }
  return names;
}

void gpupool__pool_config_init(gpupool__pool_config *p) {
  memset(p, 0, sizeof *p);
  p->kind = 0; /* the backend's default, decided by gpupool__backend_pool_finish */
  p->device = -1;
  p->numa_node = -1;
  p->release_threshold = -1;
  p->reuse_follow_event_deps = -1;
  p->reuse_allow_opportunistic = -1;
  p->reuse_allow_internal_deps = -1;
  p->keep_slabs = 1;
}

static const char *kind_name(gpupool_mem_kind k) {
  switch (k) {
  case GPUPOOL_MEM_HOST: return "host";
  case GPUPOOL_MEM_DEVICE: return "device";
  case GPUPOOL_MEM_HOST_NUMA: return "host-numa";
  default: return "unknown";
  }
}

int gpupool__backend_pool_finish(const gpupool__backend_desc *d, gpupool__pool_config *p) {
  if (p->kind == 0)
    p->kind = d->default_mem_kind;
  if (!(d->mem_kinds & (1u << p->kind)))
    return gpupool__err(GPUPOOL_ECONFIG, "pool '%s' asks for %s memory, which %s", p->name,
                        kind_name(p->kind), d->refuse_kind(p->kind));
  if (p->kind != GPUPOOL_MEM_HOST && p->device < 0)
    p->device = 0;
  if (p->kind == GPUPOOL_MEM_HOST_NUMA && p->numa_node < 0)
    p->numa_node = 0;
  if (p->slab_size == 0)
    p->slab_size = d->default_slab_size;
  if (p->alignment == 0)
    p->alignment = 256;
  if (p->capacity == 0)
    p->capacity = d->default_capacity;
  if (p->alignment & (p->alignment - 1) || p->alignment > (2 * MIB))
    return gpupool__err(GPUPOOL_ECONFIG, "pool '%s': alignment %llu must be a power of two up to 2M",
                        p->name, (unsigned long long)p->alignment);
  if (p->slab_size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__err(GPUPOOL_ECONFIG,
                        "pool '%s': slab_size %llu exceeds 4G; exported allocations above 4 GiB "
                        "crash or corrupt importers, so gpupool caps every slab at 4G",
                        p->name, (unsigned long long)p->slab_size);
  /* Slabs start at 2 MiB boundaries (the GPU page size; also page-aligned for mmap). */
  p->slab_size = (p->slab_size + 2 * MIB - 1) & ~(2 * MIB - 1);
  if (p->capacity < p->slab_size)
    return gpupool__err(GPUPOOL_ECONFIG, "pool '%s': capacity %llu is smaller than one slab (%llu)",
                        p->name, (unsigned long long)p->capacity, (unsigned long long)p->slab_size);
  p->capacity &= ~(2 * MIB - 1);
  return 0;
}

int gpupool__backend_open(const gpupool__backend_desc *want, gpupool__backend **out) {
  const gpupool__backend_desc *host = &gpupool__backend_host, *cuda = &gpupool__backend_cuda;
  int rc;

  if (want) {
    rc = want->open(out);
    if (rc == 0)
      GPUPOOL__INFO("backend: %s (%s), as configured", want->name, want->what);
    return rc;
  }
  if (cuda->probe()) {
    if ((rc = cuda->open(out)) == 0) {
      GPUPOOL__INFO("backend: cuda (auto: a usable GPU is present)");
      return 0;
    }
    GPUPOOL__WARN("backend auto: CUDA looked usable but failed to open (%s); using host memory",
                  gpupool__errmsg());
  } else {
    GPUPOOL__INFO("backend: host (auto: %s)", gpupool__errmsg());
  }
  return host->open(out);
}
