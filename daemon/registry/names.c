/*
 * Names and their versions: publishing buffers or a bundle under a name (a new version swaps
 * buffers and layout in one step), finding, getting and unpublishing them.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "log.h"
#include "registry_internal.h"

/* Drops what a name's current version refers to (its buffers' references, its members). */
static void name_clear(gpd_registry *reg, gpd_name *n) {
  if (n->file) {
    gpd_file_close(reg, n->file);
    n->file = NULL;
  }
  gpd_layout_unref(reg, n->layout);
  n->layout = NULL;
  for (uint32_t i = 0; i < n->nbufs; i++) {
    /* A buffer no name holds any more is a version no get can reach (gets go by name): its
     * replicas go now, not when its last holder lets go (a producer that double-buffers
     * keeps it). Getters holding a replica keep their own reference to it. */
    if (--n->bufs[i]->names == 0)
      gpd_buffer_replaced(reg, n->bufs[i]);
    gpd_buffer_unref(reg, n->bufs[i]);
  }
  free(n->bufs);
  n->bufs = NULL;
  n->nbufs = 0;
}

void gpd_name_free(gpd_registry *reg, gpd_name *n) {
  name_clear(reg, n);
  free(n->name);
  free(n);
}

/* Checks for a publish under `name` by c of buffers bufs: the namespace, the buffers' owner,
 * the name limits (for a new name) and the member limits. *old gets the name's entry when it
 * exists. */
static int publish_check(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, gpd_buffer *const *bufs,
                         uint32_t nbufs, gpd_name **old) {
  const gpd_config *cfg = reg->cfg;
  const char *name = rn->name;
  uint64_t owner = rn->owner;
  int rc;
  if ((rc = gpd_rname_ok(rn)) != 0)
    return rc;
  for (uint32_t i = 0; i < nbufs; i++)
    if (bufs[i]->slab->owner != owner) {
      char label[80];
      gpd_tenant_label(cfg, bufs[i]->slab->owner, label, sizeof label);
      return gpupool__err(GPUPOOL_EPERM,
                          "'%s' would make a buffer of %s readable outside it; publish it in that namespace "
                          "(%s)", name, label,
                          (bufs[i]->slab->owner & GROUP_SET) ? "as group:GROUP/NAME" : "under a plain name");
    }
  *old = gpupool__smap_get(&reg->names, rn->key);
  if (*old && (*old)->file)
    return gpupool__err(GPUPOOL_EEXIST, "'%s' names a published file; unpublish it before publishing buffers "
                        "under that name", name);
  if (*old && (*old)->tenant != c->tenant)
    return gpd_quota_name_move(reg, c->tenant, name);
  return *old ? 0 : gpd_quota_name(reg, c->tenant);
}

/* Make (bufs, layout) the current version of `key`, creating the name or replacing its
 * previous version in one step. Takes over bufs (an array of nbufs buffers, each given one
 * reference here) and the caller's reference on layout. Cannot fail once the name exists.
 * want: the version to make (greater than the name's; a sharded version's, parts.c), or 0 for
 * the next one. */
