/*
 * Sharded versions: a version of a name made of parts, one per publisher (the ranks of a
 * trainer, each holding a slice of every weight). Each part is checked as a bundle is
 * (names.c: gpd_bundle_prepare) and kept aside, holding a reference on each of its buffers;
 * the part that completes the set publishes the version, whose members are every part's and
 * whose buffers are every part's, in one step (gpd_publish_commit): a getter sees the version
 * whole or not at all, never the parts of two versions.
 *
 * A version waits for its parts only while every publisher of a part it has is connected:
 * when one closes its connection first (a rank that died mid-publish), the version goes and
 * its parts are released at once; it is never seen. Pending versions are bounded: per name,
 * per tenant, and in parts per version.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "log.h"
#include "registry_internal.h"

/* Most parts a version may have, and pending versions a name may have at once (a version may
 * start while an older one still waits for a slow part); a tenant may have
 * max_pending_versions_per_uid over all its names. */
#define PARTS_MAX 1024
#define PENDING_PER_NAME 4

typedef struct {
  int in;
  uint64_t client_id; /* its publisher's connection */
  gpd_buffer **bufs;  /* one reference each */
  uint32_t nbufs;
  gpd_layout *layout; /* a reference */
  int read_only;
} part;

typedef struct pending {
  struct pending *next;
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  uint64_t tenant; /* of the publisher of its first part */
  uint64_t version;
  uint32_t nparts, nin;
  part *parts;
} pending;

struct gpd_parts {
  pending *head;
};

static void part_release(gpd_registry *reg, part *p) {
  for (uint32_t i = 0; i < p->nbufs; i++)
    gpd_buffer_unref(reg, p->bufs[i]);
  free(p->bufs);
  gpd_layout_unref(reg, p->layout);
  memset(p, 0, sizeof *p);
}

/* Take v out of the list and release everything it holds. */
static void pending_drop(gpd_registry *reg, pending *v) {
  for (pending **pp = &reg->parts->head; *pp; pp = &(*pp)->next)
    if (*pp == v) {
      *pp = v->next;
      break;
    }
  for (uint32_t i = 0; i < v->nparts; i++)
    if (v->parts[i].in)
      part_release(reg, &v->parts[i]);
  free(v->parts);
  free(v);
}

/* Pending versions of key older than or at `version` can never be published: drop them. */
static void drop_not_newer(gpd_registry *reg, const char *key, uint64_t version) {
  for (pending *v = reg->parts->head, *nx; v; v = nx) {
    nx = v->next;
    if (v->version <= version && !strcmp(v->key, key)) {
      GPUPOOL__DEBUG("sharded version %" PRIu64 " of '%s' dropped with %u of %u parts: version %" PRIu64
                     " was published", v->version, key, v->nin, v->nparts, version);
      pending_drop(reg, v);
    }
  }
}

/* The version every part makes, published: one bundle of every part's buffers (in part order)
 * and members (their buffer indexes moved past the parts before). With c, the client of the
 * last part. 0, or the error (the caller drops v either way). */
