/*
 * The peers' data plane over UCX (see peers_ucx.h). The daemon has one thread: UCX runs in
 * it, woken through the worker's event fd. Each wake-up (and each loop turn after a get was
 * posted) runs at most PROGRESS_BUDGET progress calls, then re-arms the worker; when the
 * budget runs out with work left, an idle handle brings it back on the next turn, so a
 * transfer shares the loop with the clients instead of holding it. Completions are collected
 * in the UCX callbacks and handed to their owners only after the progress calls return:
 * nothing is freed or closed from inside UCX.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ucp/api/ucp.h>

#include "errors.h"
#include "log.h"
#include "peers_ucx.h"

#define PROGRESS_BUDGET 256
/* ...and at most this long: what arrives is copied into place inside progress, so a turn is
 * bounded in time as well as in calls, and the clients' requests wait for one turn at most. */
#define PROGRESS_NS 1000000ull
#define AM_DATA 1

typedef struct op op;
struct op {
  gpd_ucx *u;
  gpd_ucx_ep *ep;
  gpd_ucx_done done;
  void *arg;
  int status;
  uint8_t hdr[32];
  op *next; /* in u->completed */
};

struct gpd_ucx {
  uv_loop_t *loop;
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_address_t *addr;
  size_t addr_len;
  int efd;
  uv_poll_t poll;
  uv_idle_t idle;
  int idle_on;
  op *completed, **completed_tail;
  int draining;
  int closing;   /* handles whose close callback has not come yet */
  gpd_ucx_recv recv;
  void *recv_arg;
  int cuda;      /* its memory types include CUDA */
  char describe[256];
};

struct gpd_ucx_reg {
  gpd_ucx *u;
  ucp_mem_h memh;
};

struct gpd_ucx_ep {
  gpd_ucx *u;
  ucp_ep_h ep;
  uint32_t ops;   /* sends and flushes whose callback has not been handed out */
  int closed;     /* gpd_ucx_ep_close was called: freed once ops is 0 and UCX closed it */
  int close_started; /* ucp_ep_close_nbx was called (once no operation was in flight) */
  int close_done; /* UCX's close completed: it calls on_ep_error no more */
  int failed;
};

static int ucs_err(ucs_status_t st, const char *what) {
  return gpupool__err(GPUPOOL_EPEER, "%s: %s", what, ucs_status_string(st));
}

static void ep_close_now(gpd_ucx_ep *e);

/* A closed endpoint is closed in UCX once none of its operations is in flight (closing it
 * under in-flight sends trips UCX 1.13's error paths), and freed once UCX is done with it. */
static void ep_maybe_free(gpd_ucx_ep *ep) {
  if (ep->closed && !ep->close_started && ep->ops == 0)
    ep_close_now(ep);
  else if (ep->closed && ep->close_done && ep->ops == 0)
    free(ep);
}

/* Hand out what completed; the callbacks may post new sends (they append to the list). */
static void drain(gpd_ucx *u) {
  if (u->draining)
    return;
  u->draining = 1;
  while (u->completed) {
    op *o = u->completed;
    u->completed = o->next;
    if (!u->completed)
      u->completed_tail = &u->completed;
    if (o->ep) {
      o->ep->ops--;
      ep_maybe_free(o->ep);
    }
    if (o->status != 0)
      gpupool__err(GPUPOOL_EPEER, "UCX: %s", ucs_status_string((ucs_status_t)o->status));
    o->done(o->arg, o->status ? GPUPOOL_EPEER : 0);
    free(o);
  }
  u->draining = 0;
}

static void on_idle(uv_idle_t *h);

/* Progress within the budget, re-arm the event fd, hand out completions. */
static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void drive(gpd_ucx *u) {
  int armed = 0;
  uint64_t start = mono_ns();
  for (int i = 0; i < PROGRESS_BUDGET; i++) {
    if (ucp_worker_progress(u->worker)) {
      if ((i & 7) == 7 && mono_ns() - start > PROGRESS_NS)
        break;
      continue;
    }
    ucs_status_t st = ucp_worker_arm(u->worker);
    if (st == UCS_OK) {
      armed = 1;
      break;
    }
    if (st != UCS_ERR_BUSY) {
      GPUPOOL__WARN("peers: ucp_worker_arm failed: %s", ucs_status_string(st));
      break;
    }
  }
  drain(u);
  if (!armed || u->completed) {
    if (!u->idle_on) {
      uv_idle_start(&u->idle, on_idle);
      u->idle_on = 1;
    }
  } else if (u->idle_on) {
    uv_idle_stop(&u->idle);
    u->idle_on = 0;
  }
}

