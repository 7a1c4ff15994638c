/*
 * Hash maps used by the daemon's registry and the client's caches: uint64 keys and string
 * keys, each mapping to a void *value. Open addressing, grows by doubling; deletions keep
 * lookups correct (backward shift or tombstones). Values are not owned by the map.
 * Iteration: for (size_t i = 0; i < m->cap; i++) if (gpupool__map_slot_used(m, i)) ...
 *
 * Also the seeded hash (SipHash-1-3, key drawn once per process) for anything keyed by bytes
 * a peer chose: names, member names, member tables.
 */
#ifndef GPUPOOL_COMMON_HMAP_H
#define GPUPOOL_COMMON_HMAP_H

#include <stddef.h>
#include <stdint.h>

/* One map type serves both key kinds: a map holds either uint64 keys (ikey) or string keys
 * (skey, copied and owned by the map), never both. */
typedef struct {
  uint64_t hash;
  uint64_t ikey;
  char *skey;
  void *val;
  uint8_t state; /* 0 empty, 1 used, 2 deleted */
} gpupool__map_slot;

typedef struct {
  gpupool__map_slot *slots;
  size_t cap;   /* power of two or 0 */
  size_t len;   /* used slots */
  size_t dead;  /* tombstones */
} gpupool__map;

typedef gpupool__map gpupool__hmap; /* uint64 keys */
typedef gpupool__map gpupool__smap; /* string keys */

void gpupool__map_init(gpupool__map *m);
int gpupool__map_slot_used(const gpupool__map *m, size_t i);
/* How far the farthest entry lies from its home slot (0 when every key sits where its hash
 * points): what a lookup may cost, for tests and diagnostics. */
size_t gpupool__map_max_probe(const gpupool__map *m);

/* uint64 keys. */
#define gpupool__hmap_init gpupool__map_init
#define gpupool__hmap_slot_used gpupool__map_slot_used
void gpupool__hmap_free(gpupool__hmap *m);
/* Insert or replace. 0 or GPUPOOL_ENOMEM. */
int gpupool__hmap_put(gpupool__hmap *m, uint64_t key, void *val);
/* Value or NULL. */
void *gpupool__hmap_get(const gpupool__hmap *m, uint64_t key);
/* Remove; returns the old value or NULL. */
void *gpupool__hmap_del(gpupool__hmap *m, uint64_t key);

/* String keys; keys are copied and owned by the map. */
#define gpupool__smap_init gpupool__map_init
#define gpupool__smap_slot_used gpupool__map_slot_used
void gpupool__smap_free(gpupool__smap *m);
int gpupool__smap_put(gpupool__smap *m, const char *key, void *val);
void *gpupool__smap_get(const gpupool__smap *m, const char *key);
void *gpupool__smap_del(gpupool__smap *m, const char *key);

/* Seeded hash of bytes a peer chose. A peer that cannot predict the hash cannot make keys
 * collide on purpose, so tables keyed by its bytes keep short probes whatever it sends. The
 * key comes from getrandom(2) the first time any thread hashes, and stays for the process. */
typedef struct {
  uint64_t v[4];
  uint64_t tail; /* bytes not yet compressed, little-endian */
  size_t len;    /* bytes taken in all */
} gpupool__hash_state;

void gpupool__hash_init(gpupool__hash_state *st);
void gpupool__hash_update(gpupool__hash_state *st, const void *p, size_t n);
uint64_t gpupool__hash_final(const gpupool__hash_state *st);
/* init + update + final over p[0..n). */
uint64_t gpupool__hash_bytes(const void *p, size_t n);

#endif
