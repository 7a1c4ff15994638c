/*
 * Layouts: immutable member tables, shared by equal tables of a tenant, counted against the
 * tenant's members. Apart from the bundle plans (bundles.c), which allocate buffers: a
 * buffer's last reference drops its layout, so layouts sit below the buffers and holds.
 */
#include <inttypes.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "log.h"
#include "registry_internal.h"

/* Freeing a layout of at least this many members gives the freed heap pages back. */
#define TRIM_AFTER_MEMBERS 4096

void gpd_members_free(gpd_member *m, uint32_t n) {
  for (uint32_t i = 0; m && i < n; i++) {
    free(m[i].name);
    free(m[i].meta);
  }
  free(m);
}

static void members_account(gpd_registry *reg, uint64_t tenant, int64_t delta) {
  gpd_uid_usage *u;
  if (!delta || !(u = gpd_uid_usage_get(reg, tenant, 0)))
    return;
  u->members = (uint64_t)((int64_t)u->members + delta);
  gpd_uid_usage_put(reg, u);
}

/* Member tables and member names come from clients, so they are hashed with the seeded hash:
 * a client that cannot predict it cannot line up tables or names on one slot. */
/* What identifies a member's description: the fields in use, not the struct's bytes. */
static void meta_hash(gpupool__hash_state *st, const gpupool_tensor_meta *m) {
  uint8_t present = m != NULL;
  gpupool__hash_update(st, &present, 1);
  if (!m)
    return;
  gpupool__hash_update(st, &m->dtype_code, sizeof m->dtype_code);
  gpupool__hash_update(st, &m->dtype_bits, sizeof m->dtype_bits);
  gpupool__hash_update(st, &m->dtype_lanes, sizeof m->dtype_lanes);
  gpupool__hash_update(st, &m->ndim, sizeof m->ndim);
  gpupool__hash_update(st, m->shape, (size_t)m->ndim * sizeof m->shape[0]);
  gpupool__hash_update(st, &m->strides_present, sizeof m->strides_present);
  if (m->strides_present)
    gpupool__hash_update(st, m->strides, (size_t)m->ndim * sizeof m->strides[0]);
  gpupool__hash_update(st, &m->byte_offset, sizeof m->byte_offset);
}

static int meta_equal(const gpupool_tensor_meta *a, const gpupool_tensor_meta *b) {
  if (!a || !b)
    return a == b;
  return a->dtype_code == b->dtype_code && a->dtype_bits == b->dtype_bits && a->dtype_lanes == b->dtype_lanes &&
         a->ndim == b->ndim && !memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof a->shape[0]) &&
         a->strides_present == b->strides_present &&
         (!a->strides_present || !memcmp(a->strides, b->strides, (size_t)a->ndim * sizeof a->strides[0])) &&
         a->byte_offset == b->byte_offset;
}

static uint64_t table_hash(uint64_t tenant, const gpd_member *m, uint32_t n, uint32_t nbufs) {
  gpupool__hash_state st;
  gpupool__hash_init(&st);
  gpupool__hash_update(&st, &tenant, sizeof tenant);
  gpupool__hash_update(&st, &n, sizeof n);
  gpupool__hash_update(&st, &nbufs, sizeof nbufs);
  for (uint32_t i = 0; i < n; i++) {
    gpupool__hash_update(&st, m[i].name, strlen(m[i].name) + 1);
    gpupool__hash_update(&st, &m[i].buffer, sizeof m[i].buffer);
    gpupool__hash_update(&st, &m[i].offset, sizeof m[i].offset);
    gpupool__hash_update(&st, &m[i].size, sizeof m[i].size);
    meta_hash(&st, m[i].meta);
  }
  return gpupool__hash_final(&st) | 1;
}

static int table_equal(const gpd_layout *l, uint64_t tenant, const gpd_member *m, uint32_t n,
                       uint32_t nbufs) {
  if (l->tenant != tenant || l->n != n || l->nbufs != nbufs)
    return 0;
  for (uint32_t i = 0; i < n; i++)
    if (strcmp(l->members[i].name, m[i].name) || l->members[i].buffer != m[i].buffer ||
        l->members[i].offset != m[i].offset || l->members[i].size != m[i].size ||
        !meta_equal(l->members[i].meta, m[i].meta))
      return 0;
  return 1;
}

/* A layout (one reference, the caller's) over members (taken over; freed on failure or when an
 * equal table of the tenant exists, whose layout is then shared: two bundles allocated alike,
 * as double buffering does, have one layout id, so a consumer's cached table serves both),
 * which lie in nbufs buffers; counted against tenant's members once per layout. A new table
 * must fit in max_members_per_uid (less `freed`, members a new version releases); a shared
 * one adds no members. */
int gpd_layout_new(gpd_registry *reg, uint64_t tenant, gpd_member *members, uint32_t n,
                        uint32_t nbufs, uint64_t freed, gpd_layout **out) {
  uint64_t h = table_hash(tenant, members, n, nbufs);
  gpd_layout *same_hash = gpupool__hmap_get(&reg->layout_hash, h), *l;
  int rc;
  if (same_hash && table_equal(same_hash, tenant, members, n, nbufs)) {
    gpd_members_free(members, n);
    same_hash->refs++;
    *out = same_hash;
    return 0;
  }
  if ((rc = gpd_quota_members(reg, tenant, n, freed)) != 0) {
    gpd_members_free(members, n);
    return rc;
  }
  l = calloc(1, sizeof *l);
  if (!l || !(l->need = calloc(nbufs ? nbufs : 1, sizeof *l->need))) {
    free(l);
    gpd_members_free(members, n);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  l->id = gpd_next_id(reg);
  l->refs = 1;
  l->tenant = tenant;
  l->members = members;
  l->n = n;
  l->nbufs = nbufs;
  for (uint32_t i = 0; i < n; i++)
    if (members[i].offset + members[i].size > l->need[members[i].buffer])
      l->need[members[i].buffer] = members[i].offset + members[i].size;
  if (gpupool__hmap_put(&reg->layouts, l->id, l) != 0) {
    free(l->need);
    free(l);
    gpd_members_free(members, n);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  l->hash = h;
  if (!same_hash) /* (a different table with the same hash keeps the slot) */
    (void)gpupool__hmap_put(&reg->layout_hash, h, l); /* out of memory: just not shared */
  gpd_uid_usage *u = gpd_uid_usage_get(reg, tenant, 1);
  if (u)
    u->members += n;
  reg->nmembers += n;
  *out = l;
  return 0;
}

void gpd_layout_unref(gpd_registry *reg, gpd_layout *l) {
  if (!l || --l->refs > 0)
    return;
  gpupool__hmap_del(&reg->layouts, l->id);
  if (reg->keep)
    reg->keep->layout_gone(reg, l->id);
  if (gpupool__hmap_get(&reg->layout_hash, l->hash) == l)
    gpupool__hmap_del(&reg->layout_hash, l->hash);
  members_account(reg, l->tenant, -(int64_t)l->n);
  reg->nmembers -= l->n;
  gpd_members_free(l->members, l->n);
#ifdef __GLIBC__
  /* A large table is tens of thousands of small blocks (names, descriptions) spread over the
   * heap; malloc keeps their pages after free, so the daemon would stay at the high-water
   * mark of the largest tables a client ever sent. Handing the free pages back costs a walk
   * of the heap, paid only after tables this large. */
  if (l->n >= TRIM_AFTER_MEMBERS)
    malloc_trim(0);
#endif
  free(l->need);
  free(l);
}
