/*
 * Peers: other gpupoolds this one fetches names from, and serves its exported names to
 * (peers.c; the data plane is peers_ucx.c). A client's get of PEER:NAME (or of a name under
 * a [peer]'s prefix) that finds no local version newer than it asks for waits like any get
 * for a publish, and the name's subscription makes sure one fetch runs for it, however many
 * getters wait: the version is read over UCX into the getter's tenant's pool and published
 * locally under the name the client used, with the peer's version number, which wakes the
 * waiting getters. Without UCX (GPUPOOL_HAVE_UCX unset) the calls below are stubs and a
 * configuration with peers is refused at start.
 */
#ifndef GPUPOOL_DAEMON_PEERS_H
#define GPUPOOL_DAEMON_PEERS_H

#include <stdint.h>

#include "errors.h"
#include "gpupool.pb-c.h"

typedef struct gpd_server gpd_server;
typedef struct gpd_conn gpd_conn;
typedef struct gpd_peers gpd_peers;
typedef struct gpd_rname gpd_rname;

/* What the peers tell the server's waiting gets, through these and never by calling the
 * server: a fetched version of key landed here, or the fetch failed (only_nowait: answer only
 * the gets that asked not to wait). */
typedef struct {
  void (*wake_getters)(gpd_server *s, const char *key, uint64_t version);
  void (*fail_getters)(gpd_server *s, const char *key, int code, const char *msg, int only_nowait);
} gpd_peers_news;

#include "config.h"

#ifdef GPUPOOL_HAVE_UCX
/* The checks gpd_peers_start makes of the configuration's secret files (each [peer]'s and
 * peer_secret_file: a regular file, not readable by group or others, at least 16 bytes),
 * without starting anything; nothing to check when no peer is configured. 0, or
 * GPUPOOL_ECONFIG with the reason. gpupoold --check-config runs it. */
int gpd_peers_check_secrets(const gpd_config *cfg);
/* Read the secrets, start UCX and the peer listener (peer_listen). 0, or GPUPOOL_ECONFIG
 * (a secret file that is missing, short or readable by others) or another error, with the
 * reason; nothing is left running on error. */
int gpd_peers_start(gpd_server *s, const gpd_peers_news *news);
/* Close every peer connection (fetches fail, served versions are let go) and UCX. */
void gpd_peers_stop(gpd_server *s);
/* 1 when name is a peer's (PEER:NAME, or under a [peer]'s prefix). */
int gpd_peers_is_remote(gpd_server *s, const gpd_rname *rn);
/* c's get of the remote name found nothing newer than newer_than here and now waits (a
 * waiter of c, filed under the name's key): make sure a fetch for it runs. 0 or the error
 * (the caller removes its waiter and answers with it). */
int gpd_peers_want(gpd_server *s, gpd_conn *c, const gpd_rname *rn, uint64_t newer_than, uint32_t wait_ms);
/* A name was published here (key, as the registry files it): serve the peers' gets waiting
 * for it. */
void gpd_peers_published(gpd_server *s, const char *key, uint64_t version);
/* AdminPeers: fill r (free with gpd_peers_admin_free). */
int gpd_peers_admin(gpd_server *s, Gpupool__Wire__AdminPeersReply *r);
void gpd_peers_admin_free(Gpupool__Wire__AdminPeersReply *r);
#else
#include "server_internal.h"
static inline int gpd_peers_check_secrets(const gpd_config *cfg) {
  if (cfg->peer_listen[0] || cfg->n_peers)
    return gpupool__err(GPUPOOL_ECONFIG, "%s: peer_listen and [peer] sections need a gpupoold built with UCX "
                        "(this one was built without: pkg-config found no ucx; install libucx-dev and "
                        "rebuild, see gpupoold --version)", cfg->path[0] ? cfg->path : "the config");
  return 0;
}
static inline int gpd_peers_start(gpd_server *s, const gpd_peers_news *news) {
  (void)news;
  return gpd_peers_check_secrets(s->cfg);
}
static inline void gpd_peers_stop(gpd_server *s) { (void)s; }
static inline int gpd_peers_is_remote(gpd_server *s, const gpd_rname *rn) {
  (void)s;
  (void)name;
  return 0;
}
static inline int gpd_peers_want(gpd_server *s, gpd_conn *c, const char *name, uint64_t newer_than,
                                 uint32_t wait_ms) {
  (void)s, (void)c, (void)name, (void)newer_than, (void)wait_ms;
  return gpupool__err(GPUPOOL_ENOTSUP, "this gpupoold was built without UCX: no peers");
}
static inline void gpd_peers_published(gpd_server *s, const char *key, uint64_t version) {
  (void)s, (void)key, (void)version;
}
static inline int gpd_peers_admin(gpd_server *s, Gpupool__Wire__AdminPeersReply *r) {
  (void)s;
  r->transport = (char *)"not built (no UCX found by pkg-config)";
  return 0;
}
static inline void gpd_peers_admin_free(Gpupool__Wire__AdminPeersReply *r) { (void)r; }
#endif

#endif
