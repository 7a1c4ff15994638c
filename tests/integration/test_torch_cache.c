/*
 * The cache of libgpupool-torch-alloc (client/torch_alloc.c, included here so that the tests
 * can stand in for CUDA events) against a real gpupoold on the host backend: allocations and
 * frees served from kept segments with no request to the daemon, blocks split and merged as
 * torch's caching allocator does, reuse in stream order (on the same stream at once, on
 * another once the free's event completed; with no events, at once), a block shared with
 * another process read there with its bytes and never reused while held, a failed allocation
 * that gives the cache back and succeeds, empty_cache, threads allocating while the cache is
 * emptied, and a process that exits with blocks live and cached leaving the daemon as it was.
 */
#include <sys/wait.h>

#include "harness.h"

#include "../../client/torch_alloc.c"

static th_daemon D;

#define S1 ((void *)0x1000)
#define S2 ((void *)0x2000)
#define MIB (1u << 20)

/* Events the tests complete by hand. */
typedef struct fake_ev {
  int done;
} fake_ev;
static fake_ev *last_ev;
static int nrecorded;

static int fake_record(int device, void *stream, void **ev) {
  (void)device;
  (void)stream;
  last_ev = calloc(1, sizeof *last_ev);
  *ev = last_ev;
  nrecorded++;
  return last_ev ? 0 : -1;
}
static int fake_done(void *ev) { return ((fake_ev *)ev)->done; }
static void fake_destroy(void *ev) {
  if (ev == last_ev)
    last_ev = NULL;
  free(ev);
}
static int fake_sync(int device) {
  (void)device;
  return 0;
}
static const evops fake_evops = {fake_record, fake_done, fake_destroy, fake_sync};

static int setup(void **state) {
  (void)state;
  th_start_conf(&D, "[daemon]\n" TH_HOST_POOL("256M", "16M"));
  return 0;
}

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  return 0;
}

static void configure(void) {
  const char *names[1] = {"default"};
  assert_int_equal(gpupool_torch_alloc_configure(D.sock, names, 1), 0);
}

static uint64_t requests(void) {
  gpupool_daemon_stats ds;
  th_stats(&D, &ds, NULL);
  return ds.requests;
}

static uint64_t stat_of(int i) {
  uint64_t v[9];
  assert_int_equal(gpupool_torch_alloc_stats(v, 9), 9);
  return v[i];
}
enum {
  ST_ALLOCS, ST_FREES, ST_LIVE, ST_SEGS, ST_SEG_BYTES, ST_DAEMON_ALLOCS, ST_DAEMON_RELEASES, ST_IDLE, ST_PARKED
};

static void *alloc_ok(size_t size, void *stream) {
  void *p = gpupool_torch_alloc(size, 0, stream);
  if (!p)
    fail_msg("alloc of %zu: %s", size, gpupool_torch_alloc_last_error());
  return p;
}

/* Everything freed and the cache given back: the daemon holds nothing of ours. */
static void all_back(void) {
  assert_int_equal(stat_of(ST_LIVE), 0);
  (void)gpupool_torch_alloc_empty_cache();
  assert_int_equal(stat_of(ST_SEGS), 0);
  assert_int_equal(stat_of(ST_SEG_BYTES), 0);
  th_wait_idle(&D, 3000);
}

/* First, while this process has no connection of the allocator's: a child that allocates,
 * frees some (kept in its cache) and exits with the rest live leaves nothing behind. */
static void test_exit_leaks_nothing(void **state) {
  pid_t pid;
  int st;
  (void)state;
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    void *p[6];
    configure();
    for (int i = 0; i < 6; i++)
      if (!(p[i] = gpupool_torch_alloc((size_t)(i + 1) * 300000, 0, S1)))
        _exit(2);
    gpupool_torch_free(p[1], 0, 0, S1);
    gpupool_torch_free(p[4], 0, 0, S1);
    _exit(stat_of(ST_SEGS) > 0 ? 0 : 3);
  }
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
  th_wait_idle(&D, 5000);
}

