/*
 * GPU check of peers with device memory: two gpupoolds (CUDA backend) on this machine peer
 * over 127.0.0.1 (UCX as the environment sets it: the caller passes UCX_TLS=tcp or
 * tcp,cuda_copy, so UCX stays on the network path), each with a device pool (A on GPU 0, B on
 * GPU 1, or both on GPU 0 with one GPU). A buffer and a bundle (BYTES in all, half each; the
 * bundle of four members) are filled by a kernel behind a 300 ms spin and published on A
 * without synchronizing (the serving side's copies must wait for the producer's ready event);
 * B's client gets them as A:NAME, and a kernel on B's GPU counts mismatching words. Then the
 * buffer is published again and fetched warm (UCX connected, staging slots made). Prints each
 * fetch's throughput (bytes / time of the get, which includes the fetch), the daemons'
 * "peers:" log lines (how device memory moves, the transports, each fetch), and one PASS or FAIL
 * line.
 *
 * Then (device pools only) the kills: B is killed in the middle of fetching a 2 GiB buffer, and A
 * must let go of the serve and of every staging chunk (gpupoolctl peers: serving_now and
 * staging_in_use back to 0); a restarted B fetches it bit-exact (its throughput printed); then
 * A is killed in the middle of B fetching a new version of it, and B must be back where it
 * was (its pool's used bytes, no staging in use, no fetch in flight); a restarted A serves a
 * new name to B bit-exact. GPUPOOL_PEERS_KILL=0 leaves the kills out.
 *
 * GPUPOOL_PEERS_HOST=1 runs the same fetches between two daemons with the host backend and
 * host pools (filled and checked on the CPU): the network path without staging, the
 * reference the staged figures are read against.
 *
 *   gpupool_gpu_peers GPUPOOLD          (GPUPOOL_PEERS_BYTES=N overrides 1 GiB)
 *
 * Exit status 0 pass, 1 fail, 77 skip (no GPU, or gpupoold built without UCX).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_driver.h"
#include "gpu_harness.h"
#include "gpu_kernels.h"
#include "gpu_worker.h"
#include "gpupool/gpupool.h"

#define CHECK "peers_device"
#define STEP_MS 120000
#define fail(...) gh_verdict(1, CHECK, __VA_ARGS__)

static int free_port(void) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM, 0), port = -1;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0)
    close(fd);
  return port;
}

static int g_host; /* GPUPOOL_PEERS_HOST: host backend and host pools, CPU fill and check */

static void conf_of(char *out, size_t len, int port, const char *secret, int device, const char *peer, int peer_port) {
  char pool[128];
  if (g_host)
    snprintf(pool, sizeof pool, "[pool gpu]\nkind = host\ncapacity = 12G\nslab_size = 1G\n");
  else
    snprintf(pool, sizeof pool, "[pool gpu]\nkind = device\ndevice = %d\ncapacity = 12G\nslab_size = 1G\n", device);
  snprintf(out, len,
           "[daemon]\npeer_listen = 127.0.0.1:%d\npeer_secret_file = %s\npeer_fetch_timeout_ms = 120000\n%s"
           "[tenant t]\nuids = %u\nexport_peers = *\n[peer %s]\naddress = 127.0.0.1:%d\n",
           port, secret, pool, (unsigned)getuid(), peer, peer_port);
}

static int start(gh_daemon *d, const char *gpupoold, const char *conf) {
  ts_daemon_opts o = {.gpupoold = gpupoold, .backend = "host", .log_level = "info", .use_conf = 1,
                      .ready_ms = 60000, .poll_ms = 20};
  if (!g_host)
    return gh_daemon_start_conf(d, gpupoold, NULL, conf);
  return gh_daemon_start_opts(d, &o, conf);
}

/* Host mode: fill or check bytes at p (CPU memory) with seed's pattern; mismatching words. */
static unsigned long long cpu_pattern(void *p, size_t bytes, uint32_t seed, int check) {
  uint32_t *w = p;
  unsigned long long bad = 0;
  for (size_t i = 0; i < bytes / 4; i++) {
    uint32_t x = gk_pattern(i, seed);
    if (!check)
      w[i] = x;
    else if (w[i] != x)
      bad++;
  }
  return bad;
}

static int fill(void *p, size_t bytes, uint32_t seed, cudaStream_t s) {
  if (!g_host)
    return gk_fill(p, bytes, seed, s);
  cpu_pattern(p, bytes, seed, 0);
  return 0;
}

