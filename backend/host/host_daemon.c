/*
 * Host backend, daemon half: a pool is a capacity; each slab is its own sealed memfd of the
 * slab's size, with a read-only fd of it made at creation. A client receives, in the reply
 * that first names a slab, the fd of that slab alone (read-only when its hold is), so it can
 * map nothing it was not given; a freed slab's memfd is closed, so its pages go back to the
 * system once the last mapping goes, and a new slab always starts as zeros.
 *
 * Every memfd is sealed against shrinking and growing before any client sees it: otherwise a
 * client could ftruncate it and every other process mapping it would die of SIGBUS.
 *
 * Copies between pools (replicas): a thread per job reads each segment's source in chunks with
 * pread and writes every chunk to each destination along the chain with pwrite, so the daemon's
 * loop never waits on a copy; it polls the job's state. copy_free asks the thread to stop after
 * its current chunk and joins it, so no thread touches a slab after copy_free returns.
 *
 * Test hooks (read at each copy_start, for the integration tests of replica logic):
 * GPUPOOL_TEST_COPY_FAIL=N fails the first N jobs of this daemon after their first chunk;
 * GPUPOOL_TEST_COPY_DELAY_MS=M sleeps M ms before each chunk (a copy that takes a while, to
 * kill or wait on). GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS=M (read at each slab_alloc) sleeps M ms
 * in each slab allocation, on the daemon's thread: slabs as slow to make as GPU memory, for
 * the tests that the daemon makes many of them a few per loop turn.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "errors.h"
#include "host.h"

#define SLAB_GRAIN (2ull << 20)

struct gpupool__bpool {
  char name[64];
  uint64_t capacity;
  uint64_t reserved, reserved_high;
};

/* Host pools have no pool-wide fd: every slab is its own memfd, so a client receives (and can
 * map) only the slabs it was given, and a pool's capacity is never lost to placement. */
static int host_pool_create(gpupool__backend *be, const gpupool__pool_config *cfg,
                            gpupool__bpool **out, int *fd) {
  gpupool__bpool *p;

  (void)be;
  p = calloc(1, sizeof *p);
  if (!p)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  snprintf(p->name, sizeof p->name, "%s", cfg->name);
  p->capacity = cfg->capacity;
  *out = p;
  *fd = -1;
  return 0;
}

static void host_pool_destroy(gpupool__bpool *p) { free(p); }

/* A slab is a sealed memfd (no client can shrink or grow it under another's mapping, the
 * SIGBUS trap), mode 0600 so that a read-only fd of it cannot be reopened read-write through
 * /proc by another user, plus that read-only fd, made once. */
static int host_slab_alloc(gpupool__bpool *p, uint64_t size, uint64_t filled, gpupool__bslab *out) {
  char name[96], path[64];
  const char *env = getenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS");
  int fd, ro, rc;

  (void)filled; /* a new memfd reads as zeros: nothing to clear */
  if (env) {
    long ms = strtol(env, NULL, 10);
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    while (ms > 0 && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  size = (size + SLAB_GRAIN - 1) & ~(SLAB_GRAIN - 1);
  if (size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__err(GPUPOOL_ETOOBIG, "slab of %llu bytes exceeds 4 GiB", (unsigned long long)size);
  if (p->reserved + size > p->capacity)
    return GPUPOOL_ENOSPC;
  snprintf(name, sizeof name, "gpupool:%s", p->name);
  fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return gpupool__err(errno == EMFILE || errno == ENFILE ? GPUPOOL_EFD : GPUPOOL_EBACKEND,
                        "memfd_create failed: %s", strerror(errno));
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)size) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot size and seal a memfd of %llu bytes: %s",
                      (unsigned long long)size, strerror(errno));
    close(fd);
    return rc;
  }
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ro = open(path, O_RDONLY | O_CLOEXEC);
  if (ro < 0) {
    rc = gpupool__err(errno == EMFILE || errno == ENFILE ? GPUPOOL_EFD : GPUPOOL_EBACKEND,
                      "cannot open a read-only fd of a slab through %s: %s (is /proc mounted?)", path,
                      strerror(errno));
    close(fd);
    return rc;
  }
  memset(out, 0, sizeof *out);
  out->size = size;
  out->fd = fd;
  out->fd_ro = ro;
  out->fd_maps = 1;
  out->export_len = gpupool__host_export_encode(&(gpupool__host_export){.offset = 0, .size = size},
                                                out->export_data);
  p->reserved += size;
  if (p->reserved > p->reserved_high)
    p->reserved_high = p->reserved;
  return 0;
}

static void host_slab_free(gpupool__bpool *p, gpupool__bslab *s) {
  /* Closing the daemon's fds frees the pages once no client maps them any more (the daemon
   * frees a slab only after every client that mapped it has unmapped it or gone). */
  close(s->fd);
  close(s->fd_ro);
  s->fd = s->fd_ro = -1;
  p->reserved -= s->size;
}

