/*
 * Range allocator: hands out [offset, offset+size) ranges of a space [0, capacity).
 * The daemon uses it to sub-allocate buffers inside a slab, and the host backend to place
 * slabs inside its memfd. Best fit over an offset-ordered free list; freed ranges coalesce
 * with their neighbours at once, so a space whose ranges are all freed is one range again.
 * Not thread-safe (the daemon is single-threaded).
 */
#ifndef GPUPOOL_COMMON_ALLOC_H
#define GPUPOOL_COMMON_ALLOC_H

#include <stdint.h>

typedef struct gpupool__alloc gpupool__alloc;

/* New allocator over [0, capacity). 0 or GPUPOOL_ENOMEM / GPUPOOL_EINVAL (capacity 0). */
int gpupool__alloc_new(uint64_t capacity, gpupool__alloc **out);
void gpupool__alloc_delete(gpupool__alloc *a);

/* Take size bytes (> 0) at an offset that is a multiple of align (a power of two).
 * Returns 0 and *off, GPUPOOL_ENOSPC when no free range fits, GPUPOOL_EINVAL on bad args. */
int gpupool__alloc_get(gpupool__alloc *a, uint64_t size, uint64_t align, uint64_t *off);

/* Give back exactly a range get() returned (same off and size). Returns 0, or
 * GPUPOOL_EINVAL if the range is outside the space or overlaps a free range (double free). */
int gpupool__alloc_put(gpupool__alloc *a, uint64_t off, uint64_t size);
/* Take exactly [off, off + size) (a range handed out before, being restored): 0, or
 * GPUPOOL_EINVAL when any of it is not free. */
int gpupool__alloc_take(gpupool__alloc *a, uint64_t off, uint64_t size);

uint64_t gpupool__alloc_capacity(const gpupool__alloc *a);
uint64_t gpupool__alloc_used(const gpupool__alloc *a);          /* bytes handed out */
uint64_t gpupool__alloc_largest_free(const gpupool__alloc *a);  /* biggest free range */
uint32_t gpupool__alloc_free_ranges(const gpupool__alloc *a);   /* number of free ranges */

#endif