static void test_reuse_without_round_trips(void **state) {
  static const size_t sizes[] = {4096, MIB, 64 * MIB};
  (void)state;
  configure();
  for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
    uint64_t r0, r1, r2, made;
    unsigned char *p = alloc_ok(sizes[k], S1); /* the first makes a segment */
    memset(p, 0x5a, sizes[k]);
    gpupool_torch_free(p, sizes[k], 0, S1);
    made = stat_of(ST_DAEMON_ALLOCS);
    r0 = requests();
    r1 = requests();
    for (int i = 0; i < 1000; i++) {
      unsigned char *q = alloc_ok(sizes[k], S1);
      assert_ptr_equal(q, p); /* the same block, at once, on its stream */
      q[0] = (unsigned char)i;
      q[sizes[k] - 1] = (unsigned char)i;
      gpupool_torch_free(q, sizes[k], 0, S1);
    }
    r2 = requests();
    assert_int_equal(r2 - r1 - (r1 - r0), 0); /* no request to the daemon for 1,000 of them */
    assert_int_equal(stat_of(ST_DAEMON_ALLOCS), made);
  }
  assert_int_equal(stat_of(ST_ALLOCS) - stat_of(ST_FREES), 0);
  all_back();
}

static void test_split_and_merge(void **state) {
  unsigned char *a, *b, *c, *x, *y, *z;
  gpupool_buffer *buf = NULL;
  size_t off, size;
  (void)state;
  configure();
  /* Small pool: rounded to 512 bytes, carved one after another from one 2 MiB segment. */
  a = alloc_ok(1000, S1);
  b = alloc_ok(2000, S1);
  assert_ptr_equal(b, a + 1024);
  assert_int_equal(gpupool_torch_alloc_lookup(b, &buf, &off, &size), 1);
  assert_int_equal(size, 2048);
  assert_int_equal(off, (size_t)(b - a) + (size_t)(a - (unsigned char *)gpupool_buffer_ptr(buf)));
  assert_int_equal(gpupool_buffer_size(buf), SMALL_SEGMENT);
  gpupool_torch_free(a, 1000, 0, S1);
  c = alloc_ok(100, S1);
  assert_ptr_equal(c, a); /* the freed block, split again */
  gpupool_torch_free(c, 100, 0, S1);
  gpupool_torch_free(b, 2000, 0, S1);
  /* All merged back into one block: the whole of it serves 1 MiB, from the same segment. */
  c = alloc_ok(MIB, S1);
  assert_ptr_equal(c, a);
  assert_int_equal(stat_of(ST_SEGS), 1);
  gpupool_torch_free(c, MIB, 0, S1);
  /* Large pool: a 20 MiB segment split while what is left is over 1 MiB. */
  x = alloc_ok(3 * MIB, S1);
  y = alloc_ok(5 * MIB, S1);
  assert_ptr_equal(y, x + 3 * MIB);
  assert_int_equal(stat_of(ST_SEGS), 2);
  z = alloc_ok(11 * MIB + MIB / 2, S1);
  assert_ptr_equal(z, y + 5 * MIB);
  assert_int_equal(gpupool_torch_alloc_lookup(z, &buf, &off, &size), 1);
  assert_int_equal(size, 12 * MIB); /* the 512 KiB left is not worth a block of the large pool */
  gpupool_torch_free(y, 0, 0, S1);
  gpupool_torch_free(x, 0, 0, S1);
  gpupool_torch_free(z, 0, 0, S1);
  x = alloc_ok(19 * MIB, S1); /* merged: the whole segment again, no new one */
  assert_int_equal(stat_of(ST_SEGS), 2);
  assert_int_equal(gpupool_torch_alloc_lookup(x, &buf, &off, &size), 1);
  assert_int_equal(size, 20 * MIB);
  gpupool_torch_free(x, 0, 0, S1);
  /* From 10 MiB on, a segment of its own (when no cached block holds it), rounded to 2 MiB. */
  assert_int_equal(gpupool_torch_alloc_empty_cache(), 2);
  x = alloc_ok(11 * MIB, S1);
  assert_int_equal(gpupool_torch_alloc_lookup(x, &buf, &off, &size), 1);
  assert_int_equal(gpupool_buffer_size(buf), 12 * MIB);
  gpupool_torch_free(x, 0, 0, S1);
  all_back();
}

/* A message's storages looked up in one call say what lookup says of each: the segment's
 * buffer and the block's offset for a block in use that holds the size asked, NULL for a
 * pointer inside a block, one past every block, a freed block, or more bytes than the block
 * has; and only the blocks found are marked shared. */
