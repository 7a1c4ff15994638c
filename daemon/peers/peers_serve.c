/*
 * Peers' serving side (see peers.c): a peer's PeerGet is looked up in the tenant or group it
 * names (which must export to that peer), waits for a publish when no newer version is
 * there, and the version's buffers are held, mapped, registered with UCX and sent as active
 * messages (a window of them in flight) until PeerDone or the connection's end.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "peers_internal.h"

/* ---- mapping a buffer's range of a host slab -------------------------------------------- */

/* Map and register [off, off + len) of fd: *base is where the range starts. */
static int map_range(gpd_peers *P, int fd, uint64_t off, uint64_t len, int writable, void **map, size_t *maplen,
                     void **base, gpd_ucx_reg **reg) {
  long page = sysconf(_SC_PAGESIZE);
  uint64_t start = off - off % (uint64_t)page;
  size_t ml = (size_t)(off + len - start);
  void *m;
  int rc;
  if (fd < 0) /* such memory is staged (gpd_pr_stage_needed): never here */
    return gpupool__err(GPUPOOL_EINVAL, "a slab without an fd cannot be mapped for a peer transfer");
  m = mmap(NULL, ml, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, (off_t)start);
  if (m == MAP_FAILED)
    return gpupool__err(GPUPOOL_EBACKEND, "cannot map %zu bytes of a slab for a peer transfer: %s", ml,
                        strerror(errno));
  if ((rc = gpd_ucx_reg_new(P->ucx, m, ml, reg)) != 0) {
    munmap(m, ml);
    return rc;
  }
  *map = m;
  *maplen = ml;
  *base = (uint8_t *)m + (off - start);
  return 0;
}

/* ---- serving --------------------------------------------------------------------------------- */

/* A served range the peer may still be reading when its connection ended (the serving
 * side's UCX sends the data of a get from it on its own time): its mapping is replaced by
 * zero pages at once, so the slab's memory can go back to the pool and nothing of it leaves
 * any more, and the placeholder and its registration are let go only later. */
typedef struct grave {
  void *map;
  size_t len;
  gpd_ucx_reg *reg;
  uint64_t until_ns;
  struct grave *next;
} grave;

void gpd_pr_graves_free(gpd_peers *P, uint64_t now, int all) {
  grave **g = &P->graves;
  while (*g) {
    grave *x = *g;
    if (!all && now < x->until_ns) {
      g = &x->next;
      continue;
    }
    *g = x->next;
    gpd_ucx_reg_free(x->reg);
    munmap(x->map, x->len);
    free(x);
  }
}

/* Let go of the served ranges; reading: UCX may still be sending from them. */
static void serve_release(serve *sv, int reading) {
  gpd_peers *P = sv->link->P;
  /* Its copies end before its holds go (an engine may be reading the buffers). */
  gpd_pr_stager_free(sv->st);
  sv->st = NULL;
  if (sv->push) {
    reading |= sv->push->inflight > 0;
    sv->push->sv = NULL;
    if (!sv->push->inflight)
      free(sv->push);
    sv->push = NULL;
  }
  for (uint32_t i = 0; i < sv->n; i++) {
    grave *g = reading && sv->maps[i] ? calloc(1, sizeof *g) : NULL;
    if (g && mmap(sv->maps[i], sv->maplens[i], PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                  0) != MAP_FAILED) {
      uint64_t hold = 2ull * P->cfg->peer_fetch_timeout_ms * 1000000ull;
      g->map = sv->maps[i];
      g->len = sv->maplens[i];
      g->reg = sv->regs[i];
      g->until_ns = now_ns() + (hold > 10000000000ull ? hold : 10000000000ull);
      g->next = P->graves;
      P->graves = g;
      continue;
    }
    free(g);
    gpd_ucx_reg_free(sv->regs[i]);
    if (sv->maps[i])
      munmap(sv->maps[i], sv->maplens[i]);
  }
  free(sv->regs);
  free(sv->maps);
  free(sv->maplens);
  free(sv->lens);
  free(sv->bases);
  sv->regs = NULL, sv->maps = NULL, sv->maplens = NULL, sv->lens = NULL, sv->bases = NULL, sv->n = 0;
  if (sv->cl_on) {
    gpd_client_drop(P->reg, &sv->cl);
    sv->cl_on = 0;
    if (sv->link->peer)
      sv->link->peer->serving_now--;
  }
}

