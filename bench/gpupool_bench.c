/*
 * gpupool benchmark: one run on GPU 0 with its own private gpupoold.
 *
 *   gpupool_bench GPUPOOLD
 *
 * GPUPOOL_BENCH_ONLY=LIST (comma-separated: socket wake raw alloc handoff bundle throughput ops
 * bw) runs only those sections; GPUPOOL_TRACE=FILE in the environment traces every process.
 *
 * Measures, in this order:
 *   - the floor of any request/reply: a 1-byte socketpair ping-pong between two processes;
 *   - the wake-up floor of a handoff whose consumer sleeps: a message to a process that has
 *     been blocked 2 ms, directly (1 hop) and through another idle process (2 hops);
 *   - raw CUDA floors without gpupool: cudaMemPoolExportPointer (1 MiB allocation),
 *     cudaMemPoolImportPointer in a second process, cudaIpcOpenEventHandle (first and later
 *     opens), cudaStreamWaitEvent on an opened IPC event;
 *   - warm gpupool_buffer_alloc (pointer usable on return) and alloc+release, p50/p99, and the
 *     ratio of alloc to the socket floor;
 *   - producer->consumer handoff for 4 KiB, 1 MiB and 64 MiB: from the producer's
 *     gpupool_buffer_publish call to the consumer holding a pointer with the ready event waited on
 *     (gpupool_buffer_get returned and its stream synchronized), p50/p99; warm (slab already mapped
 *     by the consumer) and cold (first import of the slab by a fresh consumer process);
 *   - bundle handoff from C: a Llama-3.2-1B-shaped bf16 state dict (146 members, 2.47 GB in
 *     one buffer) and 1,000 members of 64 KiB, republished as 40 versions of one name, each
 *     got by a consumer waiting with newer_than: from the producer's gpupool_bundle_publish
 *     call to the consumer holding every member's pointer with the ready event waited on and
 *     its stream synchronized; first version (cold) and the rest (warm) p50/p99; the consumer
 *     gets with GPUPOOL_KEEP_MAPPED, and the state dict once more without it;
 *   - handoffs per second with 1 producer and 4 consumers (64 KiB buffers);
 *   - warm alloc+release ops/s summed over 16 client processes;
 *   - read bandwidth of a shared 1 GiB buffer in a consumer vs a local cudaMalloc of the
 *     same size (same kernel).
 *
 * Every figure is printed as a human line and as "BENCH <key> <value>" for scripts
 * (tools/gpu-bench.sh builds its table from those). Times are CLOCK_MONOTONIC, which all
 * processes of the machine share. Worker processes are this executable re-executed with a
 * role; the parent never forks without exec, so it may use CUDA itself.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpupool/gpupool.h"

#define BENCH_PROG "gpupool_bench"
#include "bench_util.h"

#define POOL "gpu0"
#define POOL_SPEC "name=gpu0,kind=device,device=0,capacity=16G,slab=256M"
#define SLAB_BYTES (256ull << 20)
#define STEP_MS 120000

#define N_SOCKET 20000
#define N_RAW 300
#define N_ALLOC 5000
#define N_WARM 300
#define N_WARMUP 10
#define N_COLD 20
#define TP_ITEMS 2000
#define TP_WINDOW 32
#define TP_CONSUMERS 4
#define TP_BYTES (64u << 10)
#define OPS_PROCS 16
#define OPS_N 2000
#define OPS_BYTES (64u << 10)
#define BW_BYTES (1ull << 30)
#define BW_REPS 20

static double us_since(uint64_t t0) { return (double)(gh_now_ns() - t0) / 1e3; }

/* p50/p99 of v[0..n) as "<key>_p50_us"/"<key>_p99_us", with a human line. */
static double report_lat(const char *what, const char *key, double *v, size_t n) {
  char k[128];
  double p50 = gh_percentile(v, n, 50), p99 = gh_percentile(v, n, 99);
  gh_say("%-52s p50 %9.1f us  p99 %9.1f us  (n=%zu)", what, p50, p99, n);
  snprintf(k, sizeof(k), "%s_p50_us", key);
  report(k, p50);
  snprintf(k, sizeof(k), "%s_p99_us", key);
  report(k, p99);
  return p50;
}

static char *next_line(char *buf, size_t len) {
  if (!fgets(buf, (int)len, stdin))
    die("stdin closed");
  buf[strcspn(buf, "\n")] = '\0';
  return buf;
}

/* ---------------------------------------------------------------- socket floor */

static int w_echo(char **a) {
  uint8_t b;
  (void)a;
  while (read(3, &b, 1) == 1)
    if (write(3, &b, 1) != 1)
      return 1;
  return 0;
}

