/*
 * Fairness benchmark: how much one uid's flood raises another uid's latency. The goal it
 * measures: one uid cannot raise another's allocate+release p99 by more than 5x while it stays
 * within its limits.
 *
 *   gpupool_fairness_bench GPUPOOLD [--seconds S] [--quick] [--modes idle,wake,...]
 *                                   [--flooders N] [--members N] [--repeat N] [--nice N]
 *                                   [--keep-logs]
 *
 * Run as root. For each mode it starts its own gpupoold (host backend, a private socket in a
 * temp dir reachable by uid 65534, every limit at its default) and a victim (root, in this
 * process) that times allocate+release round trips of 4 KiB for S seconds (default 3) with
 * no flood (the mode's idle baseline: the load of a shared machine drifts, so each flood is
 * compared with an idle time on the same daemon seconds before), then again for S seconds
 * while flooders (forked copies of this process that drop to uid 65534) flood the daemon:
 *
 *   idle    no flooder: the machine's reference;
 *   limits  256 connections (max_clients_per_uid) in N processes (--flooders; default one
 *           per CPU, 2 to 8: more would measure the kernel's scheduler) sending every kind of
 *           request in turn (allocate/release, waiting gets, stats, publish, share/open,
 *           bundles, files, refused requests, connection churn), after filling the uid's
 *           names and a client's holds up to their limits (as far as 5 s of set-up allows);
 *   wake    4,096 gets parked with newer_than past any version (max_waiters_per_uid), then
 *           publishes of that name pipelined 16 deep: each publish wakes every waiter;
 *   frames  2 connections sending 1 MiB frames of ~349,000 unknown fields back to back;
 *   hash    AllocateBundle of 65,000 member names (a 910 KB frame) whose unseeded FNV-1a
 *           hashes share the low bits the daemon's uniqueness check indexes by, repeated;
 *   files   publish_file / get_file / unpublish loops (2 processes);
 *   batches kept Shares (with an Idle question), Opens by a connection that then closes, and
 *           Idle requests, of 1024 buffers each (max_share_batch; 2 processes).
 *
 * --repeat N runs each mode N times and shows the run of median ratio with the range of all;
 * --nice N sets the priority that the daemon, the victim and the flooders all inherit (on a
 * machine shared with other work, a negative N keeps that work out of the figures without
 * favouring either side).
 *
 * A flooder counts what the daemon answered (ok), what it refused (an error reply) and how
 * often it had to connect again (a dropped connection, or a connection refused): a daemon
 * that refuses a flood is measured the same way, since the point is the victim's latency. A
 * victim round trip stuck past S + 30 s is cut short by killing that daemon (the mode then
 * says "stalled"). A round trip already in flight when the S seconds end is waited for, so a
 * mode can take longer than S (hash: one bundle takes the daemon seconds). Every child is
 * killed at the end of its mode.
 *
 * Prints one row per mode (victim round trips, p50, p99, max, the idle p99 and the ratio of
 * p99 to it, flooder counts), whether each ratio meets the 5x goal, and "BENCH key value" lines. Exits 1 only
 * when a mode could not be run (the daemon did not start, a flooder never got going, the
 * victim measured nothing); never because of a figure. --quick runs every mode once, briefly
 * (the ctest entry uses it to check that the benchmark runs).
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpupool/gpupool.h"
#include "daemon.h"
#include "frames.h"
#include "wire.h"

#define NOBODY TS_NOBODY
#define MAX_FLOODERS 64
#define MAX_REPEAT 15
/* The goal: another uid's flood raises the victim's p99 at most this many times. */
#define GOAL_RATIO 5.0

/* What the flooders report, in memory shared with them (they are killed, not asked to stop). */
typedef struct {
  atomic_uint_fast64_t sent;       /* requests sent (answered or not) */
  atomic_uint_fast64_t ok;         /* requests the daemon answered without an error */
  atomic_uint_fast64_t refused;    /* requests answered with an error */
  atomic_uint_fast64_t reconnects; /* connections made again after a drop or a refused connect */
  atomic_uint_fast64_t ready;      /* flooder processes done with their set-up */
  atomic_uint_fast64_t names;      /* limits: names held through the flood */
  atomic_uint_fast64_t holds;      /* limits: holds of one client kept through the flood */
} flood_counts;

typedef struct {
  double seconds;       /* victim's measuring time per mode */
  int quick;
  int flooders;         /* processes of the limits mode */
  int members;          /* members of the hash mode's bundle */
  double setup_s;       /* most time the limits mode spends filling names and holds */
  int keep_logs;
  int repeat;           /* runs of each mode; the row shown is the one of median ratio */
  ts_daemon d;          /* dir (0711), socket and config of every mode's daemon */
  char file[300];       /* what the files mode publishes */
  const char *gpupoold;
} bench;

typedef struct mode mode;
struct mode {
  const char *name;
  const char *what;
  int (*procs)(const bench *b); /* flooder processes (0: none) */
  void (*flood)(const bench *b, int idx, int nprocs);
};

/* The victim's round trips over one measuring time. */
typedef struct {
  size_t n;
  double p50, p99, max; /* us */
  int stalled;          /* a round trip was cut short by the watchdog (max: how long it had waited) */
  int errors;           /* requests refused (other than by the stall) */
} lat;

typedef struct {
  lat base;             /* with no flood, on the same daemon, just before the flood */
  lat v;                /* during the flood */
  uint64_t sent, ok, refused, reconnects;
  uint64_t names, holds; /* limits: what the flooder held through its flood */
  int ran;              /* 0: the mode could not be run (see why) */
  char why[400];
} result;

