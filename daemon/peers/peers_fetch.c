/*
 * Peers' fetching side (see peers.c): a subscription per local name key asks the peer for a
 * newer version, allocates the local copy from the reply's layout, receives the data as UCX
 * active messages copied into place (a thread faulting in the pages of memory new to the pool
 * meanwhile), publishes the copy under the local name with the peer's version number (shifted
 * once the peer restarted) and tells the peer it is done; a fetch that fails answers every
 * getter. A peer's new instance drops what this daemon holds of its old one.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "peers_internal.h"

/* The getters waiting for key here: how many, and the oldest version they wait past. */
static uint32_t local_waiters(gpd_server *s, const char *key, uint64_t *min_newer) {
  wqueue *q = gpupool__smap_get(&s->get_q, key);
  if (!q || !q->n)
    return 0;
  if (q->heap[0]->newer_than < *min_newer)
    *min_newer = q->heap[0]->newer_than;
  return q->n;
}

/* Peers' gets waiting here for key. */
static uint32_t serve_waiters(gpd_peers *P, const char *key, uint64_t *min_newer) {
  uint32_t n = 0;
  for (plink *l = P->links; l; l = l->next)
    for (serve *sv = l->serves; sv; sv = sv->next)
      if (sv->waiting && !strcmp(sv->key, key)) {
        n++;
        if (sv->newer_than < *min_newer)
          *min_newer = sv->newer_than;
      }
  return n;
}

/* ---- fetching ------------------------------------------------------------------------------- */

/* Which peer a local name is, and the remote tenant and name it means. */
static peer *route(gpd_peers *P, const char *name, const char **rest) {
  for (int i = 0; i < P->npeers; i++) {
    const gpd_peer_conf *c = P->peers[i].conf;
    size_t nl = strlen(c->name), pl = strlen(c->prefix);
    if (!strncmp(name, c->name, nl) && name[nl] == ':' && name[nl + 1]) {
      *rest = name + nl + 1;
      return &P->peers[i];
    }
    if (pl && !strncmp(name, c->prefix, pl) && name[pl]) {
      *rest = name + pl;
      return &P->peers[i];
    }
  }
  return NULL;
}

int gpd_pr_routed(gpd_peers *P, const char *name) {
  const char *rest;
  return route(P, name, &rest) != NULL;
}

int gpd_peers_is_remote(gpd_server *s, const gpd_rname *rn) {
  return s->peers && gpd_pr_routed(s->peers, rn->name);
}

/* The peer whose name is filed under key here (a tenant's or uid's key: a group's names are
 * never a peer's), or NULL. */
static peer *key_peer(gpd_peers *P, const char *key) {
  const char *slash = strchr(key, '/'), *rest;
  if (!slash || !strncmp(key, "group:", 6))
    return NULL;
  return route(P, slash + 1, &rest);
}

/* How many of p's names are here; with drop, unpublish them too. */
static uint32_t peer_names(gpd_peers *P, peer *p, int drop) {
  gpupool__smap *names = &P->reg->names;
  char **keys = NULL;
  uint32_t n = 0, cap = 0;
  for (size_t i = 0; i < names->cap; i++) {
    gpd_name *nm;
    if (!gpupool__smap_slot_used(names, i))
      continue;
    nm = names->slots[i].val;
    if (key_peer(P, nm->name) != p)
      continue;
    if (drop && n == cap) {
      char **k = realloc(keys, (cap = cap ? 2 * cap : 16) * sizeof *keys);
      if (!k)
        break; /* what is left stays until it is fetched anew */
      keys = k;
    }
    if (drop && !(keys[n] = strdup(nm->name)))
      break;
    n++;
  }
  for (uint32_t i = 0; drop && i < n; i++) {
    gpd_unpublish_key(P->reg, keys[i]);
    free(keys[i]);
  }
  free(keys);
  return n;
}

/* A peer's names here are its versions shifted by p->shift; a restart (a new instance: its
 * version numbers begin anew) drops them and shifts its new versions above every one shown
 * here, so that no getter is answered an older version as the newest one, and a getter
 * waiting past a version shown before gets the restarted peer's next one. */
