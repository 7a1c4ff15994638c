/*
 * Tenants and what each one uses: owner ids (a uid, a [tenant] or a [group]), who may reach
 * what, the names' namespaces, the usage counted per uid or tenant, and every limit on what
 * a client may cost in the registry (the quota checks, below).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errors.h"
#include "log.h"
#include "registry_internal.h"

/* The uid's record, created when create is set; NULL when absent (or out of memory). */
gpd_uid_usage *gpd_uid_usage_get(gpd_registry *reg, uint64_t tenant, int create) {
  gpd_uid_usage *u = gpupool__hmap_get(&reg->uids, tenant);
  if (u || !create)
    return u;
  u = calloc(1, sizeof *u);
  if (!u || gpupool__hmap_put(&reg->uids, tenant, u) != 0) {
    free(u);
    return NULL;
  }
  u->tenant = tenant;
  return u;
}

/* Drop the record once nothing is counted in it. */
void gpd_uid_usage_put(gpd_registry *reg, gpd_uid_usage *u) {
  if (u && u->allocs == 0 && u->bytes == 0 && u->names == 0 && u->members == 0 && u->holds == 0 &&
      u->leases == 0 &&
      u->conns == 0 && u->waiters == 0 && u->files == 0) {
    gpupool__hmap_del(&reg->uids, u->tenant);
    free(u);
  }
}

void gpd_uid_account(gpd_registry *reg, uint64_t tenant, int64_t bytes, int32_t allocs) {
  gpd_uid_usage *u = gpd_uid_usage_get(reg, tenant, bytes > 0);
  if (!u)
    return;
  u->bytes += (uint64_t)bytes;
  u->allocs += (uint32_t)allocs;
  gpd_uid_usage_put(reg, u);
}

uint64_t gpd_tenant_of(const gpd_config *cfg, uid_t uid, gid_t gid) {
  for (int i = 0; i < cfg->n_tenants; i++)
    if (gpd_member_of(&cfg->tenants[i], uid, gid))
      return TENANT_SET | (uint64_t)i;
  return (uint64_t)uid;
}

void gpd_tenant_label(const gpd_config *cfg, uint64_t owner, char *buf, size_t len) {
  if (owner & GROUP_SET)
    snprintf(buf, len, "group:%s", cfg->groups[owner & 0xffff].name);
  else if (owner & TENANT_SET)
    snprintf(buf, len, "tenant:%s", cfg->tenants[owner & 0xffff].name);
  else
    snprintf(buf, len, "uid:%u", (unsigned)owner);
}

/* May c use memory (slabs, buffers, names) owned by owner? */
int gpd_owner_reachable(const gpd_registry *reg, const gpd_client *c, uint64_t owner) {
  if (owner == c->tenant)
    return 1;
  return (owner & GROUP_SET) && gpd_member_of(&reg->cfg->groups[owner & 0xffff], c->uid, c->gid);
}

static int name_key(gpd_registry *reg, const gpd_client *c, const char *name, char *key, size_t len,
                    uint64_t *owner) {
  char label[80];
  int rc = gpupool__wire_check_utf8_name(name); /* its UTF-8 was checked where it arrived */
  if (rc != 0)
    return rc;
  if (!strncmp(name, "group:", 6)) {
    const char *g = name + 6, *slash = strchr(g, '/');
    int idx = -1;
    for (int i = 0; slash && i < reg->cfg->n_groups; i++)
      if ((size_t)(slash - g) == strlen(reg->cfg->groups[i].name) && !strncmp(g, reg->cfg->groups[i].name, (size_t)(slash - g)))
        idx = i;
    if (!slash || !slash[1])
      return gpupool__err(GPUPOOL_ENAME, "'%s': a group name is written group:GROUP/NAME", name);
    if (idx < 0 || !gpd_member_of(&reg->cfg->groups[idx], c->uid, c->gid))
      return gpupool__err(GPUPOOL_EPERM, "'%s': this daemon has no group '%.*s' with uid %u or gid %u in it "
                          "(groups are [group NAME] sections of its config)", name, (int)(slash - g), g,
                          (unsigned)c->uid, (unsigned)c->gid);
    *owner = GROUP_SET | (uint64_t)idx;
    snprintf(key, len, "%s", name);
    return 0;
  }
  *owner = c->tenant;
  gpd_tenant_label(reg->cfg, c->tenant, label, sizeof label);
  snprintf(key, len, "%s/%s", label, name);
  return 0;
}