static flood_counts *counts;
static volatile pid_t daemon_pid;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "gpupool_fairness_bench (pid %d): ", (int)getpid());
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  exit(1);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* How many times the flood raised the victim's p99 over its idle p99. */
static double ratio(const result *r) { return r->v.p99 / r->base.p99; }

static int cmp_ratio(const void *a, const void *b) {
  double x = ratio(a), y = ratio(b);
  return x < y ? -1 : x > y;
}

/* ---- flooder helpers (run as uid 65534) --------------------------------------------------- */

/* The answer to a request already counted as sent. */
static void answered(int rc) {
  if (rc == 0)
    atomic_fetch_add(&counts->ok, 1);
  else
    atomic_fetch_add(&counts->refused, 1);
}

/* A synchronous request: sent and answered. */
static void count(int rc) {
  atomic_fetch_add(&counts->sent, 1);
  answered(rc);
}

/* The daemon hung up on this connection (or the connection is unusable). */
static int dropped(int rc) {
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO || rc == GPUPOOL_EPROTO || rc == GPUPOOL_ECONNECT;
}

/* A library connection that does not reconnect on its own: the flooder does it and counts it. */
static gpupool_client *fl_connect(const bench *b) {
  gpupool_client *c = NULL;
  if (gpupool_client_connect(b->d.sock, "flood", 10000, &c) != 0)
    return NULL;
  gpupool_client_set_reconnect(c, 0);
  return c;
}

/* Replace *c after a drop (or a failed connect); NULL while the daemon refuses. */
static void fl_reconnect(const bench *b, gpupool_client **c) {
  gpupool_client_disconnect(*c);
  atomic_fetch_add(&counts->reconnects, 1);
  if (!(*c = fl_connect(b)))
    sleep_ms(1); /* refused: try again later without spinning on the accept queue */
}

static void ready(void) { atomic_fetch_add(&counts->ready, 1); }

/* A raw connection that has said Hello, or -1. */
static int raw_hello(const bench *b, int timeout_s) {
  return ts_raw_session(b->d.sock, timeout_s, "flood-raw", getpid());
}

/* Ready once, after the first try whatever came of it: a daemon that refuses the flood (drops
 * the connection at a frame's header, refuses the connection) is measured too. */
static void ready_once(int *first) {
  if (*first) {
    *first = 0;
    ready();
  }
}

/* Raw frames sent over and over on one connection, connecting again whenever the daemon
 * drops it (a refusal, counted); ready once the daemon has the first frame. close_each: a new
 * connection for every frame, so that what a frame was given goes with its connection. */
static void raw_loop(const bench *b, const uint8_t *frame, size_t len, int close_each) {
  int fd = -1, first = 1;
  for (;;) {
    gpupool__rep *rep;
    int got = 0, out;
    if (fd < 0 && (fd = raw_hello(b, 120)) < 0) {
      atomic_fetch_add(&counts->reconnects, 1);
      ready_once(&first);
      sleep_ms(1);
      continue;
    }
    out = gpupool__wire_send(fd, frame, len, NULL, 0) == 0;
    ready_once(&first);
    if (out) {
      atomic_fetch_add(&counts->sent, 1);
      if ((rep = ts_raw_recv(fd))) {
        got = 1;
        answered(rep->error ? rep->error->code : 0);
        gpupool__wire__reply__free_unpacked(rep, NULL);
        if (!close_each)
          continue;
      }
    }
    close(fd);
    fd = -1;
    if (!got) {
      atomic_fetch_add(&counts->refused, 1);
      atomic_fetch_add(&counts->reconnects, 1);
    }
  }
}

/* ---- limits: every kind of request, up to the uid's limits ------------------------------ */

typedef struct {
  gpupool_client *c;
  gpupool_buffer *b; /* a buffer this connection holds, for publish and share */
} fl_conn;

