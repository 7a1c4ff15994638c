/*
 * GPU check of a pinned host-NUMA pool (kind = host-numa) against a real gpupoold with the
 * CUDA backend.
 *
 *   gpupool_gpu_pinned GPUPOOLD
 *
 * The daemon gets two pools on a private socket: "pinned", pinned host memory of NUMA node 0
 * served to GPU 0 (512 MiB, 128 MiB slabs), and a small device pool "gpu0" next to it. Worker
 * processes are this executable re-executed with "worker ROLE ...":
 *
 *   producer    allocates a 1 MiB pad and then the 64 MiB buffer in "pinned" (so the buffer
 *               lies at an offset inside its slab), checks its kind, fills it FROM A KERNEL
 *               behind a 500 ms spin kernel, and publishes it without synchronizing: only
 *               the ready event orders the consumers' reads after the fill.
 *   cpu-reader  gets it by name on its own stream, waits for that stream (the get queued
 *               the wait on the ready event there; the CPU does not block in gpupool_buffer_get),
 *               then reads every word FROM THE CPU and compares it with the seeded pattern.
 *   gpu-reader  gets it by name and counts mismatching words in a kernel on its own stream.
 *
 * Both readers check gpupool_buffer_kind == GPUPOOL_MEM_HOST_NUMA and print what
 * cudaPointerGetAttributes says of the pointer in their process; CUDA must know the memory
 * (cudaMemoryTypeHost expected; another registered type is reported as a NOTE) and give a
 * host pointer for it. Both readers wait in gpupool_buffer_get
 * before the producer starts its kernels. After the readers release and the producer
 * unpublishes, the pool's used bytes must return to their start value.
 *
 * Prints one "PASS: ..." or "FAIL: ..." line. Exit status 0 pass, 1 fail, 77 skip (no GPU, or
 * GPU 0 without host-NUMA memory pools).
 */
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_driver.h"
#include "gpu_harness.h"
#include "gpu_worker.h"
#include "gpu_kernels.h"
#include "gpupool/gpupool.h"

#define POOL "pinned"
#define NUMA_NODE 0
#define POOL_SPEC "name=pinned,kind=host-numa,device=0,numa=0,capacity=512M,slab=128M"
#define DEVICE_POOL_CONF                                                                    \
  "[pool gpu0]\n"                                                                           \
  "kind = device\n"                                                                         \
  "device = 0\n"                                                                            \
  "capacity = 256M\n"                                                                       \
  "slab_size = 64M\n"
#define PAD_BYTES (1u << 20)
#define BUF_BYTES (64u << 20)
#define SPIN_US 500000u /* long enough that an unordered read sees the cleared slab */
#define STEP_MS 120000  /* generous per-step timeout: CUDA context creation is slow */

/* ------------------------------------------------------------------ worker side */

static const char *mem_kind_name(gpupool_mem_kind k) {
  switch (k) {
  case GPUPOOL_MEM_HOST: return "GPUPOOL_MEM_HOST";
  case GPUPOOL_MEM_DEVICE: return "GPUPOOL_MEM_DEVICE";
  case GPUPOOL_MEM_HOST_NUMA: return "GPUPOOL_MEM_HOST_NUMA";
  default: return "unknown";
  }
}

static const char *cuda_type_name(enum cudaMemoryType t) {
  switch (t) {
  case cudaMemoryTypeUnregistered: return "cudaMemoryTypeUnregistered";
  case cudaMemoryTypeHost: return "cudaMemoryTypeHost";
  case cudaMemoryTypeDevice: return "cudaMemoryTypeDevice";
  case cudaMemoryTypeManaged: return "cudaMemoryTypeManaged";
  default: return "unknown";
  }
}

/* The buffer must be at least bytes of host-NUMA memory served to GPU 0. 0, or 1 with the
 * reason on stderr. */
static int check_buffer(const char *role, const gpupool_buffer *b, size_t bytes) {
  if (gpupool_buffer_kind(b) != GPUPOOL_MEM_HOST_NUMA || gpupool_buffer_device(b) != 0 ||
      gpupool_buffer_size(b) < bytes || !gpupool_buffer_ptr(b)) {
    fprintf(stderr, "worker %s: buffer is %s (%d), device %d, %zu bytes at %p; expected "
            "GPUPOOL_MEM_HOST_NUMA for device 0, >= %zu bytes\n", role,
            mem_kind_name(gpupool_buffer_kind(b)), (int)gpupool_buffer_kind(b),
            gpupool_buffer_device(b), gpupool_buffer_size(b), gpupool_buffer_ptr(b), bytes);
    return 1;
  }
  return 0;
}