int gpd_publish_commit(gpd_registry *reg, gpd_client *c, const char *key, gpd_name *n,
                       gpd_buffer **bufs, uint32_t nbufs, gpd_layout *layout,
                       int read_only, const gpupool_tensor_meta *meta, uint64_t want, uint64_t *version) {
  uint64_t prev = 0;
  if (!n) {
    n = calloc(1, sizeof *n);
    if (!n || !(n->name = strdup(key)) || gpupool__smap_put(&reg->names, key, n) != 0) {
      if (n)
        free(n->name);
      free(n);
      gpd_layout_unref(reg, layout);
      free(bufs);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    reg->nnames++;
    gpd_uid_usage *u = gpd_uid_usage_get(reg, c->tenant, 1);
    if (u)
      u->names++; /* (the record holds at least this client's hold: it exists) */
    n->tenant = c->tenant;
  } else {
    prev = n->version;
  }
  /* The new version's references first: a buffer kept from the previous version must not
   * drop to zero in between. */
  for (uint32_t i = 0; i < nbufs; i++) {
    bufs[i]->refs++;
    bufs[i]->names++;
    /* Its replicas copy what it held at an earlier publish: a new version gets new ones. */
    gpd_buffer_replaced(reg, bufs[i]);
  }
  name_clear(reg, n);
  if (n->tenant != c->tenant) {
    /* Republished by another member of the namespace: the name now counts against it. */
    gpd_uid_usage *u = gpd_uid_usage_get(reg, n->tenant, 0);
    if (u) {
      u->names--;
      gpd_uid_usage_put(reg, u);
    }
    u = gpd_uid_usage_get(reg, c->tenant, 1);
    if (u)
      u->names++;
    n->tenant = c->tenant;
  }
  n->bufs = bufs;
  n->nbufs = nbufs;
  n->layout = layout;
  n->version = want > prev ? want : prev + 1;
  reg->state_changes++;
  if (reg->keep)
    reg->keep->name_changed(reg, n->name);
  n->uid = c->uid;
  n->read_only = read_only;
  n->created_ns = gpd_now_ns();
  n->has_meta = meta != NULL;
  if (meta) {
    n->meta = *meta;
    bufs[0]->meta = *meta;
    bufs[0]->has_meta = 1;
  }
  if (version)
    *version = n->version;
  return 0;
}

int gpd_publish(gpd_registry *reg, gpd_client *c, gpd_hold *h, const gpd_rname *rn,
                     const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all, uint64_t *version) {
  gpd_name *old = NULL;
  gpd_buffer **bufs;
  gpupool_tensor_meta m;
  int rc, has_meta = meta && meta->present;

  if (share_gid || share_all)
    return gpupool__err(GPUPOOL_EINVAL,
                        "publishing to other users (share_gid/share_all) is gone: its readers would get "
                        "the fd of a slab holding the publisher's other buffers. Allocate in a pool the "
                        "operator shares with a group (share = GROUP) and publish as group:GROUP/NAME");
  if ((rc = publish_check(reg, c, rn, &h->buf, 1, &old)) != 0)
    return rc;
  if (has_meta && (rc = gpupool__wire_meta_from(meta, h->buf->asked, &m)) != 0)
    return rc;
  if (!(bufs = malloc(sizeof *bufs)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  bufs[0] = h->buf;
  /* A name never upgrades the hold it was published from. */
  return gpd_publish_commit(reg, c, rn->key, old, bufs, 1, NULL, h->read_only, has_meta ? &m : NULL, 0, version);
}

/* The member table layout_id of c's tenant, for a bundle of nholds buffers. */
static int layout_of(gpd_registry *reg, const gpd_client *c, uint64_t layout_id, size_t nholds, gpd_layout **out) {
  gpd_layout *layout = gpupool__hmap_get(&reg->layouts, layout_id);
  if (!layout || layout->tenant != c->tenant)
    return gpupool__err(GPUPOOL_ENOENT, "member table %" PRIu64 " is not one this daemon has for your tenant (it "
                        "went with the last bundle that used it); publish the members themselves", layout_id);
  if (nholds != layout->nbufs)
    return gpupool__err(GPUPOOL_EINVAL, "member table %" PRIu64 " spans %u buffers, not %zu", layout_id,
                        layout->nbufs, nholds);
  *out = layout;
  return 0;
}

/* The members of a bundle from the wire into members (nmembers of them, in the nholds
 * buffers bufs): each in its buffer, every buffer used, no name twice. *nm counts those
 * converted (to free on failure). */
static int members_from_wire(Gpupool__Wire__BundleMember *const *wm, size_t nmembers, gpd_buffer *const *bufs,
                             size_t nholds, const uint64_t *hold_ids, int utf8_checked, gpd_member *members,
                             uint32_t *used, size_t *nm) {
  int rc;
  for (*nm = 0; *nm < nmembers; (*nm)++) {
    const Gpupool__Wire__BundleMember *m = wm[*nm];
    if (m->buffer >= nholds)
      return gpupool__err(GPUPOOL_EINVAL, "member %zu ('%s') names buffer %u of a bundle of %zu buffers", *nm,
                          m->name ? m->name : "", m->buffer, nholds);
    if ((rc = gpd_member_from_wire(m->name, m->offset, m->size, m->tensor, bufs[m->buffer]->asked, *nm,
                                   utf8_checked, &members[*nm])) != 0)
      return rc;
    members[*nm].buffer = m->buffer;
    used[m->buffer] = 1;
  }
  for (size_t i = 0; i < nholds; i++)
    if (!used[i])
      return gpupool__err(GPUPOOL_EINVAL, "no member lies in buffer %zu (hold %" PRIu64 "); list only the buffers "
                          "the members use", i, hold_ids[i]);
  return gpd_members_unique(members, nmembers);
}

int gpd_bundle_prepare(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint64_t *hold_ids,
                       size_t nholds, Gpupool__Wire__BundleMember *const *wm, size_t nmembers,
                       uint64_t layout_id, int part, int utf8_checked, gpd_bundle_prep *out) {
  gpd_buffer **bufs = NULL;
  gpd_member *members = NULL;
  gpd_layout *layout = NULL;
  gpd_name *old = NULL;
  uint32_t *used = NULL;
  size_t i, nm = 0;
  uint32_t fd_slabs = 0;
  int rc, read_only = 0;
  gpupool__hmap seen;

  gpupool__hmap_init(&seen);
  if (layout_id && nmembers)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle is published with its members or with a layout id, not both");
  if (layout_id) {
    if ((rc = layout_of(reg, c, layout_id, nholds, &layout)) != 0)
      return rc;
    nmembers = layout->n;
  } else if ((rc = gpd_check_member_count(reg, nmembers)) != 0) {
    return rc;
  }
  if (nholds == 0 || nholds > nmembers)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle of %zu members lies in 1 to %zu buffers, not %zu", nmembers,
                        nmembers, nholds);
  if (!(bufs = calloc(nholds, sizeof *bufs)) || !(used = calloc(nholds, sizeof *used)) ||
      (!layout && !(members = calloc(nmembers, sizeof *members)))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  /* Buffer and slab ids come from one counter: one set tells repeats of either. */
  for (i = 0; i < nholds; i++) {
    gpd_hold *h = NULL;
    if ((rc = gpd_hold_of(reg, c, hold_ids[i], &h)) != 0)
      goto fail;
    if (gpupool__hmap_get(&seen, h->buf->id)) {
      rc = gpupool__err(GPUPOOL_EINVAL, "buffer %" PRIu64 " is listed twice (hold %" PRIu64 " and another); list "
                        "each buffer once", h->buf->id, hold_ids[i]);
      goto fail;
    }
    bufs[i] = h->buf;
    read_only |= h->read_only;
    if (layout && layout->need[i] > h->buf->asked) {
      rc = gpupool__err(GPUPOOL_EINVAL, "member table %" PRIu64 " needs %" PRIu64 " bytes in buffer %zu, which has %"
                        PRIu64, layout_id, layout->need[i], i, h->buf->asked);
      goto fail;
    }
    /* Each getter needs the fd of every slab it has not mapped, all in one reply frame. */
    if (h->buf->slab->bs.fd >= 0 && !gpupool__hmap_get(&seen, h->buf->slab->id)) {
      if (++fd_slabs > GPUPOOL_WIRE_MAX_FDS) {
        rc = gpupool__err(GPUPOOL_EINVAL,
                          "the bundle's buffers lie in more than %d slabs, more than one reply can carry; "
                          "allocate its members with gpupool_bundle_alloc, which packs them into few buffers",
                          GPUPOOL_WIRE_MAX_FDS);
        goto fail;
      }
      if (gpupool__hmap_put(&seen, h->buf->slab->id, h->buf->slab) != 0) {
        rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
        goto fail;
      }
    }
    if (gpupool__hmap_put(&seen, h->buf->id, h->buf) != 0) {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
      goto fail;
    }
  }
  if (!layout && (rc = members_from_wire(wm, nmembers, bufs, nholds, hold_ids, utf8_checked, members, used, &nm)) != 0)
    goto fail;
  if ((rc = publish_check(reg, c, rn, bufs, (uint32_t)nholds, &old)) != 0)
    goto fail;
  if (layout) {
    layout->refs++;
  } else {
    /* The previous version's table goes with it when nothing else uses it. */
    uint64_t freed = !part && old && old->layout && old->layout->refs == 1 && old->layout->tenant == c->tenant
                         ? old->layout->n : 0;
    rc = gpd_layout_new(reg, c->tenant, members, (uint32_t)nmembers, (uint32_t)nholds, freed, &layout);
    members = NULL; /* taken over, also on failure */
    nm = 0;
    if (rc != 0)
      goto fail;
  }
  free(used);
  gpupool__hmap_free(&seen);
  memcpy(out->key, rn->key, sizeof out->key);
  out->old = old;
  out->bufs = bufs;
  out->nbufs = (uint32_t)nholds;
  out->layout = layout;
  out->read_only = read_only;
  return 0;
fail:
  gpd_members_free(members, (uint32_t)nm);
  free(bufs);
  free(used);
  gpupool__hmap_free(&seen);
  return rc;
}

static int publish_bundle(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint64_t *hold_ids,
                          size_t nholds, Gpupool__Wire__BundleMember *const *wm, size_t nmembers,
                          uint64_t layout_id, int utf8_checked, uint64_t *version) {
  gpd_bundle_prep p;
  int rc = gpd_bundle_prepare(reg, c, rn, hold_ids, nholds, wm, nmembers, layout_id, 0, utf8_checked, &p);
  if (rc != 0)
    return rc;
  return gpd_publish_commit(reg, c, p.key, p.old, p.bufs, p.nbufs, p.layout, p.read_only, NULL, 0, version);
}

int gpd_publish_bundle(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint64_t *hold_ids,
                       size_t nholds, Gpupool__Wire__BundleMember *const *wm, size_t nmembers,
                       uint64_t layout_id, uint64_t *version) {
  return publish_bundle(reg, c, rn, hold_ids, nholds, wm, nmembers, layout_id, 0, version);
}

int gpd_publish_bundle_checked(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint64_t *hold_ids,
                               size_t nholds, Gpupool__Wire__BundleMember *const *wm, size_t nmembers,
                               uint64_t layout_id, uint64_t *version) {
  return publish_bundle(reg, c, rn, hold_ids, nholds, wm, nmembers, layout_id, 1, version);
}

int gpd_find_name(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, gpd_name **out) {
  int rc = gpd_rname_ok(rn);
  (void)c;
  if (rc != 0)
    return rc;
  *out = gpupool__smap_get(&reg->names, rn->key);
  if (!*out)
    return gpupool__err(GPUPOOL_ENOENT, "no buffer is published under '%s'", rn->name);
  return 0;
}

int gpd_find_newer(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, uint64_t newer_than,
                   gpd_name **out) {
  const char *name = rn->name;
  int rc = gpd_find_name(reg, c, rn, out);
  if (rc == 0 && (*out)->file)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' names a published file, not a buffer: get it with gpupool_file_get "
                        "(Python: Client.get_file_array)", name);
  if (rc == 0 && (*out)->version <= newer_than)
    return gpupool__err(GPUPOOL_ENOENT, "'%s' is at version %" PRIu64 ", not newer than %" PRIu64, name,
                        (*out)->version, newer_than);
  if (rc == 0)
    rc = gpd_quota_waiting_leases(reg, c);
  return rc;
}

int gpd_find_single(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, uint64_t newer_than, gpd_name **out) {
  gpd_name *n = NULL;
  int rc = gpd_find_newer(reg, c, rn, newer_than, &n);
  if (rc != 0)
    return rc;
  /* Any bundle, one member included: a plain get would hand over its whole buffer without
   * the member's range and description. */
  if (n->layout || n->nbufs != 1)
    return gpupool__err(GPUPOOL_EINVAL,
                        "'%s' is a bundle of %u member%s in %u buffer%s; get it with gpupool_bundle_get "
                        "(Python: get_dict)", rn->name, n->layout ? n->layout->n : 0,
                        n->layout && n->layout->n == 1 ? "" : "s", n->nbufs,
                        n->nbufs == 1 ? "" : "s");
  *out = n;
  return 0;
}

int gpd_get(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only, uint64_t newer_than,
                 gpd_hold **out, uint64_t *version) {
  gpd_name *n = NULL;
  int rc = gpd_find_single(reg, c, rn, newer_than, &n);
  if (rc != 0)
    return rc;
  if (version)
    *version = n->version;
  return gpd_hold_new(reg, c, n->bufs[0], read_only || n->read_only, 0, out);
}

int gpd_get_bundle(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only,
                        uint64_t newer_than, gpd_hold ***holds, const gpd_name **out) {
  gpd_name *n = NULL;
  gpd_hold **hs;
  int rc = gpd_find_newer(reg, c, rn, newer_than, &n);
  if (rc != 0)
    return rc;
  if (!(hs = calloc(n->nbufs, sizeof *hs)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if ((rc = gpd_batch_begin(reg, c)) != 0) {
    free(hs);
    return rc;
  }
  /* One done event for the bundle's holds. */
  for (uint32_t i = 0; i < n->nbufs; i++)
    if ((rc = gpd_hold_new(reg, c, n->bufs[i], read_only || n->read_only, 0, &hs[i])) != 0) {
      while (i-- > 0)
        gpd_hold_drop(reg, hs[i], 0, NULL);
      gpd_batch_end(reg, c);
      free(hs);
      return rc;
    }
  gpd_batch_end(reg, c);
  *holds = hs;
  *out = n;
  return 0;
}

/* Take n out of the table and free it. */
static void name_remove(gpd_registry *reg, gpd_name *n) {
  gpd_uid_usage *u;
  gpupool__smap_del(&reg->names, n->name);
  reg->nnames--;
  reg->state_changes++;
  if (reg->keep)
    reg->keep->name_changed(reg, n->name);
  if ((u = gpd_uid_usage_get(reg, n->tenant, 0))) {
    u->names--;
    gpd_uid_usage_put(reg, u);
  }
  gpd_name_free(reg, n);
}

int gpd_unpublish(gpd_registry *reg, gpd_client *c, const gpd_rname *rn) {
  gpd_name *n = NULL;
  int rc = gpd_find_name(reg, c, rn, &n);
  if (rc != 0)
    return rc;
  /* Found in the caller's own namespace (its tenant's, or a group it is in): its members
   * share it, so any of them may take a name out. */
  name_remove(reg, n);
  return 0;
}

int gpd_unpublish_key(gpd_registry *reg, const char *key) {
  gpd_name *n = gpupool__smap_get(&reg->names, key);
  if (!n)
    return gpupool__err(GPUPOOL_ENOENT, "no name is filed under '%s' (names are listed with their tenant, e.g. "
                        "uid:1000/weights, by gpupoolctl names)", key);
  name_remove(reg, n);
  return 0;
}
