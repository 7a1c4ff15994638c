/*
 * libgpupool-client: one connection to gpupoold, shared by every thread of the caller.
 *
 * Requests carry a sequence number; replies may come back in any order (a get that waits
 * for a publisher does not hold up an allocate from another thread). Whichever waiting
 * thread finds no reader active becomes the reader, reads one frame without the lock, hands
 * it to the thread whose request it answers, and wakes everyone. All other state (imported
 * pools, mapped slabs, opened events, live buffers) is guarded by the one mutex.
 *
 * Memory: each pool is imported once, each slab mapped once (refcounted by the buffers this
 * client has in it), each event opened once. A buffer is (slab base + offset).
 *
 * Lease: the Hello reply carries an fd this client keeps (close-on-exec) for as long as it maps
 * any of that daemon's memory; forked children share it. The daemon reuses what a closed
 * connection held or mapped only once no process holds the lease any more, so it is closed
 * only after the last mapping of its daemon's memory is gone.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <pwd.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "errors.h"
#include "hmap.h"
#include "wire.h"

#define GPUPOOL_WAIT_FOREVER UINT32_MAX

typedef struct cpool {
  uint32_t id;
  char name[64];
  gpupool_mem_kind kind;
  int device;
  uint64_t capacity;
  gpupool__cpool *bp; /* NULL until attached */
} cpool;

typedef struct cslab {
  uint64_t id;
  cpool *pool;
  void *base;     /* the first mapping: read-write, or read-only when `writable` is 0 */
  void *base_rw;  /* a second, read-write mapping, made when a writable hold came later */
  int writable;   /* base is read-write */
  uint64_t size;
  void *priv;
  int dedicated;
  uint32_t refs; /* buffers of this client inside */
  int keep;      /* dedicated, but stays mapped when empty until revoked (GPUPOOL_KEEP_MAPPED) */
  struct stale_gen *stale; /* set when its daemon connection is gone */
} cslab;

/* How to map a slab, kept from the reply that carried it: with several threads, the reply
 * that carries a slab's export data may be processed after another reply that only names it. */
typedef struct slab_export {
  uint32_t pool_id;
  uint64_t size;
  int dedicated;
  int fd;        /* the slab's own fd, when the frame carried one (host), else -1 */
  int writable;  /* the fd (or the hold it came for) allows writing */
  size_t len;
  uint8_t data[];
} slab_export;

typedef struct pending {
  uint64_t seq;
  uint64_t gen;   /* c->reconnects when it was sent */
  gpupool__rep *rep;
  int fds[GPUPOOL_WIRE_MAX_FDS];
  int nfds;
  int done;
  int err; /* set with done when the connection broke before the reply came */
  struct pending *next;
} pending;

/* What is left of a connection to a daemon that went away: its pools and events stay
 * imported while buffers obtained through it still map its slabs (mappings outlive the
 * daemon), and go when the last such buffer is released. */
typedef struct stale_gen {
  cpool *pools;
  int npools;
  gpupool__hmap events;
  uint64_t live_slabs;
  int lease_fd;            /* closed with the generation's last mapping */
  struct stale_gen *next;
} stale_gen;

struct gpupool_client {
  int fd;
  int lease_fd;            /* this connection's lease, or -1 */
  pthread_mutex_t mu;      /* mu and cv stay near the start: test_reconnect_race finds a thread
                            * waiting on them by address (first 512 bytes) */
  pthread_cond_t cv;
  uint64_t next_seq;
  int reader_active;
  int broken;              /* 0 or the error that ended the connection */
  char broken_msg[GPUPOOL__ERRMSG_MAX];
  pending *pend;
  gpupool__wire_rx rx;     /* used only by the active reader */
  const gpupool__cbackend_ops *be;
  int backend_kind;
  cpool *pools;
  int npools;
  gpupool__hmap slabs;     /* id -> cslab */
  gpupool__hmap exports;   /* slab id -> slab_export seen in a reply, not yet mapped */
  gpupool__hmap events;    /* id -> gpupool__cevent */
  uint64_t *unmapped;      /* slab ids to report in the next request */
  size_t nunmapped, capunmapped;
  gpupool_buffer *buffers; /* live buffers (for disconnect) */
  int devices[64];
  int ndevices;
  uint64_t client_id;
  uint32_t max_frame;
  /* Reconnection after the daemon went away (restart, crash). */
  char socket_path[108];
  char name[64];
  int reconnect_ms;        /* budget for reconnecting before a request fails */
  int connect_timeout_ms;  /* connect + Hello; < 0: wait forever */
  uint64_t hs_deadline_ns; /* while saying Hello: when to give up (0 otherwise) */
  int hs_closed;           /* the last Hello went unanswered and the peer hung up: on a socket
                            * that served us before, most likely a daemon restarting */
  int spin_us;             /* GPUPOOL_SPIN_US: poll this long for a reply before sleeping */
  int host_fences_env;     /* GPUPOOL_HOST_FENCES: 1 on, 0 off, -1 decide per connection */
  int host_fences;         /* this connection orders work by synchronizing streams, not with
                            * the daemon's IPC events (see gpupool_host_fences) */
  uint64_t reconnects;
  stale_gen *stale;
  char **published;        /* names this client published and has not unpublished */
  size_t npublished, cappublished;
  char **lost_names;       /* names lost in a restart, until gpupool_lost_names() reads them */
  gpupool__smap layout_cache; /* name -> clayout (a reference): member tables got by name */
  size_t nlayout_cache;
  size_t nlost_names;
  uint64_t holds_lost;
};

struct gpupool_buffer {
  gpupool_client *c;
  uint64_t hold_id, buffer_id;
  cslab *slab;
  void *base;     /* the slab mapping this buffer uses (read-only holds may use a read-only one) */
  uint64_t offset, size;
  int read_only;
  uint32_t ready_id, done_id;
  int has_meta;
  gpupool_tensor_meta meta;
  int lost; /* its hold died with a previous daemon connection */
  gpupool_buffer *prev, *next;
};

/* ---- tracing ------------------------------------------------------------------------------------ */

/* GPUPOOL_TRACE=FILE appends one line per step (request round trips, slab maps, event opens,
 * stream waits) with CLOCK_MONOTONIC microseconds, to find where a handoff spends its time. */
static FILE *trace_file;
static pthread_once_t trace_once = PTHREAD_ONCE_INIT;

static void trace_open(void) {
  const char *p = getenv("GPUPOOL_TRACE");
  if (p && *p && (trace_file = fopen(p, "ae")))
    setvbuf(trace_file, NULL, _IOLBF, 0);
}

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void trace(const char *what, uint64_t t0, uint64_t detail) {
  pthread_once(&trace_once, trace_open);
  if (trace_file)
    fprintf(trace_file, "%d %.1f %s %.1fus %" PRIu64 "\n", (int)getpid(), (double)t0 / 1e3, what,
            (double)(mono_ns() - t0) / 1e3, detail);
}

#define TRACE_ON() (pthread_once(&trace_once, trace_open), trace_file != NULL)

/* ---- transport -------------------------------------------------------------------------------- */

/* Marks the connection unusable and fails every request still waiting on it. */
static void set_broken(gpupool_client *c, int code, const char *msg) {
  if (c->broken)
    return;
  c->broken = code;
  snprintf(c->broken_msg, sizeof c->broken_msg, "%s", msg);
  for (pending *p = c->pend; p; p = p->next)
    if (!p->done) {
      p->done = 1;
      p->err = code;
    }
  pthread_cond_broadcast(&c->cv);
}

static int broken_err(gpupool_client *c) {
  return gpupool__err(c->broken, "connection to gpupoold is unusable: %s", c->broken_msg);
}

static void export_free(slab_export *e) {
  if (e->fd >= 0)
    close(e->fd);
  free(e);
}

static void exports_clear(gpupool_client *c) {
  for (size_t i = 0; i < c->exports.cap; i++)
    if (gpupool__hmap_slot_used(&c->exports, i))
      export_free(c->exports.slots[i].val);
  gpupool__hmap_free(&c->exports);
  gpupool__hmap_init(&c->exports);
}

/* The buffer a reply carries, if its body is of the expected kind. body is a oneof (a
 * union): only the member its case names may be read. want 0 = any buffer-carrying kind. */
static const Gpupool__Wire__BufferDesc *reply_desc(const gpupool__rep *rep, int want) {
  if (want && (int)rep->body_case != want)
    return NULL;
  switch (rep->body_case) {
  case GPUPOOL__WIRE__REPLY__BODY_ALLOCATE:
    return rep->allocate ? rep->allocate->buffer : NULL;
  case GPUPOOL__WIRE__REPLY__BODY_GET:
    return rep->get ? rep->get->buffer : NULL;
  case GPUPOOL__WIRE__REPLY__BODY_OPEN:
    return rep->open ? rep->open->buffer : NULL;
  default:
    return NULL;
  }
}


/* Keep how to map a slab from the reply that carries it (and the slab's fd, which comes in the
 * same frame): a first mapping, or a writable one for a slab mapped read-only so far. *fdi is
 * the index of the frame's next fd: each desc with fd_attached took one, in order. */
static void stash_one(gpupool_client *c, const Gpupool__Wire__BufferDesc *d, int *fdi) {
  const cslab *s;
  slab_export *e, *old;
  int fd = -1;
  if (!d || !d->slab || !d->slab->export_data.len)
    return;
  if (d->slab->fd_attached && *fdi < c->rx.nfds)
    fd = (*fdi)++;
  s = gpupool__hmap_get(&c->slabs, d->slab->id);
  old = gpupool__hmap_get(&c->exports, d->slab->id);
  if ((s && (s->writable || s->base_rw || !d->slab->writable)) || (old && (old->writable || !d->slab->writable)))
    return;
  e = malloc(sizeof *e + d->slab->export_data.len);
  if (!e)
    return; /* materialize then fails with a clear error for the thread that needs it */
  e->pool_id = d->slab->pool_id;
  e->size = d->slab->size;
  e->dedicated = d->slab->dedicated;
  e->writable = d->slab->writable;
  e->fd = -1;
  if (fd >= 0) {
    e->fd = c->rx.fds[fd];
    c->rx.fds[fd] = -1;
  }
  e->len = d->slab->export_data.len;
  memcpy(e->data, d->slab->export_data.data, e->len);
  if (gpupool__hmap_put(&c->exports, d->slab->id, e) != 0) {
    export_free(e);
    return;
  }
  if (old)
    export_free(old);
}

/* The bundle a reply carries, if any. */
static const Gpupool__Wire__Bundle *reply_bundle(const gpupool__rep *rep) {
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_ALLOCATE_BUNDLE)
    return rep->allocate_bundle ? rep->allocate_bundle->bundle : NULL;
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_GET_BUNDLE)
    return rep->get_bundle ? rep->get_bundle->bundle : NULL;
  return NULL;
}

static void stash_export(gpupool_client *c, const gpupool__rep *rep) {
  const Gpupool__Wire__Bundle *b = reply_bundle(rep);
  int fdi = 0;
  if (b) {
    for (size_t i = 0; i < b->n_buffers; i++)
      stash_one(c, b->buffers[i], &fdi);
    return;
  }
  stash_one(c, reply_desc(rep, 0), &fdi);
}

/* Read one reply (lock released meanwhile) and hand it to its waiter. Called with c->mu. */
static void read_one(gpupool_client *c) {
  gpupool__rep *rep;
  pending *p;
  int rc;

  uint64_t t_read = TRACE_ON() ? mono_ns() : 0;
  c->reader_active = 1;
  pthread_mutex_unlock(&c->mu);
  if (c->spin_us > 0) {
    /* Latency mode: most replies come within tens of microseconds; waiting for them awake
     * saves being woken up (costly on virtual machines and in deep idle states). */
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    uint64_t end = mono_ns() + (uint64_t)c->spin_us * 1000;
    while (poll(&pfd, 1, 0) == 0 && mono_ns() < end)
      ;
  }
  /* Only while saying Hello does the socket have a receive timeout (SO_RCVTIMEO): a read
   * that times out returns 0 and is tried again until the deadline. */
  while ((rc = gpupool__wire_rx_read(&c->rx, c->fd)) == 0 && c->hs_deadline_ns &&
         mono_ns() < c->hs_deadline_ns)
    ;
  if (t_read)
    trace("read", t_read, c->rx.payload_len);
  rep = rc == 1 ? gpupool__wire_unpack_reply(&c->rx) : NULL;
  pthread_mutex_lock(&c->mu);
  c->reader_active = 0;
  if (c->hs_deadline_ns && (rc != 1 || !rep)) {
    char msg[GPUPOOL__ERRMSG_MAX];
    if (rc == 0)
      snprintf(msg, sizeof msg, "the daemon did not answer in %g s: gpupoold at %s accepted the "
               "connection but did not answer Hello (stopped or stuck? see 'systemctl status "
               "gpupoold'; the timeout is gpupool_connect_timeout() or GPUPOOL_CONNECT_TIMEOUT_MS)",
               c->connect_timeout_ms / 1000.0, c->socket_path);
    else
      snprintf(msg, sizeof msg, "this socket is not gpupoold: %s %s (%s); check the socket path "
               "(GPUPOOL_SOCKET)", c->socket_path,
               rc == GPUPOOL_ECLOSED ? "closed the connection without answering Hello"
                                     : "answered Hello with something that is not a gpupool reply",
               rc == 1 ? "the frame does not decode" : gpupool__errmsg());
    set_broken(c, rc == 0 ? GPUPOOL_ETIMEDOUT : GPUPOOL_EPROTO, msg);
    c->hs_closed = rc == GPUPOOL_ECLOSED;
    if (rep)
      gpupool__wire__reply__free_unpacked(rep, NULL);
    goto out;
  }
  if (rc != 1) {
    set_broken(c, rc == GPUPOOL_ECLOSED ? GPUPOOL_ECLOSED : rc,
               rc == GPUPOOL_ECLOSED ? "the daemon closed the connection (stopped, restarted, or dropped this client)"
               : rc == 0             ? "no reply from the daemon"
                                     : gpupool__errmsg());
    goto out;
  }
  if (!rep) {
    set_broken(c, GPUPOOL_EPROTO, "malformed reply from the daemon");
    goto out;
  }
  for (p = c->pend; p; p = p->next)
    if (!p->done && p->seq == rep->seq)
      break;
  if (!p && rep->seq == 0 && rep->error) {
    /* A connection-level error (refusal, protocol violation): the oldest request gets it. */
    for (p = c->pend; p && p->next; p = p->next)
      ;
    if (p && p->done)
      p = NULL;
    if (!p)
      set_broken(c, rep->error->code, rep->error->message ? rep->error->message : "daemon error");
  }
  if (!p) {
    if (!c->broken)
      set_broken(c, GPUPOOL_EPROTO, "reply for an unknown request");
    gpupool__wire__reply__free_unpacked(rep, NULL);
    goto out;
  }
  p->rep = rep;
  stash_export(c, rep);
  for (int i = 0; i < c->rx.nfds; i++) {
    p->fds[p->nfds++] = c->rx.fds[i];
    c->rx.fds[i] = -1;
  }
  p->done = 1;
out:
  gpupool__wire_rx_reset(&c->rx);
  pthread_cond_broadcast(&c->cv);
}

