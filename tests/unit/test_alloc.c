/*
 * Unit tests of the range allocator: alignment, exhaustion, coalescing, refusal of double
 * and out-of-range frees, and a randomized churn checked against a shadow bitmap (no two live
 * ranges overlap, every counter matches, a fully freed space is one range again).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "alloc.h"
#include "errors.h"

static void test_new_and_args(void **state) {
  gpupool__alloc *a = NULL;
  uint64_t off;

  assert_int_equal(gpupool__alloc_new(0, &a), GPUPOOL_EINVAL);
  assert_null(a);
  assert_int_equal(gpupool__alloc_new(1000, &a), 0);
  assert_int_equal(gpupool__alloc_capacity(a), 1000);
  assert_int_equal(gpupool__alloc_used(a), 0);
  assert_int_equal(gpupool__alloc_largest_free(a), 1000);
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);
  assert_int_equal(gpupool__alloc_get(a, 0, 1, &off), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_get(a, 10, 0, &off), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_get(a, 10, 3, &off), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "power of two"));
  assert_int_equal(gpupool__alloc_get(a, 10, 96, &off), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_used(a), 0);
  gpupool__alloc_delete(a);
  gpupool__alloc_delete(NULL);
}

static void test_alignment(void **state) {
  gpupool__alloc *a;
  uint64_t o1, o2, o3, o4;

  assert_int_equal(gpupool__alloc_new(1 << 20, &a), 0);
  assert_int_equal(gpupool__alloc_get(a, 3, 1, &o1), 0);
  assert_int_equal(o1, 0);
  /* Next aligned start is 256: the gap [3, 256) goes back to the free list. */
  assert_int_equal(gpupool__alloc_get(a, 100, 256, &o2), 0);
  assert_int_equal(o2, 256);
  assert_int_equal(gpupool__alloc_free_ranges(a), 2);
  assert_int_equal(gpupool__alloc_used(a), 103);
  /* The gap is reused by a request that fits it (best fit picks the small range). */
  assert_int_equal(gpupool__alloc_get(a, 200, 8, &o3), 0);
  assert_int_equal(o3, 8);
  /* Large alignments work anywhere in the space. */
  assert_int_equal(gpupool__alloc_get(a, 1, 1 << 19, &o4), 0);
  assert_int_equal(o4, 1 << 19);
  assert_int_equal(o4 % (1 << 19), 0);
  /* An alignment with no aligned offset left inside the space fails. */
  {
    uint64_t o;
    assert_int_equal(gpupool__alloc_get(a, 1, 1 << 20, &o), GPUPOOL_ENOSPC);
  }
  assert_int_equal(gpupool__alloc_put(a, o1, 3), 0);
  assert_int_equal(gpupool__alloc_put(a, o2, 100), 0);
  assert_int_equal(gpupool__alloc_put(a, o3, 200), 0);
  assert_int_equal(gpupool__alloc_put(a, o4, 1), 0);
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);
  assert_int_equal(gpupool__alloc_used(a), 0);
  assert_int_equal(gpupool__alloc_largest_free(a), 1 << 20);
  gpupool__alloc_delete(a);
}