/* The daemon's "peers:" lines (and the copy engine's), to stdout. */
static void print_peer_lines(const gh_daemon *d, const char *who) {
  FILE *f = fopen(d->log, "r");
  char line[2048];
  if (!f)
    return;
  while (fgets(line, sizeof line, f))
    if (strstr(line, "peers:") || strstr(line, "UCX") || strstr(line, "error"))
      printf("  %s| %s", who, line);
  fclose(f);
}

static double secs(uint64_t a, uint64_t b) { return (double)(b - a) / 1e9; }

/* Get name on B (newer than newer), count mismatches against seeds (one per member). */
static int fetch_check(gpupool_client *c, const char *name, uint64_t newer, int dev, cudaStream_t s,
                       const uint32_t *seeds, int nseeds, size_t bytes, const char *label) {
  gpupool_bundle *g = NULL;
  unsigned long long bad = 0, n;
  uint64_t t0 = gh_now_ns(), t1;
  int rc, ce;
  if ((rc = gpupool_bundle_get(c, name, newer, STEP_MS, 0, s, &g)) < 0)
    return fail("get %s on B: %s (%s)", name, gpupool_err_name(rc), gpupool_last_error());
  t1 = gh_now_ns();
  if (gpupool_bundle_count(g) != nseeds) {
    gpupool_bundle_release(g, s);
    return fail("%s has %d members, %d expected", name, gpupool_bundle_count(g), nseeds);
  }
  for (int i = 0; i < gpupool_bundle_buffers(g) && !g_host; i++)
    if (gpupool_buffer_device(gpupool_bundle_buffer(g, i)) != dev ||
        gpupool_buffer_kind(gpupool_bundle_buffer(g, i)) != GPUPOOL_MEM_DEVICE) {
      gpupool_bundle_release(g, s);
      return fail("%s: buffer %d of the fetched copy is not device memory of GPU %d", name, i, dev);
    }
  for (int i = 0; i < nseeds; i++) {
    gpupool_member m;
    gpupool_bundle_member(g, i, &m);
    if (g_host)
      n = cpu_pattern(m.ptr, m.size, seeds[i], 1);
    else if ((ce = gk_count_mismatches(m.ptr, m.size, seeds[i], s, &n)))
      cdie("driver", "mismatch kernel", ce);
    bad += n;
  }
  gpupool_bundle_release(g, g_host ? NULL : s);
  if (!g_host)
    cudaStreamSynchronize(s);
  printf("fetch %-28s %10zu bytes in %8.3f s = %6.2f GB/s, mismatching words: %llu\n", label, bytes, secs(t0, t1),
         (double)bytes / secs(t0, t1) / 1e9, bad);
  return bad ? fail("%s: %llu words differ on B", name, bad) : 0;
}

/* A number of `gpupoolctl --json peers` of d (the daemon's, or its one peer's): -1 when
 * unreadable. */
static long long ctl_num(const char *ctl, const gh_daemon *d, const char *key) {
  char cmd[1024], buf[16384], k[64];
  const char *at;
  size_t n;
  FILE *p;
  snprintf(cmd, sizeof cmd, "%s --socket %s --json peers", ctl, d->sock);
  if (!(p = popen(cmd, "r")))
    return -1;
  n = fread(buf, 1, sizeof buf - 1, p);
  pclose(p);
  buf[n] = '\0';
  snprintf(k, sizeof k, "\"%s\":", key);
  return (at = strstr(buf, k)) ? strtoll(at + strlen(k), NULL, 10) : -1;
}

/* Wait (15 s at most) until both numbers of d are 0: the ms it took, or -1. */
static long wait_zero(const char *ctl, const gh_daemon *d, const char *k1, const char *k2) {
  uint64_t t0 = gh_now_ns();
  while (gh_now_ns() - t0 < 15000000000ull) {
    if (ctl_num(ctl, d, k1) == 0 && ctl_num(ctl, d, k2) == 0)
      return (long)((gh_now_ns() - t0) / 1000000);
    gh_sleep_ms(20);
  }
  fprintf(stderr, "%s: %s = %lld, %s = %lld\n", d->sock, k1, ctl_num(ctl, d, k1), k2, ctl_num(ctl, d, k2));
  return -1;
}

/* A child that SIGKILLs pid after ms (only async-signal-safe calls: the parent uses CUDA). */
static pid_t kill_later(pid_t pid, int ms) {
  pid_t k = fork();
  if (k == 0) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    _exit(0);
  }
  return k;
}