static void limits_op(const bench *b, fl_conn *k, unsigned op, unsigned serial) {
  gpupool_buffer *x = NULL;
  gpupool_token tok;
  gpupool_file *f;
  gpupool_bundle *bu;
  char name[64];
  int rc = 0;
  if (!k->c) {
    fl_reconnect(b, &k->c);
    return;
  }
  if (!k->b) {
    count(rc = gpupool_buffer_alloc(k->c, NULL, 4096, 0, NULL, &k->b));
    if (rc != 0)
      k->b = NULL;
    goto out;
  }
  snprintf(name, sizeof name, "limits/%d/%u", (int)getpid(), serial % 64);
  switch (op % 10) {
  case 0: /* allocate + release */
    count(rc = gpupool_buffer_alloc(k->c, NULL, 4096, 0, NULL, &x));
    if (rc == 0)
      count(rc = gpupool_buffer_release(x, NULL));
    break;
  case 1: /* a get that waits for a name nobody publishes, then times out */
    count(rc = gpupool_buffer_get(k->c, "limits/never", 0, 1, 0, NULL, &x, NULL));
    if (rc == 0)
      gpupool_buffer_release(x, NULL);
    else if (rc == GPUPOOL_ETIMEDOUT || rc == GPUPOOL_ENOENT)
      rc = 0;
    break;
  case 2: {
    gpupool_daemon_stats st;
    gpupool_pool_stats ps[4];
    int np;
    count(rc = gpupool_client_stats(k->c, &st, ps, 4, &np));
    break;
  }
  case 3: /* publish, get, unpublish (refused once the uid's names are at their limit) */
    count(rc = gpupool_buffer_publish(k->b, name, NULL, NULL, NULL));
    if (rc == 0) {
      count(rc = gpupool_buffer_get(k->c, name, 0, 0, GPUPOOL_READ_ONLY, NULL, &x, NULL));
      if (rc == 0)
        gpupool_buffer_release(x, NULL);
      count(rc = gpupool_name_unpublish(k->c, name));
    }
    break;
  case 4: /* share, open, release */
    count(rc = gpupool_buffer_share(k->b, NULL, &tok));
    if (rc == 0) {
      count(rc = gpupool_buffer_open(k->c, &tok, 0, NULL, &x));
      if (rc == 0)
        count(rc = gpupool_buffer_release(x, NULL));
    }
    break;
  case 5: { /* a small bundle */
    gpupool_member_spec ms[8];
    char mn[8][8];
    for (int i = 0; i < 8; i++) {
      snprintf(mn[i], sizeof mn[i], "m%d", i);
      ms[i].name = mn[i];
      ms[i].size = 64;
      ms[i].meta = NULL;
    }
    count(rc = gpupool_bundle_alloc(k->c, NULL, ms, 8, 0, 0, NULL, &bu));
    if (rc == 0)
      count(rc = gpupool_bundle_release(bu, NULL));
    break;
  }
  case 6: /* a file: publish, get, unpublish */
    count(rc = gpupool_file_publish(k->c, name, b->file, 0, 0, NULL));
    if (rc == 0) {
      count(rc = gpupool_file_get(k->c, name, 0, GPUPOOL_FILE_HOST_ONLY, &f));
      if (rc == 0)
        gpupool_file_release(f);
      count(rc = gpupool_name_unpublish(k->c, name));
    }
    break;
  case 7: { /* refused by design: a member alignment that is not a power of two */
    gpupool_member_spec bad = {.name = "limits/odd", .size = 4096};
    count(rc = gpupool_bundle_alloc(k->c, NULL, &bad, 1, 3, 0, NULL, &bu));
    if (rc == 0)
      gpupool_bundle_release(bu, NULL);
    break;
  }
  case 8: /* a get of a bundle name nobody publishes, at once */
    count(rc = gpupool_bundle_get(k->c, "limits/none", 0, 0, 0, NULL, &bu));
    if (rc == 0)
      gpupool_bundle_release(bu, NULL);
    break;
  default: /* connection churn: the uid's connection slots turn over */
    gpupool_client_disconnect(k->c);
    k->b = NULL;
    if (!(k->c = fl_connect(b)))
      atomic_fetch_add(&counts->reconnects, 1);
    return;
  }
out:
  if (dropped(rc)) {
    k->b = NULL;
    fl_reconnect(b, &k->c);
  }
}

/* Fill the uid's names (max_names_per_uid) and one client's holds (max_holds_per_client), as
 * far as the set-up time allows: state the daemon must carry while it serves the victim. */
static void limits_fill(const bench *b, fl_conn *conns, int n) {
  uint64_t end = now_ns() + (uint64_t)(b->setup_s * 1e9);
  gpupool_buffer *x;
  gpupool_token tok;
  char name[64];
  if (n < 2 || !conns[0].b)
    return;
  for (int i = 0; i < 100000 && now_ns() < end; i++) {
    snprintf(name, sizeof name, "limits/held/%d", i);
    if (gpupool_buffer_publish(conns[0].b, name, NULL, NULL, NULL) != 0)
      break;
    count(0);
    atomic_fetch_add(&counts->names, 1);
  }
  if (gpupool_buffer_share(conns[0].b, NULL, &tok) == 0)
    while (now_ns() < end && gpupool_buffer_open(conns[1].c, &tok, 0, NULL, &x) == 0) {
      count(0);
      atomic_fetch_add(&counts->holds, 1);
    }
}

static int limits_procs(const bench *b) { return b->flooders; }

static void limits_flood(const bench *b, int idx, int nprocs) {
  /* max_clients_per_uid (256) connections across the processes. */
  int n = 256 / nprocs, nc = 0;
  fl_conn *conns = calloc((size_t)n, sizeof *conns);
  unsigned op = (unsigned)idx, serial = 0;
  if (!conns)
    _exit(3);
  for (; nc < n; nc++) {
    if (!(conns[nc].c = fl_connect(b)))
      break;
    if (gpupool_buffer_alloc(conns[nc].c, NULL, 4096, 0, NULL, &conns[nc].b) != 0)
      conns[nc].b = NULL;
  }
  if (nc == 0)
    _exit(4);
  if (idx == 0)
    limits_fill(b, conns, nc);
  ready();
  for (;;)
    for (int k = 0; k < nc; k++)
      limits_op(b, &conns[k], op++, serial++);
}

/* ---- wake: parked gets that every publish wakes ----------------------------------------- */

#define WAKE_WAITERS 4096     /* max_waiters_per_uid */
#define WAKE_PER_CONN 1024    /* max_waiters_per_client */
#define WAKE_DEPTH 16         /* publishes in flight */

static int one_proc(const bench *b) { return 1; }

/* After a drop: the publishes still in flight are ended (the library wants every pending
 * request ended before its client goes), then the publisher connects again. */
static void wake_reconnect(const bench *b, gpupool_client **pc, gpupool_pending **pub) {
  for (int i = 0; i < WAKE_DEPTH; i++)
    if (pub[i]) {
      gpupool_pending_cancel(pub[i]);
      pub[i] = NULL;
    }
  fl_reconnect(b, pc);
}

