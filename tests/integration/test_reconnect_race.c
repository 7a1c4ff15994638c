/*
 * A reply's hold is never released over a connection made after the reply came (fdc1ddb).
 *
 * materialize() lets go of the client's lock while it attaches a pool. If the connection breaks
 * then and another thread of the client reconnects, the reply's hold went with the old daemon;
 * a new daemon numbers its holds from 1 again, so releasing the old id over the new connection
 * can drop a hold the client got there.
 *
 * A scripted fake gpupoold (a thread here, speaking the real framing) plays that out:
 *   conn 1: B gets "y" (left waiting: B reads the socket); A gets "x" -> hold 7 in pool 1, not
 *           attached yet, so A sends AttachPool and waits for B to read the reply. A is parked
 *           there by a signal, and the fake closes conn 1;
 *   conn 2: B reconnects, gets "y" again and receives hold 7 (a real memfd-backed buffer);
 *   then A is let go. Its get must fail with GPUPOOL_ELOST and send no Release: the one
 *   Release{7} conn 2 sees is B's own, at the end.
 * Parking makes it deterministic: left running, A would take the lock as soon as B's reconnect
 * lets go of it for its Hello round trip, before c->reconnects changes (a Release sent then
 * finds a connection with no holds yet, not the case at stake). A is parked by the library's
 * test hook (client/test_hooks.h) right after its AttachPool went out, where it would otherwise
 * wait for B to read the reply.
 */
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <sys/mman.h>

#include "frames.h"
#include "harness.h"
#include "test_hooks.h"
#include "wire.h"

#define HOLD 7
#define SLAB 4096
#define WAIT_S 20

static struct {
  int lfd;
  sem_t y_seen, attach_seen, go_close;
  pthread_mutex_t mu;
  uint64_t released[8]; /* hold ids released on conn 2, in order */
  int nreleased;
  char err[200];
} F = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int gate[2], parked[2];

static void fake_fail(const char *msg) {
  pthread_mutex_lock(&F.mu);
  if (!F.err[0])
    snprintf(F.err, sizeof F.err, "%s", msg);
  pthread_mutex_unlock(&F.mu);
}

static struct timespec deadline(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += WAIT_S;
  return ts;
}

static int sem_wait_s(sem_t *s) {
  struct timespec ts = deadline();
  while (sem_timedwait(s, &ts) != 0)
    if (errno != EINTR)
      return -1;
  return 0;
}

static void fill_pool(Gpupool__Wire__PoolInfo *pi) { ts_host_pool_info(pi, 16 * SLAB); }

static int send_rep(int fd, gpupool__rep *rep, int send_fd) {
  return ts_raw_send_reply(fd, rep, send_fd >= 0 ? &send_fd : NULL, send_fd >= 0 ? 1 : 0) == 0 ? 0 : -1;
}

/* A GetReply naming hold HOLD in slab 1 of pool 1; with a sealed memfd (and how to map it) when
 * with_slab, else none (the client then never gets past attaching the pool). */
