/*
 * End-to-end flows against a real gpupoold (host backend) from real processes: producer and
 * consumers with byte-exact checks, 1 producer + 8 consumers, 32 clients churning, a client
 * SIGKILLed while holding memory, waiting allocations and gets, threads sharing one client,
 * and the holder rules (release exactly once, only one's own holds).
 */
#include <pthread.h>

#include "harness.h"

#define MIB (1u << 20)

static th_daemon D;

static int setup(void **state) {
  *state = &D;
  th_prepare(&D);
  th_start(&D, 0, "--pool", "name=default,kind=host,capacity=256M,slab=8M", NULL);
  return 0;
}

/* ---- producer / consumers ------------------------------------------------------------------ */

#define TENSOR_NAME_LEN 32

/* Tensor i of the run as producer, consumers and cleanup agree on it: its name, written to
 * name, and its size in bytes. */
static uint64_t nth_tensor(int i, char name[TENSOR_NAME_LEN]) {
  snprintf(name, TENSOR_NAME_LEN, "t%d", i);
  return (uint64_t)(i + 1) * 100003;
}

static int producer(const th_daemon *d, int n) {
  gpupool_client *c;
  CHILD_CHECK(gpupool_client_connect(d->sock, "producer", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  for (int i = 0; i < n; i++) {
    gpupool_buffer *b;
    char name[TENSOR_NAME_LEN];
    uint64_t size = nth_tensor(i, name);
    gpupool_tensor_meta m = {.dtype_code = GPUPOOL_DTYPE_UINT, .dtype_bits = 8, .dtype_lanes = 1, .ndim = 1};
    m.shape[0] = (int64_t)size;
    CHILD_CHECK(gpupool_buffer_alloc(c, NULL, size, 0, NULL, &b) == 0, "alloc %d", i);
    CHILD_CHECK(gpupool_buffer_size(b) == size, "size");
    th_fill(gpupool_buffer_ptr(b), (uint32_t)i, size);
    CHILD_CHECK(gpupool_buffer_publish(b, name, &m, NULL, NULL) == 0, "publish %s", name);
    CHILD_CHECK(gpupool_buffer_release(b, NULL) == 0, "release");
  }
  gpupool_client_disconnect(c);
  return 0;
}

static int consumer(const th_daemon *d, int n) {
  gpupool_client *c;
  CHILD_CHECK(gpupool_client_connect(d->sock, "consumer", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  for (int i = 0; i < n; i++) {
    gpupool_buffer *b;
    gpupool_tensor_meta m;
    char name[TENSOR_NAME_LEN];
    uint64_t size = nth_tensor(i, name);
    CHILD_CHECK(gpupool_buffer_get(c, name, 0, 10000, GPUPOOL_READ_ONLY, NULL, &b, NULL) == 0, "get %s", name);
    CHILD_CHECK(gpupool_buffer_size(b) == size, "size %zu != %llu", gpupool_buffer_size(b), (unsigned long long)size);
    CHILD_CHECK(gpupool_buffer_read_only(b), "read-only flag");
    CHILD_CHECK(gpupool_buffer_tensor(b, &m) == 0 && m.ndim == 1 && m.shape[0] == (int64_t)size, "meta");
    CHILD_CHECK(th_check(gpupool_buffer_ptr(b), (uint32_t)i, size), "content of %s", name);
    CHILD_CHECK(gpupool_buffer_release(b, NULL) == 0, "release");
  }
  gpupool_client_disconnect(c);
  return 0;
}

static void unpublish_all(int n) {
  gpupool_client *c = th_connect(&D, "cleanup");
  for (int i = 0; i < n; i++) {
    char name[TENSOR_NAME_LEN];
    nth_tensor(i, name);
    assert_int_equal(gpupool_name_unpublish(c, name), 0);
  }
  gpupool_client_disconnect(c);
}

static void test_producer_consumer(void **state) {
  (void)state;
  /* Consumer first: its gets wait for the producer. */
  pid_t cons = th_spawn(&D, consumer, 6);
  th_sleep_ms(50);
  th_wait_ok(th_spawn(&D, producer, 6), "producer");
  th_wait_ok(cons, "consumer");
  unpublish_all(6);
  th_wait_idle(&D, 2000);
}

static void test_one_producer_eight_consumers(void **state) {
  pid_t cons[8];
  (void)state;
  for (int i = 0; i < 8; i++)
    cons[i] = th_spawn(&D, consumer, 5);
  th_wait_ok(th_spawn(&D, producer, 5), "producer");
  for (int i = 0; i < 8; i++)
    th_wait_ok(cons[i], "consumer");
  unpublish_all(5);
  th_wait_idle(&D, 2000);
}

/* ---- churn ----------------------------------------------------------------------------------- */

static int churner(const th_daemon *d, int seed) {
  gpupool_client *c, *c2;
  uint64_t end = th_now_ms() + 2500;
  unsigned r = (unsigned)seed * 2654435761u;
  long ops = 0;
  CHILD_CHECK(gpupool_client_connect(d->sock, "churn", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_client_connect(d->sock, "churn-2", GPUPOOL_TIMEOUT_DEFAULT, &c2) == 0, "connect 2");
  while (th_now_ms() < end) {
    gpupool_buffer *b, *o;
    gpupool_token tok;
    uint64_t size;
    r = r * 1103515245u + 12345u;
    size = 1 + (r >> 8) % (3 * MIB / 2);
    /* Wait for memory if 32 clients fill the pool at once. */
    CHILD_CHECK(gpupool_buffer_alloc(c, NULL, size, 5000, NULL, &b) == 0, "alloc %llu", (unsigned long long)size);
    memset(gpupool_buffer_ptr(b), seed & 0xff, size);
    CHILD_CHECK(gpupool_buffer_share(b, NULL, &tok) == 0, "share");
    /* Open from a second connection: a different mapping of the same bytes. */
    CHILD_CHECK(gpupool_buffer_open(c2, &tok, 0, NULL, &o) == 0, "open");
    CHILD_CHECK(gpupool_buffer_id(o) == gpupool_buffer_id(b), "same buffer");
    CHILD_CHECK(((uint8_t *)gpupool_buffer_ptr(o))[size - 1] == (uint8_t)(seed & 0xff), "content via open");
    if (r & 1) {
      CHILD_CHECK(gpupool_buffer_release(b, NULL) == 0, "release owner first");
      CHILD_CHECK(gpupool_buffer_release(o, NULL) == 0, "release opener");
    } else {
      CHILD_CHECK(gpupool_buffer_release(o, NULL) == 0, "release opener first");
      CHILD_CHECK(gpupool_buffer_release(b, NULL) == 0, "release owner");
    }
    ops++;
  }
  gpupool_client_disconnect(c2);
  gpupool_client_disconnect(c);
  return ops > 0 ? 0 : 1;
}

static void test_32_clients_churn(void **state) {
  pid_t kids[32];
  gpupool_daemon_stats after;
  uint64_t fds_before = th_settled_fds(&D);
  (void)state;
  for (int i = 0; i < 32; i++)
    kids[i] = th_spawn(&D, churner, i + 1);
  for (int i = 0; i < 32; i++)
    th_wait_ok(kids[i], "churner");
  th_wait_idle(&D, 2000);
  th_expect_fds(&D, fds_before);
  th_stats(&D, &after, NULL);
  assert_int_equal(after.clients, 1); /* the stats connection itself */
}

/* ---- crash: the connection is the lease ------------------------------------------------------ */

static int holder(const th_daemon *d, int wfd) {
  gpupool_client *c;
  gpupool_buffer *b[3];
  CHILD_CHECK(gpupool_client_connect(d->sock, "holder", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  for (int i = 0; i < 3; i++) {
    CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 3 * MIB, 0, NULL, &b[i]) == 0, "alloc");
    memset(gpupool_buffer_ptr(b[i]), 0x5a, 3 * MIB);
  }
  /* Also hold a published buffer through an extra hold: the name must survive the crash. */
  CHILD_CHECK(gpupool_buffer_publish(b[0], "survivor", NULL, NULL, NULL) == 0, "publish");
  CHILD_CHECK(write(wfd, "R", 1) == 1, "signal ready");
  for (;;)
    pause();
}

static void test_sigkill_holder(void **state) {
  gpupool_daemon_stats before, during, after;
  gpupool_pool_stats pb, pd, pa;
  uint64_t fds_before = th_settled_fds(&D);
  gpupool_client *c;
  gpupool_buffer *b;
  int fds[2];
  char ch;
  pid_t pid;
  (void)state;

  th_stats(&D, &before, &pb);
  assert_int_equal(pipe(fds), 0);
  pid = th_spawn(&D, holder, fds[1]);
  assert_int_equal(read(fds[0], &ch, 1), 1);
  th_stats(&D, &during, &pd);
  assert_int_equal(pd.used, pb.used + 9 * MIB);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  close(fds[0]);
  close(fds[1]);
  /* The published buffer lives on through its name, content intact. */
  c = th_connect(&D, "after-crash");
  assert_int_equal(gpupool_buffer_get(c, "survivor", 0, 1000, 0, NULL, &b, NULL), 0);
  assert_true(((uint8_t *)gpupool_buffer_ptr(b))[3 * MIB - 1] == 0x5a);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "survivor"), 0);
  gpupool_client_disconnect(c);
  /* Every byte comes back, and the daemon's fds are back to where they started. */
  th_wait_idle(&D, 3000);
  th_stats(&D, &after, &pa);
  assert_int_equal(pa.used, pb.used);
  (void)after;
  th_expect_fds(&D, fds_before);
}

/* ---- waiting ---------------------------------------------------------------------------------- */

static int late_publisher(const th_daemon *d, int delay_ms) {
  gpupool_client *c;
  gpupool_buffer *b;
  th_sleep_ms(delay_ms);
  CHILD_CHECK(gpupool_client_connect(d->sock, "late", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b) == 0, "alloc");
  th_fill(gpupool_buffer_ptr(b), 77, 4096);
  CHILD_CHECK(gpupool_buffer_publish(b, "late-name", NULL, NULL, NULL) == 0, "publish");
  gpupool_client_disconnect(c); /* releases its hold; the name keeps the buffer */
  return 0;
}

static void test_get_waits_for_publish(void **state) {
  gpupool_client *c = th_connect(&D, "waiter");
  gpupool_buffer *b;
  uint64_t t0;
  int rc;
  pid_t pid;
  (void)state;

  rc = gpupool_buffer_get(c, "late-name", 0, 0, 0, NULL, &b, NULL);
  assert_int_equal(rc, GPUPOOL_ENOENT);
  t0 = th_now_ms();
  rc = gpupool_buffer_get(c, "never-published", 0, 150, 0, NULL, &b, NULL);
  assert_int_equal(rc, GPUPOOL_ETIMEDOUT);
  assert_true(th_now_ms() - t0 >= 140);
  assert_non_null(strstr(gpupool_last_error(), "never-published"));

  pid = th_spawn(&D, late_publisher, 200);
  assert_int_equal(gpupool_buffer_get(c, "late-name", 0, 5000, 0, NULL, &b, NULL), 0);
  assert_true(th_check(gpupool_buffer_ptr(b), 77, 4096));
  th_wait_ok(pid, "late publisher");
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "late-name"), 0);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 2000);
}

