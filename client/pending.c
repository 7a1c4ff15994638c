/*
 * libgpupool-client, pending.c: Pipelined requests (gpupool_*_begin / *_end): a request sent now
 * whose reply is taken later, several in flight together. See internal.h for how the client is put
 * together.
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

#include "internal.h"

enum { PEND_GET = 1, PEND_BGET, PEND_PUBLISH, PEND_RELEASE, PEND_IDLE };

struct gpupool_pending {
  gpupool_client *c;
  pending *p;
  int kind;
  unsigned flags;             /* gets: GPUPOOL_KEEP_MAPPED applies when they end */
  clayout *known;             /* PEND_BGET: the table named as known (a reference), or NULL */
  int count;                  /* PEND_IDLE: the buffers asked about */
  char name[GPUPOOL_NAME_MAX + 1];
};

/* Send req as a pending request of kind. With c->mu held; *err says why it failed. */
static int begin_locked(gpupool_client *c, gpupool__req *req, int kind, gpupool_pending **out, gpupool__error *err) {
  gpupool_pending *gp = calloc(1, sizeof *gp);
  int rc;
  if (!gp)
    return gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory");
  if ((rc = gpupool__ensure_connected(c, err)) != 0 || (rc = gpupool__call_send(c, req, &gp->p, -1, err)) != 0) {
    free(gp);
    return rc;
  }
  gp->c = c;
  gp->kind = kind;
  *out = gp;
  return 0;
}