void gpd_pr_peer_instance(peer *p, uint64_t inst) {
  gpd_peers *P = p->P;
  uint32_t dropped;
  p->retry_ns = 0;
  if (p->instance == inst)
    return;
  if (!p->instance) {
    p->instance = inst;
    return;
  }
  p->instance = inst;
  p->restarts++;
  p->shift = p->shown;
  dropped = peer_names(P, p, 1);
  GPUPOOL__INFO("peers: %s restarted (a new instance): %u of its names dropped here; its versions now show here "
                "as their number plus %" PRIu64 ", above every version shown before", p->conf->name, dropped,
                p->shift);
}

/* Connect again to the peers whose connection went down while this daemon has names of theirs:
 * a restarted peer's old versions go as soon as it is back, not only when a getter asks for a
 * newer one. */
void gpd_pr_reconnect(gpd_peers *P, uint64_t now) {
  for (int i = 0; i < P->npeers; i++) {
    peer *p = &P->peers[i];
    if (!p->retry_ns || p->out || now < p->retry_ns)
      continue;
    if (!peer_names(P, p, 0)) {
      p->retry_ns = 0;
      continue;
    }
    p->retry_ns = now + RECONNECT_MAX_NS; /* the attempt's end sets the next one */
    gpd_pr_link_connect(P, p);
    if (p->out)
      p->out->background = 1;
  }
}

void gpd_pr_sub_free(sub *sb) {
  gpd_peers *P = sb->P;
  gpupool__smap_del(&P->subs_by_key, sb->key);
  GPUPOOL__LIST_UNLINK(P->subs, sb, prev, next);
  free(sb->key);
  free(sb->local_name);
  free(sb->rtenant);
  free(sb->rname);
  free(sb);
}

/* Let go of the local copy (freed unless it was published) and the transfer's state. Data
 * still arriving for it finds no fetch under its id and is dropped. */
void gpd_pr_sub_release(sub *sb) {
  if (sb->receiving) {
    gpupool__hmap_del(&sb->P->receiving, sb->id);
    sb->receiving = 0;
  }
  gpd_pr_prefault_stop(sb);
  /* Its copies end before its buffers go (an engine may be writing them). */
  gpd_pr_stager_free(sb->st);
  sb->st = NULL;
  sb->stage_wait = 0;
  sb->bad_data = 0;
  free(sb->bases);
  free(sb->holds);
  sb->bases = NULL, sb->holds = NULL, sb->n = 0;
  if (sb->cl_on) {
    gpd_client_drop(sb->P->reg, &sb->cl);
    sb->cl_on = 0;
  }
  if (sb->rep) {
    gpupool__wire__peer_frame__free_unpacked(sb->rep, NULL);
    sb->rep = NULL;
  }
  if (sb->state == S_TRANSFER || sb->state == S_ASKED)
    sb->peer->in_flight--;
  sb->state = S_IDLE;
  sb->complete = 0;
  sb->received = 0;
}

