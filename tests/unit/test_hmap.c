/*
 * Unit tests of the u64 and string hash maps: put/get/del/replace, growth through many
 * rebuilds, delete/reinsert churn checked against a shadow table (and that tombstones do not
 * grow the table without bound), iteration, and string keys that share prefixes or hashes'
 * low bits. String keys are names peers choose: keys made to collide under the unseeded hash
 * the map once used must still land spread out (short probes).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "errors.h"
#include "hmap.h"

/* Distinct non-NULL values that encode their key. */
#define VAL(k) ((void *)(uintptr_t)((k) * 2 + 1))

static void test_u64_basic(void **state) {
  gpupool__hmap m;
  int a, b;

  gpupool__hmap_init(&m);
  assert_null(gpupool__hmap_get(&m, 1));
  assert_null(gpupool__hmap_del(&m, 1));
  assert_int_equal(gpupool__hmap_put(&m, 1, &a), 0);
  assert_int_equal(gpupool__hmap_put(&m, 0, &b), 0);          /* 0 is a valid key */
  assert_int_equal(gpupool__hmap_put(&m, UINT64_MAX, &a), 0); /* so is the top one */
  assert_int_equal(m.len, 3);
  assert_ptr_equal(gpupool__hmap_get(&m, 1), &a);
  assert_ptr_equal(gpupool__hmap_get(&m, 0), &b);
  assert_ptr_equal(gpupool__hmap_get(&m, UINT64_MAX), &a);
  assert_null(gpupool__hmap_get(&m, 2));
  /* Replace keeps one entry. */
  assert_int_equal(gpupool__hmap_put(&m, 1, &b), 0);
  assert_int_equal(m.len, 3);
  assert_ptr_equal(gpupool__hmap_get(&m, 1), &b);
  assert_ptr_equal(gpupool__hmap_del(&m, 1), &b);
  assert_null(gpupool__hmap_get(&m, 1));
  assert_null(gpupool__hmap_del(&m, 1));
  assert_int_equal(m.len, 2);
  assert_ptr_equal(gpupool__hmap_get(&m, 0), &b);
  assert_false(gpupool__hmap_slot_used(&m, m.cap)); /* out of range is simply unused */
  gpupool__hmap_free(&m);
  assert_int_equal(m.cap, 0);
  assert_null(gpupool__hmap_get(&m, 0));
  gpupool__hmap_free(&m); /* twice is fine */
}

static void test_u64_growth(void **state) {
  enum { N = 200000 };
  gpupool__hmap m;
  size_t seen = 0;

  gpupool__hmap_init(&m);
  /* Sequential keys (like the registry's ids) and strided ones that share low bits. */
  for (uint64_t k = 0; k < N; k++) {
    assert_int_equal(gpupool__hmap_put(&m, k, VAL(k)), 0);
    assert_int_equal(gpupool__hmap_put(&m, (k << 32) | 0xabc, VAL(k + N)), 0);
  }
  /* The strided key of k = 0 is 0xabc, also a plain key, which replaced it. */
  assert_int_equal(m.len, 2 * N - 1);
  assert_int_equal(m.cap & (m.cap - 1), 0);
  assert_true(m.len * 10 <= m.cap * 7);
  for (uint64_t k = 0; k < N; k++) {
    assert_ptr_equal(gpupool__hmap_get(&m, k), VAL(k));
    if (k > 0)
      assert_ptr_equal(gpupool__hmap_get(&m, (k << 32) | 0xabc), VAL(k + N));
  }
  assert_null(gpupool__hmap_get(&m, N));
  /* Iteration sees every entry exactly once. */
  for (size_t i = 0; i < m.cap; i++)
    if (gpupool__hmap_slot_used(&m, i)) {
      uint64_t k = m.slots[i].ikey;
      assert_true(m.slots[i].val == VAL(k) || m.slots[i].val == VAL((k >> 32) + N));
      seen++;
    }
  assert_int_equal(seen, m.len);
  gpupool__hmap_free(&m);
}

static void test_u64_churn(void **state) {
  enum { KEYS = 5000, STEPS = 400000 };
  gpupool__hmap m;
  void **shadow = calloc(KEYS, sizeof *shadow);
  uint64_t x = 88172645463325252ull;
  size_t live = 0, max_cap = 0;

  assert_non_null(shadow);
  gpupool__hmap_init(&m);
  for (int step = 0; step < STEPS; step++) {
    uint64_t k, r;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    k = (x % KEYS) * 0x100000001ull; /* spread, but deterministic */
    r = (x >> 32) % 3;
    if (r < 2 && shadow[x % KEYS] == NULL) {
      assert_int_equal(gpupool__hmap_put(&m, k, VAL(x % KEYS)), 0);
      shadow[x % KEYS] = VAL(x % KEYS);
      live++;
    } else if (r == 2 || shadow[x % KEYS] != NULL) {
      void *want = shadow[x % KEYS];
      assert_ptr_equal(gpupool__hmap_del(&m, k), want);
      if (want != NULL)
        live--;
      shadow[x % KEYS] = NULL;
    }
    assert_int_equal(m.len, live);
    if (m.cap > max_cap)
      max_cap = m.cap;
  }
  for (uint64_t i = 0; i < KEYS; i++)
    assert_ptr_equal(gpupool__hmap_get(&m, i * 0x100000001ull), shadow[i]);
  /* Tombstones are reclaimed: the table stays within a small multiple of the key set. */
  assert_true(max_cap <= 4 * 8192);
  assert_true(m.len + m.dead < m.cap);
  gpupool__hmap_free(&m);
  free(shadow);
}