static void test_lookup_many(void **state) {
  unsigned char *a, *b, *big, *gone;
  gpupool_buffer *buf = NULL, *bufs[7];
  size_t off, size, offs[7];
  (void)state;
  configure();
  a = alloc_ok(1000, S1);
  b = alloc_ok(3000, S1);
  big = alloc_ok(3 * MIB, S1);
  gone = alloc_ok(700, S1);
  gpupool_torch_free(gone, 700, 0, S1);
  const void *ptrs[7] = {a, b, big, a + 16, gone, b, big};
  size_t sizes[7] = {1000, 3000, 3 * MIB, 8, 700, 3072, 3 * MIB + 1};
  assert_int_equal(gpupool_torch_alloc_lookup_many(ptrs, sizes, 7, bufs, offs), 4);
  for (int i = 0; i < 4; i++) {
    int k = i == 3 ? 5 : i;
    assert_int_equal(gpupool_torch_alloc_lookup(ptrs[k], &buf, &off, &size), 1);
    assert_ptr_equal(bufs[k], buf);
    assert_int_equal(offs[k], off);
    assert_true(sizes[k] <= size);
  }
  assert_ptr_equal(bufs[3], NULL); /* inside a block, not its start */
  assert_ptr_equal(bufs[4], NULL); /* freed */
  assert_ptr_equal(bufs[6], NULL); /* one byte more than the block has */
  assert_ptr_equal(bufs[0], bufs[1]); /* the small pool's blocks share a segment */
  assert_ptr_not_equal(bufs[0], bufs[2]);
  assert_int_equal(gpupool_torch_alloc_lookup_many(ptrs, sizes, 0, bufs, offs), 0);
  gpupool_torch_free(a, 1000, 0, S1);
  gpupool_torch_free(b, 3000, 0, S1);
  gpupool_torch_free(big, 3 * MIB, 0, S1);
  all_back();
}

/* Two 1 MiB blocks fill a small segment: so a stream has no free block of its own left. */
static void test_stream_order_with_events(void **state) {
  unsigned char *big, *p, *p2, *q1, *q2, *r;
  fake_ev *e1;
  (void)state;
  configure();
  test_evops = &fake_evops;
  p = alloc_ok(MIB, S1);
  p2 = alloc_ok(MIB, S1);
  big = alloc_ok(3 * MIB, S2); /* a second stream: frees record events from now on */
  gpupool_torch_free(p, MIB, 0, S1);
  e1 = last_ev;
  assert_non_null(e1);
  /* S1's free block is not S2's until the event recorded at the free completed. */
  q1 = alloc_ok(MIB, S2);
  assert_ptr_not_equal(q1, p);
  q2 = alloc_ok(MIB, S2); /* S2's own small segment is full now */
  assert_ptr_not_equal(q2, p);
  e1->done = 1;
  r = alloc_ok(MIB, S2);
  assert_ptr_equal(r, p);
  /* On its own stream a freed block comes back at once, its event not done. */
  gpupool_torch_free(p2, MIB, 0, S1);
  assert_false(last_ev->done);
  assert_ptr_equal(alloc_ok(MIB, S1), p2);
  gpupool_torch_free(p2, MIB, 0, S1);
  gpupool_torch_free(r, MIB, 0, S2);
  gpupool_torch_free(q1, MIB, 0, S2);
  gpupool_torch_free(q2, MIB, 0, S2);
  gpupool_torch_free(big, 0, 0, S2);
  all_back();
  test_evops = NULL;
  devs[0].streams_seen = 0;
}

/* Host memory: nothing to order, a block freed on one stream serves another at once. */
static void test_stream_order_without_events(void **state) {
  unsigned char *p, *p2, *q;
  int recorded = nrecorded;
  (void)state;
  configure();
  p = alloc_ok(MIB, S1);
  p2 = alloc_ok(MIB, S1);
  assert_ptr_not_equal(p2, p);
  gpupool_torch_free(p, MIB, 0, S1);
  q = alloc_ok(MIB, S2);
  assert_ptr_equal(q, p);
  assert_int_equal(nrecorded, recorded); /* no event recorded for host memory */
  gpupool_torch_free(q, MIB, 0, S2);
  gpupool_torch_free(p2, MIB, 0, S1);
  all_back();
}