static double bench_socket(void) {
  int sv[2];
  gh_proc p;
  double *v = calloc(N_SOCKET, sizeof(*v));
  const char *av[] = {"", "worker", "echo", NULL};
  if (!v || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    die("socketpair: %s", strerror(errno));
  if (gh_spawn(&p, av, &sv[1], 1) < 0)
    die("cannot start the echo worker");
  close(sv[1]);
  for (int i = 0; i < N_SOCKET + 1000; i++) {
    uint8_t b = (uint8_t)i;
    uint64_t t0 = gh_now_ns();
    if (write(sv[0], &b, 1) != 1 || read(sv[0], &b, 1) != 1)
      die("echo worker went away");
    if (i >= 1000)
      v[i - 1000] = us_since(t0);
  }
  close(sv[0]);
  gh_wait(&p, 10000);
  double p50 = report_lat("socketpair 1-byte round trip (floor)", "socket_rtt", v, N_SOCKET);
  free(v);
  return p50;
}

/* ---------------------------------------------------------------- raw CUDA floors */

typedef struct {
  uint32_t type; /* 0 quit, 1 pointer export data, 2 event handle */
  uint8_t data[64];
} raw_msg;

typedef struct {
  double a_us, b_us;
} raw_reply;

/* A one-byte message with room for one fd, as send_fd and recv_fd pass it. */
typedef struct {
  char byte;
  struct iovec iov;
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr mh;
} fd_msg;

static void fd_msg_init(fd_msg *m, char byte) {
  memset(m, 0, sizeof(*m));
  m->byte = byte;
  m->iov.iov_base = &m->byte;
  m->iov.iov_len = 1;
  m->mh.msg_iov = &m->iov;
  m->mh.msg_iovlen = 1;
  m->mh.msg_control = m->u.buf;
  m->mh.msg_controllen = sizeof(m->u.buf);
}

static int send_fd(int sock, int fd) {
  fd_msg m;
  fd_msg_init(&m, 'F');
  struct cmsghdr *cm = CMSG_FIRSTHDR(&m.mh);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  return sendmsg(sock, &m.mh, 0) == 1 ? 0 : -1;
}

static int recv_fd(int sock) {
  fd_msg m;
  int fd = -1;
  fd_msg_init(&m, 0);
  if (recvmsg(sock, &m.mh, MSG_CMSG_CLOEXEC) != 1 || (m.mh.msg_flags & MSG_CTRUNC))
    return -1;
  struct cmsghdr *cm = CMSG_FIRSTHDR(&m.mh);
  if (!cm || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len != CMSG_LEN(sizeof(int)))
    return -1;
  memcpy(&fd, CMSG_DATA(cm), sizeof(int));
  return fd;
}

/* raw: fd 3 is a SOCK_SEQPACKET socket; imports the pool sent over it, then answers. */
static int w_raw(char **a) {
  cudaStream_t s = new_stream();
  cudaMemPool_t pool;
  raw_msg m;
  int fd;
  (void)a;
  if ((fd = recv_fd(3)) < 0)
    die("raw: no pool fd received");
  CK(cudaMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)fd,
                                          cudaMemHandleTypePosixFileDescriptor, 0));
  close(fd);
  while (recv(3, &m, sizeof(m), 0) == (ssize_t)sizeof(m) && m.type != 0) {
    raw_reply r = {0, 0};
    if (m.type == 1) {
      struct cudaMemPoolPtrExportData d;
      void *ptr;
      memcpy(&d, m.data, sizeof(d));
      uint64_t t0 = gh_now_ns();
      CK(cudaMemPoolImportPointer(&ptr, pool, &d));
      r.a_us = us_since(t0);
      t0 = gh_now_ns();
      CK(cudaFreeAsync(ptr, s));
      CK(cudaStreamSynchronize(s));
      r.b_us = us_since(t0);
    } else {
      cudaIpcEventHandle_t h;
      cudaEvent_t ev;
      memcpy(&h, m.data, sizeof(h));
      uint64_t t0 = gh_now_ns();
      CK(cudaIpcOpenEventHandle(&ev, h));
      r.a_us = us_since(t0);
      t0 = gh_now_ns();
      CK(cudaStreamWaitEvent(s, ev, 0));
      r.b_us = us_since(t0);
      CK(cudaStreamSynchronize(s));
      CK(cudaEventDestroy(ev));
    }
    if (send(3, &r, sizeof(r), 0) != (ssize_t)sizeof(r))
      return 1;
  }
  CK(cudaMemPoolDestroy(pool));
  CK(cudaStreamDestroy(s));
  return 0;
}

static void bench_raw(void) {
  struct cudaMemPoolProps props;
  cudaMemPool_t pool;
  cudaStream_t s = new_stream();
  double *exp_us = calloc(N_RAW, sizeof(double)), *imp_us = calloc(N_RAW, sizeof(double));
  double *unmap_us = calloc(N_RAW, sizeof(double)), *malloc_us = calloc(N_RAW, sizeof(double));
  double *open_us = calloc(N_RAW, sizeof(double)), *wait_us = calloc(N_RAW, sizeof(double));
  double *geth_us = calloc(N_RAW, sizeof(double)), first_open = 0;
  const char *av[] = {"", "worker", "raw", NULL};
  int sv[2], fd = -1;
  gh_proc p;

  if (!exp_us || !imp_us || !unmap_us || !malloc_us || !open_us || !wait_us || !geth_us)
    die("out of memory");
  memset(&props, 0, sizeof(props));
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypePosixFileDescriptor;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  props.maxSize = 4ull << 30;
  CK(cudaMemPoolCreate(&pool, &props));
  CK(cudaMemPoolExportToShareableHandle(&fd, pool, cudaMemHandleTypePosixFileDescriptor, 0));
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
    die("socketpair: %s", strerror(errno));
  if (gh_spawn(&p, av, &sv[1], 1) < 0)
    die("cannot start the raw importer");
  close(sv[1]);
  if (send_fd(sv[0], fd) < 0)
    die("cannot send the pool fd");
  close(fd);
  for (int i = 0; i < N_RAW; i++) {
    raw_msg m = {1, {0}};
    raw_reply r;
    struct cudaMemPoolPtrExportData d;
    void *ptr;
    uint64_t t0 = gh_now_ns();
    CK(cudaMallocFromPoolAsync(&ptr, 1u << 20, pool, s));
    malloc_us[i] = us_since(t0);
    CK(cudaStreamSynchronize(s));
    t0 = gh_now_ns();
    CK(cudaMemPoolExportPointer(&d, ptr));
    exp_us[i] = us_since(t0);
    memcpy(m.data, &d, sizeof(d));
    if (send(sv[0], &m, sizeof(m), 0) != (ssize_t)sizeof(m) ||
        recv(sv[0], &r, sizeof(r), 0) != (ssize_t)sizeof(r))
      die("raw importer went away");
    imp_us[i] = r.a_us;
    unmap_us[i] = r.b_us;
    CK(cudaFreeAsync(ptr, s));
    CK(cudaStreamSynchronize(s));
  }
  for (int i = 0; i < N_RAW; i++) {
    raw_msg m = {2, {0}};
    raw_reply r;
    cudaIpcEventHandle_t h;
    cudaEvent_t ev;
    CK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
    uint64_t t0 = gh_now_ns();
    CK(cudaIpcGetEventHandle(&h, ev));
    geth_us[i] = us_since(t0);
    CK(cudaEventRecord(ev, s));
    memcpy(m.data, &h, sizeof(h));
    if (send(sv[0], &m, sizeof(m), 0) != (ssize_t)sizeof(m) ||
        recv(sv[0], &r, sizeof(r), 0) != (ssize_t)sizeof(r))
      die("raw importer went away");
    if (i == 0)
      first_open = r.a_us;
    open_us[i] = r.a_us;
    wait_us[i] = r.b_us;
    CK(cudaEventDestroy(ev));
  }
  {
    raw_msg q = {0, {0}};
    if (send(sv[0], &q, sizeof(q), 0) != (ssize_t)sizeof(q))
      die("raw importer went away");
  }
  gh_wait(&p, 30000);
  close(sv[0]);
  CK(cudaStreamSynchronize(s));
  {
    /* What gpupoold adds to every new slab: clearing it (cudaMemsetAsync + synchronize), so
     * memory never passes between tenants with its bytes in it. */
    static const size_t sizes[] = {64u << 20, 256u << 20};
    for (int k = 0; k < 2; k++) {
      void *ptr;
      double best = 1e30, us;
      char what[80], key[64];
      CK(cudaMallocFromPoolAsync(&ptr, sizes[k], pool, s));
      CK(cudaStreamSynchronize(s));
      for (int i = 0; i < 20; i++) {
        uint64_t t0 = gh_now_ns();
        CK(cudaMemsetAsync(ptr, 0, sizes[k], s));
        CK(cudaStreamSynchronize(s));
        us = us_since(t0);
        if (us < best)
          best = us;
      }
      CK(cudaFreeAsync(ptr, s));
      CK(cudaStreamSynchronize(s));
      snprintf(what, sizeof what, "clearing a new %zu MiB slab (best of 20)", sizes[k] >> 20);
      snprintf(key, sizeof key, "slab_scrub_%zuMiB_us", sizes[k] >> 20);
      gh_say("%-52s %9.1f us", what, best);
      gh_say("BENCH %s %.1f", key, best);
    }
  }
  CK(cudaMemPoolDestroy(pool));
  CK(cudaStreamDestroy(s));

  report_lat("raw cudaMallocFromPoolAsync (1 MiB)", "raw_malloc_from_pool", malloc_us, N_RAW);
  report_lat("raw cudaMemPoolExportPointer (1 MiB)", "raw_export_ptr", exp_us, N_RAW);
  report_lat("raw cudaMemPoolImportPointer (1 MiB, 2nd process)", "raw_import_ptr", imp_us,
             N_RAW);
  report_lat("raw importer cudaFreeAsync+sync of the import", "raw_unmap_sync", unmap_us,
             N_RAW);
  report_lat("raw cudaIpcGetEventHandle", "raw_ipc_get_event", geth_us, N_RAW);
  gh_say("%-52s %9.1f us", "raw cudaIpcOpenEventHandle, first in the process", first_open);
  report("raw_ipc_open_event_first_us", first_open);
  report_lat("raw cudaIpcOpenEventHandle, later opens", "raw_ipc_open_event", open_us + 1,
             N_RAW - 1);
  report_lat("raw cudaStreamWaitEvent on an IPC event", "raw_stream_wait_event", wait_us,
             N_RAW);
  free(exp_us);
  free(imp_us);
  free(unmap_us);
  free(malloc_us);
  free(open_us);
  free(wait_us);
  free(geth_us);
}

