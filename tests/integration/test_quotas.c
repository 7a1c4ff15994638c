/*
 * What one user may take of what every user shares. Each test attacks the daemon from
 * another uid (nobody, and a second unprivileged uid, when the tests run as root, as CI
 * does) and checks the bound: connections per uid with slots kept for root, waiting requests
 * per client and per uid, a client that keeps sending after a protocol violation, a client
 * that never reads its replies, and the log lines a client can cause.
 */
#include <grp.h>
#include <inttypes.h>
#include <sys/stat.h>
#include <sys/resource.h>

#include "harness.h"
#include "raw.h"

#define OTHER 65533

static th_daemon D;

/* A daemon on a socket every uid can reach, with the given [daemon] lines. */
static void start_with(const char *daemon_lines) {
  th_start_shared(&D, daemon_lines, TH_HOST_POOL("64M", "4M"));
}

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  return 0;
}

static int raw_connect(void) { return th_raw_connect(D.sock, 3); }
static int raw_send(int fd, gpupool__req *req) { return th_raw_send(fd, req, NULL, 0); }
#define raw_recv th_raw_recv

static int send_hello(int fd) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Hello h = GPUPOOL__WIRE__HELLO__INIT;
  h.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  h.client_name = "quota";
  req.seq = 1;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  return raw_send(fd, &req);
}

/* Connect and say Hello: 1 when served, 0 when refused with ELIMIT naming `limit`, -1 else. */
static int try_session(const char *limit, int *fd_out) {
  int fd = raw_connect(), ok = -1;
  gpupool__rep *rep;
  *fd_out = -1;
  if (fd < 0)
    return -1;
  send_hello(fd); /* may fail when the daemon refused and closed at once */
  rep = raw_recv(fd);
  if (rep && rep->body_case == GPUPOOL__WIRE__REPLY__BODY_HELLO) {
    ok = 1;
    *fd_out = fd;
  } else if (rep && rep->error && rep->error->code == GPUPOOL_ELIMIT && strstr(rep->error->message, limit)) {
    ok = 0;
  } else if (rep && rep->error) {
    fprintf(stderr, "unexpected refusal: %s\n", rep->error->message);
  }
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  if (ok != 1)
    close(fd);
  return ok;
}

/* Child: as uid, open `tries` sessions; exit status = how many were served (255 on error).
 * It says it is done on ready_fd, and keeps the served ones open until go_fd closes. */
static int open_sessions(uid_t uid, int tries, const char *limit, int ready_fd, int go_fd) {
  int fds[64], served = 0;
  char b = 1;
  if (th_become(uid) != 0)
    return 255;
  for (int i = 0; i < tries && i < 64; i++) {
    int r = try_session(limit, &fds[served]);
    if (r < 0)
      return 255;
    served += r;
  }
  printf("uid %u: %d of %d sessions served\n", (unsigned)getuid(), served, tries);
  fflush(stdout);
  if (write(ready_fd, &b, 1) != 1 || read(go_fd, &b, 1) < 0)
    return 255;
  return served;
}

/* Start a child that opens sessions as uid; returns when it has finished trying. */
static pid_t spawn_sessions(uid_t uid, int tries, const char *limit, int *release_fd) {
  int go[2], ready[2];
  char b;
  pid_t pid;
  assert_int_equal(pipe(go), 0);
  assert_int_equal(pipe(ready), 0);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(go[1]);
    close(ready[0]);
    _exit(open_sessions(uid, tries, limit, ready[1], go[0]));
  }
  close(go[0]);
  close(ready[1]);
  assert_int_equal(read(ready[0], &b, 1), 1);
  close(ready[0]);
  *release_fd = go[1];
  return pid;
}

static int served_by(pid_t pid, int release_fd) {
  int st;
  char b = 1;
  /* A byte, not EOF: a later child may hold a copy of this pipe's write end. */
  assert_int_equal(write(release_fd, &b, 1), 1);
  close(release_fd);
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_not_equal(WEXITSTATUS(st), 255);
  return WEXITSTATUS(st);
}

/* One uid cannot take every connection: it gets max_clients_per_uid, all users together get
 * max_clients less reserved_clients, and root still gets in. */
