/*
 * libgpupool-client, bundles.c: Bundles: member tables (layouts) and their per-name cache, bundle
 * alloc, publish, get and release, and the bundle accessors. See internal.h for how the client is
 * put together.
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
#include "refit_internal.h"

/* At most this many names keep a cached layout; past it the cache starts over. */
#define LAYOUT_CACHE_MAX 256

void gpupool__clayout_unref(clayout *l) {
  if (!l || --l->refs > 0)
    return;
  free(l->members);
  free(l->names);
  free(l->need);
  free(l);
}

/* Forget every cached layout (the daemon's ids mean nothing to another daemon). With c->mu. */
void gpupool__layout_cache_clear(gpupool_client *c) {
  for (size_t i = 0; i < c->layout_cache.cap; i++)
    if (gpupool__smap_slot_used(&c->layout_cache, i))
      gpupool__clayout_unref(c->layout_cache.slots[i].val);
  gpupool__smap_free(&c->layout_cache);
  gpupool__smap_init(&c->layout_cache);
  c->nlayout_cache = 0;
}

/* The layout cached for name, or NULL. With c->mu. */
clayout *gpupool__layout_cached(gpupool_client *c, const char *name) {
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
    gpupool__layout_cache_clear(c);
  if (old) {
    gpupool__smap_del(&c->layout_cache, name);
    gpupool__clayout_unref(old);
    c->nlayout_cache--;
  }
  if (gpupool__smap_put(&c->layout_cache, name, l) == 0) {
    l->refs++;
    c->nlayout_cache++;
  }
}

/* A layout from a reply's member table, checked (buffer indexes, descriptions); *err says
 * why it failed. */
