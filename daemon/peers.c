/*
 * Peers (see peers.h): the control plane between daemons and the fetches it runs.
 *
 * Control: one TCP connection (libuv) from a fetching daemon to each peer it fetches from,
 * carrying 4-byte little-endian length-prefixed PeerFrames (proto/gpupool.proto), each at most
 * peer_max_frame bytes. The fetching side says Hello (its nonce and its own peer_listen, by
 * which the serving side finds its [peer] section: the advertised address, else the source
 * address when one section alone has it), the serving side answers Challenge (its nonce and
 * HMAC-SHA256(secret, "gpupool peer server" | nonce_f | nonce_s)), the fetching side checks it
 * and answers Auth (the same with "gpupool peer client"), and the serving side checks that and
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
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "list.h"
#include "peers.h"
#include "peers_ucx.h"
#include "registry_internal.h"
#include "server_internal.h"
#include "sha256.h"

#define NONCE_LEN 32
#define AUTH_TIMEOUT_NS (5ull * 1000000000ull)
#define TICK_MS 100
#define MAX_SECRET 4096
#define MAX_WRITE_QUEUE (64u << 20)
#define READ_CHUNK (64u << 10)
/* A version is sent in messages of at most SEND_CHUNK bytes, SEND_WINDOW of them in flight:
 * the transfer is pipelined, and what one completion hands the loop stays small. */
#define SEND_CHUNK (1u << 20)
#define SEND_WINDOW 4
#define DATA_HDR 20 /* fetch id (8), buffer index (4), offset (8), little-endian */

enum { L_CONNECTING, L_AWAIT_HELLO, L_AWAIT_CHALLENGE, L_AWAIT_AUTH, L_AWAIT_WELCOME, L_AWAIT_EP, L_UP };
enum { S_IDLE, S_QUEUED, S_ASKED, S_TRANSFER };

typedef struct plink plink;
typedef struct sub sub;
typedef struct serve serve;

/* A configured [peer]: its secret, the connection to it (when fetching) and its counters. */
typedef struct {
  struct gpd_peers *P;
  const gpd_peer_conf *conf;
  uint8_t secret[MAX_SECRET];
  size_t secret_len;
  plink *out;             /* the connection this daemon opened to it, or NULL */
  char last_error[256];
  uint32_t in_flight;    /* fetches from it */
  uint64_t fetches, failures, bytes_fetched;
  uint64_t versions_served, bytes_served;
  uint32_t serving_now;
} peer;

struct plink {
  struct gpd_peers *P;
  uv_tcp_t tcp;
  uv_connect_t connect;
  uv_shutdown_t shutdown;
  int state;
  int outgoing;
  int closing;
  char why[256];         /* why it closes once what was sent is out */
  int flushing;          /* its endpoint's flush is in flight: freed once it ends */
  int freed_later;
  gpd_ucx_ep *ep;        /* incoming: to the fetching daemon's worker (the data goes there) */
  uint8_t *waddr;        /* incoming: that worker's address, from Hello */
  size_t waddr_len;
  peer *peer;            /* outgoing: the peer; incoming: once known from its Hello */
  char addr[64];         /* where it connects from / to, for logs */
  uint8_t nonce_mine[NONCE_LEN], nonce_theirs[NONCE_LEN];
  uint64_t since_ns;
  uint8_t *rbuf;
  size_t rlen, rcap;
  gpupool__hmap asked;   /* outgoing: PeerGet id -> sub */
  serve *serves;         /* incoming: the gets served or waiting */
  uint32_t nserves;
  plink *prev, *next;     /* in P->links */
};

/* A subscription: the fetches of one local name key. */
struct sub {
  struct gpd_peers *P;
  peer *peer;
  char *key, *local_name, *rtenant, *rname;
  uid_t uid;
  gid_t gid;
  int state;
  uint64_t id;           /* of the PeerGet in flight */
  plink *link;            /* that it went on */
  uint64_t deadline_ns;  /* the latest any getter waits to */
  uint64_t asked_ns, wait_ms, started_ns;
  uint64_t asked_newer; /* the newer_than the get asked the peer for */
  int asked_once;        /* a first PeerGet went out (later ones only while getters have time) */
  /* The transfer: a client of the daemon's own holding the local copy until published. */
  gpd_client cl;
  int cl_on;
  Gpupool__Wire__PeerFrame *rep;
  gpd_hold **holds;
  void **maps;
  size_t *maplens;
  uint32_t n;
  uint64_t bytes, received;
  int receiving;         /* in P->receiving under id */
  int complete;          /* every byte is in: finished from the loop */
  sub *prev, *next;      /* in P->subs */
};

/* A peer's get being served here: waiting for a version, or holding one until PeerDone. */
struct serve {
  plink *link;
  uint64_t id;
  char *key;
  uint64_t newer_than;
  uint64_t deadline_ns;
  int waiting;
  gpd_client cl;
  int cl_on;
  void **maps;
  size_t *maplens;
  gpd_ucx_reg **regs;
  uint64_t *lens;
  void **bases;
  uint32_t n;
  struct push *push;     /* while sending: what its sends' callbacks find it by */
  uint32_t cur_seg;      /* where the next message starts: buffer, and offset in it */
  uint64_t cur_off;
  serve *prev, *next;
};

/* A serve's sends in flight: their callbacks come from the loop, possibly after the serve
 * went; the last one frees this. */
struct push {
  serve *sv;             /* NULL once the serve went */
  uint32_t inflight;
};

struct gpd_peers {
  gpd_server *s;
  uv_loop_t *loop;
  const gpd_config *cfg;
  gpd_registry *reg;
  gpd_ucx *ucx;
  uv_tcp_t listener;
  int listening;
  uv_timer_t tick;
  peer peers[GPUPOOL_MAX_PEERS];
  int npeers;
  plink *links;
  gpupool__smap subs_by_key;
  sub *subs;
  uint64_t next_id;
  char listen_addr[64];
  int closing;           /* handles whose close callback has not come yet */
  gpupool__ratelimit log_rl; /* lines that connections to peer_listen cause */
  struct grave *graves;  /* served ranges a gone peer may still be reading */
  gpupool__hmap receiving; /* fetch id -> sub whose data is arriving */
  int finish_posted;     /* a deferred call will finish the subs whose data is all in */
};

static void link_close(plink *l, const char *why);
static void sub_next(sub *sb);
static void sub_fail_waiters(sub *sb, int code, const char *msg, int only_nowait);
static void serve_try(serve *sv);
static int want_key(gpd_peers *P, const char *local_name, const char *key, uid_t uid, gid_t gid,
                    const char *tenant_name, uint32_t wait_ms);

