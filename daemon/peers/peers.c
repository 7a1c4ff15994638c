/*
 * Peers (see peers.h): the control plane between daemons and the fetches it runs.
 *
 * Control: one TCP connection (libuv) from a fetching daemon to each peer it fetches from,
 * carrying 4-byte little-endian length-prefixed PeerFrames (proto/gpupool.proto), each at most
 * peer_max_frame bytes. The fetching side says Hello (its nonce and its own peer_listen, by
 * which the serving side finds its [peer] section: the advertised address, else the source
 * address when one section alone has it; its UCX worker address; its instance), the serving
 * side answers Challenge (its nonce, its instance and HMAC-SHA256(secret, "gpupool peer server"
 * | both nonces | Hello's worker and listen addresses | both instances): what Hello carried is
 * authenticated, not only who sent it), the fetching side checks it and answers Auth (the same
 * with "gpupool peer client"), and the serving side checks that and
 * connects its UCX endpoint to the fetching side's worker (the address came in Hello) and says
 * Welcome once UCX is connected both ways. Both compare in constant time; a wrong secret is
 * logged on both sides, and nothing but Hello, Challenge, Auth and Error is read before.
 *
 * Fetching: a subscription per local name key (what the waiting getters are filed under)
 * asks the peer for a version newer than the oldest version any of them waits past (PeerGet,
 * which may wait there for a publish); the reply gives the layout and each buffer's length;
 * the local copy is allocated in the getters' tenant's pool and PeerReady asks for the data,
 * which the peer sends as UCX active messages (1 MiB each, a window of them in flight) copied
 * into place as they arrive; the copy is published under the local name with the peer's
 * version number (which wakes the getters), and PeerDone lets the peer release its hold.
 * The serving side sends and the fetching side only receives: a daemon whose peer dies never
 * has UCX answer that peer on its behalf (UCX 1.13's software RMA over TCP aborts the serving
 * process when a get's reply cannot be sent). One subscription, one fetch at a time: 200
 * getters of one version cause one transfer. A fetch that fails (peer gone, timeout, quota)
 * frees the local copy, answers every getter of the name with the reason, and the next get
 * starts a new one. A fetch that completes when nobody waits any more is dropped.
 *
 * Serving: a PeerGet is looked up in the tenant (or group) it names, which must export to the
 * asking peer (ENOENT otherwise, the answer for an absent name: no leak of existence); the
 * version's buffers are held (a hold of a client of the daemon's own, per fetch), mapped and
 * registered with UCX for exactly their ranges until PeerDone or the connection's end. A get that
 * finds no newer version waits (bounded by peer_max_fetches per peer) for a publish. A name
 * this daemon itself fetches from another peer (a tree: A -> B -> C) is fetched for the
 * waiting peer like for a local getter, and re-served once here.
 *
 * Device memory (device pools, and every pool of the CUDA backend, whose slabs the daemon
 * cannot map) is staged through pinned host memory in a bounded ring of chunks per transfer,
 * copied by the backend's copy jobs and polled from the loop (peers_stage.c); the fetching side
 * gives the serving side a window (PeerReady.window) and acknowledges what reached device
 * memory (PeerCredit). How device memory moves is decided and logged at start-up.
 *
 * The parts: this file starts and stops the peers (reading the secrets, the listener, the
 * tick that enforces the timeouts) and lists them for gpupoolctl peers; peers_link.c holds the
 * TCP connections, their framing and Hello/Challenge/Auth; peers_fetch.c the subscriptions
 * and fetches; peers_serve.c the peers' gets served here; peers_stage.c the staging of device
 * memory; peers_internal.h what they share.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "peers_internal.h"

/* Read a secret file: at least 16 bytes, a regular file not readable by group or others.
 * Opened non-blocking, so that a FIFO is refused rather than waited on. */
