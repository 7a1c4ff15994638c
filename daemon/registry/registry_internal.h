/*
 * What the registry's files share and the server does not see: the registry is one thing
 * (registry.h, the interface the server uses) kept in rooms, and these are the doors between
 * them. Everything here runs on the daemon's loop thread, like the rest of the registry.
 *
 * The rooms: registry.c (clients, descriptions, lifetime), leases.c, slabs.c (backend pools
 * per owner, slabs, placement, sweeping), holds.c (events, buffers, holds), tenants.c
 * (tenants, uid usage, every limit on what a client may cost), names.c (names, versions),
 * bundles.c (layouts, bundle plans); files.c (published files) uses the limits too.
 */
#ifndef GPUPOOL_DAEMON_REGISTRY_INTERNAL_H
#define GPUPOOL_DAEMON_REGISTRY_INTERNAL_H

#include "registry.h"

#define MIB ((uint64_t)1 << 20)
#define SLAB_GRAIN (2 * MIB)
/* Empty kept slabs (replicas' and fetched copies') a pool keeps for the next versions (slabs.c):
 * a bundle's buffers on one device, each a dedicated slab. */
#define GPD_REPLICA_SLABS_KEPT 32
/* What gpd_place's `place` argument says of a buffer: made by the daemon, filled in full by a
 * copy before anyone gets it (its slab may be a kept one, not cleared first), and its slab kept
 * once empty for the next version of the same owner and size. A replica on another device
 * (replicas.c), or a version's local copy fetched from a peer (peers_fetch.c), which is put in
 * a dedicated slab of its own from GPD_COPY_DEDICATED_MIN bytes on so the next version fetched
 * lands in pages already there (a fresh slab's pages are zeroed by the kernel or cleared by the
 * backend: on a host pool that is most of a fetch's time). */
#define GPD_PLACE_REPLICA 1
#define GPD_PLACE_FETCHED 2
/* The kept mark of a dedicated slab made for a client's own allocation in a pool with
 * keep_dedicated: kept once empty (up to keep_dedicated of them), as a replica's is, so that
 * the next version of the same owner and size (a trainer's copied part of a sharded version)
 * goes where the last one was, and readers that keep it mapped import nothing. */
#define GPD_PLACE_ALLOC 3
#define GPD_COPY_DEDICATED_MIN (16 * MIB)

/* Owner ids: a uid alone is its own tenant; [tenant] and [group] sections get ids above any
 * uid. */
#define TENANT_SET (1ull << 40)
#define GROUP_SET (2ull << 40)

/* registry.c: ids and arrays */
uint64_t gpd_next_id(gpd_registry *reg);
uint64_t gpd_round_up(uint64_t v, uint64_t a);
int gpd_grow(void **arr, uint32_t *cap, uint32_t need, size_t elem);

/* holds.c: events, buffers and holds */
/* A reference to an event for c's next hold or buffer (c NULL: a buffer the daemon makes, which
 * gets one of its own), or NULL with the reason in gpupool__errmsg(). */
gpd_event *gpd_event_get(gpd_registry *reg, gpd_client *c);
void gpd_event_put(gpd_registry *reg, gpd_event *e);
/* The holds c's current request makes share one done event, from gpd_batch_begin (0, or the
 * error of gpd_event_get) to gpd_batch_end. */
int gpd_batch_begin(gpd_registry *reg, gpd_client *c);
void gpd_batch_end(gpd_registry *reg, gpd_client *c);
/* c's own events go back (the client is leaving). */
void gpd_client_events_drop(gpd_registry *reg, gpd_client *c);
int gpd_hold_new(gpd_registry *reg, gpd_client *c, gpd_buffer *b, int read_only, int owner,
                      gpd_hold **out);
void gpd_hold_drop(gpd_registry *reg, gpd_hold *h, int done_recorded, gpd_lease *lease);
int gpd_pool_alignment(const gpd_pool *p, uint64_t *align);
/* place: 0, or GPD_PLACE_REPLICA / GPD_PLACE_FETCHED for a buffer filled in full by a copy
 * before anyone gets it (its memory may be a kept slab, and is not cleared first; gpd_place). */
int gpd_buffer_place(gpd_registry *reg, gpd_client *c, gpd_pool *p, uint64_t owner, uint64_t size,
                     uint64_t asize, uint64_t align, int place, gpd_buffer **out);

/* A replica's memory against its tenant's limits (tenants.c) */
int gpd_quota_replica(gpd_registry *reg, uint64_t tenant, uint64_t size, int device);
/* b's last holder let go, or b was published again: tell what keeps state on it (replicas) */
static inline void gpd_buffer_replaced(gpd_registry *reg, gpd_buffer *b) {
  if (reg->ext && reg->ext->buffer_replaced)
    reg->ext->buffer_replaced(reg, b);
}
/* Kept shares: the timer that expires them (init with the registry), and dropping them all
 * (registry_stop stops the timer, registry_close drops every keep first). */
void gpd_keeps_init(gpd_registry *reg);
void gpd_keeps_stop(gpd_registry *reg);
void gpd_keeps_close(gpd_registry *reg);
/* A kept share of a previous daemon's (state.c's restore): on buffer b, with its id, secret,
 * kind and expiry (CLOCK_MONOTONIC ns, as gpd_now_ns), counted as a hold of tenant. */