int gpupool_buffer_get_begin(gpupool_client *c, const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                             gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Get gt;
  gpupool__error err = {.code = 0}; /* why sending failed */
  int rc;
  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "get_begin: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = gpupool__get_request(name, newer_than, timeout_ms, flags, &req, &gt)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  if ((rc = begin_locked(c, &req, PEND_GET, out, &err)) == 0)
    (*out)->flags = flags;
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_bundle_get_begin(gpupool_client *c, const char *name, uint64_t newer_than, int timeout_ms,
                             unsigned flags, gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__GetBundle gb;
  gpupool__error err = {.code = 0}; /* why sending failed */
  int rc;
  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_get_begin: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = gpupool__bundle_get_request(name, newer_than, timeout_ms, flags, &req, &gb)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  if ((rc = gpupool__ensure_connected(c, &err)) == 0) {
    clayout *known = gpupool__layout_cached(c, name);
    gb.known_layout = known ? known->id : 0;
    if ((rc = begin_locked(c, &req, PEND_BGET, out, &err)) == 0) {
      (*out)->flags = flags;
      (*out)->known = known;
      if (known)
        known->refs++;
      snprintf((*out)->name, sizeof (*out)->name, "%s", name);
    }
  }
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_buffer_publish_begin(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, void *stream,
                                 gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Publish pb;
  Gpupool__Wire__TensorMeta tm = GPUPOOL__WIRE__TENSOR_META__INIT;
  gpupool_client *c;
  gpupool__error err = {.code = 0}; /* why sending failed */
  int rc;
  if (!out)
    return gpupool__err(GPUPOOL_EINVAL, "publish_begin: out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = gpupool__publish_request(b, name, meta, &req, &pb, &tm)) != 0)
    return rc;
  c = b->c;
  pthread_mutex_lock(&c->mu);
  if ((rc = gpupool__hand_over_prepare(c, b, stream, &err)) == 0 &&
      (rc = begin_locked(c, &req, PEND_PUBLISH, out, &err)) == 0) {
    snprintf((*out)->name, sizeof (*out)->name, "%s", name);
    /* Now, not at the end: the caller may release b before ending the publish. */
    if (meta) {
      b->meta = *meta;
      b->has_meta = 1;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_buffer_release_begin(gpupool_buffer *b, void *stream, gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Release rl;
  gpupool_client *c;
  uint64_t hold_id;
  gpupool__error err = {.code = 0}, gone; /* why sending failed; a reconnect's failure */
  int recorded, rc = 0;
  if (!b || !out)
    return gpupool__err(GPUPOOL_EINVAL, "release_begin: buffer and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  c = b->c;
  pthread_mutex_lock(&c->mu);
  gpupool__ensure_connected(c, &gone);
  gpupool__release_local(c, b, stream, &hold_id, &recorded);
  if (hold_id) {
    gpupool__release_request(&req, &rl, hold_id, recorded);
    rc = begin_locked(c, &req, PEND_RELEASE, out, &err);
  }
  pthread_mutex_unlock(&c->mu);
  /* Lost with its daemon: nothing to wait for (*out stays NULL, which pending_end accepts). */
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : gpupool__error_report(&err, rc);
}

int gpupool_buffer_idle_many_begin(gpupool_buffer *const *bufs, int n, gpupool_pending **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Idle id = GPUPOOL__WIRE__IDLE__INIT;
  gpupool__error err = {.code = 0}; /* why sending failed */
  gpupool_client *c;
  uint64_t *ids;
  int rc = 0;
  if (!bufs || n <= 0 || !out)
    return gpupool__err(GPUPOOL_EINVAL, "idle_many_begin: at least one buffer, and out, are needed");
  gpupool__err_clear();
  *out = NULL;
  for (int i = 0; i < n; i++)
    if (!bufs[i] || bufs[i]->c != bufs[0]->c)
      return gpupool__err(GPUPOOL_EINVAL, "idle_many_begin: buffer %d is NULL or of another client than buffer 0", i);
  c = bufs[0]->c;
  if ((rc = gpupool__idle_request(bufs, n, &req, &id, &ids)) != 0)
    return rc;
  pthread_mutex_lock(&c->mu);
  for (int i = 0; i < n && rc == 0; i++)
    if (bufs[i]->lost)
      rc = gpupool__lost_err(bufs[i]);
  if (rc == 0 && (rc = begin_locked(c, &req, PEND_IDLE, out, &err)) == 0)
    (*out)->count = n;
  pthread_mutex_unlock(&c->mu);
  free(ids);
  return gpupool__error_report(&err, rc);
}

/* Wait for gp's reply (frees gp). With c->mu held; *err says why it failed. */
static int end_locked(gpupool_pending *gp, gpupool__rep **rep, gpupool__error *err) {
  pending *p = gp->p;
  gpupool_client *c = gp->c;
  free(gp);
  return gpupool__call_wait(c, p, rep, NULL, NULL, err);
}

int gpupool_buffer_get_end(gpupool_pending *gp, void *stream, gpupool_buffer **out, uint64_t *version) {
  gpupool_client *c;
  gpupool__rep *rep;
  gpupool__error err; /* why a step after the reply failed */
  unsigned flags;
  int rc;
  if (!gp || !out || gp->kind != PEND_GET)
    return gpupool__err(GPUPOOL_EINVAL, "get_end: needs a pending get from gpupool_buffer_get_begin");
  gpupool__err_clear();
  *out = NULL;
  if (version)
    *version = 0;
  c = gp->c;
  flags = gp->flags;
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  if ((rc = end_locked(gp, &rep, &err)) == 0)
    rc = gpupool__get_finish(c, rep, flags, stream, out, version, &err);
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_bundle_get_end(gpupool_pending *gp, void *stream, gpupool_bundle **out) {
  gpupool_client *c;
  gpupool__rep *rep;
  char name[GPUPOOL_NAME_MAX + 1];
  clayout *known;
  gpupool__error err; /* why a step after the reply failed */
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
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  if ((rc = end_locked(gp, &rep, &err)) == 0)
    rc = gpupool__bundle_get_finish(c, rep, flags, stream, name, known, out, &err);
  gpupool__clayout_unref(known);
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_buffer_idle_many_end(gpupool_pending *gp, int *idle) {
  gpupool_client *c;
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why the wait failed */
  int rc, n;
  if (!gp || !idle || gp->kind != PEND_IDLE)
    return gpupool__err(GPUPOOL_EINVAL, "idle_many_end: needs a pending Idle from gpupool_buffer_idle_many_begin, "
                        "and idle");
  gpupool__err_clear();
  c = gp->c;
  n = gp->count;
  for (int i = 0; i < n; i++)
    idle[i] = 0;
  pthread_mutex_lock(&c->mu);
  if ((rc = end_locked(gp, &rep, &err)) == 0)
    rc = gpupool__idle_answer(rep, n, idle);
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_pending_end(gpupool_pending *gp, uint64_t *version) {
  gpupool_client *c;
  char name[GPUPOOL_NAME_MAX + 1];
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why the wait failed */
  int rc, kind;
  if (version)
    *version = 0;
  if (!gp)
    return 0; /* a release_begin of a buffer whose daemon was gone */
  if (gp->kind != PEND_PUBLISH && gp->kind != PEND_RELEASE)
    return gpupool__err(GPUPOOL_EINVAL, "pending_end: ends a publish or a release; end gets with gpupool_buffer_get_end "
                        "or gpupool_bundle_get_end, an Idle with gpupool_buffer_idle_many_end");
  gpupool__err_clear();
  c = gp->c;
  kind = gp->kind;
  memcpy(name, gp->name, sizeof name);
  pthread_mutex_lock(&c->mu);
  if ((rc = end_locked(gp, &rep, &err)) == 0) {
    if (version)
      *version = gpupool__reply_version(rep);
    gpupool__wire__reply__free_unpacked(rep, NULL);
    if (kind == PEND_PUBLISH)
      gpupool__note_published(c, name);
  }
  pthread_mutex_unlock(&c->mu);
  if (kind == PEND_RELEASE && (rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO))
    return 0; /* a broken connection already dropped the hold */
  return gpupool__error_report(&err, rc);
}

void gpupool_pending_cancel(gpupool_pending *gp) {
  gpupool_client *c;
  gpupool__rep *rep;
  gpupool__error ignored; /* a cancel tells nothing */
  int kind;
  if (!gp)
    return;
  c = gp->c;
  kind = gp->kind;
  pthread_mutex_lock(&c->mu);
  gpupool__clayout_unref(gp->known);
  if (end_locked(gp, &rep, &ignored) == 0) {
    /* Undo what the reply brought: holds this process never turned into buffers. */
    if (kind == PEND_GET) {
      const Gpupool__Wire__BufferDesc *d = gpupool__reply_desc(rep, GPUPOOL__WIRE__REPLY__BODY_GET);
      if (d && d->hold_id)
        gpupool__send_release(c, d->hold_id, 0, &ignored);
    } else if (kind == PEND_BGET) {
      gpupool__release_holds_from(c, gpupool__reply_bundle(rep), 0, c->reconnects);
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
}
