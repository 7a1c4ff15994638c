/*
 * Peers under attack: two real gpupoolds on 127.0.0.1 (UCX over TCP on lo). A host without
 * the secret that keeps hundreds of connections open to peer_listen of a daemon with few fds
 * leaves that daemon's local clients served and its peer's fetches working (unauthenticated
 * connections are capped in total and per address, fds are kept in reserve).
 * Links the wire module: reasons come from the logs.
 * Skipped (77) when gpupoold was built without UCX.
 */
#include <arpa/inet.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>

#include "harness.h"

#define SECRET "0123456789abcdef-shared-peer-secret"

typedef struct {
  th_daemon d;
  int port;
  char secret[400];
} node;

static node A, B;

static int free_port(void) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM, 0), port;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_true(fd >= 0);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  port = ntohs(a.sin_port);
  close(fd);
  return port;
}

static void node_prepare(node *n) {
  FILE *f;
  th_prepare(&n->d);
  n->port = free_port();
  snprintf(n->secret, sizeof n->secret, "%s/secret", n->d.dir);
  assert_non_null(f = fopen(n->secret, "w"));
  fputs(SECRET, f);
  fclose(f);
  assert_int_equal(chmod(n->secret, 0600), 0);
}

/* Start n exporting tenant t to peer `peer_name`, which it reaches at peer_port; with the
 * further [daemon] lines `lines` and, when nofile is set, that fd limit. */
static void node_start(node *n, const char *peer_name, int peer_port, const char *lines, rlim_t nofile) {
  char conf[4096];
  struct rlimit old, rl;
  snprintf(conf, sizeof conf,
           "[daemon]\npeer_listen = 127.0.0.1:%d\npeer_secret_file = %s\npeer_fetch_timeout_ms = 20000\n%s"
           "[pool default]\nkind = host\ncapacity = 1G\nslab_size = 64M\n"
           "[tenant t]\nuids = %u\nexport_peers = %s\n[peer %s]\naddress = 127.0.0.1:%d\n",
           n->port, n->secret, lines, (unsigned)getuid(), peer_name, peer_name, peer_port);
  th_write_conf(&n->d, conf);
  assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
  if (nofile) {
    rl = old;
    rl.rlim_cur = nofile;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
  }
  th_start(&n->d, 1, NULL);
  assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
}

static void fill(uint8_t *p, size_t len, uint32_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < len; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    memcpy(p + i, &x, len - i < 8 ? len - i : 8);
  }
}

static int same(const uint8_t *p, size_t len, uint32_t seed) {
  uint8_t *want = malloc(len);
  int eq;
  assert_non_null(want);
  fill(want, len, seed);
  eq = !memcmp(p, want, len);
  free(want);
  return eq;
}

