/*
 * The client library's view of a backend: import a pool from the fd the daemon sent, map
 * slabs from their export data, and (CUDA) open, record and wait on inter-process events.
 * Host implementation in cbackend_host.c, CUDA in cbackend_cuda.c. Functions returning int
 * return 0 or a negative GPUPOOL_E* code with a message recorded through gpupool__err().
 */
#ifndef GPUPOOL_CLIENT_CBACKEND_H
#define GPUPOOL_CLIENT_CBACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "gpupool/gpupool.h"

typedef struct gpupool__cpool gpupool__cpool;   /* backend-private imported pool */
typedef struct gpupool__cevent gpupool__cevent; /* backend-private opened event */

typedef struct {
  const char *name;
  int has_events;
  /* Import a pool. Takes ownership of fd (closes it on failure too). kind/device/numa say
   * where the memory lives. */
  int (*pool_import)(int fd, gpupool_mem_kind kind, int device, uint64_t capacity,
                     gpupool__cpool **out);
  /* Undo pool_import (after every slab is unmapped). */
  void (*pool_release)(gpupool__cpool *p);
  /* Give these devices read/write access to the pool (CUDA; host: no-op). */
  int (*pool_set_access)(gpupool__cpool *p, const int *devices, int n);
  /* Map a slab; *base is its address in this process, *priv the backend's handle. */
  int (*slab_map)(gpupool__cpool *p, const uint8_t *export_data, size_t export_len,
                  uint64_t size, void **base, void **priv);
  /* Unmap a slab in stream order (CUDA: cudaFreeAsync of the import in stream). */
  int (*slab_unmap)(gpupool__cpool *p, void *base, uint64_t size, void *priv, void *stream);
  /* Events (has_events only). */
  int (*event_open)(const uint8_t *handle, size_t len, gpupool__cevent **out);
  void (*event_close)(gpupool__cevent *e);
  int (*event_record)(gpupool__cevent *e, void *stream);
  int (*stream_wait)(gpupool__cevent *e, void *stream);
  /* 1 when all work recorded in e has completed, 0 when not, < 0 on error. A stream wait on
   * an inter-process event costs ~135 us on an H200 even when the event has completed, so
   * the client queries first and waits only for work still running. */
  int (*event_query)(gpupool__cevent *e);
  /* 1 when nothing is queued in stream (then recording an event there orders nothing and
   * is skipped), 0 when work is pending, < 0 on error. */
  int (*stream_idle)(void *stream);
  /* Wait until work queued in stream has run (NULL: nothing to wait for on this backend).
   * Used before telling the daemon that slabs unmapped outside any caller's stream are gone:
   * the importer's free must complete before the exporter frees. */
  int (*sync)(void *stream);
} gpupool__cbackend_ops;

extern const gpupool__cbackend_ops gpupool__cbackend_host;
/* NULL when the library was built without CUDA. */
extern const gpupool__cbackend_ops *const gpupool__cbackend_cuda;

#endif
