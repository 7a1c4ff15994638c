/*
 * Host fences without a GPU: the daemon's real server and registry, in process on a libuv
 * loop of their own thread, over a backend that is the host backend plus inter-process events
 * whose completion this test decides (one flag: every event pending, then every event done).
 * Clients are raw sockets. It proves that:
 *   - a Get of a client that says host_fences gets no reply while the buffer's ready event is
 *     pending, and gets it once the event has completed;
 *   - later replies on that connection (Stats, an Allocate naming the slab whose fd only the
 *     held-back Get carries) wait behind it and leave in request order;
 *   - a client without host_fences is answered at once while the event is pending;
 *   - closing a connection with held-back replies gives back their holds and fds (and, under
 *     ASan, leaks and touches nothing freed);
 *   - several connections with several held-back replies each all drain, in order, on
 *     completion;
 *   - held-back replies count against max_queued_bytes_per_client: a client flooding
 *     requests behind one that never completes is dropped and its holds given back.
 * Only CUDA has events otherwise, so tests/gpu (check_fences) is the only other coverage.
 */
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "raw.h"
#include "registry.h"
#include "run_tests.h"
#include "server.h"

/* ---- the backend: host memory, events that complete when the test says so ---------------- */

static atomic_int g_done; /* 0: every event is pending; 1: every event has completed */
static atomic_int g_live; /* events created and not destroyed */

struct gpupool__bevent {
  uint32_t serial;
};

static int fake_event_create(gpupool__backend *be, gpupool__bevent **out, uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE]) {
  static uint32_t serial;
  gpupool__bevent *e = calloc(1, sizeof *e);
  (void)be;
  if (!e)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  e->serial = ++serial;
  memset(handle, 0, GPUPOOL_EVENT_HANDLE_SIZE);
  memcpy(handle, &e->serial, sizeof e->serial);
  atomic_fetch_add(&g_live, 1);
  *out = e;
  return 0;
}

static int fake_event_query(gpupool__bevent *e) {
  (void)e;
  return atomic_load(&g_done);
}

static void fake_event_destroy(gpupool__bevent *e) {
  atomic_fetch_sub(&g_live, 1);
  free(e);
}

/* ---- the daemon, in process ---------------------------------------------------------------- */

static struct {
  char dir[64];
  gpd_config cfg;
  gpupool__backend *be;
  gpupool__backend_ops ops;
  gpd_registry reg;
  gpd_server *srv;
  uv_loop_t loop;
  uv_async_t stop;
  pthread_t thread;
} D;

static void on_stop(uv_async_t *a) {
  gpd_server_stop(D.srv);
  gpd_registry_stop(&D.reg);
  uv_close((uv_handle_t *)a, NULL);
}

static void *serve(void *arg) {
  (void)arg;
  uv_run(&D.loop, UV_RUN_DEFAULT);
  return NULL;
}

static int setup(void **state) {
  (void)state;
  atomic_store(&g_done, 0);
  snprintf(D.dir, sizeof D.dir, "/tmp/gpupool-fence-XXXXXX");
  assert_non_null(mkdtemp(D.dir));
  gpd_config_defaults(&D.cfg);
  snprintf(D.cfg.socket_path, sizeof D.cfg.socket_path, "%s/d.sock", D.dir);
  assert_int_equal(gpd_config_add_pool_spec(&D.cfg, "name=p,kind=host,capacity=64M,slab=4M"), 0);
  assert_int_equal(gpd_config_finish(&D.cfg, &gpupool__backend_host), 0);
  assert_int_equal(gpupool__backend_host.open(&D.be), 0);
  D.ops = *D.be->ops;
  D.ops.has_events = 1;
  D.ops.event_create = fake_event_create;
  D.ops.event_query = fake_event_query;
  D.ops.event_destroy = fake_event_destroy;
  D.be->ops = &D.ops;
  assert_int_equal(uv_loop_init(&D.loop), 0);
  assert_int_equal(gpd_registry_init(&D.reg, &D.loop, &D.cfg, D.be), 0);
  assert_int_equal(gpd_server_start(&D.srv, &D.loop, &D.cfg, &D.reg, -1), 0);
  assert_int_equal(uv_async_init(&D.loop, &D.stop, on_stop), 0);
  assert_int_equal(pthread_create(&D.thread, NULL, serve, NULL), 0);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  atomic_store(&g_done, 1);
  uv_async_send(&D.stop);
  pthread_join(D.thread, NULL);
  gpd_registry_close(&D.reg);
  uv_run(&D.loop, UV_RUN_DEFAULT);
  D.be->ops->close(D.be);
  assert_int_equal(uv_loop_close(&D.loop), 0); /* no handle left behind */
  assert_int_equal(atomic_load(&g_live), 0);   /* every event destroyed */
  unlink(D.cfg.socket_path);
  rmdir(D.dir);
  return 0;
}

