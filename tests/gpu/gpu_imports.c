/*
 * GPU checks of what one process imports over its life, against a real gpupoold with the CUDA
 * backend (a host-NUMA pool "pinned" and a device pool "gpu0" on GPU 0).
 *
 *   gpupool_gpu_imports GPUPOOLD reuse|message|ready
 *
 * reuse     Several connections in one process, as a program that makes one PinnedLoader (one
 *           client) after another does, in each pool: a second connection gets a buffer in a
 *           slab the first one maps (the driver refuses a second import of pinned memory with
 *           cudaErrorAlreadyMapped, and hands device memory out once for both imports) and
 *           opens the first one's buffer; a connection goes while another one still uses the
 *           pool (its access must stay); then rounds of a new connection each, whose buffers
 *           are shared and opened, one kept past the round, the slabs returned to the
 *           backend between rounds (trim) so that later slabs take addresses of earlier ones.
 *           Every buffer is filled by a kernel and checked word by word through every mapping.
 * message   Messages of 1,000 buffers (three in flight at once) and one of 10,000, made and
 *           opened as gpupool.torch sends them: allocated in one round trip, shared kept in
 *           runs of max_share_batch, opened in such runs by a second connection. CUDA gives
 *           a process 4096 inter-process events; one event per hold and per buffer ran out.
 * ready     Messages whose buffers are filled behind a spin kernel and shared kept while that
 *           work still runs, opened by a second connection on a stream of its own: the buffers
 *           of one share are one ready group, so opening them together makes the receiver's
 *           stream wait once (gpupool_client_ready_waits), opening them in two calls twice,
 *           two shares' buffers in one call twice, and an idle sender's none; 40 buffers
 *           shared one by one (more than the 32 events a sharer has) make it wait once per
 *           distinct event, not once per buffer; every buffer
 *           is read by a kernel in the receiver's stream right after the open, bit-exact (a
 *           wait skipped wrongly reads the buffers before the fill).
 *
 * Prints "PASS: ..." or "FAIL: ..." lines. Exit status 0 pass, 1 fail, 77 skip (no GPU, or
 * GPU 0 without host-NUMA pools for reuse).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_driver.h"
#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpupool/gpupool.h"

#define POOL_SPEC "name=pinned,kind=host-numa,device=0,numa=0,capacity=512M,slab=32M"
#define DEVICE_POOL_CONF                                                                    \
  "[pool gpu0]\n"                                                                           \
  "kind = device\n"                                                                         \
  "device = 0\n"                                                                            \
  "capacity = 2G\n"                                                                         \
  "slab_size = 32M\n"
#define BUF (4u << 20)
#define ROUNDS 5
#define PER_ROUND 6
#define MSG_BYTES (64u << 10)
#define BATCH 1024 /* gpupoold's max_share_batch by default */

static char why[1024];

#define FAILF(...) (snprintf(why, sizeof why, __VA_ARGS__), 1)

static int gp_fail(const char *what, int rc) {
  return FAILF("%s: %s: %s", what, gpupool_err_name(rc), gpupool_last_error());
}