static void wake_flood(const bench *b, int idx, int nprocs) {
  gpupool_client *w[WAKE_WAITERS / WAKE_PER_CONN], *pc = NULL;
  gpupool_pending *pub[WAKE_DEPTH] = {0};
  gpupool_buffer *buf = NULL;
  unsigned head = 0;
  int is_ready = 0;
  /* The waiters: gets of "wake" newer than any version it will reach, with a long timeout, so
   * that they stay parked while every publish wakes and re-parks them all. */
  for (int k = 0; k < WAKE_WAITERS / WAKE_PER_CONN; k++) {
    if (!(w[k] = fl_connect(b)))
      continue;
    for (int i = 0; i < WAKE_PER_CONN; i++) {
      gpupool_pending *p;
      /* Sent only: the answer comes when it times out (or at once if refused). */
      if (gpupool_buffer_get_begin(w[k], "wake", UINT64_C(1) << 60, 600000, 0, &p) != 0)
        break;
      atomic_fetch_add(&counts->sent, 1);
    }
  }
  for (;;) {
    if (!pc || !buf) {
      if (!pc && !(pc = fl_connect(b))) {
        atomic_fetch_add(&counts->reconnects, 1);
        sleep_ms(1);
        continue;
      }
      if (gpupool_buffer_alloc(pc, NULL, 4096, 0, NULL, &buf) != 0) {
        buf = NULL;
        wake_reconnect(b, &pc, pub);
        continue;
      }
    }
    /* Keep WAKE_DEPTH publishes in flight: end the oldest, begin the next. */
    if (pub[head % WAKE_DEPTH]) {
      int rc = gpupool_pending_end(pub[head % WAKE_DEPTH], NULL);
      pub[head % WAKE_DEPTH] = NULL;
      answered(rc);
      if (!is_ready) { /* answered, refused or dropped: the flood is under way */
        is_ready = 1;
        ready();
      }
      if (dropped(rc)) {
        buf = NULL;
        wake_reconnect(b, &pc, pub);
        continue;
      }
    }
    atomic_fetch_add(&counts->sent, 1);
    if (gpupool_buffer_publish_begin(buf, "wake", NULL, NULL, &pub[head % WAKE_DEPTH]) != 0) {
      pub[head % WAKE_DEPTH] = NULL;
      atomic_fetch_add(&counts->refused, 1);
      buf = NULL;
      wake_reconnect(b, &pc, pub);
      continue;
    }
    head++;
  }
}

/* ---- frames: 1 MiB of unknown fields ------------------------------------------------------ */

static int two_procs(const bench *b) { return 2; }

/* A Stats request followed by unknown fields (number 1000, varint 0: three bytes each) up to
 * just under the daemon's default max_frame: valid protobuf that the daemon must unpack. */
static uint8_t *unknown_fields_frame(size_t *len) {
  const size_t payload_max = GPUPOOL_WIRE_DEFAULT_MAX_FRAME - 16;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  uint8_t *packed, *frame;
  size_t plen, n;
  req.seq = 1;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  if (gpupool__wire_pack_request(&req, &packed, &plen) != 0)
    die("packing a Stats request failed");
  n = plen - GPUPOOL_WIRE_HDR;
  if (!(frame = malloc(GPUPOOL_WIRE_HDR + payload_max)))
    die("out of memory");
  memcpy(frame, packed, plen);
  free(packed);
  while (n + 3 <= payload_max) {
    uint8_t *p = frame + GPUPOOL_WIRE_HDR + n;
    p[0] = 0xc0; /* tag (1000 << 3 | varint) = 8000 as a varint: 0xc0 0x3e */
    p[1] = 0x3e;
    p[2] = 0x00;
    n += 3;
  }
  for (int i = 0; i < 4; i++)
    frame[i] = (uint8_t)(n >> (8 * i));
  *len = GPUPOOL_WIRE_HDR + n;
  return frame;
}

static void frames_flood(const bench *b, int idx, int nprocs) {
  size_t len;
  uint8_t *frame = unknown_fields_frame(&len);
  raw_loop(b, frame, len, 0);
}

/* ---- hash: member names whose hashes collide ---------------------------------------------- */

#define FNV_OFFSET UINT64_C(1469598103934665603)
#define FNV_PRIME UINT64_C(1099511628211)

static uint64_t fnv1a(uint64_t h, const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    h = (h ^ (uint8_t)s[i]) * FNV_PRIME;
  return h;
}

/* n distinct 8-byte printable names whose FNV-1a hashes are equal in their low bits: as many
 * bits as the open-addressing table of a uniqueness check over n names has slots (the smallest
 * power of two >= 2n, at least 16), so that every name lands on one chain. The low k bits of
 * an FNV-1a step depend only on the low k bits of the state and the byte, and the prime is odd
 * (invertible mod 2^k): the last two bytes are found backwards from the target, the third
 * last by trying each character after a distinct 5-byte prefix. names: n * 9 bytes. */