static void on_idle(uv_idle_t *h) { drive(h->data); }

static void on_efd(uv_poll_t *h, int status, int events) {
  (void)status;
  (void)events;
  drive(h->data);
}

static void kick(gpd_ucx *u) {
  if (!u->idle_on) {
    uv_idle_start(&u->idle, on_idle);
    u->idle_on = 1;
  }
}

static void complete(op *o, ucs_status_t st) {
  gpd_ucx *u = o->u;
  o->status = st == UCS_OK ? 0 : (int)st;
  o->next = NULL;
  *u->completed_tail = o;
  u->completed_tail = &o->next;
}

static void on_sent(void *request, ucs_status_t st, void *user) {
  complete(user, st);
  ucp_request_free(request);
}

/* The resources the context found ("tcp/lo, tcp/eth0, ..."), from its printed description. */
static void list_resources(ucp_context_h ctx, char *out, size_t len) {
  char *text = NULL, *line, *save = NULL;
  size_t tl = 0, off = 0;
  FILE *f = open_memstream(&text, &tl);
  out[0] = '\0';
  if (!f)
    return;
  ucp_context_print_info(ctx, f);
  fclose(f);
  for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    const char *r = strstr(line, "flags -- ");
    if (!strstr(line, "resource") || !r)
      continue;
    r += 9;
    if (off + strlen(r) + 3 >= len)
      break;
    off += (size_t)snprintf(out + off, len - off, "%s%s", off ? ", " : "", r);
  }
  free(text);
}

/* A data message: eager only (the sender forces it), so data is here, whole, for this call. */
static ucs_status_t on_am(void *arg, const void *header, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param) {
  gpd_ucx *u = arg;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    ucp_am_data_release(u->worker, data);
    return UCS_OK;
  }
  u->recv(u->recv_arg, header, hlen, data, len);
  if (!u->idle_on) {
    uv_idle_start(&u->idle, on_idle);
    u->idle_on = 1;
  }
  return UCS_OK;
}

/* Whether UCX_TLS lets UCX use its TCP transport (unset, "all", "tcp" named, or a "^" list
 * that leaves it): a transport key UCX applies to no transport is warned about on stderr. */
static int tls_may_use_tcp(void) {
  const char *t = getenv("UCX_TLS");
  if (!t || !*t)
    return 1;
  if (t[0] == '^')
    return strstr(t, "tcp") == NULL;
  return strstr(t, "tcp") != NULL || strstr(t, "all") != NULL;
}