/* Send req and wait for its reply. Called and returns with c->mu held. On success *rep is
 * the reply (caller frees) and it carried no error. Handles slab revocations it carries. */
static int handle_revokes(gpupool_client *c, const gpupool__rep *rep);

/* After a failed send: an error frame the daemon left before closing, as (code, message). */
static int refusal(gpupool_client *c) {
  struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  int code = 0;
  if (c->reader_active || poll(&pfd, 1, 0) != 1 || !(pfd.revents & POLLIN))
    return 0;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_DEFAULT_MAX_FRAME);
  if (gpupool__wire_rx_read(&rx, c->fd) == 1)
    rep = gpupool__wire_unpack_reply(&rx);
  gpupool__wire_rx_reset(&rx);
  if (rep && rep->error && rep->error->code < 0 && rep->error->code > GPUPOOL_ERRNO_MIN) {
    code = rep->error->code;
    set_broken(c, code, rep->error->message ? rep->error->message : gpupool_strerror(code));
    gpupool__err(code, "%s", c->broken_msg);
  }
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  return code;
}

/* Send req (with send_fd, when >= 0; the caller keeps it) and register its pending reply
 * (*out, freed by call_wait). With c->mu held. */
static int call_send(gpupool_client *c, gpupool__req *req, pending **out, int send_fd) {
  pending *p;
  uint8_t *buf;
  size_t len;
  int rc;

  if (c->broken)
    return broken_err(c);
  req->seq = ++c->next_seq;
  req->n_unmapped_slabs = c->nunmapped;
  req->unmapped_slabs = c->unmapped;
  req->host_fences = c->host_fences;
  if ((rc = gpupool__wire_pack_request(req, &buf, &len)) != 0)
    return rc;
  if (c->max_frame && len - GPUPOOL_WIRE_HDR > c->max_frame) {
    free(buf);
    return gpupool__err(GPUPOOL_ETOOBIG, "request of %zu bytes exceeds the daemon's frame limit of %u (max_frame "
                        "in its config)", len - GPUPOOL_WIRE_HDR, c->max_frame);
  }
  if (!(p = calloc(1, sizeof *p))) {
    free(buf);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  rc = gpupool__wire_send(c->fd, buf, len, send_fd >= 0 ? &send_fd : NULL, send_fd >= 0 ? 1 : 0);
  free(buf);
  if (rc != 0) {
    free(p);
    /* The daemon may have refused this connection (too many clients, uid not allowed) and
     * closed it before our request went out: its reason is still readable. */
    int code = refusal(c);
    if (code)
      return code;
    if (c->hs_deadline_ns) {
      char msg[160];
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      set_broken(c, rc == GPUPOOL_ETIMEDOUT ? GPUPOOL_ETIMEDOUT : GPUPOOL_EPROTO, "");
      if (c->broken == GPUPOOL_ETIMEDOUT)
        snprintf(c->broken_msg, sizeof c->broken_msg,
                 "the daemon did not answer in %g s: gpupoold at %s does not read (%s)",
                 c->connect_timeout_ms / 1000.0, c->socket_path, msg);
      else
        snprintf(c->broken_msg, sizeof c->broken_msg,
                 "this socket is not gpupoold, or it is shutting down: %s closed the connection "
                 "before reading Hello (%s)",
                 c->socket_path, msg);
      c->hs_closed = c->broken == GPUPOOL_EPROTO;
      return gpupool__err(c->broken, "%s", c->broken_msg);
    }
    set_broken(c, rc, "cannot send to the daemon (it stopped or dropped this client)");
    return broken_err(c);
  }
  c->nunmapped = 0;
  p->seq = req->seq;
  p->gen = c->reconnects;
  p->next = c->pend;
  c->pend = p;
  *out = p;
  return 0;
}

/* Wait for p's reply, unlink and free p. On success *out is the reply (caller frees) and it
 * carried no error; fds it carried go to fds_out (first *nfds_out, at most GPUPOOL_WIRE_MAX_FDS)
 * or are closed when fds_out is NULL. Handles the slab revocations it carries. With c->mu. */
static int call_wait(gpupool_client *c, pending *p, gpupool__rep **out, int *fds_out, int *nfds_out) {
  pending **pp;
  int rc;
  uint64_t t_wait = TRACE_ON() ? mono_ns() : 0;

  if (nfds_out)
    *nfds_out = 0;
  while (!p->done) {
    if (!c->reader_active)
      read_one(c);
    else
      pthread_cond_wait(&c->cv, &c->mu);
  }
  for (pp = &c->pend; *pp && *pp != p; pp = &(*pp)->next)
    ;
  if (*pp)
    *pp = p->next;
  if (t_wait)
    trace("rpc", t_wait, p->seq);
  if (!p->rep || p->gen != c->reconnects) {
    rc = gpupool__err(p->err ? p->err : p->rep ? GPUPOOL_ECLOSED : GPUPOOL_EIO,
                      "connection to gpupoold lost while waiting for the reply: %s (the next request "
                      "reconnects; holds of the old connection are reported by gpupool_lost_names and "
                      "gpupool_buffer_lost)",
                      c->broken_msg[0] ? c->broken_msg : "the client reconnected since");
    goto fail;
  }
  handle_revokes(c, p->rep);
  if (p->rep->error) {
    rc = p->rep->error->code < 0 && p->rep->error->code > GPUPOOL_ERRNO_MIN ? p->rep->error->code : GPUPOOL_EPROTO;
    gpupool__err(rc, "%s", p->rep->error->message ? p->rep->error->message : gpupool_strerror(rc));
    goto fail;
  }
  for (int i = 0; i < p->nfds; i++)
    if (p->fds[i] >= 0) {
      if (fds_out && nfds_out)
        fds_out[(*nfds_out)++] = p->fds[i];
      else
        close(p->fds[i]);
    }
  *out = p->rep;
  free(p);
  return 0;
fail:
  if (p->rep)
    gpupool__wire__reply__free_unpacked(p->rep, NULL);
  for (int i = 0; i < p->nfds; i++)
    if (p->fds[i] >= 0)
      close(p->fds[i]);
  free(p);
  return rc;
}

/* Send req (with send_fd when >= 0; the caller keeps it) and wait for its reply. Called and
 * returns with c->mu held. On success *rep is the reply (caller frees) and it carried no
 * error; *fd_out (may be NULL) gets the first fd it carried. Handles slab revocations. */
static int call_fds(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int *fd_out, int send_fd) {
  pending *p = NULL;
  int fds[GPUPOOL_WIRE_MAX_FDS], nfds = 0, rc;
  if (fd_out)
    *fd_out = -1;
  if ((rc = call_send(c, req, &p, send_fd)) != 0)
    return rc;
  if ((rc = call_wait(c, p, out, fds, &nfds)) != 0)
    return rc;
  for (int i = 0; i < nfds; i++) {
    if (i == 0 && fd_out)
      *fd_out = fds[0];
    else
      close(fds[i]);
  }
  return 0;
}

static int call(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int *fd_out) {
  return call_fds(c, req, out, fd_out, -1);
}

/* ---- slabs, pools, events ------------------------------------------------------------------- */

static void note_unmapped(gpupool_client *c, uint64_t id) {
  if (c->nunmapped == c->capunmapped) {
    size_t ncap = c->capunmapped ? c->capunmapped * 2 : 8;
    uint64_t *n = realloc(c->unmapped, ncap * sizeof *n);
    if (!n)
      return; /* the daemon frees the slab when this client disconnects instead */
    c->unmapped = n;
    c->capunmapped = ncap;
  }
  c->unmapped[c->nunmapped++] = id;
}

/* Undo the backend mapping(s) of s. */
static int be_unmap(gpupool_client *c, cslab *s, void *stream) {
  int rc = c->be->slab_unmap(s->pool->bp, s->base, s->size, s->priv, stream);
  if (s->base_rw && c->be->slab_unmap(s->pool->bp, s->base_rw, s->size, NULL, stream) != 0)
    rc = rc ? rc : GPUPOOL_EBACKEND;
  return rc;
}

static void slab_unmap(gpupool_client *c, cslab *s, void *stream) {
  if (be_unmap(c, s, stream) != 0)
    fprintf(stderr, "libgpupool-client: unmapping slab %" PRIu64 ": %s\n", s->id, gpupool__errmsg());
  gpupool__hmap_del(&c->slabs, s->id);
  note_unmapped(c, s->id);
  free(s);
}

static int handle_revokes(gpupool_client *c, const gpupool__rep *rep) {
  int unmapped = 0;
  for (size_t i = 0; i < rep->n_revoke_slabs; i++) {
    cslab *s = gpupool__hmap_get(&c->slabs, rep->revoke_slabs[i]);
    slab_export *e = gpupool__hmap_get(&c->exports, rep->revoke_slabs[i]);
    if (e) {
      /* Stashed from a reply whose buffer never became ours (a cancelled or failed get):
       * its fd would otherwise keep the slab's memory until disconnect. */
      gpupool__hmap_del(&c->exports, rep->revoke_slabs[i]);
      export_free(e);
    }
    if (!s) {
      note_unmapped(c, rep->revoke_slabs[i]);
      continue;
    }
    if (s->refs > 0)
      continue; /* cannot happen: the daemon revokes only empty slabs */
    slab_unmap(c, s, NULL);
    unmapped = 1;
  }
  /* The report goes out with the next request: the frees must have run by then. */
  if (unmapped && c->be->sync && c->be->sync(NULL) != 0)
    fprintf(stderr, "libgpupool-client: waiting for slab unmaps: %s\n", gpupool__errmsg());
  return 0;
}

static cpool *pool_by_id(gpupool_client *c, uint32_t id) {
  for (int i = 0; i < c->npools; i++)
    if (c->pools[i].id == id)
      return &c->pools[i];
  return NULL;
}

static int pool_attach(gpupool_client *c, cpool *p) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AttachPool ap = GPUPOOL__WIRE__ATTACH_POOL__INIT;
  gpupool__rep *rep;
  gpupool__cpool *bp;
  int fd, rc;

  if (p->bp)
    return 0;
  ap.pool_id = p->id;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL;
  req.attach_pool = &ap;
  if ((rc = call(c, &req, &rep, &fd)) != 0)
    return rc;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  /* fd is -1 for backends without a pool-wide fd (host: slabs come with their own). */
  if ((rc = c->be->pool_import(fd, p->kind, p->device, p->capacity, &bp)) != 0)
    return rc;
  if (c->ndevices > 0 && (rc = c->be->pool_set_access(bp, c->devices, c->ndevices)) != 0) {
    c->be->pool_release(bp);
    return rc;
  }
  /* call() let go of the lock: another thread may have attached the pool meanwhile. */
  if (p->bp)
    c->be->pool_release(bp);
  else
    p->bp = bp;
  return 0;
}

static int event_get(gpupool_client *c, const Gpupool__Wire__EventRef *ref, gpupool__cevent **out) {
  gpupool__cevent *e;
  int rc;
  *out = NULL;
  if (!ref || !c->be->has_events || c->host_fences)
    return 0;
  e = gpupool__hmap_get(&c->events, ref->id);
  if (!e) {
    if ((rc = c->be->event_open(ref->ipc_handle.data, ref->ipc_handle.len, &e)) != 0)
      return rc;
    if (gpupool__hmap_put(&c->events, ref->id, e) != 0) {
      c->be->event_close(e);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    }
  }
  *out = e;
  return 0;
}

static int send_release(gpupool_client *c, uint64_t hold_id, int done_recorded) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Release rl = GPUPOOL__WIRE__RELEASE__INIT;
  gpupool__rep *rep;
  int rc;
  rl.hold_id = hold_id;
  rl.done_recorded = done_recorded;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_RELEASE;
  req.release = &rl;
  rc = call(c, &req, &rep, NULL);
  if (rc == 0)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Turn a BufferDesc into a buffer of this process: attach the pool, map the slab, open the
 * events, and (wait_ready) make `stream` wait on the producer's ready event. On failure the
 * daemon's hold is released so nothing stays behind. */