static int delayed_release(const th_daemon *d, int hold_ms) {
  gpupool_client *c;
  gpupool_buffer *b;
  CHILD_CHECK(gpupool_client_connect(d->sock, "big", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 200 * MIB, 0, NULL, &b) == 0, "alloc 200M");
  CHILD_CHECK(gpupool_buffer_publish(b, "big-flag", NULL, NULL, NULL) == 0, "publish flag");
  th_sleep_ms(hold_ms);
  CHILD_CHECK(gpupool_name_unpublish(c, "big-flag") == 0, "unpublish");
  CHILD_CHECK(gpupool_buffer_release(b, NULL) == 0, "release");
  gpupool_client_disconnect(c);
  return 0;
}

/* A child running delayed_release(hold_ms), returned once c sees its flag: it holds its
 * memory by then. */
static pid_t spawn_holder(gpupool_client *c, int hold_ms) {
  gpupool_buffer *flag;
  pid_t pid = th_spawn(&D, delayed_release, hold_ms);
  assert_int_equal(gpupool_buffer_get(c, "big-flag", 0, 5000, 0, NULL, &flag, NULL), 0);
  assert_int_equal(gpupool_buffer_release(flag, NULL), 0);
  return pid;
}

static void test_alloc_waits_for_memory(void **state) {
  gpupool_client *c = th_connect(&D, "needy");
  gpupool_buffer *b;
  pid_t pid;
  int rc;
  (void)state;

  pid = spawn_holder(c, 300);
  /* 256M pool, 200M taken: 100M cannot fit now. */
  rc = gpupool_buffer_alloc(c, NULL, 100 * MIB, 0, NULL, &b);
  assert_int_equal(rc, GPUPOOL_ENOSPC);
  assert_non_null(strstr(gpupool_last_error(), "asked for 104857600 bytes"));
  /* With a timeout it waits until the other client lets go. */
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 100 * MIB, 5000, NULL, &b), 0);
  th_wait_ok(pid, "holder");
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  /* A wait that nothing satisfies times out with the sizes in the message. */
  pid = spawn_holder(c, 600);
  rc = gpupool_buffer_alloc(c, NULL, 100 * MIB, 100, NULL, &b);
  assert_int_equal(rc, GPUPOOL_ETIMEDOUT);
  assert_non_null(strstr(gpupool_last_error(), "waiting for memory"));
  th_wait_ok(pid, "holder");
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 2000);
}