static int reply_get(int fd, uint64_t seq, int with_slab) {
  gpupool__rep rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__GetReply gr = GPUPOOL__WIRE__GET_REPLY__INIT;
  Gpupool__Wire__BufferDesc d = GPUPOOL__WIRE__BUFFER_DESC__INIT;
  Gpupool__Wire__SlabRef sr = GPUPOOL__WIRE__SLAB_REF__INIT;
  uint8_t exp[16] = {0}; /* host export data: offset 0, then size, each 8 bytes little-endian */
  int mfd = -1, rc;
  sr.id = 1;
  sr.pool_id = 1;
  sr.size = SLAB;
  if (with_slab) {
    mfd = memfd_create("fake-slab", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (mfd < 0 || ftruncate(mfd, SLAB) != 0 || fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
      fake_fail("fake: cannot make a sealed memfd");
      return -1;
    }
    for (int i = 0; i < 8; i++)
      exp[8 + i] = (uint8_t)((uint64_t)SLAB >> (8 * i));
    sr.export_data.data = exp;
    sr.export_data.len = sizeof exp;
    sr.fd_attached = 1;
    sr.writable = 1;
  }
  d.buffer_id = with_slab ? 2 : 1;
  d.hold_id = HOLD;
  d.pool_id = 1;
  d.slab = &sr;
  d.size = 100;
  gr.buffer = &d;
  gr.version = 1;
  rep.seq = seq;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET;
  rep.get = &gr;
  rc = send_rep(fd, &rep, mfd);
  if (mfd >= 0)
    close(mfd);
  return rc;
}

/* Serve connection `conn` (1 or 2) until it ends: 0 on EOF, 1 when conn 1 is to be closed now
 * (its script is done), -1 on anything unexpected. */
static int serve(int fd, int conn) {
  for (;;) {
    gpupool__rep rep = GPUPOOL__WIRE__REPLY__INIT;
    Gpupool__Wire__PoolInfo pi;
    Gpupool__Wire__PoolInfo *pis[1] = {&pi};
    Gpupool__Wire__HelloReply hr = GPUPOOL__WIRE__HELLO_REPLY__INIT;
    Gpupool__Wire__AttachPoolReply ar = GPUPOOL__WIRE__ATTACH_POOL_REPLY__INIT;
    Gpupool__Wire__ReleaseReply rr = GPUPOOL__WIRE__RELEASE_REPLY__INIT;
    gpupool__wire_rx rx;
    gpupool__req *req = NULL;
    int rc = -1, r;

    gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_DEFAULT_MAX_FRAME);
    r = gpupool__wire_rx_read(&rx, fd);
    if (r == 1)
      req = gpupool__wire_unpack_request(&rx);
    gpupool__wire_rx_reset(&rx);
    if (!req) {
      if (r == GPUPOOL_ECLOSED && conn == 2)
        return 0;
      fake_fail(r == 1 ? "fake: malformed request" : "fake: connection ended or timed out too early");
      return -1;
    }
    fill_pool(&pi);
    rep.seq = req->seq;
    switch (req->body_case) {
    case GPUPOOL__WIRE__REQUEST__BODY_HELLO:
      hr.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
      hr.daemon_version = (char *)"fake";
      hr.backend = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST;
      hr.n_pools = 1;
      hr.pools = pis;
      hr.client_id = (uint64_t)conn;
      hr.max_frame = GPUPOOL_WIRE_DEFAULT_MAX_FRAME;
      rep.body_case = GPUPOOL__WIRE__REPLY__BODY_HELLO;
      rep.hello = &hr;
      rc = send_rep(fd, &rep, -1);
      break;
    case GPUPOOL__WIRE__REQUEST__BODY_GET:
      if (conn == 1 && !strcmp(req->get->name, "y")) {
        sem_post(&F.y_seen); /* left waiting: B reads the socket from now on */
        rc = 0;
      } else {
        rc = reply_get(fd, req->seq, conn == 2);
      }
      break;
    case GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL:
      if (conn == 1) {
        sem_post(&F.attach_seen);
        rc = sem_wait_s(&F.go_close) == 0 ? 1 : -1;
        break;
      }
      ar.pool = &pi;
      rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ATTACH_POOL;
      rep.attach_pool = &ar;
      rc = send_rep(fd, &rep, -1);
      break;
    case GPUPOOL__WIRE__REQUEST__BODY_RELEASE:
      pthread_mutex_lock(&F.mu);
      if (conn == 2 && F.nreleased < 8)
        F.released[F.nreleased++] = req->release->hold_id;
      pthread_mutex_unlock(&F.mu);
      rr.freed = 1;
      rep.body_case = GPUPOOL__WIRE__REPLY__BODY_RELEASE;
      rep.release = &rr;
      rc = send_rep(fd, &rep, -1);
      break;
    default:
      fake_fail("fake: unexpected request");
      break;
    }
    gpupool__wire__request__free_unpacked(req, NULL);
    if (rc != 0)
      return rc;
  }
}

static void *fake_daemon(void *arg) {
  struct pollfd p = {.fd = F.lfd, .events = POLLIN};
  struct timeval tv = {WAIT_S, 0};
  (void)arg;
  for (int conn = 1, fd, rc; conn <= 2; conn++) {
    if (poll(&p, 1, WAIT_S * 1000) != 1 || (fd = accept4(F.lfd, NULL, NULL, SOCK_CLOEXEC)) < 0) {
      fake_fail("fake: no connection came");
      return NULL;
    }
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    rc = serve(fd, conn);
    close(fd); /* conn 1: the daemon goes away while A waits for its pool */
    if (rc < 0 || (conn == 1 && rc != 1))
      return NULL;
  }
  return NULL;
}

typedef struct {
  gpupool_client *c;
  const char *name;
  int rc;
  gpupool_buffer *buf;
} getter;

static void *get_thread(void *arg) {
  getter *g = arg;
  g->rc = gpupool_buffer_get(g->c, g->name, 0, -1, 0, NULL, &g->buf, NULL);
  return NULL;
}

/* The first AttachPool is A's, on conn 1 (B's comes on conn 2): its thread is parked, the
 * client's lock released, until a byte comes on gate[0]. */
static atomic_int attach_parked;