static void colliding_names(size_t n, char *names) {
  char alpha[96];
  size_t na = 0, done = 0;
  uint64_t cap = 16, mask, inv = FNV_PRIME, j = 0;
  uint16_t *back;
  for (int ch = 0x21; ch < 0x7f; ch++)
    if (ch != '/' && ch != ':' && ch != '\\')
      alpha[na++] = (char)ch;
  while (cap < 2 * n)
    cap *= 2;
  mask = cap - 1;
  for (int i = 0; i < 6; i++) /* Newton: inv = FNV_PRIME^-1 mod 2^64 */
    inv *= 2 - FNV_PRIME * inv;
  if (!(back = calloc(cap, sizeof *back)))
    die("out of memory");
  /* back[h]: the last two bytes (indices into alpha, +1) that take state h to hash 0. */
  for (size_t y = 0; y < na; y++) {
    uint64_t h2 = ((0 * inv) ^ (uint8_t)alpha[y]) & mask;
    for (size_t x = 0; x < na; x++)
      back[((h2 * inv) ^ (uint8_t)alpha[x]) & mask] = (uint16_t)((x + 1) << 8 | (y + 1));
  }
  while (done < n) {
    char *s = names + done * 9;
    uint64_t h, v = j++;
    for (int i = 0; i < 5; i++, v /= na)
      s[i] = alpha[v % na];
    h = fnv1a(FNV_OFFSET, s, 5);
    for (size_t c = 0; c < na; c++) {
      uint16_t t = back[((h ^ (uint8_t)alpha[c]) * FNV_PRIME) & mask];
      if (t) {
        s[5] = alpha[c];
        s[6] = alpha[(t >> 8) - 1];
        s[7] = alpha[(t & 0xff) - 1];
        s[8] = 0;
        if ((fnv1a(FNV_OFFSET, s, 8) & mask) != 0)
          die("colliding name '%s' does not collide: the construction is wrong", s);
        done++;
        break;
      }
    }
  }
  free(back);
}

static void hash_flood(const bench *b, int idx, int nprocs) {
  size_t n = (size_t)b->members, len;
  char *names = malloc(n * 9);
  Gpupool__Wire__MemberSpec *specs = calloc(n, sizeof *specs), **sp = calloc(n, sizeof *sp);
  Gpupool__Wire__AllocateBundle ab = GPUPOOL__WIRE__ALLOCATE_BUNDLE__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  uint8_t *frame;
  if (!names || !specs || !sp)
    _exit(3);
  colliding_names(n, names);
  for (size_t i = 0; i < n; i++) {
    gpupool__wire__member_spec__init(&specs[i]);
    specs[i].name = names + i * 9;
    specs[i].size = 1;
    sp[i] = &specs[i];
  }
  ab.pool_name = "default";
  ab.n_members = n;
  ab.members = sp;
  req.seq = 1;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE;
  req.allocate_bundle = &ab;
  if (gpupool__wire_pack_request(&req, &frame, &len) != 0)
    _exit(5);
  /* A new connection each time: the bundle it may be given goes with it. */
  raw_loop(b, frame, len, 1);
}

/* ---- files: publish, get and unpublish files ---------------------------------------------- */

static void files_flood(const bench *b, int idx, int nprocs) {
  gpupool_client *c = fl_connect(b);
  char name[64];
  int announced = 0;
  for (unsigned i = 0;; i++) {
    gpupool_file *f;
    int rc;
    if (!c) {
      fl_reconnect(b, &c);
      continue;
    }
    snprintf(name, sizeof name, "files/%d/%u", idx, i % 16);
    count(rc = gpupool_file_publish(c, name, b->file, 0, 0, NULL));
    if (rc == 0) {
      count(rc = gpupool_file_get(c, name, 0, GPUPOOL_FILE_HOST_ONLY, &f));
      if (rc == 0)
        gpupool_file_release(f);
      if (!dropped(rc))
        count(rc = gpupool_name_unpublish(c, name));
    }
    if (!announced) {
      announced = 1;
      ready();
    }
    if (dropped(rc))
      fl_reconnect(b, &c);
  }
}

/* ---- batches: Share, Open and Idle of max_share_batch buffers each ------------------------- */

/* The daemon's default max_share_batch: the most buffers one Share, Open or Idle names. */
#define BATCH 1024

/* What gpupool.torch does per message, at the largest batch the daemon takes: kept shares of
 * 1024 buffers with an Idle question about the same 1024 in one request, an Open of the 1024
 * tokens by a second connection, which then closes (the daemon drops its 1024 holds at once:
 * a receiver that exits), then an Idle request of 1024. */
static void batches_flood(const bench *b, int idx, int nprocs) {
  gpupool_client *c = fl_connect(b), *rx = NULL;
  gpupool_buffer **bufs = calloc(BATCH, sizeof *bufs), **opened = calloc(BATCH, sizeof *opened);
  gpupool_token *tok = calloc(BATCH, sizeof *tok);
  size_t *sizes = calloc(BATCH, sizeof *sizes);
  int *idle = calloc(BATCH, sizeof *idle), have = 0, announced = 0;
  (void)idx;
  (void)nprocs;
  if (!bufs || !opened || !tok || !sizes || !idle)
    _exit(3);
  for (int i = 0; i < BATCH; i++)
    sizes[i] = 4096;
  for (;;) {
    int rc;
    if (!c) {
      fl_reconnect(b, &c);
      have = 0;
      continue;
    }
    if (!have) {
      count(rc = gpupool_buffer_alloc_many(c, NULL, sizes, BATCH, NULL, bufs));
      if (rc != 0) {
        if (dropped(rc))
          fl_reconnect(b, &c);
        else
          sleep_ms(1);
        continue;
      }
      have = 1;
    }
    count(rc = gpupool_buffer_share_kept_many(bufs, BATCH, NULL, tok, bufs, BATCH, idle));
    if (rc == 0 && (rx = fl_connect(b))) {
      int orc;
      count(orc = gpupool_buffer_open_many(rx, tok, BATCH, 0, NULL, opened));
      gpupool_client_disconnect(rx); /* its holds go with it */
      rx = NULL;
    }
    if (rc == 0)
      count(rc = gpupool_buffer_idle_many(bufs, BATCH, idle));
    if (!announced) {
      announced = 1;
      ready();
    }
    if (dropped(rc)) {
      fl_reconnect(b, &c);
      have = 0;
    }
  }
}

