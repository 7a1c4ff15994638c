/*
 * Daemon-wide requests: Hello (the handshake and the lease), Stats (also the metrics' stats
 * source), Trim, and the operators' requests (list clients, buffers and names, drop a client,
 * remove a name).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "peers.h"
#include "server_internal.h"
#include "state.h"

uint64_t gpd_count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  uint64_t n = 0;
  if (!d)
    return 0;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n > 0 ? n - 1 : 0; /* not counting the directory's own fd */
}

/* ---- stats ---------------------------------------------------------------------------------- */

/* Frees what gpd_server_stats allocated in *st (not st itself). */
void gpd_stats_free(Gpupool__Wire__StatsReply *st) {
  if (st->metrics_exporters != protobuf_c_empty_string)
    free(st->metrics_exporters);
  st->metrics_exporters = (char *)protobuf_c_empty_string;
  if (st->survival != protobuf_c_empty_string)
    free(st->survival);
  st->survival = (char *)protobuf_c_empty_string;
  for (size_t i = 0; i < st->n_pools; i++)
    free(st->pools[i]);
  free(st->pools);
  st->pools = NULL;
  st->n_pools = 0;
}

/* Current statistics (the Stats reply's content); free with gpd_stats_free. Also the metrics'
 * stats source (the server hands itself in when it starts them). */
int gpd_server_stats(void *server, Gpupool__Wire__StatsReply *st) {
  gpd_server *s = server;
  gpd_registry *reg = s->reg;
  gpupool__wire__stats_reply__init(st);
  st->pools = calloc((size_t)reg->npools, sizeof *st->pools);
  if (!st->pools && reg->npools)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < reg->npools; i++) {
    st->pools[i] = malloc(sizeof *st->pools[i]);
    if (!st->pools[i]) {
      gpd_stats_free(st);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    }
    st->n_pools++;
    gpd_fill_pool_info(reg, &reg->pools[i], st->pools[i]);
  }
  st->clients = s->nconns;
  st->buffers = reg->buffers.len;
  st->holds = reg->holds.len + reg->keeps.len; /* kept shares are the daemon's own holds */
  st->names = reg->nnames;
  st->uptime_s = (gpd_now_ns() - s->started_ns) / 1000000000ull;
  st->daemon_version = (char *)GPUPOOL_VERSION_STRING;
  st->daemon_pid = (int32_t)getpid();
  st->daemon_uid = (uint32_t)geteuid();
  st->backend = reg->be->desc->kind;
  st->requests = s->requests;
  st->errors = s->errors;
  st->open_fds = gpd_count_open_fds();
  st->pending_frees = reg->npending;
  st->waiting_leases = reg->nwaiting;
  st->waiting_gets_tried = s->gets_tried;
  st->waiting_gets_answered = s->gets_answered;
  st->opens_waited = s->opens_waited;
  st->opens_waiting = s->opens_waiting;
  st->bytes_read = s->bytes_read;
  st->replica_copies = reg->copies_started;
  st->replica_bytes = reg->copy_bytes;
  st->replica_copies_running = reg->ncopies;
  st->replica_copies_failed = reg->copies_failed;
  st->restart_pending = s->restart_pending;
  {
    char surv[512];
    gpd_state_describe(reg, surv, sizeof surv);
    if (!(st->survival = strdup(surv))) {
      st->survival = (char *)protobuf_c_empty_string;
      gpd_stats_free(st);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    }
  }
  if (s->metrics) {
    char health[3 * GPUPOOL__ERRMSG_MAX + 64];
    gpd_metrics_health(s->metrics, health, sizeof health);
    if (health[0] && !(st->metrics_exporters = strdup(health))) {
      gpd_stats_free(st);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    }
  }
  return 0;
}

/* ---- request handlers ----------------------------------------------------------------------- */

