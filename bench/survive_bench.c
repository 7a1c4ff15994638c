/*
 * What a survive=yes device pool costs, and how fast a restarted gpupoold serves again.
 *
 *   gpupool_survive_bench GPUPOOLD [cost|restart|all]
 *
 * cost     The same operations on a stream-ordered pool ("gpu0") and a survive=yes pool
 *          ("keep"), both on GPU 0, same daemon, same run (p50 and p99 of 30, in us):
 *          - alloc: a 64 MiB buffer in a new slab (slab_size 64M, keep_slabs 0: every
 *            allocation makes its slab, every release gives it back), from the request until
 *            the buffer is usable;
 *          - first get: a second client gets a name published in a slab it has never mapped
 *            (the import: cudaMemPoolImportPointer against cuMemImportFromShareableHandle +
 *            cuMemMap + cuMemSetAccess);
 *          - warm get: the same client gets the name again while it still maps the slab;
 *          - release of that first get (the unmap: cudaFreeAsync against a stream
 *            synchronize + cuMemUnmap).
 * restart  Under gpupoold --supervise, a survive=yes pool holding GPUPOOL_BENCH_SURVIVE_GB
 *          GiB (default 100) in names of 1 GiB, then 10,000 names of 4 KiB: each time the
 *          daemon is killed (SIGKILL) and the time from the kill until the restarted daemon
 *          served a get is measured (the supervisor restarts it after 50 ms here).
 *
 * Prints "BENCH survive ..." lines and a markdown table on stdout. Exit status 0, 1 on a
 * failure, 77 without a GPU.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpupool/gpupool.h"

#define N 30
#define BUF (64ull << 20)

static int gp_die(const char *what, int rc) {
  fprintf(stderr, "survive_bench: %s: %s: %s\n", what, gpupool_err_name(rc), gpupool_last_error());
  return 1;
}

static double us_since(uint64_t t0) { return (double)(gh_now_ns() - t0) / 1e3; }

typedef struct {
  double alloc[N], first[N], warm[N], rel[N];
} costs;

static int measure_pool(const gh_daemon *d, const char *pool, cudaStream_t s, costs *out) {
  gpupool_client *p = NULL, *r = NULL;
  int rc = 1, e;
  if ((e = gpupool_client_connect(d->sock, "bench-p", GPUPOOL_TIMEOUT_DEFAULT, &p)) < 0 ||
      (e = gpupool_client_connect(d->sock, "bench-r", GPUPOOL_TIMEOUT_DEFAULT, &r)) < 0) {
    gp_die("connect", e);
    goto out;
  }
  for (int i = -3; i < N; i++) { /* three warm-up rounds */
    gpupool_buffer *b = NULL, *g = NULL, *w = NULL;
    uint64_t t0, v = 0;
    t0 = gh_now_ns();
    if ((e = gpupool_buffer_alloc(p, pool, BUF, 0, s, &b)) < 0) {
      gp_die("gpupool_buffer_alloc", e);
      goto out;
    }
    if (i >= 0)
      out->alloc[i] = us_since(t0);
    if ((e = gk_fill(gpupool_buffer_ptr(b), BUF, (uint32_t)(i + 10), s)) != 0 ||
        (e = gpupool_buffer_publish(b, "bench", NULL, s, &v)) < 0) {
      gp_die("fill and publish", e);
      goto out;
    }
    (void)gpupool_buffer_release(b, s);
    (void)cudaStreamSynchronize(s);
    t0 = gh_now_ns();
    if ((e = gpupool_buffer_get(r, "bench", 0, 0, 0, s, &g, &v)) < 0) {
      gp_die("first get", e);
      goto out;
    }
    if (i >= 0)
      out->first[i] = us_since(t0);
    t0 = gh_now_ns();
    if ((e = gpupool_buffer_get(r, "bench", 0, 0, 0, s, &w, &v)) < 0) {
      gp_die("warm get", e);
      goto out;
    }
    if (i >= 0)
      out->warm[i] = us_since(t0);
    (void)gpupool_buffer_release(w, s);
    t0 = gh_now_ns();
    (void)gpupool_buffer_release(g, s);
    if (i >= 0)
      out->rel[i] = us_since(t0);
    /* The name goes, the slab with it (keep_slabs 0): the next round makes a new one. */
    if ((e = gpupool_name_unpublish(p, "bench")) < 0) {
      gp_die("unpublish", e);
      goto out;
    }
  }
  rc = 0;
