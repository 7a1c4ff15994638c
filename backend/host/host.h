/*
 * The host backend: pools of shared host memory (a sealed memfd), for machines without a GPU
 * and for CPU-only users. host_daemon.c is the daemon half, host_client.c the client half,
 * host.c the descriptor and the slab export format below, which both halves use.
 */
#ifndef GPUPOOL_BACKEND_HOST_H
#define GPUPOOL_BACKEND_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* A slab's export data: where it lies in the pool's memfd. On the wire: offset then size,
 * each 8 bytes little-endian. */
typedef struct {
  uint64_t offset;
  uint64_t size;
} gpupool__host_export;

#define GPUPOOL__HOST_EXPORT_LEN 16

/* Writes GPUPOOL__HOST_EXPORT_LEN bytes to out; returns that length. */
uint32_t gpupool__host_export_encode(const gpupool__host_export *e, uint8_t *out);
/* GPUPOOL_EPROTO (with a message) when len is not GPUPOOL__HOST_EXPORT_LEN. */
int gpupool__host_export_decode(const uint8_t *data, size_t len, gpupool__host_export *e);

int gpupool__host_open(gpupool__backend **out);
extern const gpupool__cbackend_ops gpupool__host_client_ops;

#endif
