/*
 * GPU check of the CUDA copy engine alone (backend/cuda/copy.c): the CUDA backend opened in
 * this process, pools and slabs made through its ops, sources filled with the seeded pattern by
 * a kernel, copy jobs run through copy_start / copy_poll / copy_free, and every destination
 * slab read back and compared byte for byte with the image it must hold (its bytes before the
 * job with each segment's source bytes laid over them), so bytes outside the segments are
 * checked too.
 *
 *   gpupool_gpu_copy CHECK
 *
 *   peer     GPU 0 -> GPU 1, segments at odd offsets and lengths; the target GPU was given
 *            access to the source pool (when the pair can peer); the job's end is written to
 *            the backend's copy notifier; bad jobs are refused.
 *   staged   the same with GPUPOOL_NO_PEER=1: no access granted, bytes through the pinned ring
 *            (more pieces than ring slots, so slots are reused).
 *   chain    1, 2 and 3 destinations along GPUs 1, 2, 3 (1, 0, 1 on two GPUs), peer and staged,
 *            and a chain with a hop inside one GPU.
 *   running  copy_free right after copy_start of a 4 GiB job (staged, then peer): once it
 *            returns the test overwrites the destinations and checks, 300 ms later, that no
 *            copy wrote over them.
 *   many     2,000 segments of 1 byte to 3 MiB to two destinations, peer and staged.
 *   host     a host-NUMA pool (node 0) in the chain: GPU 0 -> host -> GPU 1, and host -> GPU 1
 *            (skipped when GPU 0 lacks host-NUMA pools).
 *   clear    a slab made over memory a freed slab left full of a pattern: slab_alloc clears
 *            every byte past its `filled` argument (those a replica's copy does not cover),
 *            and every byte with filled 0.
 *
 * Each check ends by freeing its slabs (every pool's used bytes back to 0) and destroying its
 * pools. Prints one "PASS: ..." or "FAIL: ..." line; exit status 0 pass, 1 fail, 77 skip (fewer
 * than two GPUs).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "backend.h"
#include "cuda_daemon.h"
#include "errors.h"
#include "gpu_driver.h"
#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "log.h"

#define MiB (1ull << 20)
#define MAXP 8
#define MAXS 8

typedef struct {
  gpupool__backend *be;
  gpupool__bpool *pool[MAXP];
  int npool;
  gpupool__bslab slab[MAXS];
  gpupool__bpool *slab_pool[MAXS];
  int slab_dev[MAXS];
  int nslab;
  int ngpu;
} env;

static int fail(const char *check, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(const char *check, const char *fmt, ...) {
  va_list ap;
  printf("FAIL: %s: ", check);
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  putchar('\n');
  fflush(stdout);
  return 1;
}

static int cuda_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess)
    return 0;
  fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return -1;
}

static int env_open(env *v) {
  int rc;
  memset(v, 0, sizeof(*v));
  if (cudaGetDeviceCount(&v->ngpu) != cudaSuccess)
    return -1;
  if ((rc = gpupool__backend_open(&gpupool__backend_cuda, &v->be)) < 0) {
    fprintf(stderr, "open the CUDA backend: %s: %s\n", gpupool_err_name(rc), gpupool__errmsg());
    return -1;
  }
  return 0;
}

/* A pool of kind on device (numa node 0 for host-NUMA): its index, or -1. */
static int mkpool(env *v, const char *name, gpupool_mem_kind kind, int device, uint64_t cap) {
  gpupool__pool_config cfg;
  int fd = -1, rc;
  gpupool__pool_config_init(&cfg);
  snprintf(cfg.name, sizeof(cfg.name), "%s", name);
  cfg.kind = kind;
  cfg.device = device;
  cfg.numa_node = kind == GPUPOOL_MEM_HOST_NUMA ? 0 : -1;
  cfg.capacity = cap;
  cfg.slab_size = cap;
  if ((rc = v->be->ops->pool_create(v->be, &cfg, &v->pool[v->npool], &fd)) < 0) {
    fprintf(stderr, "pool_create %s: %s: %s\n", name, gpupool_err_name(rc), gpupool__errmsg());
    return -1;
  }
  return v->npool++;
}