/* Publish `bytes` of seed's pattern as name on c (GPU 0), synchronized. */
static int publish_dev(gpupool_client *c, const char *name, size_t bytes, uint32_t seed, cudaStream_t s) {
  gpupool_buffer *b;
  int rc;
  cudaSetDevice(0);
  if ((rc = gpupool_buffer_alloc(c, "gpu", bytes, 10000, s, &b)) < 0)
    return fail("alloc of %zu bytes on A: %s", bytes, gpupool_last_error());
  wfill_publish("driver", b, bytes, seed, 0, name, s);
  gpupool_buffer_release(b, s);
  cudaStreamSynchronize(s);
  return 0;
}

/* The daemon d was SIGKILLed: reap it and remove its dir. */
static void reap(gh_daemon *d) {
  ts_wait_pid(d->pid, 10000, 1, NULL);
  d->pid = 0;
  ts_daemon_remove(d);
}

static int kill_checks(const char *gpupoold, const char *ctl, gh_daemon *A, gh_daemon *B, const char *confa,
                       const char *confb, gpupool_client **ca, gpupool_client **cb, cudaStream_t sa, cudaStream_t sb,
                       int dev_b, uint32_t seed) {
  const size_t big = (size_t)2 << 30;
  gpupool_bundle *g = NULL;
  gpupool_pool_stats ps;
  uint64_t used0 = 0, got = 0;
  uint32_t seeds[1];
  pid_t k;
  long ms;
  int rc;

  /* The fetching daemon dies mid-fetch. */
  if ((rc = publish_dev(*ca, "big", big, seed + 11, sa)) != 0)
    return rc;
  cudaSetDevice(dev_b);
  k = kill_later(B->pid, 250);
  rc = gpupool_bundle_get(*cb, "A:big", 0, STEP_MS, 0, sb, &g);
  ts_wait_pid(k, 5000, 1, NULL);
  if (rc == 0) {
    gpupool_bundle_release(g, sb);
    return fail("the 2 GiB fetch ended within 250 ms, before B was killed: the kill was not checked");
  }
  reap(B);
  gpupool_client_disconnect(*cb);
  *cb = NULL;
  if ((ms = wait_zero(ctl, A, "serving_now", "staging_in_use")) < 0)
    return fail("A still serves B or holds staging chunks 15 s after B was killed mid-fetch");
  printf("kill of the fetching daemon mid-fetch: A let go of the serve and its staging in %ld ms\n", ms);
  if (start(B, gpupoold, confb) < 0)
    return fail("B did not start again");
  if ((rc = gpupool_client_connect(B->sock, "gpu-peers-getter", GPUPOOL_TIMEOUT_DEFAULT, cb)) < 0)
    return fail("connect to the restarted B: %s", gpupool_last_error());
  seeds[0] = seed + 11;
  if ((rc = fetch_check(*cb, "A:big", 0, dev_b, sb, seeds, 1, big, "2 GiB, restarted B")) != 0)
    return rc;

  /* The serving daemon dies mid-fetch. */
  if (gh_pool_stats(*cb, "gpu", &ps, NULL) < 0)
    return fail("cannot read B's pool");
  used0 = ps.used;
  if ((rc = publish_dev(*ca, "big", big, seed + 12, sa)) != 0)
    return rc;
  cudaSetDevice(dev_b);
  k = kill_later(A->pid, 250);
  rc = gpupool_bundle_get(*cb, "A:big", 1, STEP_MS, 0, sb, &g);
  ts_wait_pid(k, 5000, 1, NULL);
  if (rc == 0) {
    gpupool_bundle_release(g, sb);
    return fail("the 2 GiB fetch ended within 250 ms, before A was killed: the kill was not checked");
  }
  printf("kill of the serving daemon mid-fetch: B's get failed with %s (%s)\n", gpupool_err_name(rc),
         gpupool_last_error());
  reap(A);
  gpupool_client_disconnect(*ca);
  *ca = NULL;
  if ((ms = wait_zero(ctl, B, "staging_in_use", "fetches_in_flight")) < 0)
    return fail("B holds staging chunks or a fetch 15 s after A was killed mid-fetch");
  if (gh_wait_used(*cb, "gpu", used0, 15000, &got) < 0)
    return fail("B's pool uses %" PRIu64 " bytes after the failed fetch, %" PRIu64 " before", got, used0);
  printf("kill of the serving daemon mid-fetch: B back to its staging and pool usage in %ld ms\n", ms);
  if (start(A, gpupoold, confa) < 0)
    return fail("A did not start again");
  if ((rc = gpupool_client_connect(A->sock, "gpu-peers-producer", GPUPOOL_TIMEOUT_DEFAULT, ca)) < 0)
    return fail("connect to the restarted A: %s", gpupool_last_error());
  if ((rc = publish_dev(*ca, "again", (size_t)64 << 20, seed + 13, sa)) != 0)
    return rc;
  cudaSetDevice(dev_b);
  seeds[0] = seed + 13;
  return fetch_check(*cb, "A:again", 0, dev_b, sb, seeds, 1, (size_t)64 << 20, "64 MiB, restarted A");
}

