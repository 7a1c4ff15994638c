/*
 * What every room of the registry uses and that calls none of them: the clock, ids, rounding
 * and growing arrays. Kept apart from registry.c (the registry's lifetime, which calls every
 * room) so that no room has to call back up into it.
 */
#include <stdlib.h>
#include <time.h>

#include "errors.h"
#include "registry_internal.h"

uint64_t gpd_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t gpd_next_id(gpd_registry *reg) { return ++reg->next_id; }

uint64_t gpd_round_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

int gpd_grow(void **arr, uint32_t *cap, uint32_t need, size_t elem) {
  uint32_t ncap;
  void *n;
  if (need <= *cap)
    return 0;
  ncap = *cap ? *cap * 2 : 4;
  while (ncap < need)
    ncap *= 2;
  n = realloc(*arr, (size_t)ncap * elem);
  if (!n)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  *arr = n;
  *cap = ncap;
  return 0;
}
