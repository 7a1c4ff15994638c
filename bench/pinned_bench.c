/*
 * Copy throughput of gpupool's pinned host-NUMA tier: one run on GPU 0 with its own private
 * gpupoold.
 *
 *   gpupool_pinned_bench GPUPOOLD [TABLE_FILE]
 *
 * The daemon serves one pool of kind host-numa (pinned host memory of the GPU's NUMA node,
 * node 0 when CUDA does not say; GPUPOOL_BENCH_NUMA=N overrides) to GPU 0, 2 GiB in 256 MiB
 * slabs. A producer process allocates a 64 MiB, a 256 MiB and a 1 GiB buffer in it (a size
 * the pool cannot hold is skipped and said so), fills each from a kernel and publishes it;
 * this process gets them by name, as any consumer does (its own connection, its own import
 * of the pool and the slabs), checks that a host-to-device copy of each brings the
 * producer's bytes, and then times cudaMemcpyAsync host->device and device->host between a
 * cudaMalloc buffer and each of:
 *   (a) the gpupool host-NUMA buffer,
 *   (b) cudaMallocHost memory of the same size,
 *   (c) pageable malloc memory of the same size (touched first).
 * One copy is timed from the call to its stream drained (CLOCK_MONOTONIC around
 * cudaMemcpyAsync(cudaMemcpyDefault) + cudaStreamSynchronize, the same for all three, so
 * pageable staging is counted); the three sources take turns within each repetition, after warm-up copies, and
 * the median of the repetitions is reported in GB/s (10^9 bytes/s), with gpupool's share of
 * cudaMallocHost's (the target is at least 95%).
 *
 * Prints human lines, "BENCH <key> <value>" lines for scripts, and a markdown table at the
 * end (also written to TABLE_FILE when given; tools/gpu-bench.sh collects it). Exit status 0,
 * 1 on failure, 77 when there is no GPU or GPU 0 lacks host-NUMA memory pools. Figures are
 * never asserted.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpupool/gpupool.h"

#define BENCH_PROG "gpupool_pinned_bench"
#include "bench_util.h"

#define POOL "pinned"
#define POOL_CAPACITY "2G"
#define POOL_SLAB "256M"
#define STEP_MS 120000
#define N_SIZES 3
#define WARMUP 2
#define REPS 10
#define TARGET_PCT 95.0

static const size_t sizes[N_SIZES] = {64ull << 20, 256ull << 20, 1ull << 30};
static const char *const size_labels[N_SIZES] = {"64 MiB", "256 MiB", "1 GiB"};

enum { SRC_GPUPOOL, SRC_PINNED, SRC_PAGEABLE, N_SRC };
static const char *const src_keys[N_SRC] = {"gpupool", "mallochost", "pageable"};
static const char *const src_names[N_SRC] = {"gpupool host-NUMA buffer", "cudaMallocHost",
                                             "pageable malloc"};
enum { H2D, D2H, N_DIR };
static const char *const dir_keys[N_DIR] = {"h2d", "d2h"};
static const char *const dir_names[N_DIR] = {"host->device", "device->host"};

/* The private daemon, stopped (its log printed) when the measuring process dies. */
static gh_daemon *g_daemon;

static void stop_daemon_at_exit(void) {
  if (g_daemon)
    gh_daemon_stop(g_daemon, 1);
}

static void buf_name(char *out, size_t len, size_t size) {
  snprintf(out, len, "pinned-bench-%zu", size);
}

static uint32_t size_seed(size_t size) { return (uint32_t)(size >> 20) * 0x9e3779b9u + 7u; }

/* ---------------------------------------------------------------- producer process */

/* prod SOCK: allocates, fills and publishes every size it can; says PUBLISHED SIZE or
 * SKIP SIZE REASON for each, then READY; QUIT on stdin unpublishes and exits. */
