/*
 * Host-backend benchmark: what gpupool costs per request when no GPU is involved, against the
 * floor of any request/reply on this machine, all measured in the same run.
 *
 *   gpupool_host_bench GPUPOOLD [--clients N] [--seconds S]
 *
 * Prints, each as a human line and as "BENCH <key> <value>":
 *   - socket floor: 1-byte ping-pong over a socketpair between two processes (p50/p99);
 *   - warm allocate (slab already mapped) and allocate+release round trips (p50/p99) and
 *     the ratio of allocate to the socket floor;
 *   - producer -> consumer handoff of a 1 MiB buffer: from the producer's publish call to the
 *     consumer holding a mapped pointer (p50/p99), and handoffs per second;
 *   - allocate+release operations per second summed over N client processes (default 16),
 *     which measures the daemon's single loop thread;
 *   - (as root) one client's allocate+release p50/p99 idle, then while another uid (nobody)
 *     floods the daemon with connections, names, holds and waiting gets up to its limits and
 *     keeps connecting and sending refused requests: what one user's flood costs another.
 * Starts its own gpupoold (host backend) on a private socket. Not a test: no assertions on
 * time; it fails only if an operation fails.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon.h"
#include "gpupool/gpupool.h"

static ts_daemon D;
static const char *sock_path = D.sock;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double pct(uint64_t *v, size_t n, double p) {
  qsort(v, n, sizeof *v, cmp_u64);
  return (double)v[(size_t)((double)(n - 1) * p)] / 1000.0;
}

static void die(const char *what, int rc) {
  fprintf(stderr, "%s failed: %s: %s\n", what, gpupool_err_name(rc), gpupool_last_error());
  exit(1);
}

static double socket_floor(double *p99) {
  enum { N = 20000 };
  static uint64_t t[N];
  int sv[2];
  char c = 0;
  pid_t pid;
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
    exit(1);
  pid = fork();
  if (pid == 0) {
    close(sv[0]);
    while (read(sv[1], &c, 1) == 1 && write(sv[1], &c, 1) == 1)
      ;
    _exit(0);
  }
  close(sv[1]);
  for (int i = 0; i < N; i++) {
    uint64_t t0 = now_ns();
    if (write(sv[0], &c, 1) != 1 || read(sv[0], &c, 1) != 1)
      exit(1);
    t[i] = now_ns() - t0;
  }
  close(sv[0]);
  waitpid(pid, NULL, 0);
  *p99 = pct(t, N, 0.99);
  return pct(t, N, 0.5);
}

static void bench_alloc(double floor50) {
  enum { N = 20000 };
  static uint64_t ta[N], tr[N];
  gpupool_client *c;
  gpupool_buffer *b;
  int rc;
  if ((rc = gpupool_client_connect(sock_path, "bench-alloc", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0)
    die("connect", rc);
  for (int i = 0; i < 100; i++) { /* warm: the slab gets mapped */
    if ((rc = gpupool_buffer_alloc(c, NULL, 1 << 20, 0, NULL, &b)) != 0)
      die("alloc", rc);
    gpupool_buffer_release(b, NULL);
  }
  for (int i = 0; i < N; i++) {
    uint64_t t0 = now_ns(), t1;
    if ((rc = gpupool_buffer_alloc(c, NULL, 1 << 20, 0, NULL, &b)) != 0)
      die("alloc", rc);
    t1 = now_ns();
    if ((rc = gpupool_buffer_release(b, NULL)) != 0)
      die("release", rc);
    ta[i] = t1 - t0;
    tr[i] = now_ns() - t0;
  }
  {
    double a50 = pct(ta, N, 0.5), a99 = pct(ta, N, 0.99), r50 = pct(tr, N, 0.5), r99 = pct(tr, N, 0.99);
    printf("warm allocate (1 MiB):      p50 %7.1f us  p99 %7.1f us  = %.2fx the socket floor\n", a50, a99,
           a50 / floor50);
    printf("allocate+release:           p50 %7.1f us  p99 %7.1f us\n", r50, r99);
    printf("BENCH host_alloc_p50_us %.2f\nBENCH host_alloc_p99_us %.2f\nBENCH host_alloc_over_floor %.2f\n"
           "BENCH host_alloc_release_p50_us %.2f\n",
           a50, a99, a50 / floor50, r50);
  }
  gpupool_client_disconnect(c);
}

