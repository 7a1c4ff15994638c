/*
 * GPU checks of gpupool against a real gpupoold with the CUDA backend.
 *
 *   gpupool_gpu_test GPUPOOLD CHECK     CHECK = handoff | kill | killwork | orphan | churn | peer |
 *                                               tenants | bundles | all
 *
 * Each check starts its own daemon on a private socket (pool gpu0 on device 0, 2 GiB, 64 MiB
 * slabs), drives it from worker processes (this executable re-executed with "worker ROLE
 * ..."), prints one "PASS: ..." or "FAIL: ..." line and stops the daemon. Exit status 0 pass,
 * 1 fail, 77 skip (no GPU, or fewer than two for peer).
 *
 *   handoff  a producer fills 64 MiB behind a long kernel and publishes without synchronizing;
 *            1 consumer, then 4 at once, get it by name and count mismatches on their own
 *            stream: only the ready event orders their reads after the producer's writes.
 *   kill     a consumer is SIGKILLed while holding the buffer; two more still read it
 *            correctly; after unpublish the pool's used bytes return to their start value.
 *   orphan   the producer exits right after publishing; consumers started afterwards read it.
 *   churn    10,000 allocate/share/open/release cycles between two processes (some in
 *            dedicated slabs, some verified); then gpupool_client_trim: backend_used back to the
 *            baseline (0 with nothing live) and the daemon's open fds flat.
 *   killwork a consumer runs a kernel that keeps writing its buffer for 3 s and is SIGKILLed
 *            while it runs; the producer lets go; another client then
 *            takes the whole pool, fills it and checks it after the dead consumer's work
 *            would have ended: the range is not handed out before that work is over (the
 *            consumer's lease closes only when its process, CUDA context included, is gone).
 *   tenants  (run as root: the check switches a worker to uid 65534) a root producer publishes
 *            64 MiB; a root consumer reads it bit-exact; a root worker gets it through the raw
 *            protocol, keeps the slab's export data from the daemon's reply, and shows that
 *            export data imports into the pool its own AttachPool returns; a worker that
 *            setuid(65534) before touching CUDA connects (socket_mode 0666), attaches the
 *            pool, imports the fd it got, and must fail to import that export data into it
 *            (its tenant's backend pool is another one). The daemon counts 2 backend pools
 *            while both tenants are attached and 1 again once uid 65534 has gone.
 *   fences   a root producer publishes 64 MiB behind a 500 ms kernel without synchronizing;
 *            two consumers with GPUPOOL_HOST_FENCES=1 (they open no event) read it bit-exact:
 *            the daemon held their gets back until the ready event completed. Then (as root)
 *            the same with producer and consumers as uid 65534, which cannot open gpupoold's
 *            events: the library switches to host fences by itself (gpupool_client_host_fences),
 *            publish returns with the producer's stream idle, release with the consumer's
 *            (a read queued behind a spin before it), reads are bit-exact, and the pool's
 *            used bytes return to their start value.
 *   bundles  a producer publishes 6 versions of a 146-member bundle (~70 MiB in one buffer),
 *            each a fresh bundle filled by kernels behind a spin kernel and published without
 *            synchronizing; a consumer gets each with newer_than and checks every member on
 *            its own stream, keeps version 1 and checks it again at the end; then the pool's
 *            used bytes return to their start value.
 *   peer     (2+ GPUs) pool on GPU 0, a consumer on GPU 1 calls gpupool_client_set_devices({1}) and
 *            reads it there; without peer access that call must fail with GPUPOOL_ENOTSUP
 *            naming both devices (or, if the library imports pools lazily, the first
 *            gpupool_buffer_get that imports the pool must).
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
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_driver.h"
#include "gpu_harness.h"
#include "gpu_worker.h"
#include "gpu_kernels.h"
#include "gpupool/gpupool.h"
#include "frames.h"
#include "wire.h"

#define POOL "gpu0"
#define POOL_SPEC "name=gpu0,kind=device,device=0,capacity=2G,slab=64M"
#define BUF_BYTES (64u << 20)
#define SPIN_US 500000u /* long enough that an unordered read would see unwritten memory */
#define STEP_MS 120000  /* generous per-step timeout: CUDA context creation is slow */
#define CHURN_CYCLES 10000
#define NOBODY 65534

static const char *g_check = "?";

/* ------------------------------------------------------------------ worker side */

/* GPU_TEST_WANT_FENCES=0|1: what gpupool_client_host_fences must say in producers and consumers
 * (-1 when unset: not checked). */
static int want_fences(void) {
  const char *e = getenv("GPU_TEST_WANT_FENCES");
  return e && *e ? atoi(e) != 0 : -1;
}