/* ---- raw client side ----------------------------------------------------------------------- */

static void send_req(int fd, gpupool__req *r, uint64_t seq, int fences) {
  r->seq = seq;
  r->host_fences = fences;
  assert_int_equal(th_raw_send(fd, r, NULL, 0), 0);
}

static void send_get(int fd, uint64_t seq, int fences) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get g = GPUPOOL__WIRE__GET__INIT;
  g.name = (char *)"w";
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  r.get = &g;
  send_req(fd, &r, seq, fences);
}

static void send_stats(int fd, uint64_t seq, int fences) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  r.stats = &st;
  send_req(fd, &r, seq, fences);
}

static void send_alloc(int fd, uint64_t seq, int fences) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Allocate a = GPUPOOL__WIRE__ALLOCATE__INIT;
  a.pool_name = (char *)"p";
  a.size = 4096;
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  r.allocate = &a;
  send_req(fd, &r, seq, fences);
}

/* The next reply, which must answer seq with body; *nfds (if asked) gets how many fds it
 * carried (closed here). Fails after the socket's receive timeout. */
static gpupool__rep *expect(int fd, uint64_t seq, int body, int *nfds) {
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  if (gpupool__wire_rx_read(&rx, fd) == 1) {
    rep = gpupool__wire_unpack_reply(&rx);
    if (nfds)
      *nfds = rx.nfds;
  }
  gpupool__wire_rx_reset(&rx);
  if (!rep)
    fail_msg("no reply to request %llu", (unsigned long long)seq);
  if (rep->error)
    fail_msg("request %llu failed: %s", (unsigned long long)seq, rep->error->message);
  if (rep->seq != seq || (int)rep->body_case != body)
    fail_msg("expected the reply to request %llu (body %d), got request %llu's (body %d)", (unsigned long long)seq,
             body, (unsigned long long)rep->seq, (int)rep->body_case);
  return rep;
}

static void expect_free(int fd, uint64_t seq, int body) {
  gpupool__wire__reply__free_unpacked(expect(fd, seq, body, NULL), NULL);
}

/* Nothing to read on fd for ms milliseconds. */
static void expect_quiet(int fd, int ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  gpupool__rep *rep;
  if (poll(&p, 1, ms) == 0)
    return;
  rep = th_raw_recv(fd);
  fail_msg("the reply to request %lld (body %d) came while the ready event was pending",
           rep ? (long long)rep->seq : -1LL, rep ? (int)rep->body_case : -1);
}

/* A connection past Hello (its lease fd closed at once: nothing here maps memory). */
static int client(void) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Hello h = GPUPOOL__WIRE__HELLO__INIT;
  gpupool__rep *rep;
  int fd = th_raw_connect(D.cfg.socket_path, 10); /* "eventually" = within 10 s */
  assert_true(fd >= 0);
  h.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  h.client_name = (char *)"fence-test";
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  r.hello = &h;
  send_req(fd, &r, 1, 0);
  rep = expect(fd, 1, GPUPOOL__WIRE__REPLY__BODY_HELLO, NULL);
  assert_true(rep->hello->host_fences);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return fd;
}

/* A producer connection that allocated a buffer (with a ready event) and published it as
 * "w": while events are pending, neither reply is held back (it did not ask). */