/* Print what CUDA says of p in this process ("ATTR ..." on stdout); 0 when CUDA knows it
 * (pinned: not cudaMemoryTypeUnregistered) and gives a host pointer for it, else 1 with the
 * reason on stderr. Pinned host memory is expected to say cudaMemoryTypeHost; another
 * registered type with a host pointer is reported (NOTE) but not failed: the CPU read and
 * the kernel are what prove the memory usable, and how the driver classifies pool memory
 * on a host NUMA node is its own business. */
static int check_attributes(const char *role, const void *p) {
  struct cudaPointerAttributes a;
  cudaError_t e;

  memset(&a, 0, sizeof(a));
  e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    fprintf(stderr, "worker %s: cudaPointerGetAttributes(%p): %s: %s\n", role, p,
            cudaGetErrorName(e), cudaGetErrorString(e));
    return 1;
  }
  gh_say("ATTR %s: ptr %p type %s (%d) device %d hostPointer %p devicePointer %p", role, p,
         cuda_type_name(a.type), (int)a.type, a.device, a.hostPointer, a.devicePointer);
  if (a.type == cudaMemoryTypeUnregistered || !a.hostPointer) {
    fprintf(stderr, "worker %s: cudaPointerGetAttributes(%p) says type %s with host pointer "
            "%p; a host-NUMA buffer must be memory CUDA pinned (cudaMemoryTypeHost) with a "
            "host pointer\n", role, p, cuda_type_name(a.type), a.hostPointer);
    return 1;
  }
  if (a.type != cudaMemoryTypeHost)
    gh_say("ATTR %s: NOTE: expected cudaMemoryTypeHost for pinned host memory, CUDA says %s",
           role, cuda_type_name(a.type));
  return 0;
}

