/*
 * libgpupool-client, buffers.c: Single buffers: alloc, share and open, publish and get (with their
 * versions), release, unpublish, and the buffer accessors. See internal.h for how the client is
 * put together.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
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

#include "internal.h"
#include "test_hooks.h"
#include "list.h"

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
void gpupool__release_local(gpupool_client *c, gpupool_buffer *b, void *stream, uint64_t *hold_id, int *recorded) {
  cslab *s = b->slab;
  gpupool__cevent *done = b->done_id ? gpupool__hmap_get(&c->events, b->done_id) : NULL;
  gpupool__error why;
  int rc;

  *hold_id = 0;
  *recorded = 0;
  GPUPOOL__LIST_UNLINK(c->buffers, b, prev, next);
  s->refs--;
  if (b->lost || s->stale) {
    /* Its daemon is gone: nothing to tell (unless the new one gave the hold back); unmap once
     * no buffer of ours needs the slab. */
    stale_gen *g = s->stale;
    if (!b->lost)
      *hold_id = b->hold_id;
    if (s->refs == 0) {
      gpupool__be_unmap(c, s, stream);
      free(s);
      if (g && --g->live_slabs == 0)
        gpupool__stale_gen_free(c, g);
    }
    free(b);
    return;
  }
  /* A dedicated slab holds only this buffer: unmap it now, in stream order, before the done
   * event, so the daemon frees the allocation only after our import is gone. */
  if (s->refs == 0 && s->dedicated && !s->keep)
    gpupool__slab_unmap(c, s, stream);
  /* The daemon may reuse the range once it has the release and the done event (if recorded)
   * has completed. */
  switch (rc = fence_stream(c, done, stream)) {
  case 1:
    *recorded = 1;
    break;
  case 0:
    break;
  default:
    gpupool__error_take(&why, rc);
    fprintf(stderr, "libgpupool-client: %s failed (%s); the daemon will treat the buffer as idle\n",
            c->host_fences ? "synchronizing the stream before a release" : "recording the done event", why.msg);
  }
  *hold_id = b->hold_id;
  free(b);
}

void gpupool__release_request(gpupool__req *req, Gpupool__Wire__Release *rl, uint64_t hold_id, int recorded) {
  gpupool__wire__release__init(rl);
  rl->hold_id = hold_id;
  rl->done_recorded = recorded;
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_RELEASE;
  req->release = rl;
}

/* Drop b's local state and tell the daemon (or say in *err why that failed). With the lock
 * held. */
int gpupool__release_locked(gpupool_client *c, gpupool_buffer *b, void *stream, gpupool__error *err) {
  uint64_t hold_id;
  int recorded;
  gpupool__release_local(c, b, stream, &hold_id, &recorded);
  return hold_id ? gpupool__send_release(c, hold_id, recorded, err) : 0;
}

/* Release several buffers in one round trip: their holds named together in as few Release
 * requests as the daemon takes (HelloReply.max_release_batch; one each from a daemon that
 * takes one), those requests in flight together. The first failure is the one returned and
 * said in *err. */
int gpupool__release_many_locked(gpupool_client *c, gpupool_buffer **bs, int n, void *stream, gpupool__error *err) {
  size_t batch = c->max_release_batch > 1 ? c->max_release_batch : 1, m = 0, np = 0;
  uint64_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
  protobuf_c_boolean *rec = malloc((size_t)(n > 0 ? n : 1) * sizeof *rec);
  pending **ps = calloc((size_t)(n > 0 ? n : 1), sizeof *ps);
  int rc = 0;
  if (!ids || !rec || !ps) {
    free(ids);
    free(rec);
    free(ps);
    for (int i = 0; i < n; i++) {
      gpupool__error e;
      int r = gpupool__release_locked(c, bs[i], stream, &e);
      if (r && !rc) {
        rc = r;
        *err = e;
      }
    }
    return rc;
  }
  for (int i = 0; i < n; i++) {
    uint64_t hold_id;
    int recorded;
    gpupool__release_local(c, bs[i], stream, &hold_id, &recorded);
    if (hold_id) {
      ids[m] = hold_id;
      rec[m++] = recorded;
    }
  }
  for (size_t k = 0; k < m; k += batch) {
    gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Release rl;
    size_t len = m - k < batch ? m - k : batch;
    gpupool__error e;
    int r;
    gpupool__release_request(&req, &rl, ids[k], rec[k]);
    rl.n_more_hold_ids = rl.n_more_done_recorded = len - 1;
    rl.more_hold_ids = ids + k + 1;
    rl.more_done_recorded = rec + k + 1;
    if ((r = gpupool__call_send(c, &req, &ps[np++], -1, &e)) != 0 && !rc) {
      rc = r;
      *err = e;
    }
  }
  for (size_t i = 0; i < np; i++) {
    gpupool__rep *rep;
    gpupool__error e;
    int r;
    if (!ps[i])
      continue;
    if ((r = gpupool__call_wait(c, ps[i], &rep, NULL, NULL, &e)) == 0) {
      gpupool__wire__reply__free_unpacked(rep, NULL);
    } else if (r == GPUPOOL_EINVAL && batch > 1) {
      /* The daemon takes fewer holds a Release now (max_share_batch lowered by a reload):
       * these go one a request, and so do the next ones on this connection. */
      size_t k = i * batch, len = m - k < batch ? m - k : batch;
      c->max_release_batch = 1;
      for (size_t j = k; j < k + len; j++)
        if ((r = gpupool__send_release(c, ids[j], rec[j], &e)) != 0 && !rc) {
          rc = r;
          *err = e;
        }
    } else if (!rc) {
      rc = r;
      *err = e;
    }
  }
  free(ids);
  free(rec);
  free(ps);
  return rc;
}