static int cu_fail(const char *what, cudaError_t e) {
  (void)cudaGetLastError();
  return FAILF("%s: %s: %s", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Fill b with seed's pattern in s (a kernel: the GPU writes through this mapping). */
static int fill(gpupool_buffer *b, size_t bytes, uint32_t seed, cudaStream_t s) {
  int ce = gk_fill(gpupool_buffer_ptr(b), bytes, seed, s);
  return ce ? cu_fail("fill kernel", (cudaError_t)ce) : 0;
}

/* Every word of b must be seed's pattern, read by a kernel in s. */
static int verify(const char *what, gpupool_buffer *b, size_t bytes, uint32_t seed, cudaStream_t s) {
  unsigned long long bad = 0;
  int ce = gk_count_mismatches(gpupool_buffer_ptr(b), bytes, seed, s, &bad);
  if (ce)
    return cu_fail(what, (cudaError_t)ce);
  if (bad)
    return FAILF("%s: %llu of %zu words differ from the pattern written (a stale or wrong mapping)", what, bad,
                 bytes / 4);
  return 0;
}

static int connect_as(const gh_daemon *d, const char *name, gpupool_client **c) {
  int rc = gpupool_client_connect(d->sock, name, GPUPOOL_TIMEOUT_DEFAULT, c);
  return rc < 0 ? gp_fail("gpupool_client_connect", rc) : 0;
}

/* Share b kept and open the token on c: the opener's hold in *out. */
static int pass_on(gpupool_buffer *b, gpupool_client *c, cudaStream_t s, gpupool_buffer **out) {
  gpupool_token t;
  int rc;
  if ((rc = gpupool_buffer_share_kept(b, s, &t)) < 0)
    return gp_fail("gpupool_buffer_share_kept", rc);
  if ((rc = gpupool_buffer_open(c, &t, 0, s, out)) < 0)
    return gp_fail("gpupool_buffer_open of a buffer in a slab another connection of this process maps", rc);
  return 0;
}

static int reuse_pool(const gh_daemon *d, const char *pool, gpupool_client *c1, cudaStream_t s) {
  gpupool_client *c2 = NULL, *cr[ROUNDS] = {0};
  gpupool_buffer *a1 = NULL, *a2 = NULL, *o = NULL, *kept[ROUNDS] = {0};
  int rc;

  if ((rc = gpupool_buffer_alloc(c1, pool, BUF, 0, s, &a1)) < 0)
    return gp_fail("gpupool_buffer_alloc on the first connection", rc);
  if ((rc = fill(a1, BUF, 1, s)) || (rc = connect_as(d, "gpu-imports-2", &c2)))
    goto out;
  /* Same process, same tenant: the same slab as a1, imported a second time by c2. */
  if ((rc = gpupool_buffer_alloc(c2, pool, BUF, 0, s, &a2)) < 0) {
    rc = gp_fail("gpupool_buffer_alloc on a second connection of the process", rc);
    goto out;
  }
  if ((rc = fill(a2, BUF, 2, s)) || (rc = pass_on(a1, c2, s, &o)) ||
      (rc = verify("a buffer of connection 1 opened by connection 2", o, BUF, 1, s)) ||
      (rc = verify("connection 2's own buffer", a2, BUF, 2, s)))
    goto out;
  gpupool_buffer_release(o, s);
  gpupool_buffer_release(a2, s);
  o = a2 = NULL;
  /* Connection 2 goes; connection 1 still uses the pool and its slab. */
  gpupool_client_disconnect(c2);
  c2 = NULL;
  if ((rc = fill(a1, BUF, 3, s)) || (rc = verify("connection 1's buffer after connection 2 went", a1, BUF, 3, s)))
    goto out;
  for (int r = 0; r < ROUNDS; r++) {
    gpupool_buffer *bs[PER_ROUND] = {0};
    char name[32];
    snprintf(name, sizeof name, "gpu-imports-round-%d", r);
    if ((rc = connect_as(d, name, &cr[r])))
      goto out;
    for (int i = 0; i < PER_ROUND && rc == 0; i++) {
      uint32_t seed = 100u * (uint32_t)r + (uint32_t)i;
      if ((rc = gpupool_buffer_alloc(cr[r], pool, BUF, 0, s, &bs[i])) < 0) {
        rc = gp_fail("gpupool_buffer_alloc in a later round", rc);
        break;
      }
      if ((rc = fill(bs[i], BUF, seed, s)) || (rc = pass_on(bs[i], c1, s, &o)))
        break;
      rc = verify("a later round's buffer opened by connection 1", o, BUF, seed, s);
      gpupool_buffer_release(o, s);
      o = NULL;
    }
    /* The round's first buffer outlives it (the batch a loop variable keeps); the others go. */
    kept[r] = bs[0];
    for (int i = 1; i < PER_ROUND; i++)
      if (bs[i])
        gpupool_buffer_release(bs[i], s);
    if (rc)
      goto out;
    if (r > 0) {
      if ((rc = verify("the previous round's kept buffer", kept[r - 1], BUF, 100u * (uint32_t)(r - 1), s)))
        goto out;
      gpupool_buffer_release(kept[r - 1], s);
      kept[r - 1] = NULL;
      gpupool_client_disconnect(cr[r - 1]);
      cr[r - 1] = NULL;
    }
    if (cudaStreamSynchronize(s) != cudaSuccess) {
      rc = cu_fail("cudaStreamSynchronize", cudaGetLastError());
      goto out;
    }
    /* Empty slabs go back to the backend, so the next round's slabs reuse their addresses. */
    if ((rc = gpupool_client_trim(c1)) < 0) {
      rc = gp_fail("gpupool_client_trim", rc);
      goto out;
    }
  }
  rc = verify("connection 1's buffer after every round", a1, BUF, 3, s);
out:
  if (o)
    gpupool_buffer_release(o, s);
  if (a2)
    gpupool_buffer_release(a2, s);
  if (a1)
    gpupool_buffer_release(a1, s);
  for (int r = 0; r < ROUNDS; r++) {
    if (kept[r])
      gpupool_buffer_release(kept[r], s);
    gpupool_client_disconnect(cr[r]);
  }
  gpupool_client_disconnect(c2);
  (void)cudaStreamSynchronize(s);
  return rc;
}

static int check_reuse(const gh_daemon *d, gpupool_client *c1) {
  cudaStream_t s;
  int rc;
  if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    return gh_verdict(1, "reuse", "cannot create a stream on GPU 0: %s", cudaGetErrorString(cudaGetLastError()));
  if ((rc = reuse_pool(d, "pinned", c1, s)) != 0)
    return gh_verdict(1, "reuse", "host-NUMA pool: %s", why);
  gh_verdict(0, "reuse-pinned", "%d connections in one process opened buffers of each other's slabs, slabs "
             "returned and reused between rounds", ROUNDS + 2);
  if ((rc = reuse_pool(d, "gpu0", c1, s)) != 0)
    return gh_verdict(1, "reuse", "device pool: %s", why);
  return gh_verdict(0, "reuse", "the same in the device pool");
}

/* One message of n buffers from c1 to c2, opened and checked; the receiver's holds in *rx and
 * the sender's in *tx (n each, released by the caller). */
static int message(gpupool_client *c1, gpupool_client *c2, int n, uint32_t seed, cudaStream_t s,
                   gpupool_buffer **tx, gpupool_buffer **rx) {
  size_t *sizes = malloc((size_t)n * sizeof *sizes);
  gpupool_token *toks = malloc((size_t)n * sizeof *toks);
  int rc = 0;
  if (!sizes || !toks) {
    rc = FAILF("out of memory");
    goto out;
  }
  for (int i = 0; i < n; i++)
    sizes[i] = MSG_BYTES;
  if ((rc = gpupool_buffer_alloc_many(c1, "gpu0", sizes, n, s, tx)) < 0) {
    rc = gp_fail("gpupool_buffer_alloc_many", rc);
    goto out;
  }
  for (int i = 0; i < n && rc == 0; i++)
    rc = fill(tx[i], MSG_BYTES, seed + (uint32_t)i, s);
  for (int i = 0; i < n && rc == 0; i += BATCH) {
    int k = n - i < BATCH ? n - i : BATCH;
    if ((rc = gpupool_buffer_share_kept_many(tx + i, k, s, toks + i, NULL, 0, NULL)) < 0)
      rc = gp_fail("gpupool_buffer_share_kept_many", rc);
  }
  for (int i = 0; i < n && rc == 0; i += BATCH) {
    int k = n - i < BATCH ? n - i : BATCH;
    if ((rc = gpupool_buffer_open_many(c2, toks + i, k, 0, s, rx + i)) < 0)
      rc = gp_fail("gpupool_buffer_open_many", rc);
  }
  for (int i = 0; i < n && rc == 0; i++)
    rc = verify("a message's buffer as its receiver opened it", rx[i], MSG_BYTES, seed + (uint32_t)i, s);
out:
  free(sizes);
  free(toks);
  return rc;
}

static void release_all(gpupool_buffer **bs, int n, cudaStream_t s) {
  for (int i = 0; i < n; i++)
    if (bs[i]) {
      gpupool_buffer_release(bs[i], s);
      bs[i] = NULL;
    }
}

enum { READY_N = 8, READY_SPIN_US = 200000 };

/* One round of check_ready: READY_N buffers of c1 filled in s1 (behind a spin unless idle is
 * set, then s1 is synchronized first), shared kept in `shares` requests (their tokens split
 * evenly), opened by c2 in s2 in `opens` calls, each read in s2 right after; *waits: how many
 * ready waits c2 made. */
static int ready_round(gpupool_client *c1, gpupool_client *c2, cudaStream_t s1, cudaStream_t s2, int shares,
                       int opens, int idle, uint32_t seed, uint64_t *waits) {
  static const size_t sizes[READY_N] = {MSG_BYTES, MSG_BYTES, 4u << 20, MSG_BYTES, MSG_BYTES, 4u << 20, MSG_BYTES,
                                        MSG_BYTES};
  gpupool_buffer *tx[READY_N] = {0}, *rx[READY_N] = {0};
  gpupool_token toks[READY_N];
  int rc, ce;
  uint64_t w0 = gpupool_client_ready_waits(c2);

  if ((rc = gpupool_buffer_alloc_many(c1, "gpu0", sizes, READY_N, s1, tx)) < 0)
    return gp_fail("gpupool_buffer_alloc_many", rc);
  rc = 0;
  if (!idle && (ce = gk_spin(s1, READY_SPIN_US)))
    rc = cu_fail("spin kernel", (cudaError_t)ce);
  for (int i = 0; i < READY_N && rc == 0; i++)
    rc = fill(tx[i], sizes[i], seed + (uint32_t)i, s1);
  if (rc == 0 && idle && cudaStreamSynchronize(s1) != cudaSuccess)
    rc = cu_fail("cudaStreamSynchronize", cudaGetLastError());
  for (int k = 0; k < shares && rc == 0; k++) {
    int at = k * READY_N / shares, n = (k + 1) * READY_N / shares - at;
    if ((rc = gpupool_buffer_share_kept_many(tx + at, n, s1, toks + at, NULL, 0, NULL)) < 0)
      rc = gp_fail("gpupool_buffer_share_kept_many", rc);
  }
  for (int k = 0; k < opens && rc == 0; k++) {
    int at = k * READY_N / opens, n = (k + 1) * READY_N / opens - at;
    if ((rc = gpupool_buffer_open_many(c2, toks + at, n, 0, s2, rx + at)) < 0)
      rc = gp_fail("gpupool_buffer_open_many", rc);
  }
  /* Read at once in s2: the spin is still running unless s2 waits for it. */
  for (int i = 0; i < READY_N && rc == 0; i++)
    rc = verify("a buffer shared while its fill still ran, read in the opener's stream", rx[i], sizes[i],
                seed + (uint32_t)i, s2);
  *waits = gpupool_client_ready_waits(c2) - w0;
  release_all(rx, READY_N, s2);
  release_all(tx, READY_N, s1);
  (void)cudaStreamSynchronize(s1);
  (void)cudaStreamSynchronize(s2);
  return rc;
}

/* More buffers than a sharer has events (gpupoold gives each connection 32 and its buffers
 * take them in turn), each filled behind the spin and shared alone (its event recorded in the
 * busy stream), all opened in one call: the receiver's stream waits once per distinct event,
 * not once per buffer, and still reads every buffer after its fill. */
enum { REPEAT_N = 40, SHARER_EVENTS = 32 };
static int ready_repeats(gpupool_client *c1, gpupool_client *c2, cudaStream_t s1, cudaStream_t s2, uint64_t *waits) {
  size_t sizes[REPEAT_N];
  gpupool_buffer *tx[REPEAT_N] = {0}, *rx[REPEAT_N] = {0};
  gpupool_token toks[REPEAT_N];
  int rc, ce;
  uint64_t w0 = gpupool_client_ready_waits(c2);
  for (int i = 0; i < REPEAT_N; i++)
    sizes[i] = MSG_BYTES;
  if ((rc = gpupool_buffer_alloc_many(c1, "gpu0", sizes, REPEAT_N, s1, tx)) < 0)
    return gp_fail("gpupool_buffer_alloc_many", rc);
  rc = 0;
  if ((ce = gk_spin(s1, READY_SPIN_US)))
    rc = cu_fail("spin kernel", (cudaError_t)ce);
  for (int i = 0; i < REPEAT_N && rc == 0; i++)
    rc = fill(tx[i], sizes[i], 900u + (uint32_t)i, s1);
  for (int i = 0; i < REPEAT_N && rc == 0; i++)
    if ((rc = gpupool_buffer_share_kept_many(tx + i, 1, s1, toks + i, NULL, 0, NULL)) < 0)
      rc = gp_fail("gpupool_buffer_share_kept_many", rc);
  if (rc == 0 && (rc = gpupool_buffer_open_many(c2, toks, REPEAT_N, 0, s2, rx)) < 0)
    rc = gp_fail("gpupool_buffer_open_many", rc);
  for (int i = 0; i < REPEAT_N && rc == 0; i++)
    rc = verify("a buffer whose ready event another buffer of the message shares, read in the opener's stream",
                rx[i], sizes[i], 900u + (uint32_t)i, s2);
  *waits = gpupool_client_ready_waits(c2) - w0;
  release_all(rx, REPEAT_N, s2);
  release_all(tx, REPEAT_N, s1);
  (void)cudaStreamSynchronize(s1);
  (void)cudaStreamSynchronize(s2);
  return rc;
}

static int check_ready(const gh_daemon *d, gpupool_client *c1) {
  static const struct {
    const char *what;
    int shares, opens, idle;
    uint64_t waits;
  } rounds[] = {
      {"one share opened in one call", 1, 1, 0, 1},
      {"one share opened in two calls", 1, 2, 0, 2},
      {"two shares opened in one call", 2, 1, 0, 2},
      {"one share of an idle sender", 1, 1, 1, 0},
  };
  gpupool_client *c2 = NULL;
  cudaStream_t s1, s2;
  int rc = 0;

  if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) != cudaSuccess)
    return gh_verdict(1, "ready", "cannot create two streams on GPU 0");
  if ((rc = connect_as(d, "gpu-imports-receiver", &c2)))
    return gh_verdict(1, "ready", "%s", why);
  for (size_t r = 0; r < sizeof rounds / sizeof rounds[0] && rc == 0; r++) {
    uint64_t waits = 0;
    if ((rc = ready_round(c1, c2, s1, s2, rounds[r].shares, rounds[r].opens, rounds[r].idle, 50u * (uint32_t)r,
                          &waits)))
      rc = gh_verdict(1, "ready", "%s: %s", rounds[r].what, why);
    else if (waits != rounds[r].waits)
      rc = gh_verdict(1, "ready", "%s: the receiver's stream waited %" PRIu64 " times on ready events, not %" PRIu64,
                      rounds[r].what, waits, rounds[r].waits);
  }
  if (rc == 0) {
    uint64_t waits = 0;
    if ((rc = ready_repeats(c1, c2, s1, s2, &waits)))
      rc = gh_verdict(1, "ready", "%d buffers shared one by one: %s", REPEAT_N, why);
    else if (waits == 0 || waits > SHARER_EVENTS)
      rc = gh_verdict(1, "ready", "%d buffers shared one by one behind the spin, opened in one call: the receiver's "
                      "stream waited %" PRIu64 " times, not once per distinct ready event (at most %d)", REPEAT_N,
                      waits, SHARER_EVENTS);
  }
  gpupool_client_disconnect(c2);
  if (rc)
    return rc;
  return gh_verdict(0, "ready", "%d buffers filled behind a %d ms spin and shared at once: read bit-exact in the "
                    "opener's stream, one wait per share and open call, none from an idle sender; %d shared "
                    "one by one: one wait per distinct ready event", READY_N, READY_SPIN_US / 1000, REPEAT_N);
}