static const mode modes[] = {
    {"idle", "no other client", NULL, NULL},
    {"limits", "256 conns, every request kind, names/holds at limits", limits_procs, limits_flood},
    {"wake", "4096 parked newer_than gets + pipelined publishes", one_proc, wake_flood},
    {"frames", "2 conns, 1 MiB frames of unknown fields", two_procs, frames_flood},
    {"hash", "AllocateBundle of colliding member names", one_proc, hash_flood},
    {"files", "publish_file/get_file/unpublish loops", two_procs, files_flood},
    {"batches", "2 procs: Share+Idle, Open (then close), Idle of 1024 buffers", two_procs, batches_flood},
};
#define NMODES (sizeof modes / sizeof modes[0])

/* ---- the daemon, the flooders and the victim ---------------------------------------------- */

static void on_alarm(int sig) {
  (void)sig;
  if (daemon_pid > 0)
    kill(daemon_pid, SIGKILL); /* the victim's request then fails at once */
}

/* Interrupted: the daemon goes now; the flooders follow their parent (PR_SET_PDEATHSIG). */
static void on_stop(int sig) {
  if (daemon_pid > 0)
    kill(daemon_pid, SIGKILL);
  _exit(128 + sig);
}

/* In the daemon's child: it never outlives the benchmark. */
static int die_with_parent(void *arg) {
  (void)arg;
  return prctl(PR_SET_PDEATHSIG, SIGKILL) == 0 ? 0 : -1;
}

/* The mode's daemon on b's socket, its log gpupoold-MODE.log: its pid, or -1. */
static pid_t start_daemon(const bench *b, const char *mode_name) {
  ts_daemon d = b->d;
  ts_daemon_opts o = {.gpupoold = b->gpupoold, .backend = "host", .log_level = "warn",
                      .pool = "name=default,kind=host,capacity=4G,slab=64M", .use_conf = 1,
                      .ready_ms = 5000, .poll_ms = 10, .hook = die_with_parent};
  snprintf(d.log, sizeof d.log, "%s/gpupoold-%s.log", b->d.dir, mode_name);
  unlink(b->d.sock);
  if (ts_daemon_start(&d, &o) != 0) {
    fprintf(stderr, "fairness: %s\n", d.why);
    return -1;
  }
  return d.pid;
}

static void stop_daemon(pid_t pid) {
  int st;
  kill(pid, SIGTERM);
  ts_wait_pid(pid, 2000, 1, &st); /* then SIGKILL: still busy with a flood's request */
}

static pid_t start_flooder(const bench *b, const mode *m, int idx, int nprocs) {
  pid_t parent = getpid(), pid = fork();
  if (pid < 0)
    die("fork: %s", strerror(errno));
  if (pid != 0)
    return pid;
  signal(SIGALRM, SIG_DFL);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  if (ts_become(NOBODY) != 0)
    _exit(2);
  /* After the uid change, which clears it: a flooder never outlives the benchmark. */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent)
    _exit(0);
  m->flood(b, idx, nprocs);
  _exit(0);
}

/* The victim: root's allocate+release round trips for the mode's time. */
static void victim(const bench *b, gpupool_client *c, lat *r) {
  size_t cap = 1u << 21, n = 0;
  uint64_t *t = malloc(cap * sizeof *t), end;
  gpupool_buffer *x;
  int rc;
  if (!t)
    die("out of memory");
  alarm((unsigned)(b->seconds + 30));
  end = now_ns() + (uint64_t)(b->seconds * 1e9);
  while (n < cap && now_ns() < end) {
    uint64_t t0 = now_ns();
    if ((rc = gpupool_buffer_alloc(c, NULL, 4096, 1000, NULL, &x)) == 0)
      rc = gpupool_buffer_release(x, NULL);
    if (rc != 0) {
      if (dropped(rc)) {
        r->stalled = 1;
        r->max = (double)(now_ns() - t0) / 1000.0;
        break;
      }
      r->errors++;
      continue;
    }
    t[n++] = now_ns() - t0;
  }
  alarm(0);
  r->n = n;
  if (n > 0) {
    qsort(t, n, sizeof *t, cmp_u64);
    r->p50 = (double)t[(n - 1) / 2] / 1000.0;
    r->p99 = (double)t[(size_t)((double)(n - 1) * 0.99)] / 1000.0;
    if (!r->stalled) /* else the stuck round trip is the worst one */
      r->max = (double)t[n - 1] / 1000.0;
  }
  free(t);
}