out:
  if (r)
    gpupool_client_disconnect(r);
  if (p)
    gpupool_client_disconnect(p);
  return rc;
}

static int run_cost(const char *gpupoold, cudaStream_t s) {
  static const char conf[] =
      "[pool gpu0]\nkind = device\ndevice = 0\ncapacity = 4G\nslab_size = 64M\nkeep_slabs = 0\n"
      "[pool keep]\nkind = device\ndevice = 0\ncapacity = 4G\nslab_size = 64M\nkeep_slabs = 0\nsurvive = yes\n";
  gh_daemon d;
  costs c[2];
  const char *pools[2] = {"gpu0", "keep"};
  /* GPUPOOL_BENCH_SURVIVE_ORDER=survive-first measures the survive=yes pool first (the order's
   * own effect: the first pool measured warms what both share). */
  const char *order = getenv("GPUPOOL_BENCH_SURVIVE_ORDER");
  int first = order && !strcmp(order, "survive-first") ? 1 : 0;
  int rc = 0;
  if (gh_daemon_start_conf(&d, gpupoold, NULL, conf) != 0)
    return 1;
  printf("survive_bench: cost, %s pool measured first\n", first ? "the survive=yes" : "the stream-ordered");
  for (int j = 0; j < 2 && rc == 0; j++)
    rc = measure_pool(&d, pools[(first + j) % 2], s, &c[(first + j) % 2]);
  gh_daemon_stop(&d, rc != 0);
  if (rc)
    return rc;
  printf("\n| 64 MiB buffer, new slab each time (us, p50 / p99 of %d) | stream-ordered pool | survive=yes pool | survive / stream-ordered (p50) |\n| --- | --- | --- | --- |\n", N);
  {
    double *rows[4][2] = {{c[0].alloc, c[1].alloc}, {c[0].first, c[1].first}, {c[0].warm, c[1].warm},
                          {c[0].rel, c[1].rel}};
    const char *what[4] = {"alloc (daemon makes the slab)", "first get (import and map the slab)",
                           "warm get (slab mapped already)", "release of the first get (unmap)"};
    for (int r = 0; r < 4; r++) {
      double a50 = gh_percentile(rows[r][0], N, 50), a99 = gh_percentile(rows[r][0], N, 99);
      double b50 = gh_percentile(rows[r][1], N, 50), b99 = gh_percentile(rows[r][1], N, 99);
      printf("| %s | %.1f / %.1f | %.1f / %.1f | %.2fx |\n", what[r], a50, a99, b50, b99, b50 / a50);
      printf("BENCH survive cost %s: ordered p50 %.1f us, survive p50 %.1f us\n", what[r], a50, b50);
    }
  }
  return 0;
}

/* Kill the supervised daemon and time until the new one served a get of name. */
static int time_restart(const gh_daemon *d, gpupool_client *c, const char *name, cudaStream_t s, double *ms) {
  pid_t child = ts_child_of(d->pid);
  gpupool_buffer *b = NULL;
  uint64_t t0, v = 0;
  int e;
  if (!child)
    return 1;
  gh_sleep_ms(500); /* the last publishes reach the store */
  t0 = gh_now_ns();
  if (kill(child, SIGKILL) != 0)
    return 1;
  for (;;) {
    e = gpupool_buffer_get(c, name, 0, 0, GPUPOOL_READ_ONLY, s, &b, &v);
    if (e == 0)
      break;
    if (gh_now_ns() - t0 > 120ull * 1000000000ull)
      return gp_die("no get served within 120 s of the kill", e);
    gh_sleep_ms(1);
  }
  *ms = (double)(gh_now_ns() - t0) / 1e6;
  (void)gpupool_buffer_release(b, s);
  return 0;
}