int main(int argc, char **argv) {
  gh_daemon A, B;
  char dir[] = "/tmp/gpupool-peers.XXXXXX", secret[256], confa[2048], confb[2048], cmd[1024], out[256] = "";
  const char *env = getenv("GPUPOOL_PEERS_BYTES");
  size_t total = env ? (size_t)strtoull(env, NULL, 0) : (size_t)1 << 30, half, quarter;
  int ngpu, dev_b, pa, pb, rc = 0, ce;
  gpupool_client *ca = NULL, *cb = NULL;
  cudaStream_t sa, sb;
  uint32_t seed = (uint32_t)time(NULL) ^ ((uint32_t)getpid() << 8), seeds[4];
  FILE *f, *p;

  g_host = getenv("GPUPOOL_PEERS_HOST") && strcmp(getenv("GPUPOOL_PEERS_HOST"), "0") != 0;
  ngpu = gh_driver_start(argc, argv, 2, "GPUPOOLD", 1, "peers need a GPU");
  snprintf(cmd, sizeof cmd, "%s --version", argv[1]);
  if ((p = popen(cmd, "r"))) {
    while (fgets(out, sizeof out, p))
      if (!strncmp(out, "peers: ", 7))
        break;
    pclose(p);
  }
  if (strncmp(out, "peers: ucx", 10) != 0) {
    printf("SKIP: gpupoold %s", out[0] ? out : "says nothing about peers\n");
    return GH_SKIP;
  }
  printf("gpupoold %s", out);
  half = (total / 2) & ~(size_t)4095;
  quarter = (half / 4) & ~(size_t)4095;
  dev_b = ngpu > 1 ? 1 : 0;
  if (g_host)
    printf("UCX_TLS=%s, host backend and host pools on both sides (reference), %zu bytes\n",
           getenv("UCX_TLS") ? getenv("UCX_TLS") : "(default)", half + 4 * quarter);
  else
    printf("UCX_TLS=%s, A on GPU 0, B on GPU %d, %zu bytes\n", getenv("UCX_TLS") ? getenv("UCX_TLS") : "(default)",
           dev_b, half + 4 * quarter);
  if (!mkdtemp(dir))
    return fail("mkdtemp: %s", strerror(errno));
  snprintf(secret, sizeof secret, "%s/secret", dir);
  if (!(f = fopen(secret, "w")))
    return fail("cannot write %s", secret);
  fputs("gpu-peers-check-secret-0123456789", f);
  fclose(f);
  chmod(secret, 0600);
  pa = free_port();
  pb = free_port();
  conf_of(confa, sizeof confa, pa, secret, 0, "B", pb);
  conf_of(confb, sizeof confb, pb, secret, dev_b, "A", pa);
  if (start(&A, argv[1], confa) < 0)
    return fail("daemon A did not start");
  if (start(&B, argv[1], confb) < 0) {
    gh_daemon_stop(&A, 1);
    return fail("daemon B did not start");
  }
  sa = g_host ? NULL : wstream("driver", 0);
  sb = g_host ? NULL : wstream("driver", dev_b);
  if ((rc = gpupool_client_connect(A.sock, "gpu-peers-producer", GPUPOOL_TIMEOUT_DEFAULT, &ca)) < 0 ||
      (rc = gpupool_client_connect(B.sock, "gpu-peers-getter", GPUPOOL_TIMEOUT_DEFAULT, &cb)) < 0) {
    rc = fail("connect: %s", gpupool_last_error());
    goto out;
  }
  {
    /* A buffer and a bundle of four members on A, filled behind a spin, not synchronized. */
    gpupool_buffer *b;
    gpupool_bundle *bb;
    gpupool_member_spec spec[4] = {{"m0", quarter, NULL}, {"m1", quarter, NULL}, {"m2", quarter, NULL},
                                   {"m3", quarter, NULL}};
    if (!g_host)
      cudaSetDevice(0);
    if ((rc = gpupool_buffer_alloc(ca, "gpu", half, 10000, sa, &b)) < 0) {
      rc = fail("alloc on A: %s", gpupool_last_error());
      goto out;
    }
    if (g_host) {
      fill(gpupool_buffer_ptr(b), half, seed, sa);
      gpupool_buffer_publish(b, "buf", NULL, NULL, NULL);
    } else {
      wfill_publish("driver", b, half, seed, 300000, "buf", sa);
    }
    gpupool_buffer_release(b, sa);
    if ((rc = gpupool_bundle_alloc(ca, "gpu", spec, 4, 0, 10000, sa, &bb)) < 0) {
      rc = fail("bundle alloc on A: %s", gpupool_last_error());
      goto out;
    }
    if (!g_host && (ce = gk_spin(sa, 300000)))
      cdie("driver", "spin kernel", ce);
    for (int i = 0; i < 4; i++) {
      gpupool_member m;
      gpupool_bundle_member(bb, i, &m);
      if ((ce = fill(m.ptr, m.size, seed + 1 + (uint32_t)i, sa)))
        cdie("driver", "fill kernel", ce);
    }
    if ((rc = gpupool_bundle_publish(bb, "model", sa, NULL)) < 0) {
      rc = fail("bundle publish on A: %s", gpupool_last_error());
      goto out;
    }
    gpupool_bundle_release(bb, sa);
  }
  if (!g_host)
    cudaSetDevice(dev_b);
  seeds[0] = seed;
  if ((rc = fetch_check(cb, "A:buf", 0, dev_b, sb, seeds, 1, half, "buffer (cold)")) != 0)
    goto out;
  for (int i = 0; i < 4; i++)
    seeds[i] = seed + 1 + (uint32_t)i;
  if ((rc = fetch_check(cb, "A:model", 0, dev_b, sb, seeds, 4, 4 * quarter, "bundle of 4 members")) != 0)
    goto out;
  {
    gpupool_buffer *b;
    if (!g_host)
      cudaSetDevice(0);
    if ((rc = gpupool_buffer_alloc(ca, "gpu", half, 10000, sa, &b)) < 0) {
      rc = fail("alloc on A: %s", gpupool_last_error());
      goto out;
    }
    if (g_host) {
      fill(gpupool_buffer_ptr(b), half, seed + 7, sa);
      gpupool_buffer_publish(b, "buf", NULL, NULL, NULL);
    } else {
      wfill_publish("driver", b, half, seed + 7, 0, "buf", sa);
    }
    gpupool_buffer_release(b, sa);
    if (!g_host)
      cudaStreamSynchronize(sa);
  }
  if (!g_host)
    cudaSetDevice(dev_b);
  seeds[0] = seed + 7;
  if ((rc = fetch_check(cb, "A:buf", 1, dev_b, sb, seeds, 1, half, "buffer v2 (warm)")) != 0)
    goto out;
  if (!g_host && !(getenv("GPUPOOL_PEERS_KILL") && !strcmp(getenv("GPUPOOL_PEERS_KILL"), "0"))) {
    char ctl[1024], *slash;
    snprintf(ctl, sizeof ctl, "%s", argv[1]);
    /* BUILD/daemon/gpupoold -> BUILD/tools/gpupoolctl */
    if ((slash = strrchr(ctl, '/')))
      *slash = '\0';
    if ((slash = strrchr(ctl, '/')))
      snprintf(slash, sizeof ctl - (size_t)(slash - ctl), "/tools/gpupoolctl");
    if (access(ctl, X_OK) != 0) {
      rc = fail("no gpupoolctl at %s (build it next to gpupoold)", ctl);
      goto out;
    }
    if ((rc = kill_checks(argv[1], ctl, &A, &B, confa, confb, &ca, &cb, sa, sb, dev_b, seed)) != 0)
      goto out;
  }
  rc = 0;
out:
  if (ca)
    gpupool_client_disconnect(ca);
  if (cb)
    gpupool_client_disconnect(cb);
  if (A.pid)
    print_peer_lines(&A, "A");
  if (B.pid)
    print_peer_lines(&B, "B");
  if (B.pid)
    gh_daemon_stop(&B, rc != 0);
  if (A.pid)
    gh_daemon_stop(&A, rc != 0);
  unlink(secret);
  rmdir(dir);
  if (rc)
    return rc;
  if (g_host)
    return gh_verdict(0, CHECK, "reference: a buffer and a 4-member bundle in host pools (host backend) fetched "
                      "over UCX_TLS=%s, bit-exact, cold and warm", getenv("UCX_TLS") ? getenv("UCX_TLS") : "(default)");
  return gh_verdict(0, CHECK, "a buffer and a 4-member bundle in device memory fetched from daemon A (GPU 0) into "
                    "daemon B's device pool (GPU %d) over UCX_TLS=%s, bit-exact, cold and warm; each side killed "
                    "mid-fetch left nothing behind on the other", dev_b,
                    getenv("UCX_TLS") ? getenv("UCX_TLS") : "(default)");
}