/* Delete everything, reinsert, many times: lookups of absent keys must still terminate and
 * the table must not grow. */
static void test_u64_delete_reinsert(void **state) {
  enum { N = 3000 };
  gpupool__hmap m;
  size_t cap_after_first = 0;

  gpupool__hmap_init(&m);
  for (int round = 0; round < 50; round++) {
    for (uint64_t k = 0; k < N; k++)
      assert_int_equal(gpupool__hmap_put(&m, k + (uint64_t)round * N, VAL(k)), 0);
    if (round == 0)
      cap_after_first = m.cap;
    assert_int_equal(m.len, N);
    for (uint64_t k = 0; k < N; k++)
      assert_ptr_equal(gpupool__hmap_del(&m, k + (uint64_t)round * N), VAL(k));
    assert_int_equal(m.len, 0);
    assert_null(gpupool__hmap_get(&m, 12345678));
  }
  assert_true(m.cap <= 2 * cap_after_first);
  gpupool__hmap_free(&m);
}

/* The registry's pattern: ids only grow, and a bounded window of them is live. Deletions
 * leave tombstones all over the table; rebuilds must reclaim them instead of doubling. */
static void test_u64_sliding_window(void **state) {
  enum { WINDOW = 1000, STEPS = 1000000 };
  gpupool__hmap m;
  size_t max_cap = 0;

  gpupool__hmap_init(&m);
  for (uint64_t k = 0; k < WINDOW; k++)
    assert_int_equal(gpupool__hmap_put(&m, k, VAL(k)), 0);
  for (uint64_t k = 0; k < STEPS; k++) {
    assert_int_equal(gpupool__hmap_put(&m, k + WINDOW, VAL(k + WINDOW)), 0);
    assert_ptr_equal(gpupool__hmap_del(&m, k), VAL(k));
    if (m.cap > max_cap)
      max_cap = m.cap;
  }
  assert_int_equal(m.len, WINDOW);
  for (uint64_t k = STEPS; k < STEPS + WINDOW; k++)
    assert_ptr_equal(gpupool__hmap_get(&m, k), VAL(k));
  assert_null(gpupool__hmap_get(&m, STEPS - 1));
  /* 1000 live entries fit a 2048-slot table under 50% load: a larger table would mean
   * tombstones, not entries, drove growth. */
  assert_true(max_cap <= 2048);
  gpupool__hmap_free(&m);
}

static void test_smap(void **state) {
  enum { N = 50000 };
  gpupool__smap m;
  char key[64], big[600];
  int a, b;

  gpupool__smap_init(&m);
  assert_null(gpupool__smap_get(&m, "x"));
  assert_null(gpupool__smap_del(&m, "x"));
  assert_null(gpupool__smap_get(&m, NULL));
  assert_int_equal(gpupool__smap_put(&m, NULL, &a), GPUPOOL_EINVAL);
  /* The map copies keys: the caller's buffer may change afterwards. */
  strcpy(key, "tensor/a");
  assert_int_equal(gpupool__smap_put(&m, key, &a), 0);
  strcpy(key, "tensor/b");
  assert_ptr_equal(gpupool__smap_get(&m, "tensor/a"), &a);
  assert_null(gpupool__smap_get(&m, "tensor/b"));
  assert_int_equal(gpupool__smap_put(&m, "", &b), 0); /* empty key is a key */
  assert_ptr_equal(gpupool__smap_get(&m, ""), &b);
  assert_int_equal(gpupool__smap_put(&m, "tensor/a", &b), 0);
  assert_int_equal(m.len, 2);
  assert_ptr_equal(gpupool__smap_get(&m, "tensor/a"), &b);
  assert_null(gpupool__smap_get(&m, "tensor/"));
  assert_null(gpupool__smap_get(&m, "tensor/aa"));
  assert_ptr_equal(gpupool__smap_del(&m, "tensor/a"), &b);
  assert_ptr_equal(gpupool__smap_del(&m, ""), &b);
  assert_int_equal(m.len, 0);

  memset(big, 'n', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  assert_int_equal(gpupool__smap_put(&m, big, &a), 0);
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof key, "model/layer%d/weight", i);
    assert_int_equal(gpupool__smap_put(&m, key, VAL(i)), 0);
  }
  assert_int_equal(m.len, N + 1);
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof key, "model/layer%d/weight", i);
    assert_ptr_equal(gpupool__smap_get(&m, key), VAL(i));
    snprintf(key, sizeof key, "model/layer%d/bias", i);
    assert_null(gpupool__smap_get(&m, key));
  }
  assert_ptr_equal(gpupool__smap_get(&m, big), &a);
  /* Delete the odd ones, reinsert under other names, check everything. */
  for (int i = 1; i < N; i += 2) {
    snprintf(key, sizeof key, "model/layer%d/weight", i);
    assert_ptr_equal(gpupool__smap_del(&m, key), VAL(i));
  }
  for (int i = 1; i < N; i += 2) {
    snprintf(key, sizeof key, "model/layer%d/bias", i);
    assert_int_equal(gpupool__smap_put(&m, key, VAL(i + N)), 0);
  }
  {
    size_t seen = 0;
    for (size_t i = 0; i < m.cap; i++)
      if (gpupool__smap_slot_used(&m, i)) {
        assert_non_null(m.slots[i].skey);
        assert_ptr_equal(gpupool__smap_get(&m, m.slots[i].skey), m.slots[i].val);
        seen++;
      }
    assert_int_equal(seen, m.len);
    assert_int_equal(seen, N + 1);
  }
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof key, "model/layer%d/weight", i);
    assert_ptr_equal(gpupool__smap_get(&m, key), i % 2 ? NULL : VAL(i));
    snprintf(key, sizeof key, "model/layer%d/bias", i);
    assert_ptr_equal(gpupool__smap_get(&m, key), i % 2 ? VAL(i + N) : NULL);
  }
  gpupool__smap_free(&m); /* frees every key it still owns (checked under valgrind/ASan) */
  assert_int_equal(m.cap, 0);
}