static int clayout_from_wire(const Gpupool__Wire__Bundle *wb, clayout **out, gpupool__error *err) {
  clayout *l = calloc(1, sizeof *l);
  size_t names_len = 0, i;
  char *np;
  int rc;
  for (i = 0; i < wb->n_members; i++)
    names_len += (wb->members[i]->name ? strlen(wb->members[i]->name) : 0) + 1;
  if (!l || !(l->members = calloc(wb->n_members, sizeof *l->members)) || !(l->names = malloc(names_len)) ||
      !(l->need = calloc(wb->n_buffers, sizeof *l->need))) {
    gpupool__clayout_unref(l ? (l->refs = 1, l) : NULL);
    return gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory for a bundle of %zu members", wb->n_members);
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
      gpupool__clayout_unref(l);
      return gpupool__error_set(err, GPUPOOL_EPROTO, "the daemon sent member %zu in buffer %u of %zu (offset %" PRIu64
                                ", size %" PRIu64 ")", i, wm->buffer, wb->n_buffers, wm->offset, wm->size);
    }
    if (wm->tensor && wm->tensor->present) {
      if ((rc = gpupool__wire_meta_from(wm->tensor, wm->size, &m->meta)) != 0) {
        gpupool__error_take(err, GPUPOOL_EPROTO);
        gpupool__error_prefix(err, "gpupoold sent tensor metadata this library refuses for member %zu: ", i);
        gpupool__clayout_unref(l);
        return err->code;
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
    gpupool__keep_mapped(b->bufs[i], flags);
}

static void bundle_free_local(gpupool_bundle *b) {
  if (!b)
    return;
  gpupool__clayout_unref(b->layout);
  free(b->bufs);
  free(b);
}

/* Send a Release for every hold of a reply's bundle from index `from` on (they never became
 * buffers here). With c->mu held. */
void gpupool__release_holds_from(gpupool_client *c, const Gpupool__Wire__Bundle *wb, size_t from, uint64_t gen) {
  /* Holds of a daemon that has gone since the reply came went with it; their ids may name
   * other holds of the new one. */
  gpupool__error ignored; /* cleanup: the failure that led here is the one to tell */
  if (c->reconnects != gen)
    return;
  for (size_t i = from; wb && i < wb->n_buffers; i++)
    if (wb->buffers[i] && wb->buffers[i]->hold_id)
      gpupool__send_release(c, wb->buffers[i]->hold_id, 0, &ignored);
}

/* Turn a reply's Bundle into a bundle of this process: every buffer materialized (waiting on
 * its ready event in `stream` when wait_ready), the member table from the reply or, when the
 * reply left it out, `known` (the table the request said it had; the caller's reference),
 * checked against the buffers. A table that came
 * with the reply is cached for name (NULL: not cached). On failure every hold it carried is
 * released. With c->mu held; *err says why it failed. */
static int bundle_from_reply(gpupool_client *c, const Gpupool__Wire__Bundle *wb, int wait_ready, void *stream,
                             const char *name, clayout *known, gpupool_bundle **out, gpupool__error *err) {
  gpupool_bundle *b = NULL;
  clayout *l = NULL;
  gpupool__error ignored; /* a cleanup's failure after the one *err tells */
  size_t i;
  int rc;
  uint64_t gen = c->reconnects; /* the reply's connection (materialize may let go of the lock) */

  if (!wb || wb->n_buffers == 0 || wb->n_members > GPUPOOL_BUNDLE_MAX_MEMBERS ||
      (wb->n_members && wb->n_buffers > wb->n_members)) {
    gpupool__error_set(err, GPUPOOL_EPROTO, "the daemon sent a malformed bundle (%zu buffers, %zu members)",
                       wb ? wb->n_buffers : 0, wb ? wb->n_members : 0);
    gpupool__release_holds_from(c, wb, 0, gen);
    return err->code;
  }
  if (wb->n_members == 0) {
    /* The daemon saw that we have this table (the known_layout the request named). */
    l = known;
    if (!l || l->id != wb->layout_id || l->nbufs != wb->n_buffers) {
      gpupool__error_set(err, GPUPOOL_EPROTO, "the daemon sent no members for layout %" PRIu64 ", which this "
                         "client does not have", wb->layout_id);
      gpupool__release_holds_from(c, wb, 0, gen);
      return err->code;
    }
    l->refs++;
  } else if ((rc = clayout_from_wire(wb, &l, err)) != 0) {
    gpupool__release_holds_from(c, wb, 0, gen);
    return rc;
  }
  if (!(b = calloc(1, sizeof *b)) || !(b->bufs = calloc(wb->n_buffers, sizeof *b->bufs))) {
    if (b)
      free(b);
    gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory for a bundle of %zu buffers", wb->n_buffers);
    gpupool__clayout_unref(l);
    gpupool__release_holds_from(c, wb, 0, gen);
    return err->code;
  }
  b->c = c;
  b->layout = l;
  b->version = wb->version;
  for (i = 0; i < wb->n_buffers; i++) {
    gpupool__error why;
    if ((rc = gpupool__materialize(c, wb->buffers[i], wait_ready, stream, &b->bufs[i], &why)) != 0) {
      gpupool__error_set(err, rc, "buffer %zu of the bundle: %s", i, why.msg);
      gpupool__release_holds_from(c, wb, i + 1, gen); /* materialize released hold i */
      gpupool__release_many_locked(c, b->bufs, (int)i, NULL, &ignored);
      bundle_free_local(b);
      return rc;
    }
    b->nbufs = (int)i + 1;
    if (l->need[i] > b->bufs[i]->size) {
      gpupool__error_set(err, GPUPOOL_EPROTO, "the daemon sent members past the end of buffer %zu", i);
      gpupool__release_holds_from(c, wb, i + 1, gen);
      gpupool__release_many_locked(c, b->bufs, b->nbufs, NULL, &ignored);
      bundle_free_local(b);
      return err->code;
    }
  }
  if (wb->n_members)
    layout_cache_put(c, name, l);
  *out = b;
  return 0;
}

/* Member i's name and description, checked here before any request goes out (the daemon
 * checks them again): 0, or the error naming the member in *err. */
static int member_name_check(int i, const char *name, gpupool__error *err) {
  if (!name)
    return gpupool__error_set(err, GPUPOOL_ENAME, "member %d: name is NULL", i);
  if (gpupool__wire_check_name(name) != 0) {
    gpupool__error_take(err, GPUPOOL_ENAME);
    return gpupool__error_prefix(err, "member %d: ", i);
  }
  return 0;
}

static int member_meta_check(int i, const char *name, const gpupool_tensor_meta *meta, uint64_t size,
                             gpupool__error *err) {
  int rc = gpupool__wire_meta_check(meta, size);
  if (rc == 0)
    return 0;
  gpupool__error_take(err, rc);
  return gpupool__error_prefix(err, "member %d ('%s'): ", i, name);
}

int gpupool_bundle_alloc(gpupool_client *c, const char *pool, const gpupool_member_spec *members, int n,
                         uint64_t alignment, int timeout_ms, void *stream, gpupool_bundle **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AllocateBundle ab = GPUPOOL__WIRE__ALLOCATE_BUNDLE__INIT;
  Gpupool__Wire__MemberSpec *specs = NULL, **sp = NULL;
  Gpupool__Wire__TensorMeta *tms = NULL;
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why a step after the reply failed */
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
    if ((rc = member_name_check(i, m->name, &err)) != 0)
      goto out;
    if (m->size == 0) {
      rc = gpupool__err(GPUPOOL_EINVAL, "member %d ('%s') has size 0; members need at least 1 byte", i, m->name);
      goto out;
    }
    gpupool__wire__member_spec__init(&specs[i]);
    specs[i].name = (char *)m->name;
    specs[i].size = m->size;
    if (m->meta) {
      if ((rc = member_meta_check(i, m->name, m->meta, m->size, &err)) != 0)
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
  ab.timeout_ms = gpupool__wire_timeout(timeout_ms);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE;
  req.allocate_bundle = &ab;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__call_retry(c, &req, &rep, -1, &err);
  if (rc == 0) {
    /* Fresh ranges: nothing to wait for (see gpupool_buffer_alloc). */
    rc = bundle_from_reply(c, gpupool__reply_bundle(rep), 0, stream, NULL, NULL, out, &err);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
out:
  free(specs);
  free(sp);
  free(tms);
  return gpupool__error_report(&err, rc);
}

/* Publish members (wire form, lying in bufs) under name in one request: the whole version, or
 * one part of it when part is not NULL (PublishPart; part->complete gets the answer). With
 * c->mu held; a failure of the transport is said in *err. */
static int publish_bundle_locked(gpupool_client *c, const char *name, gpupool_buffer *const *bufs, int nbufs,
                                 Gpupool__Wire__BundleMember **wm, int n, uint64_t layout_id, void *stream,
                                 const uint32_t *devs, int ndevs, gpupool__part *part, uint64_t *version,
                                 gpupool__error *err) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__PublishBundle pb = GPUPOOL__WIRE__PUBLISH_BUNDLE__INIT;
  Gpupool__Wire__PublishPart pp = GPUPOOL__WIRE__PUBLISH_PART__INIT;
  uint64_t *holds;
  gpupool__rep *rep;
  int rc;

  if ((rc = gpupool__ensure_connected(c, err)) != 0)
    return rc;
  if (!(holds = calloc((size_t)nbufs, sizeof *holds)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < nbufs; i++) {
    if (bufs[i]->lost) {
      rc = gpupool__lost_err(bufs[i]);
      goto out;
    }
    /* Every buffer's ready event, so getters wait for everything queued in stream. */
    if ((rc = gpupool__record_ready(c, bufs[i], stream)) != 0)
      goto out;
    holds[i] = bufs[i]->hold_id;
  }
  pb.name = (char *)name;
  pb.n_hold_ids = (size_t)nbufs;
  pb.hold_ids = holds;
  pb.n_members = (size_t)n;
  pb.members = wm;
  pb.layout_id = layout_id;
  pb.n_replicate_to = (size_t)ndevs;
  pb.replicate_to = (uint32_t *)devs;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_BUNDLE;
  req.publish_bundle = &pb;
  if (part) {
    pp.name = pb.name;
    pp.version = part->version;
    pp.part = (uint32_t)part->part;
    pp.parts = (uint32_t)part->parts;
    pp.n_hold_ids = pb.n_hold_ids;
    pp.hold_ids = holds;
    pp.n_members = pb.n_members;
    pp.members = wm;
    pp.layout_id = layout_id;
    req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_PART;
    req.publish_part = &pp;
  }
  if ((rc = gpupool__call(c, &req, &rep, NULL, err)) == 0) {
    if (part && (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_PUBLISH_PART || !rep->publish_part)) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered a PublishPart with something else");
    } else if (part) {
      part->complete = rep->publish_part->complete;
      if (version)
        *version = rep->publish_part->version;
    } else if (version) {
      *version = gpupool__reply_version(rep);
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
    if (rc == 0 && (!part || part->complete))
      gpupool__note_published(c, name);
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
  return gpupool_bundle_publish_to(b, name, stream, NULL, 0, version);
}

int gpupool_bundle_publish_to(gpupool_bundle *b, const char *name, void *stream, const int *devices, int ndevs,
                              uint64_t *version) {
  uint32_t devs[16];
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc;
  if (!b || !name)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_publish: bundle and name must not be NULL");
  gpupool__err_clear();
  if (version)
    *version = 0;
  if ((rc = gpupool__wire_check_name(name)) != 0 || (rc = gpupool__replicate_to(devices, ndevs, devs)) != 0)
    return rc;
  rc = gpupool__bundle_publish(b, name, stream, devs, ndevs, NULL, version, &err);
  return gpupool__error_report(&err, rc);
}

int gpupool__bundle_publish(gpupool_bundle *b, const char *name, void *stream, const uint32_t *devs, int ndevs,
                            gpupool__part *part, uint64_t *version, gpupool__error *err) {
  members_wire w;
  const clayout *l = b->layout;
  uint64_t v = 0;
  int rc;
  pthread_mutex_lock(&b->c->mu);
  /* By the layout's id first: the daemon has the table, so no member travels. It forgets a
   * table once nothing uses it (a relayed bundle's may be gone): then the members go. */
  rc = l->id ? publish_bundle_locked(b->c, name, b->bufs, b->nbufs, NULL, 0, l->id, stream, devs, ndevs, part, &v,
                                     err)
              : GPUPOOL_ENOENT;
  pthread_mutex_unlock(&b->c->mu);
  if (rc == GPUPOOL_ENOENT) {
    err->code = 0; /* the daemon forgot the table: not a failure, the members go instead */
    if ((rc = members_wire_new(&w, l->n)) != 0)
      return rc;
    for (int i = 0; i < l->n; i++) {
      const gpupool_member *m = &l->members[i];
      member_wire(&w, i, m->name, (uint32_t)m->buffer, m->offset, m->size, m->has_meta ? &m->meta : NULL);
    }
    pthread_mutex_lock(&b->c->mu);
    rc = publish_bundle_locked(b->c, name, b->bufs, b->nbufs, w.p, l->n, 0, stream, devs, ndevs, part, &v, err);
    pthread_mutex_unlock(&b->c->mu);
    members_wire_free(&w);
  }
  if (rc == 0 && (!part || part->complete)) {
    b->version = v;
    if (version)
      *version = v;
  }
  return rc;
}

int gpupool_bundle_publish_members(gpupool_client *c, const char *name, const gpupool_member_ref *members, int n,
                                   void *stream, uint64_t *version) {
  gpupool__error err = {.code = 0}; /* why a member was refused */
  return gpupool__error_report(&err, gpupool__publish_members(c, name, members, n, stream, NULL, version, &err));
}

int gpupool__publish_members(gpupool_client *c, const char *name, const gpupool_member_ref *members, int n,
                             void *stream, gpupool__part *part, uint64_t *version, gpupool__error *err) {
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
    if ((rc = member_name_check(i, m->name, err)) != 0)
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
    if (m->meta && (rc = member_meta_check(i, m->name, m->meta, m->size, err)) != 0)
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
  rc = publish_bundle_locked(c, name, bufs, nbufs, w.p, n, 0, stream, NULL, 0, part, version, err);
  pthread_mutex_unlock(&c->mu);
out:
  gpupool__hmap_free(&index);
  members_wire_free(&w);
  free(bufs);
  return rc;
}

int gpupool__bundle_get_request(const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                                gpupool__req *req, Gpupool__Wire__GetBundle *gb) {
  int rc;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gpupool__wire__get_bundle__init(gb);
  gb->name = (char *)name;
  gb->newer_than = newer_than;
  gb->timeout_ms = gpupool__wire_timeout(timeout_ms);
  gb->read_only = (flags & GPUPOOL_READ_ONLY) != 0;
  gb->target_device = gpupool__target_device(flags);
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_GET_BUNDLE;
  req->get_bundle = gb;
  return 0;
}

/* A GetBundle's reply turned into the caller's bundle, the reply freed; blocking and pipelined
 * gets alike. known: the table the request named (the caller's reference), or NULL. With
 * c->mu held; *err says why it failed. */
int gpupool__bundle_get_finish(gpupool_client *c, gpupool__rep *rep, unsigned flags, void *stream, const char *name,
                               clayout *known, gpupool_bundle **out, gpupool__error *err) {
  int rc = bundle_from_reply(c, gpupool__reply_bundle(rep), 1, stream, name, known, out, err);
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
  gpupool__error err; /* why a step after the reply failed */
  int rc;

  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_get: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = gpupool__bundle_get_request(name, newer_than, timeout_ms, flags, &req, &gb)) != 0)
    return rc;
  err.code = 0;
  pthread_mutex_lock(&c->mu);
  /* Connected first, so the table named as known is one of this daemon's; it is held
   * until the reply is handled, whatever happens to the cache meanwhile. */
  if ((rc = gpupool__ensure_connected(c, &err)) != 0) {
    pthread_mutex_unlock(&c->mu);
    return gpupool__error_report(&err, rc);
  }
  known = gpupool__layout_cached(c, name);
  if (known)
    known->refs++;
  gb.known_layout = known ? known->id : 0;
  rc = gpupool__get_across_restarts(c, &req, &gb.timeout_ms, timeout_ms, &rep, &gb.known_layout, &err);
  if (rc == 0)
    rc = gpupool__bundle_get_finish(c, rep, flags, stream, name, gb.known_layout ? known : NULL, out, &err);
  gpupool__clayout_unref(known);
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

int gpupool_bundle_release(gpupool_bundle *b, void *stream) {
  gpupool_client *c;
  gpupool__error err = {.code = 0}, gone;
  int rc;
  if (!b)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_release: bundle is NULL");
  gpupool__err_clear();
  c = b->c;
  pthread_mutex_lock(&c->mu);
  gpupool__ensure_connected(c, &gone); /* marks the buffers lost if their daemon went away */
  rc = gpupool__release_many_locked(c, b->bufs, b->nbufs, stream, &err);
  bundle_free_local(b); /* its layout is shared with the cache: under the lock */
  pthread_mutex_unlock(&c->mu);
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : gpupool__error_report(&err, rc);
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
