/*
 * libgpupool-client, parts.c: sharded versions from the publishing side: the member names of
 * slices ("KEY@PART[S0:E0,...]/G0x..."), and publishing a bundle as one part of a version
 * (PublishPart, sent by bundles.c's publishes). Reading them back is refit.c's
 * (gpupool__shard_parse).
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

/* The checks every publish of a part makes before sending. */
static int part_check(const char *name, uint64_t version, int part, int parts) {
  int rc;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  if (parts < 1 || parts > GPUPOOL_PARTS_MAX || part < 0 || part >= parts || version == 0)
    return gpupool__err(GPUPOOL_EINVAL, "part %d of %d of version %" PRIu64 ": a version (1 or more) has 1 to %d "
                        "parts, numbered from 0", part, parts, version, GPUPOOL_PARTS_MAX);
  return 0;
}

int gpupool_bundle_publish_part(gpupool_bundle *b, const char *name, uint64_t version, int part, int parts,
                                void *stream, int *complete) {
  gpupool__part p = {.version = version, .part = part, .parts = parts};
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc;
  if (complete)
    *complete = 0;
  if (!b || !name)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_publish_part: bundle and name must not be NULL");
  gpupool__err_clear();
  if ((rc = part_check(name, version, part, parts)) != 0)
    return rc;
  rc = gpupool__bundle_publish(b, name, stream, NULL, 0, &p, NULL, &err);
  if (rc == 0 && complete)
    *complete = p.complete;
  return gpupool__error_report(&err, rc);
}

int gpupool_bundle_publish_members_part(gpupool_client *c, const char *name, uint64_t version, int part, int parts,
                                        const gpupool_member_ref *members, int n, void *stream, int *complete) {
  gpupool__part p = {.version = version, .part = part, .parts = parts};
  gpupool__error err = {.code = 0}; /* why a member was refused */
  int rc;
  if (complete)
    *complete = 0;
  if (!c || !name)
    return gpupool__err(GPUPOOL_EINVAL, "bundle_publish_members_part: client and name must not be NULL");
  gpupool__err_clear();
  if ((rc = part_check(name, version, part, parts)) != 0)
    return rc;
  rc = gpupool__publish_members(c, name, members, n, stream, &p, NULL, &err);
  if (rc == 0 && complete)
    *complete = p.complete;
  return gpupool__error_report(&err, rc);
}