void gpd_pr_serve_free_reading(serve *sv, int reading) {
  plink *l = sv->link;
  serve_release(sv, reading);
  GPUPOOL__LIST_UNLINK(l->serves, sv, prev, next);
  l->nserves--;
  free(sv->key);
  free(sv);
}

void gpd_pr_serve_free(serve *sv) { gpd_pr_serve_free_reading(sv, 0); }

/* What the reply says of version n besides its buffers: its member table (a bundle; the
 * arrays are the caller's to free) or its tensor description. */
static int describe_version(const gpd_name *n, Gpupool__Wire__PeerGetReply *r, Gpupool__Wire__TensorMeta *tensor,
                            Gpupool__Wire__BundleMember **mem, Gpupool__Wire__BundleMember ***memp,
                            Gpupool__Wire__TensorMeta **metas) {
  if (n->layout) {
    uint32_t nm = n->layout->n;
    if (!(*mem = calloc(nm, sizeof **mem)) || !(*memp = calloc(nm, sizeof **memp)) ||
        !(*metas = calloc(nm, sizeof **metas)))
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    for (uint32_t i = 0; i < nm; i++) {
      const gpd_member *m = &n->layout->members[i];
      Gpupool__Wire__BundleMember *w = &(*mem)[i];
      gpupool__wire__bundle_member__init(w);
      w->name = m->name;
      w->buffer = m->buffer;
      w->offset = m->offset;
      w->size = m->size;
      if (m->meta) {
        gpupool__wire_meta_to(m->meta, &(*metas)[i]);
        w->tensor = &(*metas)[i];
      }
      (*memp)[i] = w;
    }
    r->n_members = nm;
    r->members = *memp;
    r->bundle = 1;
  } else if (n->has_meta) {
    gpupool__wire_meta_to(&n->meta, tensor);
    r->tensor = tensor;
  }
  return 0;
}

