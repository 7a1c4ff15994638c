/*
 * libgpupool-client, parts.c: sharded versions from the publishing side: the member names of
 * slices ("KEY@PART[S0:E0,...]/G0x..."), and publishing a bundle as one part of a version
 * (PublishPart). Reading them back is refit.c's (gpupool__shard_parse).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "refit_internal.h"
#include "gpupool/refit.h"

int gpupool_shard_member_name(char *out, size_t len, const char *key, int part, int ndim,
                              const int64_t *global_shape, const int64_t *start, const int64_t *shape) {
  char buf[2 * (GPUPOOL_NAME_MAX + 1)];
  size_t at;
  if (!out || !key || (ndim > 0 && (!global_shape || !start || !shape)))
    return gpupool__err(GPUPOOL_EINVAL, "shard_member_name: out, key and (for ndim > 0) the shapes must not be NULL");
  if (ndim < 0 || ndim > GPUPOOL_MAX_NDIM || part < 0 || part >= GPUPOOL_PARTS_MAX)
    return gpupool__err(GPUPOOL_EINVAL, "shard of '%s': ndim %d (0..%d), part %d (0..%d)", key, ndim,
                        GPUPOOL_MAX_NDIM, part, GPUPOOL_PARTS_MAX - 1);
  if (!*key || strlen(key) > GPUPOOL_NAME_MAX)
    return gpupool__err(GPUPOOL_ENAME, "shard key of %zu bytes: keys are 1 to %d bytes", strlen(key),
                        GPUPOOL_NAME_MAX);
  for (int i = 0; i < ndim; i++)
    if (global_shape[i] < 0 || start[i] < 0 || shape[i] < 0 || start[i] > global_shape[i] ||
        shape[i] > global_shape[i] - start[i])
      return gpupool__err(GPUPOOL_EINVAL, "shard of '%s': dimension %d, slice %" PRId64 "..%" PRId64 " is not "
                          "inside the global size %" PRId64, key, i, start[i], start[i] + shape[i], global_shape[i]);
  at = (size_t)snprintf(buf, sizeof buf, "%s@%d[", key, part);
  for (int i = 0; i < ndim && at < sizeof buf; i++)
    at += (size_t)snprintf(buf + at, sizeof buf - at, "%s%" PRId64 ":%" PRId64, i ? "," : "", start[i],
                           start[i] + shape[i]);
  if (at < sizeof buf)
    at += (size_t)snprintf(buf + at, sizeof buf - at, "]/");
  for (int i = 0; i < ndim && at < sizeof buf; i++)
    at += (size_t)snprintf(buf + at, sizeof buf - at, "%s%" PRId64, i ? "x" : "", global_shape[i]);
  if (at > GPUPOOL_NAME_MAX)
    return gpupool__err(GPUPOOL_ENAME, "the member name of a shard of '%s' would be %zu bytes, over the limit of "
                        "%d; use a shorter key", key, at, GPUPOOL_NAME_MAX);
  if (at + 1 > len)
    return gpupool__err(GPUPOOL_EINVAL, "shard_member_name: %zu bytes of room for a name of %zu", len, at + 1);
  memcpy(out, buf, at + 1);
  return 0;
}

/* Reads a number of the name at *p (digits only), moving *p past it: 0 or -1. */
static int read_num(const char **p, int64_t *v) {
  const char *s = *p;
  int64_t x = 0;
  if (*s < '0' || *s > '9')
    return -1;
  for (; *s >= '0' && *s <= '9'; s++) {
    if (x > (INT64_MAX - 9) / 10)
      return -1;
    x = x * 10 + (*s - '0');
  }
  *p = s;
  *v = x;
  return 0;
}

int gpupool__shard_parse(const char *name, gpupool__shard *out) {
  const char *at = strrchr(name, '@'), *p;
  int64_t v, e;
  int n = 0;
  if (!at || at == name || (size_t)(at - name) > GPUPOOL_NAME_MAX)
    return -1;
  memset(out, 0, sizeof *out);
  p = at + 1;
  if (read_num(&p, &v) != 0 || v >= GPUPOOL_PARTS_MAX || *p++ != '[')
    return -1;
  out->part = (int)v;
  while (*p != ']') {
    if (n == GPUPOOL_MAX_NDIM || (n && *p++ != ',') || read_num(&p, &v) != 0 || *p++ != ':' ||
        read_num(&p, &e) != 0 || e < v)
      return -1;
    out->start[n] = v;
    out->shape[n] = e - v;
    n++;
  }
  p++;
  if (*p++ != '/')
    return -1;
  for (int i = 0; i < n; i++) {
    if ((i && *p++ != 'x') || read_num(&p, &v) != 0 || out->start[i] + out->shape[i] > v)
      return -1;
    out->global[i] = v;
  }
  if (*p)
    return -1;
  out->ndim = n;
  out->keylen = (size_t)(at - name);
  return 0;
}

