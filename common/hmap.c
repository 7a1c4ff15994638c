/*
 * Hash maps for the registry and the client's caches: uint64 -> void * and string -> void *.
 * Open addressing with linear probing over a power-of-two table, tombstones for deletions.
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

/* --- uint64 keys ---------------------------------------------------------------------------- */

void gpupool__hmap_init(gpupool__hmap *m) { memset(m, 0, sizeof *m); }

void gpupool__hmap_free(gpupool__hmap *m) {
  free(m->slots);
  memset(m, 0, sizeof *m);
}

/* Slot holding key, or SIZE_MAX. */
static size_t hfind(const gpupool__hmap *m, uint64_t key) {
  size_t mask, i;

  if (m->cap == 0)
    return SIZE_MAX;
  mask = m->cap - 1;
  for (i = mix64(key) & mask;; i = (i + 1) & mask) {
    const gpupool__hmap_slot *s = &m->slots[i];
    if (s->state == EMPTY)
      return SIZE_MAX;
    if (s->state == USED && s->key == key)
      return i;
  }
}

static int hrebuild(gpupool__hmap *m) {
  size_t ncap = rebuild_cap(m->cap, m->len);
  gpupool__hmap_slot *ns;

  if (ncap == 0 || ncap > SIZE_MAX / sizeof *ns)
    return gpupool__err(GPUPOOL_ENOMEM, "hash map of %zu entries cannot grow further", m->len);
  ns = calloc(ncap, sizeof *ns);
  if (ns == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "cannot grow a hash map to %zu slots", ncap);
  for (size_t j = 0; j < m->cap; j++) {
    const gpupool__hmap_slot *s = &m->slots[j];
    size_t i;
    if (s->state != USED)
      continue;
    for (i = mix64(s->key) & (ncap - 1); ns[i].state != EMPTY; i = (i + 1) & (ncap - 1))
      ;
    ns[i] = *s;
  }
  free(m->slots);
  m->slots = ns;
  m->cap = ncap;
  m->dead = 0;
  return 0;
}

int gpupool__hmap_put(gpupool__hmap *m, uint64_t key, void *val) {
  size_t i, mask, tomb = SIZE_MAX;

  i = hfind(m, key);
  if (i != SIZE_MAX) {
    m->slots[i].val = val;
    return 0;
  }
  if (needs_rebuild(m->cap, m->len, m->dead)) {
    int rc = hrebuild(m);
    if (rc < 0)
      return rc;
  }
  mask = m->cap - 1;
  for (i = mix64(key) & mask; m->slots[i].state != EMPTY; i = (i + 1) & mask)
    if (m->slots[i].state == DEAD && tomb == SIZE_MAX)
      tomb = i;
  if (tomb != SIZE_MAX) {
    i = tomb;
    m->dead--;
  }
  m->slots[i].key = key;
  m->slots[i].val = val;
  m->slots[i].state = USED;
  m->len++;
  return 0;
}

void *gpupool__hmap_get(const gpupool__hmap *m, uint64_t key) {
  size_t i = hfind(m, key);
  return i == SIZE_MAX ? NULL : m->slots[i].val;
}

void *gpupool__hmap_del(gpupool__hmap *m, uint64_t key) {
  size_t i = hfind(m, key), mask;
  void *val;

  if (i == SIZE_MAX)
    return NULL;
  mask = m->cap - 1;
  val = m->slots[i].val;
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

int gpupool__hmap_slot_used(const gpupool__hmap *m, size_t i) {
  return i < m->cap && m->slots[i].state == USED;
}

/* --- string keys ---------------------------------------------------------------------------- */

void gpupool__smap_init(gpupool__smap *m) { memset(m, 0, sizeof *m); }

void gpupool__smap_free(gpupool__smap *m) {
  for (size_t i = 0; i < m->cap; i++)
    if (m->slots[i].state == USED)
      free(m->slots[i].key);
  free(m->slots);
  memset(m, 0, sizeof *m);
}

static size_t sfind(const gpupool__smap *m, const char *key, uint64_t h) {
  size_t mask, i;

  if (m->cap == 0)
    return SIZE_MAX;
  mask = m->cap - 1;
  for (i = h & mask;; i = (i + 1) & mask) {
    const gpupool__smap_slot *s = &m->slots[i];
    if (s->state == EMPTY)
      return SIZE_MAX;
    if (s->state == USED && s->hash == h && strcmp(s->key, key) == 0)
      return i;
  }
}

static int srebuild(gpupool__smap *m) {
  size_t ncap = rebuild_cap(m->cap, m->len);
  gpupool__smap_slot *ns;

  if (ncap == 0 || ncap > SIZE_MAX / sizeof *ns)
    return gpupool__err(GPUPOOL_ENOMEM, "hash map of %zu entries cannot grow further", m->len);
  ns = calloc(ncap, sizeof *ns);
  if (ns == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "cannot grow a hash map to %zu slots", ncap);
  for (size_t j = 0; j < m->cap; j++) {
    const gpupool__smap_slot *s = &m->slots[j];
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

int gpupool__smap_put(gpupool__smap *m, const char *key, void *val) {
  size_t i, mask, tomb = SIZE_MAX;
  uint64_t h;
  char *copy;

  if (key == NULL)
    return gpupool__err(GPUPOOL_EINVAL, "string map key is NULL");
  h = hash_str(key);
  i = sfind(m, key, h);
  if (i != SIZE_MAX) {
    m->slots[i].val = val;
    return 0;
  }
  copy = strdup(key);
  if (copy == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "cannot copy a %zu-byte map key", strlen(key));
  if (needs_rebuild(m->cap, m->len, m->dead)) {
    int rc = srebuild(m);
    if (rc < 0) {
      free(copy);
      return rc;
    }
  }
  mask = m->cap - 1;
  for (i = h & mask; m->slots[i].state != EMPTY; i = (i + 1) & mask)
    if (m->slots[i].state == DEAD && tomb == SIZE_MAX)
      tomb = i;
  if (tomb != SIZE_MAX) {
    i = tomb;
    m->dead--;
  }
  m->slots[i].key = copy;
  m->slots[i].hash = h;
  m->slots[i].val = val;
  m->slots[i].state = USED;
  m->len++;
  return 0;
}

void *gpupool__smap_get(const gpupool__smap *m, const char *key) {
  size_t i;

  if (key == NULL)
    return NULL;
  i = sfind(m, key, hash_str(key));
  return i == SIZE_MAX ? NULL : m->slots[i].val;
}

void *gpupool__smap_del(gpupool__smap *m, const char *key) {
  size_t i, mask;
  void *val;

  if (key == NULL)
    return NULL;
  i = sfind(m, key, hash_str(key));
  if (i == SIZE_MAX)
    return NULL;
  mask = m->cap - 1;
  val = m->slots[i].val;
  free(m->slots[i].key);
  m->slots[i].key = NULL;
  m->slots[i].val = NULL;
  m->len--;
  if (m->slots[(i + 1) & mask].state == EMPTY) {
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

int gpupool__smap_slot_used(const gpupool__smap *m, size_t i) {
  return i < m->cap && m->slots[i].state == USED;
}