static int pending_commit(gpd_registry *reg, gpd_client *c, pending *v, uint64_t *version) {
  uint32_t nbufs = 0, nmembers = 0, at = 0, m = 0, fd_slabs = 0;
  gpd_buffer **bufs = NULL;
  gpd_member *members = NULL;
  gpd_layout *layout = NULL;
  gpd_name *old;
  int rc, read_only = 0;
  gpupool__hmap seen;

  gpupool__hmap_init(&seen);
  for (uint32_t i = 0; i < v->nparts; i++) {
    nbufs += v->parts[i].nbufs;
    nmembers += v->parts[i].layout->n;
  }
  if ((rc = gpd_check_member_count(reg, nmembers)) != 0)
    goto out;
  if (!(bufs = calloc(nbufs, sizeof *bufs)) || !(members = calloc(nmembers, sizeof *members))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto out;
  }
  for (uint32_t i = 0; i < v->nparts; i++) {
    const part *p = &v->parts[i];
    read_only |= p->read_only;
    for (uint32_t j = 0; j < p->layout->n; j++, m++) {
      const gpd_member *src = &p->layout->members[j];
      members[m] = *src;
      members[m].buffer = src->buffer + at;
      members[m].meta = NULL;
      if (!(members[m].name = strdup(src->name)) ||
          (src->meta && !(members[m].meta = malloc(sizeof *members[m].meta)))) {
        free(members[m].name);
        rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
        goto out;
      }
      if (src->meta)
        *members[m].meta = *src->meta;
    }
    for (uint32_t j = 0; j < p->nbufs; j++, at++) {
      gpd_buffer *b = p->bufs[j];
      if (gpupool__hmap_get(&seen, b->id)) {
        rc = gpupool__err(GPUPOOL_EINVAL, "part %u of version %" PRIu64 " lists a buffer another part lists too; "
                          "each part publishes buffers of its own", i, v->version);
        goto out;
      }
      if (b->slab->bs.fd >= 0 && !gpupool__hmap_get(&seen, b->slab->id) && ++fd_slabs > GPUPOOL_WIRE_MAX_FDS) {
        rc = gpupool__err(GPUPOOL_EINVAL, "the parts' buffers lie in more than %d slabs, more than one reply can "
                          "carry; allocate each part with gpupool_bundle_alloc, which packs it into few buffers",
                          GPUPOOL_WIRE_MAX_FDS);
        goto out;
      }
      if (gpupool__hmap_put(&seen, b->id, b) != 0 || gpupool__hmap_put(&seen, b->slab->id, b->slab) != 0) {
        rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
        goto out;
      }
      bufs[at] = b;
    }
  }
  if ((rc = gpd_members_unique(members, nmembers)) != 0) {
    rc = gpupool__err(rc, "version %" PRIu64 " of its parts: %s; each part names its members apart from the "
                      "others' (gpupool_shard_member_name puts the part in the name)", v->version, gpupool__errmsg());
    goto out;
  }
  /* The name as it is now: the parts were checked against it when they came. */
  old = gpupool__smap_get(&reg->names, v->key);
  if (old && old->file) {
    rc = gpupool__err(GPUPOOL_EEXIST, "'%s' names a published file now; unpublish it first", v->key);
    goto out;
  }
  if (old && old->version >= v->version) {
    rc = gpupool__err(GPUPOOL_EINVAL, "version %" PRIu64 " is no longer newer than the published version %" PRIu64,
                      v->version, old->version);
    goto out;
  }
  if (!old && (rc = gpd_quota_name(reg, c->tenant)) != 0)
    goto out;
  {
    uint64_t freed = old && old->layout && old->layout->refs == 1 && old->layout->tenant == c->tenant
                         ? old->layout->n : 0;
    rc = gpd_layout_new(reg, c->tenant, members, nmembers, nbufs, freed, &layout);
    members = NULL; /* taken over, also on failure */
    if (rc != 0)
      goto out;
  }
  rc = gpd_publish_commit(reg, c, v->key, old, bufs, nbufs, layout, read_only, NULL, v->version, version);
  bufs = NULL; /* taken over */
out:
  gpupool__hmap_free(&seen);
  gpd_members_free(members, m);
  free(bufs);
  return rc;
}

static uint32_t pending_count(const gpd_registry *reg, const char *key, uint64_t tenant) {
  uint32_t n = 0;
  for (const pending *v = reg->parts->head; v; v = v->next)
    if (key ? !strcmp(v->key, key) : v->tenant == tenant)
      n++;
  return n;
}

