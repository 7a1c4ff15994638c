/*
 * Metrics connections under a flood: another user (uid 65534) holds as many connections to the
 * metrics Unix socket and the metrics TCP address as the daemon lets it, never sending and never
 * reading, and opens new ones as soon as any is closed. Root's scrapes on both must be answered.
 */
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "harness.h"

#define HOLD 40 /* per listener: more than all of its slots */

static th_daemon D;
static char msock[320];
static int port;

/* A port nothing listens on now (the daemon binds it right after). */
static int free_port(void) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM, 0), p;
  assert_true(fd >= 0);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  p = ntohs(a.sin_port);
  close(fd);
  return p;
}

/* A connection to the metrics socket or TCP address, or -1. The hog's (hog = 1) has the
 * smallest receive buffer the kernel allows, and gives up connecting after 0.2 s so that a full
 * accept queue cannot hold it past its parent's end. */
static int dial(int tcp, int hog) {
  struct sockaddr_un u = {.sun_family = AF_UNIX};
  struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  struct timeval tv = {0, 200000};
  int fd = socket(tcp ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
  if (fd < 0)
    return -1;
  if (hog) {
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &one, sizeof one); /* the kernel's minimum */
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  in.sin_port = htons((uint16_t)port);
  memcpy(u.sun_path, msock, strlen(msock) + 1);
  if ((tcp ? connect(fd, (struct sockaddr *)&in, sizeof in) : connect(fd, (struct sockaddr *)&u, sizeof u)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* As uid 65534: holds HOLD connections to each listener, replacing every one the daemon
 * closes and every one older than half a second (before the daemon's request timeout would
 * answer it), so that the daemon always has fresh idle connections of this uid. Says so on
 * ready_fd once it holds them; runs until its parent closes the pipe. */
static int hog(const th_daemon *d, int stop_fd, int ready_fd) {
  struct pollfd pf[2 * HOLD + 1];
  uint64_t born[2 * HOLD];
  (void)d;
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  for (int i = 0; i < 2 * HOLD; i++) {
    pf[i].fd = dial(i >= HOLD, 1);
    pf[i].events = POLLRDHUP;
    born[i] = th_now_ms();
  }
  pf[2 * HOLD].fd = stop_fd;
  pf[2 * HOLD].events = POLLIN;
  CHILD_CHECK(write(ready_fd, "r", 1) == 1, "ready");
  for (;;) {
    if (poll(pf, 2 * HOLD + 1, 10) < 0 && errno != EINTR)
      return 1;
    if (pf[2 * HOLD].revents)
      return 0;
    for (int i = 0; i < 2 * HOLD; i++)
      if (pf[i].fd < 0 || (pf[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) || th_now_ms() - born[i] > 500) {
        if (pf[i].fd >= 0)
          close(pf[i].fd);
        pf[i].fd = dial(i >= HOLD, 1);
        born[i] = th_now_ms();
      }
  }
}

/* One scrape: 0 when answered with 200 within 10 s, else -1 and why in buf. */
static int scrape(int tcp, char *why, size_t len) {
  static const char req[] = "GET /metrics HTTP/1.0\r\n\r\n";
  static char buf[1 << 16];
  struct timeval tv = {10, 0};
  size_t got = 0;
  ssize_t n;
  int fd = dial(tcp, 0);
  if (fd < 0) {
    snprintf(why, len, "connect: %s", strerror(errno));
    return -1;
  }
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (send(fd, req, sizeof req - 1, MSG_NOSIGNAL) != (ssize_t)sizeof req - 1) {
    snprintf(why, len, "write: %s", strerror(errno));
    close(fd);
    return -1;
  }
  while (got < sizeof buf - 1 && (n = read(fd, buf + got, sizeof buf - 1 - got)) > 0)
    got += (size_t)n;
  close(fd);
  buf[got] = '\0';
  if (strncmp(buf, "HTTP/1.0 200 OK", 15) != 0 || !strstr(buf, "gpupool_clients ")) {
    snprintf(why, len, "%zu bytes of answer: '%.60s'", got, buf);
    return -1;
  }
  return 0;
}

static void test_root_scrapes_under_flood(void **state) {
  char conf[800], why[256], r;
  int stop[2], ready[2], failed[2] = {0, 0};
  pid_t h;
  (void)state;
  th_prepare_shared(&D);
  snprintf(msock, sizeof msock, "%s/metrics.sock", D.dir);
  port = free_port();
  snprintf(conf, sizeof conf,
           "[daemon]\nsocket_mode = 0666\nmetrics_socket = %s\nmetrics_listen = 127.0.0.1:%d\n"
           "[pool default]\nkind = host\ncapacity = 16M\nslab_size = 4M\n",
           msock, port);
  th_write_conf(&D, conf);
  th_start(&D, 1, NULL);
  assert_int_equal(pipe2(stop, O_CLOEXEC), 0);
  assert_int_equal(pipe2(ready, O_CLOEXEC), 0);
  h = fork();
  assert_true(h >= 0);
  if (h == 0) {
    close(stop[1]);
    close(ready[0]);
    _exit(hog(&D, stop[0], ready[1]));
  }
  close(stop[0]);
  close(ready[1]);
  assert_int_equal(read(ready[0], &r, 1), 1); /* the hog holds what it can */
  close(ready[0]);
  /* Spread over a few seconds, so the hog's connections come and go meanwhile. */
  for (int i = 0; i < 40; i++) {
    th_sleep_ms(50);
    int tcp = i % 2;
    if (scrape(tcp, why, sizeof why) != 0) {
      failed[tcp]++;
      fprintf(stderr, "root's scrape %d on %s: %s\n", i, tcp ? "TCP" : "the Unix socket", why);
    }
  }
  close(stop[1]);
  th_wait_ok(h, "hog");
  if (failed[0] || failed[1]) {
    th_dump_log(&D);
    fail_msg("root's scrapes failed while uid %d held connections: %d of 20 on the Unix socket, %d of 20 on TCP",
             NOBODY, failed[0], failed[1]);
  }
  th_stop(&D);
}

#define BURST 100 /* more than the old accept queue (16), less than any kernel's somaxconn */

/* A non-blocking connect to the metrics socket, as a scraper's event loop makes it: the fd, or
 * -1 with errno (EAGAIN: the socket's accept queue is full). */
static int dial_nonblocking(void) {
  struct sockaddr_un u = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), e;
  if (fd < 0)
    return -1;
  memcpy(u.sun_path, msock, strlen(msock) + 1);
  if (connect(fd, (struct sockaddr *)&u, sizeof u) != 0) {
    e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

/* As uid 65534: BURST connections to the metrics socket at once, kept until its parent closes
 * stop_fd. How many the kernel queued goes to ready_fd. */
static int burst(int stop_fd, int ready_fd) {
  int fds[BURST], n = 0;
  char ch;
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  for (int i = 0; i < BURST; i++)
    if ((fds[n] = dial_nonblocking()) >= 0)
      n++;
  CHILD_CHECK(write(ready_fd, &n, sizeof n) == (ssize_t)sizeof n, "ready");
  (void)read(stop_fd, &ch, 1);
  while (n > 0)
    close(fds[--n]);
  return 0;
}

/* A daemon every uid can reach with a metrics socket (msock) and no TCP listener. */
static void start_with_metrics_socket(void) {
  char conf[800];
  th_prepare_shared(&D);
  snprintf(msock, sizeof msock, "%s/metrics.sock", D.dir);
  snprintf(conf, sizeof conf,
           "[daemon]\nsocket_mode = 0666\nmetrics_socket = %s\n"
           "[pool default]\nkind = host\ncapacity = 16M\nslab_size = 4M\n", msock);
  th_write_conf(&D, conf);
  th_start(&D, 1, NULL);
}

/* While the daemon's loop is busy (here: stopped), another user's burst of connections waits in
 * the metrics socket's accept queue; root's scrape must still get in (its connect is not
 * refused for a full queue) and be answered once the loop runs. */
static void test_root_scrape_after_connect_burst(void **state) {
  char why[256] = "";
  int stop[2], ready[2], queued = 0, fd, connect_errno = 0, answered = 0;
  pid_t b;
  (void)state;
  start_with_metrics_socket();
  /* The clients' socket accepting means the metrics socket is bound too (the daemon binds it
   * first): a scraper started right after the daemon must not find it missing. */
  if (!ts_can_connect(msock))
    fail_msg("the clients' socket accepts but the metrics socket %s does not (%s)", msock, strerror(errno));
  assert_int_equal(pipe2(stop, O_CLOEXEC), 0);
  assert_int_equal(pipe2(ready, O_CLOEXEC), 0);
  assert_int_equal(kill(D.pid, SIGSTOP), 0);
  b = fork();
  assert_true(b >= 0);
  if (b == 0) {
    close(stop[1]);
    close(ready[0]);
    _exit(burst(stop[0], ready[1]));
  }
  close(stop[0]);
  close(ready[1]);
  if (read(ready[0], &queued, sizeof queued) != (ssize_t)sizeof queued)
    queued = -1;
  close(ready[0]);
  fd = dial_nonblocking();
  connect_errno = fd < 0 ? errno : 0;
  assert_int_equal(kill(D.pid, SIGCONT), 0);
  if (fd >= 0) {
    /* Blocking from here: the answer comes once the loop has worked through the queue. */
    static const char req[] = "GET /metrics HTTP/1.0\r\n\r\n";
    static char buf[1 << 16];
    struct timeval tv = {10, 0};
    size_t got = 0;
    ssize_t n;
    assert_int_equal(fcntl(fd, F_SETFL, 0), 0);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (send(fd, req, sizeof req - 1, MSG_NOSIGNAL) == (ssize_t)sizeof req - 1)
      while (got < sizeof buf - 1 && (n = read(fd, buf + got, sizeof buf - 1 - got)) > 0)
        got += (size_t)n;
    buf[got] = '\0';
    answered = !strncmp(buf, "HTTP/1.0 200 OK", 15) && strstr(buf, "gpupool_clients ");
    snprintf(why, sizeof why, "%zu bytes of answer: '%.60s'", got, buf);
    close(fd);
  }
  close(stop[1]);
  th_wait_ok(b, "burst");
  if (fd < 0)
    fail_msg("root's connect to the metrics socket failed (%s) with %d connections of uid %d queued",
             strerror(connect_errno), queued, NOBODY);
  if (!answered) {
    th_dump_log(&D);
    fail_msg("root's scrape after uid %d's burst was not answered: %s", NOBODY, why);
  }
  assert_int_equal(queued, BURST);
  th_stop(&D);
}

#define CHURNERS 4 /* processes reconnecting at once */

/* As uid 65534: connect to the metrics socket and close at once, as fast as it can, until its
 * parent closes stop_fd (each connection the daemon takes is one over the uid's share, or one
 * its peer already closed: refused at once). */
static int churn(int stop_fd) {
  struct pollfd pf = {.fd = stop_fd, .events = POLLIN};
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  for (unsigned n = 0;; n++) {
    if ((n & 63) == 0 && poll(&pf, 1, 0) != 0)
      return 0;
    int fd = dial_nonblocking();
    if (fd >= 0)
      close(fd);
  }
}

/* Processes of another uid reconnecting to the metrics socket as fast as they can: libuv's
 * accept loop takes connections for as long as there are some, so a peer that reconnects as
 * fast as it is refused kept the daemon's one thread in it, and neither a scraper nor any
 * client of the daemon was answered. Every request of root's client and every scrape must be
 * answered meanwhile. */
/* Root's part of the flood test, in a process of its own (so that a daemon that never answers
 * fails the test instead of hanging it): 20 allocations of the daemon's client, a scrape every
 * fifth; what failed, if anything, to out_fd. */
static int root_requests(int out_fd) {
  char why[256] = "";
  gpupool_client *c = th_connect(&D, "root during a flood");
  for (int i = 0; i < 20 && !why[0]; i++) {
    gpupool_buffer *b = NULL;
    int rc = gpupool_buffer_alloc(c, NULL, 4096, 5000, NULL, &b);
    if (rc != 0)
      snprintf(why, sizeof why, "root's allocation %d failed: %s: %s", i, gpupool_err_name(rc), gpupool_last_error());
    else
      gpupool_buffer_release(b, NULL);
    if (!why[0] && i % 5 == 0)
      (void)scrape(0, why, sizeof why);
  }
  gpupool_client_disconnect(c);
  return write(out_fd, why, sizeof why) == (ssize_t)sizeof why ? 0 : 1;
}

static void test_reconnect_flood_starves_nobody(void **state) {
  char why[256] = "";
  int stop[2], res[2], failed = 0;
  pid_t ch[CHURNERS], r;
  (void)state;
  start_with_metrics_socket();
  assert_int_equal(pipe2(stop, O_CLOEXEC), 0);
  assert_int_equal(pipe2(res, O_CLOEXEC), 0);
  for (int i = 0; i < CHURNERS; i++) {
    ch[i] = fork();
    assert_true(ch[i] >= 0);
    if (ch[i] == 0) {
      close(stop[1]);
      _exit(churn(stop[0]));
    }
  }
  close(stop[0]);
  th_sleep_ms(300); /* the flood under way */
  r = fork();
  assert_true(r >= 0);
  if (r == 0) {
    close(stop[1]);
    close(res[0]);
    _exit(root_requests(res[1]));
  }
  close(res[1]);
  {
    struct pollfd pf = {.fd = res[0], .events = POLLIN};
    if (poll(&pf, 1, 60000) != 1 || read(res[0], why, sizeof why) != (ssize_t)sizeof why) {
      snprintf(why, sizeof why, "root's 20 requests and 4 scrapes were not all answered in 60 s");
      kill(r, SIGKILL);
    }
    why[sizeof why - 1] = '\0';
    failed = why[0] != '\0';
  }
  close(res[0]);
  (void)waitpid(r, NULL, 0);
  close(stop[1]);
  for (int i = 0; i < CHURNERS; i++)
    th_wait_ok(ch[i], "churner");
  if (failed) {
    th_dump_log(&D);
    fail_msg("while %d processes of uid %d reconnected to the metrics socket: %s", CHURNERS, NOBODY, why);
  }
  th_stop(&D);
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_root_scrapes_under_flood, test_root_scrape_after_connect_burst,
                      test_reconnect_flood_starves_nobody);
}