/* ---------------------------------------------------------------- warm alloc round trip */

/* alloc SOCK N SIZE: prints "A <alloc_us>" and "P <alloc+release_us>" per op on stdout. */
static int w_alloc(char **a) {
  const char *sock = a[0];
  int n = atoi(a[1]);
  size_t size = strtoull(a[2], NULL, 0);
  cudaStream_t s = new_stream();
  gpupool_client *c;
  gpupool_buffer *b;
  double *va = calloc((size_t)n, sizeof(double)), *vp = calloc((size_t)n, sizeof(double));
  if (!va || !vp)
    die("out of memory");
  GP(gpupool_client_connect(sock, "bench-alloc", GPUPOOL_TIMEOUT_DEFAULT, &c));
  for (int i = 0; i < 200; i++) { /* maps the slab, fills the client's caches */
    GP(gpupool_buffer_alloc(c, POOL, size, 10000, s, &b));
    GP(gpupool_buffer_release(b, s));
  }
  for (int i = 0; i < n; i++) {
    uint64_t t0 = gh_now_ns();
    GP(gpupool_buffer_alloc(c, POOL, size, 10000, s, &b));
    va[i] = us_since(t0);
    if (!gpupool_buffer_ptr(b))
      die("gpupool_buffer_alloc returned no pointer");
    GP(gpupool_buffer_release(b, s));
    vp[i] = us_since(t0);
  }
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  gh_say("ALLOC %.3f %.3f %.3f %.3f", gh_percentile(va, (size_t)n, 50),
      gh_percentile(va, (size_t)n, 99), gh_percentile(vp, (size_t)n, 50),
      gh_percentile(vp, (size_t)n, 99));
  free(va);
  free(vp);
  return 0;
}

static void bench_alloc(const gh_daemon *d, double socket_p50) {
  char n[16], sz[16], line[256];
  double a50, a99, p50, p99;
  gh_proc p;
  snprintf(n, sizeof(n), "%d", N_ALLOC);
  snprintf(sz, sizeof(sz), "%d", 4096);
  const char *av[] = {"", "worker", "alloc", d->sock, n, sz, NULL};
  if (gh_spawn(&p, av, NULL, 0) < 0 || gh_expect(&p, "ALLOC", line, sizeof(line), STEP_MS) < 0 ||
      sscanf(line, "ALLOC %lf %lf %lf %lf", &a50, &a99, &p50, &p99) != 4)
    die("alloc worker failed");
  gh_wait(&p, STEP_MS);
  gh_say("%-52s p50 %9.1f us  p99 %9.1f us  (n=%d)", "warm gpupool_buffer_alloc 4 KiB (usable pointer)",
      a50, a99, N_ALLOC);
  gh_say("%-52s p50 %9.1f us  p99 %9.1f us", "warm gpupool_buffer_alloc + gpupool_buffer_release", p50, p99);
  gh_say("%-52s %9.2fx", "alloc p50 / socket floor p50", a50 / socket_p50);
  report("alloc_p50_us", a50);
  report("alloc_p99_us", a99);
  report("alloc_release_p50_us", p50);
  report("alloc_release_p99_us", p99);
  report("alloc_vs_socket_p50_ratio", a50 / socket_p50);
}

/* ---------------------------------------------------------------- wake-up floor */

/* hop: reads 8-byte timestamps on fd 3; "fwd" passes each on to fd 4 at once, "last" writes
 * the microseconds since it to fd 4 (as a double). */
static int w_hop(char **a) {
  int last = !strcmp(a[0], "last");
  uint64_t t0;
  while (read(3, &t0, sizeof t0) == (ssize_t)sizeof t0) {
    if (last) {
      double us = us_since(t0);
      if (write(4, &us, sizeof us) != (ssize_t)sizeof us)
        return 1;
    } else if (write(4, &t0, sizeof t0) != (ssize_t)sizeof t0) {
      return 1;
    }
  }
  return 0;
}

/* What any handoff in which the consumer sleeps pays before gpupool does anything: a message
 * to a process blocked in read() for 2 ms (as the handoff's consumer is), through one process
 * (producer -> consumer) or through two (producer -> daemon -> consumer, where the middle one
 * was idle too). Pipes, 8 bytes, no other work. */
