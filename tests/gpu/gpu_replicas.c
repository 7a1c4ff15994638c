/*
 * GPU check of replicas: a version on GPU 0 got on GPU 1 (GPUPOOL_ON_DEVICE(1)) is a replica
 * in GPU 1's pool, filled by the daemon's CUDA copy engine, bit-exact, made once however many
 * getters ask, and freed with its version.
 *
 *   gpupool_gpu_replicas GPUPOOLD CHECK
 *
 * CHECK is one of
 *   buffer   a 64 MiB buffer, one getter on GPU 1
 *   bundle   a bundle of 3 members (one buffer), one getter on GPU 1
 *   getters  a 256 MiB buffer, 8 getters on GPU 1 at once: every one bit-exact, all holding
 *            the same replica buffer (one copy), GPU 1's pool holding one replica
 *   staged   as buffer with GPUPOOL_NO_PEER=1 in the daemon's environment: the copy engine
 *            ignores peer access and stages through pinned host memory
 * Each ends with the producer unpublishing: both pools' used bytes must return to where they
 * started (the replica goes with its version).
 *
 * Workers are this executable re-executed with "worker ROLE ...". Prints one "PASS: ..." or
 * "FAIL: ..." line. Exit status 0 pass, 1 fail, 77 skip (fewer than 2 GPUs). Runs only with a
 * CUDA backend whose copy engine is in (copy_start); otherwise the first get fails with
 * GPUPOOL_ENOTSUP and the check says so.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_driver.h"
#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpu_worker.h"
#include "gpupool/gpupool.h"

#define POOLS_CONF                                                                          \
  "[pool gpu0]\nkind = device\ndevice = 0\ncapacity = 2G\nslab_size = 256M\n"               \
  "[pool gpu1]\nkind = device\ndevice = 1\ncapacity = 2G\nslab_size = 256M\n"
#define STEP_MS 120000
#define MAX_GETTERS 8

/* ------------------------------------------------------------------ worker side */

/* producer SOCK NAME SEED BYTES KIND: publishes in gpu0 (a buffer, or a bundle of three
 * members each BYTES/4 bytes, member i filled with SEED+i), says PUBLISHED <buffer id>, waits
 * for EXIT, unpublishes, says DONE. */
