/*
 * A fair loop: one client, or one uid, cannot take the daemon's thread from the others.
 * - wake: thousands of parked gets that wait for a version far ahead cost a publish nothing
 *   (the daemon's own count of the waiters a publish looked at, in the Stats reply), those a
 *   publish does reach are answered in the order they came, and root is served meanwhile;
 * - budget: a client that pipelines thousands of requests in one write does not have them all
 *   handled before another client's request that arrived right after them;
 * - uid shares: while uid 65534 floods on eight connections, root's request is the next one
 *   handled once it is read, not one behind each of the flood's connections;
 * - reads in the fair pass: while uid 65534 has big frames waiting in a few sockets and small
 *   requests in many, root's request is read and handled before more than one read budget of
 *   the flood is read (the daemon's count of bytes read, in root's Stats reply);
 * - an idle daemon sleeps: with clients connected, one of them half-way through a frame, it
 *   uses (almost) no CPU.
 */
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "harness.h"
#include "raw.h"

#define NOBODY 65534

static th_daemon D;

/* A daemon on a socket every uid can reach. */
static void start_daemon(void) {
  th_prepare(&D);
  assert_int_equal(chmod(D.dir, 0711), 0);
  th_write_conf(&D, "[daemon]\nsocket_mode = 0666\n[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  th_start(&D, 1, NULL);
}

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  return 0;
}

/* Connect and say Hello: the socket, or -1. */
static int session(const char *name) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Hello h = GPUPOOL__WIRE__HELLO__INIT;
  gpupool__rep *rep;
  int fd = th_raw_connect(D.sock, 20), ok;
  if (fd < 0)
    return -1;
  h.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  h.client_name = (char *)name;
  req.seq = 1;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  if (th_raw_send(fd, &req, NULL, 0) != 0 || !(rep = th_raw_recv(fd))) {
    close(fd);
    return -1;
  }
  ok = rep->body_case == GPUPOOL__WIRE__REPLY__BODY_HELLO;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  if (!ok) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Append req's frame to the buffer *buf of *len bytes: 0 or -1. */
static int append_frame(uint8_t **buf, size_t *len, const gpupool__req *req) {
  uint8_t *f, *n;
  size_t flen;
  if (gpupool__wire_pack_request(req, &f, &flen) != 0)
    return -1;
  if (!(n = realloc(*buf, *len + flen))) {
    free(f);
    return -1;
  }
  memcpy(n + *len, f, flen);
  *buf = n;
  *len += flen;
  free(f);
  return 0;
}

static int write_all(int fd, const uint8_t *buf, size_t len) {
  while (len > 0) {
    ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    buf += n;
    len -= (size_t)n;
  }
  return 0;
}

static int append_get(uint8_t **buf, size_t *len, uint64_t seq, const char *name, uint32_t timeout_ms,
                      uint64_t newer_than) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get g = GPUPOOL__WIRE__GET__INIT;
  g.name = (char *)name;
  g.timeout_ms = timeout_ms;
  g.newer_than = newer_than;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  req.get = &g;
  return append_frame(buf, len, &req);
}

static int append_stats(uint8_t **buf, size_t *len, uint64_t seq) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  return append_frame(buf, len, &req);
}

/* ---- wake-ups proportional to what a publish delivers ------------------------------------- */

#define WAKE_CONNS 4
#define WAKE_PER_CONN 1024 /* the default max_waiters_per_client; 4 x 1024 = max_waiters_per_uid */
#define WAKE_NEAR_EVERY 128 /* on the first connection, every 128th get waits for version 4 only */
#define WAKE_PUBLISHES 64
#define FAR_AHEAD (1ull << 40)

/* Child, as uid 65534: park 4,096 gets of "wake" (a few waiting for version 4, the rest for a
 * version no publish here reaches), then pipeline WAKE_PUBLISHES publishes of it in one write. */
