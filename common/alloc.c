/*
 * The range allocator behind slab sub-allocation (daemon) and slab placement in a memfd
 * (host backend). It owns only bookkeeping: a dynamic array of free ranges sorted by offset
 * and never holding two adjacent ranges (they are merged on every put).
 *
 * get() is best fit: a linear scan over the free ranges picks the smallest one that can hold
 * the request after alignment, stopping early on an exact fit. Best fit keeps large ranges
 * whole for large requests, which matters more here than the scan's cost: a slab rarely has
 * more than a few thousand free ranges. An alignment gap in front of the result goes back
 * into the free list rather than being wasted.
 *
 * put() finds its neighbours by binary search, refuses a range that leaves the space or
 * overlaps a free range (a double free or a wrong size), and merges with both neighbours.
 */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "errors.h"

typedef struct {
  uint64_t off;
  uint64_t size;
} range;

struct gpupool__alloc {
  uint64_t capacity;
  uint64_t used;
  range *free;  /* sorted by off, no two touching */
  uint32_t nfree;
  uint32_t cap; /* slots allocated in free */
};

int gpupool__alloc_new(uint64_t capacity, gpupool__alloc **out) {
  gpupool__alloc *a;

  if (out == NULL || capacity == 0)
    return gpupool__err(GPUPOOL_EINVAL, "range allocator needs a capacity above 0");
  a = calloc(1, sizeof *a);
  if (a == NULL)
    goto nomem;
  a->cap = 16;
  a->free = malloc(a->cap * sizeof *a->free);
  if (a->free == NULL)
    goto nomem_a;
  a->capacity = capacity;
  a->free[0].off = 0;
  a->free[0].size = capacity;
  a->nfree = 1;
  *out = a;
  return 0;

nomem_a:
  free(a);
nomem:
  return gpupool__err(GPUPOOL_ENOMEM, "cannot allocate a range allocator");
}

void gpupool__alloc_delete(gpupool__alloc *a) {
  if (a == NULL)
    return;
  free(a->free);
  free(a);
}

/* Make room for one more free range. */
static int reserve_one(gpupool__alloc *a) {
  range *r;
  uint32_t ncap;

  if (a->nfree < a->cap)
    return 0;
  if (a->cap > UINT32_MAX / 2)
    return gpupool__err(GPUPOOL_ENOMEM, "range allocator has too many free ranges (%u)",
                        a->nfree);
  ncap = a->cap * 2;
  r = realloc(a->free, (size_t)ncap * sizeof *r);
  if (r == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "cannot grow the range allocator's free list to %u "
                        "entries", ncap);
  a->free = r;
  a->cap = ncap;
  return 0;
}

static void insert_at(gpupool__alloc *a, uint32_t i, uint64_t off, uint64_t size) {
  memmove(&a->free[i + 1], &a->free[i], (size_t)(a->nfree - i) * sizeof *a->free);
  a->free[i].off = off;
  a->free[i].size = size;
  a->nfree++;
}

static void remove_at(gpupool__alloc *a, uint32_t i) {
  memmove(&a->free[i], &a->free[i + 1], (size_t)(a->nfree - i - 1) * sizeof *a->free);
  a->nfree--;
}

int gpupool__alloc_get(gpupool__alloc *a, uint64_t size, uint64_t align, uint64_t *off) {
  uint32_t best = UINT32_MAX;
  uint64_t best_size = UINT64_MAX, best_pad = 0;

  if (a == NULL || off == NULL || size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "range allocation needs a size above 0");
  if (align == 0 || (align & (align - 1)) != 0)
    return gpupool__err(GPUPOOL_EINVAL,
                        "alignment %llu is not a power of two; use 1, 2, 4, ... bytes",
                        (unsigned long long)align);
  if (size > a->capacity - a->used)
    goto nospc;

  for (uint32_t i = 0; i < a->nfree; i++) {
    const range *r = &a->free[i];
    uint64_t rem = r->off & (align - 1);
    uint64_t pad = rem ? align - rem : 0;
    if (r->size < pad || r->size - pad < size)
      continue;
    if (r->size < best_size) {
      best = i;
      best_size = r->size;
      best_pad = pad;
      if (pad == 0 && r->size == size)
        break; /* exact fit: nothing can do better */
    }
  }
  if (best == UINT32_MAX)
    goto nospc;

  {
    range *r = &a->free[best];
    uint64_t start = r->off + best_pad;
    uint64_t tail = r->size - best_pad - size;
    if (best_pad > 0 && tail > 0) {
      /* The range splits into a leading gap and a tail: one more entry. */
      int rc = reserve_one(a);
      if (rc < 0)
        return rc;
      r = &a->free[best];
      r->size = best_pad;
      insert_at(a, best + 1, start + size, tail);
    } else if (best_pad > 0) {
      r->size = best_pad;
    } else if (tail > 0) {
      r->off = start + size;
      r->size = tail;
    } else {
      remove_at(a, best);
    }
    a->used += size;
    *off = start;
  }
  return 0;

nospc:
  return gpupool__err(GPUPOOL_ENOSPC,
                      "no free range of %llu bytes (alignment %llu): %llu of %llu bytes are "
                      "free, the largest free range is %llu bytes",
                      (unsigned long long)size, (unsigned long long)align,
                      (unsigned long long)(a->capacity - a->used),
                      (unsigned long long)a->capacity,
                      (unsigned long long)gpupool__alloc_largest_free(a));
}