/* Ask the peer (its connection is up) for the version the waiters want. */
void gpd_pr_sub_ask(sub *sb) {
  gpd_peers *P = sb->P;
  plink *l = sb->peer->out;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerGet g = GPUPOOL__WIRE__PEER_GET__INIT;
  uint64_t min_newer = UINT64_MAX, now = now_ns();
  gpd_name *n = gpupool__smap_get(&P->reg->names, sb->key);
  uint32_t waiters = local_waiters(P->s, sb->key, &min_newer) + serve_waiters(P, sb->key, &min_newer);
  if (!waiters) {
    gpd_pr_sub_free(sb);
    return;
  }
  if (n && n->version > min_newer)
    min_newer = n->version;
  /* Asked in the peer's numbers (this daemon's minus the shift since its restart). */
  min_newer = min_newer > sb->peer->shift ? min_newer - sb->peer->shift : 0;
  /* The fetch's id names it in the data messages the source sends to this daemon's UCX
   * worker, which any peer that learnt the worker's address can send to: an id another peer
   * could guess (a counter) would let it fill someone else's fetch with bytes of its own. A
   * random 64-bit id, unique among this daemon's fetches, cannot be guessed. */
  do {
    if (getrandom(&sb->id, sizeof sb->id, 0) != (ssize_t)sizeof sb->id)
      sb->id = ++P->next_id ^ (now * 0x9E3779B97F4A7C15ull); /* no entropy: still unique below */
  } while (!sb->id || gpupool__hmap_get(&l->asked, sb->id) || gpupool__hmap_get(&P->receiving, sb->id));
  if (gpupool__hmap_put(&l->asked, sb->id, sb) != 0) {
    gpd_pr_sub_fail_waiters(sb, GPUPOOL_ENOMEM, "out of memory in the daemon", 0);
    gpd_pr_sub_free(sb);
    return;
  }
  sb->link = l;
  sb->asked_once = 1;
  sb->state = S_ASKED;
  sb->peer->in_flight++;
  sb->asked_ns = now;
  sb->wait_ms = sb->deadline_ns > now ? (sb->deadline_ns - now) / 1000000 : 0;
  g.id = sb->id;
  g.tenant = sb->rtenant;
  g.name = sb->rname;
  g.newer_than = min_newer;
  sb->asked_newer = min_newer;
  g.wait_ms = (uint32_t)sb->wait_ms;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_GET;
  f.get = &g;
  gpd_pr_send_frame(l, &f);
}


/* Next step of a subscription whose last fetch ended: ask again while getters wait. */
static void sub_next(sub *sb) {
  uint64_t min_newer = UINT64_MAX;
  gpd_peers *P = sb->P;
  if (sb->state != S_IDLE)
    return;
  if (!local_waiters(P->s, sb->key, &min_newer) && !serve_waiters(P, sb->key, &min_newer)) {
    gpd_pr_sub_free(sb);
    return;
  }
  if (sb->asked_once && now_ns() >= sb->deadline_ns) {
    gpd_pr_sub_free(sb); /* the waiters time out on their own */
    return;
  }
  if (sb->peer->out && sb->peer->out->state == L_UP) {
    gpd_pr_sub_ask(sb);
    return;
  }
  sb->state = S_QUEUED;
  if (!sb->peer->out)
    gpd_pr_link_connect(P, sb->peer);
}

/* Answer the waiters of sb's key (local getters and peers' gets) with an error; only_nowait:
 * only the gets that asked not to wait. */
void gpd_pr_sub_fail_waiters(sub *sb, int code, const char *msg, int only_nowait) {
  gpd_peers *P = sb->P;
  P->news->fail_getters(P->s, sb->key, code, msg, only_nowait);
  if (only_nowait)
    return;
  for (plink *l = P->links; l; l = l->next) {
    serve *sv = l->serves, *next;
    for (; sv; sv = next) {
      next = sv->next;
      if (sv->waiting && !strcmp(sv->key, sb->key)) {
        gpd_pr_send_get_error(l, sv->id, code, msg);
        gpd_pr_serve_free(sv);
      }
    }
  }
}

void gpd_pr_sub_failed(sub *sb, int code, const char *msg) {
  sb->peer->failures++;
  snprintf(sb->peer->last_error, sizeof sb->peer->last_error, "%s", msg);
  GPUPOOL__WARN("peers: %s", msg);
  gpd_pr_sub_fail_waiters(sb, code, msg, 0);
  gpd_pr_sub_release(sb);
  gpd_pr_sub_free(sb);
}