static void run_mode(const bench *b, const mode *m, result *r) {
  pid_t kids[MAX_FLOODERS];
  int nk = 0, nprocs = m->procs ? m->procs(b) : 0;
  gpupool_client *c = NULL;
  gpupool_buffer *x;
  pid_t d;
  memset(r, 0, sizeof *r);
  memset(counts, 0, sizeof *counts);
  if ((d = start_daemon(b, m->name)) < 0) {
    snprintf(r->why, sizeof r->why, "gpupoold did not start (see %s/gpupoold-%s.log)", b->d.dir, m->name);
    return;
  }
  daemon_pid = d;
  if (gpupool_client_connect(b->d.sock, "victim", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0) {
    snprintf(r->why, sizeof r->why, "the victim could not connect: %s", gpupool_last_error());
    goto out;
  }
  gpupool_client_set_reconnect(c, 0);
  for (int i = 0; i < 200; i++) /* warm: the slab gets mapped */
    if (gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &x) == 0)
      gpupool_buffer_release(x, NULL);
  /* The baseline on this daemon, seconds before its flood: the machine's load drifts (other
   * work on a shared machine), so each flood is compared with an idle time next to it. */
  victim(b, c, &r->base);
  if (nprocs == 0 || r->base.n == 0 || r->base.stalled) {
    r->v = r->base;
    nprocs = 0;
  }
  for (int i = 0; i < nprocs && i < MAX_FLOODERS; i++)
    kids[nk++] = start_flooder(b, m, i, nprocs);
  if (nk > 0) {
    uint64_t deadline = now_ns() + UINT64_C(20) * 1000000000u;
    while (atomic_load(&counts->ready) < (uint64_t)nk && now_ns() < deadline) {
      int st;
      for (int i = 0; i < nk; i++)
        if (kids[i] > 0 && waitpid(kids[i], &st, WNOHANG) == kids[i]) {
          snprintf(r->why, sizeof r->why, "flooder %d exited during set-up (status 0x%x)", i, st);
          kids[i] = 0;
          goto out;
        }
      sleep_ms(5);
    }
    if (atomic_load(&counts->ready) < (uint64_t)nk) {
      snprintf(r->why, sizeof r->why, "the flooders were not ready within 20 s (%" PRIu64 " of %d)",
               (uint64_t)atomic_load(&counts->ready), nk);
      goto out;
    }
  }
  if (nk > 0)
    victim(b, c, &r->v);
  r->sent = atomic_load(&counts->sent);
  r->names = atomic_load(&counts->names);
  r->holds = atomic_load(&counts->holds);
  r->ok = atomic_load(&counts->ok);
  r->refused = atomic_load(&counts->refused);
  r->reconnects = atomic_load(&counts->reconnects);
  if (r->v.n == 0 || r->base.n == 0)
    snprintf(r->why, sizeof r->why, "the victim completed no round trip%s", r->v.stalled ? " (stalled)" : "");
  else if (nk > 0 && r->sent + r->reconnects == 0)
    snprintf(r->why, sizeof r->why, "the flooders sent nothing");
  else
    r->ran = 1;
out:
  for (int i = 0; i < nk; i++)
    if (kids[i] > 0) {
      kill(kids[i], SIGKILL);
      waitpid(kids[i], NULL, 0);
    }
  gpupool_client_disconnect(c);
  daemon_pid = 0;
  stop_daemon(d);
}

static void usage(const char *prog, int status) {
  fprintf(status ? stderr : stdout,
          "usage: %s GPUPOOLD [--seconds S] [--quick] [--modes idle,limits,wake,frames,hash,files,batches]\n"
          "       [--flooders N] [--members N] [--repeat N] [--nice N] [--keep-logs]\n",
          prog);
  exit(status);
}

static int mode_wanted(const char *list, const char *name) {
  size_t n = strlen(name);
  for (const char *p = list; p && *p;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == n && !strncmp(p, name, n))
      return 1;
    p = e ? e + 1 : NULL;
  }
  return 0;
}

