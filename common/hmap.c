/*
 * Hash maps for the registry and the client's caches: uint64 -> void * and string -> void *,
 * one implementation for both key kinds. Open addressing with linear probing over a power-of-two table, tombstones for deletions.
 *
 * Linear probing is only as good as the hash's low bits, and our keys are sequential ids, so
 * u64 keys go through the splitmix64 finalizer and strings through FNV-1a followed by the
 * same finalizer. The table is rebuilt when used slots plus tombstones pass 70%: doubled when
 * live entries need it, rebuilt at the same size when the load is mostly tombstones (a
 * delete/insert churn would otherwise fill the table with them and make misses probe
 * forever). A deletion whose next slot is empty needs no tombstone, so those are cleared at
 * once, along with any tombstones run that ends there.
 */
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "hmap.h"

enum { EMPTY = 0, USED = 1, DEAD = 2 };

#define MIN_CAP 16

static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

static uint64_t hash_str(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    h ^= *p;
    h *= 0x100000001b3ull;
  }
  return mix64(h);
}

/* Whether inserting one more entry would push used + tombstones past 70% of cap. */
static int needs_rebuild(size_t cap, size_t len, size_t dead) {
  return cap == 0 || (len + dead + 1) * 10 > cap * 7;
}

/* Table size for len live entries after a rebuild: the same size when at most half of it
 * would be live (the rebuild was for tombstones), else doubled. Either way at least 20% of
 * the table's inserts remain before the next rebuild, which keeps inserts amortised O(1). */
static size_t rebuild_cap(size_t cap, size_t len) {
  size_t n = cap < MIN_CAP ? MIN_CAP : cap;
  while ((len + 1) * 2 > n) {
    if (n > SIZE_MAX / 2)
      return 0;
    n *= 2;
  }
  return n;
}

/* --- one map for both key kinds -------------------------------------------------------------- */

void gpupool__map_init(gpupool__map *m) { memset(m, 0, sizeof *m); }

int gpupool__map_slot_used(const gpupool__map *m, size_t i) {
  return i < m->cap && m->slots[i].state == USED;
}

static int key_eq(const gpupool__map_slot *s, uint64_t h, uint64_t ikey, const char *skey) {
  return s->hash == h && (skey ? s->skey && strcmp(s->skey, skey) == 0 : s->ikey == ikey);
}

/* Slot holding the key (skey when not NULL, else ikey), or SIZE_MAX. */
static size_t find(const gpupool__map *m, uint64_t h, uint64_t ikey, const char *skey) {
  size_t mask, i;

  if (m->cap == 0)
    return SIZE_MAX;
  mask = m->cap - 1;
  for (i = h & mask;; i = (i + 1) & mask) {
    const gpupool__map_slot *s = &m->slots[i];
    if (s->state == EMPTY)
      return SIZE_MAX;
    if (s->state == USED && key_eq(s, h, ikey, skey))
      return i;
  }
}

static int rebuild(gpupool__map *m) {
  size_t ncap = rebuild_cap(m->cap, m->len);
  gpupool__map_slot *ns;

  if (ncap == 0 || ncap > SIZE_MAX / sizeof *ns)
    return gpupool__err(GPUPOOL_ENOMEM, "hash map of %zu entries cannot grow further", m->len);
  ns = calloc(ncap, sizeof *ns);
  if (ns == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "cannot grow a hash map to %zu slots", ncap);
  for (size_t j = 0; j < m->cap; j++) {
    const gpupool__map_slot *s = &m->slots[j];
    size_t i;
    if (s->state != USED)
      continue;
    for (i = s->hash & (ncap - 1); ns[i].state != EMPTY; i = (i + 1) & (ncap - 1))
      ;
    ns[i] = *s;
  }
  free(m->slots);
  m->slots = ns;
  m->cap = ncap;
  m->dead = 0;
  return 0;
}