static uint64_t publish(node *n, const char *name, size_t len, uint32_t seed) {
  gpupool_client *c = th_connect(&n->d, "producer");
  gpupool_buffer *b = NULL;
  uint64_t v = 0;
  assert_int_equal(gpupool_buffer_alloc(c, NULL, len, 0, NULL, &b), 0);
  fill(gpupool_buffer_ptr(b), len, seed);
  assert_int_equal(gpupool_buffer_publish(b, name, NULL, NULL, &v), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  return v;
}

/* A get of name on n: its rc; on success the version and whether the bytes are seed's. */
static int get(node *n, const char *name, uint64_t newer_than, uint32_t timeout_ms, size_t len, uint32_t seed,
               uint64_t *version, int *right) {
  gpupool_client *c = th_connect(&n->d, "consumer");
  gpupool_buffer *b = NULL;
  int rc = gpupool_buffer_get(c, name, newer_than, timeout_ms, 0, NULL, &b, version);
  if (rc == 0) {
    *right = gpupool_buffer_size(b) == len && same(gpupool_buffer_ptr(b), len, seed);
    gpupool_buffer_release(b, NULL);
  }
  gpupool_client_disconnect(c);
  return rc;
}

static int log_has(const node *n, const char *needle) {
  FILE *f = fopen(n->d.log, "r");
  char line[4096];
  int found = 0;
  if (!f)
    return 0;
  while (!found && fgets(line, sizeof line, f))
    found = strstr(line, needle) != NULL;
  fclose(f);
  return found;
}

static int skip_without_ucx(void) {
  char cmd[512], out[256] = "";
  FILE *p;
  snprintf(cmd, sizeof cmd, "%s --version", GPUPOOLD_PATH);
  if ((p = popen(cmd, "r"))) {
    while (fgets(out, sizeof out, p))
      if (!strncmp(out, "peers: ", 7))
        break;
    pclose(p);
  }
  if (strncmp(out, "peers: ucx", 10) != 0) {
    fprintf(stderr, "skipped: gpupoold %s", out[0] ? out : "says nothing about peers\n");
    return 1;
  }
  return 0;
}

static void daemon_alive(node *n) {
  if (kill(n->d.pid, 0) != 0 || waitpid(n->d.pid, NULL, WNOHANG) != 0) {
    th_dump_log(&n->d);
    fail_msg("gpupoold died");
  }
}

/* ---- a flood of unauthenticated connections ------------------------------------------------- */

enum { FLOOD = 400, FLOOD_BATCH = 40 };

/* In a child: keep FLOOD connections from 127.0.0.2 (a host without the secret) open to port,
 * opening new ones in place of those the daemon closes, until killed. */
static void flood(int port) {
  static struct pollfd fds[FLOOD];
  struct sockaddr_in to = {.sin_family = AF_INET}, from = {.sin_family = AF_INET};
  struct rlimit rl = {FLOOD + 64, FLOOD + 64};
  setrlimit(RLIMIT_NOFILE, &rl);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, "127.0.0.2", &from.sin_addr);
  for (int i = 0; i < FLOOD; i++)
    fds[i].fd = -1;
  for (;;) {
    int opened = 0;
    for (int i = 0; i < FLOOD && opened < FLOOD_BATCH; i++) {
      int fd;
      if (fds[i].fd >= 0)
        continue;
      if ((fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0)) < 0)
        break;
      if (bind(fd, (struct sockaddr *)&from, sizeof from) != 0 ||
          (connect(fd, (struct sockaddr *)&to, sizeof to) != 0 && errno != EINPROGRESS)) {
        close(fd);
        continue;
      }
      fds[i].fd = fd;
      fds[i].events = POLLIN;
      opened++;
    }
    if (poll(fds, FLOOD, 50) > 0)
      for (int i = 0; i < FLOOD; i++)
        if (fds[i].fd >= 0 && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
          close(fds[i].fd);
          fds[i].fd = -1;
        }
  }
}

/* A daemon with 256 fds and peer_listen, flooded by 400 connections from a host without the
 * secret (closed ones replaced at once): its local clients are served, its peer's fetches
 * work, and it lives on. The total cap is set low (4) so that the peer's connection takes
 * the place of one of the flood's. */
static void test_unauthenticated_flood(void **state) {
  pid_t child;
  uint64_t v = 0;
  int right = 0;
  (void)state;
  node_prepare(&A);
  node_prepare(&B);
  node_start(&A, "B", B.port, "peer_max_unauthenticated = 4\n", 256);
  node_start(&B, "A", A.port, "", 0);
  publish(&A, "weights", 1u << 20, 7);
  if ((child = fork()) == 0) {
    flood(A.port);
    _exit(0);
  }
  th_sleep_ms(1500); /* some 1,000 connections tried: more than the daemon's fds */
  for (int round = 0; round < 5; round++) {
    gpupool_client *c = NULL;
    gpupool_daemon_stats ds;
    gpupool_pool_stats ps[4];
    int n = 0, rc = gpupool_client_connect(A.d.sock, "local", GPUPOOL_TIMEOUT_DEFAULT, &c);
    if (rc != 0) {
      kill(child, SIGKILL);
      waitpid(child, NULL, 0);
      th_dump_log(&A.d);
      fail_msg("round %d: a local client of the flooded daemon was refused: %s", round, gpupool_err_name(rc));
    }
    assert_int_equal(gpupool_client_stats(c, &ds, ps, 4, &n), 0);
    gpupool_client_disconnect(c);
    th_sleep_ms(100);
  }
  /* The peer connects, authenticates and fetches while the flood goes on. */
  if (get(&B, "A:weights", 0, 15000, 1u << 20, 7, &v, &right) != 0 || !right) {
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    th_dump_log(&A.d);
    th_dump_log(&B.d);
    fail_msg("the peer's fetch from the flooded daemon failed");
  }
  daemon_alive(&A);
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  assert_int_equal(v, 1);
  assert_true(log_has(&A, "peer_max_unauthenticated"));
  th_stop(&B.d);
  th_stop(&A.d);
}

int main(void) {
  if (skip_without_ucx())
    return 77;
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_NET_DEVICES", "lo", 1);
  signal(SIGPIPE, SIG_IGN);
  return TS_RUN_TESTS(NULL, NULL, test_unauthenticated_flood);
}