/* Every byte of the local copy is in: publish it (or drop it when nobody waits any more). */
static void sub_finish(sub *sb) {
  gpd_peers *P = sb->P;
  gpd_registry *reg = P->reg;
  Gpupool__Wire__PeerGetReply *r = sb->rep->get_reply;
  uint64_t version = 0, min_newer = UINT64_MAX;
  char msg[GPUPOOL__ERRMSG_MAX + 256];
  gpd_rname rn;
  int rc;

  if (sb->link && !sb->link->closing)
    gpd_pr_send_done(sb->link, sb->id);
  if (!local_waiters(P->s, sb->key, &min_newer) && !serve_waiters(P, sb->key, &min_newer)) {
    GPUPOOL__DEBUG("peers: fetched %s v%" PRIu64 " but nobody waits for it any more: dropped", sb->local_name,
                   r->version);
    gpd_pr_sub_release(sb);
    gpd_pr_sub_free(sb);
    return;
  }
  gpd_name_key(reg, &sb->cl, sb->local_name, &rn); /* an error is told by the publish */
  if (r->bundle) {
    uint64_t *ids = calloc(sb->n, sizeof *ids);
    if (!ids) {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    } else {
      for (uint32_t i = 0; i < sb->n; i++)
        ids[i] = sb->holds[i]->id;
      rc = gpd_publish_bundle(reg, &sb->cl, &rn, ids, sb->n, r->members, r->n_members, 0, &version);
      free(ids);
    }
  } else {
    rc = gpd_publish(reg, &sb->cl, sb->holds[0], &rn, r->tensor, 0, 0, &version);
  }
  if (rc != 0) {
    snprintf(msg, sizeof msg, "fetch of %s:%s v%" PRIu64 " failed: publishing the local copy: %s", sb->peer->conf->name,
             sb->rname, r->version, gpupool__errmsg());
    gpd_pr_sub_failed(sb, rc, msg);
    return;
  }
  version = r->version + sb->peer->shift;
  {
    /* The local version is the peer's (shifted once it restarted). */
    gpd_name *n = gpupool__smap_get(&reg->names, sb->key);
    if (n)
      n->version = version;
  }
  if (version > sb->peer->shown)
    sb->peer->shown = version;
  sb->peer->fetches++;
  sb->peer->bytes_fetched += sb->bytes;
  GPUPOOL__INFO("peers: fetched %s v%" PRIu64 " from %s as v%" PRIu64 " (%" PRIu64 " bytes in %" PRIu64 " us)",
                sb->local_name, r->version, sb->peer->conf->name, version, sb->bytes,
                (now_ns() - sb->started_ns) / 1000);
  gpd_pr_sub_release(sb);
  P->news->wake_getters(P->s, sb->key, version);
  gpd_peers_published(P->s, sb->key, version);
  sub_next(sb);
}

/* From the loop: finish the fetches whose data is all in (one at a time, looked up afresh:
 * finishing one may end others). */
static void on_received(void *arg, int status) {
  gpd_peers *P = arg;
  (void)status;
  P->finish_posted = 0;
  for (;;) {
    sub *sb = P->subs;
    while (sb && !(sb->complete && sb->state == S_TRANSFER))
      sb = sb->next;
    if (!sb)
      return;
    sb->complete = 0;
    if (sb->receiving) {
      gpupool__hmap_del(&P->receiving, sb->id);
      sb->receiving = 0;
    }
    sub_finish(sb);
  }
}

