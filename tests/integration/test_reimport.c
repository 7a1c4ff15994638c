/*
 * What one process maps of the daemon's memory over its life, against a real daemon: several
 * connections of one process (one per PinnedLoader, a library's next to the application's)
 * get buffers in the same slabs and open each other's, connections come and go while others
 * still use those slabs, and between rounds every empty slab goes back to the backend (trim),
 * so that later slabs are new ones the earlier connections never saw. Every buffer is checked
 * through every mapping this process has of it: a mapping kept from a slab that was given back
 * would show other bytes. The CUDA backend adds the driver's own rule (an allocation is
 * imported once per process, pinned memory refuses a second import), checked on a GPU by
 * gpupool_gpu_imports; this is the same walk on the host backend's mappings.
 */
#include <inttypes.h>

#include "harness.h"

#define BUF (256u << 10)
#define ROUNDS 6
#define PER_ROUND 5

static th_daemon D;

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  return 0;
}

static gpupool_buffer *alloc_filled(gpupool_client *c, uint32_t seed) {
  gpupool_buffer *b = NULL;
  if (gpupool_buffer_alloc(c, NULL, BUF, 0, NULL, &b) != 0)
    fail_msg("alloc: %s", gpupool_last_error());
  th_fill(gpupool_buffer_ptr(b), seed, BUF);
  return b;
}

static gpupool_buffer *pass_on(gpupool_buffer *b, gpupool_client *to) {
  gpupool_token t;
  gpupool_buffer *o = NULL;
  if (gpupool_buffer_share_kept(b, NULL, &t) != 0 || gpupool_buffer_open(to, &t, 0, NULL, &o) != 0)
    fail_msg("share and open: %s", gpupool_last_error());
  return o;
}

static void check(gpupool_buffer *b, uint32_t seed, const char *what) {
  if (!th_check(gpupool_buffer_ptr(b), seed, BUF))
    fail_msg("%s: the bytes differ from what was written (a mapping of another slab)", what);
}

static uint64_t slabs_now(void) {
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps;
  th_stats(&D, &ds, &ps);
  return ps.slabs;
}

static void test_connections_in_a_row(void **state) {
  gpupool_client *c1, *c2, *cr[ROUNDS] = {0};
  gpupool_buffer *a1, *a2, *o, *kept[ROUNDS] = {0};
  (void)state;
  th_start_conf(&D, "[daemon]\n" TH_HOST_POOL("64M", "2M") "keep_slabs = 0\n");
  c1 = th_connect(&D, "first");
  c2 = th_connect(&D, "second");
  a1 = alloc_filled(c1, 1);
  a2 = alloc_filled(c2, 2); /* same tenant: the slab c1 maps */
  o = pass_on(a1, c2);
  check(o, 1, "connection 1's buffer opened by connection 2");
  check(a2, 2, "connection 2's own buffer");
  th_fill(gpupool_buffer_ptr(o), 3, BUF); /* written through one mapping, read through the other */
  check(a1, 3, "connection 1's buffer after connection 2 wrote it");
  assert_int_equal(gpupool_buffer_release(o, NULL), 0);
  assert_int_equal(gpupool_buffer_release(a2, NULL), 0);
  gpupool_client_disconnect(c2); /* connection 1 still maps that slab and uses it */
  th_fill(gpupool_buffer_ptr(a1), 4, BUF);
  check(a1, 4, "connection 1's buffer after connection 2 went");
  for (int r = 0; r < ROUNDS; r++) {
    char name[32];
    snprintf(name, sizeof name, "round-%d", r);
    cr[r] = th_connect(&D, name);
    for (int i = 0; i < PER_ROUND; i++) {
      uint32_t seed = 100u * (uint32_t)r + (uint32_t)i + 10;
      gpupool_buffer *b = alloc_filled(cr[r], seed);
      o = pass_on(b, c1);
      check(o, seed, "a later round's buffer opened by connection 1");
      assert_int_equal(gpupool_buffer_release(o, NULL), 0);
      if (i == 0)
        kept[r] = b; /* outlives its round, as a loop variable keeps the last batch */
      else
        assert_int_equal(gpupool_buffer_release(b, NULL), 0);
    }
    if (r > 0) {
      check(kept[r - 1], 100u * (uint32_t)(r - 1) + 10, "the previous round's kept buffer");
      assert_int_equal(gpupool_buffer_release(kept[r - 1], NULL), 0);
      kept[r - 1] = NULL;
      gpupool_client_disconnect(cr[r - 1]);
      cr[r - 1] = NULL;
    }
    /* Every empty slab goes back, so the next round's slabs are new ones. */
    assert_int_equal(gpupool_client_trim(c1), 0);
  }
  check(a1, 4, "connection 1's buffer after every round");
  assert_int_equal(gpupool_buffer_release(kept[ROUNDS - 1], NULL), 0);
  gpupool_client_disconnect(cr[ROUNDS - 1]);
  assert_int_equal(gpupool_buffer_release(a1, NULL), 0);
  assert_int_equal(gpupool_client_trim(c1), 0);
  gpupool_client_disconnect(c1);
  th_wait_idle(&D, 3000);
  /* Nothing of this process maps a slab any more: every one went back. */
  {
    uint64_t end = th_now_ms() + 3000;
    while (slabs_now() != 0 && th_now_ms() < end)
      th_sleep_ms(20);
    assert_int_equal(slabs_now(), 0);
  }
}

int main(void) { return TS_RUN_TESTS(NULL, teardown, test_connections_in_a_row); }
