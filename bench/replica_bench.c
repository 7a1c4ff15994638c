/*
 * Replicas end to end through gpupoold, as a user sees them, on one machine with two GPUs or
 * more: the figures bench/copy_bench.c takes of the copy engine alone, taken again through a
 * private gpupoold (a device pool on each GPU, up to 4) and real client processes. Every
 * replica read is checked bit-exact on its device.
 *
 *   gpupool_replica_bench peer GPUPOOLD GPUPOOLCTL
 *       1 MiB and 64 MiB .. 4 GiB published on GPU 0; one getter process with
 *       GPUPOOL_ON_DEVICE(1): time from the get's call until the replica is usable (get
 *       returned + stream synchronized), against raw cudaMemcpyPeerAsync of the same bytes
 *       GPU 0 -> GPU 1 (peer access on; on the target's stream and the source's, the faster)
 *       measured in this run. The 1 MiB row is the fixed cost of a get that makes a replica.
 *   gpupool_replica_bench staged GPUPOOLD GPUPOOLCTL
 *       256 MiB .. 4 GiB the same way, gpupoold started with GPUPOOL_NO_PEER=1 (its copy
 *       engine stages through pinned host memory), against cudaMemcpyPeer without peer access.
 *   gpupool_replica_bench broadcast GPUPOOLD GPUPOOLCTL
 *       a 290-tensor bf16 state dict (the one copy_bench.c and broadcast_nccl.py lay out, 15.0
 *       GB) published on GPU 0 with gpupool_bundle_publish_to devices {1, 2, 3}; a getter
 *       process on each of GPUs 1-3, already waiting (newer_than the last version) when the
 *       publish is called: time from the publish call until all three hold usable replicas
 *       (clock: CLOCK_MONOTONIC, one for every process). Needs 4 GPUs for 1 -> 3; with 2 or 3
 *       it broadcasts to the GPUs there are and says so.
 *   gpupool_replica_bench getters GPUPOOLD GPUPOOLCTL
 *       8 getter processes on GPU 1 ask at once for a 256 MiB version on GPU 0: all bit-exact,
 *       all holding the same replica, and the daemon's replica_copies counter (gpupoolctl
 *       stats) grew by exactly 1; fails otherwise.
 *
 * Options after the paths: --table FILE appends the markdown table to FILE; --quick takes two
 * runs of each figure (to check that the benchmark runs, not for numbers). Times are medians
 * of several runs after one warm-up. Prints "BENCH key value" lines and a markdown table.
 * tools/gpu-bench.sh multi runs every mode, each in a process of its own (peer access, once
 * enabled in a process, stays). Exit 0, 1 on a failure (wrong data, wrong counter), 77 with
 * fewer than two GPUs.
 *
 * Workers are this executable re-executed with "worker ROLE ...", talking to the driver line
 * by line over their stdin and stdout.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#define BENCH_PROG "replica_bench"
#include "bench_util.h"
#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpu_worker.h"
#include "gpupool/gpupool.h"

#define MiB ((uint64_t)1 << 20)
#define GiB ((uint64_t)1 << 30)
#define STEP_MS 300000
#define NGETTERS 8
#define MAXDEV 4

#define USAGE "peer|staged|broadcast|getters GPUPOOLD GPUPOOLCTL [--table FILE] [--quick]"

static FILE *table;
static int quick;


static int iters_for(uint64_t size) {
  if (quick)
    return 2;
  return size >= 4 * GiB ? 3 : size >= GiB ? 5 : 10;
}

/* The state dict: Llama-3-8B-shaped (hidden 4096, MLP 14336, 8 KV heads of 128, vocabulary
 * 128256, 32 layers), tied embeddings: 290 tensors, bf16. The list of copy_bench.c and
 * broadcast_nccl.py. */
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

/* ------------------------------------------------------------------ worker side */

static void read_cmd(const char *role, char *line, size_t len) {
  if (!fgets(line, (int)len, stdin)) {
    fprintf(stderr, "worker %s: stdin closed\n", role);
    exit(2);
  }
  line[strcspn(line, "\n")] = '\0';
}

/* producer SOCK NAME BYTES SEED: allocates BYTES in gpu0 and fills them with SEED's pattern;
 * then, for each "PUB" line, publishes the buffer again (a new version: new replicas) and
 * says "V <version> <buffer id>"; on "EXIT" unpublishes and says DONE. */