static int read_secret(const char *path, uint8_t *out, size_t *len) {
  struct stat st;
  ssize_t n;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot open the peer secret file %s: %s", path, strerror(errno));
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "the peer secret file %s is not a regular file", path);
  }
  if (st.st_mode & 077) {
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "the peer secret file %s is readable by group or others (mode %04o); "
                        "chmod 600 %s", path, (unsigned)(st.st_mode & 07777), path);
  }
  n = read(fd, out, MAX_SECRET);
  close(fd);
  if (n < 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot read the peer secret file %s: %s", path, strerror(errno));
  /* A trailing newline is not part of the secret (echo adds one on one side, not the other). */
  while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == '\r'))
    n--;
  if (n < 16)
    return gpupool__err(GPUPOOL_ECONFIG, "the peer secret file %s holds %zd bytes, fewer than 16; write a longer "
                        "secret (e.g. head -c 32 /dev/urandom | base64 > %s)", path, n, path);
  *len = (size_t)n;
  return 0;
}

int gpd_peers_check_secrets(const gpd_config *cfg) {
  uint8_t secret[MAX_SECRET];
  size_t len;
  int rc = 0;
  if (!cfg->peer_listen[0] && !cfg->n_peers)
    return 0;
  for (int i = 0; i < cfg->n_peers && rc == 0; i++)
    rc = read_secret(cfg->peers[i].secret_file[0] ? cfg->peers[i].secret_file : cfg->peer_secret_file, secret, &len);
  /* The default secret is checked even when no [peer] uses it yet: a file others can read is
   * refused at start, not first when a [peer] section is added and the daemon restarted. */
  if (rc == 0 && cfg->peer_secret_file[0])
    rc = read_secret(cfg->peer_secret_file, secret, &len);
  explicit_bzero(secret, sizeof secret);
  return rc;
}

/* Timeouts: authentication, peers' waiting gets, fetches. */
static void on_tick(uv_timer_t *t) {
  gpd_peers *P = t->data;
  uint64_t now = now_ns(), limit = (uint64_t)P->cfg->peer_fetch_timeout_ms * 1000000ull;
  uint64_t hs = (uint64_t)P->cfg->peer_handshake_timeout_ms * 1000000ull;
  for (plink *l = P->links, *next; l; l = next) {
    next = l->next;
    if (l->state != L_UP && (l->why[0] || now - l->since_ns > hs)) {
      char why[128];
      snprintf(why, sizeof why, "no %s within %u ms (peer_handshake_timeout_ms)",
               l->state == L_CONNECTING ? "connection" : "authentication", P->cfg->peer_handshake_timeout_ms);
      gpd_pr_link_close(l, l->why[0] ? l->why : why);
      continue;
    }
  }
  gpd_pr_reconnect(P, now);
  gpd_pr_serves_retry(P, NULL, 0, now);
  gpd_pr_graves_free(P, now, 0);
  for (sub *sb = P->subs, *next; sb; sb = next) {
    next = sb->next;
    if (sb->state == S_ASKED && now - sb->asked_ns > sb->wait_ms * 1000000ull + limit && sb->link) {
      char why[160];
      snprintf(why, sizeof why, "no answer to a fetch within %u ms (peer_fetch_timeout_ms)", P->cfg->peer_fetch_timeout_ms);
      gpd_pr_link_close(sb->link, why);
      break; /* the list changed */
    }
    if (sb->state == S_TRANSFER && now - sb->started_ns > limit && sb->peer->out) {
      char why[160];
      snprintf(why, sizeof why, "a transfer took longer than %u ms (peer_fetch_timeout_ms)", P->cfg->peer_fetch_timeout_ms);
      gpd_pr_link_close(sb->peer->out, why);
      break;
    }
  }
}

/* The link and the stager tell fetching and serving of their news through these. */
static const gpd_pr_ops pr_ops = {
    .on_peer_get = gpd_pr_on_peer_get,
    .on_peer_done = gpd_pr_on_peer_done,
    .on_peer_ready = gpd_pr_on_peer_ready,
    .on_peer_credit = gpd_pr_on_peer_credit,
    .on_peer_failed = gpd_pr_on_peer_failed,
    .on_get_reply = gpd_pr_on_get_reply,
    .peer_instance = gpd_pr_peer_instance,
    .sub_ask = gpd_pr_sub_ask,
    .sub_failed = gpd_pr_sub_failed,
    .serve_free_reading = gpd_pr_serve_free_reading,
    .sub_stage_step = gpd_pr_sub_stage_step,
    .serve_stage_step = gpd_pr_serve_stage_step,
};