/* producer SOCK NAME SEED: fd 0 gets GO and EXIT, stdout says ALLOCATED, PUBLISHED, DONE. */
static int w_producer(char **a) {
  const char *sock = a[0], *name = a[1];
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  gpupool_client *c;
  gpupool_buffer *pad, *b;
  cudaStream_t s = wstream("producer", 0);
  int rc;

  if ((rc = gpupool_client_connect(sock, "gpu-pinned-producer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("producer", "gpupool_client_connect", rc);
  /* The pad puts the tested buffer at an offset inside its slab. */
  if ((rc = gpupool_buffer_alloc(c, POOL, PAD_BYTES, 10000, s, &pad)) < 0)
    wdie("producer", "gpupool_buffer_alloc (pad)", rc);
  if ((rc = gpupool_buffer_alloc(c, POOL, BUF_BYTES, 10000, s, &b)) < 0)
    wdie("producer", "gpupool_buffer_alloc", rc);
  if (check_buffer("producer", b, BUF_BYTES))
    return 1;
  gh_say("ALLOCATED %zu bytes at %p (pad at %p)", gpupool_buffer_size(b), gpupool_buffer_ptr(b),
         gpupool_buffer_ptr(pad));
  wait_stdin_line("producer", "GO");
  wfill_publish("producer", b, BUF_BYTES, seed, SPIN_US, name, s);
  gh_say("PUBLISHED");
  /* The name holds the buffer now. */
  if ((rc = gpupool_buffer_release(b, s)) < 0)
    wdie("producer", "gpupool_buffer_release", rc);
  wait_stdin_line("producer", "EXIT");
  if ((rc = gpupool_name_unpublish(c, name)) < 0)
    wdie("producer", "gpupool_name_unpublish", rc);
  if ((rc = gpupool_buffer_release(pad, s)) < 0)
    wdie("producer", "gpupool_buffer_release (pad)", rc);
  wfinish("producer", c, s);
  gh_say("DONE");
  return 0;
}

/* Where a CPU read faulted, for the reader's report. */
static sigjmp_buf g_fault_jmp;
static void *volatile g_fault_addr;
static volatile sig_atomic_t g_fault_sig;

static void on_fault(int sig, siginfo_t *si, void *uc) {
  (void)uc;
  g_fault_sig = sig;
  g_fault_addr = si->si_addr;
  siglongjmp(g_fault_jmp, 1);
}

/* Connect and get NAME read-only on a new stream, as both readers do; exits on failure. */
static void reader_get(const char *role, const char *sock, const char *name, gpupool_client **c,
                       gpupool_buffer **b, cudaStream_t *s) {
  gpupool_tensor_meta meta;
  int rc;

  *s = wstream(role, 0);
  if ((rc = gpupool_client_connect(sock, role, GPUPOOL_TIMEOUT_DEFAULT, c)) < 0)
    wdie(role, "gpupool_client_connect", rc);
  gh_say("WAITING");
  if ((rc = gpupool_buffer_get(*c, name, 0, STEP_MS, GPUPOOL_READ_ONLY, *s, b, NULL)) < 0)
    wdie(role, "gpupool_buffer_get", rc);
  if (check_buffer(role, *b, BUF_BYTES))
    exit(1);
  if ((rc = gpupool_buffer_tensor(*b, &meta)) < 0)
    wdie(role, "gpupool_buffer_tensor", rc);
  if (meta.ndim != 1 || meta.shape[0] != (int64_t)(BUF_BYTES / 4) || meta.dtype_bits != 32) {
    fprintf(stderr, "worker %s: tensor meta ndim %d shape0 %" PRId64 " bits %u, expected "
            "1-d uint32 of %u elements\n", role, meta.ndim, meta.shape[0], meta.dtype_bits,
            BUF_BYTES / 4);
    exit(1);
  }
  if (check_attributes(role, gpupool_buffer_ptr(*b)))
    exit(1);
}

static void reader_done(const char *role, gpupool_client *c, gpupool_buffer *b, cudaStream_t s) {
  int rc, ce;
  if ((rc = gpupool_buffer_release(b, s)) < 0)
    wdie(role, "gpupool_buffer_release", rc);
  if ((ce = (int)cudaStreamSynchronize(s)))
    cdie(role, "cudaStreamSynchronize after release", ce);
  gpupool_client_disconnect(c);
  (void)cudaStreamDestroy(s);
}

/* What the CPU found in the buffer. */
typedef struct {
  unsigned long long bad; /* words that differ from the pattern */
  size_t first;           /* the first of them */
  uint32_t first_got;
} scan_result;

static void scan(const volatile uint32_t *w, uint32_t seed, scan_result *r) {
  memset(r, 0, sizeof(*r));
  for (size_t i = 0; i < BUF_BYTES / 4; i++) {
    uint32_t got = w[i];
    if (got != gk_pattern(i, seed)) {
      if (!r->bad) {
        r->first = i;
        r->first_got = got;
      }
      r->bad++;
    }
  }
}

/* scan() with SIGSEGV and SIGBUS caught: 0, or -1 with the faulting address reported. */
static int guarded_scan(const char *role, const volatile uint32_t *w, uint32_t seed,
                        scan_result *r) {
  struct sigaction sa, old_segv, old_bus;
  int faulted = 0;

  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  if (sigsetjmp(g_fault_jmp, 1) == 0)
    scan(w, seed, r);
  else
    faulted = 1;
  sigaction(SIGSEGV, &old_segv, NULL);
  sigaction(SIGBUS, &old_bus, NULL);
  if (faulted) {
    uintptr_t at = (uintptr_t)g_fault_addr, base = (uintptr_t)w;
    fprintf(stderr, "worker %s: %s reading the host-NUMA buffer from the CPU at %p (word %lld "
            "of %u; buffer at %p): the imported mapping is not readable by the CPU in a "
            "consumer process\n", role, g_fault_sig == SIGBUS ? "SIGBUS" : "SIGSEGV",
            g_fault_addr, at >= base ? (long long)((at - base) / 4) : -1LL, BUF_BYTES / 4,
            (const void *)w);
    return -1;
  }
  return 0;
}

/* cpu-reader SOCK NAME SEED: every word read by the CPU. Says RESULT <mismatches> and, when
 * any, FIRST ... naming the first. */
static int w_cpu_reader(char **a) {
  const char *role = "cpu-reader";
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  gpupool_client *c;
  gpupool_buffer *b;
  cudaStream_t s;
  scan_result r;
  int ce;

  reader_get(role, a[0], a[1], &c, &b, &s);
  /* gpupool_buffer_get queued the wait on the producer's ready event in s and returned without
   * blocking; the CPU is ordered after the producer's kernel only once s has drained. */
  if ((ce = (int)cudaStreamSynchronize(s)))
    cdie(role, "cudaStreamSynchronize (waiting for the ready event)", ce);
  if (guarded_scan(role, gpupool_buffer_ptr(b), seed, &r) < 0)
    return 1;
  gh_say("RESULT %llu", r.bad);
  if (r.bad)
    gh_say("FIRST word %zu (byte offset %zu) is 0x%08x, the pattern says 0x%08x", r.first,
           r.first * 4, r.first_got, gk_pattern(r.first, seed));
  reader_done(role, c, b, s);
  return r.bad ? 1 : 0;
}

/* gpu-reader SOCK NAME SEED: mismatches counted by a kernel. Says RESULT <mismatches>. */
static int w_gpu_reader(char **a) {
  const char *role = "gpu-reader";
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  unsigned long long bad = ~0ull;
  gpupool_client *c;
  gpupool_buffer *b;
  cudaStream_t s;
  int ce;

  reader_get(role, a[0], a[1], &c, &b, &s);
  /* The stream waits on the ready event (gpupool_buffer_get queued the wait); nothing else orders
   * this kernel after the producer's fill. */
  if ((ce = gk_count_mismatches(gpupool_buffer_ptr(b), BUF_BYTES, seed, s, &bad)))
    cdie(role, "mismatch kernel on the host-NUMA buffer", ce);
  gh_say("RESULT %llu", bad);
  reader_done(role, c, b, s);
  return bad ? 1 : 0;
}

static int worker_main(int argc, char **argv) {
  static const struct {
    const char *role;
    int nargs;
    int (*fn)(char **);
  } roles[] = {{"producer", 3, w_producer},
               {"cpu-reader", 3, w_cpu_reader},
               {"gpu-reader", 3, w_gpu_reader}};
  setvbuf(stdout, NULL, _IOLBF, 0);
  for (size_t i = 0; i < sizeof(roles) / sizeof(roles[0]); i++)
    if (!strcmp(argv[2], roles[i].role)) {
      if (argc - 3 != roles[i].nargs) {
        fprintf(stderr, "worker %s: %d arguments, expected %d\n", roles[i].role, argc - 3,
                roles[i].nargs);
        return 2;
      }
      return roles[i].fn(argv + 3);
    }
  fprintf(stderr, "unknown worker role %s\n", argv[2]);
  return 2;
}

/* ------------------------------------------------------------------ driver side */

#define fail(...) gh_verdict(1, "pinned", __VA_ARGS__)

static uint32_t fresh_seed(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint32_t)ts.tv_nsec ^ ((uint32_t)getpid() << 16) ^ 0x5a5a5a5au;
}

static int spawn(gh_proc *p, const char *role, const gh_daemon *d, const char *name,
                 uint32_t seed) {
  char sd[32];
  snprintf(sd, sizeof(sd), "%u", seed);
  const char *argv[] = {"", "worker", role, d->sock, name, sd, NULL};
  if (gh_spawn(p, argv, NULL, 0) < 0) {
    fprintf(stderr, "cannot start the %s worker\n", role);
    return -1;
  }
  return 0;
}

/* Read a reader's lines up to RESULT, echoing ATTR and FIRST lines and keeping the memory
 * type CUDA reported in type; 0 for "RESULT 0". */
static int reader_result(gh_proc *p, const char *role, char *type, size_t type_len) {
  char line[512];
  for (;;) {
    if (gh_readline(p, line, sizeof(line), STEP_MS) < 0)
      return fail("%s reported no result (see its stderr above)", role);
    if (!strncmp(line, "ATTR ", 5)) {
      const char *t = strstr(line, " type ");
      printf("  %s\n", line + 5);
      if (t && !strstr(line, "NOTE:"))
        snprintf(type, type_len, "%.*s", (int)strcspn(t + 6, " "), t + 6);
      continue;
    }
    if (!strncmp(line, "RESULT ", 7)) {
      if (strcmp(line, "RESULT 0") != 0) {
        char first[512] = "";
        if (gh_readline(p, first, sizeof(first), 5000) == 0)
          printf("  %s: %s\n", role, first);
        return fail("%s read wrong data: %s of %u words differ from the pattern", role,
                    line + 7, BUF_BYTES / 4);
      }
      return 0;
    }
  }
}

static int check_pinned(const gh_daemon *d, gpupool_client *c) {
  gpupool_pool_stats ps;
  gh_proc prod, cpu, gpu;
  char name[64], line[512], type_cpu[64] = "?", type_gpu[64] = "?";
  uint32_t seed = fresh_seed();
  uint64_t start_used, used = 0;
  int rc, r_cpu, r_gpu;

  if (gh_pool_stats(c, POOL, &ps, NULL) < 0)
    return fail("cannot read the stats of pool %s", POOL);
  if (ps.kind != GPUPOOL_MEM_HOST_NUMA)
    return fail("pool %s reports kind %s (%d), expected GPUPOOL_MEM_HOST_NUMA", POOL,
                mem_kind_name(ps.kind), (int)ps.kind);
  start_used = ps.used;
  snprintf(name, sizeof(name), "pinned-%08x", seed);

  if (spawn(&prod, "producer", d, name, seed) < 0)
    return fail("cannot start the producer");
  if (gh_expect(&prod, "ALLOCATED", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(&prod, 5000);
    return fail("producer could not allocate %u bytes in pool %s (see its stderr above)",
                BUF_BYTES, POOL);
  }
  printf("  producer: %s\n", line);
  if (spawn(&cpu, "cpu-reader", d, name, seed) < 0) {
    gh_wait(&prod, 5000);
    return fail("cannot start the cpu-reader");
  }
  if (spawn(&gpu, "gpu-reader", d, name, seed) < 0) {
    gh_wait(&cpu, 5000);
    gh_wait(&prod, 5000);
    return fail("cannot start the gpu-reader");
  }
  rc = 0;
  if (gh_expect(&cpu, "WAITING", line, sizeof(line), STEP_MS) < 0)
    rc = fail("cpu-reader never got to gpupool_buffer_get");
  else if (gh_expect(&gpu, "WAITING", line, sizeof(line), STEP_MS) < 0)
    rc = fail("gpu-reader never got to gpupool_buffer_get");
  if (rc == 0) {
    /* Let both Gets reach the daemon before the producer starts its kernels. */
    gh_sleep_ms(200);
    if (gh_writeline(&prod, "GO") < 0 ||
        gh_expect(&prod, "PUBLISHED", line, sizeof(line), STEP_MS) < 0)
      rc = fail("producer did not publish %s (see its stderr above)", name);
  }
  if (rc == 0)
    rc = reader_result(&cpu, "cpu-reader", type_cpu, sizeof(type_cpu));
  if (rc == 0)
    rc = reader_result(&gpu, "gpu-reader", type_gpu, sizeof(type_gpu));
  r_cpu = gh_wait(&cpu, rc == 0 ? STEP_MS : 5000);
  r_gpu = gh_wait(&gpu, rc == 0 ? STEP_MS : 5000);
  if (rc == 0 && r_cpu != 0)
    rc = fail("cpu-reader exited with %d", r_cpu);
  if (rc == 0 && r_gpu != 0)
    rc = fail("gpu-reader exited with %d", r_gpu);
  gh_writeline(&prod, "EXIT");
  if (rc == 0 && gh_expect(&prod, "DONE", line, sizeof(line), STEP_MS) < 0)
    rc = fail("producer did not unpublish and disconnect (see its stderr above)");
  if ((r_cpu = gh_wait(&prod, rc == 0 ? STEP_MS : 5000)) != 0 && rc == 0)
    rc = fail("producer exited with %d", r_cpu);
  if (rc)
    return rc;
  if (gh_wait_used(c, POOL, start_used, 20000, &used) < 0)
    return fail("pool %s uses %" PRIu64 " bytes 20 s after the last release and the unpublish, "
                "%" PRIu64 " before the producer started", POOL, used, start_used);
  printf("PASS: pinned: 64 MiB of host-NUMA memory (node %d) filled by a kernel behind a %u ms "
         "spin and published without synchronizing; read bit-exact by the CPU and by a kernel "
         "in two other processes, both seeing GPUPOOL_MEM_HOST_NUMA (cudaPointerGetAttributes: "
         "%s / %s, with a host pointer); pool used back to %" PRIu64 " bytes\n", NUMA_NODE,
         SPIN_US / 1000, type_cpu, type_gpu, start_used);
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  gh_daemon d;
  int ok = 0, node = -1;
  cudaError_t e;

  if (argc >= 3 && !strcmp(argv[1], "worker"))
    return worker_main(argc, argv);
  gh_driver_start(argc, argv, 2, "GPUPOOLD", 1, "the pinned host-NUMA test");
  e = cudaDeviceGetAttribute(&ok, cudaDevAttrHostNumaMemoryPoolsSupported, 0);
  if (e != cudaSuccess) {
    printf("SKIP: cudaDeviceGetAttribute(cudaDevAttrHostNumaMemoryPoolsSupported, 0): %s: %s\n",
           cudaGetErrorName(e), cudaGetErrorString(e));
    return GH_SKIP;
  }
  if (!ok) {
    printf("SKIP: device 0 does not support host-NUMA memory pools "
           "(cudaDevAttrHostNumaMemoryPoolsSupported = 0)\n");
    return GH_SKIP;
  }
  if (cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    node = -1;
  }
  printf("  device 0's host NUMA node: %d (the pool is on node %d)\n", node, NUMA_NODE);
  if (gh_daemon_start_conf(&d, argv[1], POOL_SPEC, DEVICE_POOL_CONF) < 0)
    return fail("gpupoold did not start with a host-NUMA pool (%s)", POOL_SPEC);
  return gh_run_on_daemon(&d, "pinned", "gpu-pinned-driver", check_pinned);
}
