/*
 * Bundle plans: checking members from the wire and cutting a bundle into chunks of at most
 * 4 GiB. The member tables themselves (layouts) are in layouts.c.
 */
#include <inttypes.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "log.h"
#include "registry_internal.h"

/* Refuses a table whose member names repeat (an open-addressing set of the names: O(n), as
 * long as the names cannot be chosen to share a slot, hence the seeded hash). */
int gpd_members_unique(const gpd_member *m, size_t n) {
  size_t cap = 16, i;
  uint32_t *slots;
  while (cap < 2 * n)
    cap *= 2;
  if (!(slots = calloc(cap, sizeof *slots)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  for (i = 0; i < n; i++) {
    size_t k = (size_t)gpupool__hash_bytes(m[i].name, strlen(m[i].name)) & (cap - 1);
    for (; slots[k]; k = (k + 1) & (cap - 1))
      if (!strcmp(m[i].name, m[slots[k] - 1].name)) {
        free(slots);
        return gpupool__err(GPUPOOL_EINVAL, "member name '%s' appears twice (again at member %zu); member names "
                            "must be unique in a bundle", m[i].name, i);
      }
    slots[k] = (uint32_t)i + 1;
  }
  free(slots);
  return 0;
}

/* Checks a member's name, range and tensor description and copies it into *out. utf8_checked:
 * the name came in a request the daemon's frame validator passed (its bytes are UTF-8 without
 * NUL), so only its length and control characters are left to check; members from a peer's
 * reply, which no validator saw, get the full check. */
int gpd_member_from_wire(const char *name, uint64_t offset, uint64_t size, const Gpupool__Wire__TensorMeta *tm,
                              uint64_t limit, size_t idx, int utf8_checked, gpd_member *out) {
  gpupool_tensor_meta m;
  int rc;
  if (!name || (utf8_checked ? gpupool__wire_check_utf8_name(name) : gpupool__wire_check_name(name)) != 0)
    return gpupool__err(GPUPOOL_ENAME, "member %zu: %s", idx,
                        name ? gpupool__errmsg() : "no name; every member needs a name of 1..255 bytes");
  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "member %zu ('%s') has size 0; members need at least 1 byte", idx, name);
  if (offset > limit || size > limit - offset)
    return gpupool__err(GPUPOOL_EINVAL,
                        "member %zu ('%s'): range [%" PRIu64 ", +%" PRIu64 ") does not fit in its buffer of %" PRIu64
                        " bytes", idx, name, offset, size, limit);
  if (tm && tm->present && (rc = gpupool__wire_meta_from(tm, size, &m)) != 0)
    return gpupool__err(rc, "member %zu ('%s'): %s", idx, name, gpupool__errmsg());
  memset(out, 0, sizeof *out);
  out->offset = offset;
  out->size = size;
  if (!(out->name = strdup(name)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (tm && tm->present) {
    if (!(out->meta = malloc(sizeof *out->meta))) {
      free(out->name);
      out->name = NULL;
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    *out->meta = m;
  }
  return 0;
}

int gpd_check_member_count(gpd_registry *reg, size_t n) {
  if (n == 0)
    return gpupool__err(GPUPOOL_EINVAL, "a bundle needs at least one member");
  return gpd_quota_bundle_members(reg, n);
}

void gpd_bundle_plan_free(gpd_bundle_plan *plan) {
  if (!plan)
    return;
  if (plan->layout)
    gpd_layout_unref(plan->reg, plan->layout);
  else
    gpd_members_free(plan->members, plan->nmembers);
  free(plan->chunks);
  free(plan);
}

int gpd_bundle_plan_new(gpd_registry *reg, gpd_client *c, gpd_pool *p,
                             Gpupool__Wire__MemberSpec *const *specs, size_t n, uint64_t align,
                             gpd_bundle_plan **out) {
  gpd_bundle_plan *plan;
  uint64_t owner, cur = 0, limit;
  size_t i;
  int rc;

  if ((rc = gpd_check_member_count(reg, n)) != 0)
    return rc;
  if ((rc = gpd_pool_owner(reg, c, p, &owner)) != 0 || (rc = gpd_pool_alignment(p, &align)) != 0)
    return rc;
  /* A chunk is one exported allocation: at most 4 GiB (the CUDA driver's limit on one). */
  limit = GPUPOOL_SLAB_HARD_MAX & ~(align - 1);
  if (!(plan = calloc(1, sizeof *plan)) || !(plan->members = calloc(n, sizeof *plan->members)) ||
      !(plan->chunks = calloc(n, sizeof *plan->chunks))) {
    gpd_bundle_plan_free(plan);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  plan->pool = p;
  plan->reg = reg;
  plan->align = align;
  for (i = 0; i < n; i++) {
    const Gpupool__Wire__MemberSpec *sp = specs[i];
    gpd_member *m = &plan->members[i];
    uint64_t off;
    if ((rc = gpd_member_from_wire(sp->name, 0, sp->size, sp->tensor, UINT64_MAX, i, 1, m)) != 0)
      goto fail;
    plan->nmembers = (uint32_t)i + 1;
    if (sp->size > limit) {
      rc = gpupool__err(GPUPOOL_ETOOBIG,
                        "member %zu ('%s') of %" PRIu64 " bytes is larger than one allocation of pool '%s' may be "
                        "(%" PRIu64 " bytes); split it", i, sp->name, sp->size, p->cfg.name, limit);
      goto fail;
    }
    off = gpd_round_up(cur, align);
    if (plan->nchunks == 0 || off + sp->size > limit || off < cur) {
      /* Start a new chunk (the first one, or this member does not fit in the current one). */
      if (plan->nchunks)
        plan->chunks[plan->nchunks - 1] = cur;
      plan->nchunks++;
      off = 0;
    }
    m->buffer = plan->nchunks - 1;
    m->offset = off;
    cur = off + sp->size;
  }
  plan->chunks[plan->nchunks - 1] = cur;
  for (i = 0; i < plan->nchunks; i++) {
    if (plan->total + plan->chunks[i] < plan->total) {
      rc = gpupool__err(GPUPOOL_EINVAL, "the bundle's total size overflows");
      goto fail;
    }
    plan->total += plan->chunks[i];
  }
  if (plan->total > p->cfg.capacity) {
    rc = gpupool__err(GPUPOOL_ETOOBIG,
                      "bundle of %" PRIu64 " bytes is larger than pool '%s' (capacity %" PRIu64 " bytes)",
                      plan->total, p->cfg.name, p->cfg.capacity);
    goto fail;
  }
  if ((rc = gpd_members_unique(plan->members, n)) != 0)
    goto fail;
  rc = gpd_layout_new(reg, c->tenant, plan->members, (uint32_t)n, plan->nchunks, 0, &plan->layout);
  if (rc != 0) {
    plan->members = NULL; /* freed by layout_new */
    plan->nmembers = 0;
    goto fail;
  }
  *out = plan;
  return 0;
fail:
  gpd_bundle_plan_free(plan);
  return rc;
}

int gpd_bundle_allocate(gpd_registry *reg, gpd_client *c, const gpd_bundle_plan *plan,
                             gpd_hold ***holds) {
  gpd_hold **hs = calloc(plan->nchunks, sizeof *hs);
  int rc = 0;
  if (!hs)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  for (uint32_t i = 0; i < plan->nchunks; i++)
    if ((rc = gpd_allocate(reg, c, plan->pool, plan->chunks[i], plan->align, &hs[i])) != 0) {
      char msg[GPUPOOL__ERRMSG_MAX];
      int returned = reg->memory_returned;
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      /* Giving back the chunks just taken returns nothing that was free before this call:
       * it must not wake the waiting allocations (this one among them, which would be
       * tried again at once, fail the same way, and so on forever). */
      while (i-- > 0)
        gpd_hold_drop(reg, hs[i], 0, NULL);
      reg->memory_returned = returned;
      free(hs);
      if (plan->nchunks > 1)
        return gpupool__err(rc, "bundle of %" PRIu64 " bytes in %u buffers: %s", plan->total, plan->nchunks, msg);
      return gpupool__err(rc, "%s", msg);
    }
  /* Each chunk keeps the layout, so the bundle can be published by its id while it lives. */
  for (uint32_t i = 0; i < plan->nchunks; i++) {
    hs[i]->buf->layout = plan->layout;
    plan->layout->refs++;
  }
  *holds = hs;
  return 0;
}
