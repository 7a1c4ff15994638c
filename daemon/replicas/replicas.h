/*
 * Replicas of a version on other devices (replicas.c): beside the handlers, over the
 * registry. The registry never calls them; it tells them of a buffer replaced, of stopping
 * and of closing through the gpd_registry_ext they attach.
 */
#ifndef GPUPOOL_DAEMON_REPLICAS_H
#define GPUPOOL_DAEMON_REPLICAS_H

#include "registry.h"

/* Attach the replicas to reg (once, before any request): their timers and the backend's
 * copy notifier, and the registry's news. */
void gpd_replicas_attach(gpd_registry *reg);
/* Replicas (replicas.c). A get for `device` (>= 0; -1 = wherever the version lies): the version's
 * buffers on that device, their replicas there when ready, or GPUPOOL_EBUSY with *copy_id the
 * copy job to wait for (started here when none runs). Same codes as gpd_get / gpd_get_bundle
 * otherwise, and the reason when no replica can be made (no pool of that device, quota, room). */
int gpd_get_on(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only, uint64_t newer_than,
               int device, gpd_hold **out, uint64_t *version, uint64_t *copy_id);
int gpd_get_bundle_on(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only,
                      uint64_t newer_than, int device, gpd_hold ***holds, const gpd_name **out,
                      uint64_t *copy_id);
/* Broadcast: make replicas of the name's current version on each of the n devices now (one
 * copy job along them as a chain). Devices it cannot serve are told in the log and left to
 * the gets. Checked before the publish: at most 16 devices and a backend that copies
 * (gpd_replicate_limits, before the hold is looked up), then each device once, each with a
 * pool the owner of the buffer of h (the hold of the first buffer) may use. */
int gpd_replicate_limits(gpd_registry *reg, size_t n);
int gpd_replicate_check(gpd_registry *reg, const gpd_hold *h, const uint32_t *devices, size_t n);
void gpd_replicate(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint32_t *devices, size_t n);
/* Stop every running copy (the daemon is stopping): its replicas are dropped. */
void gpd_copies_stop(gpd_registry *reg);

#endif
