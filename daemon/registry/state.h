/*
 * What outlives the daemon's process (state.c): the memory of its slabs and the leases of its
 * clients as fds in a file descriptor store (systemd's, FDSTORE=1, or gpupoold --supervise's),
 * and the registry's state (pools' slabs, buffers, names and their versions, bundle layouts,
 * which lease pins what) in a sealed memfd kept there too. The next daemon takes them back at
 * start and rebuilds the registry from them, each piece checked; what does not check out is
 * discarded, with the reason in the log.
 */
#ifndef GPUPOOL_DAEMON_STATE_H
#define GPUPOOL_DAEMON_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "registry.h"

/* The format the state is written in; a daemon reads every format up to its own. */
/* 1: whole states only. 2: the same whole state, and deltas that follow it (gpd.delta.G.N):
 * a daemon of format 1 would miss the changes they hold, so it must refuse such a store.
 * 3: kept shares (tokens in flight that open after a restart): a section after the leases,
 * and their records in deltas; a daemon of format 2 would drop them, so it refuses it. */
#define GPD_STATE_FORMAT 3

/* What the start found and did, for the log, STATUS= and `gpupoolctl status`. */
typedef struct {
  int enabled;              /* a store is there and the backend's memory can outlive the daemon */
  uint64_t store_max;       /* entries the store holds at most */
  int found;                /* a state was found */
  uint64_t generation;      /* of the state restored */
  uint32_t format;          /* its format */
  uint64_t names, bytes, slabs, leases, buffers, keeps; /* restored (keeps: kept shares) */
  uint64_t keeps_expired;   /* kept shares that expired while no daemon ran */
  uint64_t names_lost, slabs_lost, buffers_lost, fds_dropped; /* discarded */
  char why[256];            /* the first reason something was discarded */
  uint64_t restore_ns;      /* how long the restore took */
  uint64_t writes, write_ns_last, write_ns_max, write_bytes_last; /* states written since */
  uint64_t deltas, compactions; /* of those writes: deltas, and whole states that replaced deltas */
  uint64_t deltas_restored, deltas_dropped; /* at start: deltas replayed, and those discarded */
} gpd_state_info;

/* After gpd_registry_init: take the fds the store gave back (gpd_sd_stored_fds), restore what
 * checks out and start saving from now on. 0, or GPUPOOL_ECONFIG when the state was written
 * by a newer daemon (the message names both formats and what to do): the daemon then refuses
 * to start rather than discard what the newer one kept. */
int gpd_state_init(gpd_registry *reg);
/* Write the whole state now if anything changed or deltas follow it (the daemon is stopping:
 * after its clients are dropped, before gpd_registry_stop). */
void gpd_state_flush(gpd_registry *reg);
/* Write what changed (a delta) now if a name or version changed since the last write: before
 * any reply leaves (server/send.c), so that no client is told of a version a crash could lose.
 * Other changes (holds, leases, mappings) are written at the end of the loop turn that made
 * them, at most every 100 ms. */
void gpd_state_sync(gpd_registry *reg);
/* Stop saving (before gpd_registry_close: what it frees stays in the store). */
void gpd_state_stop(gpd_registry *reg);
const gpd_state_info *gpd_state_info_get(const gpd_registry *reg);
/* One line for `gpupoolctl status`: whether the state is kept, what the start restored and
 * what it discarded, with the first reason. */
void gpd_state_describe(const gpd_registry *reg, char *buf, size_t len);

/* Resuming a client's holds after a restart. GPD_STATE_RESUME_LEN bytes of token for lease l
 * into buf (0 when its state is not kept: nothing to send). */
#define GPD_STATE_RESUME_LEN 24
size_t gpd_state_resume_token(const gpd_lease *l, uint8_t buf[GPD_STATE_RESUME_LEN]);
/* The holds the previous daemon's connection named by token had, as new holds of c (only for
 * the same uid, once): *out (the caller frees the array) and *n. 0, or an error when a hold
 * could not be made (those made are kept). */
int gpd_state_resume(gpd_registry *reg, gpd_client *c, const uint8_t *token, size_t len, gpd_hold ***out,
                     size_t *n);

/* A slab made or given back, a lease made or closed: reported by the registry through
 * reg->keep, which gpd_state_init sets. */

#endif