static void test_exhaustion(void **state) {
  gpupool__alloc *a;
  uint64_t off[10], o;

  assert_int_equal(gpupool__alloc_new(1000, &a), 0);
  for (int i = 0; i < 10; i++) {
    assert_int_equal(gpupool__alloc_get(a, 100, 1, &off[i]), 0);
    assert_int_equal(off[i], (uint64_t)i * 100);
  }
  assert_int_equal(gpupool__alloc_used(a), 1000);
  assert_int_equal(gpupool__alloc_free_ranges(a), 0);
  assert_int_equal(gpupool__alloc_largest_free(a), 0);
  assert_int_equal(gpupool__alloc_get(a, 1, 1, &o), GPUPOOL_ENOSPC);
  /* Free space split in two holes of 100: 150 does not fit although 200 are free, and the
   * message says both numbers. */
  assert_int_equal(gpupool__alloc_put(a, off[2], 100), 0);
  assert_int_equal(gpupool__alloc_put(a, off[7], 100), 0);
  assert_int_equal(gpupool__alloc_get(a, 150, 1, &o), GPUPOOL_ENOSPC);
  assert_non_null(strstr(gpupool__errmsg(), "200 of 1000 bytes are free"));
  assert_non_null(strstr(gpupool__errmsg(), "largest free range is 100 bytes"));
  assert_int_equal(gpupool__alloc_get(a, 1001, 1, &o), GPUPOOL_ENOSPC);
  assert_int_equal(gpupool__alloc_get(a, UINT64_MAX, 1, &o), GPUPOOL_ENOSPC);
  assert_int_equal(gpupool__alloc_get(a, 100, 1, &o), 0);
  assert_int_equal(o, 200);
  gpupool__alloc_delete(a);
}

static void test_coalescing(void **state) {
  gpupool__alloc *a;
  uint64_t off[8];

  assert_int_equal(gpupool__alloc_new(800, &a), 0);
  for (int i = 0; i < 8; i++)
    assert_int_equal(gpupool__alloc_get(a, 100, 1, &off[i]), 0);
  /* Free every other one: four separate holes. */
  for (int i = 0; i < 8; i += 2)
    assert_int_equal(gpupool__alloc_put(a, off[i], 100), 0);
  assert_int_equal(gpupool__alloc_free_ranges(a), 4);
  assert_int_equal(gpupool__alloc_largest_free(a), 100);
  /* Join with the previous only, the next only, then both. */
  assert_int_equal(gpupool__alloc_put(a, off[1], 100), 0); /* [0,300) */
  assert_int_equal(gpupool__alloc_free_ranges(a), 3);
  assert_int_equal(gpupool__alloc_largest_free(a), 300);
  assert_int_equal(gpupool__alloc_put(a, off[5], 100), 0); /* [400,700) */
  assert_int_equal(gpupool__alloc_free_ranges(a), 2);
  assert_int_equal(gpupool__alloc_put(a, off[3], 100), 0); /* [0,700) */
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);
  assert_int_equal(gpupool__alloc_largest_free(a), 700);
  assert_int_equal(gpupool__alloc_put(a, off[7], 100), 0); /* with the tail, at the end */
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);
  assert_int_equal(gpupool__alloc_largest_free(a), 800);
  assert_int_equal(gpupool__alloc_used(a), 0);
  gpupool__alloc_delete(a);
}

static void test_bad_put(void **state) {
  gpupool__alloc *a;
  uint64_t o1, o2;

  assert_int_equal(gpupool__alloc_new(1000, &a), 0);
  assert_int_equal(gpupool__alloc_get(a, 100, 1, &o1), 0);
  assert_int_equal(gpupool__alloc_get(a, 100, 1, &o2), 0);
  assert_int_equal(gpupool__alloc_put(a, o1, 100), 0);
  /* Double free. */
  assert_int_equal(gpupool__alloc_put(a, o1, 100), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "double free"));
  /* A range that reaches into free memory (wrong size). */
  assert_int_equal(gpupool__alloc_put(a, o2, 101), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_put(a, o2 - 1, 100), GPUPOOL_EINVAL);
  /* Outside the space, including offsets whose end would overflow. */
  assert_int_equal(gpupool__alloc_put(a, 1000, 1), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "outside"));
  assert_int_equal(gpupool__alloc_put(a, 900, 200), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_put(a, UINT64_MAX, 2), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_put(a, 150, UINT64_MAX), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_put(a, o2, 0), GPUPOOL_EINVAL);
  /* None of that changed anything. */
  assert_int_equal(gpupool__alloc_used(a), 100);
  assert_int_equal(gpupool__alloc_free_ranges(a), 2);
  assert_int_equal(gpupool__alloc_put(a, o2, 100), 0);
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);
  assert_int_equal(gpupool__alloc_used(a), 0);
  gpupool__alloc_delete(a);
}