int gpd_name_key(gpd_registry *reg, const gpd_client *c, const char *name, gpd_rname *out) {
  out->name = name;
  out->owner = 0;
  out->key[0] = 0;
  out->why[0] = 0;
  out->rc = name_key(reg, c, name, out->key, sizeof out->key, &out->owner);
  if (out->rc != 0)
    snprintf(out->why, sizeof out->why, "%s", gpupool__errmsg());
  return out->rc;
}

int gpd_rname_ok(const gpd_rname *rn) {
  return rn->rc ? gpupool__err(rn->rc, "%s", rn->why) : 0;
}

/* Whose memory c's buffers in p are: the group a shared pool belongs to, else c's tenant.
 * Every buffer c can receive in p has this owner (allocate places it so; open, get and
 * publish admit only slabs gpd_owner_reachable() allows, and a group owns slabs only in its
 * shared pool, where every slab is the group's), so on per-owner backends the pool id names
 * exactly one backend pool for c. */
int gpd_pool_owner(gpd_registry *reg, const gpd_client *c, const gpd_pool *p, uint64_t *owner) {
  int share = reg->cfg->pool_share[p - reg->pools];
  *owner = c->tenant;
  if (share < 0)
    return 0;
  /* A shared pool's memory belongs to its group: every member can read all of it. */
  if (!gpd_member_of(&reg->cfg->groups[share], c->uid, c->gid))
    return gpupool__err(GPUPOOL_EPERM, "pool '%s' is shared with group '%s', which does not include uid %u "
                        "or gid %u; use another pool, or ask the operator to add you to the group",
                        p->cfg.name, reg->cfg->groups[share].name, (unsigned)c->uid, (unsigned)c->gid);
  *owner = GROUP_SET | (uint64_t)share;
  return 0;
}

/* ---- the limits on what a client may cost ------------------------------------------------ */

/*
 * Every limit on what a client may cost the daemon in the registry is checked here, one
 * function per thing counted, and each refusal's message is built here: it names the count,
 * the limit (the config key) and what to do. Each returns 0, or GPUPOOL_ELIMIT with that
 * message. The counts themselves are kept where the thing is made and dropped (holds.c,
 * names.c, bundles.c, files.c); the server keeps the limits on connections, queues and
 * waiters.
 */

/* Memory: live allocations and bytes, of the client and of its tenant, with size more. */
int gpd_quota_memory(gpd_registry *reg, const gpd_client *c, uint64_t size) {
  const gpd_config *cfg = reg->cfg;
  gpd_uid_usage *u = gpupool__hmap_get(&reg->uids, c->tenant);
  char who[80];
  gpd_tenant_label(cfg, c->tenant, who, sizeof who);
  if (cfg->max_allocs_per_client && c->allocs + 1 > cfg->max_allocs_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "client already has %u live allocations, the limit (max_allocs_per_client) is %u; "
                        "release buffers or ask the operator to raise the limit",
                        c->allocs, cfg->max_allocs_per_client);
  if (cfg->max_bytes_per_client && c->bytes + size > cfg->max_bytes_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "allocating %" PRIu64 " bytes would bring this client to %" PRIu64
                        " bytes, over its limit (max_bytes_per_client) of %" PRIu64 " bytes",
                        size, c->bytes + size, cfg->max_bytes_per_client);
  if (cfg->max_allocs_per_uid && u && u->allocs + 1 > cfg->max_allocs_per_uid)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "%s already has %u live allocations, the limit (max_allocs_per_uid) is %u",
                        who, u->allocs, cfg->max_allocs_per_uid);
  if (cfg->max_bytes_per_uid && (u ? u->bytes : 0) + size > cfg->max_bytes_per_uid)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "allocating %" PRIu64 " bytes would bring %s to %" PRIu64
                        " bytes, over its limit (max_bytes_per_uid) of %" PRIu64 " bytes",
                        size, who, (u ? u->bytes : 0) + size, cfg->max_bytes_per_uid);
  return 0;
}