/* A slab of size bytes in pool p: its index, or -1. */
static int mkslab(env *v, int p, uint64_t size) {
  int rc = v->be->ops->slab_alloc(v->pool[p], size, 0, &v->slab[v->nslab]);
  if (rc < 0) {
    fprintf(stderr, "slab_alloc of %" PRIu64 " bytes: %s: %s\n", size, gpupool_err_name(rc),
            gpupool__errmsg());
    return -1;
  }
  v->slab_pool[v->nslab] = v->pool[p];
  v->slab_dev[v->nslab] = v->pool[p]->device;
  return v->nslab++;
}

static gpupool__bloc loc(env *v, int s, uint64_t off) {
  gpupool__bloc l = {v->slab_pool[s], &v->slab[s], off};
  return l;
}

static int fill(env *v, int s, uint32_t seed) {
  if (cuda_ok(cudaSetDevice(v->slab_dev[s]), "cudaSetDevice") < 0)
    return -1;
  if (cuda_ok((cudaError_t)gk_fill(v->slab[s].priv, v->slab[s].size, seed, NULL), "gk_fill") < 0)
    return -1;
  return cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize after gk_fill");
}

/* The slab's bytes, read back into a new host buffer (NULL on error). */
static uint8_t *readback(env *v, int s) {
  uint8_t *b = malloc(v->slab[s].size);
  if (!b)
    return NULL;
  if (cuda_ok(cudaSetDevice(v->slab_dev[s]), "cudaSetDevice") < 0 ||
      cuda_ok(cudaMemcpy(b, v->slab[s].priv, v->slab[s].size, cudaMemcpyDefault),
              "cudaMemcpy (read back)") < 0) {
    free(b);
    return NULL;
  }
  return b;
}

/* Run a job to its end, polling: 0, or the engine's error. */
static int run_job(env *v, const gpupool__bcopy_seg *segs, size_t n, int ndst, int *polls) {
  gpupool__bcopy *c = NULL;
  uint64_t end = gh_now_ns() + 300ull * 1000000000ull;
  int rc = v->be->ops->copy_start(v->be, segs, n, ndst, &c);
  *polls = 0;
  if (rc < 0)
    return rc;
  while ((rc = v->be->ops->copy_poll(c)) == 0 && gh_now_ns() < end) {
    (*polls)++;
    gh_sleep_ms(1);
  }
  if (rc == 0)
    rc = gpupool__err(GPUPOOL_ETIMEDOUT, "copy job still running after 300 s");
  v->be->ops->copy_free(c);
  return rc < 0 ? rc : 0;
}

/* Compare every destination slab named by segs with its image: before (each slab's bytes
 * before the job, indexed by slab; NULL = zeros) with every segment's source bytes (src
 * images in img, indexed by slab) laid over. 0, or 1 after a FAIL line. */
static int verify(env *v, const char *check, const char *what, const gpupool__bcopy_seg *segs,
                  size_t n, int ndst, uint8_t **img) {
  int done[MAXS] = {0};
  for (size_t i = 0; i < n; i++)
    for (int h = 0; h < ndst; h++) {
      int d = (int)(segs[i].dst[h].slab - v->slab);
      uint8_t *want, *got;
      uint64_t size = v->slab[d].size, bad = 0, first = UINT64_MAX;
      int differ;
      if (done[d])
        continue;
      done[d] = 1;
      want = calloc(1, size);
      got = readback(v, d);
      if (!want || !got) {
        free(want);
        free(got);
        return fail(check, "%s: cannot read back slab %d", what, d);
      }
      if (img[d])
        memcpy(want, img[d], size);
      for (size_t j = 0; j < n; j++)
        for (int g = 0; g < ndst; g++)
          if (segs[j].dst[g].slab == &v->slab[d]) {
            int s = (int)(segs[j].src.slab - v->slab);
            memcpy(want + segs[j].dst[g].off, img[s] + segs[j].src.off, segs[j].len);
          }
      differ = memcmp(want, got, size) != 0;
      for (uint64_t k = 0; differ && k < size; k++)
        if (want[k] != got[k]) {
          bad++;
          if (first == UINT64_MAX)
            first = k;
        }
      free(want);
      free(got);
      if (bad)
        return fail(check, "%s: destination slab %d (device %d) has %" PRIu64 " wrong bytes, "
                    "the first at offset %" PRIu64, what, d, v->slab_dev[d], bad, first);
    }
  return 0;
}