static int materialize(gpupool_client *c, const Gpupool__Wire__BufferDesc *d, int wait_ready, void *stream,
                       gpupool_buffer **out) {
  gpupool_buffer *b;
  cpool *p;
  cslab *s;
  gpupool__cevent *ready = NULL, *done = NULL;
  gpupool_tensor_meta meta;
  int rc, new_slab = 0;
  /* The connection d came on. Attaching a pool lets go of the lock: if another thread
   * reconnects meanwhile, d's hold, pool and slab belong to a daemon that is gone, and its
   * ids may name something else on the new one. */
  uint64_t gen = c->reconnects;

  if (!d || !d->slab) {
    rc = gpupool__err(GPUPOOL_EPROTO, "reply without a buffer description");
    goto fail;
  }
  p = pool_by_id(c, d->pool_id);
  if (!p) {
    rc = gpupool__err(GPUPOOL_EPROTO, "buffer in unknown pool %u", d->pool_id);
    goto fail;
  }
  uint64_t t_m = TRACE_ON() ? mono_ns() : 0;
  rc = pool_attach(c, p);
  if (c->reconnects != gen) {
    gpupool__err(GPUPOOL_ELOST, "gpupoold went away while this buffer was being mapped: its hold went with the "
                 "old daemon (get or allocate it again)");
    return GPUPOOL_ELOST;
  }
  if (rc != 0)
    goto fail;
  if (t_m)
    trace("attach", t_m, d->pool_id);
  s = gpupool__hmap_get(&c->slabs, d->slab->id);
  if (s && !d->read_only && !s->writable && !s->base_rw) {
    /* Mapped read-only so far; this hold may write: map it again, read-write. */
    slab_export *ex = gpupool__hmap_get(&c->exports, d->slab->id);
    void *priv = NULL;
    if (!ex || !ex->writable) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon sent no writable mapping for slab %" PRIu64, d->slab->id);
      goto fail;
    }
    gpupool__hmap_del(&c->exports, s->id);
    rc = c->be->slab_map(p->bp, ex->data, ex->len, s->size, ex->fd, 1, &s->base_rw, &priv);
    ex->fd = -1;
    export_free(ex);
    if (rc != 0)
      goto fail;
  }
  if (!s) {
    slab_export *ex = gpupool__hmap_get(&c->exports, d->slab->id);
    if (!ex) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon sent no export data for slab %" PRIu64, d->slab->id);
      goto fail;
    }
    s = calloc(1, sizeof *s);
    if (!s) {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
      goto fail;
    }
    s->id = d->slab->id;
    s->pool = p;
    s->size = d->slab->size;
    s->dedicated = d->slab->dedicated;
    s->writable = ex->writable;
    rc = c->be->slab_map(p->bp, ex->data, ex->len, s->size, ex->fd, ex->writable, &s->base, &s->priv);
    gpupool__hmap_del(&c->exports, s->id);
    ex->fd = -1; /* taken by slab_map */
    export_free(ex);
    if (rc != 0) {
      free(s);
      /* Tell the daemon we do not map it, so it does not wait for us. */
      note_unmapped(c, d->slab->id);
      goto fail;
    }
    if (gpupool__hmap_put(&c->slabs, s->id, s) != 0) {
      c->be->slab_unmap(p->bp, s->base, s->size, s->priv, NULL);
      note_unmapped(c, s->id);
      free(s);
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
      goto fail;
    }
    new_slab = 1;
  }
  if (d->offset > s->size || d->size > s->size - d->offset) {
    rc = gpupool__err(GPUPOOL_EPROTO, "buffer %" PRIu64 "+%" PRIu64 " lies outside its slab", d->offset, d->size);
    goto fail_slab;
  }
  if (!d->read_only && !s->writable && !s->base_rw) {
    /* A new slab whose export data came read-only, for a hold that may write. */
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon sent a read-only mapping of slab %" PRIu64 " for a writable hold",
                      s->id);
    goto fail_slab;
  }
  if (t_m)
    trace("slab", t_m, d->slab->id);
  if ((rc = event_get(c, d->ready, &ready)) != 0 || (rc = event_get(c, d->done, &done)) != 0)
    goto fail_slab;
  if (t_m)
    trace("events", t_m, d->ready ? d->ready->id : 0);
  /* Make the caller's stream wait for the producer's work, unless it has already finished
   * (then the wait would only cost time). */
  if (wait_ready && ready && !(c->be->event_query && c->be->event_query(ready) == 1) &&
      (rc = c->be->stream_wait(ready, stream)) != 0)
    goto fail_slab;
  if (t_m)
    trace("wait", t_m, 0);
  if (d->tensor && d->tensor->present && (rc = gpupool__wire_meta_from(d->tensor, d->size, &meta)) != 0) {
    rc = gpupool__err(GPUPOOL_EPROTO, "gpupoold sent tensor metadata this library refuses: %s",
                      gpupool__errmsg());
    goto fail_slab;
  }
  b = calloc(1, sizeof *b);
  if (!b) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    goto fail_slab;
  }
  b->c = c;
  b->hold_id = d->hold_id;
  b->buffer_id = d->buffer_id;
  b->slab = s;
  b->base = d->read_only || s->writable ? s->base : s->base_rw;
  b->offset = d->offset;
  b->size = d->size;
  b->read_only = d->read_only;
  b->ready_id = d->ready ? d->ready->id : 0;
  b->done_id = d->done ? d->done->id : 0;
  if (d->tensor && d->tensor->present) {
    b->meta = meta;
    b->has_meta = 1;
  }
  s->refs++;
  b->next = c->buffers;
  if (c->buffers)
    c->buffers->prev = b;
  c->buffers = b;
  *out = b;
  return 0;
fail_slab:
  if (new_slab && s->refs == 0)
    slab_unmap(c, s, NULL);
fail:
  if (d && d->hold_id) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    send_release(c, d->hold_id, 0);
    gpupool__err(rc, "%s", msg);
  }
  return rc;
}

/* ---- public API -------------------------------------------------------------------------------- */

/* "owner root, group gpupool, mode 0660" of the socket at path, for permission errors. */
static void describe_socket(const char *path, char *buf, size_t len) {
  struct stat st;
  struct passwd pw, *pwp = NULL;
  struct group gr, *grp = NULL;
  char pwbuf[1024], grbuf[4096], u[16], g[16];
  if (stat(path, &st) != 0) {
    snprintf(buf, len, "its directory cannot be searched by this user: %s", strerror(errno));
    return;
  }
  (void)getpwuid_r(st.st_uid, &pw, pwbuf, sizeof pwbuf, &pwp);
  (void)getgrgid_r(st.st_gid, &gr, grbuf, sizeof grbuf, &grp);
  snprintf(u, sizeof u, "%u", (unsigned)st.st_uid);
  snprintf(g, sizeof g, "%u", (unsigned)st.st_gid);
  snprintf(buf, len, "owner %s, group %s, mode %04o", pwp ? pwp->pw_name : u, grp ? grp->gr_name : g,
           (unsigned)(st.st_mode & 07777));
}

static void ms_to_timeval(int ms, struct timeval *tv) {
  tv->tv_sec = ms > 0 ? ms / 1000 : 0;
  tv->tv_usec = ms > 0 ? (ms % 1000) * 1000 : 0;
}

/* Backoff between connects refused because the daemon's accept queue is full. */
#define CONNECT_RETRY_FIRST_MS 1
#define CONNECT_RETRY_MAX_MS 50

static int connect_socket(const char *path, int timeout_ms, int *out) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  struct timeval tv;
  uint64_t deadline = mono_ns() + (timeout_ms > 0 ? (uint64_t)timeout_ms * 1000000u : 0);
  int fd, tries = 0, pause_ms = CONNECT_RETRY_FIRST_MS;
  if (strlen(path) >= sizeof addr.sun_path)
    return gpupool__err(GPUPOOL_EINVAL, "socket path '%s' is longer than %zu bytes", path, sizeof addr.sun_path - 1);
  strcpy(addr.sun_path, path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return gpupool__err(GPUPOOL_ECONNECT, "socket: %s", strerror(errno));
  /* connect() on a Unix socket whose listener is stopped blocks once the backlog is full:
   * SO_SNDTIMEO bounds it (and the Hello that follows). */
  ms_to_timeval(timeout_ms, &tv);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while (tries++, connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    int e = errno;
    char what[160];
    uint64_t now;
    if (e == EINTR)
      continue;
    /* The accept queue was full (a flood, or a daemon busy for a moment): a place may open
     * before the timeout, so try again after a short pause rather than fail at once. */
    if (e == EAGAIN && (timeout_ms < 0 || (now = mono_ns()) < deadline)) {
      int ms = pause_ms;
      if (timeout_ms > 0 && (uint64_t)ms * 1000000u > deadline - now)
        ms = (int)((deadline - now) / 1000000u) + 1;
      if (timeout_ms > 0) {
        /* What is left of the timeout bounds the next wait in connect(). */
        ms_to_timeval((int)((deadline - now) / 1000000u) + 1, &tv);
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
      }
      poll(NULL, 0, ms);
      pause_ms = pause_ms * 2 > CONNECT_RETRY_MAX_MS ? CONNECT_RETRY_MAX_MS : pause_ms * 2;
      continue;
    }
    close(fd);
    if (e == ENOENT || e == ECONNREFUSED)
      return gpupool__err(GPUPOOL_ECONNECT,
                          "cannot connect to gpupoold at %s: %s; is the daemon running? Start it "
                          "(gpupoold --socket %s, or systemctl start gpupoold.socket) or set GPUPOOL_SOCKET",
                          path, strerror(e), path);
    if (e == EACCES || e == EPERM) {
      describe_socket(path, what, sizeof what);
      return gpupool__err(GPUPOOL_ECONNECT,
                          "cannot connect to gpupoold at %s: permission denied (%s); connecting needs "
                          "write access to the socket: join its group or ask the operator",
                          path, what);
    }
    if (e == EAGAIN)
      return gpupool__err(GPUPOOL_ETIMEDOUT,
                          "the daemon did not answer in %g s: gpupoold at %s kept its queue of waiting "
                          "connections full all that time (%d tries): it is stopped, stuck or flooded with "
                          "connections (see 'systemctl status gpupoold' and its log; the queue is listen_backlog "
                          "in its config); the timeout is gpupool_connect_timeout() or GPUPOOL_CONNECT_TIMEOUT_MS",
                          timeout_ms / 1000.0, path, tries);
    if (e == EINPROGRESS || e == ETIMEDOUT)
      return gpupool__err(GPUPOOL_ETIMEDOUT,
                          "the daemon did not answer in %g s: gpupoold at %s accepts no connections "
                          "(stopped or stuck? see 'systemctl status gpupoold')",
                          timeout_ms / 1000.0, path);
    return gpupool__err(GPUPOOL_ECONNECT, "cannot connect to gpupoold at %s: %s", path, strerror(e));
  }
  *out = fd;
  return 0;
}

/* Whether this connection orders GPU work without the daemon's inter-process events. CUDA
 * backs each such event with a file in /dev/shm that only the daemon's uid may open: a client
 * of another uid (root excepted) synchronizes its stream before Publish and Release instead,
 * and the daemon holds its gets back until the producer's work is done. GPUPOOL_HOST_FENCES
 * decides instead when set (1: always, e.g. in a container with its own /dev/shm; 0: never). */
static int host_fences_for(gpupool_client *c, const Gpupool__Wire__HelloReply *hr) {
  int want;
  /* A daemon that does not hold gets back would hand over unfinished work: then events it is
   * (failing with the reason when they cannot be opened). */
  if (!c->be->has_events || !hr->host_fences)
    return 0;
  /* The daemon's own uid (the socket's peer may be the service manager, under socket
   * activation). */
  want = c->host_fences_env >= 0 ? c->host_fences_env : geteuid() != 0 && hr->daemon_uid != geteuid();
  return want;
}

/* Connect to c->socket_path and say Hello; fills the pool list. With c->mu held and
 * c->fd == -1. On failure the fd is closed again. */
static int handshake(gpupool_client *c) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Hello hello = GPUPOOL__WIRE__HELLO__INIT;
  gpupool__rep *rep = NULL;
  const Gpupool__Wire__HelloReply *hr;
  int rc, fd = -1, lease = -1;

  c->hs_closed = 0;
  if ((rc = connect_socket(c->socket_path, c->connect_timeout_ms, &fd)) != 0)
    return rc;
  c->fd = fd;
  c->broken = 0;
  c->broken_msg[0] = '\0';
  gpupool__wire_rx_reset(&c->rx);
  if (c->connect_timeout_ms > 0)
    c->hs_deadline_ns = mono_ns() + (uint64_t)c->connect_timeout_ms * 1000000u;
  hello.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  hello.client_name = c->name;
  hello.pid = (int32_t)getpid();
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req.hello = &hello;
  rc = call(c, &req, &rep, &lease);
  c->hs_deadline_ns = 0;
  if (rc != 0) {
    if (c->broken == GPUPOOL_ETIMEDOUT || c->broken == GPUPOOL_EPROTO)
      rc = gpupool__err(c->broken, "%s", c->broken_msg);
    goto fail;
  }
  {
    /* Requests after Hello wait as long as they need (gets and allocations have their own
     * timeouts, kept by the daemon). */
    struct timeval tv = {0, 0};
    (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    (void)setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  hr = rep->hello;
  if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_HELLO || !hr) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered Hello with something else");
    goto fail;
  }
  if (hr->lease && lease < 0) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon announced a lease but sent no fd with its Hello reply");
    goto fail;
  }
  if (!hr->lease && lease >= 0) {
    close(lease); /* an fd this library did not ask for */
    lease = -1;
  }
  if (hr->protocol_version != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION) {
    rc = gpupool__err(GPUPOOL_EVERSION, "gpupoold %s speaks protocol %u, this library (%s) speaks %d",
                      hr->daemon_version, hr->protocol_version, GPUPOOL_VERSION_STRING,
                      GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
    goto fail;
  }
  c->client_id = hr->client_id;
  c->max_frame = hr->max_frame;
  c->backend_kind = hr->backend;
  {
    const gpupool__backend_desc *d = gpupool__backend_by_kind(hr->backend);
    if (!d) {
      rc = gpupool__err(GPUPOOL_EPROTO, "gpupoold %s runs backend %d, which this library (%s) does "
                        "not know; upgrade libgpupool-client", hr->daemon_version, hr->backend,
                        GPUPOOL_VERSION_STRING);
      goto fail;
    }
    if (!d->client) {
      rc = gpupool__err(GPUPOOL_ENOTSUP,
                        "gpupoold serves %s but this libgpupool-client was built without it; "
                        "rebuild it with the CUDA toolkit", d->what);
      goto fail;
    }
    c->be = d->client;
  }
  c->host_fences = host_fences_for(c, hr);
  c->pools = calloc(hr->n_pools ? hr->n_pools : 1, sizeof *c->pools);
  if (!c->pools) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    goto fail;
  }
  c->npools = 0;
  for (size_t i = 0; i < hr->n_pools; i++) {
    const Gpupool__Wire__PoolInfo *pi = hr->pools[i];
    cpool *p = &c->pools[c->npools++];
    p->id = pi->id;
    snprintf(p->name, sizeof p->name, "%s", pi->name ? pi->name : "");
    if ((rc = gpupool__wire_mem_kind(pi->location, &p->kind)) != 0)
      goto fail;
    p->device = pi->device;
    p->capacity = pi->capacity;
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  c->lease_fd = lease;
  return 0;
fail:
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  if (lease >= 0)
    close(lease);
  close(c->fd);
  c->fd = -1;
  if (!c->broken)
    set_broken(c, GPUPOOL_ECLOSED, gpupool__errmsg());
  return rc;
}

static void stale_gen_free(gpupool_client *c, stale_gen *g) {
  stale_gen **pp;
  for (pp = &c->stale; *pp && *pp != g; pp = &(*pp)->next)
    ;
  if (*pp)
    *pp = g->next;
  if (c->be && c->be->has_events)
    for (size_t i = 0; i < g->events.cap; i++)
      if (gpupool__hmap_slot_used(&g->events, i))
        c->be->event_close(g->events.slots[i].val);
  gpupool__hmap_free(&g->events);
  for (int i = 0; i < g->npools; i++)
    if (g->pools[i].bp)
      c->be->pool_release(g->pools[i].bp);
  free(g->pools);
  /* Last: no mapping of that daemon's memory is left in this process. */
  if (g->lease_fd >= 0)
    close(g->lease_fd);
  free(g);
}

/* The daemon went away: keep what this process still maps (buffers stay readable), mark every
 * hold and published name lost, and connect again with backoff for up to reconnect_ms.
 * With c->mu held. */
static void layout_cache_clear(gpupool_client *c);