static int w_prod(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  char name[64], line[64];
  int published[N_SIZES] = {0};

  GP(gpupool_client_connect(a[0], "pinned-bench-producer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  for (int i = 0; i < N_SIZES; i++) {
    gpupool_buffer *b;
    int rc = gpupool_buffer_alloc(c, POOL, sizes[i], 0, s, &b), ce;
    if (rc == GPUPOOL_ENOSPC || rc == GPUPOOL_ETOOBIG) {
      gh_say("SKIP %zu %s: %s", sizes[i], gpupool_err_name(rc), gpupool_last_error());
      continue;
    }
    if (rc < 0)
      die("gpupool_buffer_alloc of %zu bytes in pool %s: %s: %s", sizes[i], POOL, gpupool_err_name(rc),
          gpupool_last_error());
    if (gpupool_buffer_kind(b) != GPUPOOL_MEM_HOST_NUMA)
      die("pool %s gave a buffer of kind %d, not GPUPOOL_MEM_HOST_NUMA", POOL,
          (int)gpupool_buffer_kind(b));
    if ((ce = gk_fill(gpupool_buffer_ptr(b), sizes[i], size_seed(sizes[i]), s)))
      die("fill kernel on the host-NUMA buffer: %s", cudaGetErrorString((cudaError_t)ce));
    buf_name(name, sizeof(name), sizes[i]);
    GP(gpupool_buffer_publish(b, name, NULL, s, NULL));
    GP(gpupool_buffer_release(b, s));
    published[i] = 1;
    gh_say("PUBLISHED %zu", sizes[i]);
  }
  gh_say("READY");
  while (fgets(line, sizeof(line), stdin) && strncmp(line, "QUIT", 4) != 0)
    ;
  for (int i = 0; i < N_SIZES; i++)
    if (published[i]) {
      buf_name(name, sizeof(name), sizes[i]);
      GP(gpupool_name_unpublish(c, name));
    }
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  return 0;
}

/* ---------------------------------------------------------------- measuring process */

/* One copy of bytes between host and dev, from the call until the stream has drained. The
 * same call for every kind of host memory: cudaMemcpyDefault lets CUDA tell pinned from
 * pageable by the pointer, as an application copying a gpupool buffer would. */
static double copy_gbps(void *host, void *dev, size_t bytes, int dir, cudaStream_t s) {
  uint64_t t0 = gh_now_ns();
  if (dir == H2D)
    CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyDefault, s));
  else
    CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDefault, s));
  CK(cudaStreamSynchronize(s));
  return (double)bytes / ((double)(gh_now_ns() - t0) / 1e9) / 1e9;
}

typedef struct {
  int published;                 /* the producer has it under its name */
  int measured;
  char skip[512];                /* why this size was not measured */
  double gbps[N_SRC][N_DIR];     /* medians */
} size_result;

static void measure(size_t bytes, void *pool_ptr, void *dev, cudaStream_t s, size_result *r) {
  void *src[N_SRC];
  double v[N_SRC][N_DIR][REPS];

  src[SRC_GPUPOOL] = pool_ptr;
  CK(cudaMallocHost(&src[SRC_PINNED], bytes));
  src[SRC_PAGEABLE] = malloc(bytes);
  if (!src[SRC_PAGEABLE])
    die("malloc of %zu bytes: %s", bytes, strerror(errno));
  /* Touch every page of both (the pageable copy must not pay first-touch faults). */
  memset(src[SRC_PINNED], 0x5a, bytes);
  memset(src[SRC_PAGEABLE], 0x5a, bytes);
  for (int w = 0; w < WARMUP; w++)
    for (int k = 0; k < N_SRC; k++)
      for (int d = 0; d < N_DIR; d++)
        (void)copy_gbps(src[k], dev, bytes, d, s);
  /* Sources take turns within each repetition, so drift hits all three alike. */
  for (int rep = 0; rep < REPS; rep++)
    for (int k = 0; k < N_SRC; k++)
      for (int d = 0; d < N_DIR; d++)
        v[k][d][rep] = copy_gbps(src[k], dev, bytes, d, s);
  for (int k = 0; k < N_SRC; k++)
    for (int d = 0; d < N_DIR; d++)
      r->gbps[k][d] = gh_percentile(v[k][d], REPS, 50);
  r->measured = 1;
  CK(cudaFreeHost(src[SRC_PINNED]));
  free(src[SRC_PAGEABLE]);
}

/* The producer's bytes arrive through a host->device copy from the pointer gpupool_buffer_get gave
 * this process: the figures are of the shared memory, not of some other mapping. */
static void check_contents(void *pool_ptr, void *dev, size_t bytes, cudaStream_t s) {
  unsigned long long bad = ~0ull;
  int ce;
  CK(cudaMemcpyAsync(dev, pool_ptr, bytes, cudaMemcpyDefault, s));
  if ((ce = gk_count_mismatches(dev, bytes, size_seed(bytes), s, &bad)))
    die("mismatch kernel: %s", cudaGetErrorString((cudaError_t)ce));
  if (bad)
    die("%llu of %zu words copied from the gpupool buffer of %zu bytes differ from what the "
        "producer's kernel wrote", bad, bytes / 4, bytes);
}

