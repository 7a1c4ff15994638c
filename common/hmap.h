/*
 * Hash maps used by the daemon's registry and the client's caches: uint64 keys and string
 * keys, each mapping to a void *value. Open addressing, grows by doubling; deletions keep
 * lookups correct (backward shift or tombstones). Values are not owned by the map.
 * Iteration: for (size_t i = 0; i < m->cap; i++) if (gpupool__hmap_slot_used(m, i)) ...
 */
#ifndef GPUPOOL_COMMON_HMAP_H
#define GPUPOOL_COMMON_HMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  uint64_t key;
  void *val;
  uint8_t state; /* 0 empty, 1 used, 2 deleted (if tombstones are used) */
} gpupool__hmap_slot;

typedef struct {
  gpupool__hmap_slot *slots;
  size_t cap;   /* power of two or 0 */
  size_t len;   /* used slots */
  size_t dead;  /* tombstones */
} gpupool__hmap;

void gpupool__hmap_init(gpupool__hmap *m);
void gpupool__hmap_free(gpupool__hmap *m);
/* Insert or replace. 0 or GPUPOOL_ENOMEM. */
int gpupool__hmap_put(gpupool__hmap *m, uint64_t key, void *val);
/* Value or NULL. */
void *gpupool__hmap_get(const gpupool__hmap *m, uint64_t key);
/* Remove; returns the old value or NULL. */
void *gpupool__hmap_del(gpupool__hmap *m, uint64_t key);
int gpupool__hmap_slot_used(const gpupool__hmap *m, size_t i);

/* String-keyed map; keys are copied and owned by the map. */
typedef struct {
  char *key;
  uint64_t hash;
  void *val;
  uint8_t state;
} gpupool__smap_slot;

typedef struct {
  gpupool__smap_slot *slots;
  size_t cap;
  size_t len;
  size_t dead;
} gpupool__smap;

void gpupool__smap_init(gpupool__smap *m);
void gpupool__smap_free(gpupool__smap *m);
int gpupool__smap_put(gpupool__smap *m, const char *key, void *val);
void *gpupool__smap_get(const gpupool__smap *m, const char *key);
void *gpupool__smap_del(gpupool__smap *m, const char *key);
int gpupool__smap_slot_used(const gpupool__smap *m, size_t i);

#endif
