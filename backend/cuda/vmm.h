/*
 * Slabs that outlive their daemon: memory made with the driver's virtual memory API
 * (cuMemCreate) and exported once as a POSIX fd. Such memory lives while any fd or mapping of
 * it does, and a process that imports the fd owns it fully, so a restarted gpupoold takes its
 * slabs back from the fd store (a stream-ordered pool's memory can only be imported, never
 * allocated from, by anyone but its maker). Exporting an imported handle again fails
 * (CUDA_ERROR_INVALID_VALUE, seen on an H200): the first export's fd is the one that is kept
 * and passed on.
 *
 * The driver calls are taken from the runtime (cudaGetDriverEntryPointByVersion), so nothing
 * links libcuda directly, as everywhere else in gpupool. Both halves use this file: the daemon
 * makes, maps, adopts and frees slabs, a client imports and maps them.
 */
#ifndef GPUPOOL_BACKEND_CUDA_VMM_H
#define GPUPOOL_BACKEND_CUDA_VMM_H

#include <stddef.h>
#include <stdint.h>

/* Export data of such a slab: a tag and the size mapped (its allocation's, a multiple of the
 * granularity). */
#define GPUPOOL__VMM_EXPORT_LEN 12

/* 0 when the driver has the calls (once per process), else GPUPOOL_ENOTSUP with why. */
int gpupool__vmm_load(void);
/* Allocation granularity (bytes, a power of two) of device memory of device (numa < 0), or of
 * pinned host memory of NUMA node numa served to device. */
int gpupool__vmm_granularity(int device, int numa, uint64_t *out);
uint64_t gpupool__vmm_round(uint64_t size, uint64_t gran);

/* Daemon: make size bytes (a multiple of the granularity) on device (numa < 0) or of pinned
 * memory of NUMA node numa, exported as *fd, mapped at *va with read/write access for device
 * and for every device in access (a bit per device, devices below 64), and for the CPU when
 * it is host memory. ENOSPC when out of memory. */
int gpupool__vmm_create(int device, int numa, uint64_t size, uint64_t access, int *fd, void **va);
/* numa for gpupool__vmm_import: device memory of its device; host-NUMA memory of any node. */
#define GPUPOOL__VMM_DEVICE (-1)
#define GPUPOOL__VMM_ANY_NODE (-2)
/* Import fd (not taken) of an allocation of at least size bytes, which must lie where numa
 * says (GPUPOOL__VMM_DEVICE: on device; a node >= 0 or GPUPOOL__VMM_ANY_NODE: pinned host
 * memory; else GPUPOOL_ENOTSUP), and map size bytes of it at *va with read/write access for
 * device and the devices in access (a bit per device) and devs[0..ndevs), and for the CPU when
 * it is host memory. */
int gpupool__vmm_import(int fd, int device, int numa, uint64_t size, uint64_t access, const int *devs,
                        int ndevs, void **va);
/* Give device read/write access to the size bytes mapped at va. */
int gpupool__vmm_access(void *va, uint64_t size, int device);
/* Unmap and free the address range (the memory goes with its last fd and mapping). Errors
 * are logged by the caller from the returned message. */
int gpupool__vmm_unmap(void *va, uint64_t size);

uint32_t gpupool__vmm_export_encode(uint64_t size, uint8_t *out);
/* 1 with *size when data is a VMM slab's export data, 0 when it is not. */
int gpupool__vmm_export_decode(const uint8_t *data, size_t len, uint64_t *size);

#endif