int gpd_handle_hello(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Hello *m = req->hello;
  gpd_server *s = c->srv;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__HelloReply hr = GPUPOOL__WIRE__HELLO_REPLY__INIT;
  Gpupool__Wire__PoolInfo *pis, **pptr;

  if (c->hello_done)
    return gpupool__err(GPUPOOL_EPROTO, "second Hello on one connection");
  if (m->protocol_version != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION) {
    gpd_conn_drop_after_flush(c);
    return gpupool__err(GPUPOOL_EVERSION,
                        "client speaks protocol version %u, this gpupoold (%s) speaks %d; "
                        "use a libgpupool-client of the same major version as the daemon",
                        m->protocol_version, GPUPOOL_VERSION_STRING, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  }
  c->hello_done = 1;
  uv_timer_stop(&c->hs_timer);
  snprintf(c->cl.name, sizeof c->cl.name, "%s", m->client_name && *m->client_name ? m->client_name : "-");
  for (char *p = c->cl.name; *p; p++)
    if ((unsigned char)*p < 0x20)
      *p = '?';
  /* Every connect at debug level; at info, within the limits of what clients may log. */
  if (gpupool__log_get_level() >= GPUPOOL_LOG_DEBUG)
    GPUPOOL__DEBUG("client %" PRIu64 " connected: pid %d uid %u gid %u name '%s'", c->cl.id, (int)c->cl.pid,
                   (unsigned)c->cl.uid, (unsigned)c->cl.gid, c->cl.name);
  else
    GPUPOOL__PEER_INFO(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " connected: pid %d uid %u gid %u name '%s'",
                       c->cl.id, (int)c->cl.pid, (unsigned)c->cl.uid, (unsigned)c->cl.gid, c->cl.name);
  pis = calloc((size_t)s->reg->npools, sizeof *pis);
  pptr = calloc((size_t)s->reg->npools, sizeof *pptr);
  if (!pis || !pptr) {
    free(pis);
    free(pptr);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (int i = 0; i < s->reg->npools; i++) {
    gpd_fill_pool_info(s->reg, &s->reg->pools[i], &pis[i]);
    pptr[i] = &pis[i];
  }
  hr.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  hr.daemon_version = (char *)GPUPOOL_VERSION_STRING;
  hr.daemon_pid = (int32_t)getpid();
  hr.daemon_uid = (uint32_t)geteuid();
  hr.host_fences = 1;
  hr.max_release_batch = s->cfg->max_share_batch;
  hr.backend = s->reg->be->desc->kind;
  hr.n_pools = (size_t)s->reg->npools;
  hr.pools = pptr;
  hr.client_id = c->cl.id;
  hr.max_frame = s->cfg->max_frame;
  hr.lease = 1;
  /* What survives a restart: the token that gives this connection's holds back to its next
   * one, and the holds its previous one had, given back when its token checks out. */
  uint8_t tok[GPD_STATE_RESUME_LEN];
  gpd_hold **rh = NULL;
  size_t nrh = 0;
  Gpupool__Wire__ResumedHold *rs = NULL, **rsp = NULL;
  hr.resume.len = gpd_state_resume_token(c->cl.lease, tok);
  hr.resume.data = tok;
  if (m->resume.len && gpd_state_resume(s->reg, &c->cl, m->resume.data, m->resume.len, &rh, &nrh) != 0)
    GPUPOOL__WARN("client %" PRIu64 ": not every hold of its previous connection could be given back: %s",
                  c->cl.id, gpupool__errmsg());
  if (nrh && (rs = calloc(nrh, sizeof *rs)) && (rsp = calloc(nrh, sizeof *rsp))) {
    for (size_t i = 0; i < nrh; i++) {
      gpupool__wire__resumed_hold__init(&rs[i]);
      rs[i].buffer_id = rh[i]->buf->id;
      rs[i].hold_id = rh[i]->id;
      rs[i].read_only = rh[i]->read_only != 0;
      rsp[i] = &rs[i];
    }
    hr.n_resumed = nrh;
    hr.resumed = rsp;
  } else if (nrh) {
    for (size_t i = 0; i < nrh; i++)
      gpd_hold_discard(s->reg, rh[i]);
  }
  free(rh);
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_HELLO;
  rep.hello = &hr;
  /* The lease travels with this frame; the daemon's copy of the client's end goes now (a
   * queued frame holds its own duplicate), so only the client's processes hold it. */
  gpd_send_reply(c, seq, &rep, &c->lease_peer, 1);
  close(c->lease_peer);
  c->lease_peer = -1;
  free(rs);
  free(rsp);
  free(pis);
  free(pptr);
  return 0;
}
int gpd_handle_stats(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  Gpupool__Wire__StatsReply st;
  int rc = gpd_server_stats(c->srv, &st);
  if (rc != 0)
    return rc;
  GPUPOOL__SEND_BODY(c, seq, STATS, stats, &st);
  gpd_stats_free(&st);
  return 0;
}

int gpd_handle_admin_clients(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  gpd_server *s = c->srv;
  Gpupool__Wire__AdminClientsReply ar = GPUPOOL__WIRE__ADMIN_CLIENTS_REPLY__INIT;
  Gpupool__Wire__ClientInfo *infos, **ptrs;
  uint64_t now = gpd_now_ns();
  size_t n = 0;
  infos = calloc(s->nconns + 1, sizeof *infos);
  ptrs = calloc(s->nconns + 1, sizeof *ptrs);
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (gpd_conn *o = s->conns; o && n < s->nconns + 1; o = o->next) {
    if (o->closing)
      continue;
    gpupool__wire__client_info__init(&infos[n]);
    infos[n].id = o->cl.id;
    infos[n].pid = o->cl.pid;
    infos[n].uid = o->cl.uid;
    infos[n].gid = o->cl.gid;
    infos[n].name = o->cl.name;
    infos[n].holds = o->cl.nholds;
    for (gpd_hold *h = o->cl.holds; h; h = h->next)
      infos[n].bytes += h->buf->size;
    infos[n].age_s = (now - o->cl.connected_ns) / 1000000000ull;
    ptrs[n] = &infos[n];
    n++;
  }
  ar.n_clients = n;
  ar.clients = ptrs;
  GPUPOOL__SEND_BODY(c, seq, ADMIN_CLIENTS, admin_clients, &ar);
  free(infos);
  free(ptrs);
  return 0;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every live buffer with all its names (gpupoolctl sorts them). */
int gpd_handle_admin_buffers(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  gpd_registry *reg = c->srv->reg;
  Gpupool__Wire__AdminBuffersReply ar = GPUPOOL__WIRE__ADMIN_BUFFERS_REPLY__INIT;
  Gpupool__Wire__BufferInfo *infos, **ptrs;
  char **keys = NULL;
  gpupool__hmap rows;
  uint64_t now = gpd_now_ns();
  size_t n = 0, total = 0;
  infos = calloc(reg->buffers.len + 1, sizeof *infos);
  ptrs = calloc(reg->buffers.len + 1, sizeof *ptrs);
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < reg->buffers.cap; i++) {
    gpd_buffer *b;
    if (!gpupool__hmap_slot_used(&reg->buffers, i))
      continue;
    b = reg->buffers.slots[i].val;
    gpupool__wire__buffer_info__init(&infos[n]);
    infos[n].id = b->id;
    infos[n].pool_id = b->slab->pool->id;
    infos[n].size = b->asked;
    infos[n].holders = b->refs;
    infos[n].age_s = (now - b->created_ns) / 1000000000ull;
    infos[n].owner_pid = b->owner_pid;
    infos[n].name = (char *)"";
    infos[n].replica_of = b->replica_of;
    infos[n].device = gpd_pool_device(reg, b->slab->pool);
    ptrs[n] = &infos[n];
    n++;
  }
  /* Names: every name of every buffer (several names may file one buffer), counted in a
   * first pass over the name table and filed in a second, each buffer's slice sorted. A map
   * from buffer id to its row keeps both passes linear in names and buffers. */
  gpupool__hmap_init(&rows);
  for (size_t k = 0; k < n; k++)
    if (gpupool__hmap_put(&rows, infos[k].id, (void *)(uintptr_t)(k + 1)) != 0) {
      gpupool__hmap_free(&rows);
      free(infos);
      free(ptrs);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory listing %zu buffers", n);
    }
  for (size_t i = 0; i < reg->names.cap; i++)
    if (gpupool__smap_slot_used(&reg->names, i))
      total += ((gpd_name *)reg->names.slots[i].val)->nbufs;
  if (total && !(keys = calloc(total, sizeof *keys))) {
    gpupool__hmap_free(&rows);
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory listing %zu names", total);
  }
  for (int pass = 0; pass < 2; pass++) {
    size_t at = 0;
    if (pass == 1 && keys) /* slices: each buffer's n_names counted in pass 0 */
      for (size_t k = 0; k < n; k++) {
        infos[k].names = keys + at;
        at += infos[k].n_names;
        infos[k].n_names = 0;
      }
    for (size_t i = 0; i < reg->names.cap; i++) {
      gpd_name *nm;
      if (!gpupool__smap_slot_used(&reg->names, i))
        continue;
      nm = reg->names.slots[i].val;
      for (uint32_t j = 0; j < nm->nbufs; j++) {
        uintptr_t row = (uintptr_t)gpupool__hmap_get(&rows, nm->bufs[j]->id);
        if (!row)
          continue;
        if (pass == 1)
          infos[row - 1].names[infos[row - 1].n_names] = nm->name;
        infos[row - 1].n_names++;
      }
    }
  }
  gpupool__hmap_free(&rows);
  for (size_t k = 0; k < n; k++)
    if (infos[k].n_names) {
      qsort(infos[k].names, infos[k].n_names, sizeof *infos[k].names, cmp_str);
      infos[k].name = infos[k].names[0];
    }
  ar.n_buffers = n;
  ar.buffers = ptrs;
  GPUPOOL__SEND_BODY(c, seq, ADMIN_BUFFERS, admin_buffers, &ar);
  free(keys);
  free(infos);
  free(ptrs);
  return 0;
}

int gpd_handle_admin_drop_client(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__AdminDropClient *m = req->admin_drop_client;
  Gpupool__Wire__AdminDropClientReply ar = GPUPOOL__WIRE__ADMIN_DROP_CLIENT_REPLY__INIT;
  gpd_conn *o, *next;
  if (m->pid <= 0)
    return gpupool__err(GPUPOOL_EINVAL, "pid %d is not a valid process id", m->pid);
  for (o = c->srv->conns; o; o = next) {
    next = o->next;
    if (o != c && !o->closing && o->cl.pid == m->pid) {
      GPUPOOL__INFO("operator (uid %u) dropped client %" PRIu64 " (pid %d)", (unsigned)c->cl.uid, o->cl.id, m->pid);
      gpd_conn_drop(o, "dropped by an operator");
      ar.dropped++;
    }
  }
  if (ar.dropped == 0)
    return gpupool__err(GPUPOOL_ENOENT, "no connected client has pid %d", m->pid);
  GPUPOOL__SEND_BODY(c, seq, ADMIN_DROP_CLIENT, admin_drop_client, &ar);
  return 0;
}

/* Every tenant's names, files included: what an operator needs to find and remove names that
 * outlived their publisher. */
int gpd_handle_admin_names(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  Gpupool__Wire__AdminNamesReply ar = GPUPOOL__WIRE__ADMIN_NAMES_REPLY__INIT;
  gpd_registry *reg = c->srv->reg;
  Gpupool__Wire__NameInfo *infos = NULL, **ptrs = NULL;
  uint64_t *ids = NULL;
  uint64_t now = gpd_now_ns();
  size_t n = 0, total = 0, at = 0;
  for (size_t i = 0; i < reg->names.cap; i++)
    if (gpupool__smap_slot_used(&reg->names, i))
      total += ((gpd_name *)reg->names.slots[i].val)->nbufs;
  if (total && !(ids = calloc(total, sizeof *ids)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory listing %zu names", reg->names.len);
  if (reg->names.len &&
      (!(infos = calloc(reg->names.len, sizeof *infos)) || !(ptrs = calloc(reg->names.len, sizeof *ptrs)))) {
    free(infos);
    free(ids);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory listing %zu names", reg->names.len);
  }
  for (size_t i = 0; i < reg->names.cap && n < reg->names.len; i++) {
    gpd_name *nm;
    Gpupool__Wire__NameInfo *ni = &infos[n];
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    nm = reg->names.slots[i].val;
    gpupool__wire__name_info__init(ni);
    ni->key = nm->name;
    ni->uid = (uint32_t)nm->uid;
    ni->version = nm->version;
    ni->age_s = (now - nm->created_ns) / 1000000000ull;
    ni->path = (char *)"";
    if (nm->file) {
      ni->kind = (char *)"file";
      ni->path = nm->file->path;
      ni->size = nm->file->length;
    } else {
      ni->kind = nm->layout ? (char *)"bundle" : (char *)"buffer";
      ni->members = nm->layout ? nm->layout->n : nm->nbufs;
      ni->buffer_ids = ids + at;
      ni->n_buffer_ids = nm->nbufs;
      for (uint32_t j = 0; j < nm->nbufs; j++) {
        ni->size += nm->bufs[j]->asked;
        ids[at++] = nm->bufs[j]->id;
      }
    }
    ptrs[n++] = ni;
  }
  ar.n_names = n;
  ar.names = ptrs;
  GPUPOOL__SEND_BODY(c, seq, ADMIN_NAMES, admin_names, &ar);
  free(ids);
  free(infos);
  free(ptrs);
  return 0;
}

int gpd_handle_admin_unpublish(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__AdminUnpublish *m = req->admin_unpublish;
  Gpupool__Wire__AdminUnpublishReply ar = GPUPOOL__WIRE__ADMIN_UNPUBLISH_REPLY__INIT;
  int rc;
  if ((rc = gpd_unpublish_key(c->srv->reg, m->key)) != 0)
    return rc;
  GPUPOOL__INFO("operator (uid %u) unpublished '%s'", (unsigned)c->cl.uid, m->key);
  GPUPOOL__SEND_BODY(c, seq, ADMIN_UNPUBLISH, admin_unpublish, &ar);
  return 0;
}

int gpd_handle_trim(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  Gpupool__Wire__TrimReply tr = GPUPOOL__WIRE__TRIM_REPLY__INIT;
  gpd_trim(c->srv->reg, &tr.slabs_freed, &tr.slabs_revoked);
  GPUPOOL__SEND_BODY(c, seq, TRIM, trim, &tr);
  return 0;
}

int gpd_handle_admin_peers(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  Gpupool__Wire__AdminPeersReply ar = GPUPOOL__WIRE__ADMIN_PEERS_REPLY__INIT;
  int rc = gpd_peers_admin(c->srv, &ar);
  if (rc != 0)
    return rc;
  GPUPOOL__SEND_BODY(c, seq, ADMIN_PEERS, admin_peers, &ar);
  gpd_peers_admin_free(&ar);
  return 0;
}