static int w_producer(char **a) {
  const char *role = "producer", *sock = a[0], *name = a[1];
  size_t bytes = (size_t)strtoull(a[2], NULL, 0);
  uint32_t seed = (uint32_t)strtoul(a[3], NULL, 0);
  cudaStream_t s = wstream(role, 0);
  gpupool_tensor_meta meta;
  gpupool_client *c;
  gpupool_buffer *b;
  char line[128];
  uint64_t v;
  int rc, ce;

  if ((rc = gpupool_client_connect(sock, "replica-bench-producer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie(role, "gpupool_client_connect", rc);
  if ((rc = gpupool_buffer_alloc(c, "gpu0", bytes, STEP_MS, s, &b)) < 0)
    wdie(role, "gpupool_buffer_alloc", rc);
  if ((ce = gk_fill(gpupool_buffer_ptr(b), bytes, seed, s)) || (ce = cudaStreamSynchronize(s)))
    cdie(role, "fill kernel", ce);
  memset(&meta, 0, sizeof(meta));
  meta.dtype_code = GPUPOOL_DTYPE_UINT;
  meta.dtype_bits = 32;
  meta.dtype_lanes = 1;
  meta.ndim = 1;
  meta.shape[0] = (int64_t)(bytes / 4);
  gh_say("READY");
  for (;;) {
    read_cmd(role, line, sizeof line);
    if (!strcmp(line, "EXIT"))
      break;
    if ((rc = gpupool_buffer_publish(b, name, &meta, s, &v)) < 0)
      wdie(role, "gpupool_buffer_publish", rc);
    gh_say("V %" PRIu64 " %" PRIu64, v, gpupool_buffer_id(b));
  }
  if ((rc = gpupool_buffer_release(b, s)) < 0)
    wdie(role, "gpupool_buffer_release", rc);
  if ((rc = gpupool_name_unpublish(c, name)) < 0)
    wdie(role, "gpupool_name_unpublish", rc);
  wfinish(role, c, s);
  gh_say("DONE");
  return 0;
}

/* bproducer SOCK NAME NDEV: allocates the state dict as a bundle in gpu0, member i filled with
 * pattern 1000+i; then, for each "PUB" line, publishes it again with replicas on devices
 * 1..NDEV (gpupool_bundle_publish_to) and says "V <version> <clock before the call>
 * <clock after>"; on "EXIT" unpublishes and says DONE. */
static int w_bproducer(char **a) {
  const char *role = "bproducer", *sock = a[0], *name = a[1];
  int ndev = atoi(a[2]), nt = layout(), rc, ce, devs[MAXDEV];
  cudaStream_t s = wstream(role, 0);
  gpupool_member_spec spec[NT];
  char names[NT][16], line[128];
  gpupool_client *c;
  gpupool_bundle *b;
  gpupool_member m;
  uint64_t v, t0, t1;

  for (int i = 0; i < nt; i++) {
    snprintf(names[i], sizeof names[i], "t%d", i);
    spec[i] = (gpupool_member_spec){names[i], tensor_bytes[i], NULL};
  }
  for (int d = 0; d < ndev; d++)
    devs[d] = d + 1;
  if ((rc = gpupool_client_connect(sock, "replica-bench-bproducer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie(role, "gpupool_client_connect", rc);
  if ((rc = gpupool_bundle_alloc(c, "gpu0", spec, nt, 0, STEP_MS, s, &b)) < 0)
    wdie(role, "gpupool_bundle_alloc", rc);
  for (int i = 0; i < nt; i++) {
    gpupool_bundle_member(b, i, &m);
    if ((ce = gk_fill(m.ptr, m.size, 1000 + (uint32_t)i, s)))
      cdie(role, "fill kernel", ce);
  }
  if ((ce = cudaStreamSynchronize(s)))
    cdie(role, "cudaStreamSynchronize", ce);
  gh_say("READY %d", gpupool_bundle_buffers(b));
  for (;;) {
    read_cmd(role, line, sizeof line);
    if (!strcmp(line, "EXIT"))
      break;
    t0 = gh_now_ns();
    rc = gpupool_bundle_publish_to(b, name, s, devs, ndev, &v);
    t1 = gh_now_ns();
    if (rc < 0)
      wdie(role, "gpupool_bundle_publish_to", rc);
    gh_say("V %" PRIu64 " %" PRIu64 " %" PRIu64, v, t0, t1);
  }
  if ((rc = gpupool_bundle_release(b, s)) < 0)
    wdie(role, "gpupool_bundle_release", rc);
  if ((rc = gpupool_name_unpublish(c, name)) < 0)
    wdie(role, "gpupool_name_unpublish", rc);
  wfinish(role, c, s);
  gh_say("DONE");
  return 0;
}

/* getter SOCK NAME KIND SEED DEVICE (KIND buffer or bundle): for each "GET <newer_than>" line,
 * says WAITING, gets NAME on DEVICE (GPUPOOL_ON_DEVICE), synchronizes its stream, then checks
 * every byte on DEVICE against the pattern (SEED for a buffer, 1000+i for member i of a
 * bundle), releases, and says "T <clock at the call> <clock when usable> <mismatching words>
 * <buffer id> <version> <clock when the get returned> <ns of a second get> <address>": a
 * buffer is then got again once released (its replica now ready: what any get costs, for the
 * breakdown; 0 for a bundle); the address is the buffer's (a bundle's first buffer's) in this
 * process, the same from version to version when the replica went in the slab of the one
 * before. Stops on "EXIT". */
static int w_getter(char **a) {
  const char *role = "getter", *sock = a[0], *name = a[1];
  int bundle = !strcmp(a[2], "bundle"), dev = atoi(a[4]), rc, ce;
  uint32_t seed = (uint32_t)strtoul(a[3], NULL, 0);
  unsigned flags = GPUPOOL_READ_ONLY | GPUPOOL_ON_DEVICE(dev);
  cudaStream_t s = wstream(role, dev);
  gpupool_client *c;
  char line[128];

  if (bundle)
    layout();
  if ((rc = gpupool_client_connect(sock, "replica-bench-getter", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie(role, "gpupool_client_connect", rc);
  gh_say("READY");
  for (;;) {
    unsigned long long bad = 0, n;
    uint64_t newer, t0, t1, tr, again = 0, id, v = 0, addr;
    read_cmd(role, line, sizeof line);
    if (!strcmp(line, "EXIT"))
      break;
    if (sscanf(line, "GET %" SCNu64, &newer) != 1) {
      fprintf(stderr, "worker getter: unknown command '%s'\n", line);
      return 2;
    }
    gh_say("WAITING");
    if (!bundle) {
      gpupool_buffer *b;
      t0 = gh_now_ns();
      if ((rc = gpupool_buffer_get(c, name, newer, STEP_MS, flags, s, &b, &v)) < 0)
        wdie(role, "gpupool_buffer_get", rc);
      tr = gh_now_ns();
      if ((ce = cudaStreamSynchronize(s)))
        cdie(role, "cudaStreamSynchronize", ce);
      t1 = gh_now_ns();
      if (gpupool_buffer_device(b) != dev) {
        fprintf(stderr, "worker getter: the buffer got on device %d is on device %d\n", dev,
                gpupool_buffer_device(b));
        return 1;
      }
      if ((ce = gk_count_mismatches(gpupool_buffer_ptr(b), gpupool_buffer_size(b), seed, s, &bad)))
        cdie(role, "mismatch kernel", ce);
      id = gpupool_buffer_id(b);
      addr = (uint64_t)(uintptr_t)gpupool_buffer_ptr(b);
      if ((rc = gpupool_buffer_release(b, s)) < 0)
        wdie(role, "gpupool_buffer_release", rc);
      if ((ce = cudaStreamSynchronize(s)))
        cdie(role, "cudaStreamSynchronize", ce);
      {
        uint64_t a0 = gh_now_ns();
        if ((rc = gpupool_buffer_get(c, name, newer, STEP_MS, flags, s, &b, NULL)) < 0)
          wdie(role, "gpupool_buffer_get (again)", rc);
        if ((ce = cudaStreamSynchronize(s)))
          cdie(role, "cudaStreamSynchronize", ce);
        again = gh_now_ns() - a0;
        if (gpupool_buffer_id(b) != id) {
          fprintf(stderr, "worker getter: a second get of the version gave buffer %" PRIu64 ", not its replica %" PRIu64
                  ": a second copy\n", gpupool_buffer_id(b), id);
          return 1;
        }
        if ((rc = gpupool_buffer_release(b, s)) < 0)
          wdie(role, "gpupool_buffer_release", rc);
      }
    } else {
      gpupool_bundle *b;
      gpupool_member m;
      t0 = gh_now_ns();
      if ((rc = gpupool_bundle_get(c, name, newer, STEP_MS, flags, s, &b)) < 0)
        wdie(role, "gpupool_bundle_get", rc);
      tr = gh_now_ns();
      if ((ce = cudaStreamSynchronize(s)))
        cdie(role, "cudaStreamSynchronize", ce);
      t1 = gh_now_ns();
      v = gpupool_bundle_version(b);
      if (gpupool_bundle_count(b) != NT) {
        fprintf(stderr, "worker getter: the bundle has %d members, not %d\n", gpupool_bundle_count(b), NT);
        return 1;
      }
      for (int i = 0; i < gpupool_bundle_buffers(b); i++)
        if (gpupool_buffer_device(gpupool_bundle_buffer(b, i)) != dev) {
          fprintf(stderr, "worker getter: buffer %d of the bundle got on device %d is on device %d\n", i,
                  dev, gpupool_buffer_device(gpupool_bundle_buffer(b, i)));
          return 1;
        }
      for (int i = 0; i < NT; i++) {
        gpupool_bundle_member(b, i, &m);
        if (m.size != tensor_bytes[i]) {
          fprintf(stderr, "worker getter: member %d has %" PRIu64 " bytes, not %" PRIu64 "\n", i, m.size,
                  tensor_bytes[i]);
          return 1;
        }
        if ((ce = gk_count_mismatches(m.ptr, m.size, 1000 + (uint32_t)i, s, &n)))
          cdie(role, "mismatch kernel", ce);
        bad += n;
      }
      id = gpupool_buffer_id(gpupool_bundle_buffer(b, 0));
      addr = (uint64_t)(uintptr_t)gpupool_buffer_ptr(gpupool_bundle_buffer(b, 0));
      if ((rc = gpupool_bundle_release(b, s)) < 0)
        wdie(role, "gpupool_bundle_release", rc);
    }
    if ((ce = cudaStreamSynchronize(s)))
      cdie(role, "cudaStreamSynchronize", ce);
    gh_say("T %" PRIu64 " %" PRIu64 " %llu %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64, t0, t1, bad, id,
           v, tr, again, addr);
  }
  wfinish(role, c, s);
  gh_say("DONE");
  return 0;
}

static int worker_main(int argc, char **argv) {
  static const struct {
    const char *role;
    int nargs;
    int (*fn)(char **);
  } roles[] = {{"producer", 4, w_producer}, {"bproducer", 3, w_bproducer}, {"getter", 5, w_getter}};
  setvbuf(stdout, NULL, _IOLBF, 0);
  for (size_t i = 0; i < sizeof(roles) / sizeof(roles[0]); i++)
    if (!strcmp(argv[2], roles[i].role)) {
      if (argc - 3 != roles[i].nargs) {
        fprintf(stderr, "worker %s: %d arguments, expected %d\n", argv[2], argc - 3, roles[i].nargs);
        return 2;
      }
      return roles[i].fn(argv + 3);
    }
  fprintf(stderr, "unknown worker role %s\n", argv[2]);
  return 2;
}

/* ------------------------------------------------------------------ driver side */

static const char *g_gpupoold, *g_ctl;
static gh_daemon g_d;
static int g_up;

static void stop_daemon(int print_log) {
  if (g_up) {
    gh_daemon_stop(&g_d, print_log);
    g_up = 0;
  }
}

/* A failure on the driver's side: the daemon's log, then the reason. */
static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...) {
  va_list ap;
  stop_daemon(1);
  fprintf(stderr, "replica_bench: FAIL: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  exit(1);
}

/* A private gpupoold with a device pool gpuK of cap bytes on each of GPUs 0..ndev-1. */
static void start_daemon(int ndev, const char *cap) {
  char conf[1024];
  size_t n = 0;
  for (int g = 0; g < ndev; g++)
    n += (size_t)snprintf(conf + n, sizeof conf - n,
                          "[pool gpu%d]\nkind = device\ndevice = %d\ncapacity = %s\nslab_size = 256M\n", g,
                          g, cap);
  if (gh_daemon_start_conf(&g_d, g_gpupoold, NULL, conf) < 0)
    die("gpupoold did not start with a pool on each of GPUs 0..%d (its log above)", ndev - 1);
  g_up = 1;
}

static void spawn(gh_proc *p, const char *const *argv) {
  if (gh_spawn(p, argv, NULL, 0) < 0)
    fail("cannot start worker %s", argv[2]);
}

static void expect(gh_proc *p, const char *prefix, char *line, size_t len, const char *who) {
  if (gh_expect(p, prefix, line, len, STEP_MS) < 0)
    fail("%s said no %s (its stderr above)", who, prefix);
}

static void say(gh_proc *p, const char *line, const char *who) {
  if (gh_writeline(p, line) < 0)
    fail("cannot write to %s (it died? its stderr above)", who);
}

static void finish(gh_proc *p, const char *who) {
  char line[256];
  say(p, "EXIT", who);
  expect(p, "DONE", line, sizeof line, who);
  if (gh_wait(p, STEP_MS) != 0)
    fail("%s failed", who);
}

/* The daemon's replica_copies counter, from gpupoolctl stats. */
static uint64_t replica_copies(void) {
  char cmd[1024], buf[8192];
  const char *at;
  size_t n = 0;
  FILE *f;
  snprintf(cmd, sizeof cmd, "'%s' -s '%s' stats", g_ctl, g_d.sock);
  if (!(f = popen(cmd, "r")))
    fail("cannot run %s", cmd);
  while (n + 1 < sizeof buf) {
    size_t r = fread(buf + n, 1, sizeof buf - 1 - n, f);
    if (r == 0)
      break;
    n += r;
  }
  buf[n] = '\0';
  if (pclose(f) != 0)
    fail("%s failed: %s", cmd, buf);
  if (!(at = strstr(buf, "\nreplica_copies ")))
    fail("%s prints no replica_copies line:\n%s", cmd, buf);
  return strtoull(at + strlen("\nreplica_copies "), NULL, 10);
}

static void enable_peer(void) {
  int can = 0;
  bench_ck(cudaDeviceCanAccessPeer(&can, 1, 0), "cudaDeviceCanAccessPeer");
  if (!can) {
    printf("NOTE: device 1 cannot access device 0 as a peer: the raw column is a staged copy\n");
    return;
  }
  for (int d = 0; d < 2; d++) {
    cudaError_t e;
    bench_ck(cudaSetDevice(d), "cudaSetDevice");
    e = cudaDeviceEnablePeerAccess(1 - d, 0);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
      bench_ck(e, "cudaDeviceEnablePeerAccess");
    (void)cudaGetLastError();
  }
}

/* Raw copy of size bytes from device 0 to 1 on a stream of device `on` (async) or with
 * cudaMemcpyPeer: seconds, the median; the copy checked bit-exact. gap_ms: the GPUs left idle
 * that long before each timed copy (a replica's copy starts after such a gap: the getter's
 * check, its release, the next publish). */
static double raw_peer(uint64_t size, int on, int async, int gap_ms) {
  void *src = NULL, *dst = NULL;
  unsigned long long bad = 0;
  cudaStream_t s;
  double t[16];
  int n = iters_for(size);
  bench_ck(cudaSetDevice(0), "cudaSetDevice");
  bench_ck(cudaMalloc(&src, size), "cudaMalloc");
  bench_ck((cudaError_t)gk_fill(src, size, 3, NULL), "gk_fill");
  bench_ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  bench_ck(cudaSetDevice(1), "cudaSetDevice");
  bench_ck(cudaMalloc(&dst, size), "cudaMalloc");
  bench_ck(cudaMemset(dst, 0xa5, size), "cudaMemset");
  bench_ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  bench_ck(cudaSetDevice(on), "cudaSetDevice");
  bench_ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int i = -1; i < n; i++) {
    uint64_t t0;
    if (gap_ms)
      gh_sleep_ms(gap_ms);
    t0 = gh_now_ns();
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
  bench_ck(cudaSetDevice(1), "cudaSetDevice");
  bench_ck((cudaError_t)gk_count_mismatches(dst, size, 3, NULL, &bad), "gk_count_mismatches");
  if (bad)
    die("raw copy of %" PRIu64 " bytes: %llu words differ on device 1: not bit-exact", size, bad);
  bench_ck(cudaFree(dst), "cudaFree");
  bench_ck(cudaSetDevice(0), "cudaSetDevice");
  bench_ck(cudaFree(src), "cudaFree");
  return bench_median(t, n);
}

/* One "T ..." line of a getter: the clocks, checked bit-exact and at version want. */
typedef struct {
  uint64_t t0, t1, id, v, tr, again, addr;
} got_t;

static got_t read_got(gh_proc *p, uint64_t want, const char *who) {
  char line[256];
  unsigned long long bad;
  got_t g;
  expect(p, "T ", line, sizeof line, who);
  if (sscanf(line, "T %" SCNu64 " %" SCNu64 " %llu %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &g.t0,
             &g.t1, &bad, &g.id, &g.v, &g.tr, &g.again, &g.addr) != 8)
    fail("%s said '%s'", who, line);
  if (bad)
    fail("%s read %llu words that differ from the source: the replica is not bit-exact", who, bad);
  if (want && g.v != want)
    fail("%s got version %" PRIu64 ", not %" PRIu64, who, g.v, want);
  return g;
}

/* Publish (producer "PUB"): the version made, and the source buffer's id in *src. */
static uint64_t publish(gh_proc *prod, uint64_t *src) {
  char line[256];
  uint64_t v;
  say(prod, "PUB", "the producer");
  expect(prod, "V ", line, sizeof line, "the producer");
  if (sscanf(line, "V %" SCNu64 " %" SCNu64, &v, src) != 2)
    fail("the producer said '%s'", line);
  return v;
}

/* Where a get's time goes (medians, seconds): the first version's get (its replica's memory
 * made: a new slab), the get until it returned (before the stream synchronize), and a get of
 * the same version once its replica is ready (the fixed cost of any get). */
typedef struct {
  double first, returned, ready;
  int same, n; /* versions after the first whose replica lay where the one before did */
} breakdown;

/* (a) and (b): one size, one getter on GPU 1; seconds from the get's call to usable, median
 * of the versions after the first (steady state: each replica in the slab of the one before). */
static double get_pair(uint64_t size, uint32_t seed, breakdown *bd) {
  char name[64], by[32], sd[32], line[256];
  gh_proc prod, get;
  double t[16], tret[16], tready[16];
  uint64_t prev = 0;
  int n = iters_for(size);
  snprintf(name, sizeof name, "replica-bench-%" PRIu64, size);
  snprintf(by, sizeof by, "%" PRIu64, size);
  snprintf(sd, sizeof sd, "%u", seed);
  const char *pargv[] = {"", "worker", "producer", g_d.sock, name, by, sd, NULL};
  const char *gargv[] = {"", "worker", "getter", g_d.sock, name, "buffer", sd, "1", NULL};
  spawn(&prod, pargv);
  spawn(&get, gargv);
  expect(&prod, "READY", line, sizeof line, "the producer");
  expect(&get, "READY", line, sizeof line, "the getter");
  for (int i = -1; i < n; i++) {
    uint64_t src, v = publish(&prod, &src);
    got_t g;
    snprintf(line, sizeof line, "GET %" PRIu64, v - 1);
    say(&get, line, "the getter");
    g = read_got(&get, v, "the getter");
    if (g.id == src)
      fail("the getter on GPU 1 got the source buffer %" PRIu64 " itself, not a replica", src);
    if (i >= 0) {
      t[i] = (double)(g.t1 - g.t0) / 1e9;
      tret[i] = (double)(g.tr - g.t0) / 1e9;
      tready[i] = (double)g.again / 1e9;
      bd->same += g.addr == prev;
      bd->n++;
    } else {
      bd->first = (double)(g.t1 - g.t0) / 1e9;
    }
    prev = g.addr;
  }
  finish(&get, "the getter");
  finish(&prod, "the producer");
  bd->returned = bench_median(tret, n);
  bd->ready = bench_median(tready, n);
  return bench_median(t, n);
}

static void bench_pair(int staged) {
  static const uint64_t sizes[] = {MiB, 64 * MiB, 256 * MiB, GiB, 4 * GiB};
  uint32_t seed = (uint32_t)getpid() * 2654435761u;
  const char *k = staged ? "staged" : "peer";

  if (staged) {
    setenv("GPUPOOL_NO_PEER", "1", 1); /* read by the daemon's CUDA copy engine */
    bench_row(table, "\n| GPU 0 -> GPU 1 through gpupoold, GPUPOOL_NO_PEER=1 | cudaMemcpyPeer (no peer access) ms / GB/s "
        "| get on GPU 1 until usable ms / GB/s | raw / get | get - raw (us) | first version's get ms | get returned (us) "
        "| get of a ready replica (us) |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  } else {
    enable_peer();
    bench_row(table, "\n| GPU 0 -> GPU 1 through gpupoold, peer | raw cudaMemcpyPeerAsync ms / GB/s (best of target's and "
        "source's stream) | get on GPU 1 until usable ms / GB/s | raw / get | get - raw (us) | first version's get ms "
        "| get returned (us) | get of a ready replica (us) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  }
  start_daemon(2, "12G");
  for (size_t i = staged ? 2 : 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    uint64_t size = sizes[i];
    breakdown bd = {0, 0, 0, 0, 0};
    double raw, get, idle = 0;
    if (staged) {
      raw = raw_peer(size, 1, 0, 0);
    } else {
      double pull = raw_peer(size, 1, 1, 0), push = raw_peer(size, 0, 1, 0);
      raw = pull < push ? pull : push;
      /* The daemon's way (the target's stream) after the GPUs sat idle: for the breakdown. */
      idle = raw_peer(size, 1, 1, 5);
      printf("BENCH replica_peer_raw_after_idle_%" PRIu64 "_us %.1f\n", size, idle * 1e6);
    }
    get = get_pair(size, seed + (uint32_t)i, &bd);
    printf("BENCH replica_%s_raw_%" PRIu64 "_us %.1f\n", k, size, raw * 1e6);
    printf("BENCH replica_%s_get_%" PRIu64 "_us %.1f\n", k, size, get * 1e6);
    printf("BENCH replica_%s_first_get_%" PRIu64 "_us %.1f\n", k, size, bd.first * 1e6);
    printf("BENCH replica_%s_get_returned_%" PRIu64 "_us %.1f\n", k, size, bd.returned * 1e6);
    printf("BENCH replica_%s_ready_get_%" PRIu64 "_us %.1f\n", k, size, bd.ready * 1e6);
    printf("BENCH_INFO replica %s %" PRIu64 " bytes: %d of %d versions after the first had their replica at the "
           "address of the one before (its slab kept)\n", k, size, bd.same, bd.n);
    bench_row(table, "| %" PRIu64 " %s%s | %.3f / %.1f | %.3f / %.1f | %.1f%% | %.0f | %.3f | %.0f | %.0f |\n",
        size >= GiB ? size / GiB : size / MiB, size >= GiB ? "GiB" : "MiB",
        size < 64 * MiB ? " (the fixed cost of a get that makes a replica)" : "", raw * 1e3, (double)size / raw / 1e9,
        get * 1e3, (double)size / get / 1e9, 100.0 * raw / get, (get - raw) * 1e6, bd.first * 1e3, bd.returned * 1e6,
        bd.ready * 1e6);
  }
  stop_daemon(0);
  unsetenv("GPUPOOL_NO_PEER");
}

/* (c): the state dict published with gpupool_bundle_publish_to, a getter waiting on each
 * target GPU. */
static void bench_broadcast(int ngpu) {
  int nt = layout(), ndst = ngpu - 1 < 3 ? ngpu - 1 : 3, n = quick ? 2 : 5;
  char name[64], dv[16], line[256], nd[16];
  gh_proc prod, get[3];
  double t[8], tcall[8], first = 0, first_call = 0;
  uint64_t total = 0, last = 0, prev[3] = {0, 0, 0};
  int same = 0, nsame = 0;

  for (int i = 0; i < nt; i++)
    total += tensor_bytes[i];
  if (ndst < 3)
    printf("NOTE: %d GPUs: the broadcast goes to GPUs 1..%d; the 1 -> 3 figure needs 4 GPUs\n", ngpu, ndst);
  start_daemon(ndst + 1, "40G");
  snprintf(name, sizeof name, "replica-bench-dict-%d", (int)getpid());
  snprintf(nd, sizeof nd, "%d", ndst);
  const char *pargv[] = {"", "worker", "bproducer", g_d.sock, name, nd, NULL};
  spawn(&prod, pargv);
  for (int h = 0; h < ndst; h++) {
    snprintf(dv, sizeof dv, "%d", h + 1);
    const char *gargv[] = {"", "worker", "getter", g_d.sock, name, "bundle", "0", dv, NULL};
    spawn(&get[h], gargv);
    expect(&get[h], "READY", line, sizeof line, "a getter");
  }
  expect(&prod, "READY", line, sizeof line, "the producer");
  printf("BENCH_INFO replica broadcast %d tensors, %.2f GB in %s buffers, GPU 0 -> %d GPUs\n", nt,
         (double)total / 1e9, line + 6, ndst);
  for (int i = -1; i < n; i++) {
    uint64_t v, t0, t1, end = 0;
    snprintf(line, sizeof line, "GET %" PRIu64, last);
    for (int h = 0; h < ndst; h++)
      say(&get[h], line, "a getter");
    for (int h = 0; h < ndst; h++)
      expect(&get[h], "WAITING", line, sizeof line, "a getter");
    gh_sleep_ms(200); /* the getters are inside their gets, waiting for a newer version */
    say(&prod, "PUB", "the producer");
    expect(&prod, "V ", line, sizeof line, "the producer");
    if (sscanf(line, "V %" SCNu64 " %" SCNu64 " %" SCNu64, &v, &t0, &t1) != 3)
      fail("the producer said '%s'", line);
    for (int h = 0; h < ndst; h++) {
      got_t g = read_got(&get[h], v, "a getter");
      if (g.t1 > end)
        end = g.t1;
      if (i >= 0) {
        same += g.addr == prev[h];
        nsame++;
      }
      prev[h] = g.addr;
      if (g.t0 > t0)
        fail("getter on GPU %d called its get after the publish: raise the wait before publishing", h + 1);
    }
    if (i >= 0) {
      t[i] = (double)(end - t0) / 1e9;
      tcall[i] = (double)(t1 - t0) / 1e9;
    } else {
      first = (double)(end - t0) / 1e9;
      first_call = (double)(t1 - t0) / 1e9;
    }
    last = v;
  }
  for (int h = 0; h < ndst; h++)
    finish(&get[h], "a getter");
  finish(&prod, "the producer");
  stop_daemon(0);
  printf("BENCH replica_broadcast_ms %.2f\n", bench_median(t, n) * 1e3);
  printf("BENCH replica_broadcast_publish_call_ms %.2f\n", bench_median(tcall, n) * 1e3);
  printf("BENCH replica_broadcast_first_ms %.2f\n", first * 1e3);
  printf("BENCH_INFO replica broadcast: %d of %d replicas after the first version at the address of the one "
         "before (their slabs kept)\n", same, nsame);
  printf("BENCH replica_broadcast_first_publish_call_ms %.2f\n", first_call * 1e3);
  bench_row(table, "\n| broadcast through gpupoold, %d bf16 tensors %.2f GB, GPU 0 -> %d GPUs | ms (median) | GB/s per target |\n"
      "| --- | --- | --- |\n", nt, (double)total / 1e9, ndst);
  bench_row(table, "| gpupool_bundle_publish_to, from the call until every getter's replica is usable | %.1f | %.1f |\n",
      bench_median(t, n) * 1e3, (double)total / bench_median(t, n) / 1e9);
  bench_row(table, "| (of which the publish call itself) | %.1f | |\n", bench_median(tcall, n) * 1e3);
  bench_row(table, "| the first version (its replicas' memory made: new slabs), until usable | %.1f | %.1f |\n",
      first * 1e3, (double)total / first / 1e9);
  bench_row(table, "| (of which the first publish call) | %.1f | |\n", first_call * 1e3);
}

/* (d): 8 getters at once on GPU 1, one copy. */
static void bench_getters(void) {
  const uint64_t size = 256 * MiB;
  uint32_t seed = (uint32_t)getpid() * 2246822519u;
  char name[64], by[32], sd[32], line[256];
  gh_proc prod, get[NGETTERS];
  uint64_t src, v, before, after, rep = 0, t0, end = 0;

  start_daemon(2, "4G");
  snprintf(name, sizeof name, "replica-bench-getters-%d", (int)getpid());
  snprintf(by, sizeof by, "%" PRIu64, size);
  snprintf(sd, sizeof sd, "%u", seed);
  const char *pargv[] = {"", "worker", "producer", g_d.sock, name, by, sd, NULL};
  const char *gargv[] = {"", "worker", "getter", g_d.sock, name, "buffer", sd, "1", NULL};
  spawn(&prod, pargv);
  expect(&prod, "READY", line, sizeof line, "the producer");
  for (int i = 0; i < NGETTERS; i++) {
    spawn(&get[i], gargv);
    expect(&get[i], "READY", line, sizeof line, "a getter");
  }
  v = publish(&prod, &src);
  before = replica_copies();
  t0 = gh_now_ns();
  for (int i = 0; i < NGETTERS; i++)
    say(&get[i], "GET 0", "a getter");
  for (int i = 0; i < NGETTERS; i++) {
    got_t g = read_got(&get[i], v, "a getter");
    if (g.id == src)
      fail("getter %d on GPU 1 got the source buffer itself, not a replica", i);
    if (rep && g.id != rep)
      fail("getters hold replicas %" PRIu64 " and %" PRIu64 ": more than one copy was made", rep, g.id);
    rep = g.id;
    if (g.t1 > end)
      end = g.t1;
  }
  after = replica_copies();
  for (int i = 0; i < NGETTERS; i++)
    finish(&get[i], "a getter");
  finish(&prod, "the producer");
  if (after - before != 1)
    fail("%d getters on one device made %" PRIu64 " copies (gpupoolctl stats replica_copies %" PRIu64
         " -> %" PRIu64 "), not 1",
         NGETTERS, after - before, before, after);
  stop_daemon(0);
  printf("BENCH replica_getters_copies %" PRIu64 "\n", after - before);
  printf("BENCH replica_getters_ms %.2f\n", (double)(end - t0) / 1e6);
  bench_row(table, "\n| %d getters at once on GPU 1, 256 MiB on GPU 0 | value |\n| --- | --- |\n", NGETTERS);
  bench_row(table, "| copies made (gpupoolctl stats replica_copies) | %" PRIu64 " |\n", after - before);
  bench_row(table, "| from the first get until all %d hold it, bit-exact (ms) | %.1f |\n", NGETTERS,
      (double)(end - t0) / 1e6);
}

int main(int argc, char **argv) {
  const char *mode;
  int ngpu;
  if (argc >= 3 && !strcmp(argv[1], "worker"))
    return worker_main(argc, argv);
  if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    printf("usage: %s " USAGE "\n"
           "Replicas end to end through a private gpupoold (a pool on each GPU), every replica\n"
           "checked bit-exact on its device:\n"
           "  peer       one getter on GPU 1 gets 1 MiB, 64 MiB .. 4 GiB published on GPU 0\n"
           "             (GPUPOOL_ON_DEVICE(1)), against raw cudaMemcpyPeerAsync (2 GPUs)\n"
           "  staged     the same with GPUPOOL_NO_PEER=1 in the daemon's environment, against\n"
           "             cudaMemcpyPeer without peer access (2 GPUs)\n"
           "  broadcast  a 290-tensor bf16 state dict (15.0 GB) published with\n"
           "             gpupool_bundle_publish_to {1,2,3}, a getter waiting on each of GPUs 1-3\n"
           "             (4 GPUs; fewer targets with 2 or 3)\n"
           "  getters    8 getters at once on GPU 1: exactly one copy (2 GPUs)\n"
           "GPUPOOLCTL is gpupoolctl (its stats count the copies). --table FILE appends the\n"
           "markdown table to FILE; --quick takes two runs of each figure. Exit 77 with fewer\n"
           "than two GPUs. tools/gpu-bench.sh multi runs every mode.\n",
           argv[0]);
    return 0;
  }
  if (argc < 4) {
    fprintf(stderr, "usage: %s " USAGE "\n", argv[0]);
    return 2;
  }
  mode = argv[1];
  g_gpupoold = argv[2];
  g_ctl = argv[3];
  for (int i = 4; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) {
      quick = 1;
    } else if (!strcmp(argv[i], "--table") && i + 1 < argc) {
      if (!(table = fopen(argv[++i], "a")))
        die("cannot open %s", argv[i]);
    } else {
      fprintf(stderr, "usage: %s " USAGE "\n", argv[0]);
      return 2;
    }
  }
  if (strcmp(mode, "peer") && strcmp(mode, "staged") && strcmp(mode, "broadcast") && strcmp(mode, "getters")) {
    fprintf(stderr, "unknown mode %s (peer, staged, broadcast or getters)\n", mode);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN); /* a worker that died is seen as a failed write */
  setvbuf(stdout, NULL, _IOLBF, 0);
  ngpu = gh_gpu_count_or_skip(2, "replicas need a second GPU (the broadcast's 1 -> 3 figure needs 4)");
  if (ngpu > MAXDEV)
    ngpu = MAXDEV;
  layout();
  if (!strcmp(mode, "peer"))
    bench_pair(0);
  else if (!strcmp(mode, "staged"))
    bench_pair(1);
  else if (!strcmp(mode, "broadcast"))
    bench_broadcast(ngpu);
  else
    bench_getters();
  if (table)
    fclose(table);
  return 0;
}