/* Insert or replace; skey (already copied, owned by the map on success) or ikey. */
static int put(gpupool__map *m, uint64_t h, uint64_t ikey, char *skey, void *val, int *replaced) {
  size_t i, mask, tomb = SIZE_MAX;

  i = find(m, h, ikey, skey);
  *replaced = i != SIZE_MAX;
  if (i != SIZE_MAX) {
    m->slots[i].val = val;
    return 0;
  }
  if (needs_rebuild(m->cap, m->len, m->dead)) {
    int rc = rebuild(m);
    if (rc < 0)
      return rc;
  }
  mask = m->cap - 1;
  for (i = h & mask; m->slots[i].state != EMPTY; i = (i + 1) & mask)
    if (m->slots[i].state == DEAD && tomb == SIZE_MAX)
      tomb = i;
  if (tomb != SIZE_MAX) {
    i = tomb;
    m->dead--;
  }
  m->slots[i].hash = h;
  m->slots[i].ikey = ikey;
  m->slots[i].skey = skey;
  m->slots[i].val = val;
  m->slots[i].state = USED;
  m->len++;
  return 0;
}

static void *del_at(gpupool__map *m, size_t i) {
  size_t mask = m->cap - 1;
  void *val = m->slots[i].val;

  free(m->slots[i].skey);
  m->slots[i].skey = NULL;
  m->slots[i].val = NULL;
  m->len--;
  if (m->slots[(i + 1) & mask].state == EMPTY) {
    /* No probe sequence runs through here any more: free this slot and the tombstones
     * just before it. */
    m->slots[i].state = EMPTY;
    for (i = (i - 1) & mask; m->slots[i].state == DEAD; i = (i - 1) & mask) {
      m->slots[i].state = EMPTY;
      m->dead--;
    }
  } else {
    m->slots[i].state = DEAD;
    m->dead++;
  }
  return val;
}

static void map_free(gpupool__map *m) {
  for (size_t i = 0; i < m->cap; i++)
    if (m->slots[i].state == USED)
      free(m->slots[i].skey);
  free(m->slots);
  memset(m, 0, sizeof *m);
}

/* --- uint64 keys ---------------------------------------------------------------------------- */

void gpupool__hmap_free(gpupool__hmap *m) { map_free(m); }

int gpupool__hmap_put(gpupool__hmap *m, uint64_t key, void *val) {
  int replaced;
  return put(m, mix64(key), key, NULL, val, &replaced);
}

void *gpupool__hmap_get(const gpupool__hmap *m, uint64_t key) {
  size_t i = find(m, mix64(key), key, NULL);
  return i == SIZE_MAX ? NULL : m->slots[i].val;
}

void *gpupool__hmap_del(gpupool__hmap *m, uint64_t key) {
  size_t i = find(m, mix64(key), key, NULL);
  return i == SIZE_MAX ? NULL : del_at(m, i);
}

/* --- string keys ---------------------------------------------------------------------------- */

void gpupool__smap_free(gpupool__smap *m) { map_free(m); }

int gpupool__smap_put(gpupool__smap *m, const char *key, void *val) {
  uint64_t h;
  char *copy;
  int rc, replaced;

  if (key == NULL)
    return gpupool__err(GPUPOOL_EINVAL, "string map key is NULL");
  h = hash_str(key);
  if (find(m, h, 0, key) != SIZE_MAX)
    return put(m, h, 0, (char *)key, val, &replaced); /* replaces; the key is not taken */
  copy = strdup(key);
  if (copy == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "cannot copy a %zu-byte map key", strlen(key));
  if ((rc = put(m, h, 0, copy, val, &replaced)) != 0)
    free(copy);
  return rc;
}

void *gpupool__smap_get(const gpupool__smap *m, const char *key) {
  size_t i;
  if (key == NULL)
    return NULL;
  i = find(m, hash_str(key), 0, key);
  return i == SIZE_MAX ? NULL : m->slots[i].val;
}

void *gpupool__smap_del(gpupool__smap *m, const char *key) {
  size_t i;
  if (key == NULL)
    return NULL;
  i = find(m, hash_str(key), 0, key);
  return i == SIZE_MAX ? NULL : del_at(m, i);
}