static void test_connections_per_uid_and_reserved(void **state) {
  int r1, r2;
  pid_t a, b;
  gpupool_client *root;
  (void)state;
  if (getuid() != 0)
    skip();
  start_with("max_clients = 12\nreserved_clients = 4\nmax_clients_per_uid = 5\n");
  a = spawn_sessions(NOBODY, 8, "max_clients_per_uid", &r1);
  b = spawn_sessions(OTHER, 8, "max_clients", &r2);
  /* Both flooders hold their sessions: root still connects, in a reserved slot. */
  root = th_connect(&D, "operator");
  assert_non_null(root);
  gpupool_client_disconnect(root);
  assert_int_equal(served_by(a, r1), 5);
  assert_int_equal(served_by(b, r2), 3); /* 12 - 4 reserved - 5 of the first uid */
}

static int log_contains(const char *needle) {
  char line[1024];
  int n = 0;
  FILE *f = fopen(D.log, "r");
  assert_non_null(f);
  while (fgets(line, sizeof line, f))
    n += strstr(line, needle) != NULL;
  fclose(f);
  return n;
}

/* A [tenant] of several uids shares one set of limits: its members together get
 * max_clients_per_uid connections, not each of them. */
static void test_tenant_shares_its_limits(void **state) {
  int r1, r2;
  pid_t a, b;
  (void)state;
  if (getuid() != 0)
    skip();
  start_with("max_clients_per_uid = 5\n[tenant team]\nuids = 65534, 65533\n");
  a = spawn_sessions(NOBODY, 8, "max_clients_per_uid", &r1);
  b = spawn_sessions(OTHER, 8, "max_clients_per_uid", &r2);
  assert_int_equal(served_by(a, r1), 5);
  assert_int_equal(served_by(b, r2), 0);
  assert_true(log_contains("tenant:team already has 5 connections") >= 1);
}

/* Waiting requests are bounded per client and per uid; the refused ones get ELIMIT at once. */
static int waiter_child(const th_daemon *d, int arg) {
  int fd1, fd2, limited = 0;
  (void)d;
  (void)arg;
  if (th_become(NOBODY) != 0)
    return 2;
  CHILD_CHECK(try_session("-", &fd1) == 1, "session 1");
  CHILD_CHECK(try_session("-", &fd2) == 1, "session 2");
  /* fd1: 4 wait, 2 are refused (per client). fd2: the uid has 4 waiting of its 6, so 2 more
   * wait and 1 is refused (per uid). */
  for (int i = 0; i < 9; i++) {
    gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Get g = GPUPOOL__WIRE__GET__INIT;
    char name[32];
    int fd = i < 6 ? fd1 : fd2;
    snprintf(name, sizeof name, "never-%d", i);
    g.name = name;
    g.timeout_ms = 60000;
    req.seq = 100 + (uint64_t)i;
    req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
    req.get = &g;
    CHILD_CHECK(raw_send(fd, &req) == 0, "send get %d", i);
    if (i == 5 || i == 8) {
      const char *which = i == 5 ? "max_waiters_per_client" : "max_waiters_per_uid";
      for (int k = 0; k < (i == 5 ? 2 : 1); k++) {
        gpupool__rep *rep = raw_recv(fd);
        CHILD_CHECK(rep && rep->error && rep->error->code == GPUPOOL_ELIMIT && strstr(rep->error->message, which),
                    "expected ELIMIT naming %s, got %s", which,
                    rep && rep->error ? rep->error->message : "no error");
        gpupool__wire__reply__free_unpacked(rep, NULL);
        limited++;
      }
    }
  }
  printf("waiters refused: %d\n", limited);
  close(fd1);
  close(fd2);
  return 0;
}