static int producer(uint64_t *slab) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Publish p = GPUPOOL__WIRE__PUBLISH__INIT;
  gpupool__rep *rep;
  int fd = client();
  send_alloc(fd, 2, 0);
  rep = expect(fd, 2, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE, NULL);
  assert_non_null(rep->allocate->buffer->ready); /* the backend has events */
  p.hold_id = rep->allocate->buffer->hold_id;
  if (slab)
    *slab = rep->allocate->buffer->slab->id;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  p.name = (char *)"w";
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
  r.publish = &p;
  send_req(fd, &r, 3, 0);
  expect_free(fd, 3, GPUPOOL__WIRE__REPLY__BODY_PUBLISH);
  return fd;
}

typedef struct {
  uint64_t holds, clients, open_fds;
} counts;

static counts stats(int fd, uint64_t seq) {
  counts n;
  gpupool__rep *rep;
  send_stats(fd, seq, 0);
  rep = expect(fd, seq, GPUPOOL__WIRE__REPLY__BODY_STATS, NULL);
  n.holds = rep->stats->holds;
  n.clients = rep->stats->clients;
  n.open_fds = rep->stats->open_fds;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return n;
}

/* The counts once the daemon has seen a connection close: asked through p (sequence numbers
 * from *seq) until holds and clients, and with_fds the open fds, are back to base, for up
 * to 5 s. The caller checks what they came to. */
static counts settled(int p, uint64_t *seq, counts base, int with_fds) {
  struct timespec ts = {0, 10 * 1000 * 1000};
  counts now = base;
  for (int i = 0; i < 500; i++) {
    now = stats(p, (*seq)++);
    if (now.holds == base.holds && now.clients == base.clients && (!with_fds || now.open_fds == base.open_fds))
      break;
    nanosleep(&ts, NULL);
  }
  return now;
}

/* ---- the checks ---------------------------------------------------------------------------- */

/* (1) and (2): held back until ready, and what follows on that connection waits behind it. */
static void test_held_back_in_order(void **state) {
  uint64_t slab;
  int nfds = -1, p = producer(&slab), c = client();
  gpupool__rep *rep;
  (void)state;

  send_get(c, 10, 1);
  send_stats(c, 11, 1);
  send_alloc(c, 12, 1); /* lands in the Get's slab, whose fd only the Get's reply carries */
  expect_quiet(c, 300);
  atomic_store(&g_done, 1);

  rep = expect(c, 10, GPUPOOL__WIRE__REPLY__BODY_GET, &nfds);
  assert_int_equal(rep->get->buffer->slab->id, slab);
  assert_int_equal(nfds, 1); /* the slab's fd comes with the first reply naming the slab */
  gpupool__wire__reply__free_unpacked(rep, NULL);
  expect_free(c, 11, GPUPOOL__WIRE__REPLY__BODY_STATS);
  rep = expect(c, 12, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE, &nfds);
  assert_int_equal(rep->allocate->buffer->slab->id, slab);
  assert_int_equal(nfds, 0); /* so it must not overtake the Get */
  gpupool__wire__reply__free_unpacked(rep, NULL);
  /* Nothing held back any more: answered at once. */
  send_stats(c, 13, 1);
  expect_free(c, 13, GPUPOOL__WIRE__REPLY__BODY_STATS);
  close(c);
  close(p);
}

/* (3): without host_fences the same Get is answered while the event is pending. */
static void test_plain_client_not_held(void **state) {
  int p = producer(NULL), held = client(), plain = client();
  (void)state;

  send_get(held, 10, 1);
  send_get(plain, 10, 0);
  send_stats(plain, 11, 0);
  expect_free(plain, 10, GPUPOOL__WIRE__REPLY__BODY_GET);
  expect_free(plain, 11, GPUPOOL__WIRE__REPLY__BODY_STATS);
  expect_quiet(held, 200); /* the event is still pending */
  atomic_store(&g_done, 1);
  expect_free(held, 10, GPUPOOL__WIRE__REPLY__BODY_GET);
  close(held);
  close(plain);
  close(p);
}