/* A slab from the fd store: only a sealed memfd of exactly the size the state says, which no
 * process can shrink or grow under the clients that map it. */
static int host_slab_adopt(gpupool__bpool *p, int fd, uint64_t size, gpupool__bslab *out) {
  char path[64];
  struct stat st;
  int seals, ro;
  const int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

  if (size == 0 || size % SLAB_GRAIN != 0 || size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__err(GPUPOOL_EINVAL, "a slab of %llu bytes is not a size this backend makes",
                        (unsigned long long)size);
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != size)
    return gpupool__err(GPUPOOL_EINVAL, "the kept fd is not a memfd of %llu bytes", (unsigned long long)size);
  seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & need) != need)
    return gpupool__err(GPUPOOL_EINVAL, "the kept fd is not a memfd sealed against resizing");
  if (p->reserved + size > p->capacity)
    return gpupool__err(GPUPOOL_ENOSPC, "pool '%s' has no room left for a kept slab of %llu bytes (capacity "
                        "%llu bytes): was its capacity lowered?", p->name, (unsigned long long)size,
                        (unsigned long long)p->capacity);
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ro = open(path, O_RDONLY | O_CLOEXEC);
  if (ro < 0)
    return gpupool__err(GPUPOOL_EBACKEND, "cannot open a read-only fd of a kept slab through %s: %s", path,
                        strerror(errno));
  (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
  memset(out, 0, sizeof *out);
  out->size = size;
  out->fd = fd;
  out->fd_ro = ro;
  out->fd_maps = 1;
  out->export_len = gpupool__host_export_encode(&(gpupool__host_export){.offset = 0, .size = size},
                                                out->export_data);
  p->reserved += size;
  if (p->reserved > p->reserved_high)
    p->reserved_high = p->reserved;
  return 0;
}

static int host_pool_stats(gpupool__bpool *p, gpupool__bpool_stats *out) {
  out->reserved_cur = p->reserved;
  out->reserved_high = p->reserved_high;
  /* Slabs are whole memfds, sized at creation; pages appear as clients touch them. */
  out->used_cur = 0;
  out->used_high = 0;
  return 0;
}

/* ---- copies ---------------------------------------------------------------------------- */

/* The daemon half's state: the eventfd copy threads write when their job ends (-1: none). */
typedef struct {
  int copy_efd;
} host_state;

#define COPY_CHUNK (1u << 20)

struct gpupool__bcopy {
  pthread_t thread;
  gpupool__bcopy_seg *segs;
  size_t nsegs;
  int ndst;
  int fail;             /* test hook: fail after the first chunk */
  long delay_ms;        /* test hook: sleep before each chunk */
  atomic_int cancel;    /* copy_free asks the thread to stop */
  atomic_int state;     /* 0 running, 1 done, -1 failed (err set before) */
  int notify_fd;        /* the backend's eventfd, written once state is set (-1: none) */
  char err[200];
};

/* Jobs that GPUPOOL_TEST_COPY_FAIL still asks to fail (the daemon's one thread starts jobs). */
static long copy_fails_left = -1;

static int copy_fd(const gpupool__bloc *l) { return l->slab->fd; }

static int copy_chunk(gpupool__bcopy *c, const gpupool__bcopy_seg *sg, uint64_t at, uint8_t *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(copy_fd(&sg->src), buf + got, n - got, (off_t)(sg->src.off + at + got));
    if (r <= 0) {
      snprintf(c->err, sizeof c->err, "reading the source slab at %llu: %s",
               (unsigned long long)(sg->src.off + at + got), r < 0 ? strerror(errno) : "end of file");
      return -1;
    }
    got += (size_t)r;
  }
  /* The chain: dst[0] from the source, dst[i] from dst[i-1]; on the host the chunk read once is
   * those bytes. */
  for (int d = 0; d < c->ndst; d++) {
    size_t put = 0;
    while (put < n) {
      ssize_t w = pwrite(copy_fd(&sg->dst[d]), buf + put, n - put, (off_t)(sg->dst[d].off + at + put));
      if (w <= 0) {
        snprintf(c->err, sizeof c->err, "writing destination %d at %llu: %s", d,
                 (unsigned long long)(sg->dst[d].off + at + put), w < 0 ? strerror(errno) : "no progress");
        return -1;
      }
      put += (size_t)w;
    }
  }
  return 0;
}

/* The job ended: the daemon's loop hears of it now rather than on its next timer. */
static void notify(gpupool__bcopy *c) {
  uint64_t one = 1;
  if (c->notify_fd >= 0) {
    ssize_t r = write(c->notify_fd, &one, sizeof one);
    (void)r; /* a saturated counter is still readable */
  }
}