/* A replica of size bytes on device, counted against the tenant of the version it copies. */
int gpd_quota_replica(gpd_registry *reg, uint64_t tenant, uint64_t size, int device) {
  const gpd_config *cfg = reg->cfg;
  gpd_uid_usage *u = gpupool__hmap_get(&reg->uids, tenant);
  char who[80];
  gpd_tenant_label(cfg, tenant, who, sizeof who);
  if (cfg->max_allocs_per_uid && u && u->allocs + 1 > cfg->max_allocs_per_uid)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "a replica on device %d would be one more live allocation of %s, which has %u, the "
                        "limit (max_allocs_per_uid) is %u: replicas count against the tenant of the version "
                        "they copy; release buffers, or get the version where it lies (no target device)",
                        device, who, u->allocs, cfg->max_allocs_per_uid);
  if (cfg->max_bytes_per_uid && (u ? u->bytes : 0) + size > cfg->max_bytes_per_uid)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "a replica of %" PRIu64 " bytes on device %d would bring %s to %" PRIu64 " bytes, over "
                        "its limit (max_bytes_per_uid) of %" PRIu64 " bytes: replicas count against the tenant "
                        "of the version they copy; release buffers, ask the operator to raise the limit, or "
                        "get the version where it lies (no target device)",
                        size, device, who, (u ? u->bytes : 0) + size, cfg->max_bytes_per_uid);
  return 0;
}

/* Refuses new holds to a uid whose closed connections already pin memory through too many
 * leases: every such hold could become one more (a daemon fd and pinned memory each). */
int gpd_quota_waiting_leases(gpd_registry *reg, const gpd_client *c) {
  const gpd_uid_usage *u = gpupool__hmap_get(&reg->uids, c->tenant);
  uint32_t max = reg->cfg->max_waiting_leases_per_uid;
  char who[80];
  if (!max || !u || u->leases < max)
    return 0;
  gpd_tenant_label(reg->cfg, c->tenant, who, sizeof who);
  return gpupool__err(GPUPOOL_ELIMIT,
                      "%s has %u closed connections whose processes still hold their lease and map gpupool "
                      "memory (the limit, max_waiting_leases_per_uid, is %u): it gets no new buffers until some of "
                      "those processes exit. Find the processes of this tenant that closed their gpupool connection "
                      "but keep its memory mapped (forked children, workers that closed their sockets), end them "
                      "or have them call gpupool_client_disconnect, or raise max_waiting_leases_per_uid",
                      who, u->leases, max);
}

/* One more hold for c, whose tenant's record is u. */
int gpd_quota_holds(gpd_registry *reg, const gpd_client *c, const gpd_uid_usage *u) {
  const gpd_config *cfg = reg->cfg;
  char who[80];
  if (cfg->max_holds_per_client && c->nholds >= cfg->max_holds_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "this client already has %" PRIu64 " holds, the limit (max_holds_per_client) is %u; "
                        "release buffers it no longer uses", c->nholds, cfg->max_holds_per_client);
  if (cfg->max_holds_per_uid && u->holds >= cfg->max_holds_per_uid) {
    gpd_tenant_label(cfg, c->tenant, who, sizeof who);
    return gpupool__err(GPUPOOL_ELIMIT, "%s already has %" PRIu64 " holds, the limit (max_holds_per_uid) is %u",
                        who, u->holds, cfg->max_holds_per_uid);
  }
  return 0;
}

/* One more kept share made by c: a hold of its tenant, and one of the connection's kept
 * shares (they outlive it, so the connection's holds do not count them). */
int gpd_quota_kept_shares(gpd_registry *reg, const gpd_client *c, const gpd_uid_usage *u) {
  const gpd_config *cfg = reg->cfg;
  char who[80];
  if (cfg->max_kept_shares_per_client && c->nkept >= cfg->max_kept_shares_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "this client already has %u kept shares not yet opened, the limit "
                        "(max_kept_shares_per_client) is %u; have receivers open them, or wait for "
                        "share_keep_ms (%u ms) to expire those never read",
                        c->nkept, cfg->max_kept_shares_per_client, cfg->share_keep_ms);
  if (cfg->max_holds_per_uid && u->holds >= cfg->max_holds_per_uid) {
    gpd_tenant_label(cfg, c->tenant, who, sizeof who);
    return gpupool__err(GPUPOOL_ELIMIT, "%s already has %" PRIu64 " holds (kept shares included), the limit "
                        "(max_holds_per_uid) is %u", who, u->holds, cfg->max_holds_per_uid);
  }
  return 0;
}

/* The per-uid limit on what a tenant publishes ("names", "files"; the key is max_<what>_per_uid):
 * both outlive their publisher, so the fix is the same. */
