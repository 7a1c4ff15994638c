/*
 * GPU checks of a survive=yes device pool: its slabs are cuMemCreate allocations exported as
 * fds, kept in gpupoold --supervise's fd store, and taken over by the daemon started after a
 * kill -9 of the one that made them.
 *
 *   gpupool_gpu_survive GPUPOOLD crash|bundle|cycles
 *
 * crash   A producer publishes names (GPUPOOL_TEST_SURVIVE_BYTES in all, default 1 GiB, in
 *         names of at most 3.5 GiB; one name at version 2) filled by a kernel, and a reader
 *         holds every one of them. The daemon is killed with SIGKILL. While it is down the
 *         reader's mappings still read the pattern; after the supervisor restarted it, a new
 *         client gets every name at its version, bit-exact, the reader's holds are back (not
 *         lost, no lost names), a new version of a name goes on from the last one, and once
 *         everything is released the pool is empty and the GPU's free memory is back where it
 *         was before the names were made.
 * bundle  The same with one bundle of 8 members holding all the bytes (a model's weights as one
 *         version): version 2 held by a reader across the kill, the same after, 3 next.
 * cycles  20 crash-restart cycles, a 256 MiB name republished and held by a reader each time:
 *         every version bit-exact, versions increasing, nothing leaked at the end.
 *
 * GPUPOOL_TEST_SURVIVE_KIND=host-numa makes the pool pinned host memory of NUMA node 0 (each
 * slab a host-NUMA cuMemCreate allocation), whose words the CPU checks too; skipped (77) when
 * gpupoold cannot make such a pool here.
 *
 * Prints "PASS: ..." or "FAIL: ..." and, for crash, how long the new daemon took from the kill
 * to its first served get ("INFO:" lines: printed, never asserted). Exit status 0 pass, 1
 * fail, 77 skip (no GPU).
 */
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_driver.h"
#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpupool/gpupool.h"

#define POOL "keep"
#define MAX_NAMES 64
#define NAME_MAX_BYTES (3584ull << 20)

static char why[1024];
static gh_daemon D;
static int host; /* GPUPOOL_TEST_SURVIVE_KIND=host-numa: a pinned host-NUMA pool */