/* (4): a connection closed with held-back replies gives their holds and fds back. */
static void test_close_while_held(void **state) {
  int p = producer(NULL), c;
  uint64_t seq = 100;
  counts base = stats(p, seq++), now;
  (void)state;

  c = client();
  send_get(c, 10, 1);
  send_get(c, 11, 1);
  send_stats(c, 12, 1);
  expect_quiet(c, 200);
  now = stats(p, seq++);
  assert_int_equal(now.holds, base.holds + 2); /* both gets made holds; their replies wait */
  assert_int_equal(now.clients, base.clients + 1);
  close(c);
  now = settled(p, &seq, base, 1);
  assert_int_equal(now.holds, base.holds);
  assert_int_equal(now.clients, base.clients);
  assert_int_equal(now.open_fds, base.open_fds); /* the parked replies' slab fds are closed */
  /* The daemon goes on serving held-back gets. */
  c = client();
  send_get(c, 10, 1);
  expect_quiet(c, 100);
  atomic_store(&g_done, 1);
  expect_free(c, 10, GPUPOOL__WIRE__REPLY__BODY_GET);
  close(c);
  close(p);
}

/* (5): many held-back replies on several connections, released together. */
static void test_many_connections(void **state) {
  enum { NCONN = 4, NGET = 3 };
  int p = producer(NULL), c[NCONN];
  (void)state;

  for (int i = 0; i < NCONN; i++) {
    c[i] = client();
    for (int j = 0; j < NGET; j++)
      send_get(c[i], 10 + (uint64_t)j, 1);
    send_stats(c[i], 10 + NGET, 1);
  }
  for (int i = 0; i < NCONN; i++)
    expect_quiet(c[i], i ? 20 : 200);
  {
    counts n = stats(p, 100);
    assert_int_equal(n.holds, 1 + NCONN * NGET);
  }
  atomic_store(&g_done, 1);
  for (int i = 0; i < NCONN; i++) {
    for (int j = 0; j < NGET; j++)
      expect_free(c[i], 10 + (uint64_t)j, GPUPOOL__WIRE__REPLY__BODY_GET);
    expect_free(c[i], 10 + NGET, GPUPOOL__WIRE__REPLY__BODY_STATS);
    close(c[i]);
  }
  close(p);
}

/* (6): replies held back count against max_queued_bytes_per_client, as unread ones do: a
 * client that floods requests behind a reply that never comes is dropped, its holds given
 * back, instead of growing the daemon's memory without bound. */
static void test_flood_behind_held_reply(void **state) {
  int p = producer(NULL), c;
  uint64_t seq = 100;
  counts base = stats(p, seq++), now;
  uint8_t b;
  ssize_t n = 1;
  (void)state;

  D.cfg.max_queued_bytes_per_client = 64 * 1024;
  c = client();
  send_get(c, 10, 1);
  for (uint64_t i = 0; i < 4000; i++) { /* ~100 bytes of reply each, all held behind the get */
    gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
    r.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
    r.stats = &st;
    r.seq = 11 + i;
    r.host_fences = 1;
    if (th_raw_send(c, &r, NULL, 0) != 0)
      break; /* dropped meanwhile */
  }
  {
    struct timeval tv = {10, 0};
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  while (n > 0) /* nothing but the end of the connection (the event never completes) */
    if ((n = recv(c, &b, 1, 0)) > 0)
      fail_msg("a reply came while the ready event was pending");
  /* ECONNRESET is the end too: the daemon hung up with some of the flood still unread (it
   * reads a connection's bytes a budget at a time, in its uid's turn). */
  if (n < 0 && errno != ECONNRESET)
    fail_msg("the flooding client was not dropped within 10 s (%s)", strerror(errno));
  now = settled(p, &seq, base, 0);
  assert_int_equal(now.holds, base.holds);
  assert_int_equal(now.clients, base.clients);
  close(c);
  close(p);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  return TS_RUN_TESTS(setup, teardown, test_held_back_in_order, test_plain_client_not_held, test_close_while_held,
                      test_many_connections, test_flood_behind_held_reply);
}