/* A data message (inside UCX's progress): copy it into place, count it. */
void gpd_pr_on_data(void *arg, const void *header, size_t hlen, const void *data, size_t len) {
  gpd_peers *P = arg;
  const uint8_t *h = header;
  uint64_t id = 0, off = 0;
  uint32_t seg = 0;
  sub *sb;
  if (hlen != DATA_HDR)
    return;
  for (int i = 0; i < 8; i++)
    id |= (uint64_t)h[i] << (8 * i);
  for (int i = 0; i < 4; i++)
    seg |= (uint32_t)h[8 + i] << (8 * i);
  for (int i = 0; i < 8; i++)
    off |= (uint64_t)h[12 + i] << (8 * i);
  sb = gpupool__hmap_get(&P->receiving, id);
  if (!sb || sb->complete || seg >= sb->n)
    return;
  if (sb->st) {
    /* Into the staging ring; copied to device memory from the loop. Data outside the window
     * this daemon gave fails the fetch (from the loop). */
    const Gpupool__Wire__PeerSegment *sg = sb->rep->get_reply->segments[seg];
    if (sb->bad_data)
      return;
    if (sb->stage_wait || off > sg->length || len > sg->length - off ||
        gpd_pr_stager_recv(sb->st, sb->st->starts[seg] + off, data, len) != 0) {
      sb->bad_data = 1;
      gpd_pr_stage_kick(P);
    }
    return;
  }
  {
    const Gpupool__Wire__PeerSegment *sg = sb->rep->get_reply->segments[seg];
    if (off > sg->length || len > sg->length - off || len > sb->bytes - sb->received)
      return; /* not a range of the fetch: dropped (the fetch then times out) */
    memcpy(sb->bases[seg] + off, data, len);
  }
  sb->received += len;
  if (sb->pf)
    gpd_pr_prefault_received(sb->pf, sb->received);
  if (sb->received == sb->bytes) {
    sb->complete = 1;
    if (!P->finish_posted && gpd_ucx_defer(P->ucx, on_received, P) == 0)
      P->finish_posted = 1;
  }
}

/* The first pool the local copy may go in: not shared with a group. */
static gpd_pool *copy_pool(gpd_peers *P) {
  for (int i = 0; i < P->reg->npools; i++)
    if (P->cfg->pool_share[i] < 0)
      return &P->reg->pools[i];
  return NULL;
}

/* Device memory (the pool is the same for every buffer of the copy): staged through host
 * slots, a stager for sb's buffers. */
static int stage_fetch(sub *sb, const Gpupool__Wire__PeerGetReply *r) {
  gpd_peers *P = sb->P;
  uint64_t *lens = calloc(sb->n, sizeof *lens);
  gpd_buffer **bufs = calloc(sb->n, sizeof *bufs);
  int rc;
  if (!P->stage_bp) {
    rc = gpupool__err(GPUPOOL_ENOTSUP, "the local copy goes to device memory, which this daemon does not move "
                      "from peers: %s", P->device_memory);
  } else if (!lens || !bufs) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  } else {
    for (uint32_t i = 0; i < sb->n; i++) {
      lens[i] = r->segments[i]->length;
      bufs[i] = sb->holds[i]->buf;
    }
    rc = (sb->st = gpd_pr_stager_new(P, 1, bufs, lens, sb->n)) ? 0 : GPUPOOL_ENOMEM;
  }
  free(lens);
  free(bufs);
  return rc;
}