int gpd_keep_restore(gpd_registry *reg, uint64_t id, gpd_buffer *b, const uint8_t secret[16], int read_only,
                     uint64_t tenant, uint64_t expires_ns);

/* leases.c: the leases of closed connections */
void gpd_lease_unref(gpd_lease *l);
int gpd_lease_wait(gpd_registry *reg, gpd_lease *l);

/* slabs.c: backend pools per owner, slabs, placement, sweeping */
int gpd_per_owner(const gpd_registry *reg);
int gpd_inst_new(gpd_registry *reg, gpd_pool *p, uint64_t owner, gpd_pinst **out);
void gpd_inst_destroy(gpd_registry *reg, gpd_pinst *in);
void gpd_inst_maybe_destroy(gpd_registry *reg, gpd_pinst *in);
void gpd_slab_destroy(gpd_registry *reg, gpd_slab *s);
/* A slab of a previous daemon (state.c): fd (taken in every case) holds its memory, id its id. */
int gpd_slab_adopt(gpd_registry *reg, gpd_pool *p, uint64_t id, int fd, uint64_t size, int dedicated,
                   uint64_t owner, gpd_slab **out);
void gpd_slab_try_release(gpd_registry *reg, gpd_slab *s);
void gpd_slab_maybe_retire(gpd_registry *reg, gpd_slab *s);
int gpd_slab_add_mapper(gpd_slab *s, uint64_t client_id);
void gpd_slab_remove_mapper_at(gpd_slab *s, uint32_t i);
void gpd_finish_free(gpd_registry *reg, gpd_buffer *b);
void gpd_buffer_unref(gpd_registry *reg, gpd_buffer *b);
int gpd_place(gpd_registry *reg, gpd_pool *p, uint64_t owner, uint64_t asked, uint64_t size,
                   uint64_t align, int place, gpd_slab **slab, uint64_t *off);

/* tenants.c: tenants and uid usage */
void gpd_uid_account(gpd_registry *reg, uint64_t tenant, int64_t bytes, int32_t allocs);
int gpd_owner_reachable(const gpd_registry *reg, const gpd_client *c, uint64_t owner);

/* tenants.c, the limits on what a client may cost: 0, or GPUPOOL_ELIMIT with a message that
 * names the count, the limit and what to do. files.c calls gpd_quota_file. */
int gpd_quota_memory(gpd_registry *reg, const gpd_client *c, uint64_t size);
int gpd_quota_waiting_leases(gpd_registry *reg, const gpd_client *c);
int gpd_quota_holds(gpd_registry *reg, const gpd_client *c, const gpd_uid_usage *u);
int gpd_quota_kept_shares(gpd_registry *reg, const gpd_client *c, const gpd_uid_usage *u);
int gpd_quota_name(gpd_registry *reg, uint64_t tenant);
int gpd_quota_name_move(gpd_registry *reg, uint64_t tenant, const char *name);
int gpd_quota_file(gpd_registry *reg, uint64_t tenant);
int gpd_quota_members(gpd_registry *reg, uint64_t tenant, uint64_t n, uint64_t freed);
int gpd_quota_bundle_members(gpd_registry *reg, size_t n);

/* names.c: names and their versions */
void gpd_name_free(gpd_registry *reg, gpd_name *n);
/* The name c sees, at a version newer than newer_than (ENOENT otherwise); _single: one that
 * holds a single buffer (EINVAL for a bundle). */
int gpd_find_newer(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, uint64_t newer_than, gpd_name **out);
int gpd_find_single(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, uint64_t newer_than, gpd_name **out);
/* A bundle checked for a publish under a name: its buffers (in hold order, the caller's array
 * with no references taken yet), its member table (a reference), whether any hold was
 * read-only, the name's key and its entry now (NULL for a new name). part: checked as one part
 * of a sharded version (parts.c), which frees nothing of the name's current table. */
typedef struct {
  gpd_buffer **bufs;
  uint32_t nbufs;
  gpd_layout *layout;
  int read_only;
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  gpd_name *old;
} gpd_bundle_prep;
int gpd_bundle_prepare(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint64_t *hold_ids,
                       size_t nholds, Gpupool__Wire__BundleMember *const *wm, size_t nmembers,
                       uint64_t layout_id, int part, int utf8_checked, gpd_bundle_prep *out);
int gpd_publish_commit(gpd_registry *reg, gpd_client *c, const char *key, gpd_name *n,
                       gpd_buffer **bufs, uint32_t nbufs, gpd_layout *layout,
                       int read_only, const gpupool_tensor_meta *meta, uint64_t want, uint64_t *version);

/* bundles.c: layouts (member tables) and bundle plans */
void gpd_members_free(gpd_member *m, uint32_t n);
int gpd_layout_new(gpd_registry *reg, uint64_t tenant, gpd_member *members, uint32_t n,
                        uint32_t nbufs, uint64_t freed, gpd_layout **out);
void gpd_layout_unref(gpd_registry *reg, gpd_layout *l);
int gpd_members_unique(const gpd_member *m, size_t n);
int gpd_member_from_wire(const char *name, uint64_t offset, uint64_t size, const Gpupool__Wire__TensorMeta *tm,
                              uint64_t limit, size_t idx, int utf8_checked, gpd_member *out);
int gpd_check_member_count(gpd_registry *reg, size_t n);

#endif