/* ---- helpers -------------------------------------------------------------------------------- */

static int same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b, int with_port) {
  if (a->ss_family != b->ss_family)
    return 0;
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
    return x->sin_addr.s_addr == y->sin_addr.s_addr && (!with_port || x->sin_port == y->sin_port);
  }
  if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
    return !memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr) && (!with_port || x->sin6_port == y->sin6_port);
  }
  return 0;
}

static void fmt_addr(const struct sockaddr_storage *a, char *buf, size_t len) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *x = (const void *)a;
    inet_ntop(AF_INET, &x->sin_addr, host, sizeof host);
    port = ntohs(x->sin_port);
  } else if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *x = (const void *)a;
    inet_ntop(AF_INET6, &x->sin6_addr, host, sizeof host);
    port = ntohs(x->sin6_port);
  }
  snprintf(buf, len, "%s:%d", host, port);
}

/* Read a secret file: at least 16 bytes, a regular file not readable by group or others. */
static int read_secret(const char *path, uint8_t *out, size_t *len) {
  struct stat st;
  ssize_t n;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
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

static void mac(const peer *p, const char *role, const uint8_t *nf, const uint8_t *ns, uint8_t out[32]) {
  const void *parts[] = {role, nf, ns};
  size_t lens[] = {strlen(role), NONCE_LEN, NONCE_LEN};
  gpupool__hmac_sha256(p->secret, p->secret_len, parts, lens, 3, out);
}

static uint64_t now_ns(void) { return gpd_now_ns(); }

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

/* ---- frames --------------------------------------------------------------------------------- */

typedef struct {
  uv_write_t req;
  uint8_t *buf;
} wreq;

static void on_written(uv_write_t *req, int status) {
  wreq *w = (wreq *)req;
  (void)status;
  free(w->buf);
  free(w);
}

static int send_frame(plink *l, const Gpupool__Wire__PeerFrame *f) {
  size_t len = gpupool__wire__peer_frame__get_packed_size(f);
  wreq *w;
  uv_buf_t b;
  if (l->closing)
    return GPUPOOL_ECLOSED;
  if (uv_stream_get_write_queue_size((uv_stream_t *)&l->tcp) > MAX_WRITE_QUEUE) {
    link_close(l, "it does not read what this daemon sends (over 64 MiB queued)");
    return GPUPOOL_ECLOSED;
  }
  if (!(w = calloc(1, sizeof *w)) || !(w->buf = malloc(len + 4))) {
    free(w);
    link_close(l, "out of memory in the daemon");
    return GPUPOOL_ENOMEM;
  }
  w->buf[0] = (uint8_t)len;
  w->buf[1] = (uint8_t)(len >> 8);
  w->buf[2] = (uint8_t)(len >> 16);
  w->buf[3] = (uint8_t)(len >> 24);
  gpupool__wire__peer_frame__pack(f, w->buf + 4);
  b = uv_buf_init((char *)w->buf, (unsigned)(len + 4));
  if (uv_write(&w->req, (uv_stream_t *)&l->tcp, &b, 1, on_written) != 0) {
    free(w->buf);
    free(w);
    link_close(l, "writing to it failed");
    return GPUPOOL_ECLOSED;
  }
  return 0;
}

static void send_error(plink *l, int code, const char *msg) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__Error e = GPUPOOL__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_ERROR;
  f.error = &e;
  send_frame(l, &f);
}

static void send_get_error(plink *l, uint64_t id, int code, const char *msg) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerGetReply r = GPUPOOL__WIRE__PEER_GET_REPLY__INIT;
  Gpupool__Wire__Error e = GPUPOOL__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  r.id = id;
  r.error = &e;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_GET_REPLY;
  f.get_reply = &r;
  send_frame(l, &f);
}

static void send_done(plink *l, uint64_t id) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerDone d = GPUPOOL__WIRE__PEER_DONE__INIT;
  d.id = id;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_DONE;
  f.done = &d;
  send_frame(l, &f);
}

/* ---- mapping a buffer's range of a host slab -------------------------------------------- */

