/*
 * The requests on buffers, names and bundles: attach a pool, allocate, release, share, open,
 * publish, get, unpublish, and their bundle forms. State lives in the registry; a request
 * that cannot be answered yet becomes a waiter (waiters.c).
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
#include "replicas.h"

int gpd_handle_attach_pool(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__AttachPool *m = req->attach_pool;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AttachPoolReply ar = GPUPOOL__WIRE__ATTACH_POOL_REPLY__INIT;
  Gpupool__Wire__PoolInfo pi;
  gpd_pool *p = gpd_pool_find(c->srv->reg, NULL, m->pool_id);
  int fd = -1, rc;
  if (!p || m->pool_id == 0)
    return gpupool__err(GPUPOOL_ENOENT, "no pool with id %u", m->pool_id);
  /* The fd of the backend pool of the caller's tenant (or the pool's group): never one that
   * maps another tenant's memory. */
  if ((rc = gpd_attach(c->srv->reg, &c->cl, p, &fd)) != 0)
    return rc;
  gpd_fill_pool_info(c->srv->reg, p, &pi);
  ar.pool = &pi;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ATTACH_POOL;
  rep.attach_pool = &ar;
  gpd_send_reply(c, seq, &rep, fd >= 0 ? &fd : NULL, fd >= 0 ? 1 : 0);
  return 0;
}

/* The pool a request names (by name, or by id when the name is empty). */
static int pool_asked(gpd_registry *reg, const char *name, uint32_t id, gpd_pool **out) {
  if ((*out = gpd_pool_find(reg, name, id)))
    return 0;
  if (name && *name)
    return gpupool__err(GPUPOOL_ENOENT, "no pool named '%s' (gpupoolctl status lists the pools)", name);
  return gpupool__err(GPUPOOL_ENOENT, "no pool with id %u", id);
}