/* Another process: opens the token it is sent at the offset it is sent, checks the bytes
 * (pattern i * 7) and answers 'k' (or 'x'); on 'c' checks them again, on 'q' lets go. */
static void receiver_child(int in, int out) {
  gpupool_client *c = NULL;
  gpupool_buffer *got = NULL;
  gpupool_token tok;
  size_t off;
  char cmd = 0;
  int ok;
  if (read(in, &tok, sizeof tok) != (ssize_t)sizeof tok || read(in, &off, sizeof off) != (ssize_t)sizeof off ||
      gpupool_client_connect(D.sock, "receiver", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0 ||
      gpupool_buffer_open(c, &tok, 0, NULL, &got) != 0)
    _exit(2);
  do {
    const unsigned char *seen = (const unsigned char *)gpupool_buffer_ptr(got) + off;
    ok = 1;
    for (int i = 0; i < 5000; i++)
      ok &= seen[i] == (unsigned char)(i * 7);
    if (write(out, ok ? "k" : "x", 1) != 1 || read(in, &cmd, 1) != 1)
      _exit(3);
  } while (cmd == 'c');
  gpupool_buffer_release(got, NULL);
  gpupool_client_disconnect(c);
  _exit(0);
}

static void expect_seen(int from) {
  char ch = 0;
  assert_int_equal(read(from, &ch, 1), 1);
  assert_int_equal(ch, 'k'); /* the receiver read the block's bytes */
}

static void test_shared_block(void **state) {
  gpupool_client *r;
  gpupool_buffer *buf = NULL, *got = NULL;
  gpupool_token tok;
  size_t off, size;
  unsigned char *x, *keep, *y;
  uint64_t asked;
  int to[2], from[2], st;
  pid_t pid;
  (void)state;
  configure();
  r = th_connect(&D, "receiver");
  keep = alloc_ok(8192, S1);
  x = alloc_ok(5000, S1);
  for (int i = 0; i < 5000; i++)
    x[i] = (unsigned char)(i * 7);
  assert_int_equal(gpupool_torch_alloc_lookup(x, &buf, &off, &size), 1);
  assert_int_equal(off, (size_t)(x - (unsigned char *)gpupool_buffer_ptr(buf)));
  assert_int_equal(size, 5120);
  assert_int_equal(gpupool_buffer_share_kept(buf, NULL, &tok), 0);
  assert_int_equal(pipe(to), 0);
  assert_int_equal(pipe(from), 0);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0)
    receiver_child(to[0], from[1]);
  assert_int_equal(write(to[1], &tok, sizeof tok), (ssize_t)sizeof tok);
  assert_int_equal(write(to[1], &off, sizeof off), (ssize_t)sizeof off);
  expect_seen(from[0]);
  /* Freed while the receiver holds its segment: parked, never handed out again. */
  gpupool_torch_free(x, 5000, 0, S1);
  assert_int_equal(stat_of(ST_PARKED), 1);
  y = alloc_ok(5000, S1);
  assert_ptr_not_equal(y, x);
  memset(y, 0xee, 5000);
  gpupool_torch_free(y, 5000, 0, S1);
  /* The other block of the segment goes: the buffer is still held, so the segment goes back
   * to the daemon, which keeps it for the receiver. */
  asked = stat_of(ST_IDLE);
  gpupool_torch_free(keep, 8192, 0, S1);
  assert_int_equal(stat_of(ST_PARKED), 0);
  assert_int_equal(stat_of(ST_IDLE), asked + 1);
  y = alloc_ok(5000, S1);
  memset(y, 0xdd, 5000);
  assert_int_equal(write(to[1], "c", 1), 1);
  expect_seen(from[0]); /* the bytes it holds are still the block's */
  gpupool_torch_free(y, 5000, 0, S1);
  assert_int_equal(write(to[1], "q", 1), 1);
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
  close(to[0]);
  close(to[1]);
  close(from[0]);
  close(from[1]);
  /* Shared, and let go of by the receiver before the free: the block is free again. */
  x = alloc_ok(3000, S1);
  assert_int_equal(gpupool_torch_alloc_lookup(x, &buf, &off, &size), 1);
  assert_int_equal(gpupool_buffer_share_kept(buf, NULL, &tok), 0);
  assert_int_equal(gpupool_buffer_open(r, &tok, 0, NULL, &got), 0);
  assert_int_equal(gpupool_buffer_release(got, NULL), 0);
  gpupool_torch_free(x, 3000, 0, S1);
  assert_int_equal(stat_of(ST_PARKED), 0);
  assert_ptr_equal(alloc_ok(3000, S1), x);
  gpupool_torch_free(x, 3000, 0, S1);
  gpupool_client_disconnect(r);
  all_back();
}