int gpd_ucx_open(uv_loop_t *loop, gpd_ucx_recv recv, void *recv_arg, gpd_ucx **out) {
  gpd_ucx *u = calloc(1, sizeof *u);
  ucp_config_t *config = NULL;
  ucp_params_t params;
  ucp_worker_params_t wp;
  ucp_context_attr_t attr;
  ucs_status_t st;
  unsigned major, minor, release;
  char res[160];
  int rc;

  if (!u)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  u->loop = loop;
  u->recv = recv;
  u->recv_arg = recv_arg;
  u->completed_tail = &u->completed;
  u->efd = -1;
  if ((st = ucp_config_read(NULL, NULL, &config)) != UCS_OK) {
    rc = ucs_err(st, "reading the UCX configuration (UCX_* variables)");
    goto fail;
  }
  /* A peer that is gone stays gone for its endpoint: the daemon learns of a restarted peer on
   * the peer link and makes a new endpoint to its new worker. UCX 1.13's TCP transport
   * otherwise reconnects an endpoint whose socket closed (25 tries), and failing such an
   * endpoint with sends in flight aborts the daemon on UCX's own assertions (tcp_ep.c:478
   * "!(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX)", uct_iface.h:884 "comp->count > 0"): seen
   * in 2 of 12 loaded runs of integration_test_peers under ASan, whose peers stop mid-transfer
   * on purpose; 0 of 24 with one try. UCX_TCP_MAX_CONN_RETRIES in the environment still wins
   * (UCX applies this key, unprefixed, to its TCP transport). */
  if (!getenv("UCX_TCP_MAX_CONN_RETRIES") && tls_may_use_tcp() &&
      (st = ucp_config_modify(config, "MAX_CONN_RETRIES", "1")) != UCS_OK)
    GPUPOOL__DEBUG("peers: UCX keeps reconnecting closed TCP endpoints (TCP_MAX_CONN_RETRIES: %s)",
                   ucs_status_string(st));
  memset(&params, 0, sizeof params);
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  st = ucp_init(&params, config, &u->ctx);
  ucp_config_release(config);
  if (st != UCS_OK) {
    rc = ucs_err(st, "starting UCX (ucp_init)");
    goto fail;
  }
  memset(&wp, 0, sizeof wp);
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if ((st = ucp_worker_create(u->ctx, &wp, &u->worker)) != UCS_OK) {
    rc = ucs_err(st, "creating the UCX worker");
    goto fail;
  }
  if ((st = ucp_worker_get_address(u->worker, &u->addr, &u->addr_len)) != UCS_OK) {
    rc = ucs_err(st, "getting the UCX worker's address");
    goto fail;
  }
  {
    ucp_am_handler_param_t hp;
    memset(&hp, 0, sizeof hp);
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = AM_DATA;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = on_am;
    hp.arg = u;
    if ((st = ucp_worker_set_am_recv_handler(u->worker, &hp)) != UCS_OK) {
      rc = ucs_err(st, "setting the UCX data handler");
      goto fail;
    }
  }
  if ((st = ucp_worker_get_efd(u->worker, &u->efd)) != UCS_OK) {
    rc = ucs_err(st, "getting the UCX worker's event fd");
    goto fail;
  }
  memset(&attr, 0, sizeof attr);
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  ucp_context_query(u->ctx, &attr);
  ucp_get_version(&major, &minor, &release);
  list_resources(u->ctx, res, sizeof res);
  snprintf(u->describe, sizeof u->describe, "ucx %u.%u.%u (%s)", major, minor, release, res[0] ? res : "no transport");
  u->cuda = (attr.field_mask & UCP_ATTR_FIELD_MEMORY_TYPES) && (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
  GPUPOOL__INFO("peers: UCX %u.%u.%u, transports: %s (UCX_TLS=%s); memory types: host%s", major, minor, release,
                res[0] ? res : "none", getenv("UCX_TLS") ? getenv("UCX_TLS") : "default", u->cuda ? ", cuda" : "");
  uv_poll_init(loop, &u->poll, u->efd);
  u->poll.data = u;
  uv_idle_init(loop, &u->idle);
  u->idle.data = u;
  uv_poll_start(&u->poll, UV_READABLE, on_efd);
  kick(u);
  *out = u;
  return 0;
fail:
  if (u->addr)
    ucp_worker_release_address(u->worker, u->addr);
  if (u->worker)
    ucp_worker_destroy(u->worker);
  if (u->ctx)
    ucp_cleanup(u->ctx);
  free(u);
  return rc;
}

/* libuv runs close callbacks newest first: u goes with the last of its handles. */
static void free_after_close(uv_handle_t *h) {
  gpd_ucx *u = h->data;
  if (--u->closing == 0)
    free(u);
}

void gpd_ucx_flush(gpd_ucx *u) {
  for (int i = 0; i < 1000 && ucp_worker_progress(u->worker); i++)
    ;
  drain(u);
}

void gpd_ucx_close(gpd_ucx *u) {
  if (!u)
    return;
  gpd_ucx_flush(u);
  ucp_worker_release_address(u->worker, u->addr);
  ucp_worker_destroy(u->worker);
  ucp_cleanup(u->ctx);
  /* What the worker's end completed: nobody waits for it any more. */
  while (u->completed) {
    op *o = u->completed;
    u->completed = o->next;
    free(o);
  }
  u->completed_tail = &u->completed;
  uv_idle_stop(&u->idle);
  uv_poll_stop(&u->poll);
  u->poll.data = u->idle.data = u;
  u->closing = 2;
  uv_close((uv_handle_t *)&u->poll, free_after_close);
  uv_close((uv_handle_t *)&u->idle, free_after_close);
}

void gpd_ucx_address(gpd_ucx *u, const void **addr, size_t *len) {
  *addr = u->addr;
  *len = u->addr_len;
}

const char *gpd_ucx_describe(gpd_ucx *u) { return u->describe; }

int gpd_ucx_moves_cuda(gpd_ucx *u) { return u->cuda; }

int gpd_ucx_reg_new(gpd_ucx *u, void *addr, size_t len, gpd_ucx_reg **out) {
  ucp_mem_map_params_t p;
  ucs_status_t st;
  gpd_ucx_reg *r = calloc(1, sizeof *r);
  if (!r)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  p.address = addr;
  p.length = len;
  if ((st = ucp_mem_map(u->ctx, &p, &r->memh)) != UCS_OK) {
    free(r);
    return ucs_err(st, "registering memory with UCX (ucp_mem_map)");
  }
  r->u = u;
  *out = r;
  return 0;
}

void gpd_ucx_reg_free(gpd_ucx_reg *r) {
  if (!r)
    return;
  ucp_mem_unmap(r->u->ctx, r->memh);
  free(r);
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t st) {
  gpd_ucx_ep *e = arg;
  (void)ep;
  e->failed = 1;
  GPUPOOL__DEBUG("peers: UCX endpoint failed: %s", ucs_status_string(st));
}

int gpd_ucx_ep_new(gpd_ucx *u, const void *addr, size_t len, gpd_ucx_ep **out) {
  ucp_ep_params_t p;
  ucs_status_t st;
  gpd_ucx_ep *e = calloc(1, sizeof *e);
  (void)len;
  if (!e)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = addr;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = on_ep_error;
  p.err_handler.arg = e;
  if ((st = ucp_ep_create(u->worker, &p, &e->ep)) != UCS_OK) {
    free(e);
    return ucs_err(st, "connecting to the peer's UCX worker");
  }
  e->u = u;
  *out = e;
  kick(u);
  return 0;
}

void gpd_ucx_ep_describe(gpd_ucx_ep *e, char *buf, size_t len) {
  char *text = NULL;
  size_t tlen = 0;
  FILE *f = open_memstream(&text, &tlen);
  buf[0] = '\0';
  if (!f)
    return;
  ucp_ep_print_info(e->ep, f);
  if (fclose(f) != 0 || !text)
    return;
  /* Lines like "#  lane[0]:  0:tcp/lo.0 md[0]  -> md[0]/tcp/sysdev[255] am am_bw#0 keepalive wireup":
   * the resource (without its index) and what the daemon's data uses it for (am, am_bw). */
  for (char *line = text, *next; line && *line; line = next) {
    char *res, *end, *arrow, what[64] = "";
    size_t off = strlen(buf);
    if ((next = strchr(line, '\n')))
      *next++ = '\0';
    if (!strstr(line, "lane[") || !(res = strstr(line, "]:")) || !(res = strchr(res + 2, ':')))
      continue;
    res++;
    end = res + strcspn(res, " \t");
    *end = '\0';
    if ((arrow = strrchr(res, '.')) && arrow[1] && strspn(arrow + 1, "0123456789") == strlen(arrow + 1))
      *arrow = '\0';
    if ((arrow = strstr(end + 1, "->"))) {
      char *tok = strchr(arrow, ' '), *save = NULL;
      for (tok = tok ? strtok_r(tok, " \t", &save) : NULL; tok; tok = strtok_r(NULL, " \t", &save)) {
        size_t n = strcspn(tok, "#");
        if ((n == 2 && !strncmp(tok, "am", 2)) || (n == 5 && !strncmp(tok, "am_bw", 5)))
          snprintf(what + strlen(what), sizeof what - strlen(what), "%s%.*s", what[0] ? ", " : "", (int)n, tok);
      }
    }
    if (!what[0])
      continue; /* a lane the data does not use (keepalive, wireup alone) */
    snprintf(buf + off, len > off ? len - off : 0, "%s%s (%s)", off ? "; " : "", res, what);
  }
  free(text);
}

/* UCX 1.13 connects an endpoint to a worker address lazily: ucp_ep_create and a flush only
 * open the sockets; the wireup (its request out, the other side's reply back) starts with the
 * first send that needs the remote endpoint's id, which was the first get's data. The
 * receiving daemon's reply then waits in its TCP endpoint until this daemon takes the socket
 * back; if this daemon dies meanwhile, UCX in the receiving daemon purges the reply on a path
 * that asserts (only ACK, EP_CHECK and EP_REMOVED are expected there) and aborts it: a source
 * killed as its data started took the fetching daemon with it. An empty reply-capable message
 * needs the remote id, so it runs the wireup now and completes only once the reply is here:
 * Welcome (and any data) comes after it, and nothing of the wireup is left pending on the
 * fetching side afterwards. The receiver drops it (no data message's header). */
int gpd_ucx_ep_connect(gpd_ucx_ep *e, gpd_ucx_done done, void *arg) {
  ucp_request_param_t p;
  void *req;
  op *o = calloc(1, sizeof *o);
  if (!o)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  o->u = e->u;
  o->done = done;
  o->arg = arg;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = on_sent;
  p.user_data = o;
  p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  req = ucp_am_send_nbx(e->ep, AM_DATA, NULL, 0, NULL, 0, &p);
  if (UCS_PTR_IS_ERR(req)) {
    free(o);
    return ucs_err(UCS_PTR_STATUS(req), "connecting to the peer's UCX worker");
  }
  o->ep = e;
  e->ops++;
  if (req == NULL)
    complete(o, UCS_OK);
  kick(e->u);
  return 0;
}

static void on_closed(void *request, ucs_status_t st, void *user) {
  gpd_ucx_ep *e = user;
  (void)st;
  ucp_request_free(request);
  e->close_done = 1;
  ep_maybe_free(e);
}

static void ep_close_now(gpd_ucx_ep *e) {
  ucp_request_param_t p;
  void *req;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  p.cb.send = on_closed;
  p.user_data = e;
  e->close_started = 1;
  req = ucp_ep_close_nbx(e->ep, &p);
  /* Until the close completes UCX may still report the endpoint's failure to e. */
  if (req == NULL || UCS_PTR_IS_ERR(req)) {
    if (UCS_PTR_IS_ERR(req))
      GPUPOOL__DEBUG("peers: closing a UCX endpoint: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    e->close_done = 1;
    free(e);
    return;
  }
  kick(e->u);
}

void gpd_ucx_ep_close(gpd_ucx_ep *e) {
  if (!e)
    return;
  e->closed = 1;
  kick(e->u);
  ep_maybe_free(e);
}

int gpd_ucx_send(gpd_ucx_ep *e, const void *header, size_t hlen, const void *data, size_t len, gpd_ucx_reg *reg,
                 gpd_ucx_done done, void *arg) {
  ucp_request_param_t p;
  void *req;
  op *o;
  if (e->failed || e->closed)
    return gpupool__err(GPUPOOL_EPEER, "the UCX connection to the peer failed");
  if (hlen > sizeof o->hdr)
    return gpupool__err(GPUPOOL_EINVAL, "a data message header of %zu bytes", hlen);
  if (!(o = calloc(1, sizeof *o)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  o->u = e->u;
  o->done = done;
  o->arg = arg;
  memcpy(o->hdr, header, hlen);
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = on_sent;
  p.user_data = o;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  if (reg) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = reg->memh;
  }
  req = ucp_am_send_nbx(e->ep, AM_DATA, o->hdr, hlen, data, len, &p);
  if (UCS_PTR_IS_ERR(req)) {
    free(o);
    return ucs_err(UCS_PTR_STATUS(req), "sending to the peer (ucp_am_send_nbx)");
  }
  o->ep = e;
  e->ops++;
  if (req == NULL)
    complete(o, UCS_OK); /* done at once: handed out from the loop like the others */
  kick(e->u);
  return 0;
}

int gpd_ucx_defer(gpd_ucx *u, gpd_ucx_done done, void *arg) {
  op *o = calloc(1, sizeof *o);
  if (!o)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  o->u = u;
  o->done = done;
  o->arg = arg;
  complete(o, UCS_OK);
  kick(u);
  return 0;
}