/* Producer publishes name i, consumer (another process) gets it: latency from publish to a
 * mapped pointer in the consumer, through a pipe carrying the publish timestamp back. */
static void bench_handoff(void) {
  enum { N = 3000 };
  static uint64_t t[N];
  int go[2], done[2], rc;
  pid_t pid;
  uint64_t start, total;
  if (pipe(go) != 0 || pipe(done) != 0)
    exit(1);
  pid = fork();
  if (pid == 0) {
    gpupool_client *c;
    close(go[1]);
    close(done[0]);
    if ((rc = gpupool_client_connect(sock_path, "bench-consumer", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0)
      die("connect", rc);
    for (int i = 0; i < N; i++) {
      char name[32];
      gpupool_buffer *b;
      uint64_t t0, dt;
      snprintf(name, sizeof name, "h%d", i);
      if ((rc = gpupool_buffer_get(c, name, 0, 10000, GPUPOOL_READ_ONLY, NULL, &b, NULL)) != 0)
        die("get", rc);
      dt = now_ns();
      if (((volatile uint8_t *)gpupool_buffer_ptr(b))[0] != (uint8_t)i)
        _exit(3);
      if (read(go[0], &t0, sizeof t0) != sizeof t0)
        _exit(2);
      dt -= t0;
      gpupool_buffer_release(b, NULL);
      if (write(done[1], &dt, sizeof dt) != sizeof dt)
        _exit(2);
    }
    gpupool_client_disconnect(c);
    _exit(0);
  }
  close(go[0]);
  close(done[1]);
  {
    gpupool_client *c;
    if ((rc = gpupool_client_connect(sock_path, "bench-producer", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0)
      die("connect", rc);
    start = now_ns();
    for (int i = 0; i < N; i++) {
      char name[32];
      gpupool_buffer *b;
      uint64_t t0;
      snprintf(name, sizeof name, "h%d", i);
      if ((rc = gpupool_buffer_alloc(c, NULL, 1 << 20, 1000, NULL, &b)) != 0)
        die("alloc", rc);
      ((uint8_t *)gpupool_buffer_ptr(b))[0] = (uint8_t)i;
      t0 = now_ns();
      if ((rc = gpupool_buffer_publish(b, name, NULL, NULL, NULL)) != 0)
        die("publish", rc);
      if (write(go[1], &t0, sizeof t0) != sizeof t0 || read(done[0], &t[i], sizeof t[i]) != sizeof t[i])
        exit(1);
      gpupool_buffer_release(b, NULL);
      if ((rc = gpupool_name_unpublish(c, name)) != 0)
        die("unpublish", rc);
    }
    total = now_ns() - start;
    gpupool_client_disconnect(c);
  }
  waitpid(pid, NULL, 0);
  {
    double h50 = pct(t, N, 0.5), h99 = pct(t, N, 0.99), rate = N / ((double)total / 1e9);
    printf("handoff 1 MiB publish->get: p50 %7.1f us  p99 %7.1f us  (%.0f handoffs/s, full cycle)\n", h50, h99,
           rate);
    printf("BENCH host_handoff_p50_us %.2f\nBENCH host_handoff_p99_us %.2f\nBENCH host_handoffs_per_s %.0f\n", h50,
           h99, rate);
  }
}

static void bench_ops(int clients, double seconds) {
  int fds[2];
  pid_t *pids = calloc((size_t)clients, sizeof *pids);
  uint64_t total = 0, t0;
  if (!pids || pipe(fds) != 0)
    exit(1);
  t0 = now_ns();
  for (int k = 0; k < clients; k++) {
    pids[k] = fork();
    if (pids[k] == 0) {
      gpupool_client *c;
      gpupool_buffer *b;
      uint64_t ops = 0, end;
      int rc;
      close(fds[0]);
      if ((rc = gpupool_client_connect(sock_path, "bench-ops", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0)
        die("connect", rc);
      end = now_ns() + (uint64_t)(seconds * 1e9);
      while (now_ns() < end) {
        if ((rc = gpupool_buffer_alloc(c, NULL, 4096, 1000, NULL, &b)) != 0)
          die("alloc", rc);
        if ((rc = gpupool_buffer_release(b, NULL)) != 0)
          die("release", rc);
        ops += 2;
      }
      gpupool_client_disconnect(c);
      if (write(fds[1], &ops, sizeof ops) != sizeof ops)
        _exit(2);
      _exit(0);
    }
  }
  close(fds[1]);
  for (int k = 0; k < clients; k++) {
    uint64_t ops;
    if (read(fds[0], &ops, sizeof ops) == sizeof ops)
      total += ops;
    waitpid(pids[k], NULL, 0);
  }
  {
    double secs = (double)(now_ns() - t0) / 1e9, rate = (double)total / secs;
    printf("%2d clients alloc+release:   %.0f requests/s = %.0f allocate+release pairs/s\n", clients, rate,
           rate / 2);
    printf("BENCH host_ops_per_s_%dclients %.0f\nBENCH host_pairs_per_s_%dclients %.0f\n", clients, rate,
           clients, rate / 2);
  }
  free(pids);
}

/* p50/p99 of n allocate+release pairs of c, in us. */
static void alloc_release_pcts(gpupool_client *c, int n, double *p50, double *p99) {
  uint64_t *t = malloc((size_t)n * sizeof *t);
  gpupool_buffer *b;
  int rc;
  if (!t)
    die("malloc", GPUPOOL_ENOMEM);
  for (int i = 0; i < n; i++) {
    uint64_t t0 = now_ns();
    if ((rc = gpupool_buffer_alloc(c, NULL, 4096, 1000, NULL, &b)) != 0)
      die("alloc", rc);
    if ((rc = gpupool_buffer_release(b, NULL)) != 0)
      die("release", rc);
    t[i] = now_ns() - t0;
  }
  *p50 = pct(t, (size_t)n, 0.50);
  *p99 = pct(t, (size_t)n, 0.99);
  free(t);
}

/* The flooder, as uid 65534: take every connection, name, hold and waiting get its limits
 * allow, then keep connecting and sending refused requests until killed. */
static void flood(int ready_fd) {
  enum { MAXC = 512 };
  static gpupool_client *cs[MAXC];
  gpupool_buffer *b, *o;
  gpupool_member_spec bad = {.name = "x", .size = 4096};
  gpupool_bundle *bu;
  gpupool_token tok;
  int nc = 0, rc;
  char name[64], ch = 1;
  if (ts_become(TS_NOBODY) != 0)
    _exit(3);
  while (nc < MAXC && gpupool_client_connect(sock_path, "flood", GPUPOOL_TIMEOUT_DEFAULT, &cs[nc]) == 0)
    nc++;
  if (nc < 2)
    _exit(4);
  if (gpupool_buffer_alloc(cs[0], NULL, 4096, 0, NULL, &b) == 0) {
    for (int i = 0; i < 100000; i++) {
      snprintf(name, sizeof name, "flood/%d", i);
      if (gpupool_buffer_publish(b, name, NULL, NULL, NULL) != 0)
        break;
    }
    if (gpupool_buffer_share(b, NULL, &tok) == 0)
      for (int i = 0; i < 1000000 && gpupool_buffer_open(cs[1], &tok, 0, NULL, &o) == 0; i++)
        ;
  }
  if (write(ready_fd, &ch, 1) != 1)
    _exit(5);
  /* Waiting gets from every connection (each returns ELIMIT once the limits are reached),
   * then connect/disconnect churn and refused requests, forever. */
  for (;;) {
    for (int k = 2; k < nc; k++) {
      gpupool_buffer *g;
      snprintf(name, sizeof name, "never/%d", k);
      rc = gpupool_buffer_get(cs[k], name, 0, 1, 0, NULL, &g, NULL);
      (void)rc;
    }
    gpupool_client_disconnect(cs[nc - 1]);
    if (gpupool_client_connect(sock_path, "flood", GPUPOOL_TIMEOUT_DEFAULT, &cs[nc - 1]) != 0)
      cs[nc - 1] = NULL, nc--;
    (void)gpupool_bundle_alloc(cs[0], NULL, &bad, 1, 3, 0, NULL, &bu); /* refused: logged at most 10 per 10 s */
  }
}

static void bench_flood(void) {
  gpupool_client *c;
  double i50, i99, f50, f99;
  int p[2], rc;
  char ch;
  pid_t pid;
  if (getuid() != 0) {
    printf("flood: skipped (run as root: the flood comes from another uid)\n");
    return;
  }
  if ((rc = gpupool_client_connect(sock_path, "victim", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0)
    die("connect", rc);
  alloc_release_pcts(c, 3000, &i50, &i99);
  if (pipe(p) != 0)
    die("pipe", GPUPOOL_EIO);
  pid = fork();
  if (pid == 0) {
    close(p[0]);
    flood(p[1]);
  }
  close(p[1]);
  if (read(p[0], &ch, 1) != 1) {
    printf("flood: the flooding client failed to start\n");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    gpupool_client_disconnect(c);
    return;
  }
  alloc_release_pcts(c, 3000, &f50, &f99);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  close(p[0]);
  gpupool_client_disconnect(c);
  printf("alloc+release of one uid, idle:             p50 %7.1f us  p99 %7.1f us\n", i50, i99);
  printf("  while another uid floods to its limits:   p50 %7.1f us  p99 %7.1f us  (p99 %.2fx idle)\n", f50,
         f99, f99 / i99);
  printf("BENCH flood_idle_p99_us %.1f\nBENCH flood_p99_us %.1f\nBENCH flood_p99_ratio %.2f\n", i99, f99,
         f99 / i99);
}

int main(int argc, char **argv) {
  int clients = 16;
  double seconds = 3, f50, f99;
  ts_daemon_opts o = {.backend = "host", .log_level = "warn", .use_conf = 1, .ready_ms = 5000, .poll_ms = 10,
                      .pool = "name=default,kind=host,capacity=2G,slab=64M"};
  if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    printf("usage: %s GPUPOOLD [--clients N] [--seconds S]\n"
           "Latency of one uid's allocate+release, idle and while another uid floods gpupoold\n"
           "(host backend, a private daemon started from the GPUPOOLD binary).\n", argv[0]);
    return 0;
  }
  if (argc < 2 || argv[1][0] == '-') {
    fprintf(stderr, "usage: %s GPUPOOLD [--clients N] [--seconds S]\n", argv[0]);
    return 2;
  }
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--clients"))
      clients = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--seconds"))
      seconds = atof(argv[i + 1]);
  }
  /* Reachable by the flooding uid; every limit at its default. */
  o.gpupoold = argv[1];
  if (ts_daemon_prepare(&D, NULL, "gpupool-bench-") != 0 || chmod(D.dir, 0711) != 0 ||
      ts_daemon_write_conf(&D, "[daemon]\nsocket_mode = 0666\n") != 0 || ts_daemon_start(&D, &o) != 0) {
    fprintf(stderr, "host_bench: %s\n", D.why);
    ts_daemon_remove(&D);
    return 1;
  }
  {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    printf("gpupool host-backend benchmark, %ld CPUs\n", ncpu);
    printf("BENCH cpus %ld\n", ncpu);
  }
  f50 = socket_floor(&f99);
  printf("socket floor (1-byte RTT):  p50 %7.1f us  p99 %7.1f us\n", f50, f99);
  printf("BENCH socket_rtt_p50_us %.2f\nBENCH socket_rtt_p99_us %.2f\n", f50, f99);
  bench_alloc(f50);
  bench_handoff();
  bench_ops(clients, seconds);
  bench_flood();
  ts_daemon_stop(&D, -1);
  ts_daemon_remove(&D);
  return 0;
}
