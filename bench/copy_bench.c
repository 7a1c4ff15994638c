/*
 * The CUDA copy engine (backend/cuda/copy.c) against the CUDA runtime's own copies, on one
 * machine with two GPUs or more. The backend is opened in this process and driven through its
 * copy ops, as gpupoold's replicas will drive it; every copy is checked bit-exact.
 *
 *   gpupool_copy_bench peer        64 MiB .. 4 GiB, GPU 0 -> GPU 1: a one-destination job
 *                                  against raw cudaMemcpyPeerAsync between cudaMalloc buffers
 *                                  with peer access enabled (issued on the target's stream
 *                                  and on the source's; the faster is the baseline).
 *   gpupool_copy_bench staged      256 MiB .. 4 GiB, GPU 0 -> GPU 1, with GPUPOOL_NO_PEER=1
 *                                  against cudaMemcpyPeer without peer access enabled (run it
 *                                  in a process of its own: peer access, once enabled, stays).
 *   gpupool_copy_bench broadcast   a 290-tensor bf16 state dict (Llama-3-8B-shaped, tied
 *                                  embeddings: 15.0 GB) from GPU 0 to GPUs 1..3 through one
 *                                  chained job; also three one-destination jobs at once (the
 *                                  source fanning out), and the chain staged (GPUPOOL_NO_PEER).
 *   gpupool_copy_bench notify      what the end of a job costs to learn, GPU 0 -> GPU 1 peer,
 *                                  1 MiB and 256 MiB: copy_start on the caller's thread, then
 *                                  the job's end seen by spinning on copy_poll, and seen
 *                                  through the backend's notifier (poll() on its eventfd, as
 *                                  gpupoold's loop waits), each from the start.
 *
 * Times are wall-clock from copy_start (or the raw call) to completion seen by copy_poll (or a
 * stream synchronize), the median of several runs after one warm-up. Prints "BENCH key value"
 * lines and a markdown table (also to FILE with --table FILE). Exit 77 with fewer than two GPUs.
 */
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <unistd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend.h"
#include "errors.h"
#define BENCH_PROG "copy_bench"
#include "bench_util.h"
#include "gpu_harness.h"
#include "gpu_kernels.h"

#define MiB ((uint64_t)1 << 20)
#define GiB ((uint64_t)1 << 30)

static FILE *table;


static gpupool__backend *be;

static gpupool__bpool *mkpool(const char *name, int device, uint64_t cap) {
  gpupool__pool_config cfg;
  gpupool__bpool *p = NULL;
  int fd = -1, rc;
  gpupool__pool_config_init(&cfg);
  snprintf(cfg.name, sizeof(cfg.name), "%s", name);
  cfg.kind = GPUPOOL_MEM_DEVICE;
  cfg.device = device;
  cfg.capacity = cap;
  cfg.slab_size = cap < GPUPOOL_SLAB_HARD_MAX ? cap : GPUPOOL_SLAB_HARD_MAX;
  if ((rc = be->ops->pool_create(be, &cfg, &p, &fd)) < 0)
    die("pool_create %s: %s: %s", name, gpupool_err_name(rc), gpupool__errmsg());
  return p;
}

static void mkslab(gpupool__bpool *p, uint64_t size, gpupool__bslab *s) {
  int rc = be->ops->slab_alloc(p, size, 0, s);
  if (rc < 0)
    die("slab_alloc %" PRIu64 ": %s: %s", size, gpupool_err_name(rc), gpupool__errmsg());
}

/* What copy_start of the last job cost its caller's thread: seconds. */
static double last_start;