static void print_table(FILE *f, const char *device, int numa, const size_result *res) {
  int met = 1, any = 0;
  fprintf(f, "Pinned host-NUMA pool (NUMA node %d) vs cudaMallocHost vs pageable memory on %s: "
          "cudaMemcpyAsync throughput, median of %d copies in GB/s\n\n", numa, device, REPS);
  fprintf(f, "| size | direction | gpupool host-NUMA | cudaMallocHost | gpupool / cudaMallocHost "
          "| pageable malloc |\n");
  fprintf(f, "| --- | --- | --- | --- | --- | --- |\n");
  for (int i = 0; i < N_SIZES; i++) {
    const size_result *r = &res[i];
    if (!r->measured) {
      fprintf(f, "| %s | - | skipped: %s | - | - | - |\n", size_labels[i], r->skip);
      continue;
    }
    for (int d = 0; d < N_DIR; d++) {
      double pct = 100.0 * r->gbps[SRC_GPUPOOL][d] / r->gbps[SRC_PINNED][d];
      any = 1;
      if (pct < TARGET_PCT)
        met = 0;
      fprintf(f, "| %s | %s | %.1f | %.1f | %.1f%% | %.1f |\n", size_labels[i], dir_names[d],
              r->gbps[SRC_GPUPOOL][d], r->gbps[SRC_PINNED][d], pct, r->gbps[SRC_PAGEABLE][d]);
    }
  }
  if (any)
    fprintf(f, "\nTarget: gpupool at least %.0f%% of cudaMallocHost at every measured size and "
            "direction: %s.\n", TARGET_PCT, met ? "met" : "NOT met");
}

/* ---------------------------------------------------------------- main */

