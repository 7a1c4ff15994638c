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

/* 4G, 2M, or 1.5G (1610612736 bytes): sizes as the config file writes them. */
static const char *fmt_size(uint64_t v, char *buf, size_t len) {
  static const char *const units[] = {"", "K", "M", "G", "T"};
  uint64_t x = v;
  size_t u = 0;
  while (u + 1 < sizeof units / sizeof units[0] && x >= 1024 && x % 1024 == 0) {
    x /= 1024;
    u++;
  }
  if (u > 0 || v < 1024) {
    snprintf(buf, len, "%llu%s", (unsigned long long)x, units[u]);
    return buf;
  }
  for (u = 0, x = v; u + 1 < sizeof units / sizeof units[0] && x >= 1024; u++)
    x /= 1024;
  snprintf(buf, len, "%.1f%s (%llu bytes)", (double)v / (double)(1ull << (10 * u)), units[u], (unsigned long long)v);
  return buf;
}

int gpupool__backend_pool_finish(const gpupool__backend_desc *d, gpupool__pool_config *p, const char **key) {
  char a[48], b[48];
  const char *unused;
  if (!key)
    key = &unused;
  *key = NULL;
  if (p->kind == 0)
    p->kind = d->default_mem_kind;
  if (!(d->mem_kinds & (1u << p->kind))) {
    *key = "kind";
    return gpupool__err(GPUPOOL_ECONFIG, "pool '%s' asks for %s memory, which %s", p->name,
                        kind_name(p->kind), d->refuse_kind(p->kind));
  }
  if (p->survive && !d->every_pool_survives &&
      (p->release_threshold >= 0 || p->reuse_follow_event_deps >= 0 || p->reuse_allow_opportunistic >= 0 ||
       p->reuse_allow_internal_deps >= 0)) {
    *key = "survive";
    return gpupool__err(GPUPOOL_ECONFIG, "pool '%s': release_threshold and reuse_* are attributes of stream-ordered "
                        "pools, which a survive=yes pool does not use: remove them or survive", p->name);
  }
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
  if (p->alignment & (p->alignment - 1) || p->alignment > (2 * MIB)) {
    *key = "alignment";
    return gpupool__err(GPUPOOL_ECONFIG, "pool '%s': alignment %s must be a power of two up to 2M",
                        p->name, fmt_size(p->alignment, a, sizeof a));
  }
  if (p->slab_size > GPUPOOL_SLAB_HARD_MAX) {
    *key = "slab_size";
    return gpupool__err(GPUPOOL_ECONFIG,
                        "pool '%s': slab_size %s exceeds 4G; exported allocations above 4 GiB "
                        "crash or corrupt importers, so gpupool caps every slab at 4G",
                        p->name, fmt_size(p->slab_size, a, sizeof a));
  }
  /* Slabs start at 2 MiB boundaries (the GPU page size; also page-aligned for mmap). */
  p->slab_size = (p->slab_size + 2 * MIB - 1) & ~(2 * MIB - 1);
  if (p->capacity < p->slab_size) {
    *key = "capacity";
    return gpupool__err(GPUPOOL_ECONFIG, "pool '%s': capacity %s is smaller than one slab (%s): raise capacity "
                        "or lower slab_size",
                        p->name, fmt_size(p->capacity, a, sizeof a), fmt_size(p->slab_size, b, sizeof b));
  }
  p->capacity &= ~(2 * MIB - 1);
  return 0;
}

int gpupool__backend_open(const gpupool__backend_desc *want, gpupool__backend **out) {
  const gpupool__backend_desc *host = &gpupool__backend_host, *cuda = &gpupool__backend_cuda;
  gpupool__error why; /* why auto did not pick CUDA */
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
    gpupool__error_take(&why, rc);
    GPUPOOL__WARN("backend auto: CUDA looked usable but failed to open (%s); using host memory", why.msg);
  } else {
    gpupool__error_take(&why, GPUPOOL_ENOTSUP); /* probe's reason */
    GPUPOOL__INFO("backend: host (auto: %s)", why.msg);
  }
  return host->open(out);
}