/* The peer answered with a version: allocate the local copy and ask for the data. */
static void sub_transfer(sub *sb, Gpupool__Wire__PeerFrame *fr) {
  gpd_peers *P = sb->P;
  Gpupool__Wire__PeerGetReply *r = fr->get_reply;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerReady rd = GPUPOOL__WIRE__PEER_READY__INIT;
  gpd_pool *pool = copy_pool(P);
  uint64_t min_newer = UINT64_MAX;
  char msg[GPUPOOL__ERRMSG_MAX + 256];
  int rc, staged = 0;
  struct {
    uint8_t *maps[GPUPOOL_WIRE_MAX_FDS];
    uint64_t lens[GPUPOOL_WIRE_MAX_FDS], starts[GPUPOOL_WIRE_MAX_FDS];
    uint32_t n;
  } fresh;
  fresh.n = 0;

  sb->rep = fr;
  sb->state = S_TRANSFER;
  sb->started_ns = now_ns();
  if (!local_waiters(P->s, sb->key, &min_newer) && !serve_waiters(P, sb->key, &min_newer)) {
    gpd_pr_send_done(sb->link, sb->id);
    gpd_pr_sub_release(sb);
    gpd_pr_sub_free(sb);
    return;
  }
  if (!pool || r->n_segments == 0 || r->n_segments > GPUPOOL_WIRE_MAX_FDS) {
    rc = gpupool__err(GPUPOOL_EPROTO, "%s", !pool ? "this daemon has no pool that is not shared with a group"
                                                   : "the peer's answer has no or too many buffers");
    goto fail;
  }
  sb->cl.uid = sb->uid;
  sb->cl.gid = sb->gid;
  gpd_client_init(P->reg, &sb->cl);
  snprintf(sb->cl.name, sizeof sb->cl.name, "fetch from %s", sb->peer->conf->name);
  sb->cl_on = 1;
  if (!(sb->holds = calloc(r->n_segments, sizeof *sb->holds)) || !(sb->bases = calloc(r->n_segments, sizeof *sb->bases))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  sb->bytes = 0;
  sb->received = 0;
  for (uint32_t i = 0; i < r->n_segments; i++) {
    const Gpupool__Wire__PeerSegment *sg = r->segments[i];
    gpd_hold *h = NULL;
    uint8_t *base;
    if (!sg->length) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the peer's answer has an empty buffer");
      goto fail;
    }
    if ((rc = gpd_allocate_as(P->reg, &sb->cl, pool, sg->length, 0, GPD_PLACE_FETCHED, &h)) != 0)
      goto fail;
    sb->holds[i] = h;
    sb->n = i + 1;
    sb->bytes += sg->length;
    if (gpd_pr_stage_needed(P, h->buf)) {
      staged = 1;
      continue;
    }
    /* The slab's mapping in the daemon stays for the slab's life: the next version fetched
     * into a kept slab finds its pages mapped already (no fault per page). One mapped here for
     * the first time is memory new to the pool: its pages are made ready while the data
     * comes (gpd_pr_prefault_start). */
    int new_map = !h->buf->slab->daemon_map;
    if ((rc = gpd_slab_daemon_map(h->buf->slab, &base)) != 0)
      goto fail;
    sb->bases[i] = base + h->buf->offset;
    if (new_map && fresh.n < GPUPOOL_WIRE_MAX_FDS) {
      fresh.maps[fresh.n] = sb->bases[i];
      fresh.lens[fresh.n] = sg->length;
      fresh.starts[fresh.n++] = sb->bytes - sg->length;
    }
  }
  if (staged && (rc = stage_fetch(sb, r)) != 0)
    goto fail;
  if (gpupool__hmap_put(&P->receiving, sb->id, sb) != 0) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  sb->receiving = 1;
  if (!sb->st && fresh.n)
    sb->pf = gpd_pr_prefault_start(fresh.maps, fresh.lens, fresh.starts, fresh.n);
  if (sb->st) {
    sb->peer->bytes_staged += sb->bytes;
    sb->stage_wait = 1; /* PeerReady goes once slots are taken (gpd_pr_sub_stage_step) */
    gpd_pr_sub_stage_step(sb);
    return;
  }
  rd.id = sb->id;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_READY;
  f.ready = &rd;
  gpd_pr_send_frame(sb->link, &f);
  return;
fail:
  snprintf(msg, sizeof msg, "fetch of %s:%s v%" PRIu64 " (%" PRIu64 " bytes) failed: %s", sb->peer->conf->name,
           sb->rname, r->version, sb->bytes, gpupool__errmsg());
  gpd_pr_send_done(sb->link, sb->id);
  gpd_pr_sub_failed(sb, rc, msg);
}

static void send_ready(sub *sb, uint64_t window) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerReady rd = GPUPOOL__WIRE__PEER_READY__INIT;
  rd.id = sb->id;
  rd.window = window;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_READY;
  f.ready = &rd;
  gpd_pr_send_frame(sb->link, &f);
}

/* A staged fetch: take its slots (then PeerReady, with the window they give), copy what
 * arrived into device memory, acknowledge what is there (PeerCredit), finish once all is. */