int gpupool_buffer_release_many(gpupool_buffer *const *bufs, int n, void *stream) {
  gpupool_client *c;
  gpupool__error err = {.code = 0}, gone;
  int rc;
  if (n < 0 || (n > 0 && !bufs))
    return gpupool__err(GPUPOOL_EINVAL, "release_many: bufs must not be NULL and n not negative");
  if (n == 0)
    return 0;
  for (int i = 0; i < n; i++)
    if (!bufs[i] || bufs[i]->c != bufs[0]->c)
      return gpupool__err(GPUPOOL_EINVAL, "release_many: buffer %d is %s", i,
                          bufs[i] ? "of another client than buffer 0 (release each client's apart)" : "NULL");
  gpupool__err_clear();
  c = bufs[0]->c;
  pthread_mutex_lock(&c->mu);
  gpupool__ensure_connected(c, &gone); /* marks the buffers lost if their daemon went away */
  rc = gpupool__release_many_locked(c, (gpupool_buffer **)bufs, n, stream, &err);
  pthread_mutex_unlock(&c->mu);
  /* A broken connection already dropped the holds: the memory is the daemon's again. */
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : gpupool__error_report(&err, rc);
}

int gpupool_buffer_release(gpupool_buffer *b, void *stream) {
  gpupool_client *c;
  gpupool__error err = {.code = 0}, gone;
  int rc;
  if (!b)
    return gpupool__err(GPUPOOL_EINVAL, "release: buffer is NULL");
  gpupool__err_clear();
  c = b->c;
  pthread_mutex_lock(&c->mu);
  gpupool__ensure_connected(c, &gone); /* marks b lost if its daemon went away */
  rc = gpupool__release_locked(c, b, stream, &err);
  pthread_mutex_unlock(&c->mu);
  /* A broken connection already dropped the hold: the memory is the daemon's again. */
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : gpupool__error_report(&err, rc);
}

uint32_t gpupool__wire_timeout(int timeout_ms) {
  return timeout_ms < 0 ? GPUPOOL_WAIT_FOREVER : (uint32_t)timeout_ms;
}