static int FAILF(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int FAILF(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  return 1;
}

static int gp_fail(const char *what, int rc) {
  return FAILF("%s: %s: %s", what, gpupool_err_name(rc), gpupool_last_error());
}

static int cu_fail(const char *what, cudaError_t e) {
  (void)cudaGetLastError();
  return FAILF("%s: %s: %s", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

static int verify(const char *what, gpupool_buffer *b, size_t bytes, uint32_t seed, cudaStream_t s) {
  unsigned long long bad = 0;
  int ce = gk_count_mismatches(gpupool_buffer_ptr(b), bytes, seed, s, &bad);
  if (ce)
    return cu_fail(what, (cudaError_t)ce);
  if (bad)
    return FAILF("%s: %llu of %zu words differ from the pattern written", what, bad, bytes / 4);
  if (host) {
    /* Pinned host memory: the CPU reads the same pattern through the same pointer (every
     * 4097th word: the kernel read them all). */
    const uint32_t *w = gpupool_buffer_ptr(b);
    if (cudaStreamSynchronize(s) != cudaSuccess)
      return cu_fail(what, cudaGetLastError());
    for (uint64_t i = 0; i < bytes / 4; i += 4097)
      if (w[i] != gk_pattern(i, seed))
        return FAILF("%s: word %llu read by the CPU differs from the pattern", what, (unsigned long long)i);
  }
  return 0;
}

/* Allocate bytes, fill them with seed's pattern, publish as name: the version in *v. */
static int publish(gpupool_client *c, const char *name, size_t bytes, uint32_t seed, cudaStream_t s, uint64_t *v) {
  gpupool_buffer *b = NULL;
  int rc, ce;
  if ((rc = gpupool_buffer_alloc(c, POOL, bytes, 0, s, &b)) < 0)
    return gp_fail("gpupool_buffer_alloc in the survive=yes pool", rc);
  if ((ce = gk_fill(gpupool_buffer_ptr(b), bytes, seed, s)) != 0) {
    (void)gpupool_buffer_release(b, s);
    return cu_fail("fill kernel", (cudaError_t)ce);
  }
  rc = gpupool_buffer_publish(b, name, NULL, s, v);
  (void)gpupool_buffer_release(b, s);
  return rc < 0 ? gp_fail("gpupool_buffer_publish", rc) : 0;
}

static size_t free_mem(void) {
  size_t fr = 0, total = 0;
  if (cudaMemGetInfo(&fr, &total) != cudaSuccess)
    (void)cudaGetLastError();
  return fr;
}

static uint64_t env_u64(const char *name, uint64_t def) {
  const char *v = getenv(name);
  return v && *v ? strtoull(v, NULL, 0) : def;
}

static pid_t crash(pid_t child) {
  if (kill(child, SIGKILL) != 0)
    return 0;
  return gh_wait_restarted(&D, child, 60000);
}

/* A producer and a reader of the check `who` ("who-producer", "who-reader"). */
static int connect_pair(const char *who, gpupool_client **p, gpupool_client **r) {
  char name[64];
  int e;
  snprintf(name, sizeof name, "%s-producer", who);
  if ((e = gpupool_client_connect(D.sock, name, GPUPOOL_TIMEOUT_DEFAULT, p)) < 0)
    return gp_fail("gpupool_client_connect", e);
  snprintf(name, sizeof name, "%s-reader", who);
  if ((e = gpupool_client_connect(D.sock, name, GPUPOOL_TIMEOUT_DEFAULT, r)) < 0)
    return gp_fail("gpupool_client_connect", e);
  return 0;
}

/* The reader's first request since the crash: it reconnects and takes its holds back. */
static int reader_back(gpupool_client *r) {
  gpupool_pool_stats ps;
  if (gh_pool_stats(r, POOL, &ps, NULL) < 0)
    return FAILF("the reader's first request after the restart failed");
  return 0;
}

static int unpublish(gpupool_client *p, const char *name) {
  int e = gpupool_name_unpublish(p, name);
  return e < 0 ? gp_fail("gpupool_name_unpublish", e) : 0;
}

/* Everything released (the work queued in s included): the pool holds nothing and its slabs
 * went back to the driver. */
static int check_empty(gpupool_client *c, size_t free_before, cudaStream_t s) {
  gpupool_pool_stats ps;
  uint64_t got = 0;
  size_t after;
  (void)cudaStreamSynchronize(s);
  if (gh_wait_used(c, POOL, 0, 20000, &got) != 0)
    return FAILF("the pool still has %" PRIu64 " bytes in use after everything was released", got);
  for (int i = 0; i < 200; i++) {
    if (gh_pool_stats(c, POOL, &ps, NULL) < 0)
      return FAILF("gpupool_client_stats failed");
    if (ps.reserved == 0)
      break;
    gh_sleep_ms(50);
  }
  if (ps.reserved != 0)
    return FAILF("the pool keeps %" PRIu64 " bytes in slabs with nothing in use (keep_slabs = 0)", ps.reserved);
  /* The memory goes with the last fd of each slab: the daemon's at once, the copy in the
   * supervisor's store when the supervisor has read the daemon's removal (a datagram it
   * handles in its own time). The driver's own bookkeeping may move by a few MiB; a slab is
   * at least 2 MiB and the names were hundreds of MiB. */
  for (int i = 0; i < 100 && (after = free_mem()) + (64u << 20) < free_before; i++)
    gh_sleep_ms(50);
  if (after + (64u << 20) < free_before) {
    /* Who holds it: this process (a mapping it kept), the daemon, or nobody with a context (an
     * fd left in the supervisor's store). */
    printf("INFO: test pid %d, supervisor %d, daemon %d; GPU memory by process:\n", (int)getpid(), (int)D.pid,
           (int)ts_child_of(D.pid));
    fflush(stdout);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; "
             "echo supervisor fds: $(ls /proc/%d/fd | wc -l)", (int)D.pid);
    if (system(cmd) != 0)
      printf("INFO: nvidia-smi failed\n");
  }
  if (after + (64u << 20) < free_before)
    return FAILF("the GPU has %zu MiB less free memory than before the names were made: slab memory leaked",
                 (free_before - after) >> 20);
  printf("INFO: GPU free memory %zu MiB before, %zu MiB after everything was released\n", free_before >> 20,
         after >> 20);
  return 0;
}

static int check_crash(cudaStream_t s) {
  uint64_t total = env_u64("GPUPOOL_TEST_SURVIVE_BYTES", 1ull << 30);
  uint64_t per, versions[MAX_NAMES], got_v;
  gpupool_client *p = NULL, *r = NULL, *n = NULL;
  gpupool_buffer *held[MAX_NAMES] = {0}, *b = NULL;
  char names[MAX_NAMES][32], lost[4][GPUPOOL_NAME_MAX + 1];
  size_t free_before;
  uint64_t t0, t_first = 0;
  int nn, rc = 1, e, nlost = 0;
  pid_t child, child2;

  nn = (int)((total + NAME_MAX_BYTES - 1) / NAME_MAX_BYTES);
  if (nn < 4)
    nn = 4;
  if (nn > MAX_NAMES)
    return FAILF("GPUPOOL_TEST_SURVIVE_BYTES=%" PRIu64 " needs more than %d names", total, MAX_NAMES);
  per = total / (uint64_t)nn / 4 * 4;
  free_before = free_mem();
  if (connect_pair("survive", &p, &r) != 0)
    goto out;
  for (int i = 0; i < nn; i++) {
    snprintf(names[i], sizeof names[i], "survive/%d", i);
    if (publish(p, names[i], (size_t)per, 1000u + (uint32_t)i, s, &versions[i]) != 0)
      goto out;
  }
  /* Name 0 at version 2: the restarted daemon must go on from there. */
  if (publish(p, names[0], (size_t)per, 2000u, s, &versions[0]) != 0)
    goto out;
  if (versions[0] != 2) {
    FAILF("a second publish of %s made version %" PRIu64 ", not 2", names[0], versions[0]);
    goto out;
  }
  for (int i = 0; i < nn; i++) {
    if ((e = gpupool_buffer_get(r, names[i], 0, 0, GPUPOOL_READ_ONLY, s, &held[i], &got_v)) < 0) {
      gp_fail("the reader's gpupool_buffer_get", e);
      goto out;
    }
    if (verify("the reader, before the crash", held[i], (size_t)per, i ? 1000u + (uint32_t)i : 2000u, s) != 0)
      goto out;
  }
  if (cudaStreamSynchronize(s) != cudaSuccess) {
    cu_fail("cudaStreamSynchronize", cudaGetLastError());
    goto out;
  }
  /* The state is written at most every few ms (GPUPOOL_TEST_STATE_EVERY_MS): let the last
   * publish and the reader's holds reach the store, as a crash a moment later would find them. */
  gh_sleep_ms(300);
  child = ts_child_of(D.pid);
  if (!child) {
    FAILF("the supervisor runs no daemon");
    goto out;
  }
  t0 = gh_now_ns();
  if (kill(child, SIGKILL) != 0) {
    FAILF("kill -9 of the daemon failed");
    goto out;
  }
  /* Down or coming back: the reader's mappings do not depend on the daemon. */
  for (int i = 0; i < nn; i++)
    if (verify("the reader, daemon killed", held[i], (size_t)per, i ? 1000u + (uint32_t)i : 2000u, s) != 0)
      goto out;
  if (!(child2 = gh_wait_restarted(&D, child, 60000))) {
    FAILF("the supervisor did not start the daemon again within 60 s");
    goto out;
  }
  if ((e = gpupool_client_connect(D.sock, "survive-new", GPUPOOL_TIMEOUT_DEFAULT, &n)) < 0) {
    gp_fail("connecting to the restarted daemon", e);
    goto out;
  }
  for (int i = 0; i < nn; i++) {
    if ((e = gpupool_buffer_get(n, names[i], 0, 0, GPUPOOL_READ_ONLY, s, &b, &got_v)) < 0) {
      gp_fail("a get from the restarted daemon (the name did not survive)", e);
      goto out;
    }
    if (i == 0)
      t_first = gh_now_ns();
    if (got_v != versions[i]) {
      FAILF("%s came back at version %" PRIu64 ", not %" PRIu64, names[i], got_v, versions[i]);
      goto out;
    }
    if (verify("a new client after the restart", b, (size_t)per, i ? 1000u + (uint32_t)i : 2000u, s) != 0)
      goto out;
    (void)gpupool_buffer_release(b, s);
    b = NULL;
  }
  printf("INFO: %d names, %" PRIu64 " bytes: from the kill to the first get served by the new daemon %.1f ms\n", nn,
         per * (uint64_t)nn, (double)(t_first - t0) / 1e6);
  if (reader_back(r) != 0)
    goto out;
  if ((e = gpupool_client_lost_names(p, lost, 4, &nlost)) < 0) {
    gp_fail("gpupool_client_lost_names", e);
    goto out;
  }
  if (nlost) {
    FAILF("the producer lost %d name(s) across the restart, the first %s", nlost, lost[0]);
    goto out;
  }
  for (int i = 0; i < nn; i++)
    if (gpupool_buffer_lost(held[i])) {
      FAILF("the reader's hold on %s was lost across the restart", names[i]);
      goto out;
    }
  if (publish(p, names[0], (size_t)per, 3000u, s, &got_v) != 0)
    goto out;
  if (got_v != 3) {
    FAILF("publishing %s after the restart made version %" PRIu64 ", not 3", names[0], got_v);
    goto out;
  }
  if (verify("the reader's hold on the old version after a new one", held[0], (size_t)per, 2000u, s) != 0)
    goto out;
  for (int i = 0; i < nn; i++) {
    (void)gpupool_buffer_release(held[i], s);
    held[i] = NULL;
    if (unpublish(p, names[i]) != 0)
      goto out;
  }
  rc = check_empty(n, free_before, s);
  (void)child2;
out:
  if (b)
    (void)gpupool_buffer_release(b, s);
  for (int i = 0; i < MAX_NAMES; i++)
    if (held[i])
      (void)gpupool_buffer_release(held[i], s);
  if (n)
    gpupool_client_disconnect(n);
  if (r)
    gpupool_client_disconnect(r);
  if (p)
    gpupool_client_disconnect(p);
  return rc;
}

#define NMEM 8

/* A bundle of NMEM members, each filled with seed + its index, made and published as name. */
static int publish_bundle(gpupool_client *c, const char *name, uint64_t member, uint32_t seed, cudaStream_t s,
                          uint64_t *v) {
  gpupool_member_spec spec[NMEM];
  char names[NMEM][16];
  gpupool_bundle *b = NULL;
  int rc, ce;
  for (int k = 0; k < NMEM; k++) {
    snprintf(names[k], sizeof names[k], "layer.%d", k);
    spec[k] = (gpupool_member_spec){.name = names[k], .size = member, .meta = NULL};
  }
  if ((rc = gpupool_bundle_alloc(c, POOL, spec, NMEM, 0, 0, s, &b)) < 0)
    return gp_fail("gpupool_bundle_alloc in the survive=yes pool", rc);
  for (int k = 0; k < NMEM; k++) {
    gpupool_member m;
    if ((rc = gpupool_bundle_member(b, k, &m)) < 0 || (ce = gk_fill(m.ptr, (size_t)member, seed + (uint32_t)k, s)) != 0) {
      (void)gpupool_bundle_release(b, s);
      return rc < 0 ? gp_fail("gpupool_bundle_member", rc) : cu_fail("fill kernel", (cudaError_t)ce);
    }
  }
  rc = gpupool_bundle_publish(b, name, s, v);
  (void)gpupool_bundle_release(b, s);
  return rc < 0 ? gp_fail("gpupool_bundle_publish", rc) : 0;
}

static int verify_bundle(const char *what, gpupool_bundle *b, uint64_t member, uint32_t seed, cudaStream_t s) {
  if (gpupool_bundle_count(b) != NMEM)
    return FAILF("%s: the bundle has %d members, not %d", what, gpupool_bundle_count(b), NMEM);
  for (int k = 0; k < NMEM; k++) {
    gpupool_member m;
    int rc = gpupool_bundle_member(b, k, &m);
    unsigned long long bad = 0;
    int ce;
    if (rc < 0)
      return gp_fail("gpupool_bundle_member", rc);
    if (m.size != member)
      return FAILF("%s: member %d has %llu bytes, not %llu", what, k, (unsigned long long)m.size,
                   (unsigned long long)member);
    if ((ce = gk_count_mismatches(m.ptr, (size_t)member, seed + (uint32_t)k, s, &bad)) != 0)
      return cu_fail(what, (cudaError_t)ce);
    if (bad)
      return FAILF("%s: member %d: %llu of %llu words differ from the pattern written", what, k, bad,
                   (unsigned long long)member / 4);
  }
  return 0;
}

/* The same as crash with one bundle of NMEM members holding all the bytes (a model's weights
 * as one version): at version 2 before the crash, read by a reader that keeps it, the same
 * version after, 3 next. */
static int check_bundle(cudaStream_t s) {
  uint64_t total = env_u64("GPUPOOL_TEST_SURVIVE_BYTES", 1ull << 30), member = total / NMEM / 4 * 4, v = 0;
  gpupool_client *p = NULL, *r = NULL, *n = NULL;
  gpupool_bundle *held = NULL, *b = NULL;
  size_t free_before = free_mem();
  uint64_t t0, t_first;
  pid_t child;
  int rc = 1, e;

  if (connect_pair("bundle", &p, &r) != 0)
    goto out;
  if (publish_bundle(p, "survive/weights", member, 100, s, &v) != 0 ||
      publish_bundle(p, "survive/weights", member, 200, s, &v) != 0)
    goto out;
  if (v != 2) {
    FAILF("the second publish of the bundle made version %" PRIu64, v);
    goto out;
  }
  if ((e = gpupool_bundle_get(r, "survive/weights", 0, 0, GPUPOOL_READ_ONLY, s, &held)) < 0) {
    gp_fail("the reader's gpupool_bundle_get", e);
    goto out;
  }
  if (verify_bundle("the reader, before the crash", held, member, 200, s) != 0)
    goto out;
  (void)cudaStreamSynchronize(s);
  gh_sleep_ms(300); /* the state reaches the store */
  if (!(child = ts_child_of(D.pid)) || kill(child, SIGKILL) != 0) {
    FAILF("kill -9 of the daemon failed");
    goto out;
  }
  t0 = gh_now_ns();
  if (verify_bundle("the reader, daemon killed", held, member, 200, s) != 0)
    goto out;
  if (!gh_wait_restarted(&D, child, 60000)) {
    FAILF("the supervisor did not start the daemon again within 60 s");
    goto out;
  }
  if ((e = gpupool_client_connect(D.sock, "bundle-new", GPUPOOL_TIMEOUT_DEFAULT, &n)) < 0 ||
      (e = gpupool_bundle_get(n, "survive/weights", 0, 0, GPUPOOL_READ_ONLY, s, &b)) < 0) {
    gp_fail("a bundle get from the restarted daemon", e);
    goto out;
  }
  t_first = gh_now_ns();
  if (gpupool_bundle_version(b) != 2) {
    FAILF("the bundle came back at version %" PRIu64 ", not 2", gpupool_bundle_version(b));
    goto out;
  }
  if (verify_bundle("a new client after the restart", b, member, 200, s) != 0)
    goto out;
  printf("INFO: a bundle of %d members, %" PRIu64 " bytes: from the kill to the first get served %.1f ms\n", NMEM,
         member * NMEM, (double)(t_first - t0) / 1e6);
  (void)gpupool_bundle_release(b, s);
  b = NULL;
  if (reader_back(r) != 0)
    goto out;
  for (int i = 0; i < gpupool_bundle_buffers(held); i++)
    if (gpupool_buffer_lost(gpupool_bundle_buffer(held, i))) {
      FAILF("the reader's hold on buffer %d of the bundle was lost across the restart", i);
      goto out;
    }
  if (publish_bundle(p, "survive/weights", member, 300, s, &v) != 0)
    goto out;
  if (v != 3) {
    FAILF("publishing the bundle after the restart made version %" PRIu64 ", not 3", v);
    goto out;
  }
  if (verify_bundle("the reader's version 2 after version 3", held, member, 200, s) != 0)
    goto out;
  (void)gpupool_bundle_release(held, s);
  held = NULL;
  if (unpublish(p, "survive/weights") != 0)
    goto out;
  rc = check_empty(n, free_before, s);
out:
  if (b)
    (void)gpupool_bundle_release(b, s);
  if (held)
    (void)gpupool_bundle_release(held, s);
  if (n)
    gpupool_client_disconnect(n);
  if (r)
    gpupool_client_disconnect(r);
  if (p)
    gpupool_client_disconnect(p);
  return rc;
}

static int check_cycles(cudaStream_t s) {
  const size_t bytes = 256u << 20;
  gpupool_client *p = NULL, *r = NULL;
  gpupool_buffer *held = NULL, *b = NULL;
  uint64_t v = 0, last = 0, got_v = 0;
  size_t free_before = free_mem();
  int rc = 1, e;

  if (connect_pair("cycles", &p, &r) != 0)
    goto out;
  for (int cyc = 0; cyc < 20; cyc++) {
    pid_t child = ts_child_of(D.pid);
    if (publish(p, "cycle", bytes, 500u + (uint32_t)cyc, s, &v) != 0)
      goto out;
    if (v <= last) {
      FAILF("cycle %d: publish made version %" PRIu64 " after %" PRIu64 ": versions went back", cyc, v, last);
      goto out;
    }
    last = v;
    if (held)
      (void)gpupool_buffer_release(held, s);
    held = NULL;
    if ((e = gpupool_buffer_get(r, "cycle", 0, 0, GPUPOOL_READ_ONLY, s, &held, &got_v)) < 0) {
      gp_fail("the reader's get", e);
      goto out;
    }
    (void)cudaStreamSynchronize(s);
    gh_sleep_ms(100); /* the state reaches the store (see check_crash) */
    if (!child || !crash(child)) {
      FAILF("cycle %d: the supervisor did not start the daemon again", cyc);
      goto out;
    }
    if ((e = gpupool_buffer_get(p, "cycle", 0, 0, GPUPOOL_READ_ONLY, s, &b, &got_v)) < 0) {
      gp_fail("a get after the restart", e);
      goto out;
    }
    if (got_v != v) {
      FAILF("cycle %d: the name came back at version %" PRIu64 ", not %" PRIu64, cyc, got_v, v);
      goto out;
    }
    if (verify("after a restart", b, bytes, 500u + (uint32_t)cyc, s) != 0 ||
        verify("the reader's hold across the restart", held, bytes, 500u + (uint32_t)cyc, s) != 0)
      goto out;
    (void)gpupool_buffer_release(b, s);
    b = NULL;
  }
  if (reader_back(r) != 0)
    goto out;
  if (gpupool_buffer_lost(held)) {
    FAILF("the reader's hold did not come back after the last restart");
    goto out;
  }
  (void)gpupool_buffer_release(held, s);
  held = NULL;
  if (unpublish(p, "cycle") != 0)
    goto out;
  rc = check_empty(p, free_before, s);
out:
  if (b)
    (void)gpupool_buffer_release(b, s);
  if (held)
    (void)gpupool_buffer_release(held, s);
  if (r)
    gpupool_client_disconnect(r);
  if (p)
    gpupool_client_disconnect(p);
  return rc;
}

int main(int argc, char **argv) {
  char conf[512];
  cudaStream_t s = NULL;
  const char *check;
  uint64_t total;
  int rc, st;

  gh_driver_start(argc, argv, 3, "GPUPOOLD crash|bundle|cycles", 1, "a CUDA GPU");
  check = argv[2];
  if (strcmp(check, "crash") && strcmp(check, "bundle") && strcmp(check, "cycles")) {
    fprintf(stderr, "unknown check %s (crash, bundle, cycles)\n", check);
    return 2;
  }
  total = env_u64("GPUPOOL_TEST_SURVIVE_BYTES", 1ull << 30);
  /* Restart at once after each crash (the supervisor backs off otherwise), and write the
   * state often so a crash right after a publish finds it stored. */
  setenv("GPUPOOL_SUPERVISE_MAX_DELAY_MS", "50", 1);
  setenv("GPUPOOL_TEST_STATE_EVERY_MS", "5", 0);
  host = getenv("GPUPOOL_TEST_SURVIVE_KIND") && !strcmp(getenv("GPUPOOL_TEST_SURVIVE_KIND"), "host-numa");
  snprintf(conf, sizeof conf,
           "[pool keep]\nkind = %s\ndevice = 0\nsurvive = yes\ncapacity = %" PRIu64 "\nslab_size = 256M\n"
           "keep_slabs = 0\n",
           host ? "host-numa\nnuma = 0" : "device", (uint64_t)(total * 3 + (1ull << 30)));
  if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    return gh_verdict(1, check, "cannot make a stream on GPU 0");
  if (gh_daemon_start_supervised(&D, argv[1], conf) != 0) {
    if (host) {
      printf("SKIP: gpupoold did not start with a survive=yes host-NUMA pool on GPU 0 (see its log above)\n");
      return GH_SKIP;
    }
    return gh_verdict(1, check, "gpupoold --supervise did not start with a survive=yes pool");
  }
  rc = !strcmp(check, "crash") ? check_crash(s) : !strcmp(check, "bundle") ? check_bundle(s) : check_cycles(s);
  st = gh_daemon_stop(&D, rc != 0);
  if (rc == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
    return gh_verdict(1, check, "gpupoold --supervise did not exit cleanly on SIGTERM (wait status %d)", st);
  return gh_verdict(rc, check, "%s", rc ? why : "names, versions and memory of a survive=yes pool outlived kill -9");
}
