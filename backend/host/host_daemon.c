/*
 * Host backend, daemon half: a pool is a capacity; each slab is its own sealed memfd of the
 * slab's size, with a read-only fd of it made at creation. A client receives, in the reply
 * that first names a slab, the fd of that slab alone (read-only when its hold is), so it can
 * map nothing it was not given; a freed slab's memfd is closed, so its pages go back to the
 * system once the last mapping goes, and a new slab always starts as zeros.
 *
 * Every memfd is sealed against shrinking and growing before any client sees it: otherwise a
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

#include "errors.h"
#include "host.h"

#define SLAB_GRAIN (2ull << 20)

struct gpupool__bpool {
  char name[64];
  uint64_t capacity;
  uint64_t reserved, reserved_high;
};

/* Host pools have no pool-wide fd: every slab is its own memfd, so a client receives (and can
 * map) only the slabs it was given, and a pool's capacity is never lost to placement. */
static int host_pool_create(gpupool__backend *be, const gpupool__pool_config *cfg,
                            gpupool__bpool **out, int *fd) {
  gpupool__bpool *p;

  (void)be;
  p = calloc(1, sizeof *p);
  if (!p)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  snprintf(p->name, sizeof p->name, "%s", cfg->name);
  p->capacity = cfg->capacity;
  *out = p;
  *fd = -1;
  return 0;
}

static void host_pool_destroy(gpupool__bpool *p) { free(p); }

/* A slab is a sealed memfd (no client can shrink or grow it under another's mapping, the
 * SIGBUS trap), mode 0600 so that a read-only fd of it cannot be reopened read-write through
 * /proc by another user, plus that read-only fd, made once. */
static int host_slab_alloc(gpupool__bpool *p, uint64_t size, gpupool__bslab *out) {
  char name[96], path[64];
  int fd, ro, rc;

  size = (size + SLAB_GRAIN - 1) & ~(SLAB_GRAIN - 1);
  if (size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__err(GPUPOOL_ETOOBIG, "slab of %llu bytes exceeds 4 GiB", (unsigned long long)size);
  if (p->reserved + size > p->capacity)
    return GPUPOOL_ENOSPC;
  snprintf(name, sizeof name, "gpupool:%s", p->name);
  fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return gpupool__err(errno == EMFILE || errno == ENFILE ? GPUPOOL_EFD : GPUPOOL_EBACKEND,
                        "memfd_create failed: %s", strerror(errno));
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)size) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot size and seal a memfd of %llu bytes: %s",
                      (unsigned long long)size, strerror(errno));
    close(fd);
    return rc;
  }
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ro = open(path, O_RDONLY | O_CLOEXEC);
  if (ro < 0) {
    rc = gpupool__err(errno == EMFILE || errno == ENFILE ? GPUPOOL_EFD : GPUPOOL_EBACKEND,
                      "cannot open a read-only fd of a slab through %s: %s (is /proc mounted?)", path,
                      strerror(errno));
    close(fd);
    return rc;
  }
  memset(out, 0, sizeof *out);
  out->size = size;
  out->fd = fd;
  out->fd_ro = ro;
  out->export_len = gpupool__host_export_encode(&(gpupool__host_export){.offset = 0, .size = size},
                                                out->export_data);
  p->reserved += size;
  if (p->reserved > p->reserved_high)
    p->reserved_high = p->reserved;
  return 0;
}

static void host_slab_free(gpupool__bpool *p, gpupool__bslab *s) {
  /* Closing the daemon's fds frees the pages once no client maps them any more (the daemon
   * frees a slab only after every client that mapped it has unmapped it or gone). */
  close(s->fd);
  close(s->fd_ro);
  s->fd = s->fd_ro = -1;
  p->reserved -= s->size;
}

static int host_pool_stats(gpupool__bpool *p, gpupool__bpool_stats *out) {
  out->reserved_cur = p->reserved;
  out->reserved_high = p->reserved_high;
  /* Slabs are whole memfds, sized at creation; pages appear as clients touch them. */
  out->used_cur = 0;
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