static int w_producer(char **a) {
  const char *role = "producer", *sock = a[0], *name = a[1];
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  size_t bytes = (size_t)strtoull(a[3], NULL, 0);
  int bundle = !strcmp(a[4], "bundle");
  cudaStream_t s = wstream(role, 0);
  gpupool_client *c;
  uint64_t id;
  int rc, ce;

  if ((rc = gpupool_client_connect(sock, "gpu-replicas-producer", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie(role, "gpupool_client_connect", rc);
  if (!bundle) {
    gpupool_buffer *b;
    if ((rc = gpupool_buffer_alloc(c, "gpu0", bytes, 10000, s, &b)) < 0)
      wdie(role, "gpupool_buffer_alloc", rc);
    wfill_publish(role, b, bytes, seed, 0, name, s);
    id = gpupool_buffer_id(b);
    if ((rc = gpupool_buffer_release(b, s)) < 0)
      wdie(role, "gpupool_buffer_release", rc);
  } else {
    gpupool_member_spec spec[3] = {{"a", bytes / 4, NULL}, {"b", bytes / 4, NULL}, {"c", bytes / 4, NULL}};
    gpupool_bundle *b;
    gpupool_member m;
    if ((rc = gpupool_bundle_alloc(c, "gpu0", spec, 3, 0, 10000, s, &b)) < 0)
      wdie(role, "gpupool_bundle_alloc", rc);
    for (int i = 0; i < 3; i++) {
      gpupool_bundle_member(b, i, &m);
      if ((ce = gk_fill(m.ptr, m.size, seed + (uint32_t)i, s)))
        cdie(role, "fill kernel", ce);
    }
    if ((rc = gpupool_bundle_publish(b, name, s, NULL)) < 0)
      wdie(role, "gpupool_bundle_publish", rc);
    id = gpupool_buffer_id(gpupool_bundle_buffer(b, 0));
    if ((rc = gpupool_bundle_release(b, s)) < 0)
      wdie(role, "gpupool_bundle_release", rc);
  }
  gh_say("PUBLISHED %" PRIu64, id);
  wait_stdin_line(role, "EXIT");
  if ((rc = gpupool_name_unpublish(c, name)) < 0)
    wdie(role, "gpupool_name_unpublish", rc);
  wfinish(role, c, s);
  gh_say("DONE");
  return 0;
}

/* getter SOCK NAME SEED BYTES KIND: gets NAME on GPU 1, checks every buffer is on device 1,
 * counts mismatching words in a kernel on GPU 1, says RESULT <mismatches> <buffer id>. */
static int w_getter(char **a) {
  const char *role = "getter", *sock = a[0], *name = a[1];
  uint32_t seed = (uint32_t)strtoul(a[2], NULL, 0);
  size_t bytes = (size_t)strtoull(a[3], NULL, 0);
  int bundle = !strcmp(a[4], "bundle");
  cudaStream_t s = wstream(role, 1);
  unsigned long long bad = 0, n;
  gpupool_client *c;
  uint64_t id;
  int rc, ce;

  if ((rc = gpupool_client_connect(sock, "gpu-replicas-getter", GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0)
    wdie(role, "gpupool_client_connect", rc);
  if (!bundle) {
    gpupool_buffer *b;
    if ((rc = gpupool_buffer_get(c, name, 0, STEP_MS, GPUPOOL_READ_ONLY | GPUPOOL_ON_DEVICE(1), s, &b, NULL)) < 0)
      wdie(role, "gpupool_buffer_get on device 1", rc);
    if (gpupool_buffer_device(b) != 1 || gpupool_buffer_kind(b) != GPUPOOL_MEM_DEVICE) {
      fprintf(stderr, "worker getter: the buffer got on device 1 is on device %d\n", gpupool_buffer_device(b));
      return 1;
    }
    if ((ce = gk_count_mismatches(gpupool_buffer_ptr(b), bytes, seed, s, &bad)))
      cdie(role, "mismatch kernel", ce);
    id = gpupool_buffer_id(b);
    if ((rc = gpupool_buffer_release(b, s)) < 0)
      wdie(role, "gpupool_buffer_release", rc);
  } else {
    gpupool_bundle *b;
    gpupool_member m;
    if ((rc = gpupool_bundle_get(c, name, 0, STEP_MS, GPUPOOL_READ_ONLY | GPUPOOL_ON_DEVICE(1), s, &b)) < 0)
      wdie(role, "gpupool_bundle_get on device 1", rc);
    for (int i = 0; i < gpupool_bundle_buffers(b); i++)
      if (gpupool_buffer_device(gpupool_bundle_buffer(b, i)) != 1) {
        fprintf(stderr, "worker getter: buffer %d of the bundle is on device %d\n", i,
                gpupool_buffer_device(gpupool_bundle_buffer(b, i)));
        return 1;
      }
    for (int i = 0; i < 3; i++) {
      gpupool_bundle_member(b, i, &m);
      if ((ce = gk_count_mismatches(m.ptr, m.size, seed + (uint32_t)i, s, &n)))
        cdie(role, "mismatch kernel", ce);
      bad += n;
    }
    id = gpupool_buffer_id(gpupool_bundle_buffer(b, 0));
    if ((rc = gpupool_bundle_release(b, s)) < 0)
      wdie(role, "gpupool_bundle_release", rc);
  }
  wfinish(role, c, s);
  gh_say("RESULT %llu %" PRIu64, bad, id);
  return bad ? 1 : 0;
}

static int worker_main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc - 3 != 5) {
    fprintf(stderr, "worker %s: %d arguments, expected 5\n", argv[2], argc - 3);
    return 2;
  }
  if (!strcmp(argv[2], "producer"))
    return w_producer(argv + 3);
  if (!strcmp(argv[2], "getter"))
    return w_getter(argv + 3);
  fprintf(stderr, "unknown worker role %s\n", argv[2]);
  return 2;
}

/* ------------------------------------------------------------------ driver side */

static const char *g_check;
static size_t g_bytes;
static int g_getters;
static const char *g_kind;

#define fail(...) gh_verdict(1, g_check, __VA_ARGS__)

static int spawn(gh_proc *p, const char *role, const gh_daemon *d, const char *name, uint32_t seed) {
  char sd[32], by[32];
  snprintf(sd, sizeof sd, "%u", seed);
  snprintf(by, sizeof by, "%zu", g_bytes);
  const char *argv[] = {"", "worker", role, d->sock, name, sd, by, g_kind, NULL};
  return gh_spawn(p, argv, NULL, 0);
}

static int check_replicas(const gh_daemon *d, gpupool_client *c) {
  gpupool_pool_stats p0, p1;
  gh_proc prod, get[MAX_GETTERS];
  char name[64], line[256];
  uint64_t src_id, rep_id = 0, used1 = 0, got = 0;
  uint32_t seed = (uint32_t)time(NULL) ^ ((uint32_t)getpid() << 8);
  int rc = 0;

  if (gh_pool_stats(c, "gpu0", &p0, NULL) < 0 || gh_pool_stats(c, "gpu1", &p1, NULL) < 0)
    return fail("cannot read the pools' stats");
  snprintf(name, sizeof name, "replicas-%08x", seed);
  if (spawn(&prod, "producer", d, name, seed) < 0)
    return fail("cannot start the producer");
  if (gh_expect(&prod, "PUBLISHED", line, sizeof line, STEP_MS) < 0) {
    gh_wait(&prod, 5000);
    return fail("the producer did not publish (see its stderr above)");
  }
  src_id = strtoull(line + strlen("PUBLISHED "), NULL, 10);
  for (int i = 0; i < g_getters; i++)
    if (spawn(&get[i], "getter", d, name, seed) < 0)
      return fail("cannot start getter %d", i);
  for (int i = 0; i < g_getters; i++) {
    uint64_t id;
    if (gh_expect(&get[i], "RESULT", line, sizeof line, STEP_MS) < 0) {
      rc = fail("getter %d reported no result (see its stderr above)", i);
      continue;
    }
    if (strncmp(line, "RESULT 0 ", 9) != 0) {
      rc = fail("getter %d read wrong data on GPU 1: %s (mismatching words, replica id)", i, line + 7);
      continue;
    }
    id = strtoull(line + 9, NULL, 10);
    if (id == src_id)
      rc = fail("getter %d got the source buffer %" PRIu64 " itself, not a replica on GPU 1", i, id);
    else if (rep_id && id != rep_id)
      rc = fail("getters hold replicas %" PRIu64 " and %" PRIu64 ": more than one copy was made", rep_id, id);
    rep_id = id;
  }
  for (int i = 0; i < g_getters; i++)
    if (gh_wait(&get[i], rc ? 5000 : STEP_MS) != 0 && rc == 0)
      rc = fail("getter %d failed", i);
  if (rc == 0) {
    /* A bundle's three members of BYTES/4 each lie in one buffer of 3/4 BYTES. */
    size_t rep_bytes = strcmp(g_kind, "bundle") ? g_bytes : g_bytes / 4 * 3;
    gpupool_pool_stats now;
    if (gh_pool_stats(c, "gpu1", &now, NULL) < 0)
      rc = fail("cannot read gpu1's stats");
    else if ((used1 = now.used - p1.used) < rep_bytes || used1 >= 2 * rep_bytes)
      rc = fail("gpu1 holds %" PRIu64 " bytes more than before, expected one replica of %zu", used1, rep_bytes);
  }
  gh_writeline(&prod, "EXIT");
  if (gh_expect(&prod, "DONE", line, sizeof line, STEP_MS) < 0 && rc == 0)
    rc = fail("the producer did not unpublish (see its stderr above)");
  if (gh_wait(&prod, STEP_MS) != 0 && rc == 0)
    rc = fail("the producer failed");
  if (rc)
    return rc;
  if (gh_wait_used(c, "gpu1", p1.used, 20000, &got) < 0)
    return fail("gpu1 uses %" PRIu64 " bytes after the version went, %" PRIu64 " before: the replica stayed",
                got, p1.used);
  if (gh_wait_used(c, "gpu0", p0.used, 20000, &got) < 0)
    return fail("gpu0 uses %" PRIu64 " bytes after the version went, %" PRIu64 " before", got, p0.used);
  return gh_verdict(0, g_check, "%s of %zu bytes on GPU 0 got on GPU 1 by %d getter(s): bit-exact, one "
                    "replica (%" PRIu64 " bytes in gpu1), freed with its version; pools back to where they "
                    "started%s", g_kind, g_bytes, g_getters, used1, getenv("GPUPOOL_NO_PEER") ? " (staged: GPUPOOL_NO_PEER=1)" : "");
}

int main(int argc, char **argv) {
  gh_daemon d;
  char check[64];

  if (argc >= 3 && !strcmp(argv[1], "worker"))
    return worker_main(argc, argv);
  gh_driver_start(argc, argv, 3, "GPUPOOLD CHECK", 2, "replicas need a second GPU");
  g_kind = "buffer";
  g_bytes = 64u << 20;
  g_getters = 1;
  if (!strcmp(argv[2], "bundle")) {
    g_kind = "bundle";
  } else if (!strcmp(argv[2], "getters")) {
    g_bytes = 256u << 20;
    g_getters = MAX_GETTERS;
  } else if (!strcmp(argv[2], "staged")) {
    setenv("GPUPOOL_NO_PEER", "1", 1); /* read by the CUDA copy engine: no peer access */
  } else if (strcmp(argv[2], "buffer") != 0) {
    fprintf(stderr, "unknown check %s (buffer, bundle, getters, staged)\n", argv[2]);
    return 2;
  }
  snprintf(check, sizeof check, "replicas_%s", argv[2]);
  g_check = check;
  if (gh_daemon_start_conf(&d, argv[1], NULL, POOLS_CONF) < 0)
    return fail("gpupoold did not start with a pool on each of GPUs 0 and 1");
  return gh_run_on_daemon(&d, check, "gpu-replicas-driver", check_replicas);
}