/* Free every slab (each pool's used bytes must come back to 0), destroy the pools, close. */
static int env_close(env *v, const char *check) {
  int rc = 0;
  for (int s = 0; s < v->nslab; s++)
    if (v->slab[s].priv)
      v->be->ops->slab_free(v->slab_pool[s], &v->slab[s]);
  for (int p = 0; p < v->npool; p++) {
    gpupool__bpool_stats st;
    if (v->be->ops->pool_stats(v->pool[p], &st) < 0 || st.used_cur != 0)
      rc = fail(check, "pool %s holds %" PRIu64 " bytes after every slab was freed",
                v->pool[p]->name, st.used_cur);
    v->be->ops->pool_destroy(v->pool[p]);
  }
  v->be->ops->close(v->be);
  return rc;
}

static void no_peer(int on) {
  if (on)
    setenv("GPUPOOL_NO_PEER", "1", 1);
  else
    unsetenv("GPUPOOL_NO_PEER");
}

/* Access of device to pool p in this process. */
static enum cudaMemAccessFlags access_of(gpupool__bpool *p, int device) {
  enum cudaMemAccessFlags f = cudaMemAccessFlagsProtNone;
  struct cudaMemLocation l = {.type = cudaMemLocationTypeDevice, .id = device};
  if (cudaMemPoolGetAccess(&f, p->pool, &l) != cudaSuccess)
    (void)cudaGetLastError();
  return f;
}

