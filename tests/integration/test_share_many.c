/*
 * Many holds shared, and many tokens opened, in one request each (gpupool_buffer_share_kept_many,
 * gpupool_buffer_open_many), and the Idle question a sender asks before it writes a buffer
 * again (gpupool_buffer_idle_many), against a real daemon: one request for a whole set (counted
 * by the daemon's request counter), the bytes right, max_share_batch refused with nothing left
 * behind, a forged or repeated token in the middle of a batch opens nothing and uses up no kept
 * share, a kept-share quota hit midway leaves no kept share, a set whose slabs need more fds
 * than one reply carries opens whole, a buffer is idle only once nobody else holds it, and
 * many allocations in flight together are all or nothing. Messages of 1,000 buffers (three in
 * flight at once) and of 10,000 go through in runs of max_share_batch, as gpupool.torch sends
 * them; a failed open of a message leaves its receiver's connection usable and holds the
 * sender's buffers no longer than share_keep_ms once the sender has gone.
 */
#include <inttypes.h>

#include "harness.h"

static th_daemon D;

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  return 0;
}

static void start_with(const char *daemon_lines, const char *pool) {
  char conf[1024];
  snprintf(conf, sizeof conf, "[daemon]\n%s\n%s", daemon_lines, pool);
  th_start_conf(&D, conf);
}

/* The daemon's request counter, asked through c (which counts one request per call). */
static uint64_t requests(gpupool_client *c) {
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps[4];
  int n = 0;
  if (gpupool_client_stats(c, &ds, ps, 4, &n) != 0)
    fail_msg("stats: %s", gpupool_last_error());
  return ds.requests;
}

static void holds_now(uint64_t *buffers, uint64_t *holds) {
  gpupool_daemon_stats ds;
  th_stats(&D, &ds, NULL);
  *buffers = ds.buffers;
  *holds = ds.holds;
}

/* n buffers of size bytes, buffer i filled with (i + fill) & 0xff. */
static void alloc_filled(gpupool_client *c, gpupool_buffer **b, int n, size_t size, int fill) {
  for (int i = 0; i < n; i++) {
    if (gpupool_buffer_alloc(c, NULL, size, 0, NULL, &b[i]) != 0)
      fail_msg("alloc %d: %s", i, gpupool_last_error());
    memset(gpupool_buffer_ptr(b[i]), (i + fill) & 0xff, size);
  }
}

static void check_filled(gpupool_buffer **o, int n, size_t size, int fill) {
  for (int i = 0; i < n; i++) {
    const unsigned char *p = gpupool_buffer_ptr(o[i]);
    assert_non_null(o[i]);
    for (size_t j = 0; j < size; j += 511)
      if (p[j] != ((i + fill) & 0xff))
        fail_msg("buffer %d byte %zu is 0x%x, expected 0x%x", i, j, p[j], (i + fill) & 0xff);
  }
}

static void release_all(gpupool_buffer **b, int n) {
  for (int i = 0; i < n; i++)
    if (b[i])
      assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
}