static void test_best_fit(void **state) {
  gpupool__alloc *a;
  uint64_t off[6], o;

  /* Holes of 300, 100 and 200 (in offset order); a 90-byte request takes the 100 hole, a
   * 150-byte one the 200 hole, leaving the 300 hole whole for a 300-byte request. */
  assert_int_equal(gpupool__alloc_new(900, &a), 0);
  assert_int_equal(gpupool__alloc_get(a, 300, 1, &off[0]), 0); /* [0,300) */
  assert_int_equal(gpupool__alloc_get(a, 50, 1, &off[1]), 0);  /* [300,350) */
  assert_int_equal(gpupool__alloc_get(a, 100, 1, &off[2]), 0); /* [350,450) */
  assert_int_equal(gpupool__alloc_get(a, 50, 1, &off[3]), 0);  /* [450,500) */
  assert_int_equal(gpupool__alloc_get(a, 200, 1, &off[4]), 0); /* [500,700) */
  assert_int_equal(gpupool__alloc_get(a, 200, 1, &off[5]), 0); /* [700,900) */
  assert_int_equal(gpupool__alloc_put(a, off[0], 300), 0);
  assert_int_equal(gpupool__alloc_put(a, off[2], 100), 0);
  assert_int_equal(gpupool__alloc_put(a, off[4], 200), 0);
  assert_int_equal(gpupool__alloc_get(a, 90, 1, &o), 0);
  assert_int_equal(o, 350);
  assert_int_equal(gpupool__alloc_get(a, 150, 1, &o), 0);
  assert_int_equal(o, 500);
  assert_int_equal(gpupool__alloc_get(a, 300, 1, &o), 0);
  assert_int_equal(o, 0);
  gpupool__alloc_delete(a);
}

/* --- randomized churn against a shadow bitmap ------------------------------------------------ */

typedef struct {
  uint64_t off, size;
} live_range;

static uint64_t rng_state;
static uint64_t rnd(void) {
  /* xorshift64*: deterministic, so a failure reproduces. */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545f4914f6cdd1dull;
}

static int bit_get(const uint8_t *b, uint64_t i) { return b[i >> 3] >> (i & 7) & 1; }
static void bit_set(uint8_t *b, uint64_t i, int v) {
  if (v)
    b[i >> 3] |= (uint8_t)(1u << (i & 7));
  else
    b[i >> 3] &= (uint8_t) ~(1u << (i & 7));
}

/* Largest run of clear bits: what largest_free must report when ranges coalesce fully. */
static uint64_t shadow_largest_free(const uint8_t *b, uint64_t cap, uint32_t *runs) {
  uint64_t best = 0, cur = 0;
  *runs = 0;
  for (uint64_t i = 0; i < cap; i++) {
    if (!bit_get(b, i)) {
      if (cur == 0)
        (*runs)++;
      cur++;
      if (cur > best)
        best = cur;
    } else {
      cur = 0;
    }
  }
  return best;
}