/* Index of the first free range with off > x (nfree if none). */
static uint32_t upper_bound(const gpupool__alloc *a, uint64_t x) {
  uint32_t lo = 0, hi = a->nfree;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (a->free[mid].off <= x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

int gpupool__alloc_put(gpupool__alloc *a, uint64_t off, uint64_t size) {
  uint32_t i;
  int join_prev, join_next;
  uint64_t end;

  if (a == NULL || size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "cannot free an empty range");
  if (off >= a->capacity || size > a->capacity - off)
    return gpupool__err(GPUPOOL_EINVAL,
                        "range [%llu, +%llu) lies outside the allocator's %llu bytes; free "
                        "exactly what get returned",
                        (unsigned long long)off, (unsigned long long)size,
                        (unsigned long long)a->capacity);
  end = off + size;
  i = upper_bound(a, off); /* free[i-1].off <= off < free[i].off */
  if ((i > 0 && a->free[i - 1].off + a->free[i - 1].size > off) ||
      (i < a->nfree && a->free[i].off < end))
    return gpupool__err(GPUPOOL_EINVAL,
                        "range [%llu, +%llu) overlaps free memory: double free or wrong size",
                        (unsigned long long)off, (unsigned long long)size);
  /* Not overlapping any free range means the range lies wholly in handed-out bytes, so
   * used cannot underflow below. */

  join_prev = i > 0 && a->free[i - 1].off + a->free[i - 1].size == off;
  join_next = i < a->nfree && a->free[i].off == end;
  if (join_prev && join_next) {
    a->free[i - 1].size += size + a->free[i].size;
    remove_at(a, i);
  } else if (join_prev) {
    a->free[i - 1].size += size;
  } else if (join_next) {
    a->free[i].off = off;
    a->free[i].size += size;
  } else {
    int rc = reserve_one(a);
    if (rc < 0)
      return rc;
    insert_at(a, i, off, size);
  }
  a->used -= size;
  return 0;
}

int gpupool__alloc_take(gpupool__alloc *a, uint64_t off, uint64_t size) {
  uint32_t i;
  range *r;
  uint64_t head, tail;

  if (a == NULL || size == 0 || off >= a->capacity || size > a->capacity - off)
    return gpupool__err(GPUPOOL_EINVAL, "range [%llu, +%llu) is not inside the allocator's space",
                        (unsigned long long)off, (unsigned long long)size);
  i = upper_bound(a, off); /* the free range holding off, if any, is free[i-1] */
  if (i == 0 || a->free[i - 1].off + a->free[i - 1].size < off + size)
    return gpupool__err(GPUPOOL_EINVAL, "range [%llu, +%llu) is not wholly free: it overlaps another range",
                        (unsigned long long)off, (unsigned long long)size);
  r = &a->free[i - 1];
  head = off - r->off;
  tail = r->off + r->size - (off + size);
  if (head > 0 && tail > 0) {
    int rc = reserve_one(a);
    if (rc < 0)
      return rc;
    r = &a->free[i - 1];
    r->size = head;
    insert_at(a, i, off + size, tail);
  } else if (head > 0) {
    r->size = head;
  } else if (tail > 0) {
    r->off = off + size;
    r->size = tail;
  } else {
    remove_at(a, i - 1);
  }
  a->used += size;
  return 0;
}

uint64_t gpupool__alloc_capacity(const gpupool__alloc *a) { return a->capacity; }

uint64_t gpupool__alloc_used(const gpupool__alloc *a) { return a->used; }

uint64_t gpupool__alloc_largest_free(const gpupool__alloc *a) {
  uint64_t m = 0;
  for (uint32_t i = 0; i < a->nfree; i++)
    if (a->free[i].size > m)
      m = a->free[i].size;
  return m;
}

uint32_t gpupool__alloc_free_ranges(const gpupool__alloc *a) { return a->nfree; }