/* The hash string keys had before they were seeded: FNV-1a, then the splitmix64 finalizer. An
 * attacker can compute it offline, so it must not be what the map uses. */
static uint64_t old_hash(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    h = (h ^ *p) * 0x100000001b3ull;
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

/* How far the farthest key sits from the slot its stored hash points at (computed from the
 * slots, so it measures the map whatever hash it uses). */
static size_t max_probe(const gpupool__smap *m) {
  size_t worst = 0;
  for (size_t i = 0; i < m->cap; i++)
    if (gpupool__smap_slot_used(m, i) && ((i - (size_t)m->slots[i].hash) & (m->cap - 1)) > worst)
      worst = (i - (size_t)m->slots[i].hash) & (m->cap - 1);
  return worst;
}

static void test_smap_flood(void **state) {
  /* N keys whose old hashes agree in their low 12 bits: one home slot at every table size up
   * to 4096, which N keys fit in. */
  enum { N = 1500, BITS = 12 };
  gpupool__smap m;
  char (*keys)[24] = calloc(N, sizeof *keys);
  unsigned n = 0;
  (void)state;
  assert_non_null(keys);
  for (uint64_t j = 0; n < N; j++) {
    char k[24];
    snprintf(k, sizeof k, "t%" PRIx64, j);
    if ((old_hash(k) & ((1u << BITS) - 1)) == 0x5a5)
      memcpy(keys[n++], k, sizeof k);
  }
  gpupool__smap_init(&m);
  for (unsigned i = 0; i < N; i++)
    assert_int_equal(gpupool__smap_put(&m, keys[i], VAL(i)), 0);
  assert_true(m.cap <= 1u << BITS);
  for (unsigned i = 0; i < N; i++)
    assert_ptr_equal(gpupool__smap_get(&m, keys[i]), VAL(i));
  /* A random hash spreads 1500 keys over 4096 slots with probes of a few slots; the old hash
   * put them all in one run, 1500 long. 64 is far from both. */
  if (max_probe(&m) >= 64)
    fail_msg("keys that collided under the old hash probe %zu slots", max_probe(&m));
  assert_int_equal(gpupool__map_max_probe(&m), max_probe(&m));
  gpupool__smap_free(&m);
  free(keys);
}

/* The seeded hash: equal input, equal hash; every byte and the length count; the incremental
 * form agrees with the one-shot form whatever the split. */
static void test_seeded_hash(void **state) {
  const char *s = "abcdefghijklmnopqrstuvwxyz";
  gpupool__hash_state st;
  (void)state;
  assert_int_equal(gpupool__hash_bytes(s, 26), gpupool__hash_bytes(s, 26));
  assert_int_not_equal(gpupool__hash_bytes(s, 26), gpupool__hash_bytes(s, 25));
  assert_int_not_equal(gpupool__hash_bytes("a\0", 2), gpupool__hash_bytes("a", 1));
  assert_int_not_equal(gpupool__hash_bytes("ab", 2), gpupool__hash_bytes("ba", 2));
  for (size_t cut = 0; cut <= 26; cut++) {
    gpupool__hash_init(&st);
    gpupool__hash_update(&st, s, cut);
    gpupool__hash_update(&st, s + cut, 26 - cut);
    assert_int_equal(gpupool__hash_final(&st), gpupool__hash_bytes(s, 26));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_u64_basic),
      cmocka_unit_test(test_u64_growth),
      cmocka_unit_test(test_u64_churn),
      cmocka_unit_test(test_u64_delete_reinsert),
      cmocka_unit_test(test_u64_sliding_window),
      cmocka_unit_test(test_smap),
      cmocka_unit_test(test_smap_flood),
      cmocka_unit_test(test_seeded_hash),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
