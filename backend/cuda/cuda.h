/*
 * The CUDA backend: stream-ordered memory pools exported with POSIX fds (device memory, or
 * pinned host memory of a NUMA node). cuda_daemon.c is the daemon half, cuda_client.c the
 * client half, cuda.c the slab export format, the pool access call and the error helper both
 * halves use; desc.c the descriptor. Without the CUDA toolkit only desc.c and cuda_none.c are
 * built: the backend is still known by name, so its pools get a clear refusal.
 */
#ifndef GPUPOOL_BACKEND_CUDA_H
#define GPUPOOL_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* Daemon half (cuda_daemon.c; cuda_none.c's refusals in a build without CUDA). */
int gpupool__cuda_probe(void);
int gpupool__cuda_open(gpupool__backend **out);
int gpupool__cuda_default_pools(gpupool__pool_config *pools, int max, int *n);

#ifdef GPUPOOL_HAVE_CUDA
#include <cuda_runtime_api.h>

/* Client half (cuda_client.c). */
extern const gpupool__cbackend_ops gpupool__cuda_client_ops;

/* A slab's export data is the driver's cudaMemPoolPtrExportData, byte for byte. */
_Static_assert(sizeof(struct cudaMemPoolPtrExportData) <= GPUPOOL_EXPORT_MAX,
               "CUDA export data must fit in a slab description");
uint32_t gpupool__cuda_export_encode(const struct cudaMemPoolPtrExportData *e, uint8_t *out);
/* GPUPOOL_EPROTO (with a message) when len is not the driver's size. */
int gpupool__cuda_export_decode(const uint8_t *data, size_t len,
                                struct cudaMemPoolPtrExportData *e);

/* Access of one device to a pool in this process (ProtReadWrite or ProtNone): both halves
 * grant it, the daemon to its own device, a client to each device it maps slabs on. */
cudaError_t gpupool__cuda_pool_access(cudaMemPool_t pool, int device, enum cudaMemAccessFlags flags);

/* Record a message naming the call, the CUDA error, the device (< 0: none) and the fix (may
 * be NULL), clear the runtime's per-thread last error (so neither the daemon's next check nor
 * the application's cudaGetLastError() sees ours), and return code. */
int gpupool__cuda_fail(int code, cudaError_t e, const char *call, int device, const char *fix);
#endif /* GPUPOOL_HAVE_CUDA */

#endif