/* Send the part (members by layout id, or the members themselves when members is not NULL).
 * With c->mu held. */
static int send_part(gpupool_bundle *b, const char *name, uint64_t version, int part, int parts, void *stream,
                     Gpupool__Wire__BundleMember **members, int *complete) {
  gpupool_client *c = b->c;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__PublishPart pp = GPUPOOL__WIRE__PUBLISH_PART__INIT;
  gpupool__rep *rep;
  uint64_t *holds;
  int rc;
  if ((rc = gpupool__ensure_connected(c)) != 0)
    return rc;
  if (!(holds = calloc((size_t)b->nbufs, sizeof *holds)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < b->nbufs; i++) {
    if (b->bufs[i]->lost) {
      rc = gpupool__lost_err(b->bufs[i]);
      goto out;
    }
    if ((rc = gpupool__record_ready(c, b->bufs[i], stream)) != 0)
      goto out;
    holds[i] = b->bufs[i]->hold_id;
  }
  pp.name = (char *)name;
  pp.version = version;
  pp.part = (uint32_t)part;
  pp.parts = (uint32_t)parts;
  pp.n_hold_ids = (size_t)b->nbufs;
  pp.hold_ids = holds;
  if (members) {
    pp.n_members = (size_t)b->layout->n;
    pp.members = members;
  } else {
    pp.layout_id = b->layout->id;
  }
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_PART;
  req.publish_part = &pp;
  if ((rc = gpupool__call(c, &req, &rep, NULL)) == 0) {
    if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_PUBLISH_PART || !rep->publish_part) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered a PublishPart with something else");
    } else if (complete) {
      *complete = rep->publish_part->complete;
    }
    if (rc == 0 && rep->publish_part->complete)
      gpupool__note_published(c, name);
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
out:
  free(holds);
  return rc;
}

int gpupool_bundle_publish_part(gpupool_bundle *b, const char *name, uint64_t version, int part, int parts,
                                void *stream, int *complete) {
  Gpupool__Wire__BundleMember *wm = NULL, **wp = NULL;
  Gpupool__Wire__TensorMeta *tm = NULL;
  const clayout *l;
  int rc;
  if (complete)
    *complete = 0;
  if (!b || !name)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_publish_part: bundle and name must not be NULL");
  gpupool__err_clear();
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  if (parts < 1 || parts > GPUPOOL_PARTS_MAX || part < 0 || part >= parts || version == 0)
    return gpupool__err(GPUPOOL_EINVAL, "part %d of %d of version %" PRIu64 ": a version (1 or more) has 1 to %d "
                        "parts, numbered from 0", part, parts, version, GPUPOOL_PARTS_MAX);
  l = b->layout;
  pthread_mutex_lock(&b->c->mu);
  /* By the layout's id first (no member travels); the members when the daemon forgot it. */
  rc = l->id ? send_part(b, name, version, part, parts, stream, NULL, complete) : GPUPOOL_ENOENT;
  pthread_mutex_unlock(&b->c->mu);
  if (rc != GPUPOOL_ENOENT)
    return rc;
  gpupool__err_clear();
  if (!(wm = calloc((size_t)l->n, sizeof *wm)) || !(wp = calloc((size_t)l->n, sizeof *wp)) ||
      !(tm = calloc((size_t)l->n, sizeof *tm))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory for a part of %d members", l->n);
    goto out;
  }
  for (int i = 0; i < l->n; i++) {
    const gpupool_member *m = &l->members[i];
    gpupool__wire__bundle_member__init(&wm[i]);
    wm[i].name = (char *)m->name;
    wm[i].buffer = (uint32_t)m->buffer;
    wm[i].offset = m->offset;
    wm[i].size = m->size;
    if (m->has_meta) {
      gpupool__wire_meta_to(&m->meta, &tm[i]);
      wm[i].tensor = &tm[i];
    }
    wp[i] = &wm[i];
  }
  pthread_mutex_lock(&b->c->mu);
  rc = send_part(b, name, version, part, parts, stream, wp, complete);
  pthread_mutex_unlock(&b->c->mu);
out:
  free(wm);
  free(wp);
  free(tm);
  return rc;
}