int gpupool_buffer_alloc(gpupool_client *c, const char *pool, size_t size, int timeout_ms, void *stream,
                         gpupool_buffer **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  gpupool__rep *rep;
  gpupool__error err; /* why a step after the reply failed */
  int rc;

  if (!c || !out)
    return gpupool__err(GPUPOOL_EINVAL, "alloc: client and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "cannot allocate 0 bytes; ask for at least 1");
  al.pool_name = (char *)(pool ? pool : "");
  al.size = size;
  al.timeout_ms = gpupool__wire_timeout(timeout_ms);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__call_retry(c, &req, &rep, -1, &err);
  if (rc == 0) {
    /* A fresh range: the daemon reuses ranges only after their last holders' done events,
     * so there is nothing to wait for. */
    rc = gpupool__materialize(c, gpupool__reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE), 0, stream, out,
                              &err);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

/* All or nothing: a *_many call that failed gives back what it had made of out[0..n). c->mu held. */
static void release_made_locked(gpupool_client *c, gpupool_buffer **out, int n) {
  gpupool__error ignored; /* the failure that undoes them is the one to tell */
  for (int i = 0; i < n; i++)
    if (out[i]) {
      gpupool__release_locked(c, out[i], NULL, &ignored);
      out[i] = NULL;
    }
}

int gpupool_buffer_alloc_many(gpupool_client *c, const char *pool, const size_t *sizes, int n, void *stream,
                              gpupool_buffer **out) {
  pending **ps;
  gpupool__error err; /* why a step after a reply failed */
  int rc = 0;

  if (!c || !sizes || !out || n <= 0)
    return gpupool__err(GPUPOOL_EINVAL, "alloc_many: client, sizes and out must not be NULL, n at least 1");
  gpupool__err_clear();
  for (int i = 0; i < n; i++) {
    out[i] = NULL;
    if (sizes[i] == 0)
      return gpupool__err(GPUPOOL_EINVAL, "alloc_many: size %d is 0; ask for at least 1 byte", i);
  }
  if (!(ps = calloc((size_t)n, sizeof *ps)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__ensure_connected(c, &err);
  /* Every request in flight at once: one round trip, the daemon answering them in order. */
  for (int i = 0; i < n && rc == 0; i++) {
    gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
    al.pool_name = (char *)(pool ? pool : "");
    al.size = sizes[i];
    req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
    req.allocate = &al;
    rc = gpupool__call_send(c, &req, &ps[i], -1, &err);
  }
  for (int i = 0; i < n; i++) {
    gpupool__rep *rep;
    gpupool__error e;
    int r;
    if (!ps[i])
      continue;
    if ((r = gpupool__call_wait(c, ps[i], &rep, NULL, NULL, &e)) != 0) {
      if (!rc) {
        rc = r;
        err = e;
      }
      continue;
    }
    if (rc == 0)
      rc = gpupool__materialize(c, gpupool__reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE), 0, stream,
                                &out[i], &err);
    else {
      const Gpupool__Wire__BufferDesc *d = gpupool__reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE);
      if (d && d->hold_id)
        gpupool__send_release(c, d->hold_id, 0, &e); /* all or nothing (the first failure is told) */
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  if (rc != 0)
    release_made_locked(c, out, n);
  pthread_mutex_unlock(&c->mu);
  free(ps);
  return gpupool__error_report(&err, rc);
}

int gpupool__lost_err(const gpupool_buffer *b) {
  return gpupool__err(GPUPOOL_ELOST,
                      "buffer %" PRIu64 " belonged to a gpupoold that has gone away: its hold and names were lost "
                      "(the memory stays readable here until released); allocate or get it again",
                      b->buffer_id);
}

int gpupool__record_ready(gpupool_client *c, gpupool_buffer *b, void *stream) {
  gpupool__cevent *e = b->ready_id ? gpupool__hmap_get(&c->events, b->ready_id) : NULL;
  uint64_t t0 = TRACE_ON() ? gpupool__mono_ns() : 0;
  int rc = fence_stream(c, e, stream);
  if (t0)
    gpupool__trace("record_ready", t0, b->ready_id);
  return rc < 0 ? rc : 0;
}

/* Before b goes to others (share, publish): connected, b not lost with a previous daemon, and
 * its ready event recorded in stream (or the stream waited for, with host fences). With c->mu
 * held. A failure to reconnect is said in *err; the others are recorded as usual. */
int gpupool__hand_over_prepare(gpupool_client *c, gpupool_buffer *b, void *stream, gpupool__error *err) {
  int rc = gpupool__ensure_connected(c, err);
  if (rc == 0 && b->lost)
    rc = gpupool__lost_err(b);
  return rc == 0 ? gpupool__record_ready(c, b, stream) : rc;
}

int gpupool_client_host_fences(gpupool_client *c) {
  int on;
  if (!c)
    return 0;
  pthread_mutex_lock(&c->mu);
  on = c->host_fences;
  pthread_mutex_unlock(&c->mu);
  return on;
}

/* Share b; a failure of the transport is said in *err. */
static int share(gpupool_buffer *b, void *stream, int keep, gpupool_token *out, gpupool__error *err) {
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
  sh.keep = keep;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_SHARE;
  req.share = &sh;
  pthread_mutex_lock(&c->mu);
  if ((rc = gpupool__hand_over_prepare(c, b, stream, err)) == 0 &&
      (rc = gpupool__call(c, &req, &rep, NULL, err)) == 0) {
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

int gpupool_buffer_share(gpupool_buffer *b, void *stream, gpupool_token *out) {
  gpupool__error err = {.code = 0};
  int rc = share(b, stream, 0, out, &err);
  return gpupool__error_report(&err, rc);
}

int gpupool_buffer_share_kept(gpupool_buffer *b, void *stream, gpupool_token *out) {
  gpupool__error err = {.code = 0};
  int rc = share(b, stream, 1, out, &err);
  return gpupool__error_report(&err, rc);
}

/* 0, or the ELOST error of the first of bufs[0..n) that belonged to a daemon gone since. */
static int lost_among(gpupool_buffer *const *bufs, int n) {
  for (int i = 0; i < n; i++)
    if (bufs[i]->lost)
      return gpupool__lost_err(bufs[i]);
  return 0;
}

/* bufs[0..n) non-NULL and of one client: that client, or NULL after setting the error. */
static gpupool_client *client_of_all(gpupool_buffer *const *bufs, int n, const char *what) {
  gpupool_client *c;
  if (!bufs || n <= 0) {
    gpupool__err(GPUPOOL_EINVAL, "%s: at least one buffer is needed", what);
    return NULL;
  }
  for (int i = 0; i < n; i++)
    if (!bufs[i]) {
      gpupool__err(GPUPOOL_EINVAL, "%s: buffer %d is NULL", what, i);
      return NULL;
    }
  c = bufs[0]->c;
  for (int i = 1; i < n; i++)
    if (bufs[i]->c != c) {
      gpupool__err(GPUPOOL_EINVAL, "%s: buffer %d belongs to another client than buffer 0; one request "
                   "names holds of one client", what, i);
      return NULL;
    }
  return c;
}

/* sh names bufs[0..n)'s holds as kept shares (more: room for n - 1 ids). */
static void share_holds(Gpupool__Wire__Share *sh, gpupool_buffer *const *bufs, int n, uint64_t *more) {
  sh->hold_id = bufs[0]->hold_id;
  for (int i = 1; i < n; i++)
    more[i - 1] = bufs[i]->hold_id;
  sh->n_more_hold_ids = (size_t)(n - 1);
  sh->more_hold_ids = more;
  sh->keep = 1;
}

/* Each ready event of bufs[0..n) recorded in stream, as gpupool_buffer_share does, but the
 * stream asked once whether it is idle (then there is nothing to wait for), not once per
 * buffer; *together: every one was recorded here, one after another in one stream, so an
 * opener of several of them waits on one (the daemon groups their kept shares). With c->mu. */
static int record_many(gpupool_client *c, gpupool_buffer *const *bufs, int n, void *stream,
                       protobuf_c_boolean *together) {
  uint64_t t_r = TRACE_ON() ? gpupool__mono_ns() : 0;
  int recorded = 0, rc = 0;
  if (!(c->be->stream_idle && c->be->stream_idle(stream) == 1)) {
    if (c->host_fences)
      rc = c->be->sync ? c->be->sync(stream) : 0;
    else
      for (int i = 0; i < n && rc == 0; i++) {
        gpupool__cevent *e = bufs[i]->ready_id ? gpupool__hmap_get(&c->events, bufs[i]->ready_id) : NULL;
        if (e && (rc = c->be->event_record(e, stream)) > 0)
          rc = 0;
        recorded += e != NULL && rc == 0;
      }
  }
  *together = n > 1 && recorded == n;
  if (t_r)
    gpupool__trace("record_many", t_r, (uint64_t)n);
  return rc;
}

/* The waited share of share_kept_many, also reserving ids for the shares that do not wait
 * (reserve > 0). */
static int share_kept_many(gpupool_buffer *const *bufs, int n, void *stream, gpupool_token *out,
                           gpupool_buffer *const *ask, int nask, int *idle, uint32_t reserve);

int gpupool_buffer_share_kept_many(gpupool_buffer *const *bufs, int n, void *stream, gpupool_token *out,
                                   gpupool_buffer *const *ask, int nask, int *idle) {
  return share_kept_many(bufs, n, stream, out, ask, nask, idle, 0);
}

void (*gpupool__hook_nowait)(gpupool_client *c, const gpupool_token *out, int n);

/* n bytes from the kernel's random source (getrandom(2): glibc 2.25, which the wheel's tag
 * allows, unlike arc4random): 0, or -1 when it cannot give them. */
static int draw_secrets(uint8_t *p, size_t n) {
  size_t have = 0;
  while (have < n) {
    ssize_t r = getrandom(p + have, n - have, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    have += (size_t)r;
  }
  return 0;
}

/* Shares not waited for at once in flight on one connection: past this, the next one reads
 * replies first (the daemon drops a client that lets its replies pile up). */
#define NOWAIT_INFLIGHT_MAX 64
/* Ids reserved at a time. */
#define NOWAIT_RESERVE 256

int gpupool_buffer_share_kept_many_nowait(gpupool_buffer *const *bufs, int n, void *stream, gpupool_token *out) {
  gpupool_client *c;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Share sh = GPUPOOL__WIRE__SHARE__INIT;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  uint64_t *more = NULL;
  uint8_t *secrets = NULL;
  pending *p = NULL;
  int rc = 0;

  gpupool__err_clear();
  if (!(c = client_of_all(bufs, n, "share_kept_many_nowait")))
    return GPUPOOL_EINVAL;
  if (!out)
    return gpupool__err(GPUPOOL_EINVAL, "share_kept_many_nowait: out must not be NULL");
  pthread_mutex_lock(&c->mu);
  if ((rc = gpupool__ensure_connected(c, &err)) == 0)
    rc = lost_among(bufs, n);
  /* Not too many replies left unread (the lock is let go meanwhile). */
  while (rc == 0 && c->nowait_inflight >= NOWAIT_INFLIGHT_MAX && !c->broken) {
    if (!c->reader_active)
      gpupool__read_reply(c);
    else
      pthread_cond_wait(&c->cv, &c->mu);
  }
  if (rc == 0 && (c->broken || c->resv_end - c->resv_next < (uint64_t)n)) {
    /* Not enough ids reserved (the first share of a connection, every 256 tokens, another
     * thread's reserve in flight), or the connection broke while replies were read: this one
     * waits for its reply, which reserves the next ids (and reconnects first if need be). */
    pthread_mutex_unlock(&c->mu);
    return share_kept_many(bufs, n, stream, out, NULL, 0, NULL, n <= NOWAIT_RESERVE ? NOWAIT_RESERVE : 0);
  }
  if (rc == 0 && ((n > 1 && !(more = malloc((size_t)(n - 1) * sizeof *more))) || !(secrets = malloc((size_t)n * 16))))
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  if (rc == 0 && draw_secrets(secrets, (size_t)n * 16) != 0) {
    /* No randomness from the kernel: the daemon draws the secrets (a share that waits). */
    pthread_mutex_unlock(&c->mu);
    free(more);
    free(secrets);
    return share_kept_many(bufs, n, stream, out, NULL, 0, NULL, 0);
  }
  if (rc == 0)
    rc = record_many(c, bufs, n, stream, &sh.ready_together);
  if (rc == 0) {
    share_holds(&sh, bufs, n, more);
    sh.from_reserve = 1;
    sh.secrets.data = secrets;
    sh.secrets.len = (size_t)n * 16;
    req.body_case = GPUPOOL__WIRE__REQUEST__BODY_SHARE;
    req.share = &sh;
    /* The tokens: the next n reserved ids (taken now: the daemon takes them in the order of
     * this connection's requests), each with its secret. */
    for (int i = 0; i < n; i++) {
      uint64_t id = c->resv_next + (uint64_t)i;
      for (int b = 0; b < 8; b++)
        out[i].bytes[b] = (uint8_t)(id >> (8 * b));
      memcpy(out[i].bytes + 8, secrets + 16 * i, 16);
    }
    c->resv_next += (uint64_t)n;
    if (gpupool__hook_nowait) {
      pthread_mutex_unlock(&c->mu);
      gpupool__hook_nowait(c, out, n);
      pthread_mutex_lock(&c->mu);
    }
    if ((rc = gpupool__call_send(c, &req, &p, -1, &err)) == 0) {
      /* Sent whole: the daemon reads it before anything this process writes later, and an
       * Open of its tokens that it reads first waits for it. */
      p->detached = 1;
      c->nowait_inflight++;
    }
  }
  pthread_mutex_unlock(&c->mu);
  free(more);
  free(secrets);
  return gpupool__error_report(&err, rc);
}

uint64_t gpupool_client_nowait_failures(gpupool_client *c, char *msg, size_t len) {
  uint64_t n;
  if (!c)
    return 0;
  pthread_mutex_lock(&c->mu);
  n = c->nowait_failed;
  if (msg && len)
    snprintf(msg, len, "%s", c->nowait_msg);
  pthread_mutex_unlock(&c->mu);
  return n;
}

static int share_kept_many(gpupool_buffer *const *bufs, int n, void *stream, gpupool_token *out,
                           gpupool_buffer *const *ask, int nask, int *idle, uint32_t reserve) {
  gpupool_client *c;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Share sh = GPUPOOL__WIRE__SHARE__INIT;
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  uint64_t *more = NULL, *asked = NULL;
  int rc = 0;

  gpupool__err_clear();
  if (!(c = client_of_all(bufs, n, "share_kept_many")))
    return GPUPOOL_EINVAL;
  if (!out || nask < 0 || (nask > 0 && (!idle || client_of_all(ask, nask, "share_kept_many (ask)") != c)))
    return gpupool__err(GPUPOOL_EINVAL, "share_kept_many: out must not be NULL, and ask (nask >= 0, with idle) "
                        "must name buffers of the same client");
  for (int i = 0; i < nask; i++)
    idle[i] = 0;
  if ((n > 1 && !(more = malloc((size_t)(n - 1) * sizeof *more))) ||
      (nask > 0 && !(asked = malloc((size_t)nask * sizeof *asked)))) {
    free(more);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (int i = 0; i < nask; i++)
    asked[i] = ask[i]->hold_id;
  sh.n_idle_hold_ids = (size_t)nask;
  sh.idle_hold_ids = asked;
  share_holds(&sh, bufs, n, more);
  sh.reserve = reserve;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_SHARE;
  req.share = &sh;
  pthread_mutex_lock(&c->mu);
  if ((rc = gpupool__ensure_connected(c, &err)) == 0)
    rc = lost_among(bufs, n);
  if (rc == 0)
    rc = record_many(c, bufs, n, stream, &sh.ready_together);
  if (reserve && c->resv_asked)
    sh.reserve = reserve = 0; /* another thread's reserve is in flight */
  if (rc == 0 && reserve) {
    /* The daemon gives up what is left of the reserve when it reads this request: so does
     * this process now (a share from it sent after this one would not match). */
    c->resv_next = c->resv_end;
    c->resv_asked = 1;
  }
  if (rc == 0 && (rc = gpupool__call(c, &req, &rep, NULL, &err)) == 0) {
    const Gpupool__Wire__ShareReply *r = rep->share;
    int ok = rep->body_case == GPUPOOL__WIRE__REPLY__BODY_SHARE && r && r->token.len == GPUPOOL_TOKEN_SIZE &&
             r->n_more_tokens == (size_t)(n - 1);
    for (size_t i = 0; ok && i < r->n_more_tokens; i++)
      ok = r->more_tokens[i].len == GPUPOOL_TOKEN_SIZE;
    if (ok && r->n_idle == (size_t)nask)
      for (int i = 0; i < nask; i++)
        idle[i] = r->idle[i] != 0;
    if (!ok)
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered a share of %d buffers with %s: it may be older than "
                        "this library (share them one by one)", n,
                        r && r->token.len ? "a different number of tokens" : "a malformed reply");
    else {
      memcpy(out[0].bytes, r->token.data, GPUPOOL_TOKEN_SIZE);
      for (size_t i = 0; i < r->n_more_tokens; i++)
        memcpy(out[i + 1].bytes, r->more_tokens[i].data, GPUPOOL_TOKEN_SIZE);
      if (reserve && r->reserve_count) {
        c->resv_next = r->reserve_first;
        c->resv_end = r->reserve_first + r->reserve_count;
      }
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  if (reserve)
    c->resv_asked = 0;
  pthread_mutex_unlock(&c->mu);
  free(more);
  free(asked);
  return gpupool__error_report(&err, rc);
}

int gpupool_buffer_idle_many(gpupool_buffer *const *bufs, int n, int *idle) {
  gpupool_client *c;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Idle id = GPUPOOL__WIRE__IDLE__INIT;
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  uint64_t *ids;
  int rc;

  gpupool__err_clear();
  if (!(c = client_of_all(bufs, n, "idle_many")))
    return GPUPOOL_EINVAL;
  if (!idle)
    return gpupool__err(GPUPOOL_EINVAL, "idle_many: idle must not be NULL");
  for (int i = 0; i < n; i++)
    idle[i] = 0;
  if ((rc = gpupool__idle_request(bufs, n, &req, &id, &ids)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  if ((rc = gpupool__ensure_connected(c, &err)) == 0)
    rc = lost_among(bufs, n);
  if (rc == 0 && (rc = gpupool__call(c, &req, &rep, NULL, &err)) == 0)
    rc = gpupool__idle_answer(rep, n, idle);
  pthread_mutex_unlock(&c->mu);
  free(ids);
  return gpupool__error_report(&err, rc);
}

int gpupool__idle_request(gpupool_buffer *const *bufs, int n, gpupool__req *req, Gpupool__Wire__Idle *id,
                          uint64_t **ids) {
  if (!(*ids = malloc((size_t)n * sizeof **ids)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < n; i++)
    (*ids)[i] = bufs[i]->hold_id;
  id->n_hold_ids = (size_t)n;
  id->hold_ids = *ids;
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_IDLE;
  req->idle = id;
  return 0;
}

int gpupool__idle_answer(gpupool__rep *rep, int n, int *idle) {
  int rc = 0;
  if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_IDLE || !rep->idle || rep->idle->n_idle != (size_t)n)
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon sent a malformed answer to Idle");
  else
    for (int i = 0; i < n; i++)
      idle[i] = rep->idle->idle[i] != 0;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return rc;
}

/* GPUPOOL_KEEP_MAPPED: b's slab stays mapped after its last buffer goes, until revoked. */
void gpupool__keep_mapped(gpupool_buffer *b, unsigned flags) {
  if (b && (flags & GPUPOOL_KEEP_MAPPED))
    b->slab->keep = 1;
}

int gpupool_buffer_open(gpupool_client *c, const gpupool_token *token, unsigned flags, void *stream,
                        gpupool_buffer **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Open op = GPUPOOL__WIRE__OPEN__INIT;
  gpupool__rep *rep;
  gpupool__error err; /* why a step after the reply failed */
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
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__call_retry(c, &req, &rep, -1, &err);
  if (rc == 0) {
    rc = gpupool__materialize(c, gpupool__reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_OPEN), 1, stream, out, &err);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    if (rc == 0)
      gpupool__keep_mapped(*out, flags);
  }
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_buffer_open_many(gpupool_client *c, const gpupool_token *tokens, int n, unsigned flags, void *stream,
                             gpupool_buffer **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Open op = GPUPOOL__WIRE__OPEN__INIT;
  ProtobufCBinaryData *more = NULL;
  gpupool__error err, ignored; /* why it failed; a cleanup's failure after it */
  int rc = 0, done = 0;
  /* The ready groups whose wait this call has made (a few per message: one per Share of a
   * stream); past READY_GROUPS_SEEN distinct ones, each buffer waits on its own event. */
  enum { READY_GROUPS_SEEN = 16 };
  uint64_t seen[READY_GROUPS_SEEN];
  int nseen = 0;
  /* The ready events this call has queried or waited on: a sharer's buffers take their events
   * from a few it has (32 each), so the buffers of a message repeat them, and an event's last
   * record said all it can the first time (a query is a driver call, ~2 us). */
  enum { READY_EVENTS_SEEN = 64 };
  uint64_t evseen[READY_EVENTS_SEEN];
  int nev = 0;

  if (!c || !tokens || !out || n <= 0)
    return gpupool__err(GPUPOOL_EINVAL, "open_many: client, tokens and out must not be NULL, n at least 1");
  gpupool__err_clear();
  for (int i = 0; i < n; i++)
    out[i] = NULL;
  if (n > 1 && !(more = calloc((size_t)(n - 1), sizeof *more)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  op.read_only = (flags & GPUPOOL_READ_ONLY) != 0;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_OPEN;
  req.open = &op;
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  /* A request per run of tokens the daemon opens at once (all of them, unless their slabs need
   * more fds than one reply carries). */
  while (done < n && rc == 0) {
    gpupool__rep *rep;
    const Gpupool__Wire__OpenReply *r;
    size_t got;
    op.token.data = (uint8_t *)tokens[done].bytes;
    op.token.len = GPUPOOL_TOKEN_SIZE;
    for (int i = done + 1; i < n; i++) {
      more[i - done - 1].data = (uint8_t *)tokens[i].bytes;
      more[i - done - 1].len = GPUPOOL_TOKEN_SIZE;
    }
    op.n_more_tokens = (size_t)(n - done - 1);
    op.more_tokens = more;
    if ((rc = gpupool__call_retry(c, &req, &rep, -1, &err)) != 0)
      break;
    r = rep->body_case == GPUPOOL__WIRE__REPLY__BODY_OPEN ? rep->open : NULL;
    got = r ? 1 + r->n_more : 0;
    if (!r || got > (size_t)(n - done)) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered an open of %d tokens with %zu buffers", n - done,
                        got);
      for (size_t i = 0; r && i < got; i++) {
        const Gpupool__Wire__BufferDesc *d = i == 0 ? r->buffer : r->more[i - 1];
        if (d && d->hold_id)
          gpupool__send_release(c, d->hold_id, 0, &ignored);
      }
      gpupool__wire__reply__free_unpacked(rep, NULL);
      break;
    }
    uint64_t t_mm = TRACE_ON() ? gpupool__mono_ns() : 0;
    for (size_t i = 0; i < got; i++) {
      const Gpupool__Wire__BufferDesc *d = i == 0 ? r->buffer : r->more[i - 1];
      if (rc == 0) {
        /* A buffer of a ready group already waited for is ready when the first one is. */
        uint64_t g = d ? d->ready_group : 0;
        int k = 0;
        while (g && k < nseen && seen[k] != g)
          k++;
        int wait = !g || k == nseen;
        uint64_t ev = d && d->ready ? d->ready->id : 0;
        for (int j = 0; wait && ev && j < nev; j++)
          if (evseen[j] == ev)
            wait = 0;
        rc = gpupool__materialize(c, d, wait, stream, &out[done + (int)i], &err);
        if (rc == 0) {
          gpupool__keep_mapped(out[done + (int)i], flags);
          if (g && wait && nseen < READY_GROUPS_SEEN)
            seen[nseen++] = g;
          if (ev && wait && nev < READY_EVENTS_SEEN)
            evseen[nev++] = ev;
        }
      } else if (d && d->hold_id) {
        gpupool__send_release(c, d->hold_id, 0, &ignored); /* all or nothing: the rest of this reply goes too */
      }
    }
    if (t_mm)
      gpupool__trace("materialize_many", t_mm, (uint64_t)got);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    done += (int)got;
  }
  if (rc != 0)
    release_made_locked(c, out, n);
  pthread_mutex_unlock(&c->mu);
  free(more);
  return gpupool__error_report(&err, rc);
}

/* The version a publish reply carries (0 when the daemon is too old to say). */
uint64_t gpupool__reply_version(const gpupool__rep *rep) {
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_PUBLISH && rep->publish)
    return rep->publish->version;
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_PUBLISH_BUNDLE && rep->publish_bundle)
    return rep->publish_bundle->version;
  if (rep->body_case == GPUPOOL__WIRE__REPLY__BODY_GET && rep->get)
    return rep->get->version;
  return 0;
}

/* Checks a publish of b and fills its request (pb, tm: the caller's storage). */
int gpupool__publish_request(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, gpupool__req *req,
                             Gpupool__Wire__Publish *pb, Gpupool__Wire__TensorMeta *tm) {
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
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH;
  req->publish = pb;
  return 0;
}

static void published_locally(gpupool_client *c, gpupool_buffer *b, const char *name,
                              const gpupool_tensor_meta *meta) {
  gpupool__note_published(c, name);
  if (meta) {
    b->meta = *meta;
    b->has_meta = 1;
  }
}

/* The devices of a broadcast publish, as the wire has them: 0 or an error naming the bad one. */
int gpupool__replicate_to(const int *devices, int n, uint32_t *out) {
  if (n < 0 || n > 16 || (n > 0 && !devices))
    return gpupool__err(GPUPOOL_EINVAL, "publish_to: 0 to 16 devices, not %d%s", n,
                        n > 0 && !devices ? " with no array" : "");
  for (int i = 0; i < n; i++) {
    if (devices[i] < 0 || devices[i] > 1023)
      return gpupool__err(GPUPOOL_EINVAL, "publish_to: device %d is no device ordinal (0..1023)", devices[i]);
    out[i] = (uint32_t)devices[i];
  }
  return 0;
}

int gpupool_buffer_publish(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream,
                           uint64_t *version) {
  return gpupool_buffer_publish_to(b, name, meta, stream, NULL, 0, version);
}

int gpupool_buffer_publish_to(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream,
                              const int *devices, int n, uint64_t *version) {
  gpupool_client *c;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Publish pb;
  Gpupool__Wire__TensorMeta tm = GPUPOOL__WIRE__TENSOR_META__INIT;
  gpupool__rep *rep;
  uint32_t devs[16];
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc;

  gpupool__err_clear();
  if (version)
    *version = 0;
  if ((rc = gpupool__replicate_to(devices, n, devs)) != 0)
    return rc;
  if ((rc = gpupool__publish_request(b, name, meta, &req, &pb, &tm)) != 0)
    return rc;
  pb.n_replicate_to = (size_t)n;
  pb.replicate_to = devs;
  c = b->c;
  pthread_mutex_lock(&c->mu);
  if ((rc = gpupool__hand_over_prepare(c, b, stream, &err)) == 0 &&
      (rc = gpupool__call(c, &req, &rep, NULL, &err)) == 0) {
    if (version)
      *version = gpupool__reply_version(rep);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    published_locally(c, b, name, meta);
  }
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

/* A get waiting for a publisher when the daemon goes away was dropped with its connection:
 * ask the next daemon again for what is left of its timeout (a name published there ends the
 * wait), as often as the daemon restarts within that time. With c->mu held; *err says why it
 * failed. */
int gpupool__get_across_restarts(gpupool_client *c, gpupool__req *req, uint32_t *wire_timeout_ms, int timeout_ms,
                                 gpupool__rep **out, uint64_t *known_layout, gpupool__error *err) {
  uint64_t start = gpupool__mono_ns() / 1000000;
  int rc = gpupool__ensure_connected(c, err);
  if (rc != 0)
    return rc;
  for (int attempt = 0;; attempt++) {
    uint64_t spent;
    int last = attempt > 0 && *wire_timeout_ms == 0; /* the final try already asked for no wait */
    rc = gpupool__call(c, req, out, NULL, err);
    if ((rc != GPUPOOL_ECLOSED && rc != GPUPOOL_EIO) || !c->broken || c->reconnect_ms <= 0 || last)
      return rc;
    err->code = 0; /* the lost connection's failure is not this get's: it asks again */
    if ((rc = gpupool__ensure_connected(c, err)) != 0)
      return rc;
    if (known_layout)
      *known_layout = 0; /* a layout id of the daemon that went away names nothing here */
    spent = gpupool__mono_ns() / 1000000 - start;
    if (timeout_ms >= 0)
      *wire_timeout_ms = spent >= (uint64_t)timeout_ms ? 0 : (uint32_t)((uint64_t)timeout_ms - spent);
  }
}

int gpupool__get_request(const char *name, uint64_t newer_than, int timeout_ms, unsigned flags, gpupool__req *req,
                         Gpupool__Wire__Get *gt) {
  int rc;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gpupool__wire__get__init(gt);
  gt->name = (char *)name;
  gt->timeout_ms = gpupool__wire_timeout(timeout_ms);
  gt->read_only = (flags & GPUPOOL_READ_ONLY) != 0;
  gt->newer_than = newer_than;
  gt->target_device = gpupool__target_device(flags);
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_GET;
  req->get = gt;
  return 0;
}

/* A Get's reply turned into the caller's buffer (and version), the reply freed; blocking and
 * pipelined gets alike. With c->mu held; *err says why it failed. */
int gpupool__get_finish(gpupool_client *c, gpupool__rep *rep, unsigned flags, void *stream, gpupool_buffer **out,
                        uint64_t *version, gpupool__error *err) {
  int rc;
  if (version)
    *version = gpupool__reply_version(rep);
  rc = gpupool__materialize(c, gpupool__reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_GET), 1, stream, out, err);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  if (rc == 0)
    gpupool__keep_mapped(*out, flags);
  return rc;
}

int gpupool_buffer_get(gpupool_client *c, const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                       void *stream, gpupool_buffer **out, uint64_t *version) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get gt;
  gpupool__rep *rep;
  gpupool__error err; /* why a step after the reply failed */
  int rc;

  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "get: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if (version)
    *version = 0;
  if ((rc = gpupool__get_request(name, newer_than, timeout_ms, flags, &req, &gt)) != 0)
    return rc;
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__get_across_restarts(c, &req, &gt.timeout_ms, timeout_ms, &rep, NULL, &err);
  if (rc == 0)
    rc = gpupool__get_finish(c, rep, flags, stream, out, version, &err);
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_name_unpublish(gpupool_client *c, const char *name) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Unpublish up = GPUPOOL__WIRE__UNPUBLISH__INIT;
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc;
  if (!c || !name)
    return gpupool__err(GPUPOOL_EINVAL, "unpublish: client and name must not be NULL");
  gpupool__err_clear();
  up.name = (char *)name;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_UNPUBLISH;
  req.unpublish = &up;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__call_retry(c, &req, &rep, -1, &err);
  if (rc == 0) {
    gpupool__wire__reply__free_unpacked(rep, NULL);
    gpupool__note_unpublished(c, name);
  }
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

void *gpupool_buffer_ptr(const gpupool_buffer *b) { return b ? (char *)b->base + b->offset : NULL; }
size_t gpupool_buffer_size(const gpupool_buffer *b) { return b ? (size_t)b->size : 0; }
int gpupool_buffer_device(const gpupool_buffer *b) {
  return b && b->slab->pool->kind != GPUPOOL_MEM_HOST ? b->slab->pool->device : -1;
}
gpupool_mem_kind gpupool_buffer_kind(const gpupool_buffer *b) { return b ? b->slab->pool->kind : GPUPOOL_MEM_HOST; }
uint64_t gpupool_buffer_id(const gpupool_buffer *b) { return b ? b->buffer_id : 0; }
void gpupool_buffer_facts(const gpupool_buffer *b, uint64_t *out) {
  if (!out)
    return;
  out[0] = (uint64_t)(uintptr_t)gpupool_buffer_ptr(b);
  out[1] = gpupool_buffer_size(b);
  out[2] = (uint64_t)gpupool_buffer_kind(b);
  out[3] = (uint64_t)(gpupool_buffer_device(b) + 1);
  out[4] = gpupool_buffer_id(b);
  out[5] = (uint64_t)gpupool_buffer_read_only(b);
}
void gpupool_buffer_facts_many(gpupool_buffer *const *bufs, int n, uint64_t *out) {
  if (!bufs || !out)
    return;
  for (int i = 0; i < n; i++)
    gpupool_buffer_facts(bufs[i], out + 6 * (size_t)i);
}
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