/* Map and register [off, off + len) of fd: *base is where the range starts. */
static int map_range(gpd_peers *P, int fd, uint64_t off, uint64_t len, int writable, void **map, size_t *maplen,
                     void **base, gpd_ucx_reg **reg) {
  long page = sysconf(_SC_PAGESIZE);
  uint64_t start = off - off % (uint64_t)page;
  size_t ml = (size_t)(off + len - start);
  void *m;
  int rc;
  if (fd < 0)
    return gpupool__err(GPUPOOL_ENOTSUP, "peers move host pools only in this build: this pool's memory is not a "
                        "host slab the daemon can map (device pools are not fetched or served yet)");
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

static void graves_free(gpd_peers *P, uint64_t now, int all) {
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

static void serve_free_reading(serve *sv, int reading) {
  plink *l = sv->link;
  serve_release(sv, reading);
  GPUPOOL__LIST_UNLINK(l->serves, sv, prev, next);
  l->nserves--;
  free(sv->key);
  free(sv);
}

static void serve_free(serve *sv) { serve_free_reading(sv, 0); }

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
  int rc = 0;

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
  for (uint32_t i = 0; i < n->nbufs; i++) {
    gpd_buffer *b = n->bufs[i];
    gpd_hold *h = NULL;
    if ((rc = gpd_hold_new(reg, &sv->cl, b, 1, 0, &h)) != 0)
      goto fail;
    sv->n = i + 1;
    if ((rc = map_range(P, b->slab->bs.fd, b->offset, b->asked, 0, &sv->maps[i], &sv->maplens[i], &sv->bases[i],
                        &sv->regs[i])) != 0)
      goto fail;
    sv->lens[i] = b->asked;
    gpupool__wire__peer_segment__init(&segs[i]);
    segs[i].length = b->asked;
    segp[i] = &segs[i];
    bytes += b->asked;
  }
  if (n->layout) {
    uint32_t nm = n->layout->n;
    if (!(mem = calloc(nm, sizeof *mem)) || !(memp = calloc(nm, sizeof *memp)) ||
        !(metas = calloc(nm, sizeof *metas))) {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
      goto fail;
    }
    for (uint32_t i = 0; i < nm; i++) {
      const gpd_member *m = &n->layout->members[i];
      gpupool__wire__bundle_member__init(&mem[i]);
      mem[i].name = m->name;
      mem[i].buffer = m->buffer;
      mem[i].offset = m->offset;
      mem[i].size = m->size;
      if (m->meta) {
        gpupool__wire_meta_to(m->meta, &metas[i]);
        mem[i].tensor = &metas[i];
      }
      memp[i] = &mem[i];
    }
    r.n_members = nm;
    r.members = memp;
    r.bundle = 1;
  } else if (n->has_meta) {
    gpupool__wire_meta_to(&n->meta, &tensor);
    r.tensor = &tensor;
  }
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
  send_frame(l, &f);
  goto out;
fail:
  {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    send_get_error(l, sv->id, rc, msg);
    serve_free(sv);
  }
out:
  free(segs);
  free(segp);
  free(mem);
  free(memp);
  free(metas);
}

static void on_chunk_sent(void *arg, int status);

/* Send sv's data until SEND_WINDOW messages are in flight or all of it is on its way. */
static void post_sends(serve *sv) {
  plink *l = sv->link;
  while (sv->push->inflight < SEND_WINDOW && sv->cur_seg < sv->n) {
    uint64_t len = sv->lens[sv->cur_seg] - sv->cur_off < SEND_CHUNK ? sv->lens[sv->cur_seg] - sv->cur_off : SEND_CHUNK;
    uint8_t hdr[DATA_HDR];
    int rc;
    for (int i = 0; i < 8; i++)
      hdr[i] = (uint8_t)(sv->id >> (8 * i));
    for (int i = 0; i < 4; i++)
      hdr[8 + i] = (uint8_t)(sv->cur_seg >> (8 * i));
    for (int i = 0; i < 8; i++)
      hdr[12 + i] = (uint8_t)(sv->cur_off >> (8 * i));
    rc = gpd_ucx_send(l->ep, hdr, sizeof hdr, (uint8_t *)sv->bases[sv->cur_seg] + sv->cur_off, len,
                      sv->regs[sv->cur_seg], on_chunk_sent, sv->push);
    if (rc != 0) {
      char why[GPUPOOL__ERRMSG_MAX];
      snprintf(why, sizeof why, "sending it data failed: %s", gpupool__errmsg());
      link_close(l, why);
      return;
    }
    sv->push->inflight++;
    sv->cur_off += len;
    if (sv->cur_off == sv->lens[sv->cur_seg]) {
      sv->cur_seg++;
      sv->cur_off = 0;
    }
  }
}

static void on_chunk_sent(void *arg, int status) {
  struct push *pu = arg;
  serve *sv = pu->sv;
  pu->inflight--;
  if (!sv) {
    if (!pu->inflight)
      free(pu);
    return;
  }
  if (status != 0) {
    char why[GPUPOOL__ERRMSG_MAX];
    snprintf(why, sizeof why, "sending it data failed: %s", gpupool__errmsg());
    link_close(sv->link, why);
    return;
  }
  post_sends(sv);
}

/* The fetching side has its copy allocated: send the data. */
static void on_peer_ready(plink *l, uint64_t id) {
  for (serve *sv = l->serves; sv; sv = sv->next)
    if (sv->id == id && sv->cl_on && !sv->push) {
      if (!(sv->push = calloc(1, sizeof *sv->push))) {
        link_close(l, "out of memory in the daemon");
        return;
      }
      sv->push->sv = sv;
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
    if (slash && !strncmp(sv->key, "tenant:", 7) && gpd_peers_is_remote(P->s, slash + 1)) {
      const gpd_config *cfg = P->cfg;
      for (int t = 0; t < cfg->n_tenants; t++)
        if ((size_t)(slash - sv->key - 7) == strlen(cfg->tenants[t].name) &&
            !strncmp(sv->key + 7, cfg->tenants[t].name, (size_t)(slash - sv->key - 7))) {
          const gpd_member_set *m = &cfg->tenants[t];
          uid_t uid = m->n_uids ? m->uids[0] : 0;
          gid_t gid = m->n_uids ? 0 : (m->n_gids ? m->gids[0] : 0);
          uint64_t left = (sv->deadline_ns - now_ns()) / 1000000;
          if (want_key(P, slash + 1, sv->key, uid, gid, m->name, (uint32_t)left) != 0) {
            char msg[GPUPOOL__ERRMSG_MAX];
            snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
            send_get_error(sv->link, sv->id, GPUPOOL_EPEER, msg);
            serve_free(sv);
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
    send_get_error(sv->link, sv->id, GPUPOOL_ENOENT, msg);
    serve_free(sv);
  }
}

static void on_peer_get(plink *l, const Gpupool__Wire__PeerGet *m) {
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
    send_get_error(l, m->id, GPUPOOL_ELIMIT, msg);
    return;
  }
  if (gpupool__wire_check_name(name) != 0) {
    send_get_error(l, m->id, GPUPOOL_ENAME, gpupool__errmsg());
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
    send_get_error(l, m->id, GPUPOOL_ENOENT, msg);
    return;
  }
  if (!(sv = calloc(1, sizeof *sv)) || !(sv->key = strdup(key))) {
    free(sv);
    send_get_error(l, m->id, GPUPOOL_ENOMEM, "out of memory in the daemon");
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

static void on_peer_done(plink *l, uint64_t id) {
  for (serve *sv = l->serves; sv; sv = sv->next)
    if (sv->id == id) {
      serve_free(sv);
      return;
    }
}

/* Try again the waiting serves of key (NULL: every waiting serve) past version (0: any) whose
 * deadline passed or whose name moved on. Answering one may end others (a failed fetch answers
 * every serve of its name), so the matches are taken by id first and looked up again each
 * time; connections are freed only from their close callbacks, never inside this loop. */
static void serves_retry(gpd_peers *P, const char *key, uint64_t version, uint64_t now) {
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
    serves_retry(s->peers, key, version, 0);
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

int gpd_peers_is_remote(gpd_server *s, const char *name) {
  const char *rest;
  return s->peers && route(s->peers, name, &rest) != NULL;
}

static void sub_free(sub *sb) {
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
static void sub_release(sub *sb) {
  if (sb->receiving) {
    gpupool__hmap_del(&sb->P->receiving, sb->id);
    sb->receiving = 0;
  }
  for (uint32_t i = 0; i < sb->n; i++)
    if (sb->maps && sb->maps[i])
      munmap(sb->maps[i], sb->maplens[i]);
  free(sb->maps);
  free(sb->maplens);
  free(sb->holds);
  sb->maps = NULL, sb->maplens = NULL, sb->holds = NULL, sb->n = 0;
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
static void sub_ask(sub *sb) {
  gpd_peers *P = sb->P;
  plink *l = sb->peer->out;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerGet g = GPUPOOL__WIRE__PEER_GET__INIT;
  uint64_t min_newer = UINT64_MAX, now = now_ns();
  gpd_name *n = gpupool__smap_get(&P->reg->names, sb->key);
  uint32_t waiters = local_waiters(P->s, sb->key, &min_newer) + serve_waiters(P, sb->key, &min_newer);
  if (!waiters) {
    sub_free(sb);
    return;
  }
  if (n && n->version > min_newer)
    min_newer = n->version;
  /* The fetch's id names it in the data messages the source sends to this daemon's UCX
   * worker, which any peer that learnt the worker's address can send to: an id another peer
   * could guess (a counter) would let it fill someone else's fetch with bytes of its own. A
   * random 64-bit id, unique among this daemon's fetches, cannot be guessed. */
  do {
    if (getrandom(&sb->id, sizeof sb->id, 0) != (ssize_t)sizeof sb->id)
      sb->id = ++P->next_id ^ (now * 0x9E3779B97F4A7C15ull); /* no entropy: still unique below */
  } while (!sb->id || gpupool__hmap_get(&l->asked, sb->id) || gpupool__hmap_get(&P->receiving, sb->id));
  if (gpupool__hmap_put(&l->asked, sb->id, sb) != 0) {
    sub_fail_waiters(sb, GPUPOOL_ENOMEM, "out of memory in the daemon", 0);
    sub_free(sb);
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
  send_frame(l, &f);
}

static void link_connect(gpd_peers *P, peer *p);

/* Next step of a subscription whose last fetch ended: ask again while getters wait. */
static void sub_next(sub *sb) {
  uint64_t min_newer = UINT64_MAX;
  gpd_peers *P = sb->P;
  if (sb->state != S_IDLE)
    return;
  if (!local_waiters(P->s, sb->key, &min_newer) && !serve_waiters(P, sb->key, &min_newer)) {
    sub_free(sb);
    return;
  }
  if (sb->asked_once && now_ns() >= sb->deadline_ns) {
    sub_free(sb); /* the waiters time out on their own */
    return;
  }
  if (sb->peer->out && sb->peer->out->state == L_UP) {
    sub_ask(sb);
    return;
  }
  sb->state = S_QUEUED;
  if (!sb->peer->out)
    link_connect(P, sb->peer);
}

/* Answer the waiters of sb's key (local getters and peers' gets) with an error; only_nowait:
 * only the gets that asked not to wait. */
static void sub_fail_waiters(sub *sb, int code, const char *msg, int only_nowait) {
  gpd_peers *P = sb->P;
  gpd_fail_getters(P->s, sb->key, code, msg, only_nowait);
  if (only_nowait)
    return;
  for (plink *l = P->links; l; l = l->next) {
    serve *sv = l->serves, *next;
    for (; sv; sv = next) {
      next = sv->next;
      if (sv->waiting && !strcmp(sv->key, sb->key)) {
        send_get_error(l, sv->id, code, msg);
        serve_free(sv);
      }
    }
  }
}

static void sub_failed(sub *sb, int code, const char *msg) {
  sb->peer->failures++;
  snprintf(sb->peer->last_error, sizeof sb->peer->last_error, "%s", msg);
  GPUPOOL__WARN("peers: %s", msg);
  sub_fail_waiters(sb, code, msg, 0);
  sub_release(sb);
  sub_free(sb);
}

/* Every byte of the local copy is in: publish it (or drop it when nobody waits any more). */
static void sub_finish(sub *sb) {
  gpd_peers *P = sb->P;
  gpd_registry *reg = P->reg;
  Gpupool__Wire__PeerGetReply *r = sb->rep->get_reply;
  uint64_t version = 0, min_newer = UINT64_MAX;
  char msg[GPUPOOL__ERRMSG_MAX + 256];
  int rc;

  if (sb->link && !sb->link->closing)
    send_done(sb->link, sb->id);
  if (!local_waiters(P->s, sb->key, &min_newer) && !serve_waiters(P, sb->key, &min_newer)) {
    GPUPOOL__DEBUG("peers: fetched %s v%" PRIu64 " but nobody waits for it any more: dropped", sb->local_name,
                   r->version);
    sub_release(sb);
    sub_free(sb);
    return;
  }
  if (r->bundle) {
    uint64_t *ids = calloc(sb->n, sizeof *ids);
    if (!ids) {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    } else {
      for (uint32_t i = 0; i < sb->n; i++)
        ids[i] = sb->holds[i]->id;
      rc = gpd_publish_bundle(reg, &sb->cl, sb->local_name, ids, sb->n, r->members, r->n_members, 0, &version);
      free(ids);
    }
  } else {
    rc = gpd_publish(reg, &sb->cl, sb->holds[0]->id, sb->local_name, r->tensor, 0, 0, &version);
  }
  if (rc != 0) {
    snprintf(msg, sizeof msg, "fetch of %s:%s v%" PRIu64 " failed: publishing the local copy: %s", sb->peer->conf->name,
             sb->rname, r->version, gpupool__errmsg());
    sub_failed(sb, rc, msg);
    return;
  }
  {
    /* The local version is the peer's. */
    gpd_name *n = gpupool__smap_get(&reg->names, sb->key);
    if (n)
      n->version = r->version;
  }
  sb->peer->fetches++;
  sb->peer->bytes_fetched += sb->bytes;
  GPUPOOL__INFO("peers: fetched %s v%" PRIu64 " from %s (%" PRIu64 " bytes in %" PRIu64 " us)", sb->local_name,
                r->version, sb->peer->conf->name, sb->bytes, (now_ns() - sb->started_ns) / 1000);
  version = r->version;
  sub_release(sb);
  gpd_wake_getters(P->s, sb->key, version);
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
static void on_data(void *arg, const void *header, size_t hlen, const void *data, size_t len) {
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
  {
    const Gpupool__Wire__PeerSegment *sg = sb->rep->get_reply->segments[seg];
    long page = sysconf(_SC_PAGESIZE);
    if (off > sg->length || len > sg->length - off || len > sb->bytes - sb->received)
      return; /* not a range of the fetch: dropped (the fetch then times out) */
    memcpy((uint8_t *)sb->maps[seg] + (sb->holds[seg]->buf->offset % (uint64_t)page) + off, data, len);
  }
  sb->received += len;
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

/* The peer answered with a version: allocate the local copy and ask for the data. */
static void sub_transfer(sub *sb, Gpupool__Wire__PeerFrame *fr) {
  gpd_peers *P = sb->P;
  Gpupool__Wire__PeerGetReply *r = fr->get_reply;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerReady rd = GPUPOOL__WIRE__PEER_READY__INIT;
  gpd_pool *pool = copy_pool(P);
  uint64_t min_newer = UINT64_MAX;
  char msg[GPUPOOL__ERRMSG_MAX + 256];
  int rc;

  sb->rep = fr;
  sb->state = S_TRANSFER;
  sb->started_ns = now_ns();
  if (!local_waiters(P->s, sb->key, &min_newer) && !serve_waiters(P, sb->key, &min_newer)) {
    send_done(sb->link, sb->id);
    sub_release(sb);
    sub_free(sb);
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
  if (!(sb->holds = calloc(r->n_segments, sizeof *sb->holds)) || !(sb->maps = calloc(r->n_segments, sizeof *sb->maps)) ||
      !(sb->maplens = calloc(r->n_segments, sizeof *sb->maplens))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  sb->bytes = 0;
  sb->received = 0;
  for (uint32_t i = 0; i < r->n_segments; i++) {
    const Gpupool__Wire__PeerSegment *sg = r->segments[i];
    gpd_hold *h = NULL;
    long page = sysconf(_SC_PAGESIZE);
    uint64_t start;
    if (!sg->length) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the peer's answer has an empty buffer");
      goto fail;
    }
    if ((rc = gpd_allocate(P->reg, &sb->cl, pool, sg->length, 0, &h)) != 0)
      goto fail;
    sb->holds[i] = h;
    sb->n = i + 1;
    if (h->buf->slab->bs.fd < 0) {
      rc = gpupool__err(GPUPOOL_ENOTSUP, "peers move host pools only in this build: this pool's memory is not a "
                        "host slab the daemon can map (device pools are not fetched or served yet)");
      goto fail;
    }
    start = h->buf->offset - h->buf->offset % (uint64_t)page;
    sb->maplens[i] = (size_t)(h->buf->offset + sg->length - start);
    sb->maps[i] = mmap(NULL, sb->maplens[i], PROT_READ | PROT_WRITE, MAP_SHARED, h->buf->slab->bs.fd, (off_t)start);
    if (sb->maps[i] == MAP_FAILED) {
      sb->maps[i] = NULL;
      rc = gpupool__err(GPUPOOL_EBACKEND, "cannot map %zu bytes of a slab for a peer transfer: %s", sb->maplens[i],
                        strerror(errno));
      goto fail;
    }
    sb->bytes += sg->length;
  }
  if (gpupool__hmap_put(&P->receiving, sb->id, sb) != 0) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  sb->receiving = 1;
  rd.id = sb->id;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_READY;
  f.ready = &rd;
  send_frame(sb->link, &f);
  return;
fail:
  snprintf(msg, sizeof msg, "fetch of %s:%s v%" PRIu64 " (%" PRIu64 " bytes) failed: %s", sb->peer->conf->name,
           sb->rname, r->version, sb->bytes, gpupool__errmsg());
  send_done(sb->link, sb->id);
  sub_failed(sb, rc, msg);
}

static void on_get_reply(plink *l, Gpupool__Wire__PeerFrame *fr) {
  Gpupool__Wire__PeerGetReply *r = fr->get_reply;
  sub *sb = gpupool__hmap_del(&l->asked, r->id);
  char msg[GPUPOOL__ERRMSG_MAX + 256];
  if (!sb) {
    if (!r->error)
      send_done(l, r->id);
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
      sub_fail_waiters(sb, code, msg, 1);
      sub_next(sb);
    } else {
      sb->peer->in_flight++;
      sb->state = S_ASKED;
      sub_failed(sb, code, msg);
    }
    return;
  }
  if (r->version <= sb->asked_newer) {
    /* A peer that answers with a version not newer than asked would make this daemon publish
     * older bytes over newer ones, and fetch again and again. */
    snprintf(msg, sizeof msg, "peer %s answered '%s' with version %" PRIu64 ", not newer than the %" PRIu64
             " asked for (a peer daemon that does not follow the protocol; check its version)",
             l->peer->conf->name, sb->rname, r->version, sb->asked_newer);
    send_done(l, r->id);
    gpupool__wire__peer_frame__free_unpacked(fr, NULL);
    sub_failed(sb, GPUPOOL_EPROTO, msg);
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
static int want_key(gpd_peers *P, const char *local_name, const char *key, uid_t uid, gid_t gid,
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

int gpd_peers_want(gpd_server *s, gpd_conn *c, const char *name, uint64_t newer_than, uint32_t wait_ms) {
  gpd_peers *P = s->peers;
  char key[GPUPOOL_NAME_KEY_MAX + 1], tn[64];
  uint64_t owner;
  int rc;
  (void)newer_than;
  if (!P)
    return gpupool__err(GPUPOOL_ENOENT, "no peers");
  if ((rc = gpd_name_key(s->reg, &c->cl, name, key, sizeof key, &owner)) != 0)
    return rc;
  tenant_name(P, &c->cl, tn, sizeof tn);
  return want_key(P, name, key, c->cl.uid, c->cl.gid, tn, wait_ms);
}

/* ---- connections ---------------------------------------------------------------------------- */

static void link_freed(uv_handle_t *h) {
  plink *l = h->data;
  gpupool__hmap_free(&l->asked);
  free(l->waddr);
  free(l->rbuf);
  free(l);
}

static void link_close(plink *l, const char *why) {
  gpd_peers *P = l->P;
  peer *p = l->peer;
  if (l->closing)
    return;
  l->closing = 1;
  if (l->outgoing) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", why);
    if (p) {
      snprintf(p->last_error, sizeof p->last_error, "%s", why);
      p->out = NULL;
    }
    GPUPOOL__WARN("peers: connection to %s (%s) closed: %s", p ? p->conf->name : "?", l->addr, why);
    /* Fetches in flight on it fail, and their local copies go: this side only receives, so
     * nothing of UCX's still refers to them (late data finds no fetch under its id). */
    for (sub *sb = P->subs, *next; sb; sb = next) {
      char m2[GPUPOOL__ERRMSG_MAX + 256];
      next = sb->next;
      if (sb->peer != p || sb->state == S_IDLE)
        continue;
      if (sb->state == S_TRANSFER)
        snprintf(m2, sizeof m2, "fetch of %s:%s v%" PRIu64 " failed: peer %s closed the connection mid-transfer (%s); "
                 "retry", p->conf->name, sb->rname, sb->rep->get_reply->version, p->conf->name, why);
      else if (sb->state == S_QUEUED)
        snprintf(m2, sizeof m2, "%s", msg);
      else
        snprintf(m2, sizeof m2, "fetch of %s:%s failed: peer %s closed the connection (%s); retry", p->conf->name,
                 sb->rname, p->conf->name, why);
      sb->link = NULL;
      sub_failed(sb, GPUPOOL_EPEER, m2);
    }
  } else {
    if (p)
      GPUPOOL__PEER_INFO(&P->log_rl, 0, "peers: connection from %s (%s) closed: %s", p->conf->name, l->addr, why);
    else
      GPUPOOL__PEER_INFO(&P->log_rl, 0, "peers: connection from %s closed: %s", l->addr, why);
    while (l->serves)
      serve_free_reading(l->serves, 1);
    if (l->ep) {
      gpd_ucx_ep_close(l->ep);
      l->ep = NULL;
    }
  }
  GPUPOOL__LIST_UNLINK(P->links, l, prev, next);
  uv_read_stop((uv_stream_t *)&l->tcp);
  l->tcp.data = l;
  if (l->flushing) {
    l->freed_later = 1; /* the flush's callback (the endpoint was closed: it comes) frees it */
    return;
  }
  uv_close((uv_handle_t *)&l->tcp, link_freed);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  plink *l = req->data;
  (void)status;
  link_close(l, l->why);
}

/* Close once what was sent is out (the Error that says why). */
static void link_close_after_send(plink *l, const char *why) {
  snprintf(l->why, sizeof l->why, "%s", why);
  l->shutdown.data = l;
  uv_read_stop((uv_stream_t *)&l->tcp);
  if (uv_shutdown(&l->shutdown, (uv_stream_t *)&l->tcp, on_shutdown) != 0)
    link_close(l, l->why);
}

static void auth_failed(plink *l, const char *who) {
  char msg[256];
  snprintf(msg, sizeof msg, "peer %s: peer authentication failed: wrong secret (check secret_file on both daemons)",
           who);
  if (l->outgoing)
    GPUPOOL__WARN("peers: %s (%s)", msg, l->addr);
  else
    GPUPOOL__PEER_WARN(&l->P->log_rl, 0, "peers: %s (%s)", msg, l->addr);
  if (l->peer)
    snprintf(l->peer->last_error, sizeof l->peer->last_error, "%s", msg);
}

static void on_hello(plink *l, const Gpupool__Wire__PeerHello *m) {
  gpd_peers *P = l->P;
  struct sockaddr_storage src, adv;
  int len = sizeof src, found = -1, by_ip = 0;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerChallenge ch = GPUPOOL__WIRE__PEER_CHALLENGE__INIT;
  uint8_t macv[32];
  char msg[256];

  if (m->protocol != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION || m->nonce.len != NONCE_LEN) {
    if (m->protocol != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION)
      snprintf(msg, sizeof msg, "protocol %u, this daemon speaks %d: run the same gpupool version on both",
               m->protocol, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
    else
      snprintf(msg, sizeof msg, "its Hello has a nonce of %zu bytes, not %d: not a gpupoold of this version",
               m->nonce.len, NONCE_LEN);
    send_error(l, GPUPOOL_EVERSION, msg);
    GPUPOOL__PEER_WARN(&P->log_rl, 0, "peers: %s refused: %s", l->addr, msg);
    link_close_after_send(l, msg);
    return;
  }
  memcpy(l->nonce_theirs, m->nonce.data, NONCE_LEN);
  if (!m->worker_address.len || m->worker_address.len > 4096 || !(l->waddr = malloc(m->worker_address.len))) {
    link_close(l, "its Hello has no usable UCX worker address");
    return;
  }
  memcpy(l->waddr, m->worker_address.data, m->worker_address.len);
  l->waddr_len = m->worker_address.len;
  memset(&src, 0, sizeof src);
  uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&src, &len);
  if (m->listen && *m->listen && gpd_parse_hostport(m->listen, "listen", &adv) == 0)
    for (int i = 0; i < P->npeers; i++)
      if (same_addr(&P->peers[i].conf->addr, &adv, 1))
        found = i;
  if (found < 0)
    for (int i = 0; i < P->npeers; i++)
      if (same_addr(&P->peers[i].conf->addr, &src, 0)) {
        by_ip++;
        found = i;
      }
  if (found < 0 || by_ip > 1) {
    if (by_ip > 1)
      snprintf(msg, sizeof msg, "%d [peer] sections match %s's address and its Hello names no peer_listen to tell "
               "them apart; set peer_listen on that daemon", by_ip, l->addr);
    else
      snprintf(msg, sizeof msg, "this daemon has no [peer] section for %s (listening at '%s'); add one with its "
               "address and secret", l->addr, m->listen ? m->listen : "");
    GPUPOOL__PEER_WARN(&P->log_rl, 0, "peers: connection from %s refused: %s", l->addr, msg);
    send_error(l, GPUPOOL_EPERM, msg);
    link_close_after_send(l, msg);
    return;
  }
  l->peer = &P->peers[found];
  if (getrandom(l->nonce_mine, NONCE_LEN, 0) != NONCE_LEN) {
    link_close(l, "no random bytes for a nonce");
    return;
  }
  mac(l->peer, "gpupool peer server", l->nonce_theirs, l->nonce_mine, macv);
  ch.nonce.data = l->nonce_mine;
  ch.nonce.len = NONCE_LEN;
  ch.mac.data = macv;
  ch.mac.len = sizeof macv;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_CHALLENGE;
  f.challenge = &ch;
  l->state = L_AWAIT_AUTH;
  send_frame(l, &f);
}

static void on_challenge(plink *l, const Gpupool__Wire__PeerChallenge *m) {
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerAuth a = GPUPOOL__WIRE__PEER_AUTH__INIT;
  uint8_t want[32], macv[32];
  int ok;
  if (m->nonce.len != NONCE_LEN || m->mac.len != 32) {
    link_close(l, "malformed challenge");
    return;
  }
  memcpy(l->nonce_theirs, m->nonce.data, NONCE_LEN);
  mac(l->peer, "gpupool peer server", l->nonce_mine, l->nonce_theirs, want);
  ok = gpupool__ct_equal(want, m->mac.data, 32);
  /* Answer even when the peer's proof is wrong, so that it logs the failure too. */
  mac(l->peer, "gpupool peer client", l->nonce_mine, l->nonce_theirs, macv);
  a.mac.data = macv;
  a.mac.len = sizeof macv;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_AUTH;
  f.auth = &a;
  send_frame(l, &f);
  if (!ok) {
    char why[256];
    auth_failed(l, l->peer->conf->name);
    snprintf(why, sizeof why, "%s", l->peer->last_error);
    link_close_after_send(l, why);
    return;
  }
  l->state = L_AWAIT_WELCOME;
}

/* The serving side's UCX endpoint to the fetching daemon is connected both ways: say Welcome.
 * (A peer that went away while UCX was still setting up trips an assertion in UCX 1.13's error
 * path; no data moves before that is over.) */
static void on_ep_ready(void *arg, int status) {
  plink *l = arg;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerWelcome w = GPUPOOL__WIRE__PEER_WELCOME__INIT;
  l->flushing = 0;
  if (l->closing) {
    if (l->freed_later)
      uv_close((uv_handle_t *)&l->tcp, link_freed);
    return;
  }
  if (status != 0) {
    char why[GPUPOOL__ERRMSG_MAX];
    snprintf(why, sizeof why, "its UCX worker cannot be reached: %s", gpupool__errmsg());
    link_close(l, why);
    return;
  }
  w.you_are = (char *)l->peer->conf->name;
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_WELCOME;
  f.welcome = &w;
  l->state = L_UP;
  GPUPOOL__INFO("peers: %s authenticated from %s", l->peer->conf->name, l->addr);
  send_frame(l, &f);
}

static void on_auth(plink *l, const Gpupool__Wire__PeerAuth *m) {
  gpd_peers *P = l->P;
  uint8_t want[32];
  int rc;
  mac(l->peer, "gpupool peer client", l->nonce_theirs, l->nonce_mine, want);
  if (m->mac.len != 32 || !gpupool__ct_equal(want, m->mac.data, 32)) {
    auth_failed(l, l->peer->conf->name);
    send_error(l, GPUPOOL_EPERM, "peer authentication failed: wrong secret (check secret_file on both daemons)");
    link_close_after_send(l, "peer authentication failed: wrong secret");
    return;
  }
  if ((rc = gpd_ucx_ep_new(P->ucx, l->waddr, l->waddr_len, &l->ep)) != 0 ||
      (rc = gpd_ucx_ep_flush(l->ep, on_ep_ready, l)) != 0) {
    char why[GPUPOOL__ERRMSG_MAX];
    snprintf(why, sizeof why, "its UCX worker cannot be reached: %s", gpupool__errmsg());
    link_close(l, why);
    return;
  }
  l->flushing = 1;
  l->state = L_AWAIT_EP;
}

static void on_welcome(plink *l, const Gpupool__Wire__PeerWelcome *m) {
  gpd_peers *P = l->P;
  peer *p = l->peer;
  (void)m;
  l->state = L_UP;
  p->last_error[0] = '\0';
  GPUPOOL__INFO("peers: connected to %s at %s", p->conf->name, l->addr);
  /* Asking may close the connection (and fail the others): look for the next one afresh. */
  for (;;) {
    sub *sb = P->subs;
    while (sb && !(sb->peer == p && sb->state == S_QUEUED))
      sb = sb->next;
    if (!sb || p->out != l || l->closing)
      break;
    sb->state = S_IDLE;
    sub_ask(sb);
  }
}

static void on_frame(plink *l, const uint8_t *buf, size_t len) {
  Gpupool__Wire__PeerFrame *f = gpupool__wire__peer_frame__unpack(NULL, len, buf);
  int keep = 0;
  if (!f) {
    link_close(l, "it sent a frame that does not decode");
    return;
  }
  switch (l->state) {
  case L_AWAIT_HELLO:
    if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_HELLO)
      on_hello(l, f->hello);
    else
      link_close(l, "it did not start with Hello");
    break;
  case L_AWAIT_AUTH:
    if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_AUTH)
      on_auth(l, f->auth);
    else
      link_close(l, "it did not authenticate");
    break;
  case L_AWAIT_CHALLENGE:
  case L_AWAIT_WELCOME:
    if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_CHALLENGE && l->state == L_AWAIT_CHALLENGE) {
      on_challenge(l, f->challenge);
    } else if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_WELCOME && l->state == L_AWAIT_WELCOME) {
      on_welcome(l, f->welcome);
    } else if (f->body_case == GPUPOOL__WIRE__PEER_FRAME__BODY_ERROR) {
      char why[GPUPOOL__ERRMSG_MAX];
      snprintf(why, sizeof why, "peer %s refused this daemon: %s", l->peer->conf->name,
               f->error->message ? f->error->message : "");
      GPUPOOL__WARN("peers: %s", why);
      link_close(l, why);
    } else {
      link_close(l, "it broke the authentication exchange");
    }
    break;
  case L_UP:
    switch (f->body_case) {
    case GPUPOOL__WIRE__PEER_FRAME__BODY_GET:
      if (!l->outgoing)
        on_peer_get(l, f->get);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_DONE:
      if (!l->outgoing)
        on_peer_done(l, f->done->id);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_READY:
      if (!l->outgoing)
        on_peer_ready(l, f->ready->id);
      break;
    case GPUPOOL__WIRE__PEER_FRAME__BODY_GET_REPLY:
      if (l->outgoing) {
        on_get_reply(l, f);
        keep = 1;
      }
      break;
    default:
      break;
    }
    break;
  default:
    link_close(l, "it spoke before the connection was set up");
  }
  if (!keep)
    gpupool__wire__peer_frame__free_unpacked(f, NULL);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  plink *l = h->data;
  (void)suggested;
  if (l->rcap - l->rlen < READ_CHUNK) {
    size_t ncap = l->rlen + READ_CHUNK;
    uint8_t *n = realloc(l->rbuf, ncap);
    if (!n) {
      *buf = uv_buf_init(NULL, 0);
      return;
    }
    l->rbuf = n;
    l->rcap = ncap;
  }
  *buf = uv_buf_init((char *)l->rbuf + l->rlen, (unsigned)(l->rcap - l->rlen));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  plink *l = st->data;
  size_t off = 0;
  (void)buf;
  if (nread < 0) {
    link_close(l, nread == UV_EOF ? "the peer closed it" : uv_strerror((int)nread));
    return;
  }
  l->rlen += (size_t)nread;
  while (!l->closing && l->rlen - off >= 4) {
    const uint8_t *p = l->rbuf + off;
    uint32_t len = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    uint32_t cap = l->state == L_UP ? l->P->cfg->peer_max_frame : 4096;
    if (len > cap) {
      char why[128];
      snprintf(why, sizeof why, "it sent a frame of %u bytes, over the %u allowed (peer_max_frame)", len, cap);
      link_close(l, why);
      return;
    }
    if (l->rlen - off < 4 + (size_t)len)
      break;
    on_frame(l, p + 4, len);
    off += 4 + (size_t)len;
  }
  if (l->closing)
    return;
  if (off) {
    memmove(l->rbuf, l->rbuf + off, l->rlen - off);
    l->rlen -= off;
  }
}

static plink *link_new(gpd_peers *P) {
  plink *l = calloc(1, sizeof *l);
  if (!l)
    return NULL;
  l->P = P;
  l->since_ns = now_ns();
  gpupool__hmap_init(&l->asked);
  uv_tcp_init(P->loop, &l->tcp);
  l->tcp.data = l;
  uv_tcp_nodelay(&l->tcp, 1);
  l->next = P->links;
  if (P->links)
    P->links->prev = l;
  P->links = l;
  return l;
}

static void on_connected(uv_connect_t *req, int status) {
  plink *l = req->data;
  gpd_peers *P = l->P;
  Gpupool__Wire__PeerFrame f = GPUPOOL__WIRE__PEER_FRAME__INIT;
  Gpupool__Wire__PeerHello h = GPUPOOL__WIRE__PEER_HELLO__INIT;
  if (l->closing)
    return;
  if (status < 0) {
    char why[256];
    snprintf(why, sizeof why, "peer %s unreachable at %s: %s (is gpupoold running there with peer_listen?)",
             l->peer->conf->name, l->peer->conf->address, uv_strerror(status));
    link_close(l, why);
    return;
  }
  if (getrandom(l->nonce_mine, NONCE_LEN, 0) != NONCE_LEN) {
    link_close(l, "no random bytes for a nonce");
    return;
  }
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
  h.protocol = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  h.nonce.data = l->nonce_mine;
  h.nonce.len = NONCE_LEN;
  h.listen = P->listen_addr;
  {
    const void *addr;
    size_t alen;
    gpd_ucx_address(P->ucx, &addr, &alen);
    h.worker_address.data = (uint8_t *)addr;
    h.worker_address.len = alen;
  }
  f.body_case = GPUPOOL__WIRE__PEER_FRAME__BODY_HELLO;
  f.hello = &h;
  l->state = L_AWAIT_CHALLENGE;
  send_frame(l, &f);
}

static void link_connect(gpd_peers *P, peer *p) {
  plink *l = link_new(P);
  int rc;
  if (!l) {
    GPUPOOL__WARN("peers: out of memory connecting to %s", p->conf->name);
    return;
  }
  l->outgoing = 1;
  l->peer = p;
  l->state = L_CONNECTING;
  snprintf(l->addr, sizeof l->addr, "%s", p->conf->address);
  p->out = l;
  l->connect.data = l;
  /* A connect that fails at once is closed by the next tick: its caller may be walking lists
   * that closing it would change. */
  if ((rc = uv_tcp_connect(&l->connect, &l->tcp, (const struct sockaddr *)&p->conf->addr, on_connected)) != 0)
    snprintf(l->why, sizeof l->why, "peer %s unreachable at %s: %s (is gpupoold running there with peer_listen?)",
             p->conf->name, p->conf->address, uv_strerror(rc));
}

static void on_accept(uv_stream_t *server, int status) {
  gpd_peers *P = server->data;
  struct sockaddr_storage src;
  int len = sizeof src;
  plink *l;
  if (status < 0)
    return;
  if (!(l = link_new(P)))
    return;
  if (uv_accept(server, (uv_stream_t *)&l->tcp) != 0) {
    link_close(l, "accept failed");
    return;
  }
  memset(&src, 0, sizeof src);
  uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&src, &len);
  fmt_addr(&src, l->addr, sizeof l->addr);
  l->state = L_AWAIT_HELLO;
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
}

/* Timeouts: authentication, peers' waiting gets, fetches. */
static void on_tick(uv_timer_t *t) {
  gpd_peers *P = t->data;
  uint64_t now = now_ns(), limit = (uint64_t)P->cfg->peer_fetch_timeout_ms * 1000000ull;
  for (plink *l = P->links, *next; l; l = next) {
    next = l->next;
    if (l->state != L_UP && (l->why[0] || now - l->since_ns > AUTH_TIMEOUT_NS)) {
      link_close(l, l->why[0] ? l->why
                    : l->state == L_CONNECTING ? "no connection within 5 s" : "no authentication within 5 s");
      continue;
    }
  }
  serves_retry(P, NULL, 0, now);
  graves_free(P, now, 0);
  for (sub *sb = P->subs, *next; sb; sb = next) {
    next = sb->next;
    if (sb->state == S_ASKED && now - sb->asked_ns > sb->wait_ms * 1000000ull + limit && sb->link) {
      char why[160];
      snprintf(why, sizeof why, "no answer to a fetch within %u ms (peer_fetch_timeout_ms)", P->cfg->peer_fetch_timeout_ms);
      link_close(sb->link, why);
      break; /* the list changed */
    }
    if (sb->state == S_TRANSFER && now - sb->started_ns > limit && sb->peer->out) {
      char why[160];
      snprintf(why, sizeof why, "a transfer took longer than %u ms (peer_fetch_timeout_ms)", P->cfg->peer_fetch_timeout_ms);
      link_close(sb->peer->out, why);
      break;
    }
  }
}

int gpd_peers_start(gpd_server *s) {
  const gpd_config *cfg = s->cfg;
  gpd_peers *P;
  int rc;
  if (!cfg->peer_listen[0] && !cfg->n_peers)
    return 0;
  if (!(P = calloc(1, sizeof *P)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  P->s = s;
  P->loop = s->loop;
  P->cfg = cfg;
  P->reg = s->reg;
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
  /* The default secret is checked even when no [peer] uses it yet: a file others can read is
   * refused at start, not first when a [peer] section is added and the daemon restarted. */
  if (cfg->peer_secret_file[0]) {
    uint8_t secret[MAX_SECRET];
    size_t len;
    rc = read_secret(cfg->peer_secret_file, secret, &len);
    explicit_bzero(secret, sizeof secret);
    if (rc != 0)
      goto fail;
  }
  if (cfg->peer_listen[0] && !cfg->n_peers)
    GPUPOOL__WARN("peers: peer_listen is set but no [peer] section: no daemon can authenticate to this one");
  gpupool__hmap_init(&P->receiving);
  if ((rc = gpd_ucx_open(s->loop, on_data, P, &P->ucx)) != 0)
    goto fail;
  if (cfg->peer_listen[0]) {
    uv_tcp_init(s->loop, &P->listener);
    P->listener.data = P;
    P->listening = 1;
    if ((rc = uv_tcp_bind(&P->listener, (const struct sockaddr *)&cfg->peer_addr, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&P->listener, 128, on_accept)) != 0) {
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
    link_close(P->links, "daemon shutting down");
  /* Transfers whose endpoint was closed end now (their getters are told), then what is left
   * lets go of its memory while UCX still knows the registrations. */
  gpd_ucx_flush(P->ucx);
  graves_free(P, 0, 1);
  while (P->subs) {
    sub *sb = P->subs;
    sub_fail_waiters(sb, GPUPOOL_ECLOSED, "gpupoold is shutting down", 0);
    sub_release(sb);
    sub_free(sb);
  }
  gpd_ucx_close(P->ucx);
  P->closing = 1 + P->listening;
  if (P->listening)
    uv_close((uv_handle_t *)&P->listener, tick_closed);
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