static int wake_child(const th_daemon *d, int ready_fd) {
  int fds[WAKE_CONNS], pub;
  uint8_t *buf = NULL;
  size_t len = 0;
  uint64_t hold_id, near = 0, got_near = 0;
  gpupool__rep *rep;
  char b = 1;
  (void)d;
  if (th_become(NOBODY) != 0)
    return 2;
  for (int i = 0; i < WAKE_CONNS; i++) {
    CHILD_CHECK((fds[i] = session("waiter")) >= 0, "session %d", i);
    len = 0;
    for (uint64_t k = 0; k < WAKE_PER_CONN; k++) {
      int is_near = i == 0 && k % WAKE_NEAR_EVERY == 0;
      near += (uint64_t)is_near;
      CHILD_CHECK(append_get(&buf, &len, 100 + k, "wake", 600000, is_near ? 3 : FAR_AHEAD) == 0, "pack");
    }
    /* Replies come in order: when the Stats reply is in, every get before it is parked. */
    CHILD_CHECK(append_stats(&buf, &len, 99) == 0, "pack");
    CHILD_CHECK(write_all(fds[i], buf, len) == 0, "write the gets of connection %d", i);
    rep = th_raw_recv(fds[i]);
    CHILD_CHECK(rep && rep->seq == 99 && rep->body_case == GPUPOOL__WIRE__REPLY__BODY_STATS,
                "connection %d: expected only the Stats reply, got seq %llu (%s)", i,
                rep ? (unsigned long long)rep->seq : 0ull, rep && rep->error ? rep->error->message : "no error");
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  CHILD_CHECK((pub = session("publisher")) >= 0, "publisher session");
  {
    gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Allocate a = GPUPOOL__WIRE__ALLOCATE__INIT;
    a.size = 4096;
    req.seq = 2;
    req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
    req.allocate = &a;
    CHILD_CHECK(th_raw_send(pub, &req, NULL, 0) == 0, "send allocate");
    rep = th_raw_recv(pub);
    CHILD_CHECK(rep && rep->allocate && rep->allocate->buffer, "allocate: %s",
                rep && rep->error ? rep->error->message : "no reply");
    hold_id = rep->allocate->buffer->hold_id;
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  CHILD_CHECK(write(ready_fd, &b, 1) == 1, "tell the parent");
  len = 0;
  for (uint64_t k = 0; k < WAKE_PUBLISHES; k++) {
    gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Publish p = GPUPOOL__WIRE__PUBLISH__INIT;
    p.hold_id = hold_id;
    p.name = (char *)"wake";
    req.seq = 1000 + k;
    req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
    req.publish = &p;
    CHILD_CHECK(append_frame(&buf, &len, &req) == 0, "pack");
  }
  CHILD_CHECK(write_all(pub, buf, len) == 0, "write the publishes");
  for (uint64_t k = 0; k < WAKE_PUBLISHES; k++) {
    rep = th_raw_recv(pub);
    CHILD_CHECK(rep && rep->seq == 1000 + k && rep->publish && rep->publish->version == k + 1,
                "publish %llu: %s", (unsigned long long)k, rep && rep->error ? rep->error->message : "bad reply");
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  /* The gets that waited for version 4 got it, in the order they were sent. */
  for (uint64_t k = 0; k < WAKE_PER_CONN; k += WAKE_NEAR_EVERY) {
    rep = th_raw_recv(fds[0]);
    CHILD_CHECK(rep && rep->seq == 100 + k && rep->get && rep->get->version == 4,
                "near get %llu: got seq %llu version %llu (%s)", (unsigned long long)k,
                rep ? (unsigned long long)rep->seq : 0ull,
                rep && rep->get ? (unsigned long long)rep->get->version : 0ull,
                rep && rep->error ? rep->error->message : "no error");
    gpupool__wire__reply__free_unpacked(rep, NULL);
    got_near++;
  }
  CHILD_CHECK(got_near == near, "%llu of %llu near gets answered", (unsigned long long)got_near,
              (unsigned long long)near);
  CHILD_CHECK(th_raw_send_stats(pub, 3, NULL, 0) == 0, "send stats");
  rep = th_raw_recv(pub);
  CHILD_CHECK(rep && rep->stats, "stats");
  printf("%d publishes over %d parked gets: the daemon tried %llu waiting gets and answered %llu\n",
         WAKE_PUBLISHES, WAKE_CONNS * WAKE_PER_CONN, (unsigned long long)rep->stats->waiting_gets_tried,
         (unsigned long long)rep->stats->waiting_gets_answered);
  fflush(stdout);
  CHILD_CHECK(rep->stats->waiting_gets_answered == near, "answered %llu, expected %llu",
              (unsigned long long)rep->stats->waiting_gets_answered, (unsigned long long)near);
  /* Work per publish does not scale with the parked waiters: only those served are tried. */
  CHILD_CHECK(rep->stats->waiting_gets_tried <= rep->stats->waiting_gets_answered + 4,
              "publishes tried %llu waiting gets to answer %llu", (unsigned long long)rep->stats->waiting_gets_tried,
              (unsigned long long)rep->stats->waiting_gets_answered);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  free(buf);
  return 0;
}

static void test_wake_amplification(void **state) {
  int ready[2], st;
  char b;
  pid_t pid;
  (void)state;
  start_daemon();
  assert_int_equal(pipe(ready), 0);
  pid = th_spawn(&D, wake_child, ready[1]);
  close(ready[1]);
  assert_int_equal(read(ready[0], &b, 1), 1);
  close(ready[0]);
  /* Root is answered while the publishes run (a generous 10 s each: liveness, not speed). */
  {
    gpupool_client *c = th_connect(&D, "root");
    for (int i = 0; waitpid(pid, &st, WNOHANG) == 0; i++) {
      gpupool_buffer *bf;
      uint64_t t0 = th_now_ms();
      assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &bf), 0);
      assert_int_equal(gpupool_buffer_release(bf, NULL), 0);
      if (th_now_ms() - t0 > 10000)
        fail_msg("root's allocate+release took %llu ms during the publishes", (unsigned long long)(th_now_ms() - t0));
    }
    gpupool_client_disconnect(c);
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    th_dump_log(&D);
    fail_msg("the waiting child failed: status 0x%x", st);
  }
}

/* ---- a budget per connection and loop turn ------------------------------------------------- */

#define FLOOD 2000

static uint64_t stats_requests(gpupool__rep *rep) { return rep && rep->stats ? rep->stats->requests : 0; }

/* The daemon's request trace (GPUPOOL_TRACE) goes into a pipe the test reads: a line per
 * request handled. While the test does not read it, the daemon stops once the pipe is full,
 * in the middle of whatever it was doing: a way to hold it there without any timing. */
typedef struct {
  int fd;
  volatile int stop;
} drainer;

static void *drain(void *arg) {
  drainer *dr = arg;
  char buf[4096];
  while (!dr->stop) {
    struct pollfd p = {dr->fd, POLLIN, 0};
    if (poll(&p, 1, 50) > 0 && read(dr->fd, buf, sizeof buf) == 0)
      break;
  }
  return NULL;
}

/* Start the daemon with its request trace going into a FIFO the test holds (one page of pipe
 * when small_pipe), readable by uid 65534 when shared, and a thread draining the trace until
 * the test stops it (drain_stop) to hold the daemon. Returns the trace's read end. */
static char fifo[320]; /* the trace FIFO of the daemon start_traced started */

static int start_traced(int shared, int small_pipe, drainer *dr, pthread_t *th) {
  int trace;
  th_prepare(&D);
  if (shared) {
    assert_int_equal(chmod(D.dir, 0711), 0);
    th_write_conf(&D, "[daemon]\nsocket_mode = 0666\n[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  } else {
    th_write_conf(&D, "[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  }
  snprintf(fifo, sizeof fifo, "%s/trace", D.dir);
  assert_int_equal(mkfifo(fifo, 0600), 0);
  assert_true((trace = open(fifo, O_RDONLY | O_NONBLOCK | O_CLOEXEC)) >= 0);
  if (small_pipe)
    assert_true(fcntl(trace, F_SETPIPE_SZ, 4096) > 0);
  setenv("GPUPOOL_TRACE", fifo, 1);
  th_start(&D, 1, NULL);
  unsetenv("GPUPOOL_TRACE");
  dr->fd = trace;
  dr->stop = 0;
  assert_int_equal(pthread_create(th, NULL, drain, dr), 0);
  return trace;
}

/* Stop draining: from now on the daemon stops once the trace pipe is full. */
static void drain_stop(drainer *dr, pthread_t th) {
  dr->stop = 1;
  assert_int_equal(pthread_join(th, NULL), 0);
}

/* A daemon started by start_traced, root's session on it, and child (a flooder of uid 65534)
 * started with its go pipe's read end and its done pipe's write end; returns once the child
 * says its sessions are open. The trace is still drained: the caller stops that. */
static pid_t flood_ready(int (*child)(const th_daemon *, int), int *trace, int *victim, int go[2], int done[2],
                         drainer *dr, pthread_t *th) {
  char b;
  pid_t pid;
  *trace = start_traced(1, 1, dr, th);
  assert_true((*victim = session("root")) >= 0);
  assert_int_equal(pipe(go), 0);
  assert_int_equal(pipe(done), 0);
  pid = th_spawn(&D, child, go[0] | done[1] << 16);
  assert_int_equal(read(done[0], &b, 1), 1); /* its sessions are open */
  return pid;
}

/* Read trace lines until one for a request of type body (the Request oneof's field number). */
static void wait_trace_body(int fd, int body) {
  char line[512], tag[32];
  size_t n = 0;
  snprintf(tag, sizeof tag, " daemon-req%d ", body);
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    char ch;
    ssize_t r;
    if (poll(&p, 1, 20000) <= 0)
      fail_msg("no trace line for a request of type %d within 20 s", body);
    if ((r = read(fd, &ch, 1)) <= 0)
      continue;
    if (ch != '\n') {
      if (n < sizeof line - 1)
        line[n++] = ch;
      continue;
    }
    line[n] = '\0';
    n = 0;
    if (strstr(line, tag))
      return;
  }
}

/* One client writes FLOOD gets of a missing name and a Stats in one write. Once the daemon
 * is handling them (held there by the full trace pipe), another client sends a Stats. It must
 * be answered before the first client's last request is handled: the daemon's request counter
 * in the two Stats replies says in which order they were handled. */
static void test_turn_budget(void **state) {
  int flood, victim, trace;
  uint8_t *buf = NULL;
  size_t len = 0;
  uint64_t r_victim, r_flood = 0;
  gpupool__rep *rep;
  drainer dr;
  pthread_t th;
  (void)state;
  trace = start_traced(0, 0, &dr, &th);
  assert_true((flood = session("flood")) >= 0);
  assert_true((victim = session("victim")) >= 0);
  drain_stop(&dr, th);

  for (uint64_t k = 0; k < FLOOD; k++)
    assert_int_equal(append_get(&buf, &len, 10 + k, "absent", 0, 0), 0);
  assert_int_equal(append_stats(&buf, &len, 9), 0);
  assert_true(len < 60000); /* all of it fits in the socket and in one read of the daemon's */
  assert_int_equal(write_all(flood, buf, len), 0);
  /* The daemon has read the flood and handles it; the trace of FLOOD requests is more than the
   * pipe holds, so it cannot finish them before the test reads the pipe again. */
  wait_trace_body(trace, GPUPOOL__WIRE__REQUEST__BODY_GET);
  assert_int_equal(th_raw_send_stats(victim, 5, NULL, 0), 0);
  dr.stop = 0;
  assert_int_equal(pthread_create(&th, NULL, drain, &dr), 0);

  rep = th_raw_recv(victim);
  assert_non_null(rep);
  assert_int_equal(rep->seq, 5);
  r_victim = stats_requests(rep);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  for (uint64_t k = 0; k <= FLOOD; k++) {
    rep = th_raw_recv(flood);
    assert_non_null(rep);
    if (k < FLOOD) {
      assert_int_equal(rep->seq, 10 + k);
      assert_non_null(rep->error);
      assert_int_equal(rep->error->code, GPUPOOL_ENOENT);
    } else {
      assert_int_equal(rep->seq, 9);
      r_flood = stats_requests(rep);
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  drain_stop(&dr, th);
  printf("victim's Stats handled as request %llu, the flood's last as request %llu\n",
         (unsigned long long)r_victim, (unsigned long long)r_flood);
  if (r_victim >= r_flood)
    fail_msg("the victim's request (handled as number %llu) waited for all %d pipelined requests of the other "
             "client (its last handled as number %llu)", (unsigned long long)r_victim, FLOOD + 1,
             (unsigned long long)r_flood);
  free(buf);
  close(flood);
  close(victim);
  /* The daemon keeps writing its trace until it stops: keep reading it until then. */
  dr.stop = 0;
  assert_int_equal(pthread_create(&th, NULL, drain, &dr), 0);
  unlink(fifo);
  th_stop(&D);
  drain_stop(&dr, th);
  close(trace);
}

/* ---- shares per uid ------------------------------------------------------------------------ */

#define SHARE_CONNS 8
#define SHARE_FLOOD 1500

/* Child, as uid 65534: SHARE_CONNS sessions; on the first byte of go_fd each pipelines
 * SHARE_FLOOD gets of a missing name in one write, then a byte goes to done_fd; on the
 * second byte of go_fd it reads every reply. */
static int share_child(const th_daemon *d, int fds) {
  int go_fd = fds & 0xffff, done_fd = fds >> 16, s[SHARE_CONNS];
  uint8_t *buf = NULL;
  size_t len = 0;
  char b = 1;
  (void)d;
  if (th_become(NOBODY) != 0)
    return 2;
  for (int i = 0; i < SHARE_CONNS; i++)
    CHILD_CHECK((s[i] = session("flood")) >= 0, "session %d", i);
  for (uint64_t k = 0; k < SHARE_FLOOD; k++)
    CHILD_CHECK(append_get(&buf, &len, 10 + k, "absent", 0, 0) == 0, "pack");
  CHILD_CHECK(write(done_fd, &b, 1) == 1 && read(go_fd, &b, 1) == 1, "sync");
  for (int i = 0; i < SHARE_CONNS; i++)
    CHILD_CHECK(write_all(s[i], buf, len) == 0, "write the flood of connection %d", i);
  CHILD_CHECK(write(done_fd, &b, 1) == 1 && read(go_fd, &b, 1) == 1, "sync");
  for (int i = 0; i < SHARE_CONNS; i++)
    for (uint64_t k = 0; k < SHARE_FLOOD; k++) {
      gpupool__rep *rep = th_raw_recv(s[i]);
      CHILD_CHECK(rep && rep->seq == 10 + k && rep->error && rep->error->code == GPUPOOL_ENOENT,
                  "connection %d, reply %llu", i, (unsigned long long)k);
      gpupool__wire__reply__free_unpacked(rep, NULL);
    }
  free(buf);
  return 0;
}

/* 1 once pid sleeps in a write to a pipe (its trace pipe is full). */
static int blocked_in_pipe_write(pid_t pid) {
  char path[64], w[128] = "";
  FILE *f;
  snprintf(path, sizeof path, "/proc/%d/wchan", (int)pid);
  if ((f = fopen(path, "r"))) {
    if (!fgets(w, sizeof w, f))
      w[0] = '\0';
    fclose(f);
  }
  return strstr(w, "pipe_write") != NULL;
}

/* One trace line from fd (blocking), without its newline; 0 at end. */
static int trace_line(int fd, char *line, size_t cap) {
  size_t n = 0;
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    char ch;
    ssize_t r;
    if (poll(&p, 1, 20000) <= 0)
      return 0;
    if ((r = read(fd, &ch, 1)) == 0)
      return 0;
    if (r < 0)
      continue;
    if (ch == '\n') {
      line[n] = '\0';
      return 1;
    }
    if (n < cap - 1)
      line[n++] = ch;
  }
}

/* The daemon is held in the middle of uid 65534's flood (its one-page trace pipe is full),
 * with every flood connection and root's request waiting in the sockets. Once it goes on, it
 * finishes the request it was on, polls, and must then handle root's request before any other
 * flood request: root used no loop time lately, the flooding uid all of it. (Taking the ready
 * connections in turn alone would put root's behind one request of each flood connection.) */
static void test_uid_share(void **state) {
  int victim, trace, go[2], done[2], st;
  char line[512], b = 1, *skip;
  int queued = 0;
  uint64_t before = 0;
  pid_t child;
  drainer dr;
  pthread_t th;
  (void)state;
  child = flood_ready(share_child, &trace, &victim, go, done, &dr, &th);
  drain_stop(&dr, th);

  assert_int_equal(write(go[1], &b, 1), 1);
  assert_int_equal(read(done[0], &b, 1), 1); /* the flood is in the sockets */
  for (int i = 0; i < 2000 && !blocked_in_pipe_write(D.pid); i++)
    th_sleep_ms(10);
  if (!blocked_in_pipe_write(D.pid))
    fail_msg("the daemon did not stop on its full trace pipe within 20 s");
  assert_int_equal(th_raw_send_stats(victim, 5, NULL, 0), 0);
  /* What the pipe holds was written before; the first line after it is the request the
   * daemon was on. */
  assert_int_equal(ioctl(trace, FIONREAD, &queued), 0);
  assert_non_null(skip = malloc((size_t)queued + 1));
  for (int got = 0; got < queued;) {
    ssize_t r = read(trace, skip + got, (size_t)(queued - got));
    assert_true(r > 0);
    got += (int)r;
  }
  free(skip);
  for (;;) {
    assert_true(trace_line(trace, line, sizeof line));
    if (strstr(line, " daemon-req19 "))
      break;
    if (strstr(line, " daemon-req17 "))
      before++;
  }
  dr.stop = 0;
  assert_int_equal(pthread_create(&th, NULL, drain, &dr), 0);
  printf("flood requests handled between the held one and root's: %llu\n", (unsigned long long)(before - 1));
  {
    gpupool__rep *rep = th_raw_recv(victim);
    assert_non_null(rep);
    assert_int_equal(rep->seq, 5);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  assert_int_equal(write(go[1], &b, 1), 1);
  assert_int_equal(waitpid(child, &st, 0), child);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    fail_msg("the flooding child failed: status 0x%x", st);
  if (before > 1)
    fail_msg("root's request was handled after %llu more requests of the flooding uid", (unsigned long long)(before - 1));
  close(victim);
  unlink(fifo);
  th_stop(&D);
  drain_stop(&dr, th);
  close(trace);
}

/* ---- reads in the fair pass ---------------------------------------------------------------- */

#define READ_BUDGET (64u << 10) /* the most the daemon reads from one connection per pick */
#define BIG_CONNS 4
#define SMALL_CONNS 32
#define SMALL_NAME 4000 /* bytes of each small connection's request: 32 of them are two budgets */

/* A 1 MiB frame (the default max_frame) of a Get whose name is all of it: what the daemon
 * must take in whole before it can refuse it. */
static uint8_t *big_frame(size_t *len) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get g = GPUPOOL__WIRE__GET__INIT;
  size_t n = GPUPOOL_WIRE_DEFAULT_MAX_FRAME - 64;
  char *name = malloc(n + 1);
  uint8_t *f;
  if (!name)
    return NULL;
  memset(name, 'x', n);
  name[n] = '\0';
  g.name = name;
  req.seq = 7;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  req.get = &g;
  if (gpupool__wire_pack_request(&req, &f, len) != 0)
    f = NULL;
  free(name);
  return f;
}

/* Child, as uid 65534: a holder session, BIG_CONNS and SMALL_CONNS sessions. On the first
 * byte of go_fd the holder pipelines SHARE_FLOOD gets (the daemon handles them until its trace
 * pipe is full); on the second, each big session writes a 1 MiB frame until its socket is
 * full and each small one a Get of a 4,000-byte name; a byte to done_fd after each step; on the third byte of
 * go_fd it hangs up. */
static int read_child(const th_daemon *d, int fds) {
  int go_fd = fds & 0xffff, done_fd = fds >> 16, holder, big[BIG_CONNS], small[SMALL_CONNS];
  uint8_t *buf = NULL, *frame;
  size_t len = 0, flen;
  char b = 1, name[SMALL_NAME + 1];
  (void)d;
  if (th_become(NOBODY) != 0)
    return 2;
  CHILD_CHECK((frame = big_frame(&flen)) != NULL, "pack the big frame");
  CHILD_CHECK((holder = session("holder")) >= 0, "holder session");
  for (int i = 0; i < BIG_CONNS; i++)
    CHILD_CHECK((big[i] = session("big")) >= 0, "big session %d", i);
  for (int i = 0; i < SMALL_CONNS; i++)
    CHILD_CHECK((small[i] = session("small")) >= 0, "small session %d", i);
  for (uint64_t k = 0; k < SHARE_FLOOD; k++)
    CHILD_CHECK(append_get(&buf, &len, 10 + k, "absent", 0, 0) == 0, "pack");
  CHILD_CHECK(write(done_fd, &b, 1) == 1 && read(go_fd, &b, 1) == 1, "sync");
  CHILD_CHECK(write_all(holder, buf, len) == 0, "write the holder's flood");
  CHILD_CHECK(write(done_fd, &b, 1) == 1 && read(go_fd, &b, 1) == 1, "sync");
  for (int i = 0; i < BIG_CONNS; i++) {
    size_t off = 0;
    CHILD_CHECK(fcntl(big[i], F_SETFL, O_NONBLOCK) == 0, "nonblocking");
    for (;;) {
      ssize_t n = send(big[i], frame + off, flen - off, MSG_NOSIGNAL);
      if (n > 0 && (off += (size_t)n) < flen)
        continue;
      CHILD_CHECK(n > 0 || errno == EAGAIN || errno == EINTR, "write a big frame");
      if (n < 0 && errno == EINTR)
        continue;
      break;
    }
  }
  memset(name, 'n', SMALL_NAME);
  name[SMALL_NAME] = '\0';
  for (int i = 0; i < SMALL_CONNS; i++) {
    uint8_t *g = NULL;
    size_t glen = 0;
    CHILD_CHECK(append_get(&g, &glen, 3, name, 0, 0) == 0 && write_all(small[i], g, glen) == 0, "small %d", i);
    free(g);
  }
  CHILD_CHECK(write(done_fd, &b, 1) == 1 && read(go_fd, &b, 1) == 1, "sync");
  free(buf);
  free(frame);
  return 0;
}

static uint64_t stats_bytes_read(int fd, uint64_t seq, uint64_t *requests) {
  gpupool__rep *rep;
  uint64_t n;
  assert_int_equal(th_raw_send_stats(fd, seq, NULL, 0), 0);
  rep = th_raw_recv(fd);
  assert_non_null(rep);
  assert_int_equal(rep->seq, seq);
  assert_non_null(rep->stats);
  n = rep->stats->bytes_read;
  if (requests)
    *requests = rep->stats->requests;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return n;
}

/* The daemon is held in the middle of the holder's flood (its trace pipe is full) while uid
 * 65534 fills four sockets with a big frame each and sends a 4 KB request on 32 more, and root
 * sends a Stats. Root's uid used no loop time lately: its request must be read and handled
 * before the daemon reads more than one read budget of what uid 65534 has waiting (reading
 * every readable socket first would take in a buffer's worth of each big frame, and all 32
 * requests: together twice the budget). */
static void test_read_share(void **state) {
  int victim, trace, go[2], done[2], st;
  char b = 1;
  uint8_t *hbuf = NULL, *sbuf = NULL;
  size_t hlen = 0, slen = 0;
  uint64_t before, after, flood;
  pid_t child;
  drainer dr;
  pthread_t th;
  (void)state;
  child = flood_ready(read_child, &trace, &victim, go, done, &dr, &th);
  before = stats_bytes_read(victim, 4, NULL);
  drain_stop(&dr, th);

  /* What the holder and root send in between, counted out of the total below. */
  for (uint64_t k = 0; k < SHARE_FLOOD; k++)
    assert_int_equal(append_get(&hbuf, &hlen, 10 + k, "absent", 0, 0), 0);
  assert_int_equal(append_stats(&sbuf, &slen, 5), 0);
  assert_int_equal(write(go[1], &b, 1), 1);
  assert_int_equal(read(done[0], &b, 1), 1); /* the holder's flood is in its socket */
  for (int i = 0; i < 2000 && !blocked_in_pipe_write(D.pid); i++)
    th_sleep_ms(10);
  if (!blocked_in_pipe_write(D.pid))
    fail_msg("the daemon did not stop on its full trace pipe within 20 s");
  assert_int_equal(write(go[1], &b, 1), 1);
  assert_int_equal(read(done[0], &b, 1), 1); /* the big frames and small requests wait */
  assert_int_equal(write_all(victim, sbuf, slen), 0);
  dr.stop = 0;
  assert_int_equal(pthread_create(&th, NULL, drain, &dr), 0);
  {
    gpupool__rep *rep = th_raw_recv(victim);
    assert_non_null(rep);
    assert_int_equal(rep->seq, 5);
    assert_non_null(rep->stats);
    after = rep->stats->bytes_read;
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  assert_int_equal(write(go[1], &b, 1), 1);
  assert_int_equal(waitpid(child, &st, 0), child);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    fail_msg("the flooding child failed: status 0x%x", st);
  assert_true(after >= before + slen);
  flood = after - before - slen;
  flood = flood > hlen ? flood - hlen : 0;
  printf("bytes of uid 65534's waiting frames read before root's request was handled: %llu\n",
         (unsigned long long)flood);
  if (flood > READ_BUDGET)
    fail_msg("the daemon read %llu bytes of another uid's waiting frames before handling root's request; at "
             "most one read budget (%u bytes) was expected", (unsigned long long)flood, READ_BUDGET);
  free(hbuf);
  free(sbuf);
  close(victim);
  unlink(fifo);
  th_stop(&D);
  drain_stop(&dr, th);
  close(trace);
}

/* ---- an idle daemon sleeps ------------------------------------------------------------------ */

/* utime + stime of pid, in clock ticks. */
static uint64_t cpu_ticks(pid_t pid) {
  char path[64], buf[1024], *p;
  unsigned long long ut = 0, stt = 0;
  FILE *f;
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  assert_non_null(f = fopen(path, "r"));
  assert_non_null(fgets(buf, sizeof buf, f));
  fclose(f);
  assert_non_null(p = strrchr(buf, ')'));
  /* after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
  assert_int_equal(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &stt), 2);
  return ut + stt;
}

/* Clients connected and quiet, one of them half-way through a frame (its daemon-side
 * connection has bytes buffered and waits for the rest): the daemon must sleep in its poll,
 * not look at them again and again. Less than 5% of a CPU over a second. */
static void test_idle_sleeps(void **state) {
  int idle, partial;
  uint8_t *buf = NULL;
  size_t len = 0;
  uint64_t t0, t1;
  long hz = sysconf(_SC_CLK_TCK);
  (void)state;
  start_daemon();
  assert_true((idle = session("idle")) >= 0);
  assert_true((partial = session("partial")) >= 0);
  assert_int_equal(append_stats(&buf, &len, 3), 0);
  assert_int_equal(write_all(partial, buf, len - 1), 0);
  th_sleep_ms(200);
  t0 = cpu_ticks(D.pid);
  th_sleep_ms(1000);
  t1 = cpu_ticks(D.pid);
  printf("daemon CPU over 1 s idle: %llu ticks of %ld\n", (unsigned long long)(t1 - t0), hz);
  if ((t1 - t0) * 20 > (uint64_t)hz)
    fail_msg("the idle daemon used %llu of %ld clock ticks in 1 s (5%% allowed): it does not sleep in its poll",
             (unsigned long long)(t1 - t0), hz);
  /* The rest of the frame completes it: still answered. */
  assert_int_equal(write_all(partial, buf + len - 1, 1), 0);
  {
    gpupool__rep *rep = th_raw_recv(partial);
    assert_non_null(rep);
    assert_int_equal(rep->seq, 3);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  free(buf);
  close(idle);
  close(partial);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_wake_amplification, teardown),
      cmocka_unit_test(test_turn_budget),
      cmocka_unit_test(test_uid_share),
      cmocka_unit_test(test_read_share),
      cmocka_unit_test_teardown(test_idle_sleeps, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