static int check_message(const gh_daemon *d, gpupool_client *c1) {
  enum { SMALL = 1000, INFLIGHT = 3, BIG = 10000 };
  gpupool_client *c2 = NULL;
  gpupool_buffer **tx = calloc(BIG, sizeof *tx), **rx = calloc(BIG, sizeof *rx);
  cudaStream_t s;
  int rc = 0, m;

  if (!tx || !rx)
    return gh_verdict(1, "message", "out of memory");
  if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    return gh_verdict(1, "message", "cannot create a stream on GPU 0");
  if ((rc = connect_as(d, "gpu-imports-receiver", &c2)))
    goto out;
  /* Three messages of 1,000 alive at once (a sender keeps its copies for the next message, a
   * receiver its tensors), then all released. */
  for (m = 0; m < INFLIGHT && rc == 0; m++)
    rc = message(c1, c2, SMALL, 1000u * (uint32_t)m, s, tx + m * SMALL, rx + m * SMALL);
  release_all(rx, INFLIGHT * SMALL, s);
  release_all(tx, INFLIGHT * SMALL, s);
  if (rc) {
    rc = gh_verdict(1, "message", "message %d of %d buffers: %s", m, SMALL, why);
    goto out;
  }
  gh_verdict(0, "message-1000", "%d messages of %d buffers in flight at once, every buffer checked", INFLIGHT, SMALL);
  rc = message(c1, c2, BIG, 7, s, tx, rx);
  release_all(rx, BIG, s);
  release_all(tx, BIG, s);
  if (rc) {
    rc = gh_verdict(1, "message", "a message of %d buffers: %s", BIG, why);
    goto out;
  }
  rc = gh_verdict(0, "message", "a message of %d buffers, every buffer checked", BIG);
out:
  gpupool_client_disconnect(c2);
  (void)cudaStreamSynchronize(s);
  free(tx);
  free(rx);
  return rc;
}

int main(int argc, char **argv) {
  gh_daemon d;
  const char *check;
  int rc;

  gh_driver_start(argc, argv, 3, "GPUPOOLD reuse|message|ready", 1, "a CUDA GPU");
  check = argv[2];
  if (strcmp(check, "reuse") && strcmp(check, "message") && strcmp(check, "ready")) {
    fprintf(stderr, "unknown check %s (reuse, message, ready)\n", check);
    return 2;
  }
  if (gh_daemon_start_conf(&d, argv[1], POOL_SPEC, DEVICE_POOL_CONF) != 0) {
    if (strcmp(check, "reuse"))
      return gh_verdict(1, check, "gpupoold did not start");
    printf("SKIP: gpupoold did not start with a host-NUMA pool on GPU 0 (see its log above)\n");
    return GH_SKIP;
  }
  rc = gh_run_on_daemon(&d, check, "gpu-imports-1",
                        !strcmp(check, "reuse") ? check_reuse : !strcmp(check, "message") ? check_message : check_ready);
  return rc ? 1 : 0;
}