int gpd_handle_allocate(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Allocate *m = req->allocate;
  gpd_registry *reg = c->srv->reg;
  gpd_pool *p;
  gpd_hold *h = NULL;
  int rc;
  if ((rc = pool_asked(reg, m->pool_name, m->pool_id, &p)) != 0)
    return rc;
  rc = gpd_allocate(reg, &c->cl, p, m->size, m->alignment, &h);
  if (rc == GPUPOOL_ENOSPC && m->timeout_ms > 0) {
    if ((rc = gpd_waiter_add(c, seq, WAIT_ALLOC, m->timeout_ms, p, m->size, m->alignment, NULL, 0, 0, NULL)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  gpd_srv_reply_hold(c, seq, WAIT_ALLOC, h, NULL, 0);
  return 0;
}

int gpd_handle_release(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Release *m = req->release;
  Gpupool__Wire__ReleaseReply rr = GPUPOOL__WIRE__RELEASE_REPLY__INIT;
  int freed = 0, rc;
  if (m->n_more_hold_ids >= c->srv->cfg->max_share_batch)
    return gpupool__err(GPUPOOL_EINVAL, "one Release names %zu holds; the daemon takes at most %u "
                        "(max_share_batch): split it", 1 + m->n_more_hold_ids, c->srv->cfg->max_share_batch);
  rc = gpd_release(c->srv->reg, &c->cl, m->hold_id, m->done_recorded, &freed);
  /* Every hold named is dropped that is this client's; the first one that is not is the error. */
  for (size_t i = 0; i < m->n_more_hold_ids; i++) {
    int f, r = gpd_release(c->srv->reg, &c->cl, m->more_hold_ids[i],
                           i < m->n_more_done_recorded && m->more_done_recorded[i], &f);
    if (rc == 0)
      rc = r;
  }
  if (rc != 0)
    return rc;
  rr.freed = freed;
  GPUPOOL__SEND_BODY(c, seq, RELEASE, release, &rr);
  return 0;
}

/* A request naming n holds or tokens: EINVAL past max_share_batch. */
static int batch_ok(gpd_conn *c, size_t n, const char *what) {
  uint32_t max = c->srv->cfg->max_share_batch;
  if (n > max)
    return gpupool__err(GPUPOOL_EINVAL, "one %s request names %zu holds or tokens; the daemon takes at most %u "
                        "(max_share_batch): split it", what, n, max);
  return 0;
}

/* A Share whose tokens the client made from its reserve (Share.from_reserve): answered with
 * an empty reply (the client does not wait for it); the Opens waiting for its ids are tried. */
static int share_reserved(gpd_conn *c, uint64_t seq, const Gpupool__Wire__Share *m, const uint64_t *ids, size_t n) {
  Gpupool__Wire__ShareReply sr = GPUPOOL__WIRE__SHARE_REPLY__INIT;
  uint64_t first = 0;
  int rc;
  if (!m->keep || m->n_idle_hold_ids || m->reserve)
    return gpupool__err(GPUPOOL_EINVAL, "Share.from_reserve makes kept shares (keep) and asks nothing else "
                        "(no idle_hold_ids, no reserve)");
  if (m->secrets.len != 16 * n)
    return gpupool__err(GPUPOOL_EINVAL, "Share.from_reserve: secrets has %zu bytes, expected 16 per hold (%zu)",
                        m->secrets.len, 16 * n);
  rc = gpd_share_reserved(c->srv->reg, &c->cl, ids, n, m->ready_together, m->secrets.data, &first);
  if (rc == 0)
    GPUPOOL__SEND_BODY(c, seq, SHARE, share, &sr);
  /* Made or failed, the Opens of these ids need not wait any more. */
  gpd_opens_shared(c->srv, first, n);
  return rc;
}

int gpd_handle_share(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Share *m = req->share;
  Gpupool__Wire__ShareReply sr = GPUPOOL__WIRE__SHARE_REPLY__INIT;
  size_t n = 1 + m->n_more_hold_ids;
  uint64_t one[1], *ids = one;
  uint8_t token[1][GPUPOOL_TOKEN_SIZE], (*tokens)[GPUPOOL_TOKEN_SIZE] = token;
  ProtobufCBinaryData *more = NULL;
  protobuf_c_boolean *idle = NULL;
  int rc;
  if ((rc = batch_ok(c, n, "Share")) != 0 || (rc = batch_ok(c, m->n_idle_hold_ids, "Share (idle_hold_ids)")) != 0)
    return rc;
  if (m->n_idle_hold_ids && !(idle = calloc(m->n_idle_hold_ids, sizeof *idle)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (n > 1 && (!(ids = malloc(n * sizeof *ids)) || !(tokens = malloc(n * sizeof *tokens)) ||
                !(more = calloc(n - 1, sizeof *more)))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto out;
  }
  ids[0] = m->hold_id;
  for (size_t i = 1; i < n; i++)
    ids[i] = m->more_hold_ids[i - 1];
  if (m->from_reserve) {
    rc = share_reserved(c, seq, m, ids, n);
    goto out;
  }
  if (m->reserve) {
    /* A new reserve: the ids left of the previous one are given up (their Opens told so). */
    uint64_t from = c->cl.resv_next, end = c->cl.resv_end, first = 0;
    uint32_t count = 0;
    if ((rc = gpd_reserve(c->srv->reg, &c->cl, m->reserve, &first, &count)) != 0)
      goto out;
    gpd_opens_unreserved(c->srv, &c->cl, from, end, "reserved new ids");
    sr.reserve_first = first;
    sr.reserve_count = count;
  }
  if ((rc = gpd_share_many(c->srv->reg, &c->cl, ids, n, m->keep, m->ready_together, tokens)) != 0)
    goto out;
  sr.token.data = tokens[0];
  sr.token.len = GPUPOOL_TOKEN_SIZE;
  for (size_t i = 1; i < n; i++) {
    more[i - 1].data = tokens[i];
    more[i - 1].len = GPUPOOL_TOKEN_SIZE;
  }
  sr.n_more_tokens = n - 1;
  sr.more_tokens = more;
  for (size_t i = 0; i < m->n_idle_hold_ids; i++) {
    int on = 0;
    (void)gpd_hold_idle(c->srv->reg, &c->cl, m->idle_hold_ids[i], &on); /* not this client's: not idle */
    idle[i] = on;
  }
  sr.n_idle = m->n_idle_hold_ids;
  sr.idle = idle;
  GPUPOOL__SEND_BODY(c, seq, SHARE, share, &sr);
out:
  if (ids != one)
    free(ids);
  if (tokens != token)
    free(tokens);
  free(more);
  free(idle);
  return rc;
}

int gpd_open_now(gpd_conn *c, uint64_t seq, const uint8_t *const *toks, const size_t *lens, size_t n, int read_only,
                 uint64_t *pending) {
  gpd_registry *reg = c->srv->reg;
  gpd_hold *h = NULL, **hs = NULL;
  size_t opened = 0;
  int rc;
  if (n == 1) {
    if ((rc = gpd_open(reg, &c->cl, toks[0], lens[0], read_only, &h)) == 0)
      gpd_srv_reply_hold(c, seq, 0, h, NULL, 0);
  } else if (!(hs = calloc(n, sizeof *hs))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  } else {
    if ((rc = gpd_open_many(reg, &c->cl, toks, lens, n, read_only, GPUPOOL_WIRE_MAX_FDS, hs, &opened)) == 0)
      gpd_srv_reply_open_many(c, seq, hs, (uint32_t)opened);
    free(hs);
  }
  if (rc == GPD_OPEN_PENDING)
    *pending = reg->open_pending;
  return rc;
}

int gpd_handle_open(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  const Gpupool__Wire__Open *m = req->open;
  const uint8_t *one_tok[1];
  size_t one_len[1];
  const uint8_t **toks = one_tok;
  size_t *lens = one_len, n = 1 + m->n_more_tokens;
  uint64_t pending = 0;
  int rc;
  if ((rc = batch_ok(c, n, "Open")) != 0)
    return rc;
  if (n > 1 && (!(toks = calloc(n, sizeof *toks)) || !(lens = calloc(n, sizeof *lens)))) {
    if (toks != one_tok)
      free(toks);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  toks[0] = m->token.data;
  lens[0] = m->token.len;
  for (size_t i = 1; i < n; i++) {
    toks[i] = m->more_tokens[i - 1].data;
    lens[i] = m->more_tokens[i - 1].len;
  }
  rc = gpd_open_now(c, req->seq, toks, lens, n, m->read_only, &pending);
  if (rc == GPD_OPEN_PENDING) {
    /* A token its sender handed on before sharing it: wait for the share. */
    if ((rc = gpd_open_park(c, req->seq, toks, lens, n, m->read_only, pending)) == 0)
      *deferred = 1;
  }
  if (toks != one_tok) {
    free(toks);
    free(lens);
  }
  return rc;
}

int gpd_handle_idle(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Idle *m = req->idle;
  Gpupool__Wire__IdleReply ir = GPUPOOL__WIRE__IDLE_REPLY__INIT;
  protobuf_c_boolean *idle = NULL;
  int rc;
  if ((rc = batch_ok(c, m->n_hold_ids, "Idle")) != 0)
    return rc;
  if (m->n_hold_ids && !(idle = calloc(m->n_hold_ids, sizeof *idle)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  for (size_t i = 0; i < m->n_hold_ids; i++) {
    int on = 0;
    if ((rc = gpd_hold_idle(c->srv->reg, &c->cl, m->hold_ids[i], &on)) != 0)
      goto out;
    idle[i] = on;
  }
  ir.n_idle = m->n_hold_ids;
  ir.idle = idle;
  GPUPOOL__SEND_BODY(c, seq, IDLE, idle, &ir);
out:
  free(idle);
  return rc;
}

/* A get of a peer's name with nothing newer here waits (also when it asked not to: the
 * fetch takes its time) while a fetch runs for it. 0 with the waiter queued, or the error. */
static int wait_remote(gpd_conn *c, uint64_t seq, int kind, const gpd_rname *rn, int read_only, uint64_t newer_than,
                       uint32_t timeout_ms, int device) {
  uint32_t t = timeout_ms ? timeout_ms : c->srv->cfg->peer_fetch_timeout_ms;
  gpd_waiter *w;
  int rc = gpd_waiter_add(c, seq, kind, t, NULL, 0, 0, rn, read_only, newer_than, NULL);
  if (rc != 0)
    return rc;
  w = c->waiters; /* gpd_waiter_add put it first */
  w->peer_nowait = timeout_ms == 0;
  w->device = device; /* the local copy, once fetched, is got on that device like any version */
  if ((rc = gpd_peers_want(c->srv, c, rn, newer_than, timeout_ms)) != 0) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    gpd_waiter_remove(w);
    return gpupool__err(rc, "%s", msg);
  }
  return 0;
}

int gpd_handle_publish(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Publish *m = req->publish;
  Gpupool__Wire__PublishReply pr = GPUPOOL__WIRE__PUBLISH_REPLY__INIT;
  uint64_t version = 0;
  gpd_registry *reg = c->srv->reg;
  gpd_hold *h = NULL;
  gpd_rname rn;
  int rc;
  gpd_name_key(reg, &c->cl, m->name, &rn); /* an error is told where the name is used */
  /* The hold found once, for the devices' checks and the publish. */
  rc = gpd_replicate_limits(reg, m->n_replicate_to);
  if (rc == 0)
    rc = gpd_hold_of(reg, &c->cl, m->hold_id, &h);
  if (rc == 0)
    rc = gpd_replicate_check(reg, h, m->replicate_to, m->n_replicate_to);
  if (rc == 0)
    rc = gpd_publish(reg, &c->cl, h, &rn, m->tensor, 0, gpupool__wire_publish_shares(m),
                     &version);
  if (rc != 0)
    return rc;
  /* The copies first: getters the publish wakes on those devices then wait for them. */
  gpd_replicate(c->srv->reg, &c->cl, &rn, m->replicate_to, m->n_replicate_to);
  gpd_published(c, &rn, version);
  pr.version = version;
  GPUPOOL__SEND_BODY(c, seq, PUBLISH, publish, &pr);
  GPUPOOL__DEBUG("client %" PRIu64 " gpd_published '%s' version %" PRIu64, c->cl.id, m->name, version);
  return 0;
}

int gpd_handle_publish_bundle(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__PublishBundle *m = req->publish_bundle;
  Gpupool__Wire__PublishBundleReply pr = GPUPOOL__WIRE__PUBLISH_BUNDLE_REPLY__INIT;
  uint64_t version = 0;
  gpd_rname rn;
  int rc;
  gpd_name_key(c->srv->reg, &c->cl, m->name, &rn); /* an error is told where the name is used */
  rc = 0;
  if (m->n_replicate_to && m->n_hold_ids) {
    gpd_hold *h = NULL;
    rc = gpd_replicate_limits(c->srv->reg, m->n_replicate_to);
    if (rc == 0)
      rc = gpd_hold_of(c->srv->reg, &c->cl, m->hold_ids[0], &h);
    if (rc == 0)
      rc = gpd_replicate_check(c->srv->reg, h, m->replicate_to, m->n_replicate_to);
  }
  if (rc == 0)
    rc = gpd_publish_bundle_checked(c->srv->reg, &c->cl, &rn, m->hold_ids, m->n_hold_ids, m->members,
                                    m->n_members, m->layout_id, &version);
  if (rc != 0)
    return rc;
  gpd_replicate(c->srv->reg, &c->cl, &rn, m->replicate_to, m->n_replicate_to);
  gpd_published(c, &rn, version);
  pr.version = version;
  GPUPOOL__SEND_BODY(c, seq, PUBLISH_BUNDLE, publish_bundle, &pr);
  GPUPOOL__DEBUG("client %" PRIu64 " gpd_published bundle '%s' (%zu members) version %" PRIu64, c->cl.id, m->name,
                 m->n_members, version);
  return 0;
}

int gpd_handle_allocate_bundle(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__AllocateBundle *m = req->allocate_bundle;
  gpd_registry *reg = c->srv->reg;
  gpd_pool *p;
  gpd_bundle_plan *plan = NULL;
  gpd_hold **hs = NULL;
  int rc;
  if ((rc = pool_asked(reg, m->pool_name, m->pool_id, &p)) != 0)
    return rc;
  if ((rc = gpd_bundle_plan_new(reg, &c->cl, p, m->members, m->n_members, m->alignment, &plan)) != 0)
    return rc;
  if (plan->nchunks > GPUPOOL_WIRE_MAX_FDS) {
    rc = gpupool__err(GPUPOOL_ETOOBIG, "bundle of %" PRIu64 " bytes needs %u buffers, more than the %d one "
                      "request may hold; split it into several bundles", plan->total, plan->nchunks,
                      GPUPOOL_WIRE_MAX_FDS);
    gpd_bundle_plan_free(plan);
    return rc;
  }
  rc = gpd_bundle_allocate(reg, &c->cl, plan, &hs);
  if (rc == GPUPOOL_ENOSPC && m->timeout_ms > 0) {
    if ((rc = gpd_waiter_add(c, seq, WAIT_ABUNDLE, m->timeout_ms, p, plan->total, plan->align, NULL, 0, 0, plan)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc == 0) {
    gpd_srv_reply_bundle(c, seq, WAIT_ABUNDLE, hs, plan->nchunks, plan->layout, NULL, 0);
    free(hs);
  }
  gpd_bundle_plan_free(plan);
  return rc;
}

/* The device a get asks for (target_device is 1 + the ordinal), or -1 for wherever it lies. */
static int target_device(uint32_t target, int *device) {
  *device = target ? (int)target - 1 : -1;
  if (target > 1024)
    return gpupool__err(GPUPOOL_EINVAL, "target device %u is no device ordinal", target - 1);
  return 0;
}

/* A get that must wait: for a publish (ENOENT with a timeout), or for the copy of the replica
 * it asked for (EBUSY: waits however the timeout is set, within it when one is set, since the
 * copy always ends). 0 when it waits (the handler is deferred), else rc. */
static int get_wait(gpd_conn *c, uint64_t seq, int kind, int rc, uint32_t timeout_ms, const gpd_rname *rn,
                    int read_only, uint64_t newer_than, int device, uint64_t copy_id, uint64_t known_layout) {
  if (!(rc == GPUPOOL_ENOENT && timeout_ms > 0) && rc != GPUPOOL_EBUSY)
    return rc;
  if (rc == GPUPOOL_EBUSY && timeout_ms == 0)
    timeout_ms = WAIT_FOREVER;
  if ((rc = gpd_waiter_add(c, seq, kind, timeout_ms, NULL, 0, 0, rn, read_only, newer_than, NULL)) != 0)
    return rc;
  /* gpd_waiter_add put it first */
  c->waiters->known_layout = known_layout;
  c->waiters->device = device;
  if (copy_id && (rc = gpd_waiter_on_copy(c->waiters, copy_id)) != 0) {
    gpd_waiter_remove(c->waiters);
    return rc;
  }
  return 0;
}

int gpd_handle_get_bundle(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__GetBundle *m = req->get_bundle;
  gpd_hold **hs = NULL;
  const gpd_name *nm = NULL;
  uint64_t copy_id = 0;
  gpd_rname rn;
  int device, rc;
  if ((rc = target_device(m->target_device, &device)) != 0)
    return rc;
  gpd_name_key(c->srv->reg, &c->cl, m->name, &rn); /* an error is told where the name is used */
  rc = gpd_get_bundle_on(c->srv->reg, &c->cl, &rn, m->read_only, m->newer_than, device, &hs, &nm, &copy_id);
  if (rc == GPUPOOL_ENOENT && gpd_peers_is_remote(c->srv, &rn)) {
    if ((rc = wait_remote(c, seq, WAIT_BGET, &rn, m->read_only, m->newer_than, m->timeout_ms, device)) != 0)
      return rc;
    c->waiters->known_layout = m->known_layout;
    *deferred = 1;
    return 0;
  }
  if (rc == GPUPOOL_EBUSY || (rc == GPUPOOL_ENOENT && m->timeout_ms > 0)) {
    if ((rc = get_wait(c, seq, WAIT_BGET, rc, m->timeout_ms, &rn, m->read_only, m->newer_than, device, copy_id,
                       m->known_layout)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  gpd_srv_reply_bundle(c, seq, WAIT_BGET, hs, nm->nbufs, nm->layout, nm, m->known_layout);
  free(hs);
  return 0;
}

int gpd_handle_get(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Get *m = req->get;
  gpd_hold *h = NULL;
  uint64_t version = 0, copy_id = 0;
  gpd_rname rn;
  int device, rc;
  if ((rc = target_device(m->target_device, &device)) != 0)
    return rc;
  gpd_name_key(c->srv->reg, &c->cl, m->name, &rn); /* an error is told where the name is used */
  rc = gpd_get_on(c->srv->reg, &c->cl, &rn, m->read_only, m->newer_than, device, &h, &version, &copy_id);
  if (rc == GPUPOOL_ENOENT && gpd_peers_is_remote(c->srv, &rn)) {
    if ((rc = wait_remote(c, seq, WAIT_GET, &rn, m->read_only, m->newer_than, m->timeout_ms, device)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc == GPUPOOL_EBUSY || (rc == GPUPOOL_ENOENT && m->timeout_ms > 0)) {
    if ((rc = get_wait(c, seq, WAIT_GET, rc, m->timeout_ms, &rn, m->read_only, m->newer_than, device, copy_id,
                       0)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  gpd_srv_reply_hold(c, seq, WAIT_GET, h, &rn, version);
  return 0;
}

int gpd_handle_unpublish(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__Unpublish *m = req->unpublish;
  Gpupool__Wire__UnpublishReply ur = GPUPOOL__WIRE__UNPUBLISH_REPLY__INIT;
  gpd_rname rn;
  int rc;
  gpd_name_key(c->srv->reg, &c->cl, m->name, &rn);
  rc = gpd_unpublish(c->srv->reg, &c->cl, &rn);
  if (rc != 0)
    return rc;
  GPUPOOL__SEND_BODY(c, seq, UNPUBLISH, unpublish, &ur);
  return 0;
}