int main(int argc, char **argv) {
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  /* One limits-mode flooder process per CPU (2 to 8): more would measure the scheduler. */
  bench b = {.seconds = 3, .flooders = ncpu < 2 ? 2 : ncpu > 8 ? 8 : (int)ncpu, .members = 65000, .setup_s = 5,
             .repeat = 1};
  const char *want = NULL;
  result res[NMODES], runs[MAX_REPEAT];
  double lo[NMODES], hi[NMODES];
  int nice_to = 0;
  int failed = 0;
  if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")))
    usage(argv[0], 0);
  if (argc < 2 || argv[1][0] == '-')
    usage(argv[0], 2);
  b.gpupoold = argv[1];
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--quick")) {
      b.quick = 1;
    } else if (!strcmp(a, "--keep-logs")) {
      b.keep_logs = 1;
    } else if (v && !strcmp(a, "--repeat")) {
      b.repeat = atoi(v), i++;
    } else if (v && !strcmp(a, "--nice")) {
      nice_to = atoi(v), i++;
    } else if (v && !strcmp(a, "--seconds")) {
      b.seconds = atof(v), i++;
    } else if (v && !strcmp(a, "--modes")) {
      want = v, i++;
    } else if (v && !strcmp(a, "--flooders")) {
      b.flooders = atoi(v), i++;
    } else if (v && !strcmp(a, "--members")) {
      b.members = atoi(v), i++;
    } else {
      usage(argv[0], 2);
    }
  }
  if (b.quick) { /* every mode, briefly: that it runs, not what it measures */
    b.seconds = 0.3;
    b.flooders = 2;
    b.members = 2000;
    b.setup_s = 0.2;
    b.repeat = 1;
  }
  if (b.seconds <= 0 || b.flooders < 1 || b.flooders > MAX_FLOODERS || b.members < 1 || b.members > 65536 ||
      b.repeat < 1 || b.repeat > MAX_REPEAT || nice_to < -20 || nice_to > 19)
    usage(argv[0], 2);
  if (geteuid() != 0) {
    printf("fairness: skipped (run as root: the floods come from uid %d)\n", NOBODY);
    return 77;
  }
  /* Everything the benchmark starts inherits this, victim and flooders alike: on a machine shared
   * with other work, a raised priority keeps that work from passing for unfairness. */
  if (nice_to != 0 && setpriority(PRIO_PROCESS, 0, nice_to) != 0)
    die("setpriority(%d): %s", nice_to, strerror(errno));
  signal(SIGPIPE, SIG_IGN);
  signal(SIGALRM, on_alarm);
  signal(SIGINT, on_stop);
  signal(SIGTERM, on_stop);
  counts = mmap(NULL, sizeof *counts, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (counts == MAP_FAILED)
    die("mmap: %s", strerror(errno));

  /* A private dir the flooding uid can traverse (0711) but not list. */
  if (ts_daemon_prepare(&b.d, NULL, "gpupool-fairness-") != 0)
    die("%s", b.d.why);
  if (chmod(b.d.dir, 0711) != 0)
    die("chmod %s: %s", b.d.dir, strerror(errno));
  snprintf(b.file, sizeof b.file, "%s/data.bin", b.d.dir);
  {
    /* Every limit at its default; only the socket opened to other uids. */
    int fd;
    if (ts_daemon_write_conf(&b.d, "[daemon]\nsocket_mode = 0666\n") != 0)
      die("%s", b.d.why);
    fd = open(b.file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || ftruncate(fd, 1 << 20) != 0 || close(fd) != 0)
      die("writing %s failed", b.file);
  }

  printf("gpupool fairness benchmark: %ld CPUs, %.1f s per mode, victim = root allocate+release 4 KiB, "
         "flooders = uid %d (%d limits processes, %d hash members), each mode run %d time%s, nice %d%s\n",
         ncpu, b.seconds, NOBODY, b.flooders, b.members, b.repeat, b.repeat == 1 ? "" : "s (the median shown)",
         nice_to, b.quick ? " (quick)" : "");
  for (size_t i = 0; i < NMODES; i++)
    if (!want || i == 0 || mode_wanted(want, modes[i].name))
      printf("  %-7s %s\n", modes[i].name, modes[i].what);
  fflush(stdout);
  for (size_t i = 0; i < NMODES; i++) {
    /* idle always runs: the reference for the machine as a whole */
    if (want && i > 0 && !mode_wanted(want, modes[i].name)) {
      res[i].ran = -1;
      continue;
    }
    int bad = 0;
    for (int k = 0; k < b.repeat && !bad; k++) {
      run_mode(&b, &modes[i], &runs[k]);
      if (!runs[k].ran) {
        fprintf(stderr, "fairness: mode %s: %s\n", modes[i].name, runs[k].why);
        res[i] = runs[k];
        bad = 1;
      }
    }
    if (!bad) {
      qsort(runs, (size_t)b.repeat, sizeof *runs, cmp_ratio);
      res[i] = runs[(b.repeat - 1) / 2];
      lo[i] = ratio(&runs[0]);
      hi[i] = ratio(&runs[b.repeat - 1]);
    }
  }

  printf("\nvictim latency in us; idle p99: the same daemon just before its flood; flood: requests sent,\n"
         "answered ok, refused, connections made again\n");
  printf("%-7s %8s %9s %9s %11s %9s %9s %9s %9s %9s %7s\n", "mode", "victim n", "p50", "p99", "max", "idle p99",
         "p99/idle", "sent", "ok", "refused", "reconn");
  for (size_t i = 0; i < NMODES; i++) {
    const result *r = &res[i];
    if (r->ran < 0)
      continue;
    if (!r->ran) {
      printf("%-7s not run: %s\n", modes[i].name, r->why);
      failed = 1;
      continue;
    }
    printf("%-7s %8zu %9.1f %9.1f %11.1f %9.1f %8.2fx %9" PRIu64 " %9" PRIu64 " %9" PRIu64 " %7" PRIu64 "%s\n",
           modes[i].name, r->v.n, r->v.p50, r->v.p99, r->v.max, r->base.p99, ratio(r), r->sent, r->ok,
           r->refused, r->reconnects, r->v.stalled ? "  STALLED: daemon killed" : "");
    if (r->names + r->holds)
      printf("        (held through the flood: %" PRIu64 " names, %" PRIu64 " holds on one connection)\n", r->names,
             r->holds);
    if (r->v.errors + r->base.errors)
      printf("        (the victim's requests were refused %d times)\n", r->v.errors + r->base.errors);
  }
  printf("\ngoal: one uid raises another's p99 at most %.0fx within its limits\n", GOAL_RATIO);
  for (size_t i = 1; i < NMODES; i++) {
    const result *r = &res[i];
    if (r->ran <= 0)
      continue;
    printf("  %-7s %9.2fx  %s", modes[i].name, ratio(r),
           !r->v.stalled && r->v.p99 <= GOAL_RATIO * r->base.p99 ? "meets the goal" : "MISSES the goal");
    if (b.repeat > 1)
      printf("  (%d runs: %.2fx to %.2fx)", b.repeat, lo[i], hi[i]);
    printf("\n");
  }
  for (size_t i = 0; i < NMODES; i++) {
    const result *r = &res[i];
    const char *mn = modes[i].name;
    if (r->ran <= 0)
      continue;
    printf("BENCH fairness_%s_p50_us %.1f\nBENCH fairness_%s_p99_us %.1f\nBENCH fairness_%s_max_us %.1f\n", mn,
           r->v.p50, mn, r->v.p99, mn, r->v.max);
    if (i > 0)
      printf("BENCH fairness_%s_idle_p99_us %.1f\nBENCH fairness_%s_p99_ratio %.2f\n"
             "BENCH fairness_%s_flood_ok %" PRIu64 "\nBENCH fairness_%s_flood_refused %" PRIu64 "\n",
             mn, r->base.p99, mn, ratio(r), mn, r->ok, mn, r->refused);
  }
  printf("fairness: %s\n", failed ? "some modes could not be run (see above)" : "every mode measured");

  if (!b.keep_logs && !failed) {
    ts_daemon_remove(&b.d);
  } else {
    printf("daemon logs kept in %s\n", b.d.dir);
  }
  return failed;
}
