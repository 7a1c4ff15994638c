/*
 * Hash maps for the registry and the client's caches: uint64 -> void * and string -> void *,
 * one implementation for both key kinds. Open addressing with linear probing over a power-of-two table, tombstones for deletions.
 *
 * Linear probing is only as good as the hash's low bits, and our keys are sequential ids, so
 * u64 keys go through the splitmix64 finalizer (ids are the daemon's own: nobody can choose
 * them to collide). String keys are names that peers choose, so they go through SipHash-1-3
 * with a per-process random key: with an unseeded hash (FNV-1a, whose low bits depend only on
 * the input's low bits) a client can make tens of thousands of names share one home slot and
 * turn every insert into a walk of the whole run. The table is rebuilt when used slots plus tombstones pass 70%: doubled when
 * live entries need it, rebuilt at the same size when the load is mostly tombstones (a
 * delete/insert churn would otherwise fill the table with them and make misses probe
 * forever). A deletion whose next slot is empty needs no tombstone, so those are cleared at
 * once, along with any tombstones run that ends there.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

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

/* --- seeded hash: SipHash-1-3 ------------------------------------------------------------- */

static uint64_t sip_key[2];
static pthread_once_t sip_once = PTHREAD_ONCE_INIT;

/* The key: getrandom(2), never blocking (a daemon started early in boot must not hang on
 * the entropy pool); if the kernel cannot give one, clocks, pid and addresses, which a
 * remote peer cannot read either. */
static void sip_seed(void) {
  uint8_t k[16];
  size_t have = 0;
  while (have < sizeof k) {
    ssize_t n = getrandom(k + have, sizeof k - have, GRND_NONBLOCK);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    have += (size_t)n;
  }
  memcpy(sip_key, k, sizeof sip_key);
  if (have < sizeof k) {
    struct timespec a, b;
    clock_gettime(CLOCK_REALTIME, &a);
    clock_gettime(CLOCK_MONOTONIC, &b);
    sip_key[0] ^= mix64((uint64_t)a.tv_sec * 1000000000ull + (uint64_t)a.tv_nsec) ^ (uint64_t)(uintptr_t)&a;
    sip_key[1] ^= mix64((uint64_t)b.tv_nsec ^ (uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&sip_seed;
  }
}

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

static void sip_round(uint64_t *v) {
  v[0] += v[1];
  v[1] = ROTL(v[1], 13);
  v[1] ^= v[0];
  v[0] = ROTL(v[0], 32);
  v[2] += v[3];
  v[3] = ROTL(v[3], 16);
  v[3] ^= v[2];
  v[0] += v[3];
  v[3] = ROTL(v[3], 21);
  v[3] ^= v[0];
  v[2] += v[1];
  v[1] = ROTL(v[1], 17);
  v[1] ^= v[2];
  v[2] = ROTL(v[2], 32);
}

static void sip_compress(uint64_t *v, uint64_t m) {
  v[3] ^= m;
  sip_round(v);
  v[0] ^= m;
}

void gpupool__hash_init(gpupool__hash_state *st) {
  pthread_once(&sip_once, sip_seed);
  st->v[0] = sip_key[0] ^ 0x736f6d6570736575ull;
  st->v[1] = sip_key[1] ^ 0x646f72616e646f6dull;
  st->v[2] = sip_key[0] ^ 0x6c7967656e657261ull;
  st->v[3] = sip_key[1] ^ 0x7465646279746573ull;
  st->tail = 0;
  st->len = 0;
}

void gpupool__hash_update(gpupool__hash_state *st, const void *p, size_t n) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++) {
    st->tail |= (uint64_t)b[i] << (8 * (st->len & 7));
    if ((++st->len & 7) == 0) {
      sip_compress(st->v, st->tail);
      st->tail = 0;
    }
  }
}

uint64_t gpupool__hash_final(const gpupool__hash_state *st) {
  uint64_t v[4] = {st->v[0], st->v[1], st->v[2], st->v[3]};
  sip_compress(v, st->tail | (uint64_t)st->len << 56);
  v[2] ^= 0xff;
  sip_round(v);
  sip_round(v);
  sip_round(v);
  return v[0] ^ v[1] ^ v[2] ^ v[3];
}

uint64_t gpupool__hash_bytes(const void *p, size_t n) {
  gpupool__hash_state st;
  gpupool__hash_init(&st);
  gpupool__hash_update(&st, p, n);
  return gpupool__hash_final(&st);
}

static uint64_t hash_str(const char *s) { return gpupool__hash_bytes(s, strlen(s)); }

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

size_t gpupool__map_max_probe(const gpupool__map *m) {
  size_t worst = 0;
  for (size_t i = 0; i < m->cap; i++)
    if (m->slots[i].state == USED) {
      size_t d = (i - (size_t)m->slots[i].hash) & (m->cap - 1);
      if (d > worst)
        worst = d;
    }
  return worst;
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