static int reconnect(gpupool_client *c) {
  stale_gen *g;
  uint64_t start = 0;
  long delay_ms = 20;
  int rc;
  struct timespec ts;

  while (c->reader_active)
    pthread_cond_wait(&c->cv, &c->mu);
  if (!c->broken)
    return 0; /* another thread reconnected meanwhile */
  if (c->fd >= 0) {
    close(c->fd);
    c->fd = -1;
    g = calloc(1, sizeof *g);
    if (!g)
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    g->pools = c->pools;
    g->npools = c->npools;
    g->events = c->events;
    g->lease_fd = c->lease_fd;
    c->lease_fd = -1;
    gpupool__hmap_init(&c->events);
    for (size_t i = 0; i < c->slabs.cap; i++)
      if (gpupool__hmap_slot_used(&c->slabs, i)) {
        cslab *s = c->slabs.slots[i].val;
        if (s->refs == 0) {
          /* Kept for reuse by a daemon that is gone: nothing will use it again. */
          c->be->slab_unmap(s->pool->bp, s->base, s->size, s->priv, NULL);
          free(s);
          continue;
        }
        s->stale = g;
        g->live_slabs++;
      }
    if (c->be && c->be->sync)
      c->be->sync(NULL);
    gpupool__hmap_free(&c->slabs);
    gpupool__hmap_init(&c->slabs);
    exports_clear(c);
    layout_cache_clear(c);
    c->pools = NULL;
    c->npools = 0;
    c->nunmapped = 0;
    g->next = c->stale;
    c->stale = g;
    if (g->live_slabs == 0)
      stale_gen_free(c, g);
    for (gpupool_buffer *b = c->buffers; b; b = b->next)
      if (!b->lost) {
        b->lost = 1;
        c->holds_lost++;
      }
    for (size_t i = 0; i < c->npublished; i++) {
      char **n = realloc(c->lost_names, (c->nlost_names + 1) * sizeof *n);
      if (!n) {
        free(c->published[i]);
        continue;
      }
      c->lost_names = n;
      c->lost_names[c->nlost_names++] = c->published[i];
    }
    c->npublished = 0;
  }
  clock_gettime(CLOCK_MONOTONIC, &ts);
  start = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
  for (;;) {
    uint64_t now;
    rc = handshake(c);
    if (rc == 0)
      break;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    /* Refused outright (wrong version, not allowed, over a limit): give up. Nobody
     * listening, or a connection that closed before the Hello reply (a daemon still going
     * down or coming up): try again within the budget. */
    if ((rc != GPUPOOL_ECONNECT && rc != GPUPOOL_ECLOSED && rc != GPUPOOL_EIO &&
         !(rc == GPUPOOL_EPROTO && c->hs_closed)) ||
        now - start >= (uint64_t)c->reconnect_ms) {
      char msg[GPUPOOL__ERRMSG_MAX];
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      return gpupool__err(rc, "the daemon went away and did not come back within %d ms: %s", c->reconnect_ms, msg);
    }
    /* Sleep without the lock so other threads can fail fast or see the new connection. */
    pthread_mutex_unlock(&c->mu);
    ts.tv_sec = delay_ms / 1000;
    ts.tv_nsec = (delay_ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&c->mu);
    if (!c->broken)
      return 0;
    delay_ms = delay_ms * 2 > 500 ? 500 : delay_ms * 2;
  }
  c->reconnects++;
  return 0;
}

/* Called first by every public entry point (with c->mu held): a connection that the daemon
 * closed is replaced before the request, so holds never cross from one daemon to the next. */
static int ensure_connected(gpupool_client *c) {
  if (!c->broken)
    return 0;
  if ((c->broken != GPUPOOL_ECLOSED && c->broken != GPUPOOL_EIO) || c->reconnect_ms <= 0)
    return broken_err(c);
  return reconnect(c);
}

/* For requests that do not name a hold of the old connection (allocate, get, open,
 * unpublish, stats, trim, publish_file): when the daemon turns out to be gone, reconnect and
 * send once more. Safe: whatever the lost connection held was dropped with it. send_fd: an
 * fd that goes with the request (the caller keeps it), or -1. */
static int call_retry(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int send_fd) {
  int rc = ensure_connected(c);
  if (rc != 0)
    return rc;
  rc = call_fds(c, req, out, NULL, send_fd);
  if ((rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO) && c->broken && c->reconnect_ms > 0) {
    if ((rc = ensure_connected(c)) != 0)
      return rc;
    rc = call_fds(c, req, out, NULL, send_fd);
  }
  return rc;
}

int gpupool_connect(const char *socket_path, const char *client_name, gpupool_client **out) {
  return gpupool_connect_timeout(socket_path, client_name, 0, out);
}

/* The daemon refuses a Hello whose client name is not UTF-8 (every string on the wire must
 * be), and the name is only shown in logs: rather than fail the connect, bytes that are not
 * UTF-8 become '?', a character cut by the copy's length limit included. */
static void utf8_scrub(char *s) {
  size_t bad;
  while (gpupool__wire_utf8_check((const uint8_t *)s, strlen(s), &bad) != 0)
    s[bad] = '?';
}