static int run_restart(const char *gpupoold, cudaStream_t s) {
  uint64_t gb = strtoull(getenv("GPUPOOL_BENCH_SURVIVE_GB") ? getenv("GPUPOOL_BENCH_SURVIVE_GB") : "100", NULL, 10);
  char conf[512], name[32];
  gpupool_client *c = NULL;
  gh_daemon d;
  double big = 0, many = 0;
  int rc = 1, e;

  setenv("GPUPOOL_SUPERVISE_MAX_DELAY_MS", "50", 1);
  snprintf(conf, sizeof conf,
           "[daemon]\nmax_names = 20000\nmax_names_per_uid = 20000\n"
           "[pool keep]\nkind = device\ndevice = 0\nsurvive = yes\ncapacity = %" PRIu64 "\nslab_size = 1G\n",
           (uint64_t)(gb + 2) << 30);
  if (gh_daemon_start_supervised(&d, gpupoold, conf) != 0)
    return 1;
  if ((e = gpupool_client_connect(d.sock, "bench", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0) {
    gp_die("connect", e);
    goto out;
  }
  gpupool_client_set_reconnect(c, 120000);
  for (uint64_t i = 0; i < gb; i++) {
    gpupool_buffer *b = NULL;
    snprintf(name, sizeof name, "big/%" PRIu64, i);
    if ((e = gpupool_buffer_alloc(c, "keep", 1ull << 30, 0, s, &b)) < 0 ||
        (e = gk_fill(gpupool_buffer_ptr(b), 1ull << 30, (uint32_t)i, s)) != 0 ||
        (e = gpupool_buffer_publish(b, name, NULL, s, NULL)) < 0) {
      gp_die("publishing 1 GiB names", e);
      goto out;
    }
    (void)gpupool_buffer_release(b, s);
  }
  (void)cudaStreamSynchronize(s);
  if (time_restart(&d, c, "big/0", s, &big) != 0)
    goto out;
  printf("BENCH survive restart %" PRIu64 " GiB in %" PRIu64 " names: kill to first served get %.1f ms\n", gb, gb, big);
  for (uint64_t i = 0; i < gb; i++) {
    snprintf(name, sizeof name, "big/%" PRIu64, i);
    (void)gpupool_name_unpublish(c, name);
  }
  for (int i = 0; i < 10000; i++) {
    gpupool_buffer *b = NULL;
    snprintf(name, sizeof name, "small/%d", i);
    if ((e = gpupool_buffer_alloc(c, "keep", 4096, 0, s, &b)) < 0 ||
        (e = gpupool_buffer_publish(b, name, NULL, s, NULL)) < 0) {
      gp_die("publishing 10,000 names", e);
      goto out;
    }
    (void)gpupool_buffer_release(b, s);
  }
  if (time_restart(&d, c, "small/9999", s, &many) != 0)
    goto out;
  printf("BENCH survive restart 10000 names: kill to first served get %.1f ms\n", many);
  printf("\n| published in a survive=yes pool | kill -9 to the first get the restarted daemon served (ms) |\n"
         "| --- | --- |\n| %" PRIu64 " GiB in %" PRIu64 " names of 1 GiB | %.1f |\n| 10,000 names of 4 KiB | %.1f |\n",
         gb, gb, big, many);
  rc = 0;
out:
  if (c)
    gpupool_client_disconnect(c);
  gh_daemon_stop(&d, rc != 0);
  return rc;
}

int main(int argc, char **argv) {
  const char *what = argc > 2 ? argv[2] : "all";
  cudaStream_t s = NULL;
  int rc = 0;
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s GPUPOOLD [cost|restart|all]\n", argv[0]);
    return 2;
  }
  gh_gpu_count_or_skip(1, "the survive benchmark");
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    return 1;
  if (!strcmp(what, "cost") || !strcmp(what, "all"))
    rc |= run_cost(argv[1], s);
  if (!strcmp(what, "restart") || !strcmp(what, "all"))
    rc |= run_restart(argv[1], s);
  return rc ? 1 : 0;
}