static void test_one_request_each(void **state) {
  enum { N = 40 };
  gpupool_client *a, *r, *st;
  gpupool_buffer *b[N], *o[N];
  gpupool_token tok[N];
  uint64_t r0, r1, r2, idle_cost;
  (void)state;
  start_with("", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  r = th_connect(&D, "receiver");
  st = th_connect(&D, "stats");
  alloc_filled(a, b, N, 4096, 7);
  /* Map the pool in the receiver first, so that what is counted is the batch alone. */
  {
    gpupool_buffer *w, *wo;
    gpupool_token wt;
    assert_int_equal(gpupool_buffer_alloc(a, NULL, 64, 0, NULL, &w), 0);
    assert_int_equal(gpupool_buffer_share_kept(w, NULL, &wt), 0);
    assert_int_equal(gpupool_buffer_open(r, &wt, 0, NULL, &wo), 0);
    release_all(&wo, 1);
    release_all(&w, 1);
  }
  r0 = requests(st);
  r1 = requests(st);
  idle_cost = r1 - r0; /* what asking costs by itself */
  assert_int_equal(gpupool_buffer_share_kept_many(b, N, NULL, tok, NULL, 0, NULL), 0);
  assert_int_equal(gpupool_buffer_open_many(r, tok, N, 0, NULL, o), 0);
  r2 = requests(st);
  assert_int_equal(r2 - r1 - idle_cost, 2); /* one Share, one Open for all 40 */
  check_filled(o, N, 4096, 7);
  /* Each kept share opened once: the tokens are spent. */
  {
    gpupool_buffer *again[N];
    assert_int_equal(gpupool_buffer_open_many(r, tok, N, 0, NULL, again), GPUPOOL_ENOENT);
    for (int i = 0; i < N; i++)
      assert_null(again[i]);
  }
  release_all(o, N);
  release_all(b, N);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(st);
  th_wait_idle(&D, 3000);
}

static void test_batch_cap(void **state) {
  gpupool_client *a;
  gpupool_buffer *b[9], *o[9];
  gpupool_token tok[9];
  uint64_t nb, nh;
  (void)state;
  start_with("max_share_batch = 8", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  alloc_filled(a, b, 9, 100, 1);
  assert_int_equal(gpupool_buffer_share_kept_many(b, 9, NULL, tok, NULL, 0, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "max_share_batch"));
  holds_now(&nb, &nh);
  assert_int_equal(nh, 9); /* no kept share made */
  assert_int_equal(gpupool_buffer_share_kept_many(b, 8, NULL, tok, NULL, 0, NULL), 0);
  assert_int_equal(gpupool_buffer_share_kept(b[8], NULL, &tok[8]), 0);
  assert_int_equal(gpupool_buffer_open_many(a, tok, 9, 0, NULL, o), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "max_share_batch"));
  holds_now(&nb, &nh);
  assert_int_equal(nh, 18); /* 9 holds + 9 kept shares: none used up */
  assert_int_equal(gpupool_buffer_open_many(a, tok, 8, 0, NULL, o), 0);
  assert_int_equal(gpupool_buffer_open(a, &tok[8], 0, NULL, &o[8]), 0);
  release_all(o, 9);
  release_all(b, 9);
  gpupool_client_disconnect(a);
  th_wait_idle(&D, 3000);
}

/* Many holds let go of in one request per max_share_batch of them (a receiver freeing a whole
 * message); every handle freed and every hold gone. */
static void test_release_many(void **state) {
  enum { N = 20 };
  gpupool_client *a, *other, *st;
  gpupool_buffer *b[N], *x;
  uint64_t r0, r1, r2, nb, nh;
  (void)state;
  start_with("max_share_batch = 8", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "releaser");
  other = th_connect(&D, "other");
  st = th_connect(&D, "stats");
  alloc_filled(a, b, N, 4096, 3);
  assert_int_equal(gpupool_buffer_alloc(other, NULL, 64, 0, NULL, &x), 0);
  /* Buffers of two clients in one call: refused, nothing released. */
  {
    gpupool_buffer *mixed[2] = {b[0], x};
    assert_int_equal(gpupool_buffer_release_many(mixed, 2, NULL), GPUPOOL_EINVAL);
    assert_non_null(strstr(gpupool_last_error(), "another client"));
  }
  holds_now(&nb, &nh);
  assert_int_equal(nh, N + 1);
  r0 = requests(st);
  r1 = requests(st);
  assert_int_equal(gpupool_buffer_release_many(b, N, NULL), 0);
  r2 = requests(st);
  assert_int_equal(r2 - r1 - (r1 - r0), 3); /* 20 holds, 8 a request */
  holds_now(&nb, &nh);
  assert_int_equal(nh, 1);
  assert_int_equal(gpupool_buffer_release_many(&x, 1, NULL), 0);
  assert_int_equal(gpupool_buffer_release_many(NULL, 0, NULL), 0);
  /* A reload lowers the batch below what the client was told at its Hello: its releases
   * still go, one hold a request. */
  alloc_filled(a, b, N, 4096, 5);
  {
    char conf[1024], line[512];
    int reloaded = 0;
    FILE *f;
    snprintf(conf, sizeof conf, "[daemon]\nmax_share_batch = 2\n%s", TH_HOST_POOL("64M", "4M"));
    th_write_conf(&D, conf);
    assert_int_equal(kill(D.pid, SIGHUP), 0);
    for (int i = 0; i < 1000 && !reloaded; i++) {
      th_sleep_ms(10);
      if ((f = fopen(D.log, "r"))) {
        while (fgets(line, sizeof line, f))
          reloaded |= strstr(line, "reloaded ") != NULL;
        fclose(f);
      }
    }
    assert_true(reloaded);
  }
  assert_int_equal(gpupool_buffer_release_many(b, N, NULL), 0);
  holds_now(&nb, &nh);
  assert_int_equal(nh, 0);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(other);
  gpupool_client_disconnect(st);
  th_wait_idle(&D, 3000);
}

static void test_bad_token_in_the_middle(void **state) {
  enum { N = 10 };
  gpupool_client *a, *r;
  gpupool_buffer *b[N], *o[N];
  gpupool_token tok[N], bad[N];
  uint64_t nb, nh;
  (void)state;
  start_with("", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  r = th_connect(&D, "receiver");
  alloc_filled(a, b, N, 4096, 3);
  assert_int_equal(gpupool_buffer_share_kept_many(b, N, NULL, tok, NULL, 0, NULL), 0);
  /* Forged: one byte of token 5's secret flipped. */
  memcpy(bad, tok, sizeof tok);
  bad[5].bytes[12] ^= 0x5a;
  assert_int_equal(gpupool_buffer_open_many(r, bad, N, 0, NULL, o), GPUPOOL_ENOENT);
  assert_non_null(strstr(gpupool_last_error(), "token 6 of 10"));
  for (int i = 0; i < N; i++)
    assert_null(o[i]);
  /* Repeated: a kept share named twice in one request opens once, so the request fails. */
  memcpy(bad, tok, sizeof tok);
  bad[7] = tok[2];
  assert_int_equal(gpupool_buffer_open_many(r, bad, N, 0, NULL, o), GPUPOOL_ENOENT);
  holds_now(&nb, &nh);
  assert_int_equal(nh, 2 * N); /* the sender's holds and every kept share: nothing used up */
  /* The real tokens still open, every one. */
  assert_int_equal(gpupool_buffer_open_many(r, tok, N, 0, NULL, o), 0);
  check_filled(o, N, 4096, 3);
  release_all(o, N);
  release_all(b, N);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 3000);
}

static void test_quota_midway(void **state) {
  gpupool_client *a;
  gpupool_buffer *b[6], *o[6];
  gpupool_token tok[6];
  uint64_t nb, nh;
  (void)state;
  start_with("max_kept_shares_per_client = 5", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  alloc_filled(a, b, 6, 100, 9);
  assert_int_equal(gpupool_buffer_share_kept_many(b, 6, NULL, tok, NULL, 0, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_kept_shares_per_client"));
  assert_non_null(strstr(gpupool_last_error(), "none of the 6 holds"));
  holds_now(&nb, &nh);
  assert_int_equal(nh, 6); /* the five made before the sixth failed are gone */
  assert_int_equal(gpupool_buffer_share_kept_many(b, 5, NULL, tok, NULL, 0, NULL), 0);
  assert_int_equal(gpupool_buffer_open_many(a, tok, 5, 0, NULL, o), 0);
  check_filled(o, 5, 100, 9);
  release_all(o, 5);
  release_all(b, 6);
  gpupool_client_disconnect(a);
  th_wait_idle(&D, 3000);
}

/* 20 buffers of dedicated slabs (larger than slab_size): a fresh receiver needs 20 slab fds,
 * more than one reply carries; the set still opens whole, in as many requests as needed. */
static void test_more_slabs_than_one_reply_carries(void **state) {
  enum { N = 20 };
  gpupool_client *a, *r;
  gpupool_buffer *b[N], *o[N];
  gpupool_token tok[N];
  (void)state;
  start_with("", TH_HOST_POOL("256M", "1M"));
  a = th_connect(&D, "sender");
  r = th_connect(&D, "receiver");
  alloc_filled(a, b, N, 2 << 20, 11);
  assert_int_equal(gpupool_buffer_share_kept_many(b, N, NULL, tok, NULL, 0, NULL), 0);
  assert_int_equal(gpupool_buffer_open_many(r, tok, N, 0, NULL, o), 0);
  check_filled(o, N, 2 << 20, 11);
  release_all(o, N);
  release_all(b, N);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 3000);
}

static void test_idle_only_when_alone(void **state) {
  gpupool_client *a, *r;
  gpupool_buffer *b[2], *o;
  gpupool_token tok;
  int idle[2];
  (void)state;
  start_with("", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  r = th_connect(&D, "receiver");
  alloc_filled(a, b, 2, 100, 0);
  assert_int_equal(gpupool_buffer_idle_many(b, 2, idle), 0);
  assert_true(idle[0] && idle[1]);
  assert_int_equal(gpupool_buffer_share_kept(b[0], NULL, &tok), 0);
  assert_int_equal(gpupool_buffer_idle_many(b, 2, idle), 0);
  assert_true(!idle[0] && idle[1]); /* a kept share not yet opened */
  assert_int_equal(gpupool_buffer_open(r, &tok, 0, NULL, &o), 0);
  assert_int_equal(gpupool_buffer_idle_many(b, 2, idle), 0);
  assert_true(!idle[0] && idle[1]); /* the receiver's hold */
  assert_int_equal(gpupool_buffer_publish(b[1], "n", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_idle_many(b, 2, idle), 0);
  assert_true(!idle[0] && !idle[1]); /* a name */
  assert_int_equal(gpupool_name_unpublish(a, "n"), 0);
  release_all(&o, 1);
  assert_int_equal(gpupool_buffer_idle_many(b, 2, idle), 0);
  assert_true(idle[0] && idle[1]);
  /* The same answer in a Share's round trip. */
  {
    gpupool_token t1, t0;
    gpupool_buffer *o1, *o0;
    int one = -1;
    assert_int_equal(gpupool_buffer_share_kept_many(&b[1], 1, NULL, &t1, &b[0], 1, &one), 0);
    assert_int_equal(one, 1);
    assert_int_equal(gpupool_buffer_share_kept_many(&b[0], 1, NULL, &t0, &b[1], 1, &one), 0);
    assert_int_equal(one, 0); /* its kept share is not opened yet */
    assert_int_equal(gpupool_buffer_open(r, &t1, 0, NULL, &o1), 0);
    assert_int_equal(gpupool_buffer_open(r, &t0, 0, NULL, &o0), 0);
    release_all(&o1, 1);
    release_all(&o0, 1);
  }
  release_all(b, 2);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 3000);
}

/* Many allocations in one go: every buffer usable; one that cannot be had (more than the
 * pool holds) fails the call and leaves nothing allocated. */
static void test_alloc_many_all_or_nothing(void **state) {
  enum { N = 12 };
  gpupool_client *a;
  gpupool_buffer *b[N];
  size_t sizes[N];
  uint64_t nb, nh;
  (void)state;
  start_with("", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  for (int i = 0; i < N; i++)
    sizes[i] = 1000 + 4096 * (size_t)i;
  assert_int_equal(gpupool_buffer_alloc_many(a, NULL, sizes, N, NULL, b), 0);
  for (int i = 0; i < N; i++) {
    assert_true(gpupool_buffer_size(b[i]) >= sizes[i]);
    memset(gpupool_buffer_ptr(b[i]), i, sizes[i]);
  }
  check_filled(b, 1, sizes[0], 0);
  release_all(b, N);
  sizes[7] = 128 << 20; /* more than the pool's 64M */
  sizes[9] = 256 << 20; /* and another: the call tells of the first, its code and its message */
  assert_true(gpupool_buffer_alloc_many(a, NULL, sizes, N, NULL, b) < 0);
  if (!strstr(gpupool_last_error(), "134217728") || strstr(gpupool_last_error(), "268435456"))
    fail_msg("alloc_many should tell of the first refusal (134217728 bytes), told: %s", gpupool_last_error());
  for (int i = 0; i < N; i++)
    assert_null(b[i]);
  holds_now(&nb, &nh);
  assert_int_equal(nh, 0);
  gpupool_client_disconnect(a);
  th_wait_idle(&D, 3000);
}

/* A message of n buffers of size bytes from a to r, as gpupool.torch sends one: allocated in
 * one round trip, shared kept and opened in runs of max_share_batch (1024 by default). */
static void message(gpupool_client *a, gpupool_client *r, int n, size_t size, int fill, gpupool_buffer **tx,
                    gpupool_buffer **rx) {
  size_t *sizes = calloc((size_t)n, sizeof *sizes);
  gpupool_token *tok = calloc((size_t)n, sizeof *tok);
  assert_non_null(sizes);
  assert_non_null(tok);
  for (int i = 0; i < n; i++)
    sizes[i] = size;
  if (gpupool_buffer_alloc_many(a, NULL, sizes, n, NULL, tx) != 0)
    fail_msg("alloc_many of %d: %s", n, gpupool_last_error());
  for (int i = 0; i < n; i++)
    memset(gpupool_buffer_ptr(tx[i]), (i + fill) & 0xff, size);
  for (int i = 0; i < n; i += 1024) {
    int k = n - i < 1024 ? n - i : 1024;
    if (gpupool_buffer_share_kept_many(tx + i, k, NULL, tok + i, NULL, 0, NULL) != 0)
      fail_msg("share_kept_many at %d of %d: %s", i, n, gpupool_last_error());
  }
  for (int i = 0; i < n; i += 1024) {
    int k = n - i < 1024 ? n - i : 1024;
    if (gpupool_buffer_open_many(r, tok + i, k, 0, NULL, rx + i) != 0)
      fail_msg("open_many at %d of %d: %s", i, n, gpupool_last_error());
  }
  check_filled(rx, n, size, fill);
  free(sizes);
  free(tok);
}

static void test_messages_of_1000_and_10000(void **state) {
  enum { SMALL = 1000, INFLIGHT = 3, BIG = 10000 };
  gpupool_client *a, *r;
  gpupool_buffer **tx = calloc(BIG, sizeof *tx), **rx = calloc(BIG, sizeof *rx);
  (void)state;
  assert_non_null(tx);
  assert_non_null(rx);
  start_with("", TH_HOST_POOL("256M", "8M"));
  a = th_connect(&D, "sender");
  r = th_connect(&D, "receiver");
  for (int m = 0; m < INFLIGHT; m++)
    message(a, r, SMALL, 4096, 5 * m, tx + m * SMALL, rx + m * SMALL);
  release_all(rx, INFLIGHT * SMALL);
  release_all(tx, INFLIGHT * SMALL);
  message(a, r, BIG, 4096, 1, tx, rx);
  release_all(rx, BIG);
  release_all(tx, BIG);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 5000);
  free(tx);
  free(rx);
}

/* A message whose open fails (a token in it forged): the receiver's request fails whole and
 * its connection goes on serving it; the sender, gone already, pins its buffers through the
 * kept shares only until share_keep_ms has passed. */
static void test_failed_open_pins_nothing_past_keep(void **state) {
  enum { N = 1000 };
  gpupool_client *a, *r;
  gpupool_buffer *b[N], *o[N], *w;
  gpupool_token tok[N];
  uint64_t nb, nh, t0;
  (void)state;
  start_with("share_keep_ms = 400", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  r = th_connect(&D, "receiver");
  alloc_filled(a, b, N, 4096, 2);
  assert_int_equal(gpupool_buffer_share_kept_many(b, N, NULL, tok, NULL, 0, NULL), 0);
  release_all(b, N);
  gpupool_client_disconnect(a); /* the message is in flight: only its kept shares hold it */
  t0 = th_now_ms();
  tok[N / 2].bytes[20] ^= 0x21;
  assert_int_equal(gpupool_buffer_open_many(r, tok, N, 0, NULL, o), GPUPOOL_ENOENT);
  for (int i = 0; i < N; i++)
    assert_null(o[i]);
  /* The receiver is fine: it allocates and releases as before. */
  assert_int_equal(gpupool_buffer_alloc(r, NULL, 100, 0, NULL, &w), 0);
  assert_int_equal(gpupool_buffer_release(w, NULL), 0);
  holds_now(&nb, &nh);
  if (th_now_ms() - t0 < 300) {
    assert_int_equal(nb, N); /* still kept: share_keep_ms has not passed */
    assert_int_equal(nh, N);
  }
  th_wait_idle(&D, 5000); /* the kept shares expired: every buffer is back */
  gpupool_client_disconnect(r);
}

/* The facts of a message's holds in one call are each hold's own, in order (a receiver's,
 * one of them read-only, and the sender's of other sizes). */
static void test_facts_of_many(void **state) {
  enum { N = 3 };
  gpupool_client *a, *r;
  gpupool_buffer *b[N], *o[N];
  gpupool_token tok[N];
  uint64_t many[6 * 2 * N], one[6];
  (void)state;
  start_with("", TH_HOST_POOL("64M", "4M"));
  a = th_connect(&D, "sender");
  r = th_connect(&D, "receiver");
  for (int i = 0; i < N; i++) {
    if (gpupool_buffer_alloc(a, NULL, 100 + 4096 * (size_t)i, 0, NULL, &b[i]) != 0)
      fail_msg("alloc %d: %s", i, gpupool_last_error());
  }
  assert_int_equal(gpupool_buffer_share_kept_many(b, N, NULL, tok, NULL, 0, NULL), 0);
  assert_int_equal(gpupool_buffer_open_many(r, tok, 1, GPUPOOL_READ_ONLY, NULL, o), 0);
  assert_int_equal(gpupool_buffer_open_many(r, tok + 1, N - 1, 0, NULL, o + 1), 0);
  gpupool_buffer *all[2 * N] = {o[0], o[1], o[2], b[0], b[1], b[2]};
  memset(many, 0xee, sizeof many);
  gpupool_buffer_facts_many(all, 2 * N, many);
  for (int i = 0; i < 2 * N; i++) {
    gpupool_buffer_facts(all[i], one);
    assert_memory_equal(many + 6 * i, one, sizeof one);
    assert_int_equal(many[6 * i], (uint64_t)(uintptr_t)gpupool_buffer_ptr(all[i]));
    assert_int_equal(many[6 * i + 1], 100 + 4096 * (uint64_t)(i % N));
    assert_int_equal(many[6 * i + 4], gpupool_buffer_id(b[i % N]));
    assert_int_equal(many[6 * i + 5], i == 0);
  }
  memset(many, 0xee, sizeof many);
  gpupool_buffer_facts_many(NULL, 2, many); /* nothing to read: nothing written, no crash */
  gpupool_buffer_facts_many(all, 2, NULL);
  gpupool_buffer_facts_many(all, 0, many);
  for (size_t k = 0; k < sizeof many / sizeof many[0]; k++)
    assert_int_equal(many[k], 0xeeeeeeeeeeeeeeeeull);
  release_all(o, N);
  release_all(b, N);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 3000);
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_one_request_each, test_batch_cap, test_release_many,
                      test_bad_token_in_the_middle,
                      test_quota_midway, test_more_slabs_than_one_reply_carries, test_idle_only_when_alone,
                      test_alloc_many_all_or_nothing, test_messages_of_1000_and_10000,
                      test_failed_open_pins_nothing_past_keep, test_facts_of_many);
}