static void test_churn(void **state) {
  enum { CAP = 1 << 20, MAXLIVE = 4000, STEPS = 60000 };
  gpupool__alloc *a;
  uint8_t *shadow = calloc(CAP / 8, 1);
  live_range *live = calloc(MAXLIVE, sizeof *live);
  uint64_t used = 0;
  uint32_t nlive = 0, nospc = 0;

  assert_non_null(shadow);
  assert_non_null(live);
  rng_state = 0x9e3779b97f4a7c15ull;
  assert_int_equal(gpupool__alloc_new(CAP, &a), 0);
  for (int step = 0; step < STEPS; step++) {
    int do_get = nlive == 0 || (nlive < MAXLIVE && rnd() % 100 < 55);
    if (do_get) {
      uint64_t size = 1 + rnd() % (rnd() % 8 == 0 ? 4096 : 128);
      uint64_t align = 1ull << (rnd() % 9);
      uint64_t off;
      int rc = gpupool__alloc_get(a, size, align, &off);
      if (rc == GPUPOOL_ENOSPC) {
        nospc++;
        continue;
      }
      assert_int_equal(rc, 0);
      assert_int_equal(off % align, 0);
      assert_true(off + size <= CAP);
      for (uint64_t i = off; i < off + size; i++) {
        assert_false(bit_get(shadow, i)); /* no overlap with a live range */
        bit_set(shadow, i, 1);
      }
      live[nlive].off = off;
      live[nlive].size = size;
      nlive++;
      used += size;
    } else {
      uint32_t k = (uint32_t)(rnd() % nlive);
      live_range r = live[k];
      assert_int_equal(gpupool__alloc_put(a, r.off, r.size), 0);
      /* Immediately freeing it again must be refused. */
      if (step % 97 == 0)
        assert_int_equal(gpupool__alloc_put(a, r.off, r.size), GPUPOOL_EINVAL);
      for (uint64_t i = r.off; i < r.off + r.size; i++)
        bit_set(shadow, i, 0);
      live[k] = live[--nlive];
      used -= r.size;
    }
    assert_int_equal(gpupool__alloc_used(a), used);
    if (step % 1000 == 0) {
      uint32_t runs;
      uint64_t largest = shadow_largest_free(shadow, CAP, &runs);
      /* Every free run is exactly one free range (coalescing is immediate and complete). */
      assert_int_equal(gpupool__alloc_free_ranges(a), runs);
      assert_int_equal(gpupool__alloc_largest_free(a), largest);
      /* Whatever largest_free says fits, does fit. */
      if (largest > 0) {
        uint64_t off;
        assert_int_equal(gpupool__alloc_get(a, largest, 1, &off), 0);
        assert_int_equal(gpupool__alloc_put(a, off, largest), 0);
      }
    }
  }
  /* The run must have kept thousands of ranges live and hit a full space at times, or it
   * tested little. */
  assert_true(nlive > 1000);
  assert_true(nospc > 0);
  while (nlive > 0) {
    live_range r = live[--nlive];
    assert_int_equal(gpupool__alloc_put(a, r.off, r.size), 0);
  }
  assert_int_equal(gpupool__alloc_used(a), 0);
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);
  assert_int_equal(gpupool__alloc_largest_free(a), CAP);
  gpupool__alloc_delete(a);
  free(shadow);
  free(live);
}

/* Fragmentation sanity: equal-sized blocks with alternate ones freed leave holes exactly the
 * block size, each reused in place by a same-sized request; a workload of mixed sizes that
 * frees in bulk keeps the allocator's waste bounded. */
/* take: exactly the range asked (a restored buffer's), from any part of a free range; never a
 * byte that is not free; what was taken goes back with put. */
static void test_take(void **state) {
  gpupool__alloc *a;
  uint64_t off;
  (void)state;
  assert_int_equal(gpupool__alloc_new(1000, &a), 0);
  assert_int_equal(gpupool__alloc_take(a, 100, 50), 0);  /* middle: splits the range */
  assert_int_equal(gpupool__alloc_free_ranges(a), 2);
  assert_int_equal(gpupool__alloc_take(a, 0, 100), 0);   /* head of the first */
  assert_int_equal(gpupool__alloc_take(a, 900, 100), 0); /* tail of the last */
  assert_int_equal(gpupool__alloc_used(a), 250);
  assert_int_equal(gpupool__alloc_take(a, 120, 10), GPUPOOL_EINVAL);  /* taken already */
  assert_int_equal(gpupool__alloc_take(a, 140, 20), GPUPOOL_EINVAL);  /* overlaps a taken range */
  assert_int_equal(gpupool__alloc_take(a, 950, 100), GPUPOOL_EINVAL); /* past the end */
  assert_int_equal(gpupool__alloc_take(a, 200, 0), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__alloc_used(a), 250);
  assert_int_equal(gpupool__alloc_take(a, 150, 750), 0); /* the whole rest */
  assert_int_equal(gpupool__alloc_free_ranges(a), 0);
  assert_int_equal(gpupool__alloc_get(a, 1, 1, &off), GPUPOOL_ENOSPC);
  assert_int_equal(gpupool__alloc_put(a, 100, 50), 0);
  assert_int_equal(gpupool__alloc_get(a, 50, 1, &off), 0);
  assert_int_equal(off, 100);
  gpupool__alloc_delete(a);
}

