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

/* Owner ids: a uid alone is its own tenant; [tenant] and [group] sections get ids above any
 * uid. */
#define TENANT_SET (1ull << 40)
#define GROUP_SET (2ull << 40)

/* registry.c: ids and arrays */
uint64_t gpupool__next_id(gpupool__registry *reg);
uint64_t gpupool__round_up(uint64_t v, uint64_t a);
int gpupool__grow(void **arr, uint32_t *cap, uint32_t need, size_t elem);

/* holds.c: events, buffers and holds */
void gpupool__event_put(gpupool__registry *reg, gpupool__event *e);
int gpupool__hold_new(gpupool__registry *reg, gpupool__client *c, gpupool__buffer *b, int read_only, int owner,
                      gpupool__hold **out);
void gpupool__hold_drop(gpupool__registry *reg, gpupool__hold *h, int done_recorded, gpupool__lease *lease);
int gpupool__hold_of(gpupool__registry *reg, gpupool__client *c, uint64_t id, gpupool__hold **out);
int gpupool__pool_alignment(const gpupool__pool *p, uint64_t *align);

/* leases.c: the leases of closed connections */
void gpupool__lease_unref(gpupool__lease *l);
int gpupool__lease_wait(gpupool__registry *reg, gpupool__lease *l);

/* slabs.c: backend pools per owner, slabs, placement, sweeping */
int gpupool__per_owner(const gpupool__registry *reg);
int gpupool__inst_new(gpupool__registry *reg, gpupool__pool *p, uint64_t owner, gpupool__pinst **out);
void gpupool__inst_destroy(gpupool__registry *reg, gpupool__pinst *in);
void gpupool__inst_maybe_destroy(gpupool__registry *reg, gpupool__pinst *in);
void gpupool__slab_destroy(gpupool__registry *reg, gpupool__slab *s);
void gpupool__slab_try_release(gpupool__registry *reg, gpupool__slab *s);
void gpupool__slab_maybe_retire(gpupool__registry *reg, gpupool__slab *s);
int gpupool__slab_add_mapper(gpupool__slab *s, uint64_t client_id);
void gpupool__slab_remove_mapper_at(gpupool__slab *s, uint32_t i);
void gpupool__finish_free(gpupool__registry *reg, gpupool__buffer *b);
void gpupool__buffer_unref(gpupool__registry *reg, gpupool__buffer *b);
int gpupool__place(gpupool__registry *reg, gpupool__pool *p, uint64_t owner, uint64_t asked, uint64_t size,
                   uint64_t align, gpupool__slab **slab, uint64_t *off);

/* tenants.c: tenants and uid usage */
void gpupool__uid_account(gpupool__registry *reg, uint64_t tenant, int64_t bytes, int32_t allocs);
int gpupool__owner_reachable(const gpupool__registry *reg, const gpupool__client *c, uint64_t owner);

/* tenants.c, the limits on what a client may cost: 0, or GPUPOOL_ELIMIT with a message that
 * names the count, the limit and what to do. files.c calls gpupool__quota_file. */
int gpupool__quota_memory(gpupool__registry *reg, const gpupool__client *c, uint64_t size);
int gpupool__quota_waiting_leases(gpupool__registry *reg, const gpupool__client *c);
int gpupool__quota_holds(gpupool__registry *reg, const gpupool__client *c, const gpupool__uid_usage *u);
int gpupool__quota_name(gpupool__registry *reg, uint64_t tenant);
int gpupool__quota_name_move(gpupool__registry *reg, uint64_t tenant, const char *name);
int gpupool__quota_file(gpupool__registry *reg, uint64_t tenant);
int gpupool__quota_members(gpupool__registry *reg, uint64_t tenant, uint64_t n, uint64_t freed);
int gpupool__quota_bundle_members(gpupool__registry *reg, size_t n);

/* names.c: names and their versions */
void gpupool__name_free(gpupool__registry *reg, gpupool__name *n);

/* bundles.c: layouts (member tables) and bundle plans */
void gpupool__members_free(gpupool__member *m, uint32_t n);
int gpupool__layout_new(gpupool__registry *reg, uint64_t tenant, gpupool__member *members, uint32_t n,
                        uint32_t nbufs, uint64_t freed, gpupool__layout **out);
void gpupool__layout_unref(gpupool__registry *reg, gpupool__layout *l);
int gpupool__members_unique(const gpupool__member *m, size_t n);
int gpupool__member_from_wire(const char *name, uint64_t offset, uint64_t size, const Gpupool__Wire__TensorMeta *tm,
                              uint64_t limit, size_t idx, gpupool__member *out);
int gpupool__check_member_count(gpupool__registry *reg, size_t n);

#endif