int gpd_publish_part(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, uint64_t version, uint32_t idx,
                     uint32_t nparts, const uint64_t *hold_ids, size_t nholds,
                     Gpupool__Wire__BundleMember *const *wm, size_t nmembers, uint64_t layout_id,
                     gpd_part_result *res) {
  const char *name = rn->name;
  gpd_bundle_prep prep;
  pending *v = NULL;
  part *p;
  int rc;

  memset(res, 0, sizeof *res);
  if (nparts == 0 || nparts > PARTS_MAX || idx >= nparts)
    return gpupool__err(GPUPOOL_EINVAL, "part %u of %u: a version has 1 to %d parts, numbered from 0", idx, nparts,
                        PARTS_MAX);
  if (version == 0)
    return gpupool__err(GPUPOOL_EINVAL, "parts name the version they make (1 or more), not 0");
  if (!reg->parts && !(reg->parts = calloc(1, sizeof *reg->parts)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if ((rc = gpd_bundle_prepare(reg, c, rn, hold_ids, nholds, wm, nmembers, layout_id, 1, 1, &prep)) != 0)
    return rc;
  if (prep.old)
    drop_not_newer(reg, prep.key, prep.old->version);
  if (prep.old && prep.old->version >= version) {
    rc = gpupool__err(GPUPOOL_EINVAL, "'%s' is published at version %" PRIu64 "; the parts of a new version name "
                      "a greater one, not %" PRIu64, name, prep.old->version, version);
    goto fail;
  }
  for (v = reg->parts->head; v; v = v->next)
    if (v->version == version && !strcmp(v->key, prep.key))
      break;
  if (!v) {
    if (pending_count(reg, prep.key, 0) >= PENDING_PER_NAME) {
      rc = gpupool__err(GPUPOOL_ELIMIT, "'%s' has %d versions waiting for parts already (the limit); a version "
                        "is published once every part is in: publish the missing parts of those", name,
                        PENDING_PER_NAME);
      goto fail;
    }
    if (pending_count(reg, NULL, c->tenant) >= reg->cfg->max_pending_versions_per_uid) {
      rc = gpupool__err(GPUPOOL_ELIMIT, "your tenant has %u sharded versions waiting for parts (the limit, "
                        "max_pending_versions_per_uid); publish their missing parts, close the connections "
                        "that published the others, or raise the limit", reg->cfg->max_pending_versions_per_uid);
      goto fail;
    }
    if (!(v = calloc(1, sizeof *v)) || !(v->parts = calloc(nparts, sizeof *v->parts))) {
      free(v);
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
      goto fail;
    }
    memcpy(v->key, prep.key, sizeof v->key);
    v->tenant = c->tenant;
    v->version = version;
    v->nparts = nparts;
    v->next = reg->parts->head;
    reg->parts->head = v;
  } else if (v->nparts != nparts) {
    rc = gpupool__err(GPUPOOL_EINVAL, "version %" PRIu64 " of '%s' is made of %u parts (its first part said so), "
                      "not %u", version, name, v->nparts, nparts);
    goto fail;
  } else if (v->parts[idx].in) {
    rc = gpupool__err(GPUPOOL_EEXIST, "part %u of version %" PRIu64 " of '%s' is in already", idx, version, name);
    goto fail;
  }
  p = &v->parts[idx];
  p->in = 1;
  p->client_id = c->id;
  p->bufs = prep.bufs;
  p->nbufs = prep.nbufs;
  p->layout = prep.layout;
  p->read_only = prep.read_only;
  for (uint32_t i = 0; i < p->nbufs; i++)
    p->bufs[i]->refs++;
  res->version = version;
  res->parts_in = ++v->nin;
  if (v->nin < v->nparts)
    return 0;
  rc = pending_commit(reg, c, v, &res->version);
  pending_drop(reg, v);
  if (rc != 0)
    return gpupool__err(rc, "version %" PRIu64 " of '%s' had every part but could not be published, and is "
                        "dropped: %s", version, name, gpupool__errmsg());
  res->complete = 1;
  drop_not_newer(reg, prep.key, res->version);
  return 0;
fail:
  free(prep.bufs);
  gpd_layout_unref(reg, prep.layout);
  return rc;
}

void gpd_parts_client_gone(gpd_registry *reg, const gpd_client *c) {
  if (!reg->parts)
    return;
  for (pending *v = reg->parts->head, *nx; v; v = nx) {
    nx = v->next;
    for (uint32_t i = 0; i < v->nparts; i++)
      if (v->parts[i].in && v->parts[i].client_id == c->id) {
        GPUPOOL__PEER_INFO(&((gpd_client *)c)->log_rl, c->id, "client %" PRIu64 " (pid %d) closed its connection "
                           "before version %" PRIu64 " of '%s' had all its parts (%u of %u, its own part %u "
                           "among them): that version is dropped, its parts released", c->id, (int)c->pid,
                           v->version, v->key, v->nin, v->nparts, i);
        pending_drop(reg, v);
        break;
      }
  }
}

void gpd_parts_close(gpd_registry *reg) {
  if (!reg->parts)
    return;
  while (reg->parts->head)
    pending_drop(reg, reg->parts->head);
  free(reg->parts);
  reg->parts = NULL;
}