static void bench_wake(void) {
  enum { N = 300 };
  static double v[N];
  for (int hops = 1; hops <= 2; hops++) {
    int in[2], mid[2], out[2];
    gh_proc last, fwd;
    const char *av_last[] = {"", "worker", "hop", "last", NULL};
    const char *av_fwd[] = {"", "worker", "hop", "fwd", NULL};
    if (pipe2(in, O_CLOEXEC) < 0 || pipe2(mid, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0)
      die("pipe: %s", strerror(errno));
    if (hops == 2) {
      int f[2] = {in[0], mid[1]}, l[2] = {mid[0], out[1]};
      if (gh_spawn(&fwd, av_fwd, f, 2) < 0 || gh_spawn(&last, av_last, l, 2) < 0)
        die("cannot start the hop workers");
    } else {
      int l[2] = {in[0], out[1]};
      if (gh_spawn(&last, av_last, l, 2) < 0)
        die("cannot start the hop worker");
    }
    close(in[0]);
    close(mid[0]);
    close(mid[1]);
    close(out[1]);
    for (int i = 0; i < N + N_WARMUP; i++) {
      uint64_t t0;
      double us;
      gh_sleep_ms(2);
      t0 = gh_now_ns();
      if (write(in[1], &t0, sizeof t0) != (ssize_t)sizeof t0 || read(out[0], &us, sizeof us) != (ssize_t)sizeof us)
        die("hop worker went away");
      if (i >= N_WARMUP)
        v[i - N_WARMUP] = us;
    }
    close(in[1]);
    close(out[0]);
    gh_wait(&last, 10000);
    if (hops == 2)
      gh_wait(&fwd, 10000);
    report_lat(hops == 1 ? "wake-up floor: 1 hop to a process idle 2 ms" : "wake-up floor: 2 hops, both idle 2 ms",
               hops == 1 ? "wake_1hop" : "wake_2hop", v, N);
  }
}

/* ---------------------------------------------------------------- handoff latency */

/* With GPUPOOL_TRACE, the handoff's own start and end go into the trace with the library's and
 * the daemon's lines, in the same format. */
static void trace_mark(const char *what, uint64_t t) {
  static FILE *f;
  const char *p = getenv("GPUPOOL_TRACE");
  if (!f && p && *p && (f = fopen(p, "ae")) != NULL)
    setvbuf(f, NULL, _IOLBF, 0);
  if (f)
    fprintf(f, "%d %.1f %s 0.0us 0\n", (int)getpid(), (double)t / 1e3, what);
}

/* prod SOCK: commands on stdin (ALLOC name size | PUB name | UNPUB name | QUIT). */
static int w_prod(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  char line[512], name[256];
  unsigned long long size;
  GP(gpupool_client_connect(a[0], "bench-producer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  gh_say("READY");
  for (;;) {
    next_line(line, sizeof(line));
    if (sscanf(line, "ALLOC %255s %llu", name, &size) == 2) {
      GP(gpupool_buffer_alloc(c, POOL, size, 30000, s, &b));
      CK(cudaMemsetAsync(gpupool_buffer_ptr(b), 0x5a, size, s));
      /* The fill is done before the clock starts: the handoff is what is measured. */
      CK(cudaStreamSynchronize(s));
      gh_say("ALLOCATED");
    } else if (sscanf(line, "PUB %255s", name) == 1) {
      if (!b)
        die("PUB without ALLOC");
      uint64_t t0 = gh_now_ns();
      GP(gpupool_buffer_publish(b, name, NULL, s, NULL));
      trace_mark("bench-T0", t0);
      gh_say("T0 %" PRIu64, t0);
      GP(gpupool_buffer_release(b, s));
      b = NULL;
    } else if (sscanf(line, "UNPUB %255s", name) == 1) {
      GP(gpupool_name_unpublish(c, name));
      gh_say("UNPUBLISHED");
    } else if (!strcmp(line, "QUIT")) {
      break;
    } else {
      die("producer: unknown command %s", line);
    }
  }
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  return 0;
}

/* cons SOCK: commands on stdin (PRIME name | GET name | QUIT). */
static int w_cons(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  gpupool_buffer *primer = NULL, *b;
  char line[512], name[256];
  GP(gpupool_client_connect(a[0], "bench-consumer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  gh_say("READY");
  for (;;) {
    next_line(line, sizeof(line));
    if (sscanf(line, "PRIME %255s", name) == 1) {
      /* Imports the pool (and maps the primer's own slab) outside the measurement. */
      GP(gpupool_buffer_get(c, name, 0, STEP_MS, GPUPOOL_READ_ONLY, s, &primer, NULL));
      CK(cudaStreamSynchronize(s));
      gh_say("PRIMED");
    } else if (sscanf(line, "GET %255s", name) == 1) {
      gh_say("WAITING");
      GP(gpupool_buffer_get(c, name, 0, STEP_MS, GPUPOOL_READ_ONLY, s, &b, NULL));
      CK(cudaStreamSynchronize(s));
      uint64_t t1 = gh_now_ns();
      if (!gpupool_buffer_ptr(b))
        die("gpupool_buffer_get returned no pointer");
      trace_mark("bench-T1", t1);
      gh_say("T1 %" PRIu64, t1);
      GP(gpupool_buffer_release(b, s));
      CK(cudaStreamSynchronize(s));
      gh_say("RELEASED");
    } else if (!strcmp(line, "QUIT")) {
      break;
    } else {
      die("consumer: unknown command %s", line);
    }
  }
  if (primer)
    GP(gpupool_buffer_release(primer, s));
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  return 0;
}

static void cmd(gh_proc *p, const char *expect, char *line, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void cmd(gh_proc *p, const char *expect, char *line, size_t len, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  if (gh_writeline(p, buf) < 0)
    die("worker %d went away (sending %s)", (int)p->pid, buf);
  if (expect && gh_expect(p, expect, line, len, STEP_MS) < 0)
    die("worker %d: no %s after %s", (int)p->pid, expect, buf);
}

/* One handoff: the consumer is blocked in gpupool_buffer_get when the producer publishes. */
static double one_handoff(gh_proc *prod, gh_proc *cons, const char *name, uint64_t size) {
  char line[256];
  uint64_t t0, t1;
  cmd(prod, "ALLOCATED", line, sizeof(line), "ALLOC %s %" PRIu64, name, size);
  cmd(cons, "WAITING", line, sizeof(line), "GET %s", name);
  gh_sleep_ms(2); /* let the Get reach the daemon */
  cmd(prod, "T0", line, sizeof(line), "PUB %s", name);
  if (sscanf(line, "T0 %" SCNu64, &t0) != 1)
    die("bad producer line %s", line);
  if (gh_expect(cons, "T1", line, sizeof(line), STEP_MS) < 0 ||
      sscanf(line, "T1 %" SCNu64, &t1) != 1)
    die("consumer did not get %s", name);
  if (gh_expect(cons, "RELEASED", line, sizeof(line), STEP_MS) < 0)
    die("consumer did not release %s", name);
  cmd(prod, "UNPUBLISHED", line, sizeof(line), "UNPUB %s", name);
  return (double)(t1 - t0) / 1e3;
}

static void spawn_role(gh_proc *p, const char *role, const gh_daemon *d) {
  char line[256];
  const char *av[] = {"", "worker", role, d->sock, NULL};
  if (gh_spawn(p, av, NULL, 0) < 0 || gh_expect(p, "READY", line, sizeof(line), STEP_MS) < 0)
    die("cannot start a %s worker", role);
}

static void bench_handoff(const gh_daemon *d, uint64_t size, const char *label) {
  double *warm = calloc(N_WARM, sizeof(double)), *cold = calloc(N_COLD, sizeof(double));
  char name[64], what[96], key[64], line[256];
  gh_proc prod, cons;

  if (!warm || !cold)
    die("out of memory");
  spawn_role(&prod, "prod", d);
  spawn_role(&cons, "cons", d);
  for (int i = 0; i < N_WARMUP + N_WARM; i++) {
    double us;
    snprintf(name, sizeof(name), "w-%s-%d", label, i);
    us = one_handoff(&prod, &cons, name, size);
    if (i >= N_WARMUP)
      warm[i - N_WARMUP] = us;
  }
  cmd(&cons, NULL, line, sizeof(line), "QUIT");
  gh_wait(&cons, STEP_MS);

  /* Cold: a fresh consumer process per handoff. It first gets a primer buffer that has a
   * slab of its own (larger than a regular slab), which imports the pool; the measured
   * buffer then lies in a regular slab this process has never mapped. */
  cmd(&prod, "ALLOCATED", line, sizeof(line), "ALLOC primer-%s %llu", label,
      (unsigned long long)(SLAB_BYTES + (2u << 20)));
  cmd(&prod, "T0", line, sizeof(line), "PUB primer-%s", label);
  for (int i = 0; i < N_COLD; i++) {
    spawn_role(&cons, "cons", d);
    cmd(&cons, "PRIMED", line, sizeof(line), "PRIME primer-%s", label);
    snprintf(name, sizeof(name), "c-%s-%d", label, i);
    cold[i] = one_handoff(&prod, &cons, name, size);
    cmd(&cons, NULL, line, sizeof(line), "QUIT");
    gh_wait(&cons, STEP_MS);
  }
  cmd(&prod, "UNPUBLISHED", line, sizeof(line), "UNPUB primer-%s", label);
  cmd(&prod, NULL, line, sizeof(line), "QUIT");
  gh_wait(&prod, STEP_MS);

  snprintf(what, sizeof(what), "handoff %s warm (publish -> usable in consumer)", label);
  snprintf(key, sizeof(key), "handoff_warm_%" PRIu64, size);
  report_lat(what, key, warm, N_WARM);
  snprintf(what, sizeof(what), "handoff %s cold (first slab import)", label);
  snprintf(key, sizeof(key), "handoff_cold_%" PRIu64, size);
  report_lat(what, key, cold, N_COLD);
  free(warm);
  free(cold);
}

/* ---------------------------------------------------------------- bundle handoff */

/* Member i of a bundle layout: kind 0 is a Llama-3.2-1B-shaped bf16 state dict (146 tensors,
 * 2.47 GB: embedding 128256x2048, 16 layers of q/k/v/o, gate/up/down and two norms, a final
 * norm), kind 1 is 1,000 tensors of 64 KiB. Returns the member count; fills name/bytes of i. */
static int bundle_layout(int kind, int i, char *name, size_t len, uint64_t *bytes) {
  static const uint64_t h = 2048, inter = 8192, kv = 512, vocab = 128256;
  if (kind == 1) {
    if (name) {
      snprintf(name, len, "t%04d", i);
      *bytes = 64u << 10;
    }
    return 1000;
  }
  if (name) {
    if (i == 0) {
      snprintf(name, len, "model.embed_tokens.weight");
      *bytes = vocab * h * 2;
    } else if (i == 145) {
      snprintf(name, len, "model.norm.weight");
      *bytes = h * 2;
    } else {
      static const char *const part[9] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                          "mlp.down_proj",    "input_layernorm",  "post_attention_layernorm"};
      const uint64_t sz[9] = {h * h, kv * h, kv * h, h * h, inter * h, inter * h, h * inter, h, h};
      int l = (i - 1) / 9, k = (i - 1) % 9;
      snprintf(name, len, "model.layers.%d.%s.weight", l, part[k]);
      *bytes = sz[k] * 2;
    }
  }
  return 146;
}

/* bprod SOCK KIND: allocates one bundle of layout KIND, fills it once, then on "PUB name"
 * republishes it (a new version of that name each time; its content is not what is
 * measured) and prints T0 taken just before the publish call. */
static int w_bprod(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  gpupool_bundle *b;
  int kind = atoi(a[1]), n = bundle_layout(kind, 0, NULL, 0, NULL);
  gpupool_member_spec *specs = calloc((size_t)n, sizeof *specs);
  char (*names)[64] = calloc((size_t)n, sizeof *names);
  char line[512], name[256];
  if (!specs || !names)
    die("out of memory");
  for (int i = 0; i < n; i++) {
    bundle_layout(kind, i, names[i], sizeof names[i], &specs[i].size);
    specs[i].name = names[i];
  }
  GP(gpupool_client_connect(a[0], "bench-bundle-producer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  GP(gpupool_bundle_alloc(c, POOL, specs, n, 0, 30000, s, &b));
  for (int i = 0; i < gpupool_bundle_buffers(b); i++) {
    gpupool_buffer *buf = gpupool_bundle_buffer(b, i);
    CK(cudaMemsetAsync(gpupool_buffer_ptr(buf), 0x3c, gpupool_buffer_size(buf), s));
  }
  CK(cudaStreamSynchronize(s));
  gh_say("READY");
  for (;;) {
    next_line(line, sizeof(line));
    if (sscanf(line, "PUB %255s", name) == 1) {
      uint64_t t0 = gh_now_ns();
      GP(gpupool_bundle_publish(b, name, s, NULL));
      gh_say("T0 %" PRIu64, t0);
    } else if (sscanf(line, "UNPUB %255s", name) == 1) {
      GP(gpupool_name_unpublish(c, name));
      gh_say("UNPUBLISHED");
    } else if (!strcmp(line, "QUIT")) {
      break;
    } else {
      die("bundle producer: unknown command %s", line);
    }
  }
  GP(gpupool_bundle_release(b, s));
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  free(specs);
  free(names);
  return 0;
}

/* bcons SOCK: on "GET name version keep", waits for a version of name newer than version, holds
 * every member's pointer and size (the member table read in full) with the ready event waited
 * on and its stream synchronized, prints T1, releases. */
static int w_bcons(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  char line[512], name[256];
  unsigned long long last;
  int keep;
  GP(gpupool_client_connect(a[0], "bench-bundle-consumer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  gh_say("READY");
  for (;;) {
    next_line(line, sizeof(line));
    if (sscanf(line, "GET %255s %llu %d", name, &last, &keep) == 3) {
      gpupool_bundle *b;
      gpupool_member *m;
      uintptr_t sum = 0;
      int n;
      gh_say("WAITING");
      GP(gpupool_bundle_get(c, name, last, STEP_MS, GPUPOOL_READ_ONLY | (keep ? GPUPOOL_KEEP_MAPPED : 0), s, &b));
      n = gpupool_bundle_count(b);
      if (!(m = malloc((size_t)n * sizeof *m)))
        die("out of memory");
      GP(gpupool_bundle_members(b, 0, n, m));
      for (int i = 0; i < n; i++)
        sum += (uintptr_t)m[i].ptr + m[i].size;
      CK(cudaStreamSynchronize(s));
      uint64_t t1 = gh_now_ns();
      if (!sum)
        die("no members");
      gh_say("T1 %" PRIu64 " %llu", t1, (unsigned long long)gpupool_bundle_version(b));
      free(m);
      GP(gpupool_bundle_release(b, s));
      CK(cudaStreamSynchronize(s));
      gh_say("RELEASED");
    } else if (!strcmp(line, "QUIT")) {
      break;
    } else {
      die("bundle consumer: unknown command %s", line);
    }
  }
  gpupool_client_disconnect(c);
  return 0;
}

/* Versions of one bundle handed to a consumer waiting with newer_than: the first is cold (the
 * consumer imports the pool and maps the bundle's slab), the rest warm. keep: the consumer
 * gets with GPUPOOL_KEEP_MAPPED (its mapping of the bundle's slab survives between versions);
 * without it, a bundle larger than a slab is imported again for every version. */
static void bench_bundle(const gh_daemon *d, int kind, int keep, const char *label) {
  enum { N = 40 };
  double t[N];
  char line[256], name[64], key[64], what[128];
  gh_proc prod, cons;
  const char *avp[] = {"", "worker", "bprod", d->sock, kind ? "1" : "0", NULL};
  const char *avc[] = {"", "worker", "bcons", d->sock, NULL};
  if (gh_spawn(&prod, avp, NULL, 0) < 0 || gh_expect(&prod, "READY", line, sizeof(line), STEP_MS) < 0)
    die("cannot start the bundle producer");
  if (gh_spawn(&cons, avc, NULL, 0) < 0 || gh_expect(&cons, "READY", line, sizeof(line), STEP_MS) < 0)
    die("cannot start the bundle consumer");
  snprintf(name, sizeof(name), "bundle-%s", label);
  for (int v = 0; v < N; v++) {
    uint64_t t0, t1;
    unsigned long long got;
    cmd(&cons, "WAITING", line, sizeof(line), "GET %s %d %d", name, v, keep);
    gh_sleep_ms(2); /* let the get reach the daemon */
    cmd(&prod, "T0", line, sizeof(line), "PUB %s", name);
    if (sscanf(line, "T0 %" SCNu64, &t0) != 1)
      die("bad producer line %s", line);
    if (gh_expect(&cons, "T1", line, sizeof(line), STEP_MS) < 0 ||
        sscanf(line, "T1 %" SCNu64 " %llu", &t1, &got) != 2 || got != (unsigned long long)v + 1)
      die("bundle consumer did not get version %d (%s)", v + 1, line);
    if (gh_expect(&cons, "RELEASED", line, sizeof(line), STEP_MS) < 0)
      die("bundle consumer did not release");
    t[v] = (double)(t1 - t0) / 1e3;
  }
  cmd(&cons, NULL, line, sizeof(line), "QUIT");
  gh_wait(&cons, STEP_MS);
  cmd(&prod, "UNPUBLISHED", line, sizeof(line), "UNPUB %s", name);
  cmd(&prod, NULL, line, sizeof(line), "QUIT");
  gh_wait(&prod, STEP_MS);
  snprintf(what, sizeof(what), "bundle %s cold (first version)", label);
  gh_say("%-52s %9.1f us", what, t[0]);
  snprintf(key, sizeof(key), "bundle_%s_cold_us", label);
  report(key, t[0]);
  snprintf(what, sizeof(what), "bundle %s warm (publish -> members usable)", label);
  snprintf(key, sizeof(key), "bundle_%s_warm", label);
  report_lat(what, key, t + 1, N - 1);
}

/* ---------------------------------------------------------------- handoff throughput */

/* tp-prod SOCK: fd 3 reads consumers' 4-byte acks. Waits for GO, then publishes TP_ITEMS
 * names, keeping at most TP_WINDOW not yet taken by every consumer. */
static int w_tp_prod(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  uint8_t *taken = calloc(TP_ITEMS, 1);
  char line[64], name[64];
  int done = 0; /* items every consumer has taken, in order */
  if (!taken)
    die("out of memory");
  GP(gpupool_client_connect(a[0], "bench-tp-producer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  gh_say("READY");
  next_line(line, sizeof(line));
  uint64_t t0 = gh_now_ns();
  for (int i = 0; i < TP_ITEMS || done < TP_ITEMS;) {
    if (i < TP_ITEMS && i - done < TP_WINDOW) {
      gpupool_buffer *b;
      GP(gpupool_buffer_alloc(c, POOL, TP_BYTES, 30000, s, &b));
      CK(cudaMemsetAsync(gpupool_buffer_ptr(b), i & 0xff, TP_BYTES, s));
      snprintf(name, sizeof(name), "tp-%d", i);
      GP(gpupool_buffer_publish(b, name, NULL, s, NULL));
      GP(gpupool_buffer_release(b, s));
      i++;
      continue;
    }
    uint32_t idx;
    if (gh_full_io(3, &idx, sizeof(idx), 0) < 0 || idx >= TP_ITEMS)
      die("tp consumers went away");
    if (++taken[idx] == TP_CONSUMERS) {
      snprintf(name, sizeof(name), "tp-%u", idx);
      GP(gpupool_name_unpublish(c, name));
    }
    while (done < TP_ITEMS && taken[done] == TP_CONSUMERS)
      done++;
  }
  double secs = (double)(gh_now_ns() - t0) / 1e9;
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  gh_say("RATE %.1f %.3f", (double)TP_ITEMS * TP_CONSUMERS / secs, secs);
  free(taken);
  return 0;
}

/* tp-cons SOCK: fd 3 writes 4-byte acks. */
static int w_tp_cons(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  char line[64], name[64];
  GP(gpupool_client_connect(a[0], "bench-tp-consumer", GPUPOOL_TIMEOUT_DEFAULT, &c));
  gh_say("READY");
  next_line(line, sizeof(line));
  for (uint32_t i = 0; i < TP_ITEMS; i++) {
    gpupool_buffer *b;
    snprintf(name, sizeof(name), "tp-%u", i);
    GP(gpupool_buffer_get(c, name, 0, STEP_MS, GPUPOOL_READ_ONLY, s, &b, NULL));
    GP(gpupool_buffer_release(b, s));
    if (gh_full_io(3, &i, sizeof(i), 1) < 0)
      die("tp producer went away");
  }
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  return 0;
}

static void bench_throughput(const gh_daemon *d) {
  gh_proc prod, cons[TP_CONSUMERS];
  char line[256];
  double rate, secs;
  int ack[2];
  if (pipe2(ack, O_CLOEXEC) < 0)
    die("pipe2: %s", strerror(errno));
  {
    const char *avp[] = {"", "worker", "tp-prod", d->sock, NULL};
    const char *avc[] = {"", "worker", "tp-cons", d->sock, NULL};
    if (gh_spawn(&prod, avp, &ack[0], 1) < 0)
      die("cannot start the tp producer");
    for (int i = 0; i < TP_CONSUMERS; i++)
      if (gh_spawn(&cons[i], avc, &ack[1], 1) < 0)
        die("cannot start a tp consumer");
  }
  close(ack[0]);
  close(ack[1]);
  if (gh_expect(&prod, "READY", line, sizeof(line), STEP_MS) < 0)
    die("tp producer not ready");
  for (int i = 0; i < TP_CONSUMERS; i++)
    if (gh_expect(&cons[i], "READY", line, sizeof(line), STEP_MS) < 0)
      die("tp consumer not ready");
  for (int i = 0; i < TP_CONSUMERS; i++)
    gh_writeline(&cons[i], "GO");
  gh_writeline(&prod, "GO");
  if (gh_expect(&prod, "RATE", line, sizeof(line), 600000) < 0 ||
      sscanf(line, "RATE %lf %lf", &rate, &secs) != 2)
    die("tp producer failed");
  gh_wait(&prod, STEP_MS);
  for (int i = 0; i < TP_CONSUMERS; i++)
    if (gh_wait(&cons[i], STEP_MS) != 0)
      die("tp consumer %d failed", i);
  gh_say("%-52s %9.0f /s  (%d x %d handoffs of 64 KiB in %.2f s)",
      "handoffs per second, 1 producer -> 4 consumers", rate, TP_ITEMS, TP_CONSUMERS, secs);
  report("handoffs_per_s_1p4c", rate);
}

/* ---------------------------------------------------------------- alloc ops/s, 16 procs */

static int w_ops(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  gpupool_buffer *b;
  char line[64];
  GP(gpupool_client_connect(a[0], "bench-ops", GPUPOOL_TIMEOUT_DEFAULT, &c));
  for (int i = 0; i < 50; i++) {
    GP(gpupool_buffer_alloc(c, POOL, OPS_BYTES, 30000, s, &b));
    GP(gpupool_buffer_release(b, s));
  }
  gh_say("READY");
  next_line(line, sizeof(line));
  uint64_t t0 = gh_now_ns();
  for (int i = 0; i < OPS_N; i++) {
    GP(gpupool_buffer_alloc(c, POOL, OPS_BYTES, 30000, s, &b));
    GP(gpupool_buffer_release(b, s));
  }
  uint64_t t1 = gh_now_ns();
  CK(cudaStreamSynchronize(s));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  gh_say("OPS %d %" PRIu64 " %" PRIu64, OPS_N, t0, t1);
  return 0;
}

static void bench_ops(const gh_daemon *d) {
  gh_proc p[OPS_PROCS];
  char line[256];
  uint64_t first = UINT64_MAX, last = 0, total = 0;
  for (int i = 0; i < OPS_PROCS; i++)
    spawn_role(&p[i], "ops", d);
  for (int i = 0; i < OPS_PROCS; i++)
    gh_writeline(&p[i], "GO");
  for (int i = 0; i < OPS_PROCS; i++) {
    int n;
    uint64_t t0, t1;
    if (gh_expect(&p[i], "OPS", line, sizeof(line), 600000) < 0 ||
        sscanf(line, "OPS %d %" SCNu64 " %" SCNu64, &n, &t0, &t1) != 3)
      die("ops worker %d failed", i);
    total += (uint64_t)n;
    first = t0 < first ? t0 : first;
    last = t1 > last ? t1 : last;
    gh_wait(&p[i], STEP_MS);
  }
  double rate = (double)total / ((double)(last - first) / 1e9);
  gh_say("%-52s %9.0f /s  (%d processes x %d, 64 KiB)", "warm alloc+release ops/s, 16 processes",
      rate, OPS_PROCS, OPS_N);
  report("alloc_release_ops_per_s_16p", rate);
}

/* ---------------------------------------------------------------- read bandwidth */

static double read_gbps(const void *ptr, size_t bytes, cudaStream_t s,
                        unsigned long long *sink) {
  cudaEvent_t a, b;
  float ms = 0;
  int ce;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; i++)
    if ((ce = gk_read(ptr, bytes, s, sink)))
      die("read kernel: %s", cudaGetErrorString((cudaError_t)ce));
  CK(cudaEventRecord(a, s));
  for (int i = 0; i < BW_REPS; i++)
    if ((ce = gk_read(ptr, bytes, s, sink)))
      die("read kernel: %s", cudaGetErrorString((cudaError_t)ce));
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return (double)bytes * BW_REPS / ((double)ms / 1e3) / 1e9;
}

/* bw SOCK NAME: reads the shared buffer, then a local one of the same size. */
static int w_bw(char **a) {
  cudaStream_t s = new_stream();
  gpupool_client *c;
  gpupool_buffer *b;
  unsigned long long *sink;
  void *local;
  GP(gpupool_client_connect(a[0], "bench-bw", GPUPOOL_TIMEOUT_DEFAULT, &c));
  GP(gpupool_buffer_get(c, a[1], 0, STEP_MS, GPUPOOL_READ_ONLY, s, &b, NULL));
  CK(cudaMalloc((void **)&sink, sizeof(*sink)));
  double shared = read_gbps(gpupool_buffer_ptr(b), BW_BYTES, s, sink);
  GP(gpupool_buffer_release(b, s));
  CK(cudaMalloc(&local, BW_BYTES));
  CK(cudaMemsetAsync(local, 0x5a, BW_BYTES, s));
  double loc = read_gbps(local, BW_BYTES, s, sink);
  CK(cudaStreamSynchronize(s));
  CK(cudaFree(local));
  CK(cudaFree(sink));
  gpupool_client_disconnect(c);
  CK(cudaStreamDestroy(s));
  gh_say("BW %.1f %.1f", shared, loc);
  return 0;
}

static void bench_bw(const gh_daemon *d) {
  gh_proc prod, bw;
  char line[256];
  double shared, loc;
  spawn_role(&prod, "prod", d);
  cmd(&prod, "ALLOCATED", line, sizeof(line), "ALLOC bw %llu", (unsigned long long)BW_BYTES);
  cmd(&prod, "T0", line, sizeof(line), "PUB bw");
  {
    const char *av[] = {"", "worker", "bw", d->sock, "bw", NULL};
    if (gh_spawn(&bw, av, NULL, 0) < 0 || gh_expect(&bw, "BW", line, sizeof(line), STEP_MS) < 0 ||
        sscanf(line, "BW %lf %lf", &shared, &loc) != 2)
      die("bandwidth worker failed");
    gh_wait(&bw, STEP_MS);
  }
  cmd(&prod, "UNPUBLISHED", line, sizeof(line), "UNPUB bw");
  cmd(&prod, NULL, line, sizeof(line), "QUIT");
  gh_wait(&prod, STEP_MS);
  gh_say("%-52s %9.1f GB/s", "read bandwidth, shared 1 GiB buffer (consumer)", shared);
  gh_say("%-52s %9.1f GB/s", "read bandwidth, local cudaMalloc 1 GiB", loc);
  gh_say("%-52s %9.3f", "shared / local", shared / loc);
  report("bw_shared_gbps", shared);
  report("bw_local_gbps", loc);
  report("bw_shared_vs_local_ratio", shared / loc);
}

/* ---------------------------------------------------------------- main */

static int worker_main(int argc, char **argv) {
  static const struct {
    const char *role;
    int nargs;
    int (*fn)(char **);
  } roles[] = {{"echo", 0, w_echo},       {"raw", 0, w_raw},         {"alloc", 3, w_alloc},
               {"prod", 1, w_prod},       {"cons", 1, w_cons},       {"tp-prod", 1, w_tp_prod},
               {"tp-cons", 1, w_tp_cons}, {"ops", 1, w_ops},         {"bw", 2, w_bw},
               {"bprod", 2, w_bprod},     {"bcons", 1, w_bcons},     {"hop", 1, w_hop}};
  setvbuf(stdout, NULL, _IOLBF, 0);
  for (size_t i = 0; i < sizeof(roles) / sizeof(roles[0]); i++)
    if (!strcmp(argv[2], roles[i].role)) {
      if (argc - 3 != roles[i].nargs)
        die("worker %s: %d arguments, expected %d", roles[i].role, argc - 3, roles[i].nargs);
      return roles[i].fn(argv + 3);
    }
  die("unknown worker role %s", argv[2]);
}

/* GPUPOOL_BENCH_ONLY=socket,wake,... runs only those sections (all when unset). */
static int want(const char *section) {
  const char *only = getenv("GPUPOOL_BENCH_ONLY");
  size_t n = strlen(section);
  if (!only || !*only)
    return 1;
  for (const char *p = only; (p = strstr(p, section)) != NULL; p += n)
    if ((p == only || p[-1] == ',') && (p[n] == '\0' || p[n] == ','))
      return 1;
  return 0;
}

int main(int argc, char **argv) {
  struct cudaDeviceProp prop;
  gh_daemon d;
  int drv = 0;

  if (argc >= 3 && !strcmp(argv[1], "worker"))
    return worker_main(argc, argv);
  if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
    printf("usage: %s GPUPOOLD\n"
           "Allocation, handoff and copy benchmarks on GPU 0 against a private gpupoold started\n"
           "from the GPUPOOLD binary (tools/gpu-bench.sh runs it).\n", argv[0]);
    return 0;
  }
  gh_driver_start(argc, argv, 2, "GPUPOOLD", 1, "the benchmark");
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaDriverGetVersion(&drv));
  gh_say("gpupool %s benchmark on %s (driver %d.%d, runtime %d.%d)", gpupool_version_string(),
      prop.name, drv / 1000, (drv % 1000) / 10, CUDART_VERSION / 1000,
      (CUDART_VERSION % 1000) / 10);
  gh_say("BENCH_INFO device %s", prop.name);

  double socket_p50 = want("socket") ? bench_socket() : 0;
  if (want("wake"))
    bench_wake();
  if (want("raw"))
    bench_raw();
  if (gh_daemon_start(&d, argv[1], POOL_SPEC) < 0)
    die("gpupoold did not start");
  if (want("alloc"))
    bench_alloc(&d, socket_p50);
  if (want("handoff")) {
    bench_handoff(&d, 4096, "4KiB");
    bench_handoff(&d, 1u << 20, "1MiB");
    bench_handoff(&d, 64u << 20, "64MiB");
  }
  if (want("bundle")) {
    bench_bundle(&d, 0, 1, "llama146");
    bench_bundle(&d, 0, 0, "llama146_nokeep");
    bench_bundle(&d, 1, 1, "small1000");
  }
  if (want("throughput"))
    bench_throughput(&d);
  if (want("ops"))
    bench_ops(&d);
  if (want("bw"))
    bench_bw(&d);
  if (!gh_daemon_alive(&d)) {
    gh_daemon_stop(&d, 1);
    die("gpupoold died during the benchmark");
  }
  gh_daemon_stop(&d, 0);
  gh_say("BENCH_DONE");
  return 0;
}