int gpupool_connect_timeout(const char *socket_path, const char *client_name, int timeout_ms,
                            gpupool_client **out) {
  gpupool_client *c;
  const char *env;
  int rc;

  gpupool__err_clear();
  if (!out)
    return gpupool__err(GPUPOOL_EINVAL, "out is NULL");
  *out = NULL;
  c = calloc(1, sizeof *c);
  if (!c)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  if (!socket_path || !*socket_path) {
    if ((rc = gpupool_default_socket_path(c->socket_path, sizeof c->socket_path)) != 0) {
      free(c);
      return rc;
    }
  } else if (strlen(socket_path) >= sizeof c->socket_path) {
    free(c);
    return gpupool__err(GPUPOOL_EINVAL, "socket path '%s' is longer than %zu bytes", socket_path,
                        sizeof c->socket_path - 1);
  } else {
    strcpy(c->socket_path, socket_path);
  }
  snprintf(c->name, sizeof c->name, "%s", client_name ? client_name : "");
  utf8_scrub(c->name);
  env = getenv("GPUPOOL_RECONNECT_MS");
  c->reconnect_ms = env && *env ? atoi(env) : 5000;
  c->connect_timeout_ms = timeout_ms;
  if (timeout_ms == 0) {
    env = getenv("GPUPOOL_CONNECT_TIMEOUT_MS");
    c->connect_timeout_ms = env && *env ? atoi(env) : GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS;
    if (c->connect_timeout_ms == 0)
      c->connect_timeout_ms = GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS;
  }
  env = getenv("GPUPOOL_SPIN_US");
  c->spin_us = env && *env ? atoi(env) : 0;
  if (c->spin_us < 0 || c->spin_us > 1000000)
    c->spin_us = 0;
  env = getenv("GPUPOOL_HOST_FENCES");
  c->host_fences_env = env && *env ? atoi(env) != 0 : -1;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  gpupool__hmap_init(&c->slabs);
  gpupool__hmap_init(&c->exports);
  gpupool__hmap_init(&c->events);
  gpupool__smap_init(&c->layout_cache);
  gpupool__wire_rx_init(&c->rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  c->fd = -1;
  c->lease_fd = -1;
  pthread_mutex_lock(&c->mu);
  rc = handshake(c);
  pthread_mutex_unlock(&c->mu);
  if (rc != 0) {
    gpupool__wire_rx_reset(&c->rx);
    gpupool__hmap_free(&c->slabs);
    gpupool__hmap_free(&c->exports);
    gpupool__hmap_free(&c->events);
    free(c->pools);
    free(c->unmapped); /* revocations the refused Hello reply carried */
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    return rc;
  }
  *out = c;
  gpupool__err_clear();
  return 0;
}

int gpupool_set_reconnect(gpupool_client *c, int budget_ms) {
  if (!c || budget_ms < 0)
    return gpupool__err(GPUPOOL_EINVAL, "set_reconnect: client must not be NULL and the budget must be >= 0");
  pthread_mutex_lock(&c->mu);
  c->reconnect_ms = budget_ms;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

int gpupool_set_connect_timeout(gpupool_client *c, int timeout_ms) {
  if (!c || timeout_ms == 0)
    return gpupool__err(GPUPOOL_EINVAL, "set_connect_timeout: client must not be NULL and the "
                        "timeout must be > 0 ms (or negative to wait forever)");
  pthread_mutex_lock(&c->mu);
  c->connect_timeout_ms = timeout_ms;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

uint64_t gpupool_reconnect_count(gpupool_client *c) {
  uint64_t n;
  if (!c)
    return 0;
  pthread_mutex_lock(&c->mu);
  n = c->reconnects;
  pthread_mutex_unlock(&c->mu);
  return n;
}

int gpupool_lost_names(gpupool_client *c, char (*names)[GPUPOOL_NAME_MAX + 1], int max, int *n) {
  int k = 0;
  if (!c || !n || max < 0 || (max > 0 && !names))
    return gpupool__err(GPUPOOL_EINVAL, "lost_names: bad arguments");
  pthread_mutex_lock(&c->mu);
  while (k < max && c->nlost_names > 0) {
    char *nm = c->lost_names[--c->nlost_names];
    snprintf(names[k++], GPUPOOL_NAME_MAX + 1, "%s", nm);
    free(nm);
  }
  *n = k;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

int gpupool_buffer_lost(const gpupool_buffer *b) { return b ? b->lost : 0; }

static void note_published(gpupool_client *c, const char *name) {
  char *dup;
  if (c->npublished == c->cappublished) {
    size_t ncap = c->cappublished ? c->cappublished * 2 : 8;
    char **n = realloc(c->published, ncap * sizeof *n);
    if (!n)
      return;
    c->published = n;
    c->cappublished = ncap;
  }
  if ((dup = strdup(name)))
    c->published[c->npublished++] = dup;
}

static void note_unpublished(gpupool_client *c, const char *name) {
  for (size_t i = 0; i < c->npublished; i++)
    if (!strcmp(c->published[i], name)) {
      free(c->published[i]);
      c->published[i] = c->published[--c->npublished];
      return;
    }
}

int gpupool_set_devices(gpupool_client *c, const int *devices, int n) {
  int rc = 0;
  if (!c || n < 0 || n > 64 || (n > 0 && !devices))
    return gpupool__err(GPUPOOL_EINVAL, "set_devices: bad arguments (at most 64 devices)");
  gpupool__err_clear();
  pthread_mutex_lock(&c->mu);
  memcpy(c->devices, devices, (size_t)n * sizeof *devices);
  c->ndevices = n;
  /* Import every pool now, so a device pair without peer access is refused here, not at the
   * first buffer (pool_attach applies c->devices). */
  if ((rc = ensure_connected(c)) == 0)
    for (int i = 0; i < c->npools && rc == 0; i++) {
      rc = c->pools[i].bp ? c->be->pool_set_access(c->pools[i].bp, devices, n) : pool_attach(c, &c->pools[i]);
      /* A pool shared with a group this client is not in: it never gets memory of it. */
      if (rc == GPUPOOL_EPERM) {
        rc = 0;
        gpupool__err_clear();
      }
    }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static void buffer_unlink(gpupool_client *c, gpupool_buffer *b) {
  if (b->prev)
    b->prev->next = b->next;
  else
    c->buffers = b->next;
  if (b->next)
    b->next->prev = b->prev;
}

/* Order the work queued in `stream` before whoever comes next to a buffer (its consumers, for
 * the ready event e; the daemon's reuse, for a done event): nothing when the stream is idle
 * (an event would only make them wait for completed work); with host fences, wait for that
 * work here (nobody can wait on an event of ours); otherwise record e there, when there is
 * one. 1 when e was recorded, 0 when nothing was, < 0 on error. */
static int fence_stream(gpupool_client *c, gpupool__cevent *e, void *stream) {
  int rc;
  if (!c->host_fences && !e)
    return 0;
  if (c->be->stream_idle && c->be->stream_idle(stream) == 1)
    return 0;
  if (c->host_fences)
    return c->be->sync ? c->be->sync(stream) : 0;
  rc = c->be->event_record(e, stream);
  return rc < 0 ? rc : 1;
}

/* Drop b's local state (and free b). With the lock held. *hold_id is the hold to release at
 * the daemon (0 when there is none: b's daemon is gone), *recorded whether its done event was
 * recorded in `stream`. */
static void release_local(gpupool_client *c, gpupool_buffer *b, void *stream, uint64_t *hold_id, int *recorded) {
  cslab *s = b->slab;
  gpupool__cevent *done = b->done_id ? gpupool__hmap_get(&c->events, b->done_id) : NULL;

  *hold_id = 0;
  *recorded = 0;
  buffer_unlink(c, b);
  s->refs--;
  if (b->lost) {
    /* Its daemon is gone: nothing to tell; unmap once no buffer of ours needs the slab. */
    stale_gen *g = s->stale;
    if (s->refs == 0) {
      be_unmap(c, s, stream);
      free(s);
      if (g && --g->live_slabs == 0)
        stale_gen_free(c, g);
    }
    free(b);
    return;
  }
  /* A dedicated slab holds only this buffer: unmap it now, in stream order, before the done
   * event, so the daemon frees the allocation only after our import is gone. */
  if (s->refs == 0 && s->dedicated && !s->keep)
    slab_unmap(c, s, stream);
  /* The daemon may reuse the range once it has the release and the done event (if recorded)
   * has completed. */
  switch (fence_stream(c, done, stream)) {
  case 1:
    *recorded = 1;
    break;
  case 0:
    break;
  default:
    fprintf(stderr, "libgpupool-client: %s failed (%s); the daemon will treat the buffer as idle\n",
            c->host_fences ? "synchronizing the stream before a release" : "recording the done event",
            gpupool__errmsg());
  }
  *hold_id = b->hold_id;
  free(b);
}

static void release_request(gpupool__req *req, Gpupool__Wire__Release *rl, uint64_t hold_id, int recorded) {
  gpupool__wire__release__init(rl);
  rl->hold_id = hold_id;
  rl->done_recorded = recorded;
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_RELEASE;
  req->release = rl;
}

/* Drop b's local state and tell the daemon. With the lock held. */
static int release_locked(gpupool_client *c, gpupool_buffer *b, void *stream) {
  uint64_t hold_id;
  int recorded;
  release_local(c, b, stream, &hold_id, &recorded);
  return hold_id ? send_release(c, hold_id, recorded) : 0;
}

/* Release several buffers with their requests in flight together (one round trip). */
static int release_many_locked(gpupool_client *c, gpupool_buffer **bs, int n, void *stream) {
  pending **ps = calloc((size_t)n, sizeof *ps);
  int rc = 0;
  if (!ps) {
    for (int i = 0; i < n; i++) {
      int r = release_locked(c, bs[i], stream);
      if (!rc)
        rc = r;
    }
    return rc;
  }
  for (int i = 0; i < n; i++) {
    gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Release rl;
    uint64_t hold_id;
    int recorded, r;
    release_local(c, bs[i], stream, &hold_id, &recorded);
    if (!hold_id)
      continue;
    release_request(&req, &rl, hold_id, recorded);
    if ((r = call_send(c, &req, &ps[i], -1)) != 0 && !rc)
      rc = r;
  }
  for (int i = 0; i < n; i++) {
    gpupool__rep *rep;
    int r;
    if (!ps[i])
      continue;
    if ((r = call_wait(c, ps[i], &rep, NULL, NULL)) == 0)
      gpupool__wire__reply__free_unpacked(rep, NULL);
    else if (!rc)
      rc = r;
  }
  free(ps);
  return rc;
}

int gpupool_release(gpupool_buffer *b, void *stream) {
  gpupool_client *c;
  int rc;
  if (!b)
    return gpupool__err(GPUPOOL_EINVAL, "release: buffer is NULL");
  gpupool__err_clear();
  c = b->c;
  pthread_mutex_lock(&c->mu);
  ensure_connected(c); /* marks b lost if its daemon went away */
  rc = release_locked(c, b, stream);
  pthread_mutex_unlock(&c->mu);
  /* A broken connection already dropped the hold: the memory is the daemon's again. */
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : rc;
}

void gpupool_disconnect(gpupool_client *c) {
  if (!c)
    return;
  pthread_mutex_lock(&c->mu);
  /* Lost buffers unmap their dead daemon's slabs as they go, and the last one of a
   * generation closes that generation's pools, events and lease. */
  while (c->buffers)
    release_locked(c, c->buffers, NULL);
  for (size_t i = 0; i < c->slabs.cap; i++)
    if (gpupool__hmap_slot_used(&c->slabs, i)) {
      cslab *s = c->slabs.slots[i].val;
      be_unmap(c, s, NULL);
      free(s);
    }
  gpupool__hmap_free(&c->slabs);
  if (c->be && c->be->sync)
    c->be->sync(NULL); /* imports freed before the daemon sees this connection close */
  exports_clear(c);
  gpupool__hmap_free(&c->exports);
  layout_cache_clear(c);
  gpupool__smap_free(&c->layout_cache);
  if (c->be && c->be->has_events)
    for (size_t i = 0; i < c->events.cap; i++)
      if (gpupool__hmap_slot_used(&c->events, i))
        c->be->event_close(c->events.slots[i].val);
  gpupool__hmap_free(&c->events);
  for (int i = 0; i < c->npools; i++)
    if (c->pools[i].bp)
      c->be->pool_release(c->pools[i].bp);
  while (c->stale)
    stale_gen_free(c, c->stale);
  pthread_mutex_unlock(&c->mu);
  /* Nothing of the daemon's memory is mapped any more: the lease goes first, so the daemon
   * finds it gone when it sees the connection close. */
  if (c->lease_fd >= 0)
    close(c->lease_fd);
  if (c->fd >= 0)
    close(c->fd);
  gpupool__wire_rx_reset(&c->rx);
  free(c->pools);
  free(c->unmapped);
  for (size_t i = 0; i < c->npublished; i++)
    free(c->published[i]);
  free(c->published);
  for (size_t i = 0; i < c->nlost_names; i++)
    free(c->lost_names[i]);
  free(c->lost_names);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  free(c);
}

static uint32_t wire_timeout(int timeout_ms) {
  return timeout_ms < 0 ? GPUPOOL_WAIT_FOREVER : (uint32_t)timeout_ms;
}

int gpupool_alloc(gpupool_client *c, const char *pool, size_t size, int timeout_ms, void *stream,
                  gpupool_buffer **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  gpupool__rep *rep;
  int rc;

  if (!c || !out)
    return gpupool__err(GPUPOOL_EINVAL, "alloc: client and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "cannot allocate 0 bytes; ask for at least 1");
  al.pool_name = (char *)(pool ? pool : "");
  al.size = size;
  al.timeout_ms = wire_timeout(timeout_ms);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  pthread_mutex_lock(&c->mu);
  rc = call_retry(c, &req, &rep, -1);
  if (rc == 0) {
    /* A fresh range: the daemon reuses ranges only after their last holders' done events,
     * so there is nothing to wait for. */
    rc = materialize(c, reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE), 0, stream, out);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static int lost_err(const gpupool_buffer *b) {
  return gpupool__err(GPUPOOL_ELOST,
                      "buffer %" PRIu64 " belonged to a gpupoold that has gone away: its hold and names were lost "
                      "(the memory stays readable here until released); allocate or get it again",
                      b->buffer_id);
}

static int record_ready(gpupool_client *c, gpupool_buffer *b, void *stream) {
  gpupool__cevent *e = b->ready_id ? gpupool__hmap_get(&c->events, b->ready_id) : NULL;
  uint64_t t0 = TRACE_ON() ? mono_ns() : 0;
  int rc = fence_stream(c, e, stream);
  if (t0)
    trace("record_ready", t0, b->ready_id);
  return rc < 0 ? rc : 0;
}

/* Before b goes to others (share, publish): connected, b not lost with a previous daemon, and
 * its ready event recorded in stream (or the stream waited for, with host fences). With c->mu
 * held. */
static int hand_over_prepare(gpupool_client *c, gpupool_buffer *b, void *stream) {
  int rc = ensure_connected(c);
  if (rc == 0 && b->lost)
    rc = lost_err(b);
  return rc == 0 ? record_ready(c, b, stream) : rc;
}

int gpupool_host_fences(gpupool_client *c) {
  int on;
  if (!c)
    return 0;
  pthread_mutex_lock(&c->mu);
  on = c->host_fences;
  pthread_mutex_unlock(&c->mu);
  return on;
}

int gpupool_share(gpupool_buffer *b, void *stream, gpupool_token *out) {
  gpupool_client *c;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Share sh = GPUPOOL__WIRE__SHARE__INIT;
  gpupool__rep *rep;
  int rc;

  if (!b || !out)
    return gpupool__err(GPUPOOL_EINVAL, "share: buffer and out must not be NULL");
  gpupool__err_clear();
  c = b->c;
  sh.hold_id = b->hold_id;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_SHARE;
  req.share = &sh;
  pthread_mutex_lock(&c->mu);
  if ((rc = hand_over_prepare(c, b, stream)) == 0 && (rc = call(c, &req, &rep, NULL)) == 0) {
    if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_SHARE || !rep->share ||
        rep->share->token.len != GPUPOOL_TOKEN_SIZE)
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon sent a malformed share token");
    else
      memcpy(out->bytes, rep->share->token.data, GPUPOOL_TOKEN_SIZE);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* GPUPOOL_KEEP_MAPPED: b's slab stays mapped after its last buffer goes, until revoked. */
static void keep_mapped(gpupool_buffer *b, unsigned flags) {
  if (b && (flags & GPUPOOL_KEEP_MAPPED))
    b->slab->keep = 1;
}

int gpupool_open(gpupool_client *c, const gpupool_token *token, unsigned flags, void *stream,
                 gpupool_buffer **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Open op = GPUPOOL__WIRE__OPEN__INIT;
  gpupool__rep *rep;
  int rc;

  if (!c || !token || !out)
    return gpupool__err(GPUPOOL_EINVAL, "open: client, token and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  op.token.data = (uint8_t *)token->bytes;
  op.token.len = GPUPOOL_TOKEN_SIZE;
  op.read_only = (flags & GPUPOOL_READ_ONLY) != 0;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_OPEN;
  req.open = &op;
  pthread_mutex_lock(&c->mu);
  rc = call_retry(c, &req, &rep, -1);
  if (rc == 0) {
    rc = materialize(c, reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_OPEN), 1, stream, out);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    if (rc == 0)
      keep_mapped(*out, flags);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* The version a publish reply carries (0 when the daemon is too old to say). */
static uint64_t reply_version(const gpupool__rep *rep) {
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_PUBLISH && rep->publish)
    return rep->publish->version;
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_PUBLISH_BUNDLE && rep->publish_bundle)
    return rep->publish_bundle->version;
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_GET && rep->get)
    return rep->get->version;
  return 0;
}

/* Checks a publish of b and fills its request (pb, tm: the caller's storage). */
static int publish_request(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, uint32_t share_gid,
                           int share_all, gpupool__req *req, Gpupool__Wire__Publish *pb,
                           Gpupool__Wire__TensorMeta *tm) {
  int rc;
  if (!b || !name)
    return gpupool__err(GPUPOOL_EINVAL, "publish: buffer and name must not be NULL");
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gpupool__wire__publish__init(pb);
  if (meta) {
    if ((rc = gpupool__wire_meta_check(meta, b->size)) != 0)
      return rc;
    gpupool__wire_meta_to(meta, tm);
    pb->tensor = tm;
  }
  pb->hold_id = b->hold_id;
  pb->name = (char *)name;
  pb->share_gid = share_gid;
  pb->share_all = share_all != 0;
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
  req->publish = pb;
  return 0;
}

static void published_locally(gpupool_client *c, gpupool_buffer *b, const char *name,
                              const gpupool_tensor_meta *meta) {
  note_published(c, name);
  if (meta) {
    b->meta = *meta;
    b->has_meta = 1;
  }
}

static int publish_common(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream,
                          uint32_t share_gid, int share_all, uint64_t *version) {
  gpupool_client *c;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Publish pb;
  Gpupool__Wire__TensorMeta tm = GPUPOOL__WIRE__TENSOR_META__INIT;
  gpupool__rep *rep;
  int rc;

  gpupool__err_clear();
  if (version)
    *version = 0;
  if ((rc = publish_request(b, name, meta, share_gid, share_all, &req, &pb, &tm)) != 0)
    return rc;
  c = b->c;
  pthread_mutex_lock(&c->mu);
  if ((rc = hand_over_prepare(c, b, stream)) == 0 && (rc = call(c, &req, &rep, NULL)) == 0) {
    if (version)
      *version = reply_version(rep);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    published_locally(c, b, name, meta);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_publish_ex(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream,
                       uint32_t share_gid, int share_all) {
  return publish_common(b, name, meta, stream, share_gid, share_all, NULL);
}

int gpupool_publish(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream) {
  return publish_common(b, name, meta, stream, 0, 0, NULL);
}

int gpupool_publish_version(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream,
                            uint64_t *version) {
  return publish_common(b, name, meta, stream, 0, 0, version);
}

/* A get waiting for a publisher when the daemon goes away was dropped with its connection:
 * ask the next daemon again for what is left of its timeout (a name published there ends the
 * wait), as often as the daemon restarts within that time. With c->mu held. */
static int get_across_restarts(gpupool_client *c, gpupool__req *req, uint32_t *wire_timeout_ms, int timeout_ms,
                               gpupool__rep **out, uint64_t *known_layout) {
  uint64_t start = mono_ns() / 1000000;
  int rc = ensure_connected(c);
  if (rc != 0)
    return rc;
  for (int attempt = 0;; attempt++) {
    uint64_t spent;
    int last = attempt > 0 && *wire_timeout_ms == 0; /* the final try already asked for no wait */
    rc = call(c, req, out, NULL);
    if ((rc != GPUPOOL_ECLOSED && rc != GPUPOOL_EIO) || !c->broken || c->reconnect_ms <= 0 || last)
      return rc;
    if ((rc = ensure_connected(c)) != 0)
      return rc;
    if (known_layout)
      *known_layout = 0; /* a layout id of the daemon that went away names nothing here */
    spent = mono_ns() / 1000000 - start;
    if (timeout_ms >= 0)
      *wire_timeout_ms = spent >= (uint64_t)timeout_ms ? 0 : (uint32_t)((uint64_t)timeout_ms - spent);
  }
}

static int get_request(const char *name, uint64_t newer_than, int timeout_ms, unsigned flags, gpupool__req *req,
                       Gpupool__Wire__Get *gt) {
  int rc;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gpupool__wire__get__init(gt);
  gt->name = (char *)name;
  gt->timeout_ms = wire_timeout(timeout_ms);
  gt->read_only = (flags & GPUPOOL_READ_ONLY) != 0;
  gt->newer_than = newer_than;
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  req->get = gt;
  return 0;
}

/* A Get's reply turned into the caller's buffer (and version), the reply freed; blocking and
 * pipelined gets alike. With c->mu held. */
static int get_finish(gpupool_client *c, gpupool__rep *rep, unsigned flags, void *stream, gpupool_buffer **out,
                      uint64_t *version) {
  int rc;
  if (version)
    *version = reply_version(rep);
  rc = materialize(c, reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_GET), 1, stream, out);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  if (rc == 0)
    keep_mapped(*out, flags);
  return rc;
}

int gpupool_get_newer(gpupool_client *c, const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                      void *stream, gpupool_buffer **out, uint64_t *version) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get gt;
  gpupool__rep *rep;
  int rc;

  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "get: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if (version)
    *version = 0;
  if ((rc = get_request(name, newer_than, timeout_ms, flags, &req, &gt)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  rc = get_across_restarts(c, &req, &gt.timeout_ms, timeout_ms, &rep, NULL);
  if (rc == 0)
    rc = get_finish(c, rep, flags, stream, out, version);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_get(gpupool_client *c, const char *name, int timeout_ms, unsigned flags, void *stream,
                gpupool_buffer **out) {
  return gpupool_get_newer(c, name, 0, timeout_ms, flags, stream, out, NULL);
}

/* ---- bundles --------------------------------------------------------------------------------- */

/* A member table as the daemon sent it, shared by the bundles laid out that way (members'
 * ptr fields are unset: a bundle adds its buffers' addresses) and cached per name, so a later
 * get of the same layout receives no members. */
typedef struct clayout {
  uint64_t id;               /* the daemon's layout id (0: none, e.g. a single buffer) */
  uint32_t refs;
  int n;
  uint32_t nbufs;
  gpupool_member *members;   /* ptr is NULL; name points into names */
  char *names;
  uint64_t *need;            /* per buffer: where its last member ends */
} clayout;

/* At most this many names keep a cached layout; past it the cache starts over. */
#define LAYOUT_CACHE_MAX 256

struct gpupool_bundle {
  gpupool_client *c;
  gpupool_buffer **bufs;  /* owned: one hold each */
  int nbufs;
  clayout *layout;        /* a reference */
  uint64_t version;
};

static void clayout_unref(clayout *l) {
  if (!l || --l->refs > 0)
    return;
  free(l->members);
  free(l->names);
  free(l->need);
  free(l);
}

/* Forget every cached layout (the daemon's ids mean nothing to another daemon). With c->mu. */
static void layout_cache_clear(gpupool_client *c) {
  for (size_t i = 0; i < c->layout_cache.cap; i++)
    if (gpupool__smap_slot_used(&c->layout_cache, i))
      clayout_unref(c->layout_cache.slots[i].val);
  gpupool__smap_free(&c->layout_cache);
  gpupool__smap_init(&c->layout_cache);
  c->nlayout_cache = 0;
}

/* The layout cached for name, or NULL. With c->mu. */
static clayout *layout_cached(gpupool_client *c, const char *name) {
  return name ? gpupool__smap_get(&c->layout_cache, name) : NULL;
}

/* Cache l (a new reference) as name's layout. With c->mu; out of memory it is just not cached. */
static void layout_cache_put(gpupool_client *c, const char *name, clayout *l) {
  clayout *old;
  if (!name || !l->id)
    return;
  old = gpupool__smap_get(&c->layout_cache, name);
  if (old == l)
    return;
  if (!old && c->nlayout_cache >= LAYOUT_CACHE_MAX)
    layout_cache_clear(c);
  if (old) {
    gpupool__smap_del(&c->layout_cache, name);
    clayout_unref(old);
    c->nlayout_cache--;
  }
  if (gpupool__smap_put(&c->layout_cache, name, l) == 0) {
    l->refs++;
    c->nlayout_cache++;
  }
}

/* A layout from a reply's member table, checked (buffer indexes, descriptions). */
static int clayout_from_wire(const Gpupool__Wire__Bundle *wb, clayout **out) {
  clayout *l = calloc(1, sizeof *l);
  size_t names_len = 0, i;
  char *np;
  int rc;
  for (i = 0; i < wb->n_members; i++)
    names_len += (wb->members[i]->name ? strlen(wb->members[i]->name) : 0) + 1;
  if (!l || !(l->members = calloc(wb->n_members, sizeof *l->members)) || !(l->names = malloc(names_len)) ||
      !(l->need = calloc(wb->n_buffers, sizeof *l->need))) {
    clayout_unref(l ? (l->refs = 1, l) : NULL);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a bundle of %zu members", wb->n_members);
  }
  l->refs = 1;
  l->id = wb->layout_id;
  l->nbufs = (uint32_t)wb->n_buffers;
  np = l->names;
  for (i = 0; i < wb->n_members; i++) {
    const Gpupool__Wire__BundleMember *wm = wb->members[i];
    gpupool_member *m = &l->members[i];
    size_t len = wm->name ? strlen(wm->name) : 0;
    if (wm->buffer >= wb->n_buffers || wm->size == 0 || wm->offset + wm->size < wm->offset) {
      clayout_unref(l);
      return gpupool__err(GPUPOOL_EPROTO, "the daemon sent member %zu in buffer %u of %zu (offset %" PRIu64
                          ", size %" PRIu64 ")", i, wm->buffer, wb->n_buffers, wm->offset, wm->size);
    }
    if (wm->tensor && wm->tensor->present) {
      if ((rc = gpupool__wire_meta_from(wm->tensor, wm->size, &m->meta)) != 0) {
        rc = gpupool__err(GPUPOOL_EPROTO, "gpupoold sent tensor metadata this library refuses for member %zu: %s",
                          i, gpupool__errmsg());
        clayout_unref(l);
        return rc;
      }
      m->has_meta = 1;
    }
    memcpy(np, wm->name ? wm->name : "", len + 1);
    m->name = np;
    np += len + 1;
    m->size = wm->size;
    m->buffer = (int)wm->buffer;
    m->offset = wm->offset;
    if (wm->offset + wm->size > l->need[wm->buffer])
      l->need[wm->buffer] = wm->offset + wm->size;
  }
  l->n = (int)wb->n_members;
  *out = l;
  return 0;
}

static void bundle_keep_mapped(gpupool_bundle *b, unsigned flags) {
  for (int i = 0; i < b->nbufs; i++)
    keep_mapped(b->bufs[i], flags);
}

static void bundle_free_local(gpupool_bundle *b) {
  if (!b)
    return;
  clayout_unref(b->layout);
  free(b->bufs);
  free(b);
}

/* Send a Release for every hold of a reply's bundle from index `from` on (they never became
 * buffers here). With c->mu held. */
static void release_holds_from(gpupool_client *c, const Gpupool__Wire__Bundle *wb, size_t from, uint64_t gen) {
  /* Holds of a daemon that has gone since the reply came went with it; their ids may name
   * other holds of the new one. */
  if (c->reconnects != gen)
    return;
  for (size_t i = from; wb && i < wb->n_buffers; i++)
    if (wb->buffers[i] && wb->buffers[i]->hold_id)
      send_release(c, wb->buffers[i]->hold_id, 0);
}

/* Turn a reply's Bundle into a bundle of this process: every buffer materialized (waiting on
 * its ready event in `stream` when wait_ready), the member table from the reply or, when the
 * reply left it out, `known` (the table the request said it had; the caller's reference),
 * checked against the buffers. A table that came
 * with the reply is cached for name (NULL: not cached). On failure every hold it carried is
 * released. With c->mu held. */
static int bundle_from_reply(gpupool_client *c, const Gpupool__Wire__Bundle *wb, int wait_ready, void *stream,
                             const char *name, clayout *known, gpupool_bundle **out) {
  gpupool_bundle *b = NULL;
  clayout *l = NULL;
  size_t i;
  int rc;
  uint64_t gen = c->reconnects; /* the reply's connection (materialize may let go of the lock) */

  if (!wb || wb->n_buffers == 0 || wb->n_members > GPUPOOL_BUNDLE_MAX_MEMBERS ||
      (wb->n_members && wb->n_buffers > wb->n_members)) {
    release_holds_from(c, wb, 0, gen);
    return gpupool__err(GPUPOOL_EPROTO, "the daemon sent a malformed bundle (%zu buffers, %zu members)",
                        wb ? wb->n_buffers : 0, wb ? wb->n_members : 0);
  }
  if (wb->n_members == 0) {
    /* The daemon saw that we have this table (the known_layout the request named). */
    l = known;
    if (!l || l->id != wb->layout_id || l->nbufs != wb->n_buffers) {
      release_holds_from(c, wb, 0, gen);
      return gpupool__err(GPUPOOL_EPROTO, "the daemon sent no members for layout %" PRIu64 ", which this client "
                          "does not have", wb->layout_id);
    }
    l->refs++;
  } else if ((rc = clayout_from_wire(wb, &l)) != 0) {
    release_holds_from(c, wb, 0, gen);
    return rc;
  }
  if (!(b = calloc(1, sizeof *b)) || !(b->bufs = calloc(wb->n_buffers, sizeof *b->bufs))) {
    if (b)
      free(b);
    clayout_unref(l);
    release_holds_from(c, wb, 0, gen);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a bundle of %zu buffers", wb->n_buffers);
  }
  b->c = c;
  b->layout = l;
  b->version = wb->version;
  for (i = 0; i < wb->n_buffers; i++) {
    if ((rc = materialize(c, wb->buffers[i], wait_ready, stream, &b->bufs[i])) != 0) {
      char msg[GPUPOOL__ERRMSG_MAX];
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      release_holds_from(c, wb, i + 1, gen); /* materialize released hold i */
      release_many_locked(c, b->bufs, (int)i, NULL);
      bundle_free_local(b);
      return gpupool__err(rc, "buffer %zu of the bundle: %s", i, msg);
    }
    b->nbufs = (int)i + 1;
    if (l->need[i] > b->bufs[i]->size) {
      release_holds_from(c, wb, i + 1, gen);
      release_many_locked(c, b->bufs, b->nbufs, NULL);
      bundle_free_local(b);
      return gpupool__err(GPUPOOL_EPROTO, "the daemon sent members past the end of buffer %zu", i);
    }
  }
  if (wb->n_members)
    layout_cache_put(c, name, l);
  *out = b;
  return 0;
}

/* Member i's name and description, checked here before any request goes out (the daemon
 * checks them again): 0, or the error naming the member. */
static int member_name_check(int i, const char *name) {
  int rc;
  if (!name || (rc = gpupool__wire_check_name(name)) != 0)
    return gpupool__err(GPUPOOL_ENAME, "member %d: %s", i, name ? gpupool__errmsg() : "name is NULL");
  return 0;
}

static int member_meta_check(int i, const char *name, const gpupool_tensor_meta *meta, uint64_t size) {
  int rc = gpupool__wire_meta_check(meta, size);
  return rc ? gpupool__err(rc, "member %d ('%s'): %s", i, name, gpupool__errmsg()) : 0;
}

int gpupool_bundle_alloc(gpupool_client *c, const char *pool, const gpupool_member_spec *members, int n,
                         uint64_t alignment, int timeout_ms, void *stream, gpupool_bundle **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AllocateBundle ab = GPUPOOL__WIRE__ALLOCATE_BUNDLE__INIT;
  Gpupool__Wire__MemberSpec *specs = NULL, **sp = NULL;
  Gpupool__Wire__TensorMeta *tms = NULL;
  gpupool__rep *rep;
  int rc;

  if (!c || !out || (n > 0 && !members))
    return gpupool__err(GPUPOOL_EINVAL, "bundle_alloc: client, members and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if (n <= 0 || n > GPUPOOL_BUNDLE_MAX_MEMBERS)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle has 1 to %d members, not %d", GPUPOOL_BUNDLE_MAX_MEMBERS, n);
  if (!(specs = calloc((size_t)n, sizeof *specs)) || !(sp = calloc((size_t)n, sizeof *sp)) ||
      !(tms = calloc((size_t)n, sizeof *tms))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory for a bundle of %d members", n);
    goto out;
  }
  for (int i = 0; i < n; i++) {
    const gpupool_member_spec *m = &members[i];
    if ((rc = member_name_check(i, m->name)) != 0)
      goto out;
    if (m->size == 0) {
      rc = gpupool__err(GPUPOOL_EINVAL, "member %d ('%s') has size 0; members need at least 1 byte", i, m->name);
      goto out;
    }
    gpupool__wire__member_spec__init(&specs[i]);
    specs[i].name = (char *)m->name;
    specs[i].size = m->size;
    if (m->meta) {
      if ((rc = member_meta_check(i, m->name, m->meta, m->size)) != 0)
        goto out;
      gpupool__wire_meta_to(m->meta, &tms[i]);
      specs[i].tensor = &tms[i];
    }
    sp[i] = &specs[i];
  }
  ab.pool_name = (char *)(pool ? pool : "");
  ab.n_members = (size_t)n;
  ab.members = sp;
  ab.alignment = alignment;
  ab.timeout_ms = wire_timeout(timeout_ms);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE;
  req.allocate_bundle = &ab;
  pthread_mutex_lock(&c->mu);
  rc = call_retry(c, &req, &rep, -1);
  if (rc == 0) {
    /* Fresh ranges: nothing to wait for (see gpupool_alloc). */
    rc = bundle_from_reply(c, reply_bundle(rep), 0, stream, NULL, NULL, out);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
out:
  free(specs);
  free(sp);
  free(tms);
  return rc;
}

/* Publish members (wire form, lying in bufs) under name in one request. With c->mu held. */
static int publish_bundle_locked(gpupool_client *c, const char *name, gpupool_buffer *const *bufs, int nbufs,
                                 Gpupool__Wire__BundleMember **wm, int n, uint64_t layout_id, void *stream,
                                 uint64_t *version) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__PublishBundle pb = GPUPOOL__WIRE__PUBLISH_BUNDLE__INIT;
  uint64_t *holds;
  gpupool__rep *rep;
  int rc;

  if ((rc = ensure_connected(c)) != 0)
    return rc;
  if (!(holds = calloc((size_t)nbufs, sizeof *holds)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < nbufs; i++) {
    if (bufs[i]->lost) {
      rc = lost_err(bufs[i]);
      goto out;
    }
    /* Every buffer's ready event, so getters wait for everything queued in stream. */
    if ((rc = record_ready(c, bufs[i], stream)) != 0)
      goto out;
    holds[i] = bufs[i]->hold_id;
  }
  pb.name = (char *)name;
  pb.n_hold_ids = (size_t)nbufs;
  pb.hold_ids = holds;
  pb.n_members = (size_t)n;
  pb.members = wm;
  pb.layout_id = layout_id;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_BUNDLE;
  req.publish_bundle = &pb;
  if ((rc = call(c, &req, &rep, NULL)) == 0) {
    if (version)
      *version = reply_version(rep);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    note_published(c, name);
  }
out:
  free(holds);
  return rc;
}

/* Wire members for n members: storage the caller frees with members_wire_free. */
typedef struct {
  Gpupool__Wire__BundleMember *m, **p;
  Gpupool__Wire__TensorMeta *t;
} members_wire;

static int members_wire_new(members_wire *w, int n) {
  w->m = calloc((size_t)n, sizeof *w->m);
  w->p = calloc((size_t)n, sizeof *w->p);
  w->t = calloc((size_t)n, sizeof *w->t);
  if (w->m && w->p && w->t)
    return 0;
  free(w->m);
  free(w->p);
  free(w->t);
  return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a bundle of %d members", n);
}

static void members_wire_free(members_wire *w) {
  free(w->m);
  free(w->p);
  free(w->t);
}

static void member_wire(members_wire *w, int i, const char *name, uint32_t buffer, uint64_t offset, uint64_t size,
                        const gpupool_tensor_meta *meta) {
  gpupool__wire__bundle_member__init(&w->m[i]);
  w->m[i].name = (char *)name;
  w->m[i].buffer = buffer;
  w->m[i].offset = offset;
  w->m[i].size = size;
  if (meta) {
    gpupool__wire_meta_to(meta, &w->t[i]);
    w->m[i].tensor = &w->t[i];
  }
  w->p[i] = &w->m[i];
}

int gpupool_bundle_publish(gpupool_bundle *b, const char *name, void *stream, uint64_t *version) {
  members_wire w;
  const clayout *l;
  uint64_t v = 0;
  int rc;
  if (!b || !name)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_publish: bundle and name must not be NULL");
  gpupool__err_clear();
  if (version)
    *version = 0;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  l = b->layout;
  pthread_mutex_lock(&b->c->mu);
  /* By the layout's id first: the daemon has the table, so no member travels. It forgets a
   * table once nothing uses it (a relayed bundle's may be gone): then the members go. */
  rc = l->id ? publish_bundle_locked(b->c, name, b->bufs, b->nbufs, NULL, 0, l->id, stream, &v) : GPUPOOL_ENOENT;
  pthread_mutex_unlock(&b->c->mu);
  if (rc == GPUPOOL_ENOENT) {
    if ((rc = members_wire_new(&w, l->n)) != 0)
      return rc;
    for (int i = 0; i < l->n; i++) {
      const gpupool_member *m = &l->members[i];
      member_wire(&w, i, m->name, (uint32_t)m->buffer, m->offset, m->size, m->has_meta ? &m->meta : NULL);
    }
    pthread_mutex_lock(&b->c->mu);
    rc = publish_bundle_locked(b->c, name, b->bufs, b->nbufs, w.p, l->n, 0, stream, &v);
    pthread_mutex_unlock(&b->c->mu);
    members_wire_free(&w);
  }
  if (rc == 0) {
    b->version = v;
    if (version)
      *version = v;
  }
  return rc;
}

int gpupool_publish_members(gpupool_client *c, const char *name, const gpupool_member_ref *members, int n,
                            void *stream, uint64_t *version) {
  gpupool_buffer **bufs = NULL;
  gpupool__hmap index; /* buffer id -> buffer index + 1 */
  members_wire w = {0};
  int nbufs = 0, rc;

  if (!c || !name || (n > 0 && !members))
    return gpupool__err(GPUPOOL_EINVAL, "publish_members: client, name and members must not be NULL");
  gpupool__err_clear();
  if (version)
    *version = 0;
  if (n <= 0 || n > GPUPOOL_BUNDLE_MAX_MEMBERS)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle has 1 to %d members, not %d", GPUPOOL_BUNDLE_MAX_MEMBERS, n);
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gpupool__hmap_init(&index);
  if ((rc = members_wire_new(&w, n)) != 0)
    return rc;
  if (!(bufs = calloc((size_t)n, sizeof *bufs))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    goto out;
  }
  for (int i = 0; i < n; i++) {
    const gpupool_member_ref *m = &members[i];
    uintptr_t idx;
    if ((rc = member_name_check(i, m->name)) != 0)
      goto out;
    if (!m->buffer || m->buffer->c != c) {
      rc = gpupool__err(GPUPOOL_EINVAL, "member %d ('%s'): %s", i, m->name,
                        m->buffer ? "its buffer belongs to another client" : "buffer is NULL");
      goto out;
    }
    if (m->size == 0 || m->offset > m->buffer->size || m->size > m->buffer->size - m->offset) {
      rc = gpupool__err(GPUPOOL_EINVAL, "member %d ('%s'): range [%" PRIu64 ", +%" PRIu64 ") is empty or does not "
                        "fit in its buffer of %" PRIu64 " bytes", i, m->name, m->offset, m->size, m->buffer->size);
      goto out;
    }
    if (m->meta && (rc = member_meta_check(i, m->name, m->meta, m->size)) != 0)
      goto out;
    /* By buffer, not hold: two holds of one buffer are one buffer of the bundle. */
    idx = (uintptr_t)gpupool__hmap_get(&index, m->buffer->buffer_id);
    if (!idx) {
      bufs[nbufs++] = m->buffer;
      idx = (uintptr_t)nbufs;
      if (gpupool__hmap_put(&index, m->buffer->buffer_id, (void *)idx) != 0) {
        rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
        goto out;
      }
    }
    member_wire(&w, i, m->name, (uint32_t)(idx - 1), m->offset, m->size, m->meta);
  }
  pthread_mutex_lock(&c->mu);
  rc = publish_bundle_locked(c, name, bufs, nbufs, w.p, n, 0, stream, version);
  pthread_mutex_unlock(&c->mu);
out:
  gpupool__hmap_free(&index);
  members_wire_free(&w);
  free(bufs);
  return rc;
}

static int bundle_get_request(const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                              gpupool__req *req, Gpupool__Wire__GetBundle *gb) {
  int rc;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gpupool__wire__get_bundle__init(gb);
  gb->name = (char *)name;
  gb->newer_than = newer_than;
  gb->timeout_ms = wire_timeout(timeout_ms);
  gb->read_only = (flags & GPUPOOL_READ_ONLY) != 0;
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_GET_BUNDLE;
  req->get_bundle = gb;
  return 0;
}

/* A GetBundle's reply turned into the caller's bundle, the reply freed; blocking and pipelined
 * gets alike. known: the table the request named (the caller's reference), or NULL. With
 * c->mu held. */
static int bundle_get_finish(gpupool_client *c, gpupool__rep *rep, unsigned flags, void *stream, const char *name,
                             clayout *known, gpupool_bundle **out) {
  int rc = bundle_from_reply(c, reply_bundle(rep), 1, stream, name, known, out);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  if (rc == 0)
    bundle_keep_mapped(*out, flags);
  return rc;
}

int gpupool_bundle_get(gpupool_client *c, const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                       void *stream, gpupool_bundle **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__GetBundle gb;
  gpupool__rep *rep;
  clayout *known;
  int rc;

  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_get: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = bundle_get_request(name, newer_than, timeout_ms, flags, &req, &gb)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  /* Connected first, so the table named as known is one of this daemon's; it is held
   * until the reply is handled, whatever happens to the cache meanwhile. */
  if ((rc = ensure_connected(c)) != 0) {
    pthread_mutex_unlock(&c->mu);
    return rc;
  }
  known = layout_cached(c, name);
  if (known)
    known->refs++;
  gb.known_layout = known ? known->id : 0;
  rc = get_across_restarts(c, &req, &gb.timeout_ms, timeout_ms, &rep, &gb.known_layout);
  if (rc == 0)
    rc = bundle_get_finish(c, rep, flags, stream, name, gb.known_layout ? known : NULL, out);
  clayout_unref(known);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_bundle_release(gpupool_bundle *b, void *stream) {
  gpupool_client *c;
  int rc;
  if (!b)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_release: bundle is NULL");
  gpupool__err_clear();
  c = b->c;
  pthread_mutex_lock(&c->mu);
  ensure_connected(c); /* marks the buffers lost if their daemon went away */
  rc = release_many_locked(c, b->bufs, b->nbufs, stream);
  bundle_free_local(b); /* its layout is shared with the cache: under the lock */
  pthread_mutex_unlock(&c->mu);
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : rc;
}

int gpupool_bundle_count(const gpupool_bundle *b) { return b ? b->layout->n : 0; }
uint64_t gpupool_bundle_version(const gpupool_bundle *b) { return b ? b->version : 0; }
uint64_t gpupool_bundle_layout_id(const gpupool_bundle *b) { return b ? b->layout->id : 0; }
int gpupool_bundle_buffers(const gpupool_bundle *b) { return b ? b->nbufs : 0; }
gpupool_buffer *gpupool_bundle_buffer(const gpupool_bundle *b, int i) {
  return b && i >= 0 && i < b->nbufs ? b->bufs[i] : NULL;
}

int gpupool_bundle_member(const gpupool_bundle *b, int i, gpupool_member *out) {
  return gpupool_bundle_members(b, i, 1, out);
}

int gpupool_bundle_members(const gpupool_bundle *b, int first, int n, gpupool_member *out) {
  int count = b ? b->layout->n : 0;
  if (!b || !out || first < 0 || n < 0 || first > count || n > count - first)
    return gpupool__err(GPUPOOL_EINVAL, "members %d..%d asked of a bundle of %d", first, first + n - 1, count);
  for (int i = 0; i < n; i++) {
    const gpupool_member *m = &b->layout->members[first + i];
    out[i] = *m;
    out[i].ptr = (char *)gpupool_buffer_ptr(b->bufs[m->buffer]) + m->offset;
  }
  return 0;
}

int gpupool_bundle_find(const gpupool_bundle *b, const char *name) {
  if (!b || !name)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_find: bundle and name must not be NULL");
  for (int i = 0; i < b->layout->n; i++)
    if (!strcmp(b->layout->members[i].name, name))
      return i;
  return gpupool__err(GPUPOOL_ENOENT, "the bundle has no member '%s'", name);
}

/* ---- pipelining ------------------------------------------------------------------------------ */

enum { PEND_GET = 1, PEND_BGET, PEND_PUBLISH, PEND_RELEASE };

struct gpupool_pending {
  gpupool_client *c;
  pending *p;
  int kind;
  unsigned flags;             /* gets: GPUPOOL_KEEP_MAPPED applies when they end */
  clayout *known;             /* PEND_BGET: the table named as known (a reference), or NULL */
  char name[GPUPOOL_NAME_MAX + 1];
};

/* Send req as a pending request of kind. With c->mu held. */
static int begin_locked(gpupool_client *c, gpupool__req *req, int kind, gpupool_pending **out) {
  gpupool_pending *gp = calloc(1, sizeof *gp);
  int rc;
  if (!gp)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  if ((rc = ensure_connected(c)) != 0 || (rc = call_send(c, req, &gp->p, -1)) != 0) {
    free(gp);
    return rc;
  }
  gp->c = c;
  gp->kind = kind;
  *out = gp;
  return 0;
}

int gpupool_get_begin(gpupool_client *c, const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                      gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get gt;
  int rc;
  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "get_begin: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = get_request(name, newer_than, timeout_ms, flags, &req, &gt)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  if ((rc = begin_locked(c, &req, PEND_GET, out)) == 0)
    (*out)->flags = flags;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_bundle_get_begin(gpupool_client *c, const char *name, uint64_t newer_than, int timeout_ms,
                             unsigned flags, gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__GetBundle gb;
  int rc;
  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_get_begin: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = bundle_get_request(name, newer_than, timeout_ms, flags, &req, &gb)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  if ((rc = ensure_connected(c)) == 0) {
    clayout *known = layout_cached(c, name);
    gb.known_layout = known ? known->id : 0;
    if ((rc = begin_locked(c, &req, PEND_BGET, out)) == 0) {
      (*out)->flags = flags;
      (*out)->known = known;
      if (known)
        known->refs++;
      snprintf((*out)->name, sizeof (*out)->name, "%s", name);
    }
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_publish_begin(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream,
                          gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Publish pb;
  Gpupool__Wire__TensorMeta tm = GPUPOOL__WIRE__TENSOR_META__INIT;
  gpupool_client *c;
  int rc;
  if (!out)
    return gpupool__err(GPUPOOL_EINVAL, "publish_begin: out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = publish_request(b, name, meta, 0, 0, &req, &pb, &tm)) != 0)
    return rc;
  c = b->c;
  pthread_mutex_lock(&c->mu);
  if ((rc = hand_over_prepare(c, b, stream)) == 0 && (rc = begin_locked(c, &req, PEND_PUBLISH, out)) == 0) {
    snprintf((*out)->name, sizeof (*out)->name, "%s", name);
    /* Now, not at the end: the caller may release b before ending the publish. */
    if (meta) {
      b->meta = *meta;
      b->has_meta = 1;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_release_begin(gpupool_buffer *b, void *stream, gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Release rl;
  gpupool_client *c;
  uint64_t hold_id;
  int recorded, rc = 0;
  if (!b || !out)
    return gpupool__err(GPUPOOL_EINVAL, "release_begin: buffer and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  c = b->c;
  pthread_mutex_lock(&c->mu);
  ensure_connected(c);
  release_local(c, b, stream, &hold_id, &recorded);
  if (hold_id) {
    release_request(&req, &rl, hold_id, recorded);
    rc = begin_locked(c, &req, PEND_RELEASE, out);
  }
  pthread_mutex_unlock(&c->mu);
  /* Lost with its daemon: nothing to wait for (*out stays NULL, which pending_end accepts). */
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : rc;
}

/* Wait for gp's reply (frees gp). With c->mu held. */
static int end_locked(gpupool_pending *gp, gpupool__rep **rep) {
  pending *p = gp->p;
  gpupool_client *c = gp->c;
  free(gp);
  return call_wait(c, p, rep, NULL, NULL);
}

int gpupool_get_end(gpupool_pending *gp, void *stream, gpupool_buffer **out, uint64_t *version) {
  gpupool_client *c;
  gpupool__rep *rep;
  unsigned flags;
  int rc;
  if (!gp || !out || gp->kind != PEND_GET)
    return gpupool__err(GPUPOOL_EINVAL, "get_end: needs a pending get from gpupool_get_begin");
  gpupool__err_clear();
  *out = NULL;
  if (version)
    *version = 0;
  c = gp->c;
  flags = gp->flags;
  pthread_mutex_lock(&c->mu);
  if ((rc = end_locked(gp, &rep)) == 0)
    rc = get_finish(c, rep, flags, stream, out, version);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_bundle_get_end(gpupool_pending *gp, void *stream, gpupool_bundle **out) {
  gpupool_client *c;
  gpupool__rep *rep;
  char name[GPUPOOL_NAME_MAX + 1];
  clayout *known;
  unsigned flags;
  int rc;
  if (!gp || !out || gp->kind != PEND_BGET)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_get_end: needs a pending get from gpupool_bundle_get_begin");
  gpupool__err_clear();
  *out = NULL;
  c = gp->c;
  flags = gp->flags;
  known = gp->known;
  memcpy(name, gp->name, sizeof name);
  pthread_mutex_lock(&c->mu);
  if ((rc = end_locked(gp, &rep)) == 0)
    rc = bundle_get_finish(c, rep, flags, stream, name, known, out);
  clayout_unref(known);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_pending_end(gpupool_pending *gp, uint64_t *version) {
  gpupool_client *c;
  char name[GPUPOOL_NAME_MAX + 1];
  gpupool__rep *rep;
  int rc, kind;
  if (version)
    *version = 0;
  if (!gp)
    return 0; /* a release_begin of a buffer whose daemon was gone */
  if (gp->kind != PEND_PUBLISH && gp->kind != PEND_RELEASE)
    return gpupool__err(GPUPOOL_EINVAL, "pending_end: ends a publish or a release; end gets with gpupool_get_end "
                        "or gpupool_bundle_get_end");
  gpupool__err_clear();
  c = gp->c;
  kind = gp->kind;
  memcpy(name, gp->name, sizeof name);
  pthread_mutex_lock(&c->mu);
  if ((rc = end_locked(gp, &rep)) == 0) {
    if (version)
      *version = reply_version(rep);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    if (kind == PEND_PUBLISH)
      note_published(c, name);
  }
  pthread_mutex_unlock(&c->mu);
  if (kind == PEND_RELEASE && (rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO))
    rc = 0; /* a broken connection already dropped the hold */
  return rc;
}

void gpupool_pending_cancel(gpupool_pending *gp) {
  gpupool_client *c;
  gpupool__rep *rep;
  int kind;
  if (!gp)
    return;
  c = gp->c;
  kind = gp->kind;
  pthread_mutex_lock(&c->mu);
  clayout_unref(gp->known);
  if (end_locked(gp, &rep) == 0) {
    /* Undo what the reply brought: holds this process never turned into buffers. */
    if (kind == PEND_GET) {
      const Gpupool__Wire__BufferDesc *d = reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_GET);
      if (d && d->hold_id)
        send_release(c, d->hold_id, 0);
    } else if (kind == PEND_BGET) {
      release_holds_from(c, reply_bundle(rep), 0, c->reconnects);
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
}

int gpupool_unpublish(gpupool_client *c, const char *name) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Unpublish up = GPUPOOL__WIRE__UNPUBLISH__INIT;
  gpupool__rep *rep;
  int rc;
  if (!c || !name)
    return gpupool__err(GPUPOOL_EINVAL, "unpublish: client and name must not be NULL");
  gpupool__err_clear();
  up.name = (char *)name;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_UNPUBLISH;
  req.unpublish = &up;
  pthread_mutex_lock(&c->mu);
  rc = call_retry(c, &req, &rep, -1);
  if (rc == 0) {
    gpupool__wire__reply__free_unpacked(rep, NULL);
    note_unpublished(c, name);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int gpupool_stats_sized(gpupool_client *c, gpupool_daemon_stats *ds_out, size_t ds_size,
                        gpupool_pool_stats *pools, size_t pool_size, int max_pools, int *n_pools) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  gpupool__rep *rep;
  int rc, n = 0;
  gpupool_daemon_stats ds_full, *ds = ds_out ? &ds_full : NULL;
  if (!c)
    return gpupool__err(GPUPOOL_EINVAL, "stats: client is NULL");
  /* A caller built against an older header passes smaller structs: fill what it knows. */
  if ((ds_out && ds_size < GPUPOOL_STATS_MIN_DAEMON_SIZE) || (pools && pool_size < GPUPOOL_STATS_MIN_POOL_SIZE))
    return gpupool__err(GPUPOOL_EINVAL, "stats: struct sizes %zu/%zu are below the first release's; "
                        "call gpupool_stats() from gpupool.h", ds_size, pool_size);
  gpupool__err_clear();
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  pthread_mutex_lock(&c->mu);
  rc = call_retry(c, &req, &rep, -1);
  pthread_mutex_unlock(&c->mu);
  if (rc != 0)
    return rc;
  if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_STATS || !rep->stats) {
    gpupool__wire__reply__free_unpacked(rep, NULL);
    return gpupool__err(GPUPOOL_EPROTO, "the daemon answered Stats with something else");
  }
  if (ds) {
    const Gpupool__Wire__StatsReply *s = rep->stats;
    memset(ds, 0, sizeof *ds);
    ds->clients = s->clients;
    ds->buffers = s->buffers;
    ds->holds = s->holds;
    ds->names = s->names;
    ds->requests = s->requests;
    ds->errors = s->errors;
    ds->open_fds = s->open_fds;
    ds->pending_frees = s->pending_frees;
    ds->uptime_s = s->uptime_s;
    memcpy(ds_out, ds, ds_size < sizeof *ds ? ds_size : sizeof *ds);
  }
  for (size_t i = 0; pools && i < rep->stats->n_pools && n < max_pools; i++, n++) {
    const Gpupool__Wire__PoolInfo *pi = rep->stats->pools[i];
    gpupool_pool_stats full, *o = &full;
    memset(o, 0, sizeof *o);
    o->id = pi->id;
    snprintf(o->name, sizeof o->name, "%s", pi->name ? pi->name : "");
    if (gpupool__wire_mem_kind(pi->location, &o->kind) != 0)
      o->kind = GPUPOOL_MEM_HOST; /* a newer daemon's kind: shown as host rather than failing stats */
    o->device = pi->device;
    o->capacity = pi->capacity;
    o->slab_size = pi->slab_size;
    o->max_alloc = pi->max_alloc;
    o->used = pi->used;
    o->reserved = pi->reserved;
    o->used_high = pi->used_high;
    o->reserved_high = pi->reserved_high;
    o->backend_used = pi->backend_used;
    o->backend_reserved = pi->backend_reserved;
    o->buffers = pi->buffers;
    o->slabs = pi->slabs;
    memcpy((char *)pools + (size_t)n * pool_size, o, pool_size < sizeof *o ? pool_size : sizeof *o);
  }
  if (n_pools)
    *n_pools = n;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

int gpupool_trim(gpupool_client *c) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Trim tr = GPUPOOL__WIRE__TRIM__INIT;
  gpupool__rep *rep;
  int rc;
  if (!c)
    return gpupool__err(GPUPOOL_EINVAL, "trim: client is NULL");
  gpupool__err_clear();
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_TRIM;
  req.trim = &tr;
  pthread_mutex_lock(&c->mu);
  rc = call_retry(c, &req, &rep, -1);
  if (rc == 0)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

void *gpupool_buffer_ptr(const gpupool_buffer *b) { return b ? (char *)b->base + b->offset : NULL; }
size_t gpupool_buffer_size(const gpupool_buffer *b) { return b ? (size_t)b->size : 0; }
int gpupool_buffer_device(const gpupool_buffer *b) {
  return b && b->slab->pool->kind != GPUPOOL_MEM_HOST ? b->slab->pool->device : -1;
}
gpupool_mem_kind gpupool_buffer_kind(const gpupool_buffer *b) { return b ? b->slab->pool->kind : GPUPOOL_MEM_HOST; }
uint64_t gpupool_buffer_id(const gpupool_buffer *b) { return b ? b->buffer_id : 0; }
int gpupool_buffer_read_only(const gpupool_buffer *b) { return b ? b->read_only : 0; }
gpupool_client *gpupool_buffer_client(const gpupool_buffer *b) { return b ? b->c : NULL; }
int gpupool_buffer_tensor(const gpupool_buffer *b, gpupool_tensor_meta *out) {
  if (!b || !out)
    return gpupool__err(GPUPOOL_EINVAL, "buffer_tensor: arguments must not be NULL");
  if (!b->has_meta)
    return gpupool__err(GPUPOOL_ENOENT, "buffer %" PRIu64 " was published without tensor metadata", b->buffer_id);
  *out = b->meta;
  return 0;
}

/* ---- read-only file objects ----------------------------------------------------------------- */

struct gpupool_file {
  const gpupool__cbackend_ops *be; /* what registered it (NULL when not registered) */
  void *map;                       /* the mapping: page-aligned, map_len bytes */
  size_t map_len;
  const uint8_t *ptr;              /* the range's first byte inside it */
  const uint8_t *dev;              /* its device address, or NULL */
  gpupool_file_info info;
};

static void file_info_from(const Gpupool__Wire__FileInfo *fi, gpupool_file_info *out) {
  memset(out, 0, sizeof *out);
  out->offset = fi->offset;
  out->length = fi->length;
  out->size = fi->size;
  out->dev = fi->dev;
  out->ino = fi->ino;
  out->mtime_sec = fi->mtime_sec;
  out->mtime_nsec = fi->mtime_nsec;
}

int gpupool_publish_file(gpupool_client *c, const char *name, const char *path, uint64_t offset, uint64_t length,
                         gpupool_file_info *info) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__PublishFile pf = GPUPOOL__WIRE__PUBLISH_FILE__INIT;
  gpupool__rep *rep;
  struct stat st;
  char *wpath;
  int rc, fd, fl;

  if (!c || !name || !path)
    return gpupool__err(GPUPOOL_EINVAL, "publish_file: client, name and path must not be NULL");
  gpupool__err_clear();
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  if (length && offset + length < offset)
    return gpupool__err(GPUPOOL_EINVAL, "offset %" PRIu64 " + length %" PRIu64 " overflows a 64-bit byte count",
                        offset, length);
  /* The caller's own open, with its own credentials: what proves to the daemon that it may
   * read the file. O_NONBLOCK so that a FIFO does not hang the open; O_NOCTTY for a tty. */
  fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    int e = errno;
    return gpupool__err(e == ENOENT || e == ENOTDIR ? GPUPOOL_ENOENT
                        : e == EACCES || e == EPERM  ? GPUPOOL_EPERM
                                                     : GPUPOOL_EINVAL,
                        "cannot open '%s' for reading: %s", path, strerror(e));
  }
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is %s: only regular files can be published", path,
                        S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
  }
  if ((fl = fcntl(fd, F_GETFL)) >= 0)
    (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  /* The path goes along for the daemon's messages only, and every string on the wire must be
   * UTF-8: a file name that is not (Linux allows any bytes) is sent with '?' for those bytes. */
  if (!(wpath = strdup(path))) {
    close(fd);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  utf8_scrub(wpath);
  pf.name = (char *)name;
  pf.path = wpath;
  pf.offset = offset;
  pf.length = length;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE;
  req.publish_file = &pf;
  pthread_mutex_lock(&c->mu);
  rc = call_retry(c, &req, &rep, fd);
  if (rc == 0) {
    if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE || !rep->publish_file ||
        !rep->publish_file->file) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered PublishFile with something else");
    } else {
      if (info)
        file_info_from(rep->publish_file->file, info);
      note_published(c, name);
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
  free(wpath);
  close(fd); /* the daemon has its own copy */
  return rc;
}

/* Checks the fd against the description and maps the range. Takes fd. */
static int file_map(int fd, const Gpupool__Wire__FileInfo *fi, const char *name, gpupool_file *f) {
  struct stat st;
  long page = sysconf(_SC_PAGESIZE);
  uint64_t start, delta;
  int rc = 0;

  if (page <= 0)
    page = 4096;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the fd the daemon sent for '%s' is not a regular file", name);
    goto out;
  }
  if (fi->length == 0 || fi->offset + fi->length < fi->offset) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon described '%s' with an invalid range", name);
    goto out;
  }
  if ((uint64_t)st.st_dev != fi->dev || (uint64_t)st.st_ino != fi->ino) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the fd the daemon sent for '%s' is not the file it describes", name);
    goto out;
  }
  /* The daemon checked this too; the file may have changed since. Never map past the end. */
  if ((uint64_t)st.st_size < fi->offset + fi->length) {
    rc = gpupool__err(GPUPOOL_ESTALE,
                      "file '%s' is now %" PRIu64 " bytes, shorter than the published range of %" PRIu64
                      " bytes at offset %" PRIu64 " (it was %" PRIu64 " bytes when published)",
                      name, (uint64_t)st.st_size, fi->length, fi->offset, fi->size);
    goto out;
  }
  if ((uint64_t)st.st_size != fi->size || (int64_t)st.st_mtim.tv_sec != fi->mtime_sec ||
      (uint32_t)st.st_mtim.tv_nsec != fi->mtime_nsec) {
    rc = gpupool__err(GPUPOOL_ESTALE, "file '%s' changed since it was published (size %" PRIu64 " -> %" PRIu64
                      ", or its mtime moved)", name, fi->size, (uint64_t)st.st_size);
    goto out;
  }
  start = fi->offset & ~(uint64_t)(page - 1);
  delta = fi->offset - start;
  if (fi->length + delta > SIZE_MAX) {
    rc = gpupool__err(GPUPOOL_ETOOBIG, "file '%s': a range of %" PRIu64 " bytes does not fit this address space",
                      name, fi->length);
    goto out;
  }
  f->map_len = (size_t)(fi->length + delta);
  f->map = mmap(NULL, f->map_len, PROT_READ, MAP_SHARED, fd, (off_t)start);
  if (f->map == MAP_FAILED) {
    f->map = NULL;
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot map %zu bytes of file '%s': %s (check RLIMIT_AS / vm.max_map_count)",
                      f->map_len, name, strerror(errno));
    goto out;
  }
  f->ptr = (const uint8_t *)f->map + delta;
out:
  close(fd); /* the mapping keeps the file */
  return rc;
}

int gpupool_get_file(gpupool_client *c, const char *name, int timeout_ms, unsigned flags, gpupool_file **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__GetFile gf = GPUPOOL__WIRE__GET_FILE__INIT;
  gpupool__rep *rep = NULL;
  gpupool_file *f = NULL;
  const Gpupool__Wire__FileInfo *fi;
  uint64_t start = mono_ns() / 1000000;
  int rc, fd = -1;

  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "get_file: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gf.name = (char *)name;
  gf.timeout_ms = wire_timeout(timeout_ms);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET_FILE;
  req.get_file = &gf;
  pthread_mutex_lock(&c->mu);
  /* As gpupool_get: a wait cut short by a daemon restart goes on with the next daemon. */
  for (rc = ensure_connected(c); rc == 0;) {
    uint64_t spent;
    int last = gf.timeout_ms == 0;
    rc = call(c, &req, &rep, &fd);
    if ((rc != GPUPOOL_ECLOSED && rc != GPUPOOL_EIO) || !c->broken || c->reconnect_ms <= 0 || last)
      break;
    if ((rc = ensure_connected(c)) != 0)
      break;
    spent = mono_ns() / 1000000 - start;
    if (timeout_ms >= 0)
      gf.timeout_ms = spent >= (uint64_t)timeout_ms ? 0 : (uint32_t)((uint64_t)timeout_ms - spent);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc != 0)
    return rc;
  if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_GET_FILE || !rep->get_file || !(fi = rep->get_file->file) ||
      fd < 0) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered GetFile for '%s' without the file or its fd", name);
    goto fail;
  }
  if (!(f = calloc(1, sizeof *f))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    goto fail;
  }
  rc = file_map(fd, fi, name, f);
  fd = -1;
  if (rc != 0)
    goto fail;
  file_info_from(fi, &f->info);
  if (!(flags & GPUPOOL_FILE_HOST_ONLY) && c->be && c->be->file_register) {
    void *dev = NULL;
    if ((rc = c->be->file_register(f->map, f->map_len, &dev)) != 0)
      goto fail;
    f->be = c->be;
    f->dev = (const uint8_t *)dev + (f->ptr - (const uint8_t *)f->map);
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  *out = f;
  return 0;
fail:
  if (fd >= 0)
    close(fd);
  if (f && f->map)
    munmap(f->map, f->map_len);
  free(f);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return rc;
}

const void *gpupool_file_ptr(const gpupool_file *f) { return f ? f->ptr : NULL; }
const void *gpupool_file_device_ptr(const gpupool_file *f) { return f ? f->dev : NULL; }
size_t gpupool_file_size(const gpupool_file *f) { return f ? (size_t)f->info.length : 0; }

int gpupool_file_info_get(const gpupool_file *f, gpupool_file_info *out) {
  if (!f || !out)
    return gpupool__err(GPUPOOL_EINVAL, "file_info: file and out must not be NULL");
  *out = f->info;
  return 0;
}

void gpupool_file_release(gpupool_file *f) {
  if (!f)
    return;
  if (f->be && f->be->file_unregister)
    f->be->file_unregister(f->map);
  munmap(f->map, f->map_len);
  free(f);
}