/* One job from start to completion: seconds. */
static double job(const gpupool__bcopy_seg *segs, size_t n, int ndst) {
  gpupool__bcopy *c = NULL;
  uint64_t t0 = gh_now_ns();
  int rc = be->ops->copy_start(be, segs, n, ndst, &c);
  last_start = (double)(gh_now_ns() - t0) / 1e9;
  if (rc < 0)
    die("copy_start: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  while ((rc = be->ops->copy_poll(c)) == 0)
    sched_yield();
  if (rc < 0)
    die("copy_poll: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  t0 = gh_now_ns() - t0;
  be->ops->copy_free(c);
  return (double)t0 / 1e9;
}

/* Several jobs started together, until all are done: seconds. */
static double jobs(gpupool__bcopy_seg *const *segs, const size_t *n, int njobs) {
  gpupool__bcopy *c[8] = {0};
  int done = 0, rc;
  uint64_t t0 = gh_now_ns();
  for (int j = 0; j < njobs; j++)
    if ((rc = be->ops->copy_start(be, segs[j], n[j], 1, &c[j])) < 0)
      die("copy_start: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  while (done < njobs) {
    done = 0;
    for (int j = 0; j < njobs; j++) {
      if ((rc = be->ops->copy_poll(c[j])) < 0)
        die("copy_poll: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
      done += rc;
    }
    if (done < njobs)
      sched_yield();
  }
  t0 = gh_now_ns() - t0;
  for (int j = 0; j < njobs; j++)
    be->ops->copy_free(c[j]);
  return (double)t0 / 1e9;
}

static void check_pattern(int device, const void *p, uint64_t len, uint32_t seed, const char *what) {
  unsigned long long bad = 0;
  bench_ck(cudaSetDevice(device), "cudaSetDevice");
  bench_ck((cudaError_t)gk_count_mismatches(p, len, seed, NULL, &bad), "gk_count_mismatches");
  if (bad)
    die("%s: %llu words differ from the source on device %d: not bit-exact", what, bad, device);
}

static void fill_pattern(int device, void *p, uint64_t len, uint32_t seed) {
  bench_ck(cudaSetDevice(device), "cudaSetDevice");
  bench_ck((cudaError_t)gk_fill(p, len, seed, NULL), "gk_fill");
  bench_ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

static int iters_for(uint64_t size) { return size >= 4 * GiB ? 3 : size >= GiB ? 5 : 10; }

/* Raw copy of size bytes from device 0 to 1 on a stream of device `on`: seconds (median). */
static double raw_peer(void *dst, void *src, uint64_t size, int on, int async) {
  cudaStream_t s;
  double t[16];
  int n = iters_for(size);
  bench_ck(cudaSetDevice(on), "cudaSetDevice");
  bench_ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int i = -1; i < n; i++) {
    uint64_t t0 = gh_now_ns();
    if (async) {
      bench_ck(cudaMemcpyPeerAsync(dst, 1, src, 0, size, s), "cudaMemcpyPeerAsync");
      bench_ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    } else {
      bench_ck(cudaMemcpyPeer(dst, 1, src, 0, size), "cudaMemcpyPeer");
    }
    if (i >= 0)
      t[i] = (double)(gh_now_ns() - t0) / 1e9;
  }
  bench_ck(cudaStreamDestroy(s), "cudaStreamDestroy");
  return bench_median(t, n);
}

static double engine_pair(gpupool__bpool *ps, gpupool__bpool *pd, uint64_t size) {
  gpupool__bslab s, d;
  gpupool__bcopy_seg seg;
  double t[16];
  int n = iters_for(size);
  mkslab(ps, size, &s);
  mkslab(pd, size, &d);
  fill_pattern(0, s.priv, size, 5);
  memset(&seg, 0, sizeof(seg));
  seg.src = (gpupool__bloc){ps, &s, 0};
  seg.dst[0] = (gpupool__bloc){pd, &d, 0};
  seg.len = size;
  for (int i = -1; i < n; i++) {
    double x = job(&seg, 1, 1);
    if (i >= 0)
      t[i] = x;
  }
  check_pattern(1, d.priv, size, 5, "engine copy");
  be->ops->slab_free(ps, &s);
  be->ops->slab_free(pd, &d);
  return bench_median(t, n);
}

/* The notifier against spinning, per size: medians in seconds. */
static void bench_notify(void) {
  static const uint64_t sizes[] = {MiB, 256 * MiB};
  gpupool__bpool *ps = mkpool("src", 0, GiB), *pd = mkpool("dst", 1, GiB);
  int nfd = be->ops->copy_notify_fd ? be->ops->copy_notify_fd(be) : -1;
  if (nfd < 0)
    die("the CUDA backend has no copy notifier");
  bench_row(table, "\n| GPU 0 -> GPU 1, one-destination job | copy_start (us) | end seen spinning on copy_poll (us) "
      "| end seen through the notifier (us) | notifier - spinning (us) |\n| --- | --- | --- | --- | --- |\n");
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    uint64_t size = sizes[i], junk;
    gpupool__bslab s, d;
    gpupool__bcopy_seg seg;
    double tstart[20], tspin[20], tfd[20];
    const int n = 20;
    mkslab(ps, size, &s);
    mkslab(pd, size, &d);
    fill_pattern(0, s.priv, size, 6);
    memset(&seg, 0, sizeof(seg));
    seg.src = (gpupool__bloc){ps, &s, 0};
    seg.dst[0] = (gpupool__bloc){pd, &d, 0};
    seg.len = size;
    for (int k = -1; k < n; k++) {
      double x = job(&seg, 1, 1); /* spinning */
      gpupool__bcopy *c = NULL;
      struct pollfd pf = {.fd = nfd, .events = POLLIN};
      uint64_t t0;
      int rc;
      gh_sleep_ms(2);
      while (read(nfd, &junk, sizeof junk) > 0) {
      }
      if (k >= 0) {
        tspin[k] = x;
        tstart[k] = last_start;
      }
      gh_sleep_ms(2);
      t0 = gh_now_ns();
      if ((rc = be->ops->copy_start(be, &seg, 1, 1, &c)) < 0)
        die("copy_start: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
      if (poll(&pf, 1, 5000) != 1)
        die("the notifier was not written within 5 s of a %" PRIu64 "-byte job", size);
      x = (double)(gh_now_ns() - t0) / 1e9;
      while ((rc = be->ops->copy_poll(c)) == 0)
        sched_yield();
      if (rc < 0)
        die("copy_poll: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
      be->ops->copy_free(c);
      if (k >= 0)
        tfd[k] = x;
    }
    check_pattern(1, d.priv, size, 6, "engine copy");
    be->ops->slab_free(ps, &s);
    be->ops->slab_free(pd, &d);
    printf("BENCH copy_notify_start_%" PRIu64 "_us %.1f\n", size, bench_median(tstart, n) * 1e6);
    printf("BENCH copy_notify_spin_%" PRIu64 "_us %.1f\n", size, bench_median(tspin, n) * 1e6);
    printf("BENCH copy_notify_fd_%" PRIu64 "_us %.1f\n", size, bench_median(tfd, n) * 1e6);
    bench_row(table, "| %" PRIu64 " MiB | %.1f | %.1f | %.1f | %.1f |\n", size / MiB, bench_median(tstart, n) * 1e6,
        bench_median(tspin, n) * 1e6, bench_median(tfd, n) * 1e6,
        (bench_median(tfd, n) - bench_median(tspin, n)) * 1e6);
  }
  be->ops->pool_destroy(ps);
  be->ops->pool_destroy(pd);
}

static void bench_pair(int staged) {
  static const uint64_t sizes[] = {64 * MiB, 256 * MiB, GiB, 4 * GiB};
  gpupool__bpool *ps = mkpool("src", 0, 4 * GiB), *pd = mkpool("dst", 1, 4 * GiB);
  int can = 0;

  bench_ck(cudaDeviceCanAccessPeer(&can, 1, 0), "cudaDeviceCanAccessPeer");
  if (staged) {
    setenv("GPUPOOL_NO_PEER", "1", 1);
    bench_row(table, "\n| GPU 0 -> GPU 1, no peer access | cudaMemcpyPeer GB/s | engine staged GB/s | engine / raw |\n"
        "| --- | --- | --- | --- |\n");
  } else {
    if (!can)
      printf("NOTE: device 1 cannot access device 0 as a peer: the peer rows compare staged copies\n");
    bench_row(table, "\n| GPU 0 -> GPU 1, peer access | raw cudaMemcpyPeerAsync GB/s (target's stream / source's) "
        "| engine GB/s | engine / best raw |\n| --- | --- | --- | --- |\n");
  }
  for (size_t i = staged ? 1 : 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    uint64_t size = sizes[i];
    void *a = NULL, *b = NULL;
    double raw_pull, raw_push = 0, raw, eng;
    bench_ck(cudaSetDevice(0), "cudaSetDevice");
    bench_ck(cudaMalloc(&a, size), "cudaMalloc");
    fill_pattern(0, a, size, 3);
    bench_ck(cudaSetDevice(1), "cudaSetDevice");
    bench_ck(cudaMalloc(&b, size), "cudaMalloc");
    if (!staged && can) {
      cudaError_t e;
      bench_ck(cudaSetDevice(1), "cudaSetDevice");
      e = cudaDeviceEnablePeerAccess(0, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        bench_ck(e, "cudaDeviceEnablePeerAccess");
      bench_ck(cudaSetDevice(0), "cudaSetDevice");
      e = cudaDeviceEnablePeerAccess(1, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        bench_ck(e, "cudaDeviceEnablePeerAccess");
      (void)cudaGetLastError();
    }
    if (staged) {
      raw = raw_pull = raw_peer(b, a, size, 1, 0);
    } else {
      raw_pull = raw_peer(b, a, size, 1, 1);
      raw_push = raw_peer(b, a, size, 0, 1);
      raw = raw_pull < raw_push ? raw_pull : raw_push;
    }
    check_pattern(1, b, size, 3, "raw copy");
    bench_ck(cudaFree(a), "cudaFree");
    bench_ck(cudaFree(b), "cudaFree");
    eng = engine_pair(ps, pd, size);
    printf("BENCH copy_%s_raw_%" PRIu64 "_gbps %.1f\n", staged ? "staged" : "peer", size,
           (double)size / raw / 1e9);
    printf("BENCH copy_%s_engine_%" PRIu64 "_gbps %.1f\n", staged ? "staged" : "peer", size,
           (double)size / eng / 1e9);
    if (staged)
      bench_row(table, "| %" PRIu64 " MiB | %.1f | %.1f | %.2fx |\n", size / MiB, (double)size / raw / 1e9,
          (double)size / eng / 1e9, raw / eng);
    else
      bench_row(table, "| %" PRIu64 " MiB | %.1f / %.1f | %.1f | %.1f%% |\n", size / MiB,
          (double)size / raw_pull / 1e9, (double)size / raw_push / 1e9, (double)size / eng / 1e9,
          100.0 * raw / eng);
  }
  be->ops->pool_destroy(ps);
  be->ops->pool_destroy(pd);
  unsetenv("GPUPOOL_NO_PEER");
}

/* The state dict: Llama-3-8B-shaped (hidden 4096, MLP 14336, 8 KV heads of 128, vocabulary
 * 128256, 32 layers), tied embeddings: 290 tensors, bf16. bench/broadcast_nccl.py lays out the
 * same list. */
#define NT 290
static uint64_t tensor_bytes[NT];

static int layout(void) {
  const uint64_t h = 4096, inter = 14336, kv = 1024, vocab = 128256;
  int n = 0;
  tensor_bytes[n++] = vocab * h * 2;
  for (int l = 0; l < 32; l++) {
    const uint64_t sz[9] = {h * h, kv * h, kv * h, h * h, inter * h, inter * h, h * inter, h, h};
    for (int i = 0; i < 9; i++)
      tensor_bytes[n++] = sz[i] * 2;
  }
  tensor_bytes[n++] = h * 2;
  return n;
}

/* Overwrite every target slab (outside the timed part), so each variant's check sees what
 * that variant wrote. */
static void clear_targets(gpupool__bslab (*slab)[8], int ndst, int nslab) {
  for (int h = 1; h <= ndst; h++) {
    bench_ck(cudaSetDevice(h), "cudaSetDevice");
    for (int s = 0; s < nslab; s++)
      bench_ck(cudaMemset(slab[h][s].priv, 0xa5, slab[h][s].size), "cudaMemset");
    bench_ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
}

static void check_targets(gpupool__bslab (*slab)[8], int ndst, int nt, const int *slab_of,
                          const uint64_t *off, const char *what) {
  for (int h = 1; h <= ndst; h++)
    for (int i = 0; i < nt; i++)
      check_pattern(h, (char *)slab[h][slab_of[i]].priv + off[i], tensor_bytes[i],
                    1000 + (uint32_t)i, what);
}

static void bench_broadcast(int ngpu) {
  int nt = layout(), ndst = ngpu - 1 < 3 ? ngpu - 1 : 3, nslab = 0, rc;
  uint64_t total = 0, used[8] = {0}, off[NT];
  int slab_of[NT];
  gpupool__bpool *pool[4];
  gpupool__bslab slab[4][8];
  gpupool__bcopy_seg *segs = calloc(NT, sizeof(*segs)), *fan[3];
  size_t nfan[3];
  double tc[5], tf[5], ts[3], tstart[5];
  int n = 5;

  if (!segs)
    die("out of memory");
  /* Pack the tensors into 4 GiB slabs, 256-byte aligned, in order. */
  for (int i = 0; i < nt; i++) {
    uint64_t at = (used[nslab] + 255) & ~255ull;
    if (at + tensor_bytes[i] > GPUPOOL_SLAB_HARD_MAX) {
      nslab++;
      at = 0;
    }
    off[i] = at;
    slab_of[i] = nslab;
    used[nslab] = at + tensor_bytes[i];
    total += tensor_bytes[i];
  }
  nslab++;
  for (int g = 0; g <= ndst; g++) {
    char name[16];
    snprintf(name, sizeof(name), "gpu%d", g);
    pool[g] = mkpool(name, g, (uint64_t)nslab * GPUPOOL_SLAB_HARD_MAX);
    for (int s = 0; s < nslab; s++)
      mkslab(pool[g], used[s], &slab[g][s]);
  }
  bench_ck(cudaSetDevice(0), "cudaSetDevice");
  for (int i = 0; i < nt; i++)
    bench_ck((cudaError_t)gk_fill((char *)slab[0][slab_of[i]].priv + off[i], tensor_bytes[i],
                            1000 + (uint32_t)i, NULL), "gk_fill");
  bench_ck(cudaSetDevice(0), "cudaSetDevice");
  bench_ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  printf("BENCH_INFO broadcast %d tensors, %.2f GB (%.2f GiB) in %d slabs per GPU, GPU 0 -> %d GPUs\n",
         nt, (double)total / 1e9, (double)total / GiB, nslab, ndst);
  for (int i = 0; i < nt; i++) {
    segs[i].src = (gpupool__bloc){pool[0], &slab[0][slab_of[i]], off[i]};
    for (int h = 0; h < ndst; h++)
      segs[i].dst[h] = (gpupool__bloc){pool[h + 1], &slab[h + 1][slab_of[i]], off[i]};
    segs[i].len = tensor_bytes[i];
  }
  for (int h = 0; h < ndst; h++) {
    fan[h] = calloc(NT, sizeof(**fan));
    if (!fan[h])
      die("out of memory");
    for (int i = 0; i < nt; i++) {
      fan[h][i].src = segs[i].src;
      fan[h][i].dst[0] = segs[i].dst[h];
      fan[h][i].len = segs[i].len;
    }
    nfan[h] = (size_t)nt;
  }
  /* Every variant's last run is checked: every tensor on every target against its seed. */
  for (int i = -1; i < n; i++) {
    double x;
    clear_targets(slab, ndst, nslab);
    x = job(segs, (size_t)nt, ndst);
    if (i >= 0) {
      tc[i] = x;
      tstart[i] = last_start;
    }
  }
  check_targets(slab, ndst, nt, slab_of, off, "chained broadcast");
  for (int i = -1; i < n; i++) {
    double x;
    clear_targets(slab, ndst, nslab);
    x = jobs(fan, nfan, ndst);
    if (i >= 0)
      tf[i] = x;
  }
  check_targets(slab, ndst, nt, slab_of, off, "fan-out broadcast");
  setenv("GPUPOOL_NO_PEER", "1", 1);
  for (int i = 0; i < 3; i++) {
    clear_targets(slab, ndst, nslab);
    ts[i] = job(segs, (size_t)nt, ndst);
  }
  unsetenv("GPUPOOL_NO_PEER");
  check_targets(slab, ndst, nt, slab_of, off, "staged broadcast");
  printf("BENCH copy_broadcast_chain_ms %.2f\n", bench_median(tc, n) * 1e3);
  printf("BENCH copy_broadcast_start_ms %.2f\n", bench_median(tstart, n) * 1e3);
  printf("BENCH copy_broadcast_fanout_ms %.2f\n", bench_median(tf, n) * 1e3);
  printf("BENCH copy_broadcast_staged_ms %.2f\n", bench_median(ts, 3) * 1e3);
  bench_row(table, "\n| broadcast, %d bf16 tensors %.2f GB, GPU 0 -> %d GPUs | ms (median) | GB/s per target |\n"
      "| --- | --- | --- |\n", nt, (double)total / 1e9, ndst);
  bench_row(table, "| engine, one chained job (0 -> 1 -> 2 -> 3), peer | %.1f | %.1f |\n", bench_median(tc, n) * 1e3,
      (double)total / bench_median(tc, n) / 1e9);
  bench_row(table, "| (of which copy_start on the caller's thread, queueing the chained job) | %.1f | |\n",
      bench_median(tstart, n) * 1e3);
  bench_row(table, "| engine, %d one-destination jobs at once (GPU 0 fans out), peer | %.1f | %.1f |\n", ndst,
      bench_median(tf, n) * 1e3, (double)total / bench_median(tf, n) / 1e9);
  bench_row(table, "| engine, one chained job, staged (GPUPOOL_NO_PEER=1) | %.1f | %.1f |\n",
      bench_median(ts, 3) * 1e3, (double)total / bench_median(ts, 3) / 1e9);
  for (int g = 0; g <= ndst; g++) {
    for (int s = 0; s < nslab; s++)
      be->ops->slab_free(pool[g], &slab[g][s]);
    be->ops->pool_destroy(pool[g]);
  }
  for (int h = 0; h < ndst; h++)
    free(fan[h]);
  free(segs);
  (void)rc;
}

int main(int argc, char **argv) {
  int ngpu, rc;
  const char *mode;
  if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    printf("usage: %s peer|staged|broadcast|notify [--table FILE]\n"
           "The CUDA copy engine against cudaMemcpyPeerAsync (peer), cudaMemcpyPeer without\n"
           "peer access (staged), a 290-tensor broadcast from GPU 0 to GPUs 1-3 (broadcast), and\n"
           "what learning of a job's end costs, spinning or through the notifier (notify);\n"
           "two GPUs or more. tools/gpu-bench.sh multi runs all three.\n", argv[0]);
    return 0;
  }
  if (argc != 2 && !(argc == 4 && !strcmp(argv[2], "--table"))) {
    fprintf(stderr, "usage: %s peer|staged|broadcast|notify [--table FILE]\n", argv[0]);
    return 2;
  }
  mode = argv[1];
  setvbuf(stdout, NULL, _IOLBF, 0);
  ngpu = gh_gpu_count_or_skip(2, "the copy-engine benchmark");
  if (argc == 4 && !(table = fopen(argv[3], "a")))
    die("cannot open %s", argv[3]);
  if ((rc = gpupool__backend_open(&gpupool__backend_cuda, &be)) < 0)
    die("open the CUDA backend: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  if (!strcmp(mode, "peer"))
    bench_pair(0);
  else if (!strcmp(mode, "staged"))
    bench_pair(1);
  else if (!strcmp(mode, "broadcast"))
    bench_broadcast(ngpu);
  else if (!strcmp(mode, "notify"))
    bench_notify();
  else
    die("unknown mode %s", mode);
  be->ops->close(be);
  if (table)
    fclose(table);
  return 0;
}