/* GPU 0 -> GPU 1 with and without peer access. */
static int check_pair(int staged) {
  const char *check = staged ? "staged" : "peer";
  env v;
  int ps, pd, s, d, polls = 0, rc, can = 0, nfd;
  uint8_t *img[MAXS] = {0};
  gpupool__bcopy_seg segs[3];
  gpupool__bcopy *c = NULL;

  if (env_open(&v) < 0)
    return fail(check, "cannot open the CUDA backend");
  if ((ps = mkpool(&v, "src", GPUPOOL_MEM_DEVICE, 0, 512 * MiB)) < 0 ||
      (pd = mkpool(&v, "dst", GPUPOOL_MEM_DEVICE, 1, 512 * MiB)) < 0 ||
      (s = mkslab(&v, ps, 256 * MiB)) < 0 || (d = mkslab(&v, pd, 320 * MiB)) < 0)
    return fail(check, "cannot make pools and slabs");
  if (fill(&v, s, 7) < 0 || !(img[s] = readback(&v, s)))
    return fail(check, "cannot fill the source");
  memset(segs, 0, sizeof(segs));
  /* Odd offsets and lengths, a piece boundary inside a segment, and a 1-byte segment. */
  segs[0].src = loc(&v, s, 3);
  segs[0].dst[0] = loc(&v, d, 4097);
  segs[0].len = 200 * MiB + 5;
  segs[1].src = loc(&v, s, 211 * MiB);
  segs[1].dst[0] = loc(&v, d, 250 * MiB);
  segs[1].len = 45 * MiB - 1;
  segs[2].src = loc(&v, s, 256 * MiB - 1);
  segs[2].dst[0] = loc(&v, d, 320 * MiB - 1);
  segs[2].len = 1;
  no_peer(staged);
  if ((nfd = v.be->ops->copy_notify_fd(v.be)) < 0)
    return fail(check, "the CUDA backend gives no copy notifier (eventfd)");
  rc = run_job(&v, segs, 3, 1, &polls);
  if (rc < 0)
    return fail(check, "copy job: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  if (verify(&v, check, "three segments", segs, 3, 1, img))
    return 1;
  /* The job's end was told on the notifier (what gpupoold's loop waits on). */
  {
    struct pollfd pf = {.fd = nfd, .events = POLLIN};
    uint64_t n = 0;
    if (poll(&pf, 1, 5000) != 1 || read(nfd, &n, sizeof n) != (ssize_t)sizeof n || n == 0)
      return fail(check, "the copy notifier was not written when the job ended");
  }
  (void)cudaDeviceCanAccessPeer(&can, 1, 0);
  if (staged && access_of(v.pool[ps], 1) != cudaMemAccessFlagsProtNone)
    return fail(check, "GPUPOOL_NO_PEER=1 but device 1 was given access to the source pool");
  if (!staged && can && access_of(v.pool[ps], 1) != cudaMemAccessFlagsProtReadWrite)
    return fail(check, "devices 1 and 0 can peer but device 1 has no access to the source "
                "pool: the copy did not take the peer path");
  if (!staged && !can)
    printf("NOTE: device 1 cannot access device 0 as a peer: the copy was staged\n");

  /* Refusals: a segment past its slab's end, and a job whose segments leave from two
   * places. Nothing is queued for either. */
  segs[0].len = 300 * MiB;
  rc = v.be->ops->copy_start(v.be, segs, 1, 1, &c);
  if (rc != GPUPOOL_EINVAL || c)
    return fail(check, "a segment past the end of its slab: %s, expected GPUPOOL_EINVAL",
                gpupool_err_name(rc));
  printf("refused as expected: %s\n", gpupool__errmsg());
  segs[0].len = 1;
  segs[1].src = loc(&v, d, 0);
  rc = v.be->ops->copy_start(v.be, segs, 2, 1, &c);
  if (rc != GPUPOOL_EINVAL || c)
    return fail(check, "segments from two devices in one job: %s, expected GPUPOOL_EINVAL",
                gpupool_err_name(rc));
  printf("refused as expected: %s\n", gpupool__errmsg());
  free(img[s]);
  if (env_close(&v, check))
    return 1;
  return gh_verdict(0, check, "%s copy GPU 0 -> GPU 1 bit-exact (3 segments, %d polls), bad "
                    "jobs refused", staged ? "staged" : can ? "peer" : "staged (no peer)", polls);
}

/* 1..3 destinations along the GPUs, peer and staged; a chain with a hop inside GPU 0. */
static int check_chain(void) {
  const char *check = "chain";
  env v;
  int ps, s, pd[4], dd[4], polls = 0, rc;
  uint8_t *img[MAXS] = {0};
  gpupool__bcopy_seg segs[2];
  const uint64_t size = 192 * MiB;

  if (env_open(&v) < 0)
    return fail(check, "cannot open the CUDA backend");
  if ((ps = mkpool(&v, "src", GPUPOOL_MEM_DEVICE, 0, size)) < 0 || (s = mkslab(&v, ps, size)) < 0)
    return fail(check, "cannot make the source");
  for (int i = 0; i < 3; i++) {
    char name[16];
    snprintf(name, sizeof(name), "dst%d", i);
    if ((pd[i] = mkpool(&v, name, GPUPOOL_MEM_DEVICE, (i + 1) % v.ngpu, size)) < 0 ||
        (dd[i] = mkslab(&v, pd[i], size)) < 0)
      return fail(check, "cannot make destination %d", i);
  }
  if ((pd[3] = mkpool(&v, "local", GPUPOOL_MEM_DEVICE, 0, size)) < 0 ||
      (dd[3] = mkslab(&v, pd[3], size)) < 0)
    return fail(check, "cannot make the pool on GPU 0");
  if (fill(&v, s, 11) < 0 || !(img[s] = readback(&v, s)))
    return fail(check, "cannot fill the source");
  for (int staged = 0; staged <= 1; staged++)
    for (int n = 1; n <= 3; n++) {
      char what[64];
      memset(segs, 0, sizeof(segs));
      segs[0].src = loc(&v, s, 0);
      segs[0].len = 150 * MiB + 12; /* several pieces: the hops overlap */
      segs[1].src = loc(&v, s, 160 * MiB);
      segs[1].len = 32 * MiB;
      for (int h = 0; h < n; h++) {
        segs[0].dst[h] = loc(&v, dd[h], (uint64_t)h * 4);
        segs[1].dst[h] = loc(&v, dd[h], 160 * MiB);
      }
      for (int h = 0; h < 3; h++) /* new bytes in every destination before each job */
        if (fill(&v, dd[h], 100 + (uint32_t)(staged * 3 + n)) < 0 || !(img[dd[h]] = readback(&v, dd[h])))
          return fail(check, "cannot fill destination %d", h);
      no_peer(staged);
      rc = run_job(&v, segs, 2, n, &polls);
      if (rc < 0)
        return fail(check, "%s chain of %d: %s: %s", staged ? "staged" : "peer", n,
                    gpupool_err_name(rc), gpupool__errmsg());
      snprintf(what, sizeof(what), "%s chain of %d", staged ? "staged" : "peer", n);
      if (verify(&v, check, what, segs, 2, n, img))
        return 1;
      for (int h = 0; h < 3; h++) {
        free(img[dd[h]]);
        img[dd[h]] = NULL;
      }
    }
  /* GPU 0 -> GPU 1 -> GPU 0 (another pool) -> GPU 0 (a local hop). */
  for (int h = 0; h < 4; h++)
    if (!(img[dd[h]] = readback(&v, dd[h])))
      return fail(check, "cannot read back destination %d", h);
  memset(segs, 0, sizeof(segs));
  segs[0].src = loc(&v, s, 5);
  segs[0].len = 100 * MiB;
  segs[0].dst[0] = loc(&v, dd[0], 0);
  segs[0].dst[1] = loc(&v, v.ngpu > 2 ? dd[3] : dd[1], 1);
  segs[0].dst[2] = loc(&v, v.ngpu > 2 ? dd[1] : dd[3], 2);
  no_peer(0);
  if ((rc = run_job(&v, segs, 1, 3, &polls)) < 0)
    return fail(check, "chain with a local hop: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  if (verify(&v, check, "chain with a local hop", segs, 1, 3, img))
    return 1;
  for (int i = 0; i < MAXS; i++)
    free(img[i]);
  if (env_close(&v, check))
    return 1;
  return gh_verdict(0, check, "chains of 1, 2 and 3 destinations over %d GPUs bit-exact, peer "
                    "and staged, and one with a hop inside a GPU", v.ngpu);
}

/* copy_free of a job still running returns only once nothing writes the destinations. */
static int check_running(void) {
  const char *check = "running";
  const uint64_t size = 2048 * MiB;
  env v;
  int ps, pd, s[2], d[2], was_running[2] = {0, 0};
  gpupool__bcopy_seg segs[2];

  if (env_open(&v) < 0)
    return fail(check, "cannot open the CUDA backend");
  if ((ps = mkpool(&v, "src", GPUPOOL_MEM_DEVICE, 0, 2 * size)) < 0 ||
      (pd = mkpool(&v, "dst", GPUPOOL_MEM_DEVICE, 1, 2 * size)) < 0)
    return fail(check, "cannot make the pools");
  for (int i = 0; i < 2; i++)
    if ((s[i] = mkslab(&v, ps, size)) < 0 || (d[i] = mkslab(&v, pd, size)) < 0 ||
        fill(&v, s[i], 21 + (uint32_t)i) < 0)
      return fail(check, "cannot make and fill the slabs");
  for (int staged = 1; staged >= 0; staged--) {
    gpupool__bcopy *c = NULL;
    unsigned long long bad = 0;
    int rc;
    memset(segs, 0, sizeof(segs));
    for (int i = 0; i < 2; i++) {
      segs[i].src = loc(&v, s[i], 0);
      segs[i].dst[0] = loc(&v, d[i], 0);
      segs[i].len = size;
    }
    no_peer(staged);
    if ((rc = v.be->ops->copy_start(v.be, segs, 2, 1, &c)) < 0)
      return fail(check, "copy_start: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
    rc = v.be->ops->copy_poll(c);
    if (rc < 0)
      return fail(check, "copy_poll: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
    was_running[staged] = rc == 0;
    v.be->ops->copy_free(c);
    /* Overwrite the destinations now; a copy still running would write over them. */
    for (int i = 0; i < 2; i++)
      if (fill(&v, d[i], 77) < 0)
        return fail(check, "cannot overwrite destination %d", i);
    gh_sleep_ms(300);
    for (int i = 0; i < 2; i++) {
      if (cudaSetDevice(1) != cudaSuccess ||
          gk_count_mismatches(v.slab[d[i]].priv, size, 77, NULL, &bad) != 0)
        return fail(check, "cannot check destination %d", i);
      if (bad)
        return fail(check, "%s: %llu words of destination %d changed after copy_free returned: "
                    "the copy still ran", staged ? "staged" : "peer", bad, i);
    }
  }
  if (env_close(&v, check))
    return 1;
  return gh_verdict(0, check, "copy_free of a running 4 GiB job waited for its copies (staged: "
                    "%s at copy_free; peer: %s); nothing wrote the destinations afterwards",
                    was_running[1] ? "running" : "already done",
                    was_running[0] ? "running" : "already done");
}

static uint64_t rnd(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

/* 2,000 segments of 1 byte to 3 MiB into two destinations. */
static int check_many(void) {
  const char *check = "many";
  const size_t n = 2000;
  const uint64_t ssize = 256 * MiB, dsize = 1024 * MiB;
  env v;
  int ps, s, pd[2], dd[2], polls = 0, rc;
  uint8_t *img[MAXS] = {0};
  gpupool__bcopy_seg *segs = calloc(n, sizeof(*segs));

  if (!segs || env_open(&v) < 0)
    return fail(check, "cannot open the CUDA backend");
  if ((ps = mkpool(&v, "src", GPUPOOL_MEM_DEVICE, 0, ssize)) < 0 || (s = mkslab(&v, ps, ssize)) < 0)
    return fail(check, "cannot make the source");
  for (int i = 0; i < 2; i++) {
    char name[16];
    snprintf(name, sizeof(name), "dst%d", i);
    if ((pd[i] = mkpool(&v, name, GPUPOOL_MEM_DEVICE, i == 0 ? 1 : v.ngpu - 1, dsize)) < 0 ||
        (dd[i] = mkslab(&v, pd[i], dsize)) < 0)
      return fail(check, "cannot make destination %d", i);
  }
  if (fill(&v, s, 31) < 0 || !(img[s] = readback(&v, s)))
    return fail(check, "cannot fill the source");
  for (int staged = 0; staged <= 1; staged++) {
    uint64_t x = 0x9e3779b97f4a7c15ull + (uint64_t)staged, at = 0;
    for (size_t i = 0; i < n; i++) {
      uint64_t len = 1 + rnd(&x) % (rnd(&x) % 4 == 0 ? 3 * MiB : 4096);
      segs[i].len = len;
      segs[i].src = loc(&v, s, rnd(&x) % (ssize - len + 1));
      at += rnd(&x) % 64; /* gaps, so bytes between segments are checked untouched */
      segs[i].dst[0] = loc(&v, dd[0], at);
      segs[i].dst[1] = loc(&v, dd[1], dsize - at - len);
      at += len;
    }
    if (at > dsize)
      return fail(check, "the test's segments need %" PRIu64 " bytes, more than the slab", at);
    no_peer(staged);
    if ((rc = run_job(&v, segs, n, 2, &polls)) < 0)
      return fail(check, "%s: %s: %s", staged ? "staged" : "peer", gpupool_err_name(rc),
                  gpupool__errmsg());
    if (verify(&v, check, staged ? "staged" : "peer", segs, n, 2, img))
      return 1;
    /* The next round starts from what this one left. */
    for (int i = 0; i < 2; i++) {
      free(img[dd[i]]);
      if (!(img[dd[i]] = readback(&v, dd[i])))
        return fail(check, "cannot read back destination %d", i);
    }
  }
  for (int i = 0; i < MAXS; i++)
    free(img[i]);
  free(segs);
  if (env_close(&v, check))
    return 1;
  return gh_verdict(0, check, "2,000 segments (1 byte to 3 MiB, gaps between) to two "
                    "destinations bit-exact, peer and staged");
}

/* A host-NUMA pool as destination and as source. */
static int check_host(void) {
  const char *check = "host";
  const uint64_t size = 128 * MiB;
  env v;
  int ok = 0, ps, ph, pd, s, hs, d, polls = 0, rc;
  uint8_t *img[MAXS] = {0};
  gpupool__bcopy_seg seg;

  if (cudaDeviceGetAttribute(&ok, cudaDevAttrHostNumaMemoryPoolsSupported, 0) != cudaSuccess || !ok) {
    printf("SKIP: device 0 lacks host-NUMA memory pools\n");
    return GH_SKIP;
  }
  if (env_open(&v) < 0)
    return fail(check, "cannot open the CUDA backend");
  if ((ps = mkpool(&v, "src", GPUPOOL_MEM_DEVICE, 0, size)) < 0 ||
      (ph = mkpool(&v, "pinned", GPUPOOL_MEM_HOST_NUMA, 0, size)) < 0 ||
      (pd = mkpool(&v, "dst", GPUPOOL_MEM_DEVICE, 1, size)) < 0 || (s = mkslab(&v, ps, size)) < 0 ||
      (hs = mkslab(&v, ph, size)) < 0 || (d = mkslab(&v, pd, size)) < 0)
    return fail(check, "cannot make pools and slabs");
  if (fill(&v, s, 41) < 0 || !(img[s] = readback(&v, s)))
    return fail(check, "cannot fill the source");
  memset(&seg, 0, sizeof(seg));
  seg.src = loc(&v, s, 1);
  seg.dst[0] = loc(&v, hs, 2);
  seg.dst[1] = loc(&v, d, 3);
  seg.len = 100 * MiB + 1;
  no_peer(0);
  if ((rc = run_job(&v, &seg, 1, 2, &polls)) < 0)
    return fail(check, "GPU 0 -> host -> GPU 1: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  if (verify(&v, check, "GPU 0 -> host -> GPU 1", &seg, 1, 2, img))
    return 1;
  if (!(img[hs] = readback(&v, hs)) || !(img[d] = readback(&v, d)))
    return fail(check, "cannot read back");
  memset(&seg, 0, sizeof(seg));
  seg.src = loc(&v, hs, 0);
  seg.dst[0] = loc(&v, d, 64 * MiB);
  seg.len = 64 * MiB;
  if ((rc = run_job(&v, &seg, 1, 1, &polls)) < 0)
    return fail(check, "host -> GPU 1: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
  if (verify(&v, check, "host -> GPU 1", &seg, 1, 1, img))
    return 1;
  for (int i = 0; i < MAXS; i++)
    free(img[i]);
  if (env_close(&v, check))
    return 1;
  return gh_verdict(0, check, "GPU 0 -> host-NUMA pool -> GPU 1 and host-NUMA -> GPU 1 bit-exact");
}

/* Bytes of slab s in [from, to) that are not zero (-1 when they cannot be read). */
static int64_t nonzero(env *v, int s, uint64_t from, uint64_t to) {
  uint8_t *b = readback(v, s);
  int64_t n = 0;
  if (!b)
    return -1;
  for (uint64_t i = from; i < to; i++)
    n += b[i] != 0;
  free(b);
  return n;
}

static int check_clear(void) {
  const char *check = "clear";
  const uint64_t size = 64 * MiB, filled = 40 * MiB + 3;
  env v;
  int p, s;
  int64_t bad;
  void *at;

  if (env_open(&v) < 0)
    return fail(check, "cannot open the CUDA backend");
  if ((p = mkpool(&v, "clear", GPUPOOL_MEM_DEVICE, 0, 256 * MiB)) < 0)
    return fail(check, "cannot make the pool");
  for (int round = 0; round < 2; round++) {
    uint64_t keep = round == 0 ? filled : 0;
    int rc;
    /* A slab full of the pattern, freed: its memory stays in the pool for the next. */
    if ((s = mkslab(&v, p, size)) < 0 || fill(&v, s, 99) < 0)
      return fail(check, "cannot make and fill a slab");
    at = v.slab[s].priv;
    v.be->ops->slab_free(v.slab_pool[s], &v.slab[s]);
    v.nslab--;
    rc = v.be->ops->slab_alloc(v.pool[p], size, keep, &v.slab[s]);
    if (rc < 0)
      return fail(check, "slab_alloc: %s: %s", gpupool_err_name(rc), gpupool__errmsg());
    v.nslab++;
    if (v.slab[s].priv != at)
      printf("NOTE: the new slab is not at the freed one's address: the pool gave other memory\n");
    if ((bad = nonzero(&v, s, keep, size)) != 0)
      return fail(check, "filled %" PRIu64 ": %" PRId64 " bytes past it are not zero", keep, bad);
  }
  if (env_close(&v, check))
    return 1;
  return gh_verdict(0, check, "a new slab over a freed one's pattern reads zero past `filled` (%" PRIu64
                    " of %" PRIu64 " bytes) and everywhere with filled 0", filled, size);
}

int main(int argc, char **argv) {
  const char *check;
  gh_driver_start(argc, argv, 2, "peer|staged|chain|running|many|host|clear", 2,
                  "the copy engine check");
  gpupool__log_set_level(GPUPOOL_LOG_DEBUG);
  check = argv[1];
  if (!strcmp(check, "peer"))
    return check_pair(0);
  if (!strcmp(check, "staged"))
    return check_pair(1);
  if (!strcmp(check, "chain"))
    return check_chain();
  if (!strcmp(check, "running"))
    return check_running();
  if (!strcmp(check, "many"))
    return check_many();
  if (!strcmp(check, "host"))
    return check_host();
  if (!strcmp(check, "clear"))
    return check_clear();
  fprintf(stderr, "unknown check %s\n", check);
  return 2;
}