static int over_published(const gpd_config *cfg, uint64_t tenant, const char *what, uint32_t have,
                          uint32_t max) {
  char who[80];
  if (!max || have < max)
    return 0;
  gpd_tenant_label(cfg, tenant, who, sizeof who);
  return gpupool__err(GPUPOOL_ELIMIT,
                      "%s already has %u %s published, the limit (max_%s_per_uid) is %u; unpublish %s it no "
                      "longer needs (names outlive their publisher)",
                      who, have, what, what, max, what);
}

/* One more name for tenant: max_names, max_names_per_uid. */
int gpd_quota_name(gpd_registry *reg, uint64_t tenant) {
  const gpd_config *cfg = reg->cfg;
  gpd_uid_usage *u = gpd_uid_usage_get(reg, tenant, 0);
  if (cfg->max_names && reg->nnames >= cfg->max_names)
    return gpupool__err(GPUPOOL_ELIMIT, "the daemon already holds %" PRIu64 " names, the limit (max_names) is %u",
                        reg->nnames, cfg->max_names);
  return over_published(cfg, tenant, "names", u ? u->names : 0, cfg->max_names_per_uid);
}

/* A name of another tenant of the namespace (a group's name) republished by tenant moves to
 * its count: that tenant's max_names_per_uid applies as to a new name. */
int gpd_quota_name_move(gpd_registry *reg, uint64_t tenant, const char *name) {
  const gpd_config *cfg = reg->cfg;
  gpd_uid_usage *u = gpd_uid_usage_get(reg, tenant, 0);
  char who[80];
  if (!cfg->max_names_per_uid || !u || u->names < cfg->max_names_per_uid)
    return 0;
  gpd_tenant_label(cfg, tenant, who, sizeof who);
  return gpupool__err(GPUPOOL_ELIMIT,
                      "%s already has %u names published, the limit (max_names_per_uid) is %u; "
                      "republishing '%s' would make it one more", who, u->names, cfg->max_names_per_uid, name);
}

/* One more published file for tenant: the name limits, max_files, max_files_per_uid. */
int gpd_quota_file(gpd_registry *reg, uint64_t tenant) {
  const gpd_config *cfg = reg->cfg;
  gpd_uid_usage *u;
  int rc = gpd_quota_name(reg, tenant);
  if (rc != 0)
    return rc;
  if (cfg->max_files && reg->nfiles >= cfg->max_files)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "the daemon already keeps %" PRIu64 " files open for published names, the limit "
                        "(max_files) is %u; unpublish files no longer needed",
                        reg->nfiles, cfg->max_files);
  u = gpd_uid_usage_get(reg, tenant, 0);
  return over_published(cfg, tenant, "files", u ? u->files : 0, cfg->max_files_per_uid);
}

/* Whether n more members fit in tenant's max_members_per_uid and in the daemon's max_members
 * (less `freed`, members a new version releases). */
int gpd_quota_members(gpd_registry *reg, uint64_t tenant, uint64_t n, uint64_t freed) {
  const gpd_config *cfg = reg->cfg;
  gpd_uid_usage *u = gpupool__hmap_get(&reg->uids, tenant);
  uint64_t have = u ? u->members : 0, all = reg->nmembers > freed ? reg->nmembers - freed : 0;
  char who[80];
  /* The per-tenant limit bounds one user; this one bounds them all together, since every
   * tenant may fill its own budget. */
  if (cfg->max_members && all + n > cfg->max_members)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "%" PRIu64 " more members would bring the daemon to %" PRIu64 " members in member tables, "
                        "over its limit (max_members) of %u; release or unpublish bundles, or raise max_members "
                        "in the daemon's config", n, all + n, cfg->max_members);
  have = have > freed ? have - freed : 0;
  if (!cfg->max_members_per_uid || have + n <= cfg->max_members_per_uid)
    return 0;
  gpd_tenant_label(cfg, tenant, who, sizeof who);
  return gpupool__err(GPUPOOL_ELIMIT,
                      "%" PRIu64 " more members would bring %s to %" PRIu64 " members in bundles, over the limit "
                      "(max_members_per_uid) of %u; unpublish or release bundles it no longer needs",
                      n, who, have + n, cfg->max_members_per_uid);
}

/* n members in one bundle: max_bundle_members. */
int gpd_quota_bundle_members(gpd_registry *reg, size_t n) {
  if (n > reg->cfg->max_bundle_members)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "bundle of %zu members is over the limit (max_bundle_members) of %u; split it into "
                        "several names", n, reg->cfg->max_bundle_members);
  return 0;
}
