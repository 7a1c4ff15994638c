/*
 * The daemon's view of where memory comes from. A backend creates pools that can be shared
 * with other processes through one fd, hands out slabs (contiguous regions a client maps
 * once, described by opaque export data) and, for CUDA, inter-process events. The daemon's
 * own allocator sub-allocates buffers inside slabs; the backend never sees buffers.
 *
 * Two implementations: host (memfd, backend_host.c) and cuda (backend_cuda.c, compiled in
 * when the CUDA toolkit is found). Every function returning int returns 0 or a negative
 * GPUPOOL_E* code with a message recorded through gpupool__err().
 */
#ifndef GPUPOOL_DAEMON_BACKEND_H
#define GPUPOOL_DAEMON_BACKEND_H

#include <stdint.h>

#include "config.h"

#define GPUPOOL_EXPORT_MAX 128
#define GPUPOOL_EVENT_HANDLE_SIZE 64

typedef struct gpupool__backend gpupool__backend;
typedef struct gpupool__bpool gpupool__bpool;   /* backend-private pool */
typedef struct gpupool__bevent gpupool__bevent; /* backend-private event */

/* A slab as the backend describes it. */
typedef struct {
  uint64_t size;
  uint8_t export_data[GPUPOOL_EXPORT_MAX];
  uint32_t export_len;
  void *priv; /* backend's handle (device pointer, offset, ...) */
} gpupool__bslab;

typedef struct {
  uint64_t reserved_cur, reserved_high, used_cur, used_high;
} gpupool__bpool_stats;

typedef struct {
  const char *name;   /* "host" or "cuda" */
  int kind;           /* GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST / _CUDA */
  int has_events;     /* 1 when event_* are implemented */
  /* Create a pool per cfg (already checked by gpupool__config_finish). *fd is the pool's
   * shareable fd, owned by the pool (sent to clients with SCM_RIGHTS, never closed by the
   * caller). */
  int (*pool_create)(gpupool__backend *be, const gpupool__pool_config *cfg,
                     gpupool__bpool **out, int *fd);
  /* Frees the pool; every slab must have been freed first. */
  void (*pool_destroy)(gpupool__bpool *p);
  /* Take a slab of size bytes (<= GPUPOOL_SLAB_HARD_MAX), exported for import by clients.
   * GPUPOOL_ENOSPC when the pool cannot provide it. */
  int (*slab_alloc)(gpupool__bpool *p, uint64_t size, gpupool__bslab *out);
  /* Give a slab back. The daemon calls it only after every client that mapped it has
   * unmapped it (or exited) and every done event on it has completed. */
  void (*slab_free)(gpupool__bpool *p, gpupool__bslab *s);
  int (*pool_stats)(gpupool__bpool *p, gpupool__bpool_stats *out);
  /* Inter-process events (has_events only). handle receives the IPC handle bytes. */
  int (*event_create)(gpupool__backend *be, gpupool__bevent **out,
                      uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE]);
  /* 1 when all work recorded in the event has completed, 0 when pending, < 0 on error. */
  int (*event_query)(gpupool__bevent *e);
  void (*event_destroy)(gpupool__bevent *e);
  /* Free the backend (after every pool). */
  void (*close)(gpupool__backend *be);
} gpupool__backend_ops;

struct gpupool__backend {
  const gpupool__backend_ops *ops;
  void *priv;
};

/* Open a backend. "auto" picks cuda when a usable GPU is present, host otherwise, and logs
 * which and why. GPUPOOL_ENOTSUP (with a message naming what is missing) when cuda is asked
 * for and cannot be used. The returned backend is freed with be->ops->close(be). */
int gpupool__backend_open(gpupool__backend_choice choice, gpupool__backend **out);
int gpupool__backend_host_open(gpupool__backend **out);
/* Defined in backend_cuda.c when built with CUDA; otherwise returns GPUPOOL_ENOTSUP. */
int gpupool__backend_cuda_open(gpupool__backend **out);
/* Probe without opening: 1 usable, 0 not (with the reason in gpupool__errmsg()). */
int gpupool__backend_cuda_probe(void);
/* Default pools for a backend when none are configured (cuda: one per device). */
int gpupool__backend_cuda_default_pools(gpupool__config *c);

#endif