static void test_fragmentation_bound(void **state) {
  enum { N = 2048, BLK = 64 };
  gpupool__alloc *a;
  uint64_t off[N];

  assert_int_equal(gpupool__alloc_new((uint64_t)N * BLK, &a), 0);
  for (int i = 0; i < N; i++)
    assert_int_equal(gpupool__alloc_get(a, BLK, 64, &off[i]), 0);
  for (int i = 0; i < N; i += 2)
    assert_int_equal(gpupool__alloc_put(a, off[i], BLK), 0);
  assert_int_equal(gpupool__alloc_free_ranges(a), N / 2);
  assert_int_equal(gpupool__alloc_largest_free(a), BLK);
  /* Every hole is reused: same-sized requests succeed until the space is full again. */
  for (int i = 0; i < N; i += 2) {
    uint64_t o;
    assert_int_equal(gpupool__alloc_get(a, BLK, 64, &o), 0);
    assert_int_equal(o % (2 * BLK), 0);
    off[i] = o;
  }
  assert_int_equal(gpupool__alloc_used(a), (uint64_t)N * BLK);
  for (int i = 0; i < N; i++)
    assert_int_equal(gpupool__alloc_put(a, off[i], BLK), 0);
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);

  /* Mixed sizes: fill with small and large, free all small ones; then large requests must
   * still find all the space the large ones left, and the small holes must serve small
   * requests without touching the large range. */
  {
    uint64_t smalls[N / 2], larges[N / 8];
    int ns = 0, nl = 0;
    for (int i = 0; i < N / 2; i++)
      assert_int_equal(gpupool__alloc_get(a, 16, 16, &smalls[ns++]), 0);
    for (int i = 0; i < N / 8; i++)
      assert_int_equal(gpupool__alloc_get(a, 256, 256, &larges[nl++]), 0);
    for (int i = 0; i < ns; i += 2)
      assert_int_equal(gpupool__alloc_put(a, smalls[i], 16), 0);
    {
      uint64_t before = gpupool__alloc_largest_free(a), o;
      for (int i = 0; i < ns / 2; i++) {
        assert_int_equal(gpupool__alloc_get(a, 16, 16, &o), 0);
        smalls[i * 2] = o;
      }
      /* Best fit refilled the holes: the tail range is untouched. */
      assert_int_equal(gpupool__alloc_largest_free(a), before);
    }
    for (int i = 0; i < ns; i++)
      assert_int_equal(gpupool__alloc_put(a, smalls[i], 16), 0);
    for (int i = 0; i < nl; i++)
      assert_int_equal(gpupool__alloc_put(a, larges[i], 256), 0);
  }
  assert_int_equal(gpupool__alloc_free_ranges(a), 1);
  assert_int_equal(gpupool__alloc_used(a), 0);
  gpupool__alloc_delete(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_new_and_args),
      cmocka_unit_test(test_alignment),
      cmocka_unit_test(test_exhaustion),
      cmocka_unit_test(test_coalescing),
      cmocka_unit_test(test_bad_put),
      cmocka_unit_test(test_best_fit),
      cmocka_unit_test(test_churn),
      cmocka_unit_test(test_fragmentation_bound),
      cmocka_unit_test(test_take),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