/* producer SOCK NAME BYTES SEED SPIN_US MODE(hold|exit) WAITGO(0|1) */
static int w_producer(char **a) {
  const char *sock = a[0], *name = a[1], *mode = a[5];
  size_t bytes = strtoull(a[2], NULL, 0);
  uint32_t seed = (uint32_t)strtoul(a[3], NULL, 0);
  unsigned spin = (unsigned)strtoul(a[4], NULL, 0);
  int waitgo = atoi(a[6]), rc, ce;
  gpupool_client *c;
  gpupool_buffer *b;
  cudaStream_t s = wstream("producer", 0);

  if ((rc = gpupool_client_connect(sock, "gpu-test-producer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("producer", "gpupool_client_connect", rc);
  if (want_fences() >= 0 && gpupool_client_host_fences(c) != want_fences()) {
    fprintf(stderr, "worker producer (uid %d): host fences %d, expected %d\n", (int)getuid(), gpupool_client_host_fences(c),
            want_fences());
    return 1;
  }
  if ((rc = gpupool_buffer_alloc(c, POOL, bytes, 10000, s, &b)) < 0)
    wdie("producer", "gpupool_buffer_alloc", rc);
  if (gpupool_buffer_device(b) != 0 || gpupool_buffer_kind(b) != GPUPOOL_MEM_DEVICE ||
      gpupool_buffer_size(b) < bytes) {
    fprintf(stderr, "worker producer: buffer is device %d kind %d size %zu, expected device 0 "
            "device memory of >= %zu bytes\n", gpupool_buffer_device(b),
            (int)gpupool_buffer_kind(b), gpupool_buffer_size(b), bytes);
    return 2;
  }
  if (waitgo) {
    gh_say("ALLOCATED");
    wait_stdin_line("producer", "GO");
  }
  wfill_publish("producer", b, bytes, seed, spin, name, s);
  if (gpupool_client_host_fences(c) && (ce = (int)cudaStreamQuery(s)) != cudaSuccess) {
    fprintf(stderr, "worker producer: with host fences, gpupool_buffer_publish returned while its stream still had work "
            "(cudaStreamQuery: %s): consumers could read unwritten memory\n", cudaGetErrorName((cudaError_t)ce));
    return 1;
  }
  gh_say("PUBLISHED");
  /* The name holds the buffer now. */
  if ((rc = gpupool_buffer_release(b, s)) < 0)
    wdie("producer", "gpupool_buffer_release", rc);
  if (!strcmp(mode, "hold")) {
    wait_stdin_line("producer", "EXIT");
    if ((rc = gpupool_name_unpublish(c, name)) < 0)
      wdie("producer", "gpupool_name_unpublish", rc);
  } else {
    /* Leave with nothing pending on the GPU: what is tested is that the published memory
     * outlives this process, not how the driver tears down a context with queued work. */
    if ((ce = (int)cudaStreamSynchronize(s)))
      cdie("producer", "cudaStreamSynchronize", ce);
  }
  gpupool_client_disconnect(c);
  (void)cudaStreamDestroy(s);
  gh_say("DONE");
  return 0;
}

/* consumer SOCK NAME BYTES SEED HOLD(0|1) DEVICE PEER(-|ok|enotsup) */
static int w_consumer(char **a) {
  const char *sock = a[0], *name = a[1], *peer = a[6];
  size_t bytes = strtoull(a[2], NULL, 0);
  uint32_t seed = (uint32_t)strtoul(a[3], NULL, 0);
  int hold = atoi(a[4]), dev = atoi(a[5]), rc, ce;
  unsigned long long bad = ~0ull, sink = 0;
  gpupool_client *c;
  gpupool_buffer *b;
  gpupool_tensor_meta meta;
  cudaStream_t s = wstream("consumer", dev);

  if ((rc = gpupool_client_connect(sock, "gpu-test-consumer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("consumer", "gpupool_client_connect", rc);
  if (want_fences() >= 0 && gpupool_client_host_fences(c) != want_fences()) {
    fprintf(stderr, "worker consumer (uid %d): host fences %d, expected %d\n", (int)getuid(), gpupool_client_host_fences(c),
            want_fences());
    return 1;
  }
  if (strcmp(peer, "-") && (rc = gpupool_client_set_devices(c, &dev, 1)) < 0 &&
      strcmp(peer, "enotsup") != 0)
    wdie("consumer", "gpupool_client_set_devices", rc);
  if (!strcmp(peer, "enotsup")) {
    /* Without peer access the refusal must come from gpupool_client_set_devices; a library that
     * imports pools lazily can only refuse when the first buffer brings the pool in, so a
     * refusal from gpupool_buffer_get(before any memory is touched) is accepted too. */
    const char *where = "gpupool_client_set_devices";
    if (rc == 0) {
      where = "gpupool_buffer_get";
      rc = gpupool_buffer_get(c, name, 0, STEP_MS, GPUPOOL_READ_ONLY, s, &b, NULL);
      if (rc == 0) {
        fprintf(stderr, "worker consumer: device %d has no peer access to device 0, yet "
                "gpupool_client_set_devices({%d}) and gpupool_buffer_get both succeeded\n", dev, dev);
        return 1;
      }
    }
    const char *msg = gpupool_last_error();
    char want_a[32], want_b[32];
    snprintf(want_a, sizeof(want_a), "device %d", dev);
    snprintf(want_b, sizeof(want_b), "device %d", 0);
    if (rc == GPUPOOL_ENOTSUP && strstr(msg, want_a) && strstr(msg, want_b)) {
      gh_say("ENOTSUP from %s: %s", where, msg);
      gpupool_client_disconnect(c);
      (void)cudaStreamDestroy(s);
      return 0;
    }
    fprintf(stderr, "worker consumer: without peer access %s returned %s with \"%s\"; expected "
            "ENOTSUP naming devices %d and 0\n", where, gpupool_err_name(rc), msg, dev);
    return 1;
  }
  gh_say("WAITING");
  if ((rc = gpupool_buffer_get(c, name, 0, STEP_MS, GPUPOOL_READ_ONLY, s, &b, NULL)) < 0)
    wdie("consumer", "gpupool_buffer_get", rc);
  if (gpupool_buffer_size(b) < bytes || !gpupool_buffer_read_only(b)) {
    fprintf(stderr, "worker consumer: got %zu bytes read_only=%d, expected >= %zu read-only\n",
            gpupool_buffer_size(b), gpupool_buffer_read_only(b), bytes);
    return 1;
  }
  if ((rc = gpupool_buffer_tensor(b, &meta)) < 0)
    wdie("consumer", "gpupool_buffer_tensor", rc);
  if (meta.ndim != 1 || meta.shape[0] != (int64_t)(bytes / 4) || meta.dtype_bits != 32) {
    fprintf(stderr, "worker consumer: tensor meta ndim %d shape0 %" PRId64 " bits %u, expected "
            "1-d uint32 of %zu elements\n", meta.ndim, meta.shape[0], meta.dtype_bits,
            bytes / 4);
    return 1;
  }
  /* The stream waits on the ready event (gpupool_buffer_get queued the wait); nothing else orders
   * this read after the producer's writes. */
  if ((ce = gk_count_mismatches(gpupool_buffer_ptr(b), bytes, seed, s, &bad)))
    cdie("consumer", "mismatch kernel", ce);
  gh_say("RESULT %llu", bad);
  if (hold) {
    gh_say("HOLDING");
    for (;;)
      pause();
  }
  if (gpupool_client_host_fences(c)) {
    /* Work still queued on the buffer when it is released: without a done event, the
     * release itself must wait for it. */
    if ((ce = gk_spin(s, SPIN_US / 5)) || (ce = gk_read(gpupool_buffer_ptr(b), bytes, s, &sink)))
      cdie("consumer", "spin and read kernels", ce);
  }
  if ((rc = gpupool_buffer_release(b, s)) < 0)
    wdie("consumer", "gpupool_buffer_release", rc);
  if (gpupool_client_host_fences(c) && (ce = (int)cudaStreamQuery(s)) != cudaSuccess) {
    fprintf(stderr, "worker consumer: with host fences, gpupool_buffer_release returned while its stream still read the "
            "buffer (cudaStreamQuery: %s): the range could be reused under that read\n",
            cudaGetErrorName((cudaError_t)ce));
    return 1;
  }
  wfinish("consumer", c, s);
  if (bad) {
    fprintf(stderr, "worker consumer (pid %d): %llu of %zu words differ from the pattern\n",
            (int)getpid(), bad, bytes / 4);
    return 1;
  }
  return 0;
}

/* killer SOCK NAME BYTES SEED SPIN_US: get NAME writable, queue a kernel that keeps writing
 * SEED's pattern over the whole buffer for SPIN_US, then a fill, say QUEUED (once the kernel
 * is running) and wait to be killed with that work in flight. */
static int w_killer(char **a) {
  const char *sock = a[0], *name = a[1];
  size_t bytes = strtoull(a[2], NULL, 0);
  uint32_t seed = (uint32_t)strtoul(a[3], NULL, 0);
  unsigned spin = (unsigned)strtoul(a[4], NULL, 0);
  int rc, ce;
  gpupool_client *c;
  gpupool_buffer *b;
  cudaStream_t s = wstream("killer", 0);

  if ((rc = gpupool_client_connect(sock, "gpu-test-killer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("killer", "gpupool_client_connect", rc);
  if ((rc = gpupool_buffer_get(c, name, 0, STEP_MS, 0, s, &b, NULL)) < 0)
    wdie("killer", "gpupool_buffer_get", rc);
  if ((ce = gk_scribble(gpupool_buffer_ptr(b), bytes, seed, spin, s)) ||
      (ce = gk_fill(gpupool_buffer_ptr(b), bytes, seed, s)))
    cdie("killer", "queueing work", ce);
  gh_sleep_ms(100); /* the scribbling kernel is on the GPU now */
  if (cudaStreamQuery(s) != cudaErrorNotReady) {
    fprintf(stderr, "worker killer: the work ended before the kill; raise SPIN_US\n");
    return 2;
  }
  gh_say("QUEUED");
  for (;;)
    pause();
  return 0;
}

/* taker SOCK BYTES SEED WAIT_MS: allocate every BYTES-sized buffer the pool has (waiting for
 * memory to come back where it must: the killed consumer's range may be back already or not
 * yet), fill them all with SEED, wait WAIT_MS, count mismatches. */
static int w_taker(char **a) {
  const char *sock = a[0];
  size_t bytes = strtoull(a[1], NULL, 0);
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  int wait_ms = atoi(a[3]), n = 0, rc, ce;
  unsigned long long bad = 0, one;
  gpupool_client *c;
  gpupool_buffer *b[64];
  cudaStream_t s = wstream("taker", 0);

  if ((rc = gpupool_client_connect(sock, "gpu-test-taker", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("taker", "gpupool_client_connect", rc);
  {
    gpupool_pool_stats ps[8];
    int np = 0, want = 0;
    if ((rc = gpupool_client_stats(c, NULL, ps, 8, &np)) < 0)
      wdie("taker", "gpupool_client_stats", rc);
    for (int i = 0; i < np && i < 8; i++)
      if (!strcmp(ps[i].name, POOL))
        want = (int)(ps[i].capacity / bytes);
    if (want < 1 || want > 64)
      wdie("taker", "pool capacity", GPUPOOL_EINVAL);
    /* The range the killed consumer held comes back once its process is gone. */
    for (n = 0; n < want; n++)
      if ((rc = gpupool_buffer_alloc(c, POOL, bytes, STEP_MS, s, &b[n])) < 0)
        wdie("taker", "gpupool_buffer_alloc (waiting for the killed consumer's range)", rc);
  }
  gh_say("GOT %d", n);
  for (int i = 0; i < n; i++)
    if ((ce = gk_fill(gpupool_buffer_ptr(b[i]), bytes, seed, s)))
      cdie("taker", "fill kernel", ce);
  if ((ce = (int)cudaStreamSynchronize(s)))
    cdie("taker", "cudaStreamSynchronize", ce);
  gh_sleep_ms(wait_ms);
  for (int i = 0; i < n; i++) {
    if ((ce = gk_count_mismatches(gpupool_buffer_ptr(b[i]), bytes, seed, s, &one)))
      cdie("taker", "mismatch kernel", ce);
    bad += one;
  }
  gh_say("RESULT %llu", bad);
  for (int i = 0; i < n; i++)
    gpupool_buffer_release(b[i], s);
  (void)cudaStreamSynchronize(s);
  gpupool_client_disconnect(c);
  (void)cudaStreamDestroy(s);
  return 0;
}

/* Message from churn A to churn B: a token, the size asked for, whether to verify. */
typedef struct {
  gpupool_token token;
  uint64_t size;
  uint32_t seed;
  uint32_t verify;
} churn_msg;

static uint64_t churn_size(int i) {
  static const uint64_t sizes[4] = {4096, 64u << 10, 1u << 20, 8u << 20};
  if (i % 100 == 99)
    return 96u << 20; /* larger than a 64 MiB slab: a dedicated slab, exported and unmapped */
  return sizes[(i * 7 + i / 4) % 4];
}

/* churn-a SOCK N: fd 3 writes messages to B, fd 4 reads B's acks. */
static int w_churn_a(char **a) {
  const char *sock = a[0];
  int n = atoi(a[1]), rc, ce;
  gpupool_client *c;
  cudaStream_t s = wstream("churn-a", 0);

  if ((rc = gpupool_client_connect(sock, "gpu-test-churn-a", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("churn-a", "gpupool_client_connect", rc);
  for (int i = 0; i < n; i++) {
    churn_msg m;
    gpupool_buffer *b;
    uint8_t ack;
    memset(&m, 0, sizeof(m));
    m.size = churn_size(i);
    m.verify = i % 250 == 0 || i % 1000 == 999;
    m.seed = (uint32_t)i * 0x9e3779b9u + 1;
    if ((rc = gpupool_buffer_alloc(c, POOL, m.size, 30000, s, &b)) < 0)
      wdie("churn-a", "gpupool_buffer_alloc", rc);
    if (m.verify && (ce = gk_fill(gpupool_buffer_ptr(b), m.size, m.seed, s)))
      cdie("churn-a", "fill kernel", ce);
    if ((rc = gpupool_buffer_share(b, s, &m.token)) < 0)
      wdie("churn-a", "gpupool_buffer_share", rc);
    if (gh_full_io(3, &m, sizeof(m), 1) < 0 || gh_full_io(4, &ack, 1, 0) < 0) {
      fprintf(stderr, "worker churn-a: peer went away at cycle %d\n", i);
      return 2;
    }
    if (ack != 1) {
      fprintf(stderr, "worker churn-a: peer reported failure at cycle %d\n", i);
      return 1;
    }
    if ((rc = gpupool_buffer_release(b, s)) < 0)
      wdie("churn-a", "gpupool_buffer_release", rc);
  }
  wfinish("churn-a", c, s);
  gh_say("DONE %d", n);
  return 0;
}

/* churn-b SOCK N: fd 3 reads messages from A, fd 4 writes acks. */
static int w_churn_b(char **a) {
  const char *sock = a[0];
  int n = atoi(a[1]), rc, ce, verified = 0;
  gpupool_client *c;
  cudaStream_t s = wstream("churn-b", 0);

  if ((rc = gpupool_client_connect(sock, "gpu-test-churn-b", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("churn-b", "gpupool_client_connect", rc);
  for (int i = 0; i < n; i++) {
    churn_msg m;
    gpupool_buffer *b;
    uint8_t ack = 1;
    if (gh_full_io(3, &m, sizeof(m), 0) < 0) {
      fprintf(stderr, "worker churn-b: peer went away at cycle %d\n", i);
      return 2;
    }
    if ((rc = gpupool_buffer_open(c, &m.token, 0, s, &b)) < 0)
      wdie("churn-b", "gpupool_buffer_open", rc);
    if (gpupool_buffer_size(b) < m.size) {
      fprintf(stderr, "worker churn-b: cycle %d opened %zu bytes, expected >= %" PRIu64 "\n", i,
              gpupool_buffer_size(b), m.size);
      ack = 0;
    }
    if (ack && m.verify) {
      unsigned long long bad = ~0ull;
      if ((ce = gk_count_mismatches(gpupool_buffer_ptr(b), m.size, m.seed, s, &bad)))
        cdie("churn-b", "mismatch kernel", ce);
      if (bad) {
        fprintf(stderr, "worker churn-b: cycle %d: %llu words differ\n", i, bad);
        ack = 0;
      }
      verified++;
    }
    if ((rc = gpupool_buffer_release(b, s)) < 0)
      wdie("churn-b", "gpupool_buffer_release", rc);
    if (gh_full_io(4, &ack, 1, 1) < 0)
      return 2;
    if (!ack)
      return 1;
  }
  wfinish("churn-b", c, s);
  gh_say("DONE %d verified %d", n, verified);
  return 0;
}

/* ---- raw protocol, for what the library never shows: a slab's export data, a pool's fd */

static int raw_connect(const char *path) { return ts_raw_connect(path, STEP_MS / 1000); }

/* One request; the reply (NULL when none came), and in *fd the fd it carried (-1 if none;
 * fd NULL: any is closed). A reply carrying an error is printed and freed: NULL. */
static gpupool__rep *raw_call(const char *role, int sock, gpupool__req *req, int *fd) {
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  int rc;
  static uint64_t seq;
  if (fd)
    *fd = -1;
  req->seq = ++seq;
  if ((rc = ts_raw_send(sock, req, NULL, 0)) != 0)
    wdie(role, "sending a request", rc);
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  if (gpupool__wire_rx_read(&rx, sock) == 1 && (rep = gpupool__wire_unpack_reply(&rx)) && fd &&
      rx.nfds > 0) {
    *fd = rx.fds[0];
    rx.fds[0] = -1;
  }
  gpupool__wire_rx_reset(&rx);
  if (rep && rep->error) {
    fprintf(stderr, "worker %s: request %d refused: %s (%d)\n", role, (int)req->body_case,
            rep->error->message, rep->error->code);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    if (fd && *fd >= 0)
      close(*fd);
    return NULL;
  }
  return rep;
}

/* Hello on a raw connection: the first pool's id (the test's only pool). */
static uint32_t raw_hello(const char *role, int sock) {
  gpupool__req req;
  Gpupool__Wire__Hello h;
  gpupool__rep *rep;
  uint32_t id;
  ts_hello(&req, &h, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, role, 0);
  rep = raw_call(role, sock, &req, NULL); /* the lease fd is closed: this client maps nothing */
  if (!rep || rep->body_case != GPUPOOL__WIRE__REPLY__BODY_HELLO || rep->hello->n_pools < 1) {
    fprintf(stderr, "worker %s: no Hello reply with a pool\n", role);
    exit(2);
  }
  id = rep->hello->pools[0]->id;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return id;
}

/* AttachPool on a raw connection, then import the pool fd it returned. */
static cudaMemPool_t raw_attach_import(const char *role, int sock, uint32_t pool_id) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AttachPool ap = GPUPOOL__WIRE__ATTACH_POOL__INIT;
  gpupool__rep *rep;
  cudaMemPool_t pool;
  cudaError_t ce;
  int fd;
  ap.pool_id = pool_id;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL;
  req.attach_pool = &ap;
  rep = raw_call(role, sock, &req, &fd);
  if (!rep || fd < 0) {
    fprintf(stderr, "worker %s: AttachPool brought no pool fd\n", role);
    exit(2);
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  ce = cudaMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)fd,
                                            cudaMemHandleTypePosixFileDescriptor, 0);
  close(fd);
  if (ce != cudaSuccess)
    cdie(role, "cudaMemPoolImportFromShareableHandle of the pool fd AttachPool returned", (int)ce);
  return pool;
}

static void hex_encode(const uint8_t *p, size_t n, char *out) {
  for (size_t i = 0; i < n; i++)
    sprintf(out + 2 * i, "%02x", p[i]);
}

static size_t hex_decode(const char *h, uint8_t *out, size_t max) {
  size_t n = 0;
  unsigned v;
  while (n < max && sscanf(h + 2 * n, "%2x", &v) == 1)
    out[n++] = (uint8_t)v;
  return n;
}

/* exporter SOCK NAME BYTES SEED (root): Get NAME raw, say "EXPORT <hex>" with its slab's
 * export data from the daemon's reply, then show that data imports into the pool this
 * tenant's AttachPool returns and reads the producer's pattern (the control: the refusal the
 * other tenant must get is not an artefact of bad export data). */
static int w_exporter(char **a) {
  const char *sock = a[0], *name = a[1];
  size_t bytes = strtoull(a[2], NULL, 0);
  uint32_t seed = (uint32_t)strtoul(a[3], NULL, 0);
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get g = GPUPOOL__WIRE__GET__INIT;
  struct cudaMemPoolPtrExportData exp;
  char hex[2 * sizeof(exp) + 1];
  unsigned long long bad = ~0ull;
  gpupool__rep *rep;
  cudaMemPool_t pool;
  cudaStream_t s = wstream("exporter", 0);
  uint64_t off;
  uint32_t pool_id;
  void *ptr = NULL;
  int fd = raw_connect(sock), ce;

  if (fd < 0)
    wdie("exporter", "connecting", GPUPOOL_ECLOSED);
  raw_hello("exporter", fd);
  g.name = (char *)name;
  g.read_only = 1;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  req.get = &g;
  rep = raw_call("exporter", fd, &req, NULL);
  if (!rep || rep->body_case != GPUPOOL__WIRE__REPLY__BODY_GET || !rep->get->buffer ||
      !rep->get->buffer->slab || rep->get->buffer->slab->export_data.len != sizeof(exp)) {
    fprintf(stderr, "worker exporter: Get %s brought no slab export data of %zu bytes\n", name,
            sizeof(exp));
    return 2;
  }
  memcpy(&exp, rep->get->buffer->slab->export_data.data, sizeof(exp));
  off = rep->get->buffer->offset;
  pool_id = rep->get->buffer->pool_id;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  hex_encode((const uint8_t *)&exp, sizeof(exp), hex);
  gh_say("EXPORT %s", hex);

  pool = raw_attach_import("exporter", fd, pool_id);
  if ((ce = (int)cudaMemPoolImportPointer(&ptr, pool, &exp)))
    cdie("exporter", "cudaMemPoolImportPointer into its own tenant's pool", ce);
  if ((ce = gk_count_mismatches((char *)ptr + off, bytes, seed, s, &bad)))
    cdie("exporter", "mismatch kernel", ce);
  if ((ce = (int)cudaFreeAsync(ptr, s)) || (ce = (int)cudaStreamSynchronize(s)))
    cdie("exporter", "freeing the imported slab", ce);
  if ((ce = (int)cudaMemPoolDestroy(pool)))
    cdie("exporter", "cudaMemPoolDestroy of the imported pool", ce);
  gh_say("CONTROL %llu", bad);
  close(fd);
  (void)cudaStreamDestroy(s);
  return 0;
}

/* intruder SOCK: become uid 65534 before touching CUDA, read "EXPORT <hex>" on stdin (another
 * tenant's slab), attach the pool as this tenant and try to import that slab into the pool
 * imported from the fd the daemon gave. Says "REFUSED <error>" or "IMPORTED <mismatches>",
 * then waits for EXIT (so the daemon counts its backend pool meanwhile). */
static int w_intruder(char **a) {
  const char *sock = a[0];
  struct cudaMemPoolPtrExportData exp;
  char line[512];
  cudaMemPool_t pool;
  cudaError_t e;
  uint32_t pool_id;
  void *ptr = NULL;
  int fd;

  if (ts_become(NOBODY) != 0 || getuid() != NOBODY) {
    fprintf(stderr, "worker intruder: cannot become uid %d: %s (run the GPU tests as root)\n",
            NOBODY, strerror(errno));
    return 2;
  }
  if (!fgets(line, sizeof(line), stdin) || strncmp(line, "EXPORT ", 7) != 0 ||
      hex_decode(line + 7, (uint8_t *)&exp, sizeof(exp)) != sizeof(exp)) {
    fprintf(stderr, "worker intruder: expected \"EXPORT <hex>\" on stdin\n");
    return 2;
  }
  if ((fd = raw_connect(sock)) < 0) {
    fprintf(stderr, "worker intruder: uid %d cannot connect to %s: %s (socket_mode and the "
            "directory's mode must let it)\n", NOBODY, sock, strerror(errno));
    return 2;
  }
  pool_id = raw_hello("intruder", fd);
  pool = raw_attach_import("intruder", fd, pool_id);
  gh_say("TRYING");
  e = cudaMemPoolImportPointer(&ptr, pool, &exp);
  if (e == cudaSuccess) {
    cudaStream_t s = wstream("intruder", 0);
    unsigned long long bad = ~0ull;
    (void)gk_count_mismatches(ptr, 4096, 0, s, &bad);
    gh_say("IMPORTED %p", ptr);
    (void)cudaFreeAsync(ptr, s);
    (void)cudaStreamSynchronize(s);
  } else {
    (void)cudaGetLastError();
    gh_say("REFUSED %s", cudaGetErrorName(e));
  }
  wait_stdin_line("intruder", "EXIT");
  (void)cudaMemPoolDestroy(pool);
  close(fd);
  return 0;
}

/* fresh SOCK BYTES: as uid 65534, allocate BYTES through the library (a new slab of its own
 * tenant's pool) and count the bytes that are not zero: another tenant's freed memory must
 * never arrive with its bytes in it. */
static int w_fresh(char **a) {
  const char *sock = a[0];
  size_t bytes = strtoull(a[1], NULL, 0);
  unsigned long long nonzero = 0;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  struct cudaMemPoolPtrExportData exp;
  const Gpupool__Wire__BufferDesc *bd;
  gpupool__rep *rep;
  cudaMemPool_t pool;
  uint32_t pool_id;
  void *ptr = NULL;
  uint8_t *host;
  int fd, ce;

  if (ts_become(NOBODY) != 0 || getuid() != NOBODY) {
    fprintf(stderr, "worker fresh: cannot become uid %d: %s\n", NOBODY, strerror(errno));
    return 2;
  }
  /* The raw protocol, as the intruder: the slab's bytes as the daemon hands them over, with
   * no library in between (gpu_fences checks the library as another uid). */
  if ((fd = raw_connect(sock)) < 0) {
    fprintf(stderr, "worker fresh: cannot connect to %s: %s\n", sock, strerror(errno));
    return 2;
  }
  pool_id = raw_hello("fresh", fd);
  pool = raw_attach_import("fresh", fd, pool_id);
  al.pool_id = pool_id;
  al.size = bytes;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  rep = raw_call("fresh", fd, &req, NULL);
  bd = rep && rep->allocate ? rep->allocate->buffer : NULL;
  if (!bd || !bd->slab || bd->slab->export_data.len != sizeof(exp)) {
    fprintf(stderr, "worker fresh: the Allocate reply carries no slab export data\n");
    return 2;
  }
  memcpy(&exp, bd->slab->export_data.data, sizeof(exp));
  if ((ce = (int)cudaMemPoolImportPointer(&ptr, pool, &exp)))
    cdie("fresh", "cudaMemPoolImportPointer of its own new slab", ce);
  if (!(host = malloc(bytes)))
    return 2;
  if ((ce = (int)cudaMemcpy(host, (uint8_t *)ptr + bd->offset, bytes, cudaMemcpyDefault)))
    cdie("fresh", "cudaMemcpy", ce);
  for (size_t i = 0; i < bytes; i++)
    nonzero += host[i] != 0;
  gh_say("NONZERO %llu", nonzero);
  free(host);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  (void)cudaFree(ptr);
  (void)cudaMemPoolDestroy(pool);
  close(fd);
  return 0;
}

/* ------------------------------------------------------------------ bundles */

#define BUNDLE_MEMBERS 146
#define BUNDLE_VERSIONS 6

/* Member i of the bundles check: a multiple of 4 bytes, some large, most small (a state
 * dict's shape), 146 of them about 70 MiB in all. */
static size_t bmember_bytes(int i) { return i % 10 == 0 ? (size_t)4 << 20 : (size_t)(i % 9 + 1) * 64 * 1024 + 4u * (size_t)i; }

static uint32_t bseed(uint32_t seed, uint64_t version, int i) { return seed + (uint32_t)version * 1000u + (uint32_t)i; }

/* bproducer SOCK NAME SEED: publishes versions 1..BUNDLE_VERSIONS of bundle NAME, each in a
 * fresh bundle (double buffering: a reader may still hold the previous one), every member
 * filled from a kernel queued behind a spin kernel, published without synchronizing. */
static int w_bproducer(char **a) {
  const char *sock = a[0], *name = a[1];
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  gpupool_member_spec specs[BUNDLE_MEMBERS];
  char names[BUNDLE_MEMBERS][32];
  gpupool_client *c;
  cudaStream_t s = wstream("bproducer", 0);
  int rc, ce;

  for (int i = 0; i < BUNDLE_MEMBERS; i++) {
    snprintf(names[i], sizeof names[i], "model.layers.%d.weight", i);
    specs[i] = (gpupool_member_spec){.name = names[i], .size = bmember_bytes(i)};
  }
  if ((rc = gpupool_client_connect(sock, "gpu-test-bproducer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("bproducer", "gpupool_client_connect", rc);
  for (uint64_t v = 1; v <= BUNDLE_VERSIONS; v++) {
    gpupool_bundle *b;
    uint64_t got = 0;
    if ((rc = gpupool_bundle_alloc(c, POOL, specs, BUNDLE_MEMBERS, 0, 10000, s, &b)) < 0)
      wdie("bproducer", "gpupool_bundle_alloc", rc);
    if (gpupool_bundle_buffers(b) != 1) {
      fprintf(stderr, "worker bproducer: %d buffers for a bundle of 70 MiB, expected 1\n",
              gpupool_bundle_buffers(b));
      return 1;
    }
    if ((ce = gk_spin(s, SPIN_US / 5)))
      cdie("bproducer", "spin kernel", ce);
    for (int i = 0; i < BUNDLE_MEMBERS; i++) {
      gpupool_member m;
      gpupool_bundle_member(b, i, &m);
      if ((ce = gk_fill(m.ptr, m.size, bseed(seed, v, i), s)))
        cdie("bproducer", "fill kernel", ce);
    }
    if ((rc = gpupool_bundle_publish(b, name, s, &got)) < 0)
      wdie("bproducer", "gpupool_bundle_publish", rc);
    if (got != v) {
      fprintf(stderr, "worker bproducer: publish made version %llu, expected %llu\n",
              (unsigned long long)got, (unsigned long long)v);
      return 1;
    }
    gh_say("PUBLISHED %llu", (unsigned long long)v);
    if ((rc = gpupool_bundle_release(b, s)) < 0)
      wdie("bproducer", "gpupool_bundle_release", rc);
    wait_stdin_line("bproducer", "NEXT");
  }
  wait_stdin_line("bproducer", "EXIT");
  if ((rc = gpupool_name_unpublish(c, name)) < 0)
    wdie("bproducer", "gpupool_name_unpublish", rc);
  wfinish("bproducer", c, s);
  return 0;
}

/* Mismatching words of every member of b against version v's pattern, on b's stream. */
static unsigned long long bundle_mismatches(gpupool_bundle *b, uint32_t seed, cudaStream_t s) {
  unsigned long long total = 0;
  uint64_t v = gpupool_bundle_version(b);
  for (int i = 0; i < gpupool_bundle_count(b); i++) {
    gpupool_member m;
    unsigned long long bad = ~0ull;
    char want[32];
    snprintf(want, sizeof want, "model.layers.%d.weight", i);
    if (gpupool_bundle_member(b, i, &m) != 0 || strcmp(m.name, want) || m.size != bmember_bytes(i))
      return ~0ull;
    int ce = gk_count_mismatches(m.ptr, m.size, bseed(seed, v, i), s, &bad);
    if (ce)
      cdie("bconsumer", "mismatch kernel", ce);
    total += bad;
  }
  return total;
}

/* bconsumer SOCK NAME SEED: gets every version with newer_than (waiting for each), checks it
 * on its own stream (ordered only by the ready event), and keeps version 1 to check it again
 * after the last version was published. */
static int w_bconsumer(char **a) {
  const char *sock = a[0], *name = a[1];
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  gpupool_client *c;
  gpupool_bundle *first = NULL;
  cudaStream_t s = wstream("bconsumer", 0);
  uint64_t last = 0;
  unsigned long long bad;
  int rc;

  if ((rc = gpupool_client_connect(sock, "gpu-test-bconsumer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie("bconsumer", "gpupool_client_connect", rc);
  gh_say("WAITING");
  while (last < BUNDLE_VERSIONS) {
    gpupool_bundle *b;
    if ((rc = gpupool_bundle_get(c, name, last, STEP_MS, GPUPOOL_READ_ONLY, s, &b)) < 0)
      wdie("bconsumer", "gpupool_bundle_get", rc);
    if (gpupool_bundle_version(b) != last + 1) {
      fprintf(stderr, "worker bconsumer: got version %llu after %llu\n",
              (unsigned long long)gpupool_bundle_version(b), (unsigned long long)last);
      return 1;
    }
    last = gpupool_bundle_version(b);
    if ((bad = bundle_mismatches(b, seed, s)) != 0) {
      fprintf(stderr, "worker bconsumer: version %llu: %llu words differ (or the member table is "
              "wrong)\n", (unsigned long long)last, bad);
      return 1;
    }
    gh_say("CHECKED %llu", (unsigned long long)last);
    if (!first)
      first = b;
    else if ((rc = gpupool_bundle_release(b, s)) < 0)
      wdie("bconsumer", "gpupool_bundle_release", rc);
  }
  /* Version 1 again, now that five later versions went into other memory. */
  if ((bad = bundle_mismatches(first, seed, s)) != 0) {
    fprintf(stderr, "worker bconsumer: version 1, held to the end: %llu words differ\n", bad);
    return 1;
  }
  if ((rc = gpupool_bundle_release(first, s)) < 0)
    wdie("bconsumer", "gpupool_bundle_release", rc);
  wfinish("bconsumer", c, s);
  gh_say("RESULT 0");
  return 0;
}

static int worker_main(int argc, char **argv) {
  static const struct {
    const char *role;
    int nargs;
    int (*fn)(char **);
  } roles[] = {{"producer", 7, w_producer},
               {"consumer", 7, w_consumer},
               {"killer", 5, w_killer},
               {"taker", 4, w_taker},
               {"churn-a", 2, w_churn_a},
               {"churn-b", 2, w_churn_b},
               {"exporter", 4, w_exporter},
               {"intruder", 1, w_intruder},
               {"fresh", 2, w_fresh},
               {"bproducer", 3, w_bproducer},
               {"bconsumer", 3, w_bconsumer}};
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (getenv("GPU_TEST_AS_NOBODY") &&
      (ts_become(NOBODY) != 0 || getuid() != NOBODY)) {
    fprintf(stderr, "worker: cannot become uid %d: %s (run the GPU tests as root)\n", NOBODY, strerror(errno));
    return 2;
  }
  for (size_t i = 0; i < sizeof(roles) / sizeof(roles[0]); i++)
    if (argc >= 3 && !strcmp(argv[2], roles[i].role)) {
      if (argc - 3 != roles[i].nargs) {
        fprintf(stderr, "worker %s: %d arguments, expected %d\n", roles[i].role, argc - 3,
                roles[i].nargs);
        return 2;
      }
      return roles[i].fn(argv + 3);
    }
  fprintf(stderr, "unknown worker role %s\n", argc >= 3 ? argv[2] : "(none)");
  return 2;
}

/* ------------------------------------------------------------------ driver side */

/* The verdict lines of the check now running (g_check). */
#define fail(...) gh_verdict(1, g_check, __VA_ARGS__)
#define pass(...) gh_verdict(0, g_check, __VA_ARGS__)

static uint32_t fresh_seed(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint32_t)ts.tv_nsec ^ ((uint32_t)getpid() << 16) ^ 0xa5a5a5a5u;
}

static int spawn_producer(gh_proc *p, const gh_daemon *d, const char *name, uint32_t seed,
                          unsigned spin, const char *mode, int waitgo) {
  char bytes[32], sd[32], sp[32], wg[8];
  snprintf(bytes, sizeof(bytes), "%u", BUF_BYTES);
  snprintf(sd, sizeof(sd), "%u", seed);
  snprintf(sp, sizeof(sp), "%u", spin);
  snprintf(wg, sizeof(wg), "%d", waitgo);
  const char *argv[] = {"", "worker", "producer", d->sock, name, bytes, sd, sp, mode, wg, NULL};
  return gh_spawn(p, argv, NULL, 0);
}

static int spawn_consumer(gh_proc *p, const gh_daemon *d, const char *name, uint32_t seed,
                          int hold, int dev, const char *peer) {
  char bytes[32], sd[32], h[8], dv[8];
  snprintf(bytes, sizeof(bytes), "%u", BUF_BYTES);
  snprintf(sd, sizeof(sd), "%u", seed);
  snprintf(h, sizeof(h), "%d", hold);
  snprintf(dv, sizeof(dv), "%d", dev);
  const char *argv[] = {"", "worker", "consumer", d->sock, name, bytes, sd, h, dv, peer, NULL};
  return gh_spawn(p, argv, NULL, 0);
}

/* A producer of name (seed's pattern behind a spin of spin µs) that has published it and
 * holds it until producer_done: 0, or 1 after a FAIL line. */
static int start_published(gh_proc *prod, const gh_daemon *d, const char *name, uint32_t seed, unsigned spin) {
  char line[256];
  if (spawn_producer(prod, d, name, seed, spin, "hold", 0) < 0)
    return fail("cannot start the producer");
  if (gh_expect(prod, "PUBLISHED", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(prod, 5000);
    return fail("producer did not publish");
  }
  return 0;
}

/* Tell a holding producer to unpublish and exit, and reap it: 0, or 1 after a FAIL line. */
static int producer_done(gh_proc *prod) {
  int rc;
  gh_writeline(prod, "EXIT");
  if ((rc = gh_wait(prod, STEP_MS)) != 0)
    return fail("producer exited with %d", rc);
  return 0;
}

/* Run n consumers of name at once; all must report 0 mismatches and exit 0. */
static int run_consumers(const gh_daemon *d, const char *name, uint32_t seed, int n,
                         gh_proc *producer_to_go) {
  gh_proc cons[8];
  char line[256];
  int ok = 1, started = 0;

  for (int i = 0; i < n; i++) {
    if (spawn_consumer(&cons[i], d, name, seed, 0, 0, "-") < 0) {
      ok = 0;
      break;
    }
    started++;
  }
  for (int i = 0; ok && i < started; i++)
    if (gh_expect(&cons[i], "WAITING", line, sizeof(line), STEP_MS) < 0) {
      fail("consumer %d of %d never got to gpupool_buffer_get", i + 1, n);
      ok = 0;
    }
  if (ok && producer_to_go) {
    /* Let every consumer's Get reach the daemon before the producer starts its kernels. */
    gh_sleep_ms(200);
    if (gh_writeline(producer_to_go, "GO") < 0 ||
        gh_expect(producer_to_go, "PUBLISHED", line, sizeof(line), STEP_MS) < 0) {
      fail("producer did not publish %s", name);
      ok = 0;
    }
  }
  for (int i = 0; i < started; i++) {
    int rc;
    if (ok && gh_expect(&cons[i], "RESULT", line, sizeof(line), STEP_MS) < 0) {
      fail("consumer %d of %d reported no result", i + 1, n);
      ok = 0;
    } else if (ok && strcmp(line, "RESULT 0") != 0) {
      fail("consumer %d of %d read wrong data (%s mismatching words of %u)", i + 1, n,
           line + 7, BUF_BYTES / 4);
      ok = 0;
    }
    rc = gh_wait(&cons[i], ok ? STEP_MS : 5000);
    if (ok && rc != 0) {
      fail("consumer %d of %d exited with %d", i + 1, n, rc);
      ok = 0;
    }
  }
  return ok ? 0 : -1;
}

static int check_handoff(const gh_daemon *d, gpupool_client *c) {
  static const int rounds[2] = {1, 4};
  char line[256];
  (void)c;
  for (int r = 0; r < 2; r++) {
    gh_proc prod;
    char name[64];
    uint32_t seed = fresh_seed() + (uint32_t)r;
    int rc;
    snprintf(name, sizeof(name), "handoff-%d-%08x", rounds[r], seed);
    if (spawn_producer(&prod, d, name, seed, SPIN_US, "hold", 1) < 0)
      return fail("cannot start the producer");
    if (gh_expect(&prod, "ALLOCATED", line, sizeof(line), STEP_MS) < 0) {
      gh_wait(&prod, 5000);
      return fail("producer could not allocate %u bytes", BUF_BYTES);
    }
    if (run_consumers(d, name, seed, rounds[r], &prod) < 0) {
      gh_wait(&prod, 5000);
      return 1;
    }
    if ((rc = producer_done(&prod)) != 0)
      return rc;
  }
  return pass("64 MiB published behind a %u ms kernel without synchronizing; 1 then 4 "
              "consumers read it bit-exact on their own streams", SPIN_US / 1000);
}

static int check_kill(const gh_daemon *d, gpupool_client *c) {
  gpupool_pool_stats ps;
  gh_proc prod, holder;
  char name[64], line[256];
  uint32_t seed = fresh_seed();
  uint64_t start_used, used = 0;
  int rc;

  if (gh_pool_stats(c, POOL, &ps, NULL) < 0)
    return fail("cannot read pool stats");
  start_used = ps.used;
  snprintf(name, sizeof(name), "kill-%08x", seed);
  if ((rc = start_published(&prod, d, name, seed, 50000)) != 0)
    return rc;
  if (spawn_consumer(&holder, d, name, seed, 1, 0, "-") < 0)
    return fail("cannot start the holding consumer");
  if (gh_expect(&holder, "RESULT", line, sizeof(line), STEP_MS) < 0 ||
      strcmp(line, "RESULT 0") != 0) {
    gh_wait(&holder, 1000);
    gh_wait(&prod, 5000);
    return fail("holding consumer read wrong data or none (%s)", line);
  }
  if (gh_expect(&holder, "HOLDING", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(&holder, 1000);
    gh_wait(&prod, 5000);
    return fail("holding consumer did not report its hold");
  }
  gh_signal(&holder, SIGKILL);
  if ((rc = gh_wait(&holder, 10000)) != 128 + SIGKILL) {
    gh_wait(&prod, 5000);
    return fail("the holding consumer did not die of SIGKILL (%d)", rc);
  }
  if (!gh_daemon_alive((gh_daemon *)d))
    return fail("gpupoold died after a client was SIGKILLed");
  if (run_consumers(d, name, seed, 2, NULL) < 0) {
    gh_wait(&prod, 5000);
    return 1;
  }
  if ((rc = producer_done(&prod)) != 0)
    return rc;
  if (gh_wait_used(c, POOL, start_used, 20000, &used) < 0)
    return fail("pool used is %" PRIu64 " bytes 20 s after the last release, was %" PRIu64
                " before (the killed client's hold was not dropped)", used, start_used);
  return pass("consumer SIGKILLed while holding; 2 others read correct data; pool used back "
              "to %" PRIu64 " bytes", start_used);
}

static int check_killwork(const gh_daemon *d, gpupool_client *c) {
  gh_proc prod, killer, taker;
  char name[64], line[256], bytes[32], sk[32], sw[32], spin[32], wait[32];
  uint32_t seed = fresh_seed();
  unsigned spin_us = 3000000u; /* the killed consumer's kernel would run this long */
  int rc, got = 0;
  (void)c;

  snprintf(name, sizeof(name), "killwork-%08x", seed);
  if ((rc = start_published(&prod, d, name, seed, 0)) != 0)
    return rc;
  snprintf(bytes, sizeof(bytes), "%u", BUF_BYTES);
  snprintf(sk, sizeof(sk), "%u", seed ^ 0x5a5a5a5au);
  snprintf(sw, sizeof(sw), "%u", seed ^ 0xa5a5a5a5u);
  snprintf(spin, sizeof(spin), "%u", spin_us);
  snprintf(wait, sizeof(wait), "%u", 2 * spin_us / 1000);
  {
    const char *argv[] = {"", "worker", "killer", d->sock, name, bytes, sk, spin, NULL};
    if (gh_spawn(&killer, argv, NULL, 0) < 0) {
      gh_wait(&prod, 5000);
      return fail("cannot start the consumer to kill");
    }
  }
  if (gh_expect(&killer, "QUEUED", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(&killer, 1000);
    gh_wait(&prod, 5000);
    return fail("the consumer to kill did not queue its work");
  }
  gh_signal(&killer, SIGKILL);
  if ((rc = gh_wait(&killer, 10000)) != 128 + SIGKILL) {
    gh_wait(&prod, 5000);
    return fail("the consumer did not die of SIGKILL (%d)", rc);
  }
  /* The producer unpublishes and lets go: only the dead consumer's lease keeps the range. */
  if ((rc = producer_done(&prod)) != 0)
    return rc;
  {
    const char *argv[] = {"", "worker", "taker", d->sock, bytes, sw, wait, NULL};
    if (gh_spawn(&taker, argv, NULL, 0) < 0)
      return fail("cannot start the taker");
  }
  if (gh_expect(&taker, "GOT", line, sizeof(line), STEP_MS) < 0 || sscanf(line, "GOT %d", &got) != 1) {
    gh_wait(&taker, 5000);
    return fail("the taker did not get the whole pool");
  }
  if (gh_expect(&taker, "RESULT", line, sizeof(line), STEP_MS) < 0 || strcmp(line, "RESULT 0") != 0) {
    gh_wait(&taker, 5000);
    return fail("the killed consumer's work wrote into memory handed to another client (%s)", line);
  }
  if ((rc = gh_wait(&taker, STEP_MS)) != 0)
    return fail("taker exited with %d", rc);
  return pass("consumer SIGKILLed while its kernel kept writing its buffer; %d buffers then taken, "
              "filled and intact after that kernel would have ended",
              got);
}

static int check_orphan(const gh_daemon *d, gpupool_client *c) {
  gpupool_pool_stats ps;
  gh_proc prod;
  char name[64], line[256];
  uint32_t seed = fresh_seed();
  uint64_t start_used, used = 0;
  int rc;

  if (gh_pool_stats(c, POOL, &ps, NULL) < 0)
    return fail("cannot read pool stats");
  start_used = ps.used;
  snprintf(name, sizeof(name), "orphan-%08x", seed);
  if (spawn_producer(&prod, d, name, seed, 50000, "exit", 0) < 0)
    return fail("cannot start the producer");
  if ((rc = gh_wait(&prod, STEP_MS)) != 0)
    return fail("producer exited with %d", rc);
  if (run_consumers(d, name, seed, 2, NULL) < 0)
    return 1;
  if ((rc = gpupool_name_unpublish(c, name)) < 0)
    return fail("gpupool_name_unpublish(%s): %s: %s", name, gpupool_err_name(rc),
                gpupool_last_error());
  if (gh_wait_used(c, POOL, start_used, 20000, &used) < 0)
    return fail("pool used is %" PRIu64 " bytes after unpublish, was %" PRIu64, used,
                start_used);
  (void)line;
  return pass("producer exited after publishing; 2 consumers started later read it "
              "bit-exact; used back to %" PRIu64 " after unpublish", start_used);
}

/* Trim until the backend's used counter reaches 0 (frees wait on events and on clients
 * unmapping, so the first trim may leave slabs behind). */
static int trim_settle(gpupool_client *c, int timeout_ms, gpupool_pool_stats *ps,
                       gpupool_daemon_stats *ds) {
  uint64_t end = gh_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  int rc;
  do {
    if ((rc = gpupool_client_trim(c)) < 0) {
      fprintf(stderr, "gpupool_client_trim: %s: %s\n", gpupool_err_name(rc), gpupool_last_error());
      return -1;
    }
    if (gh_pool_stats(c, POOL, ps, ds) < 0)
      return -1;
    if (ps->backend_used == 0 && ps->used == 0)
      return 0;
    gh_sleep_ms(100);
  } while (gh_now_ns() < end);
  return 1;
}

/* One churn run of n cycles between two fresh worker processes. 0, or -1 with a FAIL line;
 * *secs gets the wall time and line B's summary. */
static int run_churn(const gh_daemon *d, int cycles, double *secs, char *line, size_t len) {
  int ab[2], ba[2], rc_a, rc_b;
  gh_proc pa, pb;
  char n[16];
  uint64_t t0;

  snprintf(n, sizeof(n), "%d", cycles);
  if (pipe2(ab, O_CLOEXEC) < 0 || pipe2(ba, O_CLOEXEC) < 0)
    return fail("pipe2: %s", strerror(errno)), -1;
  {
    const char *av_a[] = {"", "worker", "churn-a", d->sock, n, NULL};
    const char *av_b[] = {"", "worker", "churn-b", d->sock, n, NULL};
    int fa[2] = {ab[1], ba[0]}, fb[2] = {ab[0], ba[1]};
    t0 = gh_now_ns();
    if (gh_spawn(&pa, av_a, fa, 2) < 0)
      return fail("cannot start the churn workers"), -1;
    if (gh_spawn(&pb, av_b, fb, 2) < 0) {
      gh_wait(&pa, 1000);
      return fail("cannot start the churn workers"), -1;
    }
  }
  close(ab[0]);
  close(ab[1]);
  close(ba[0]);
  close(ba[1]);
  rc_a = gh_expect(&pa, "DONE", line, len, 600000);
  rc_b = gh_expect(&pb, "DONE", line, len, 60000);
  *secs = (double)(gh_now_ns() - t0) / 1e9;
  rc_a = rc_a < 0 ? -1 : gh_wait(&pa, 30000);
  rc_b = rc_b < 0 ? -1 : gh_wait(&pb, 30000);
  if (rc_a != 0 || rc_b != 0) {
    gh_wait(&pa, 1000);
    gh_wait(&pb, 1000);
    return fail("churn workers failed (a: %d, b: %d)", rc_a, rc_b), -1;
  }
  return 0;
}

/* Wait until only the driver is connected, nothing awaits a free, and the daemon's fd count
 * has held still for half a second (it closes a client's socket and pidfd once it notices
 * the exit). */
static int wait_idle(gpupool_client *c, gpupool_pool_stats *ps, gpupool_daemon_stats *ds) {
  uint64_t end = gh_now_ns() + 20ull * 1000000000ull, last = UINT64_MAX;
  int still = 0;
  while (gh_now_ns() < end) {
    if (gh_pool_stats(c, POOL, ps, ds) < 0)
      return -1;
    if (ds->clients == 1 && ds->pending_frees == 0 && ds->open_fds == last) {
      if (++still >= 5)
        return 0;
    } else {
      still = 0;
    }
    last = ds->open_fds;
    gh_sleep_ms(100);
  }
  return 1;
}

static int check_churn(const gh_daemon *d, gpupool_client *c) {
  gpupool_pool_stats ps0, ps1;
  gpupool_daemon_stats ds0, ds1;
  char line[256];
  double secs;
  int settled;

  /* A short run first: pooled resources the daemon creates on demand (IPC events, each
   * possibly holding an fd) reach their working set; what must stay flat is what follows. */
  if (run_churn(d, 1000, &secs, line, sizeof(line)) < 0)
    return 1;
  if (trim_settle(c, 20000, &ps0, &ds0) != 0)
    return fail("backend_used did not return to 0 after the warm-up cycles and trim "
                "(%" PRIu64 " bytes, %" PRIu64 " slabs)", ps0.backend_used, ps0.slabs);
  if (wait_idle(c, &ps0, &ds0) != 0)
    return fail("the daemon did not settle after the warm-up cycles (%" PRIu64 " clients, "
                "%" PRIu64 " pending frees)", ds0.clients, ds0.pending_frees);
  if (run_churn(d, CHURN_CYCLES, &secs, line, sizeof(line)) < 0)
    return 1;
  settled = trim_settle(c, 30000, &ps1, &ds1);
  if (settled < 0)
    return fail("cannot trim or read stats after the cycles");
  if (settled > 0 || ps1.backend_used != ps0.backend_used || ps1.used != ps0.used)
    return fail("after trim backend_used %" PRIu64 " (baseline %" PRIu64 "), used %" PRIu64
                " (baseline %" PRIu64 "), %" PRIu64 " buffers, %" PRIu64 " slabs",
                ps1.backend_used, ps0.backend_used, ps1.used, ps0.used, ds1.buffers,
                ps1.slabs);
  if (wait_idle(c, &ps1, &ds1) < 0)
    return fail("cannot read stats");
  if (ds1.open_fds > ds0.open_fds)
    return fail("daemon open fds grew from %" PRIu64 " to %" PRIu64 " over %d cycles",
                ds0.open_fds, ds1.open_fds, CHURN_CYCLES);
  return pass("%d alloc/share/open/release cycles in %.1f s (%s); backend_used %" PRIu64
              " after trim, open fds %" PRIu64 " -> %" PRIu64, CHURN_CYCLES, secs, line,
              ps1.backend_used, ds0.open_fds, ds1.open_fds);
}

static int check_peer(const gh_daemon *d, gpupool_client *c) {
  gh_proc prod, cons;
  char name[64], line[512];
  uint32_t seed = fresh_seed();
  int can = 0, rc;
  cudaError_t e;

  (void)c;
  e = cudaDeviceCanAccessPeer(&can, 1, 0);
  if (e != cudaSuccess)
    return fail("cudaDeviceCanAccessPeer(1, 0): %s", cudaGetErrorString(e));
  snprintf(name, sizeof(name), "peer-%08x", seed);
  if ((rc = start_published(&prod, d, name, seed, 50000)) != 0)
    return rc;
  if (spawn_consumer(&cons, d, name, seed, 0, 1, can ? "ok" : "enotsup") < 0) {
    gh_wait(&prod, 5000);
    return fail("cannot start the consumer on GPU 1");
  }
  if (!can) {
    rc = gh_expect(&cons, "ENOTSUP", line, sizeof(line), STEP_MS);
    int st = gh_wait(&cons, STEP_MS);
    gh_writeline(&prod, "EXIT");
    gh_wait(&prod, STEP_MS);
    if (rc < 0 || st != 0)
      return fail("GPUs 1 and 0 are not peers, and gpupool_client_set_devices({1}) did not fail with "
                  "ENOTSUP naming both (consumer exit %d)", st);
    return pass("GPUs 1 and 0 are not peers: %s", line);
  }
  if (gh_expect(&cons, "RESULT", line, sizeof(line), STEP_MS) < 0 ||
      strcmp(line, "RESULT 0") != 0) {
    gh_wait(&cons, 5000);
    gh_wait(&prod, 5000);
    return fail("consumer on GPU 1 read wrong data or none (%s)", line);
  }
  if ((rc = gh_wait(&cons, STEP_MS)) != 0) {
    gh_wait(&prod, 5000);
    return fail("consumer on GPU 1 exited with %d", rc);
  }
  if ((rc = producer_done(&prod)) != 0)
    return rc;
  return pass("pool on GPU 0 read bit-exact by a kernel on GPU 1 after "
              "gpupool_client_set_devices({1})");
}

/* Backend pools behind the test pool, from a raw Stats request (not in the public stats). */
static int pool_instances(const gh_daemon *d) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  gpupool__rep *rep;
  int fd = raw_connect(d->sock), n = -1;
  if (fd < 0)
    return -1;
  raw_hello("driver", fd);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  rep = raw_call("driver", fd, &req, NULL);
  if (rep && rep->body_case == GPUPOOL__WIRE__REPLY__BODY_STATS)
    for (size_t i = 0; i < rep->stats->n_pools; i++)
      if (!strcmp(rep->stats->pools[i]->name, POOL))
        n = (int)rep->stats->pools[i]->instances;
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  close(fd);
  return n;
}

static int wait_instances(const gh_daemon *d, int want, int timeout_ms, int *got) {
  uint64_t end = gh_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  do {
    if ((*got = pool_instances(d)) == want)
      return 0;
    gh_sleep_ms(50);
  } while (gh_now_ns() < end);
  return -1;
}

static int check_tenants(const gh_daemon *d, gpupool_client *c) {
  gh_proc prod, exporter, intruder;
  char name[64], line[512], exp_line[512], bytes[32], sd[32];
  uint32_t seed = fresh_seed();
  int rc, n;
  (void)c;

  if (geteuid() != 0) {
    printf("SKIP: tenants needs root (it runs a worker as uid %d)\n", NOBODY);
    return GH_SKIP;
  }
  /* uid 65534 must reach the socket: the daemon made it 0666 (socket_mode), the private
   * directory must be traversable. */
  if (chmod(d->dir, 0711) != 0)
    return fail("chmod %s: %s", d->dir, strerror(errno));
  snprintf(name, sizeof(name), "tenants-%08x", seed);
  if (spawn_producer(&prod, d, name, seed, 0, "hold", 0) < 0)
    return fail("cannot start the producer");
  if (gh_expect(&prod, "PUBLISHED", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(&prod, 5000);
    return fail("producer did not publish %s", name);
  }
  /* The same tenant still reads it in place. */
  if (run_consumers(d, name, seed, 1, NULL) < 0) {
    gh_wait(&prod, 5000);
    return 1;
  }
  snprintf(bytes, sizeof(bytes), "%u", BUF_BYTES);
  snprintf(sd, sizeof(sd), "%u", seed);
  {
    const char *argv[] = {"", "worker", "exporter", d->sock, name, bytes, sd, NULL};
    if (gh_spawn(&exporter, argv, NULL, 0) < 0) {
      gh_wait(&prod, 5000);
      return fail("cannot start the exporter");
    }
  }
  if (gh_expect(&exporter, "EXPORT ", exp_line, sizeof(exp_line), STEP_MS) < 0 ||
      gh_expect(&exporter, "CONTROL ", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(&exporter, 5000);
    gh_wait(&prod, 5000);
    return fail("the root exporter got no export data, or could not import it into its own "
                "tenant's pool (see its stderr)");
  }
  rc = gh_wait(&exporter, STEP_MS);
  if (strcmp(line, "CONTROL 0") != 0 || rc != 0) {
    gh_wait(&prod, 5000);
    return fail("root's own import of the slab read wrong data (%s) or the exporter exited %d",
                line, rc);
  }
  {
    const char *argv[] = {"", "worker", "intruder", d->sock, NULL};
    if (gh_spawn(&intruder, argv, NULL, 0) < 0) {
      gh_wait(&prod, 5000);
      return fail("cannot start the intruder");
    }
  }
  gh_writeline(&intruder, exp_line);
  if (gh_expect(&intruder, "TRYING", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(&intruder, 5000);
    gh_wait(&prod, 5000);
    return fail("the uid %d worker could not connect, attach the pool or import its fd (see "
                "its stderr)", NOBODY);
  }
  if (gh_readline(&intruder, line, sizeof(line), STEP_MS) < 0) {
    /* Killed inside cudaMemPoolImportPointer: it got no access either, but say so. */
    rc = gh_wait(&intruder, 5000);
    gh_wait(&prod, 5000);
    if (rc > 128)
      return pass("uid %d's import of root's slab export data into its own pool killed it "
                  "(signal %d) rather than failing with an error: no access", NOBODY, rc - 128);
    return fail("the uid %d worker reported nothing after trying the import (exit %d)", NOBODY, rc);
  }
  if (strncmp(line, "REFUSED ", 8) != 0) {
    gh_writeline(&intruder, "EXIT");
    gh_wait(&intruder, 5000);
    gh_wait(&prod, 5000);
    return fail("uid %d imported root's slab into the pool the daemon gave it: %s", NOBODY, line);
  }
  /* Both tenants attached: two backend pools; uid 65534's goes with its connection. */
  if (wait_instances(d, 2, 10000, &n) < 0) {
    gh_writeline(&intruder, "EXIT");
    gh_wait(&intruder, 5000);
    gh_wait(&prod, 5000);
    return fail("with root and uid %d attached the pool has %d backend pools, expected 2",
                NOBODY, n);
  }
  gh_writeline(&intruder, "EXIT");
  if ((rc = gh_wait(&intruder, STEP_MS)) != 0) {
    gh_wait(&prod, 5000);
    return fail("the uid %d worker exited with %d", NOBODY, rc);
  }
  if (wait_instances(d, 1, 10000, &n) < 0) {
    gh_wait(&prod, 5000);
    return fail("after uid %d left the pool still has %d backend pools, expected 1", NOBODY, n);
  }
  if ((rc = producer_done(&prod)) != 0)
    return rc;
  {
    /* Root's buffer (filled with a pattern) is gone; uid 65534 now gets fresh memory, which
     * must read as zeros whatever it was before (new CUDA slabs are cleared). */
    gh_proc fresh;
    const char *argv[] = {"", "worker", "fresh", d->sock, bytes, NULL};
    char zl[128];
    unsigned long long nz = ~0ull;
    if (gh_spawn(&fresh, argv, NULL, 0) < 0)
      return fail("cannot start the fresh-memory worker");
    if (gh_expect(&fresh, "NONZERO ", zl, sizeof(zl), STEP_MS) < 0 || sscanf(zl, "NONZERO %llu", &nz) != 1) {
      gh_wait(&fresh, 5000);
      return fail("the fresh-memory worker reported nothing (see its stderr)");
    }
    if ((rc = gh_wait(&fresh, STEP_MS)) != 0)
      return fail("the fresh-memory worker exited with %d", rc);
    if (nz != 0)
      return fail("uid %d's new %s-byte buffer holds %llu non-zero bytes: memory passed between "
                  "tenants uncleared", NOBODY, bytes, nz);
  }
  return pass("root's slab export data imports into root's pool and reads bit-exact; uid %d's "
              "import of it into the pool AttachPool gave it fails (%s); 2 backend pools while "
              "both were attached, 1 after; uid %d's new buffer then read all zeros",
              NOBODY, line + 8, NOBODY);
}

/* A 146-member bundle, six versions: each got whole by a consumer waiting with newer_than,
 * checked on its stream; version 1 held to the end; then everything back in the pool. */
static int check_bundles(const gh_daemon *d, gpupool_client *c) {
  gh_proc prod, cons;
  char name[64], sd[32], line[256];
  uint32_t seed = fresh_seed();
  gpupool_pool_stats ps;
  uint64_t start, got = 0;
  int rc;

  if (gh_pool_stats(c, POOL, &ps, NULL) < 0)
    return fail("stats");
  start = ps.used;
  snprintf(name, sizeof(name), "bundle-%08x", seed);
  snprintf(sd, sizeof(sd), "%u", seed);
  {
    const char *av[] = {"", "worker", "bconsumer", d->sock, name, sd, NULL};
    if (gh_spawn(&cons, av, NULL, 0) < 0 || gh_expect(&cons, "WAITING", line, sizeof(line), STEP_MS) < 0)
      return fail("cannot start the consumer");
  }
  {
    const char *av[] = {"", "worker", "bproducer", d->sock, name, sd, NULL};
    if (gh_spawn(&prod, av, NULL, 0) < 0)
      return fail("cannot start the producer");
  }
  for (int v = 1; v <= BUNDLE_VERSIONS; v++) {
    char want[32];
    if (gh_expect(&prod, "PUBLISHED", line, sizeof(line), STEP_MS) < 0) {
      gh_wait(&cons, 5000);
      return fail("producer did not publish version %d", v);
    }
    snprintf(want, sizeof want, "CHECKED %d", v);
    if (gh_expect(&cons, want, line, sizeof(line), STEP_MS) < 0) {
      gh_wait(&prod, 5000);
      return fail("consumer did not check version %d (its log above)", v);
    }
    gh_writeline(&prod, "NEXT");
  }
  if (gh_expect(&cons, "RESULT", line, sizeof(line), STEP_MS) < 0 || strcmp(line, "RESULT 0") != 0)
    return fail("consumer: %s", line);
  if ((rc = gh_wait(&cons, STEP_MS)) != 0)
    return fail("consumer exited with %d", rc);
  if ((rc = producer_done(&prod)) != 0)
    return rc;
  if (gh_wait_used(c, POOL, start, 10000, &got) < 0)
    return fail("pool uses %" PRIu64 " bytes after everything was released, %" PRIu64 " before", got, start);
  return pass("%d versions of a %d-member bundle, each published behind a %u ms kernel without "
              "synchronizing and got whole with newer_than, bit-exact; version 1 held and intact "
              "to the end; the pool back to %" PRIu64 " bytes", BUNDLE_VERSIONS, BUNDLE_MEMBERS,
              SPIN_US / 5000, start);
}

/* One handoff behind a long kernel, published without synchronizing, read by two consumers;
 * the environment (set only around the spawns) decides who the workers are. */
static int fenced_handoff(const gh_daemon *d, const char *what, int prod_nobody, int prod_fences, int cons_nobody,
                          int cons_force) {
  gh_proc prod;
  char name[64], line[256], pf[4], cf[4];
  uint32_t seed = fresh_seed();
  int rc;
  snprintf(name, sizeof name, "fences-%08x", seed);
  snprintf(pf, sizeof pf, "%d", prod_fences);
  snprintf(cf, sizeof cf, "%d", cons_nobody || cons_force);
  if (prod_nobody)
    setenv("GPU_TEST_AS_NOBODY", "1", 1);
  setenv("GPU_TEST_WANT_FENCES", pf, 1);
  rc = spawn_producer(&prod, d, name, seed, SPIN_US, "hold", 1);
  unsetenv("GPU_TEST_AS_NOBODY");
  if (rc < 0)
    return fail("%s: cannot start the producer", what);
  if (gh_expect(&prod, "ALLOCATED", line, sizeof(line), STEP_MS) < 0) {
    gh_wait(&prod, 5000);
    return fail("%s: the producer could not allocate (its stderr above)", what);
  }
  if (cons_nobody)
    setenv("GPU_TEST_AS_NOBODY", "1", 1);
  if (cons_force)
    setenv("GPUPOOL_HOST_FENCES", "1", 1);
  setenv("GPU_TEST_WANT_FENCES", cf, 1);
  rc = run_consumers(d, name, seed, 2, &prod);
  unsetenv("GPU_TEST_AS_NOBODY");
  unsetenv("GPUPOOL_HOST_FENCES");
  unsetenv("GPU_TEST_WANT_FENCES");
  gh_writeline(&prod, "EXIT");
  if (gh_wait(&prod, STEP_MS) != 0)
    return fail("%s: the producer failed (its stderr above)", what);
  return rc < 0 ? fail("%s: see above", what) : 0;
}

static int check_fences(const gh_daemon *d, gpupool_client *c) {
  uint64_t start, got = 0;
  gpupool_pool_stats ps;
  if (gh_pool_stats(c, POOL, &ps, NULL) < 0)
    return 1;
  start = ps.used;
  /* The daemon holds a get back until the producer's ready event has completed, for a
   * consumer that said it cannot wait on it (forced here in root's consumers). */
  if (fenced_handoff(d, "root producer with events -> consumers with GPUPOOL_HOST_FENCES=1", 0, 0, 0, 1))
    return 1;
  if (geteuid() != 0)
    return pass("consumers with GPUPOOL_HOST_FENCES=1 read bit-exact what a producer with events published behind "
                "a %u ms kernel; the uid %d part skipped (needs root)", SPIN_US / 1000, NOBODY);
  /* Another uid than the daemon's cannot open its events: the library sees that by itself;
   * the producer synchronizes before Publish, the consumers before Release. uid 65534 must
   * reach the socket (socket_mode 0666) through the private directory. */
  if (chmod(d->dir, 0711) != 0)
    return fail("chmod %s: %s", d->dir, strerror(errno));
  if (fenced_handoff(d, "uid 65534 producer -> uid 65534 consumers", 1, 1, 1, 0))
    return 1;
  if (gh_wait_used(c, POOL, start, 10000, &got) < 0)
    return fail("pool uses %" PRIu64 " bytes after everything was released, %" PRIu64 " before", got, start);
  return pass("a get held back by the daemon until a root producer's %u ms kernel was done (consumers with "
              "GPUPOOL_HOST_FENCES=1), and uid %d producer and consumers, which cannot open gpupoold's events, "
              "switched to host fences by themselves: bit-exact reads, publish and release returned with "
              "their streams idle; the pool back to %" PRIu64 " bytes",
              SPIN_US / 1000, NOBODY, start);
}

static const struct {
  const char *name;
  int gpus;
  int (*fn)(const gh_daemon *, gpupool_client *);
} checks[] = {
    {"handoff", 1, check_handoff}, {"kill", 1, check_kill},   {"killwork", 1, check_killwork},
    {"orphan", 1, check_orphan},
    {"churn", 1, check_churn},     {"peer", 2, check_peer},
    {"tenants", 1, check_tenants}, {"bundles", 1, check_bundles},
    {"fences", 1, check_fences},
};

static int run_check(const char *gpupoold, int idx, int ndev) {
  gh_daemon d;

  g_check = checks[idx].name;
  if (ndev < checks[idx].gpus) {
    printf("SKIP: %s needs %d CUDA devices, this machine has %d\n", g_check, checks[idx].gpus,
           ndev);
    return GH_SKIP;
  }
  /* tenants: a worker of uid 65534 connects too. */
  if (gh_daemon_start_conf(&d, gpupoold, POOL_SPEC,
                           checks[idx].fn == check_tenants || checks[idx].fn == check_fences
                               ? "[daemon]\nsocket_mode = 0666\n"
                               : NULL) < 0)
    return fail("gpupoold did not start");
  return gh_run_on_daemon(&d, g_check, "gpu-test-driver", checks[idx].fn);
}

int main(int argc, char **argv) {
  int ndev, worst = GH_SKIP, found = 0;

  if (argc >= 3 && !strcmp(argv[1], "worker"))
    return worker_main(argc, argv);
  ndev = gh_driver_start(argc, argv, 3,
                         "GPUPOOLD handoff|kill|killwork|orphan|churn|peer|tenants|bundles|fences|all", 1,
                         "the GPU tests");
  for (size_t i = 0; i < sizeof(checks) / sizeof(checks[0]); i++) {
    int rc;
    if (strcmp(argv[2], "all") != 0 && strcmp(argv[2], checks[i].name) != 0)
      continue;
    found = 1;
    rc = run_check(argv[1], (int)i, ndev);
    /* all: any failure fails; skips only count when nothing else ran. */
    if (rc == 1 || (rc == 0 && worst == GH_SKIP))
      worst = rc;
  }
  if (!found) {
    fprintf(stderr, "unknown check %s\n", argv[2]);
    return 2;
  }
  return worst;
}
