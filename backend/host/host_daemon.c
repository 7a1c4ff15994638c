/*
 * Host backend: a pool is one sealed memfd of the pool's capacity (sparse: pages exist only
 * once touched). Slabs are 2 MiB-aligned ranges of it placed by the range allocator; their
 * export data is (offset, size), which a client mmaps from the pool fd. A freed slab's pages
 * are punched out, so memory really goes back to the system.
 *
 * The memfd is sealed against shrinking and growing before any client sees it: otherwise a
 * client could ftruncate it and every other process mapping it would die of SIGBUS.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "errors.h"
#include "host.h"

#define SLAB_GRAIN (2ull << 20)

struct gpupool__bpool {
  int fd;
  gpupool__alloc *space;
  uint64_t reserved, reserved_high;
};

static int host_pool_create(gpupool__backend *be, const gpupool__pool_config *cfg,
                            gpupool__bpool **out, int *fd) {
  gpupool__bpool *p;
  char name[96];
  int rc;

  (void)be;
  p = calloc(1, sizeof *p);
  if (!p)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  snprintf(name, sizeof name, "gpupool:%s", cfg->name);
  p->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (p->fd < 0) {
    rc = gpupool__err(GPUPOOL_EBACKEND, "memfd_create failed: %s", strerror(errno));
    goto fail;
  }
  if (ftruncate(p->fd, (off_t)cfg->capacity) != 0) {
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot size the memfd to %llu bytes: %s",
                      (unsigned long long)cfg->capacity, strerror(errno));
    goto fail_fd;
  }
  if (fcntl(p->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot seal the memfd: %s", strerror(errno));
    goto fail_fd;
  }
  if ((rc = gpupool__alloc_new(cfg->capacity, &p->space)) != 0)
    goto fail_fd;
  *out = p;
  *fd = p->fd;
  return 0;
fail_fd:
  close(p->fd);
fail:
  free(p);
  return rc;
}

static void host_pool_destroy(gpupool__bpool *p) {
  if (!p)
    return;
  close(p->fd);
  gpupool__alloc_delete(p->space);
  free(p);
}

static int host_slab_alloc(gpupool__bpool *p, uint64_t size, gpupool__bslab *out) {
  uint64_t off;
  size = (size + SLAB_GRAIN - 1) & ~(SLAB_GRAIN - 1);
  if (size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__err(GPUPOOL_ETOOBIG, "slab of %llu bytes exceeds 4 GiB", (unsigned long long)size);
  if (gpupool__alloc_get(p->space, size, SLAB_GRAIN, &off) != 0)
    return GPUPOOL_ENOSPC;
  memset(out, 0, sizeof *out);
  out->size = size;
  out->export_len = gpupool__host_export_encode(&(gpupool__host_export){.offset = off, .size = size},
                                                out->export_data);
  out->priv = (void *)(uintptr_t)off;
  p->reserved += size;
  if (p->reserved > p->reserved_high)
    p->reserved_high = p->reserved;
  return 0;
}

static void host_slab_free(gpupool__bpool *p, gpupool__bslab *s) {
  uint64_t off = (uint64_t)(uintptr_t)s->priv;
  /* Give the pages back; the range reads as zeros if anyone still maps it. */
  fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)s->size);
  gpupool__alloc_put(p->space, off, s->size);
  p->reserved -= s->size;
}

static int host_pool_stats(gpupool__bpool *p, gpupool__bpool_stats *out) {
  struct stat st;
  out->reserved_cur = p->reserved;
  out->reserved_high = p->reserved_high;
  /* Pages actually present in the memfd. */
  out->used_cur = fstat(p->fd, &st) == 0 ? (uint64_t)st.st_blocks * 512 : 0;
  out->used_high = 0;
  return 0;
}

static void host_close(gpupool__backend *be) { free(be); }

static const gpupool__backend_ops host_ops = {
    .has_events = 0,
    .pool_create = host_pool_create,
    .pool_destroy = host_pool_destroy,
    .slab_alloc = host_slab_alloc,
    .slab_free = host_slab_free,
    .pool_stats = host_pool_stats,
    .close = host_close,
};

int gpupool__host_open(gpupool__backend **out) {
  gpupool__backend *be = calloc(1, sizeof *be);
  if (!be)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  be->desc = &gpupool__backend_host;
  be->ops = &host_ops;
  *out = be;
  return 0;
}