int gpd_pr_sub_stage_step(sub *sb) {
  gpd_peers *P = sb->P;
  stager *st = sb->st;
  char msg[GPUPOOL__ERRMSG_MAX + 512];
  uint64_t before;
  if (sb->state != S_TRANSFER || !st || sb->complete || !sb->link || sb->link->closing)
    return 0;
  if (sb->bad_data) {
    snprintf(msg, sizeof msg, "fetch of %s:%s failed: the peer sent data outside the window this daemon gave "
             "(PeerReady.window; a peer daemon that does not follow the protocol: run the same gpupool version "
             "on both)", sb->peer->conf->name, sb->rname);
    gpd_pr_send_done(sb->link, sb->id);
    gpd_pr_sub_failed(sb, GPUPOOL_EPROTO, msg);
    return 1;
  }
  if (sb->stage_wait) {
    if (!gpd_pr_stager_take(st)) {
      if (!st->failed)
        return 0; /* every slot is busy: the tick's transfer timeout bounds the wait */
    } else {
      sb->stage_wait = 0;
      send_ready(sb, st->nring * STAGE_SLOT);
      return 0;
    }
  }
  before = st->drained;
  gpd_pr_stager_fetch_poll(st);
  if (st->failed) {
    snprintf(msg, sizeof msg, "fetch of %s:%s (%" PRIu64 " bytes) failed: %s", sb->peer->conf->name, sb->rname,
             sb->bytes, st->why);
    gpd_pr_send_done(sb->link, sb->id);
    gpd_pr_sub_failed(sb, GPUPOOL_EBACKEND, msg);
    return 1;
  }
  if (st->drained == before)
    return 0;
  if (st->drained == st->total) {
    sb->complete = 1;
    if (!P->finish_posted && gpd_ucx_defer(P->ucx, on_received, P) == 0)
      P->finish_posted = 1;
  } else {
    Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
    Gpupool__Wire__PeerCredit c = GPUPOOL__WIRE__PEER_CREDIT__INIT;
    c.id = sb->id;
    c.bytes = st->drained;
    f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_CREDIT;
    f.credit = &c;
    gpd_pr_send_frame(sb->link, &f);
  }
  return 0;
}

void gpd_pr_on_peer_failed(plink *l, const Gpupool__Wire__PeerFailed *m) {
  sub *sb = gpupool__hmap_get(&l->P->receiving, m->id);
  char msg[GPUPOOL__ERRMSG_MAX + 256];
  /* Only a fetch of this link, and only while its data comes (ids are secret to the pair). */
  if (!sb || sb->link != l || sb->complete)
    return;
  snprintf(msg, sizeof msg, "fetch of %s:%s v%" PRIu64 " failed: peer %s: %s; retry", l->peer->conf->name, sb->rname,
           sb->rep ? sb->rep->get_reply->version : 0, l->peer->conf->name,
           m->error && m->error->message ? m->error->message : "no reason given");
  gpd_pr_sub_failed(sb, GPUPOOL_EPEER, msg);
}

void gpd_pr_on_get_reply(plink *l, Gpupool__Wire__PeerFrame *fr) {
  Gpupool__Wire__PeerGetReply *r = fr->get_reply;
  sub *sb = gpupool__hmap_del(&l->asked, r->id);
  char msg[GPUPOOL__ERRMSG_MAX + 256];
  if (!sb) {
    if (!r->error)
      gpd_pr_send_done(l, r->id);
    gpupool__wire__peer_frame__free_unpacked(fr, NULL);
    return;
  }
  if (r->error) {
    int code = r->error->code < 0 && r->error->code > GPUPOOL_ERRNO_MIN ? r->error->code : GPUPOOL_EPEER;
    snprintf(msg, sizeof msg, "peer %s: %s", l->peer->conf->name, r->error->message ? r->error->message : "");
    gpupool__wire__peer_frame__free_unpacked(fr, NULL);
    sb->peer->in_flight--;
    sb->state = S_IDLE;
    if (code == GPUPOOL_ENOENT) {
      /* Nothing newer there yet: the gets that would not wait are answered; the others wait on. */
      gpd_pr_sub_fail_waiters(sb, code, msg, 1);
      sub_next(sb);
    } else {
      sb->peer->in_flight++;
      sb->state = S_ASKED;
      gpd_pr_sub_failed(sb, code, msg);
    }
    return;
  }
  if (r->version <= sb->asked_newer) {
    /* A peer that answers with a version not newer than asked would make this daemon publish
     * older bytes over newer ones, and fetch again and again. */
    snprintf(msg, sizeof msg, "peer %s answered '%s' with version %" PRIu64 ", not newer than the %" PRIu64
             " asked for (a peer daemon that does not follow the protocol; check its version)",
             l->peer->conf->name, sb->rname, r->version, sb->asked_newer);
    gpd_pr_send_done(l, r->id);
    gpupool__wire__peer_frame__free_unpacked(fr, NULL);
    gpd_pr_sub_failed(sb, GPUPOOL_EPROTO, msg);
    return;
  }
  sub_transfer(sb, fr);
}