static void park_first_attach(gpupool_client *c, const gpupool__req *req) {
  char ch = 1;
  (void)c;
  if (req->body_case != GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL || atomic_exchange(&attach_parked, 1))
    return;
  (void)!write(parked[1], &ch, 1);
  while (read(gate[0], &ch, 1) < 0 && errno == EINTR)
    ;
}

static void join_s(pthread_t t, const char *who) {
  struct timespec ts = deadline();
  if (pthread_timedjoin_np(t, NULL, &ts) != 0)
    fail_msg("%s did not finish in %d s", who, WAIT_S);
}

static void test_no_release_across_reconnect(void **state) {
  char dir[] = "/tmp/gpupool-race-XXXXXX", sock[64];
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  pthread_t fake, ta, tb;
  getter A = {0}, B = {0};
  gpupool_client *c;
  struct pollfd pp;
  char ch = 1;
  (void)state;

  assert_non_null(mkdtemp(dir));
  snprintf(sock, sizeof sock, "%s/gpupoold.sock", dir);
  memcpy(a.sun_path, sock, strlen(sock) + 1);
  F.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(F.lfd >= 0);
  assert_int_equal(bind(F.lfd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(F.lfd, 4), 0);
  sem_init(&F.y_seen, 0, 0);
  sem_init(&F.attach_seen, 0, 0);
  sem_init(&F.go_close, 0, 0);
  assert_int_equal(pipe2(gate, O_CLOEXEC), 0);
  assert_int_equal(pipe2(parked, O_CLOEXEC), 0);
  gpupool__hook_sent = park_first_attach;
  assert_int_equal(pthread_create(&fake, NULL, fake_daemon, NULL), 0);

  assert_int_equal(gpupool_client_connect(sock, "race", GPUPOOL_TIMEOUT_DEFAULT, &c), 0);
  assert_int_equal(gpupool_client_set_reconnect(c, 5000), 0);
  /* B first: its get waits, so B is the thread reading the socket when A's replies come. */
  B.c = A.c = c;
  B.name = "y";
  A.name = "x";
  assert_int_equal(pthread_create(&tb, NULL, get_thread, &B), 0);
  if (sem_wait_s(&F.y_seen) != 0)
    fail_msg("B's get never reached the fake daemon (%s)", F.err);
  assert_int_equal(pthread_create(&ta, NULL, get_thread, &A), 0);
  if (sem_wait_s(&F.attach_seen) != 0)
    fail_msg("A never asked to attach the pool of its hold (%s)", F.err);
  /* A's AttachPool went out: A is parked before waiting for its reply. */
  pp = (struct pollfd){.fd = parked[0], .events = POLLIN};
  assert_int_equal(poll(&pp, 1, WAIT_S * 1000), 1);
  assert_int_equal(read(parked[0], &ch, 1), 1);

  /* The daemon goes away; B reconnects and gets hold HOLD of the new daemon. */
  sem_post(&F.go_close);
  join_s(tb, "B's get across the reconnect");
  if (B.rc != 0)
    fail_msg("B's get across the reconnect failed: %s (%s)", gpupool_err_name(B.rc), F.err);
  assert_non_null(B.buf);
  assert_int_equal(gpupool_client_reconnect_count(c), 1);
  memset(gpupool_buffer_ptr(B.buf), 0x5a, 100);

  /* Now A finds its attach failed, on a connection that is gone. */
  assert_int_equal(write(gate[1], &ch, 1), 1);
  join_s(ta, "A's get");
  pthread_mutex_lock(&F.mu);
  int stray = F.nreleased;
  pthread_mutex_unlock(&F.mu);
  if (stray) /* A waited for its Release's reply: it would be in by now */
    fail_msg("A sent Release{%" PRIu64 "} (its hold of the old daemon) over the new connection, where "
             "that id is B's live buffer; A's get returned %s", F.released[0], gpupool_err_name(A.rc));
  if (A.rc != GPUPOOL_ELOST)
    fail_msg("A's get returned %s, expected GPUPOOL_ELOST", gpupool_err_name(A.rc));
  assert_null(A.buf);

  /* B's own release is the one Release{HOLD} conn 2 sees. */
  assert_int_equal(gpupool_buffer_release(B.buf, NULL), 0);
  gpupool_client_disconnect(c);
  join_s(fake, "the fake daemon");
  if (F.err[0])
    fail_msg("%s", F.err);
  assert_int_equal(F.nreleased, 1);
  assert_int_equal(F.released[0], HOLD);
  close(F.lfd);
  unlink(sock);
  rmdir(dir);
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_no_release_across_reconnect);
}