static void test_waiters_bounded(void **state) {
  gpupool_client *c;
  gpupool_buffer *b;
  (void)state;
  start_with("max_waiters_per_client = 4\nmax_waiters_per_uid = 6\n");
  th_wait_ok(th_spawn(&D, waiter_child, 0), "waiter flood");
  /* Another client is served, and the flood's waiters went with its connections. */
  c = th_connect(&D, "other");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

/* After a protocol violation the daemon reads nothing more from that client, and hangs up
 * within about a second even if the client never reads the error. */
static int violator_child(const th_daemon *d, int arg) {
  int fd;
  uint8_t junk[65536];
  uint64_t sent = 0, t0;
  (void)d;
  (void)arg;
  if (th_become(NOBODY) != 0)
    return 2;
  CHILD_CHECK(try_session("-", &fd) == 1, "session");
  /* Replies it does not read pile up in the daemon's queue first... */
  for (int i = 0; i < 4000; i++)
    CHILD_CHECK(th_raw_send_stats(fd, 10 + (uint64_t)i, NULL, 0) == 0, "stats %d", i);
  /* ...then a frame that is not a Request: 4 bytes of 0xff, an invalid protobuf tag. */
  memset(junk, 0xff, sizeof junk);
  junk[0] = 4;
  junk[1] = junk[2] = junk[3] = 0;
  CHILD_CHECK(write(fd, junk, 8) == 8, "malformed frame");
  /* Keep sending, never read: the daemon must stop reading and hang up. */
  fcntl(fd, F_SETFL, O_NONBLOCK);
  memset(junk, 0xff, sizeof junk);
  t0 = th_now_ms();
  while (th_now_ms() - t0 < 5000 && sent < (256u << 20)) {
    ssize_t n = send(fd, junk, sizeof junk, MSG_NOSIGNAL);
    if (n > 0) {
      sent += (uint64_t)n;
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) {
      printf("violator: hung up after %" PRIu64 " ms, %" PRIu64 " bytes sent\n", th_now_ms() - t0, sent);
      /* What went in is what the socket buffers hold, not what the daemon read. */
      CHILD_CHECK(sent < (16u << 20), "the daemon took %" PRIu64 " bytes after the violation", sent);
      close(fd);
      return 0;
    }
    th_sleep_ms(5);
  }
  fprintf(stderr, "violator: daemon still took input after %" PRIu64 " ms (%" PRIu64 " bytes)\n",
          th_now_ms() - t0, sent);
  return 1;
}

static void test_violation_stops_reading(void **state) {
  (void)state;
  start_with("");
  th_wait_ok(th_spawn(&D, violator_child, 0), "violating client");
}

/* A client that pipelines requests and never reads its replies is dropped once they hold
 * max_queued_bytes_per_client in the daemon. */
static int slow_reader_child(const th_daemon *d, int arg) {
  int fd, got = 0;
  gpupool__rep *rep;
  (void)d;
  (void)arg;
  if (th_become(NOBODY) != 0)
    return 2;
  CHILD_CHECK(try_session("-", &fd) == 1, "session");
  for (int i = 0; i < 20000; i++)
    if (th_raw_send_stats(fd, 10 + (uint64_t)i, NULL, 0) != 0)
      break; /* dropped while sending */
  th_sleep_ms(200);
  while ((rep = raw_recv(fd)) != NULL) {
    gpupool__wire__reply__free_unpacked(rep, NULL);
    got++;
  }
  printf("slow reader: %d of 20000 replies before the hang-up\n", got);
  CHILD_CHECK(got < 20000, "all 20000 replies arrived: the client was never dropped");
  close(fd);
  return 0;
}


static void test_slow_reader_dropped(void **state) {
  (void)state;
  start_with("max_queued_bytes_per_client = 256K\n");
  th_wait_ok(th_spawn(&D, slow_reader_child, 0), "slow reader");
  assert_true(log_contains("does not read its replies") >= 1);
}

/* Refused requests are logged at most 10 times per 10 s per client; the rest are counted. */
static int refusal_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_member_spec m = {.name = "x", .size = 4096};
  gpupool_bundle *bu;
  (void)arg;
  if (th_become(NOBODY) != 0)
    return 2;
  CHILD_CHECK(gpupool_client_connect(d->sock, "refused", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  /* Refused by the daemon (the library lets it through): an alignment that is not a power
   * of two. */
  for (int i = 0; i < 2000; i++)
    CHILD_CHECK(gpupool_bundle_alloc(c, NULL, &m, 1, 3, 0, NULL, &bu) == GPUPOOL_EINVAL, "alloc %d", i);
  gpupool_client_disconnect(c);
  return 0;
}

static void test_refusals_rate_limited(void **state) {
  (void)state;
  start_with("");
  th_wait_ok(th_spawn(&D, refusal_child, 0), "refusal flood");
  th_wait_idle(&D, 2000);
  assert_true(log_contains("refused EINVAL") <= 10);
  assert_int_equal(log_contains("more lines were not logged"), 1);
}

/* Names and holds are bounded per uid (names outlive their publisher, so without a bound one
 * uid could fill the daemon's table for good) and holds per client. */
static int names_holds_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b, *o;
  gpupool_token tok;
  int published = 0, opened = 0, rc;
  (void)arg;
  if (th_become(NOBODY) != 0)
    return 2;
  CHILD_CHECK(gpupool_client_connect(d->sock, "squatter", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b) == 0, "alloc");
  for (int i = 0; i < 100; i++) {
    char name[32];
    snprintf(name, sizeof name, "squat/%d", i);
    rc = gpupool_buffer_publish(b, name, NULL, NULL, NULL);
    if (rc == GPUPOOL_ELIMIT) {
      break;
    }
    CHILD_CHECK(rc == 0, "publish %d", i);
    published++;
  }
  CHILD_CHECK(published == 20, "published %d names, expected the limit of 20", published);
  CHILD_CHECK(gpupool_buffer_share(b, NULL, &tok) == 0, "share");
  for (int i = 0; i < 100; i++) {
    rc = gpupool_buffer_open(c, &tok, 0, NULL, &o);
    if (rc == GPUPOOL_ELIMIT)
      break;
    CHILD_CHECK(rc == 0, "open %d", i);
    opened++;
  }
  CHILD_CHECK(opened == 29, "opened %d holds, expected 29 (30 with the owner's)", opened);
  printf("squatter: %d names, %d extra holds, then ELIMIT\n", published, opened);
  gpupool_client_disconnect(c);
  return 0;
}

static void test_names_and_holds_bounded(void **state) {
  gpupool_client *c;
  gpupool_buffer *b;
  (void)state;
  start_with("max_names_per_uid = 20\nmax_holds_per_client = 30\n");
  th_wait_ok(th_spawn(&D, names_holds_child, 0), "name and hold flood");
  /* (This binary links its own copy of the error module, so the reasons are read from the
   * daemon's log rather than gpupool_last_error().) */
  assert_true(log_contains("(max_names_per_uid) is 20") >= 1);
  assert_true(log_contains("(max_holds_per_client) is 30") >= 1);
  /* The squatter's names outlive it, but root still publishes. */
  c = th_connect(&D, "root");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_publish(b, "root/name", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

/* Waiting allocations queue per owner: one user's request that cannot fit (here: one that
 * waits forever for the whole pool) holds up its own later requests, never another user's. */
static int big_waiter_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b;
  (void)arg;
  if (th_become(NOBODY) != 0)
    return 2;
  CHILD_CHECK(gpupool_client_connect(d->sock, "big", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 32u << 20, -1, NULL, &b) == 0, "alloc (waits until killed)");
  return 0;
}

static int small_waiter_child(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *b;
  (void)arg;
  CHILD_CHECK(gpupool_client_connect(d->sock, "small", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_buffer_alloc(c, NULL, 4096, -1, NULL, &b) == 0, "alloc");
  gpupool_buffer_release(b, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

static void test_waiting_queue_per_owner(void **state) {
  gpupool_client *c;
  gpupool_buffer *b[4];
  pid_t big, small;
  int st = 0, done = 0;
  (void)state;
  start_with("");
  /* start_with's pool: 64M in 4M slabs. Fill it, one slab per buffer. */
  c = th_connect(&D, "filler");
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 16u << 20, 0, NULL, &b[i]), 0);
  big = th_spawn(&D, big_waiter_child, 0);
  th_sleep_ms(300); /* its request waits first */
  small = th_spawn(&D, small_waiter_child, 0);
  th_sleep_ms(300);
  assert_int_equal(gpupool_buffer_release(b[0], NULL), 0); /* 16M back: not enough for nobody's 32M */
  for (int i = 0; i < 1000 && !done; i++) {
    if (waitpid(small, &st, WNOHANG) == small)
      done = 1;
    else
      th_sleep_ms(10);
  }
  kill(big, SIGKILL);
  waitpid(big, NULL, 0);
  if (!done) {
    kill(small, SIGKILL);
    waitpid(small, NULL, 0);
    fail_msg("another user's waiting allocation held up this one after memory came back");
  }
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  for (int i = 1; i < 4; i++)
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  gpupool_client_disconnect(c);
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_connections_per_uid_and_reserved, test_tenant_shares_its_limits,
                      test_waiters_bounded, test_violation_stops_reading, test_slow_reader_dropped,
                      test_refusals_rate_limited, test_names_and_holds_bounded, test_waiting_queue_per_owner);
}