/* ---- threads sharing one client --------------------------------------------------------------- */

typedef struct {
  gpupool_client *c;
  int rc;
} thr_arg;

static void *thr_get(void *p) {
  thr_arg *a = p;
  gpupool_buffer *b;
  a->rc = gpupool_buffer_get(a->c, "thread-name", 0, 5000, 0, NULL, &b, NULL);
  if (a->rc == 0)
    a->rc = gpupool_buffer_release(b, NULL);
  if (a->rc != 0)
    fprintf(stderr, "get thread: %s: %s\n", gpupool_err_name(a->rc), gpupool_last_error());
  return NULL;
}

static void *thr_churn(void *p) {
  thr_arg *a = p;
  for (int i = 0; i < 500 && a->rc == 0; i++) {
    gpupool_buffer *b;
    a->rc = gpupool_buffer_alloc(a->c, NULL, 1000 + (size_t)i, 0, NULL, &b);
    if (a->rc == 0) {
      memset(gpupool_buffer_ptr(b), i, 1000);
      a->rc = gpupool_buffer_release(b, NULL);
    }
    if (a->rc != 0)
      fprintf(stderr, "churn thread: %s: %s\n", gpupool_err_name(a->rc), gpupool_last_error());
  }
  return NULL;
}

static void test_threads_share_client(void **state) {
  gpupool_client *c = th_connect(&D, "threads"), *p;
  pthread_t getter, churn[4];
  thr_arg ga = {c, 0}, ca[4];
  gpupool_buffer *b;
  (void)state;

  /* A thread blocked in get() must not hold up the others. */
  assert_int_equal(pthread_create(&getter, NULL, thr_get, &ga), 0);
  for (int i = 0; i < 4; i++) {
    ca[i] = (thr_arg){c, 0};
    assert_int_equal(pthread_create(&churn[i], NULL, thr_churn, &ca[i]), 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(churn[i], NULL);
    assert_int_equal(ca[i].rc, 0);
  }
  p = th_connect(&D, "threads-publisher");
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 64, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_publish(b, "thread-name", NULL, NULL, NULL), 0);
  pthread_join(getter, NULL);
  assert_int_equal(ga.rc, 0);
  assert_int_equal(gpupool_name_unpublish(p, "thread-name"), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(p);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 2000);
}