static int tenant_name(gpd_peers *P, const gpd_client *c, char *buf, size_t len) {
  struct passwd pw, *res = NULL;
  char tmp[1024];
  if (c->tenant & TENANT_SET) {
    snprintf(buf, len, "%s", P->cfg->tenants[c->tenant & 0xffff].name);
    return 0;
  }
  if (getpwuid_r(c->uid, &pw, tmp, sizeof tmp, &res) == 0 && res) {
    snprintf(buf, len, "%s", res->pw_name);
    return 0;
  }
  snprintf(buf, len, "%u", (unsigned)c->uid);
  return 0;
}

/* Make sure a fetch runs for the local name filed under key. */
int gpd_pr_want_key(gpd_peers *P, const char *local_name, const char *key, uid_t uid, gid_t gid,
                    const char *tenant_name_, uint32_t wait_ms) {
  const char *rest = NULL, *slash;
  peer *p = route(P, local_name, &rest);
  sub *sb = gpupool__smap_get(&P->subs_by_key, key);
  uint64_t deadline = now_ns() + (uint64_t)wait_ms * 1000000ull;
  if (!p)
    return gpupool__err(GPUPOOL_ENOENT, "'%s' names no peer", local_name);
  if (sb) {
    if (deadline > sb->deadline_ns)
      sb->deadline_ns = deadline;
    if (sb->state == S_IDLE)
      sub_next(sb);
    return 0;
  }
  if (!(sb = calloc(1, sizeof *sb)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  sb->P = P;
  sb->peer = p;
  sb->uid = uid;
  sb->gid = gid;
  sb->deadline_ns = deadline;
  sb->key = strdup(key);
  sb->local_name = strdup(local_name);
  if (!strncmp(rest, "group:", 6) && (slash = strchr(rest, '/'))) {
    sb->rtenant = strndup(rest, (size_t)(slash - rest));
    sb->rname = strdup(slash + 1);
  } else if ((slash = strchr(rest, '/'))) {
    sb->rtenant = strndup(rest, (size_t)(slash - rest));
    sb->rname = strdup(slash + 1);
  } else {
    sb->rtenant = strdup(tenant_name_);
    sb->rname = strdup(rest);
  }
  if (!sb->key || !sb->local_name || !sb->rtenant || !sb->rname || gpupool__smap_put(&P->subs_by_key, key, sb) != 0) {
    free(sb->key);
    free(sb->local_name);
    free(sb->rtenant);
    free(sb->rname);
    free(sb);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  sb->next = P->subs;
  if (P->subs)
    P->subs->prev = sb;
  P->subs = sb;
  sub_next(sb);
  return 0;
}

int gpd_peers_want(gpd_server *s, gpd_conn *c, const gpd_rname *rn, uint64_t newer_than, uint32_t wait_ms) {
  gpd_peers *P = s->peers;
  char tn[64];
  int rc;
  (void)newer_than;
  if (!P)
    return gpupool__err(GPUPOOL_ENOENT, "no peers");
  if ((rc = gpd_rname_ok(rn)) != 0)
    return rc;
  tenant_name(P, &c->cl, tn, sizeof tn);
  return gpd_pr_want_key(P, rn->name, rn->key, c->cl.uid, c->cl.gid, tn, wait_ms);
}