static void test_full_pool_gives_the_cache_back(void **state) {
  unsigned char *a, *b;
  uint64_t gone;
  (void)state;
  configure();
  a = alloc_ok(160 * MIB, S1);
  gpupool_torch_free(a, 0, 0, S1); /* kept: 160 of the pool's 256 MiB */
  gone = stat_of(ST_DAEMON_RELEASES);
  b = alloc_ok(180 * MIB, S1);     /* fits only once the cached segment went back */
  assert_int_equal(stat_of(ST_DAEMON_RELEASES), gone + 1);
  memset(b, 1, 180 * MIB);
  /* Too big even with the cache given back: NULL, saying why. */
  assert_null(gpupool_torch_alloc(200 * MIB, 0, S1));
  assert_non_null(strstr(gpupool_torch_alloc_last_error(), "ENOSPC"));
  gpupool_torch_free(b, 0, 0, S1);
  assert_int_equal(gpupool_torch_alloc_empty_cache(), 1);
  all_back();
}

/* Threads allocating, checking and freeing while another gives the cache back: no block is
 * ever handed to two owners, nothing is lost. */
enum { NTHREADS = 3, ROUNDS = 400 };
static volatile int stop_trimming;

static void *churn(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg * 2654435761u;
  unsigned char tag = (unsigned char)(uintptr_t)arg;
  void *stream = (uintptr_t)arg % 2 ? S1 : S2;
  for (int r = 0; r < ROUNDS; r++) {
    unsigned char *p[4];
    size_t n[4];
    for (int i = 0; i < 4; i++) {
      seed = seed * 1103515245u + 12345u;
      n[i] = (seed >> 8) % 4 == 0 ? 1 * MIB + (seed % (3 * MIB)) : 64 + (seed % (200 << 10));
      if (!(p[i] = gpupool_torch_alloc(n[i], 0, stream)))
        return (void *)"allocation failed";
      memset(p[i], tag + i, n[i]);
    }
    for (int i = 0; i < 4; i++) {
      if (p[i][0] != (unsigned char)(tag + i) || p[i][n[i] - 1] != (unsigned char)(tag + i) ||
          p[i][n[i] / 2] != (unsigned char)(tag + i))
        return (void *)"a block was written by another owner";
      gpupool_torch_free(p[i], n[i], 0, stream);
    }
  }
  return NULL;
}

static void *trimmer(void *arg) {
  (void)arg;
  while (!stop_trimming)
    (void)gpupool_torch_alloc_empty_cache();
  return NULL;
}

static void test_threads_and_empty_cache(void **state) {
  pthread_t th[NTHREADS], tr;
  (void)state;
  configure();
  assert_int_equal(pthread_create(&tr, NULL, trimmer, NULL), 0);
  for (uintptr_t i = 0; i < NTHREADS; i++)
    assert_int_equal(pthread_create(&th[i], NULL, churn, (void *)(i + 1)), 0);
  for (int i = 0; i < NTHREADS; i++) {
    void *why;
    assert_int_equal(pthread_join(th[i], &why), 0);
    if (why)
      fail_msg("thread %d: %s (%s)", i, (const char *)why, gpupool_torch_alloc_last_error());
  }
  stop_trimming = 1;
  assert_int_equal(pthread_join(tr, NULL), 0);
  all_back();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_exit_leaks_nothing),
      cmocka_unit_test(test_reuse_without_round_trips),
      cmocka_unit_test(test_split_and_merge),
      cmocka_unit_test(test_lookup_many),
      cmocka_unit_test(test_stream_order_with_events),
      cmocka_unit_test(test_stream_order_without_events),
      cmocka_unit_test(test_shared_block),
      cmocka_unit_test(test_full_pool_gives_the_cache_back),
      cmocka_unit_test(test_threads_and_empty_cache),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