int gpd_peers_start(gpd_server *s, const gpd_peers_news *news) {
  const gpd_config *cfg = s->cfg;
  gpd_peers *P;
  int rc;
  if (!cfg->peer_listen[0] && !cfg->n_peers)
    return 0;
  /* What --check-config checks too: every secret file (the default one included). */
  if ((rc = gpd_peers_check_secrets(cfg)) != 0)
    return rc;
  if (!(P = calloc(1, sizeof *P)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  P->s = s;
  P->news = news;
  P->ops = &pr_ops;
  P->loop = s->loop;
  P->cfg = cfg;
  P->revision = PEER_REVISION;
  if (getenv("GPUPOOL_TEST_PEER_REVISION")) {
    long r = strtol(getenv("GPUPOOL_TEST_PEER_REVISION"), NULL, 10);
    P->revision = r >= 1 && r <= 1000 ? (uint32_t)r : PEER_REVISION;
    GPUPOOL__WARN("peers: speaking peer revision %u (GPUPOOL_TEST_PEER_REVISION; this build's is %d)", P->revision,
                  PEER_REVISION);
  }
  P->reg = s->reg;
  /* This start's instance: a peer that sees another one knows this daemon's versions began
   * anew. */
  while (!P->instance)
    if (getrandom(&P->instance, sizeof P->instance, 0) != (ssize_t)sizeof P->instance)
      P->instance = gpd_now_ns() ^ ((uint64_t)getpid() << 32);
  gpupool__smap_init(&P->subs_by_key);
  snprintf(P->listen_addr, sizeof P->listen_addr, "%s", cfg->peer_listen);
  for (int i = 0; i < cfg->n_peers; i++) {
    peer *p = &P->peers[P->npeers++];
    p->P = P;
    p->conf = &cfg->peers[i];
    if ((rc = read_secret(p->conf->secret_file[0] ? p->conf->secret_file : cfg->peer_secret_file, p->secret,
                          &p->secret_len)) != 0)
      goto fail;
  }
  if (cfg->peer_listen[0] && !cfg->n_peers)
    GPUPOOL__WARN("peers: peer_listen is set but no [peer] section: no daemon can authenticate to this one");
  gpupool__hmap_init(&P->receiving);
  if ((rc = gpd_ucx_open(s->loop, gpd_pr_on_data, P, &P->ucx)) != 0)
    goto fail;
  if (cfg->peer_listen[0]) {
    uv_tcp_init(s->loop, &P->listener);
    P->listener.data = P;
    P->listening = 1;
    if ((rc = uv_tcp_bind(&P->listener, (const struct sockaddr *)&cfg->peer_addr, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&P->listener, 128, gpd_pr_on_accept)) != 0) {
      rc = gpupool__err(GPUPOOL_ECONFIG, "peer_listen %s: %s (is another daemon listening there?)", cfg->peer_listen,
                        uv_strerror(rc));
      uv_close((uv_handle_t *)&P->listener, NULL);
      P->listening = 0;
      gpd_ucx_close(P->ucx);
      goto fail;
    }
    GPUPOOL__INFO("peers: serving peers at %s", cfg->peer_listen);
  }
  uv_timer_init(s->loop, &P->tick);
  P->tick.data = P;
  uv_timer_start(&P->tick, on_tick, TICK_MS, TICK_MS);
  uv_unref((uv_handle_t *)&P->tick);
  gpd_pr_stage_open(P); /* logs how device memory moves; never fails the start */
  s->peers = P;
  return 0;
fail:
  gpupool__smap_free(&P->subs_by_key);
  memset(P->peers, 0, sizeof P->peers);
  free(P);
  return rc;
}

/* libuv runs close callbacks newest first: P goes with the last of its handles. */
static void tick_closed(uv_handle_t *h) {
  gpd_peers *P = h->data;
  if (--P->closing)
    return;
  gpupool__smap_free(&P->subs_by_key);
  gpupool__hmap_free(&P->receiving);
  free(P);
}

void gpd_peers_stop(gpd_server *s) {
  gpd_peers *P = s->peers;
  if (!P)
    return;
  while (P->links)
    gpd_pr_link_close(P->links, "daemon shutting down");
  /* Transfers whose endpoint was closed end now (their getters are told), then what is left
   * lets go of its memory while UCX still knows the registrations. */
  gpd_ucx_flush(P->ucx);
  gpd_pr_graves_free(P, 0, 1);
  while (P->subs) {
    sub *sb = P->subs;
    gpd_pr_sub_fail_waiters(sb, GPUPOOL_ECLOSED, "gpupoold is shutting down", 0);
    gpd_pr_sub_release(sb);
    gpd_pr_sub_free(sb);
  }
  gpd_ucx_close(P->ucx);
  /* UCX sends from no slot any more. */
  gpd_pr_stage_close(P);
  P->closing = 2 + P->listening;
  if (P->listening)
    uv_close((uv_handle_t *)&P->listener, tick_closed);
  uv_close((uv_handle_t *)&P->stage_timer, tick_closed);
  uv_timer_stop(&P->tick);
  uv_close((uv_handle_t *)&P->tick, tick_closed);
  s->peers = NULL;
}

/* ---- gpupoolctl peers ------------------------------------------------------------------------ */

static const char *peer_state(const peer *p) {
  if (!p->out)
    return "down";
  switch (p->out->state) {
  case L_CONNECTING: return "connecting";
  case L_UP: return "connected";
  default: return "authenticating";
  }
}

int gpd_peers_admin(gpd_server *s, Gpupool__Wire__AdminPeersReply *r) {
  gpd_peers *P = s->peers;
  Gpupool__Wire__PeerInfo *infos, **ptrs;
  if (!P) {
    r->transport = (char *)"ucx (no peers configured)";
    r->listen = (char *)"";
    return 0;
  }
  r->transport = (char *)gpd_ucx_describe(P->ucx);
  r->listen = P->listen_addr;
  r->device_memory = P->device_memory;
  r->staging_in_use = P->slots_taken * STAGE_SLOT;
  r->staging_made = P->nslots * STAGE_SLOT;
  if (!P->npeers)
    return 0;
  infos = calloc((size_t)P->npeers, sizeof *infos);
  ptrs = calloc((size_t)P->npeers, sizeof *ptrs);
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  for (int i = 0; i < P->npeers; i++) {
    peer *p = &P->peers[i];
    gpupool__wire__peer_info__init(&infos[i]);
    infos[i].name = (char *)p->conf->name;
    infos[i].address = (char *)p->conf->address;
    infos[i].state = (char *)peer_state(p);
    infos[i].last_error = p->last_error;
    infos[i].fetches_in_flight = p->in_flight;
    infos[i].fetches = p->fetches;
    infos[i].failures = p->failures;
    infos[i].bytes_fetched = p->bytes_fetched;
    infos[i].versions_served = p->versions_served;
    infos[i].bytes_served = p->bytes_served;
    infos[i].serving_now = p->serving_now;
    infos[i].bytes_staged = p->bytes_staged;
    infos[i].fetch_transport = p->fetch_transport;
    infos[i].serve_transport = p->serve_transport;
    infos[i].restarts = p->restarts;
    ptrs[i] = &infos[i];
  }
  r->n_peers = (size_t)P->npeers;
  r->peers = ptrs;
  return 0;
}

void gpd_peers_admin_free(Gpupool__Wire__AdminPeersReply *r) {
  if (r->n_peers)
    free(r->peers[0]);
  free(r->peers);
}