/* ---- stats ABI ------------------------------------------------------------------------------ */

/* A caller built against an older, smaller gpupool_pool_stats / gpupool_daemon_stats gets
 * exactly its own fields filled: nothing is written past its structs, and its pools array is
 * strided by its size, not the library's. */
static void test_stats_struct_sizes(void **state) {
  gpupool_client *a = th_connect(&D, "abi");
  const size_t dsz = GPUPOOL_STATS_MIN_DAEMON_SIZE, psz = GPUPOOL_STATS_MIN_POOL_SIZE;
  unsigned char dbuf[sizeof(gpupool_daemon_stats) + 64], pbuf[4 * sizeof(gpupool_pool_stats) + 64];
  gpupool_pool_stats first;
  int n = 0;
  (void)state;
  memset(dbuf, 0xA5, sizeof dbuf);
  memset(pbuf, 0xA5, sizeof pbuf);
  assert_int_equal(gpupool_client_stats_sized(a, (gpupool_daemon_stats *)(void *)dbuf, dsz,
                                              (gpupool_pool_stats *)(void *)pbuf, psz, 2, &n), 0);
  assert_true(n >= 1);
  for (size_t i = dsz; i < sizeof dbuf; i++)
    assert_int_equal(dbuf[i], 0xA5);
  for (size_t i = (size_t)n * psz; i < sizeof pbuf; i++)
    assert_int_equal(pbuf[i], 0xA5);
  memcpy(&first, pbuf, psz);
  assert_string_equal(first.name, "default");
  assert_true(first.capacity > 0);
  /* Below the first release's sizes is refused, not guessed at. */
  assert_int_equal(gpupool_client_stats_sized(a, (gpupool_daemon_stats *)(void *)dbuf, dsz - 8, NULL, 0, 0, &n),
                   GPUPOOL_EINVAL);
  gpupool_client_disconnect(a);
}