int main(int argc, char **argv) {
  struct cudaDeviceProp prop;
  size_result res[N_SIZES];
  gh_daemon d;
  gh_proc prod;
  gpupool_client *c;
  cudaStream_t s;
  char spec[256], line[1024], name[64];
  const char *env = getenv("GPUPOOL_BENCH_NUMA");
  int drv = 0, ok = 0, numa = -1;
  size_t max_bytes = 0;
  void *dev = NULL;
  cudaError_t e;

  if (argc >= 3 && !strcmp(argv[1], "worker")) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(argv[2], "prod") && argc == 4)
      return w_prod(argv + 3);
    die("unknown worker role %s or wrong arguments", argv[2]);
  }
  if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    printf("usage: %s GPUPOOLD [TABLE_FILE]\n"
           "Copy throughput of a gpupool host-NUMA buffer against cudaMallocHost and pageable\n"
           "memory on GPU 0; TABLE_FILE receives the table as well.\n", argv[0]);
    return 0;
  }
  if ((argc != 2 && argc != 3) || argv[1][0] == '-') {
    fprintf(stderr, "usage: %s GPUPOOLD [TABLE_FILE]\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  gh_gpu_count_or_skip(1, "the pinned-memory benchmark");
  e = cudaDeviceGetAttribute(&ok, cudaDevAttrHostNumaMemoryPoolsSupported, 0);
  if (e != cudaSuccess || !ok) {
    printf("SKIP: device 0 does not support host-NUMA memory pools (%s)\n",
           e != cudaSuccess ? cudaGetErrorName(e) : "cudaDevAttrHostNumaMemoryPoolsSupported = 0");
    return GH_SKIP;
  }
  if (env && *env) {
    numa = atoi(env);
  } else if (cudaDeviceGetAttribute(&numa, cudaDevAttrHostNumaId, 0) != cudaSuccess || numa < 0) {
    (void)cudaGetLastError();
    numa = 0;
  }
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaDriverGetVersion(&drv));
  gh_say("gpupool %s pinned-memory benchmark on %s (driver %d.%d, runtime %d.%d), pool on "
         "NUMA node %d", gpupool_version_string(), prop.name, drv / 1000, (drv % 1000) / 10,
         CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10, numa);
  gh_say("BENCH_INFO device %s", prop.name);
  gh_say("BENCH_INFO numa_node %d", numa);

  snprintf(spec, sizeof(spec), "name=%s,kind=host-numa,device=0,numa=%d,capacity=%s,slab=%s",
           POOL, numa, POOL_CAPACITY, POOL_SLAB);
  if (gh_daemon_start(&d, argv[1], spec) < 0)
    die("gpupoold did not start with pool %s", spec);
  g_daemon = &d;
  atexit(stop_daemon_at_exit);
  {
    const char *av[] = {"", "worker", "prod", d.sock, NULL};
    if (gh_spawn(&prod, av, NULL, 0) < 0)
      die("cannot start the producer");
  }
  memset(res, 0, sizeof(res));
  for (;;) {
    size_t sz = 0;
    int n = 0;
    if (gh_readline(&prod, line, sizeof(line), STEP_MS) < 0)
      die("the producer went away before READY (its error is above)");
    if (!strcmp(line, "READY"))
      break;
    if (sscanf(line, "PUBLISHED %zu", &sz) == 1) {
      for (int i = 0; i < N_SIZES; i++)
        if (sizes[i] == sz)
          res[i].published = 1;
      if (sz > max_bytes)
        max_bytes = sz;
    } else if (sscanf(line, "SKIP %zu %n", &sz, &n) == 1 && n > 0) {
      for (int i = 0; i < N_SIZES; i++)
        if (sizes[i] == sz)
          snprintf(res[i].skip, sizeof(res[i].skip), "%s", line + n);
      gh_say("skipping %zu bytes: the pool cannot hold it (%s)", sz, line + n);
    }
  }

  s = new_stream();
  GP(gpupool_client_connect(d.sock, "pinned-bench-consumer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  if (max_bytes)
    CK(cudaMalloc(&dev, max_bytes));
  for (int i = 0; i < N_SIZES; i++) {
    gpupool_buffer *b;
    if (!res[i].published) {
      if (!res[i].skip[0])
        snprintf(res[i].skip, sizeof(res[i].skip), "the producer reported nothing for it");
      continue;
    }
    buf_name(name, sizeof(name), sizes[i]);
    GP(gpupool_buffer_get(c, name, 0, STEP_MS, 0, s, &b, NULL));
    if (gpupool_buffer_kind(b) != GPUPOOL_MEM_HOST_NUMA || gpupool_buffer_size(b) < sizes[i])
      die("%s is of kind %d and %zu bytes, expected GPUPOOL_MEM_HOST_NUMA of %zu", name,
          (int)gpupool_buffer_kind(b), gpupool_buffer_size(b), sizes[i]);
    check_contents(gpupool_buffer_ptr(b), dev, sizes[i], s);
    measure(sizes[i], gpupool_buffer_ptr(b), dev, s, &res[i]);
    GP(gpupool_buffer_release(b, s));
    CK(cudaStreamSynchronize(s));
    for (int k = 0; k < N_SRC; k++)
      for (int dd = 0; dd < N_DIR; dd++) {
        char key[96];
        gh_say("%-8s %-13s %-26s %8.1f GB/s", size_labels[i], dir_names[dd], src_names[k],
               res[i].gbps[k][dd]);
        snprintf(key, sizeof(key), "pinned_%s_%s_%zu_gbps", src_keys[k], dir_keys[dd],
                 sizes[i] >> 20);
        report(key, res[i].gbps[k][dd]);
      }
    for (int dd = 0; dd < N_DIR; dd++) {
      char key[96];
      snprintf(key, sizeof(key), "pinned_ratio_%s_%zu", dir_keys[dd], sizes[i] >> 20);
      report(key, res[i].gbps[SRC_GPUPOOL][dd] / res[i].gbps[SRC_PINNED][dd]);
    }
  }
  if (dev)
    CK(cudaFree(dev));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  if (gh_writeline(&prod, "QUIT") < 0 || gh_wait(&prod, STEP_MS) != 0)
    die("the producer did not unpublish and exit cleanly");
  if (!gh_daemon_alive(&d))
    die("gpupoold died during the benchmark");
  g_daemon = NULL;
  gh_daemon_stop(&d, 0);

  putchar('\n');
  print_table(stdout, prop.name, numa, res);
  if (argc == 3) {
    FILE *f = fopen(argv[2], "w");
    if (!f)
      die("cannot write the table to %s: %s", argv[2], strerror(errno));
    print_table(f, prop.name, numa, res);
    if (fclose(f) != 0)
      die("writing the table to %s: %s", argv[2], strerror(errno));
  }
  gh_say("BENCH_DONE");
  return 0;
}