static void *copy_main(void *arg) {
  gpupool__bcopy *c = arg;
  uint8_t *buf = malloc(COPY_CHUNK);
  int chunks = 0;
  if (!buf) {
    snprintf(c->err, sizeof c->err, "out of memory for a copy buffer");
    atomic_store(&c->state, -1);
    notify(c);
    return NULL;
  }
  for (size_t i = 0; i < c->nsegs; i++) {
    const gpupool__bcopy_seg *sg = &c->segs[i];
    for (uint64_t at = 0; at < sg->len; at += COPY_CHUNK) {
      size_t n = sg->len - at < COPY_CHUNK ? (size_t)(sg->len - at) : COPY_CHUNK;
      if (c->delay_ms > 0) {
        struct timespec ts = {c->delay_ms / 1000, (c->delay_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
          ;
      }
      if (atomic_load(&c->cancel)) {
        snprintf(c->err, sizeof c->err, "cancelled");
        goto failed;
      }
      if (c->fail && chunks > 0) {
        snprintf(c->err, sizeof c->err, "failed on purpose (GPUPOOL_TEST_COPY_FAIL)");
        goto failed;
      }
      if (copy_chunk(c, sg, at, buf, n) != 0)
        goto failed;
      chunks++;
    }
  }
  free(buf);
  atomic_store(&c->state, 1);
  notify(c);
  return NULL;
failed:
  free(buf);
  atomic_store(&c->state, -1);
  notify(c);
  return NULL;
}

static int host_copy_start(gpupool__backend *be, const gpupool__bcopy_seg *segs, size_t nsegs, int ndst,
                           gpupool__bcopy **out) {
  gpupool__bcopy *c;
  const char *env;
  int rc;
  if (ndst < 1 || ndst > GPUPOOL_COPY_MAX_DSTS || nsegs == 0)
    return gpupool__err(GPUPOOL_EINVAL, "a copy goes to 1 to %d destinations, with at least one segment",
                        GPUPOOL_COPY_MAX_DSTS);
  if (!(c = calloc(1, sizeof *c)) || !(c->segs = malloc(nsegs * sizeof *segs))) {
    free(c);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  memcpy(c->segs, segs, nsegs * sizeof *segs);
  c->nsegs = nsegs;
  c->ndst = ndst;
  c->notify_fd = be->priv ? ((host_state *)be->priv)->copy_efd : -1;
  if (copy_fails_left < 0)
    copy_fails_left = (env = getenv("GPUPOOL_TEST_COPY_FAIL")) ? strtol(env, NULL, 10) : 0;
  if (copy_fails_left > 0) {
    copy_fails_left--;
    c->fail = 1;
  }
  if ((env = getenv("GPUPOOL_TEST_COPY_DELAY_MS")))
    c->delay_ms = strtol(env, NULL, 10);
  atomic_init(&c->cancel, 0);
  atomic_init(&c->state, 0);
  if ((rc = pthread_create(&c->thread, NULL, copy_main, c)) != 0) {
    free(c->segs);
    free(c);
    return gpupool__err(GPUPOOL_EBACKEND, "cannot start a copy thread: %s", strerror(rc));
  }
  *out = c;
  return 0;
}

static int host_copy_poll(gpupool__bcopy *c) {
  int st = atomic_load(&c->state);
  if (st < 0)
    return gpupool__err(GPUPOOL_EBACKEND, "copy between host pools failed: %s", c->err);
  return st;
}

static void host_copy_free(gpupool__bcopy *c) {
  if (!c)
    return;
  atomic_store(&c->cancel, 1);
  pthread_join(c->thread, NULL);
  free(c->segs);
  free(c);
}

static int host_copy_notify_fd(gpupool__backend *be) { return ((host_state *)be->priv)->copy_efd; }

/* After every copy job was freed (its thread joined): nothing writes the eventfd any more. */
static void host_close(gpupool__backend *be) {
  host_state *st = be->priv;
  if (st->copy_efd >= 0)
    close(st->copy_efd);
  free(st);
  free(be);
}

static const gpupool__backend_ops host_ops = {
    .has_events = 0,
    .pool_create = host_pool_create,
    .pool_destroy = host_pool_destroy,
    .slab_alloc = host_slab_alloc,
    .slab_free = host_slab_free,
    .slab_adopt = host_slab_adopt,
    .pool_stats = host_pool_stats,
    .close = host_close,
    .copy_start = host_copy_start,
    .copy_poll = host_copy_poll,
    .copy_free = host_copy_free,
    .copy_notify_fd = host_copy_notify_fd,
};

int gpupool__host_open(gpupool__backend **out) {
  gpupool__backend *be = calloc(1, sizeof *be);
  host_state *st = calloc(1, sizeof *st);
  if (!be || !st) {
    free(be);
    free(st);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  /* Made with the backend, which owns it until close: -1 (no notifier, the caller's timer
   * polls) if the kernel refuses one. */
  st->copy_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  be->desc = &gpupool__backend_host;
  be->ops = &host_ops;
  be->priv = st;
  *out = be;
  return 0;
}