/* ---- holder rules ----------------------------------------------------------------------------- */

static void test_holder_rules(void **state) {
  gpupool_client *a = th_connect(&D, "a"), *b = th_connect(&D, "b");
  gpupool_buffer *x, *y, *big;
  gpupool_token tok;
  gpupool_pool_stats ps;
  (void)state;

  assert_int_equal(gpupool_buffer_alloc(a, NULL, 5000, 0, NULL, &x), 0);
  memcpy(gpupool_buffer_ptr(x), "hello", 6);
  assert_int_equal(gpupool_buffer_share(x, NULL, &tok), 0);
  assert_int_equal(gpupool_buffer_open(b, &tok, 0, NULL, &y), 0);
  assert_string_equal((char *)gpupool_buffer_ptr(y), "hello");
  /* Owner lets go first: the opener still reads the same bytes. */
  assert_int_equal(gpupool_buffer_release(x, NULL), 0);
  assert_string_equal((char *)gpupool_buffer_ptr(y), "hello");
  th_stats(&D, NULL, &ps);
  assert_true(ps.used >= 5000);
  assert_int_equal(gpupool_buffer_release(y, NULL), 0);
  /* Now the token names a freed buffer. */
  assert_int_equal(gpupool_buffer_open(b, &tok, 0, NULL, &y), GPUPOOL_ENOENT);
  /* A forged token (right id, wrong secret) is refused the same way. */
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 100, 0, NULL, &x), 0);
  assert_int_equal(gpupool_buffer_share(x, NULL, &tok), 0);
  tok.bytes[GPUPOOL_TOKEN_SIZE - 1] ^= 1;
  assert_int_equal(gpupool_buffer_open(b, &tok, 0, NULL, &y), GPUPOOL_ENOENT);
  /* Names: publishing again makes the next version; a long name is refused; unknown names
   * fail. */
  {
    uint64_t v = 0;
    assert_int_equal(gpupool_buffer_publish(x, "dup", NULL, NULL, &v), 0);
    assert_int_equal(v, 1);
    assert_int_equal(gpupool_buffer_publish(x, "dup", NULL, NULL, &v), 0);
    assert_int_equal(v, 2);
  }
  {
    char longname[GPUPOOL_NAME_MAX + 2];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    assert_int_equal(gpupool_buffer_publish(x, longname, NULL, NULL, NULL), GPUPOOL_ENAME);
    longname[GPUPOOL_NAME_MAX] = '\0';
    assert_int_equal(gpupool_buffer_publish(x, longname, NULL, NULL, NULL), 0);
    assert_int_equal(gpupool_name_unpublish(a, longname), 0);
  }
  assert_int_equal(gpupool_name_unpublish(a, "nope"), GPUPOOL_ENOENT);
  /* Bad tensor metadata is refused with a reason. */
  {
    gpupool_tensor_meta m = {.dtype_code = GPUPOOL_DTYPE_FLOAT, .dtype_bits = 32, .dtype_lanes = 1, .ndim = 2};
    m.shape[0] = 10;
    m.shape[1] = 10; /* 400 bytes > 100 */
    assert_int_equal(gpupool_buffer_publish(x, "meta", &m, NULL, NULL), GPUPOOL_EMETA);
    m.shape[0] = -1;
    assert_int_equal(gpupool_buffer_publish(x, "meta", &m, NULL, NULL), GPUPOOL_EMETA);
    m.shape[0] = 5;
    m.shape[1] = 5;
    assert_int_equal(gpupool_buffer_publish(x, "meta", &m, NULL, NULL), 0);
    /* Each name keeps the description it was published with. */
    {
      gpupool_tensor_meta m2 = {.dtype_code = GPUPOOL_DTYPE_UINT, .dtype_bits = 8, .dtype_lanes = 1, .ndim = 1};
      gpupool_tensor_meta got;
      gpupool_buffer *g1, *g2;
      m2.shape[0] = 100;
      assert_int_equal(gpupool_buffer_publish(x, "meta-bytes", &m2, NULL, NULL), 0);
      assert_int_equal(gpupool_buffer_get(b, "meta", 0, 0, 0, NULL, &g1, NULL), 0);
      assert_int_equal(gpupool_buffer_get(b, "meta-bytes", 0, 0, 0, NULL, &g2, NULL), 0);
      assert_int_equal(gpupool_buffer_tensor(g1, &got), 0);
      assert_int_equal(got.ndim, 2);
      assert_int_equal(got.dtype_bits, 32);
      assert_int_equal(gpupool_buffer_tensor(g2, &got), 0);
      assert_int_equal(got.ndim, 1);
      assert_int_equal(got.shape[0], 100);
      assert_int_equal(gpupool_buffer_release(g1, NULL), 0);
      assert_int_equal(gpupool_buffer_release(g2, NULL), 0);
      assert_int_equal(gpupool_name_unpublish(a, "meta-bytes"), 0);
    }
  }
  assert_int_equal(gpupool_buffer_release(x, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(b, "dup"), 0);
  assert_int_equal(gpupool_name_unpublish(b, "meta"), 0);
  /* Zero bytes, more than the pool, more than 4 GiB. */
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 0, 0, NULL, &big), GPUPOOL_EINVAL);
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 512u * MIB, 0, NULL, &big), GPUPOOL_ETOOBIG);
  assert_non_null(strstr(gpupool_last_error(), "capacity"));
  assert_int_equal(gpupool_buffer_alloc(a, NULL, (size_t)5 << 30, 0, NULL, &big), GPUPOOL_ETOOBIG);
  assert_non_null(strstr(gpupool_last_error(), "4 GiB"));
  assert_int_equal(gpupool_buffer_alloc(a, "no-such-pool", 10, 0, NULL, &big), GPUPOOL_ENOENT);
  /* A large allocation gets a dedicated slab and gives it back when released. */
  assert_int_equal(gpupool_buffer_alloc(a, NULL, 20u * MIB, 0, NULL, &big), 0);
  memset(gpupool_buffer_ptr(big), 1, 20u * MIB);
  assert_int_equal(gpupool_buffer_release(big, NULL), 0);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(b);
  th_wait_idle(&D, 2000);
  th_stats(&D, NULL, &ps);
  assert_true(ps.reserved <= 8u * MIB); /* at most the one cached empty slab */
}

int main(void) {
  return TS_RUN_TESTS(setup, th_teardown, test_producer_consumer, test_one_producer_eight_consumers,
                      test_32_clients_churn, test_sigkill_holder, test_get_waits_for_publish,
                      test_alloc_waits_for_memory, test_threads_share_client, test_holder_rules,
                      test_stats_struct_sizes);
}