static void serve_send(serve *sv, gpd_name *n) {
  plink *l = sv->link;
  gpd_peers *P = l->P;
  gpd_registry *reg = P->reg;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerGetReply r = GPUPOOL__WIRE__PEER_GET_REPLY__INIT;
  Gpupool__Wire__PeerSegment *segs = NULL, **segp = NULL;
  Gpupool__Wire__BundleMember *mem = NULL, **memp = NULL;
  Gpupool__Wire__TensorMeta *metas = NULL, tensor;
  uint64_t bytes = 0;
  int rc = 0, staged = 0;

  sv->waiting = 0;
  sv->cl.uid = 0;
  sv->cl.gid = 0;
  gpd_client_init(reg, &sv->cl);
  sv->cl.tenant = n->tenant;
  snprintf(sv->cl.name, sizeof sv->cl.name, "peer %s", l->peer->conf->name);
  sv->cl_on = 1;
  l->peer->serving_now++;
  if (!(sv->regs = calloc(n->nbufs, sizeof *sv->regs)) || !(sv->maps = calloc(n->nbufs, sizeof *sv->maps)) ||
      !(sv->maplens = calloc(n->nbufs, sizeof *sv->maplens)) || !(sv->lens = calloc(n->nbufs, sizeof *sv->lens)) ||
      !(sv->bases = calloc(n->nbufs, sizeof *sv->bases)) || !(segs = calloc(n->nbufs, sizeof *segs)) ||
      !(segp = calloc(n->nbufs, sizeof *segp))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  for (uint32_t i = 0; i < n->nbufs; i++)
    staged |= gpd_pr_stage_needed(P, n->bufs[i]);
  if (staged && !P->stage_bp) {
    rc = gpupool__err(GPUPOOL_ENOTSUP, "this version lies in device memory, which this daemon does not move to "
                      "peers: %s", P->device_memory);
    goto fail;
  }
  for (uint32_t i = 0; i < n->nbufs; i++) {
    gpd_buffer *b = n->bufs[i];
    gpd_hold *h = NULL;
    if ((rc = gpd_hold_new(reg, &sv->cl, b, 1, 0, &h)) != 0)
      goto fail;
    sv->n = i + 1;
    if (!staged && (rc = map_range(P, b->slab->bs.fd, b->offset, b->asked, 0, &sv->maps[i], &sv->maplens[i],
                                   &sv->bases[i], &sv->regs[i])) != 0)
      goto fail;
    sv->lens[i] = b->asked;
    gpupool__wire__peer_segment__init(&segs[i]);
    segs[i].length = b->asked;
    segp[i] = &segs[i];
    bytes += b->asked;
  }
  /* Device memory: copied out through the staging ring, starting now (before PeerReady). */
  if (staged) {
    if (!(sv->st = gpd_pr_stager_new(P, 0, n->bufs, sv->lens, n->nbufs))) {
      rc = GPUPOOL_ENOMEM;
      goto fail;
    }
    l->peer->bytes_staged += bytes;
    gpd_pr_stager_serve_poll(sv->st, 0);
  }
  if ((rc = describe_version(n, &r, &tensor, &mem, &memp, &metas)) != 0)
    goto fail;
  r.id = sv->id;
  r.version = n->version;
  r.n_segments = n->nbufs;
  r.segments = segp;
  r.asked = n->nbufs ? n->bufs[0]->asked : 0;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_GET_REPLY;
  f.get_reply = &r;
  l->peer->versions_served++;
  l->peer->bytes_served += bytes;
  GPUPOOL__DEBUG("peers: serving %s v%" PRIu64 " (%" PRIu64 " bytes) to %s", sv->key, n->version, bytes,
                 l->peer->conf->name);
  gpd_pr_send_frame(l, &f);
  goto out;
fail:
  {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    gpd_pr_send_get_error(l, sv->id, rc, msg);
    gpd_pr_serve_free(sv);
  }
out:
  free(segs);
  free(segp);
  free(mem);
  free(memp);
  free(metas);
}


static void on_chunk_sent(void *arg, int status);

/* One data message in flight: its serve's sends, and the staging slot it reads (or NULL). */
typedef struct {
  gpd_peers *P;
  struct push *push;
  stage_slot *slot;
} sendrec;

/* Send sv's data until SEND_WINDOW messages are in flight, all of it is on its way, the
 * fetching side's credit runs out or (staged) the next bytes are not in a slot yet. */
static void post_sends(serve *sv) {
  plink *l = sv->link;
  while (sv->push->inflight < SEND_WINDOW && sv->cur_seg < sv->n && sv->sent < sv->limit) {
    uint64_t len = sv->lens[sv->cur_seg] - sv->cur_off < SEND_CHUNK ? sv->lens[sv->cur_seg] - sv->cur_off : SEND_CHUNK;
    const uint8_t *data;
    stage_slot *slot = NULL;
    gpd_ucx_reg *reg = NULL;
    uint8_t hdr[DATA_HDR];
    sendrec *rec;
    int rc;
    if (len > sv->limit - sv->sent)
      len = sv->limit - sv->sent;
    if (sv->st) {
      if (!gpd_pr_stager_next(sv->st, sv->sent, len, &data, &slot, &len))
        return; /* copied out of device memory soon */
    } else {
      data = (const uint8_t *)sv->bases[sv->cur_seg] + sv->cur_off;
      reg = sv->regs[sv->cur_seg];
    }
    for (int i = 0; i < 8; i++)
      hdr[i] = (uint8_t)(sv->id >> (8 * i));
    for (int i = 0; i < 4; i++)
      hdr[8 + i] = (uint8_t)(sv->cur_seg >> (8 * i));
    for (int i = 0; i < 8; i++)
      hdr[12 + i] = (uint8_t)(sv->cur_off >> (8 * i));
    if ((rec = malloc(sizeof *rec))) {
      *rec = (sendrec){.P = l->P, .push = sv->push, .slot = slot};
      rc = gpd_ucx_send(l->ep, hdr, sizeof hdr, data, len, reg, on_chunk_sent, rec);
    } else {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
    if (rc != 0) {
      char why[GPUPOOL__ERRMSG_MAX];
      free(rec);
      if (slot)
        gpd_pr_stage_sent(l->P, slot);
      snprintf(why, sizeof why, "sending it data failed: %s", gpupool__errmsg());
      gpd_pr_link_close(l, why);
      return;
    }
    sv->push->inflight++;
    sv->cur_off += len;
    sv->sent += len;
    if (sv->cur_off == sv->lens[sv->cur_seg]) {
      sv->cur_seg++;
      sv->cur_off = 0;
    }
  }
}

int gpd_pr_serve_stage_step(serve *sv) {
  plink *l = sv->link;
  gpd_pr_stager_serve_poll(sv->st, sv->sent);
  if (sv->st->failed) {
    /* This fetch alone fails: the peer is told why, and the link's other fetches go on. */
    Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
    Gpupool__Wire__PeerFailed pf = GPUPOOL__WIRE__PEER_FAILED__INIT;
    Gpupool__Wire__Error e = GPUPOOL__WIRE__ERROR__INIT;
    char why[400];
    snprintf(why, sizeof why, "it could not read its version: %s", sv->st->why);
    GPUPOOL__WARN("peers: serving %s to %s: %s; that fetch fails, the connection stays", sv->key,
                  l->peer ? l->peer->conf->name : "a peer", sv->st->why);
    e.code = GPUPOOL_EBACKEND;
    e.message = why;
    pf.id = sv->id;
    pf.error = &e;
    f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_FAILED;
    f.failed = &pf;
    gpd_pr_send_frame(l, &f);
    gpd_pr_serve_free_reading(sv, 1);
    return 1;
  }
  if (sv->push && !l->closing)
    post_sends(sv);
  if (l->closing)
    return 1;
  if (sv->sent == sv->st->total && !sv->st->nring) {
    /* Every byte sent and every slot back: the serve only waits for PeerDone now. */
    gpd_pr_stager_free(sv->st);
    sv->st = NULL;
  }
  return 0;
}

static void on_chunk_sent(void *arg, int status) {
  sendrec *rec = arg;
  struct push *pu = rec->push;
  serve *sv = pu->sv;
  if (rec->slot)
    gpd_pr_stage_sent(rec->P, rec->slot);
  free(rec);
  pu->inflight--;
  if (!sv) {
    if (!pu->inflight)
      free(pu);
    return;
  }
  if (status != 0) {
    char why[GPUPOOL__ERRMSG_MAX];
    snprintf(why, sizeof why, "sending it data failed: %s", gpupool__errmsg());
    gpd_pr_link_close(sv->link, why);
    return;
  }
  if (sv->st)
    gpd_pr_serve_stage_step(sv);
  else
    post_sends(sv);
}

/* The fetching side has its copy allocated: send the data. */
void gpd_pr_on_peer_ready(plink *l, uint64_t id, uint64_t window) {
  for (serve *sv = l->serves; sv; sv = sv->next)
    if (sv->id == id && sv->cl_on && !sv->push) {
      if (!(sv->push = calloc(1, sizeof *sv->push))) {
        gpd_pr_link_close(l, "out of memory in the daemon");
        return;
      }
      sv->push->sv = sv;
      sv->window = window;
      sv->limit = window ? window : UINT64_MAX;
      if (sv->st)
        gpd_pr_serve_stage_step(sv);
      else
        post_sends(sv);
      return;
    }
}

/* The fetching side has the first `bytes` bytes in place: it takes window more. */
void gpd_pr_on_peer_credit(plink *l, uint64_t id, uint64_t bytes) {
  for (serve *sv = l->serves; sv; sv = sv->next)
    if (sv->id == id && sv->push && sv->window) {
      if (bytes <= UINT64_MAX - sv->window && bytes + sv->window > sv->limit)
        sv->limit = bytes + sv->window;
      if (sv->st)
        gpd_pr_serve_stage_step(sv);
      else
        post_sends(sv);
      return;
    }
}

/* Serve sv now if its name has a version newer than it asks for; otherwise leave it waiting
 * (or answer ENOENT once its wait is over). A name this daemon fetches from another peer is
 * fetched for it. */
static void serve_try(serve *sv) {
  gpd_peers *P = sv->link->P;
  gpd_name *n = gpupool__smap_get(&P->reg->names, sv->key);
  if (n && !n->file && n->nbufs && n->version > sv->newer_than) {
    serve_send(sv, n);
    return;
  }
  if (sv->waiting && now_ns() < sv->deadline_ns)
    return;
  if (!sv->waiting && now_ns() < sv->deadline_ns) {
    const char *slash = strchr(sv->key, '/');
    sv->waiting = 1;
    /* A tree: a remote name of this daemon's is fetched here for the peer asking. */
    if (slash && !strncmp(sv->key, "tenant:", 7) && gpd_pr_routed(P, slash + 1)) {
      const gpd_config *cfg = P->cfg;
      for (int t = 0; t < cfg->n_tenants; t++)
        if ((size_t)(slash - sv->key - 7) == strlen(cfg->tenants[t].name) &&
            !strncmp(sv->key + 7, cfg->tenants[t].name, (size_t)(slash - sv->key - 7))) {
          const gpd_member_set *m = &cfg->tenants[t];
          uid_t uid = m->n_uids ? m->uids[0] : 0;
          gid_t gid = m->n_uids ? 0 : (m->n_gids ? m->gids[0] : 0);
          uint64_t left = (sv->deadline_ns - now_ns()) / 1000000;
          if (gpd_pr_want_key(P, slash + 1, sv->key, uid, gid, m->name, (uint32_t)left) != 0) {
            char msg[GPUPOOL__ERRMSG_MAX];
            snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
            gpd_pr_send_get_error(sv->link, sv->id, GPUPOOL_EPEER, msg);
            gpd_pr_serve_free(sv);
          }
          return;
        }
    }
    return;
  }
  {
    char msg[GPUPOOL__ERRMSG_MAX];
    const char *slash = strchr(sv->key, '/');
    if (n && n->version <= sv->newer_than)
      snprintf(msg, sizeof msg, "'%s' is at version %" PRIu64 ", not newer than %" PRIu64, slash ? slash + 1 : sv->key,
               n->version, sv->newer_than);
    else
      snprintf(msg, sizeof msg, "no name '%s' here for you", slash ? slash + 1 : sv->key);
    gpd_pr_send_get_error(sv->link, sv->id, GPUPOOL_ENOENT, msg);
    gpd_pr_serve_free(sv);
  }
}

void gpd_pr_on_peer_get(plink *l, const Gpupool__Wire__PeerGet *m) {
  gpd_peers *P = l->P;
  const gpd_config *cfg = P->cfg;
  const gpd_member_set *set = NULL;
  const char *tenant = m->tenant ? m->tenant : "", *name = m->name ? m->name : "";
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  serve *sv;
  uint64_t wait = m->wait_ms < cfg->peer_fetch_timeout_ms ? m->wait_ms : cfg->peer_fetch_timeout_ms;

  if (l->nserves >= cfg->peer_max_fetches) {
    char msg[160];
    snprintf(msg, sizeof msg, "peer %s has %u fetches in flight here, the limit (peer_max_fetches); wait for them",
             l->peer->conf->name, l->nserves);
    gpd_pr_send_get_error(l, m->id, GPUPOOL_ELIMIT, msg);
    return;
  }
  if (gpupool__wire_check_name(name) != 0) {
    gpd_pr_send_get_error(l, m->id, GPUPOOL_ENAME, gpupool__errmsg());
    return;
  }
  if (!strncmp(tenant, "group:", 6)) {
    for (int g = 0; g < cfg->n_groups; g++)
      if (!strcmp(cfg->groups[g].name, tenant + 6))
        set = &cfg->groups[g];
    snprintf(key, sizeof key, "%s/%s", tenant, name);
  } else {
    for (int t = 0; t < cfg->n_tenants; t++)
      if (!strcmp(cfg->tenants[t].name, tenant))
        set = &cfg->tenants[t];
    snprintf(key, sizeof key, "tenant:%s/%s", tenant, name);
  }
  /* Absent and not exported read the same to the peer. */
  if (!set || !gpd_exports_to(set, l->peer->conf->name)) {
    char msg[GPUPOOL_NAME_MAX + 160];
    GPUPOOL__DEBUG("peers: %s asked for '%s' of '%s', which is not exported to it", l->peer->conf->name, name,
                   tenant);
    snprintf(msg, sizeof msg, "no name '%s' of tenant '%s' here for peer %s", name, tenant, l->peer->conf->name);
    gpd_pr_send_get_error(l, m->id, GPUPOOL_ENOENT, msg);
    return;
  }
  if (!(sv = calloc(1, sizeof *sv)) || !(sv->key = strdup(key))) {
    free(sv);
    gpd_pr_send_get_error(l, m->id, GPUPOOL_ENOMEM, "out of memory in the daemon");
    return;
  }
  sv->link = l;
  sv->id = m->id;
  sv->newer_than = m->newer_than;
  sv->deadline_ns = now_ns() + wait * 1000000ull + (wait ? 0 : 1);
  sv->next = l->serves;
  if (l->serves)
    l->serves->prev = sv;
  l->serves = sv;
  l->nserves++;
  serve_try(sv);
}

void gpd_pr_on_peer_done(plink *l, uint64_t id) {
  for (serve *sv = l->serves; sv; sv = sv->next)
    if (sv->id == id) {
      gpd_pr_serve_free(sv);
      return;
    }
}

/* Try again the waiting serves of key (NULL: every waiting serve) past version (0: any) whose
 * deadline passed or whose name moved on. Answering one may end others (a failed fetch answers
 * every serve of its name), so the matches are taken by id first and looked up again each
 * time; connections are freed only from their close callbacks, never inside this loop. */
void gpd_pr_serves_retry(gpd_peers *P, const char *key, uint64_t version, uint64_t now) {
  struct {
    plink *l;
    uint64_t id;
  } *hit = NULL;
  size_t n = 0, cap = 0;
  for (plink *l = P->links; l; l = l->next)
    for (serve *sv = l->serves; sv; sv = sv->next) {
      if (!sv->waiting)
        continue;
      if (key ? (sv->newer_than >= version || strcmp(sv->key, key)) : now < sv->deadline_ns)
        continue;
      if (n == cap) {
        size_t ncap = cap ? cap * 2 : 16;
        void *nh = realloc(hit, ncap * sizeof *hit);
        if (!nh)
          break;
        hit = nh;
        cap = ncap;
      }
      hit[n].l = l;
      hit[n++].id = sv->id;
    }
  for (size_t i = 0; i < n; i++) {
    if (hit[i].l->closing)
      continue;
    for (serve *sv = hit[i].l->serves; sv; sv = sv->next)
      if (sv->id == hit[i].id) {
        if (sv->waiting)
          serve_try(sv);
        break;
      }
  }
  free(hit);
}

void gpd_peers_published(gpd_server *s, const char *key, uint64_t version) {
  if (s->peers)
    gpd_pr_serves_retry(s->peers, key, version, 0);
}
