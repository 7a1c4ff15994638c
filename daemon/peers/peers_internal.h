/*
 * Peers, private to daemon/peers*.c: the types the files share (the configured peers, the
 * control connections, the subscriptions and the gets being served) and the functions one
 * file calls in another. See peers.c for the whole feature: peers_link.c holds the
 * connections and their authentication, peers_fetch.c the fetching side, peers_serve.c the
 * serving side.
 */
#ifndef GPUPOOLD_PEERS_INTERNAL_H
#define GPUPOOLD_PEERS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "list.h"
#include "peers.h"
#include "peers_ucx.h"
#include "registry_internal.h"
#include "server_internal.h"

#define NONCE_LEN 32
/* Revision of the daemon-to-daemon frames this daemon speaks (PeerHello.peer_revision); a
 * daemon that sends none is revision 1. GPUPOOL_TEST_PEER_REVISION=N in the environment makes
 * a daemon announce (and expect) N: the tests' older peer. */
#define PEER_REVISION 3
#define TICK_MS 100
/* A peer whose connection went down while this daemon has names of its is connected again at
 * once, then after RECONNECT_NS, twice that, ... at most RECONNECT_MAX_NS apart (to learn
 * whether it restarted). */
#define RECONNECT_NS (500ull * 1000000ull)
#define RECONNECT_MAX_NS (8000ull * 1000000ull)
#define MAX_SECRET 4096
#define MAX_WRITE_QUEUE (64u << 20)
#define READ_CHUNK (64u << 10)
/* A version is sent in messages of at most SEND_CHUNK bytes, SEND_WINDOW of them in flight:
 * the transfer is pipelined, and what one completion hands the loop stays small. */
#define SEND_CHUNK (1u << 20)
#define SEND_WINDOW 4
#define DATA_HDR 20 /* fetch id (8), buffer index (4), offset (8), little-endian */
/* Device memory is staged through pinned host memory (peers_stage.c) in slots of STAGE_SLOT
 * bytes: a transfer uses at most STAGE_RING of them at once (a ring: one fills while others
 * copy or travel), and a daemon makes at most STAGE_SLOTS_MAX, kept for later transfers, half
 * of them for fetches and half for serves. */
#ifndef GPUPOOL__STAGE_SLOT_MIB
#define GPUPOOL__STAGE_SLOT_MIB 8
#endif
#define STAGE_SLOT ((uint64_t)GPUPOOL__STAGE_SLOT_MIB << 20)
#define STAGE_RING 4
#define STAGE_SLOTS_MAX 32

enum { L_CONNECTING, L_AWAIT_HELLO, L_AWAIT_CHALLENGE, L_AWAIT_AUTH, L_AWAIT_WELCOME, L_AWAIT_EP, L_UP };
enum { S_IDLE, S_QUEUED, S_ASKED, S_TRANSFER };

typedef struct plink plink;
typedef struct sub sub;
typedef struct serve serve;
typedef struct stage_slot stage_slot;
typedef struct stager stager;
typedef struct prefault prefault;

/* A slot of pinned host memory (a slab of the daemon's own staging pool), owned by the peers
 * for the daemon's life: free, taken by a transfer, or waiting for sends from it to end after
 * its transfer went. */
struct stage_slot {
  gpupool__bslab bs;
  uint8_t *map;          /* its bytes on the CPU */
  size_t maplen;         /* mapped here (host backend), 0 when the backend's pointer is used */
  uint32_t sends;        /* UCX sends from it in flight */
  int taken;
  int orphan;            /* its transfer went with sends in flight: freed once they end */
  int fetching;          /* taken by a fetch (1) or a serve (0) */
  stage_slot *next_free;
};

/* One ring entry of a staged transfer: the slot and the bytes of the transfer's stream (the
 * buffers one after another) it holds now. */
typedef struct {
  stage_slot *slot;
  uint64_t start, end;   /* [start, end) of the stream */
  uint64_t got;          /* fetching: bytes received into it */
  gpupool__bcopy *job;   /* the copy between it and device memory, while it runs */
  int state;             /* ST_* */
} stage_ent;

/* A transfer between device memory and the network through the ring: the serving side copies
 * device -> slot and sends the slot; the fetching side receives into a slot and copies slot ->
 * device. Polled from the loop (peers_stage.c), never waited on. */
struct stager {
  struct gpd_peers *P;
  int fetching;
  uint32_t n;            /* buffers */
  gpupool__bloc *locs;   /* where each buffer lies */
  uint64_t *starts;      /* where each begins in the stream */
  uint64_t *lens;
  uint64_t total;
  stage_ent ring[STAGE_RING];
  uint32_t nring;        /* entries in use (fetching: fixed once the slots are taken) */
  uint64_t copy_pos;     /* serving: the next byte to copy out of device memory */
  uint64_t drained;      /* fetching: the bytes in device memory (a prefix of the stream) */
  int ready;             /* serving: the sources' ready events completed */
  gpd_event **events;    /* serving: those events */
  int failed;            /* a copy failed: the owner ends the transfer (why in why) */
  char why[256];
};

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
  uint64_t bytes_staged;
  /* Its instance (PeerChallenge.instance) as last seen, 0 before; and how its versions show
   * here: a version v of it is shown as v + shift. shown is the highest version this daemon
   * showed of any of its names: when the peer restarts (a new instance) its names here go and
   * shift becomes shown, so its new versions come after every one shown before. */
  uint64_t instance;
  uint64_t shift, shown;
  uint32_t restarts;      /* new instances seen after the first */
  uint64_t retry_ns;      /* when to connect again to learn its instance (0: no need) */
  uint64_t retry_gap;     /* the wait after the next failed attempt */
  /* The UCX transports the data uses, as UCX chose them for the endpoint that sends it: to it
   * (this daemon's endpoint, serving) and from it (its endpoint, as its Welcome said). */
  char serve_transport[128], fetch_transport[128];
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
  int flushing;          /* its endpoint's wireup is in flight: freed once it ends */
  int freed_later;
  gpd_ucx_ep *ep;        /* incoming: to the fetching daemon's worker (the data goes there) */
  uint8_t *waddr;        /* incoming: that worker's address, from Hello */
  size_t waddr_len;
  char *hello_listen;    /* incoming: Hello's listen (bound into the MACs) */
  uint64_t instance_f, instance_s; /* the fetching and the serving side's instances */
  struct sockaddr_storage src; /* incoming: where it comes from */
  int counted;           /* incoming and not authenticated yet: counted in P->unauth */
  int background;        /* outgoing, opened by gpd_pr_reconnect: its failures are not news */
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
  uint8_t **bases;       /* where each buffer starts in its slab's daemon mapping (host memory) */
  uint32_t n;
  uint64_t bytes, received;
  int receiving;         /* in P->receiving under id */
  int complete;          /* every byte is in: finished from the loop */
  stager *st;            /* staged into device memory (NULL: copied into mapped host memory) */
  prefault *pf;          /* the pages of its new memory being made ready, or NULL */
  int stage_wait;        /* staged, waiting for free slots before PeerReady goes */
  int bad_data;          /* the peer sent data outside the window: failed from the loop */
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
  uint64_t sent;         /* bytes of the stream sent so far */
  uint64_t window;       /* PeerReady's window (0: none) */
  uint64_t limit;        /* send no byte at or past this (the fetching side's credit) */
  stager *st;            /* staged out of device memory (NULL: sent from mapped host memory) */
  serve *prev, *next;
};

/* A serve's sends in flight: their callbacks come from the loop, possibly after the serve
 * went; the last one frees this. */
struct push {
  serve *sv;             /* NULL once the serve went */
  uint32_t inflight;
};

/* What the rooms below (the link: frames and connections; the stager: staged copies) tell the
 * rooms above (fetching, serving) of, through this table that peers.c fills: never by
 * calling them. */
typedef struct {
  /* the link: a frame of an authenticated peer */
  void (*on_peer_get)(plink *l, const Gpupool__Wire__PeerGet *m);
  void (*on_peer_done)(plink *l, uint64_t id);
  void (*on_peer_ready)(plink *l, uint64_t id, uint64_t window);
  void (*on_peer_credit)(plink *l, uint64_t id, uint64_t bytes);
  void (*on_peer_failed)(plink *l, const Gpupool__Wire__PeerFailed *m);
  void (*on_get_reply)(plink *l, Gpupool__Wire__PeerFrame *fr);
  /* the link: a connection to p came up (its instance inst; ask for what waits on it), or
   * closed (fail what it carried) */
  void (*peer_instance)(peer *p, uint64_t inst);
  void (*sub_ask)(sub *sb);
  void (*sub_failed)(sub *sb, int code, const char *msg);
  void (*serve_free_reading)(serve *sv, int reading);
  /* the stager: run a staged fetch or serve; 1 when it ended (the lists changed) */
  int (*sub_stage_step)(sub *sb);
  int (*serve_stage_step)(serve *sv);
} gpd_pr_ops;

struct gpd_peers {
  uint32_t revision;     /* PEER_REVISION, or the test's */
  gpd_server *s;
  const gpd_peers_news *news; /* to the server's waiting gets */
  const gpd_pr_ops *ops;      /* to fetching and serving, from the link and the stager */
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
  uint64_t instance;     /* this daemon's: random, drawn at start */
  uint32_t unauth;       /* incoming connections not authenticated yet */
  int closing;           /* handles whose close callback has not come yet */
  gpupool__ratelimit log_rl; /* lines that connections to peer_listen cause */
  struct grave *graves;  /* served ranges a gone peer may still be reading */
  gpupool__hmap receiving; /* fetch id -> sub whose data is arriving */
  int finish_posted;     /* a deferred call will finish the subs whose data is all in */
  /* Staging of device memory (peers_stage.c). */
  gpupool__bpool *stage_bp;  /* the daemon's own pinned host pool for slots; NULL: none */
  char device_memory[256];   /* the start-up choice, for logs and gpupoolctl peers */
  stage_slot slots[STAGE_SLOTS_MAX];
  uint32_t nslots, slots_taken, slots_max;
  uint32_t slots_side[2];    /* taken by serves [0] and fetches [1]: each at most half */
  stage_slot *free_slots;
  uv_timer_t stage_timer;    /* polls the copies while any staged transfer runs */
  int stage_timer_on;
  uint32_t nstaged;          /* staged transfers (serves and fetches) */
  int stage_posted;          /* a deferred call will run the staged transfers */
};

static inline uint64_t now_ns(void) { return gpd_now_ns(); }

/* What one file calls in another, by the file that defines it. */

/* peers_link.c */
int gpd_pr_send_frame(plink *l, const Gpupool__Wire__PeerFrame *f);
void gpd_pr_send_get_error(plink *l, uint64_t id, int code, const char *msg);
void gpd_pr_send_done(plink *l, uint64_t id);
void gpd_pr_link_close(plink *l, const char *why);
void gpd_pr_link_connect(gpd_peers *P, peer *p);
void gpd_pr_on_accept(uv_stream_t *server, int status);
/* fds that can still be opened below the fd limit (0 when they cannot even be counted). */
uint64_t gpd_pr_fds_free(void);
/* The connection to p came up and p's instance is inst: a new instance drops what this
 * daemon holds of p's old one (peers_fetch.c). */
void gpd_pr_peer_instance(peer *p, uint64_t inst);
/* From the tick: connect again to the peers gpd_pr_peer_instance must hear from. */
void gpd_pr_reconnect(gpd_peers *P, uint64_t now);

/* peers_prefault.c: fault in the n ranges of a local copy (their mappings, lengths and
 * starts in the stream) from a thread of its own while the data comes; NULL when no thread
 * could be started (the copies then fault their pages in themselves). received: the bytes of
 * the stream in so far (the thread stops where it meets them). stop: stop and wait for it
 * (sb's buffers may go after). */
prefault *gpd_pr_prefault_start(uint8_t *const *maps, const uint64_t *lens, const uint64_t *starts, uint32_t n);
void gpd_pr_prefault_received(prefault *pf, uint64_t received);
void gpd_pr_prefault_stop(sub *sb);

/* peers_fetch.c */
/* 1 when name (as a client writes it) is a peer's: PEER:NAME, or under a [peer]'s prefix. */
int gpd_pr_routed(gpd_peers *P, const char *name);
void gpd_pr_sub_free(sub *sb);
void gpd_pr_sub_release(sub *sb);
void gpd_pr_sub_ask(sub *sb);
void gpd_pr_sub_fail_waiters(sub *sb, int code, const char *msg, int only_nowait);
void gpd_pr_sub_failed(sub *sb, int code, const char *msg);
void gpd_pr_on_data(void *arg, const void *header, size_t hlen, const void *data, size_t len);
void gpd_pr_on_get_reply(plink *l, Gpupool__Wire__PeerFrame *fr);
/* The peer of l failed one of this daemon's fetches after its reply (PeerFailed). */
void gpd_pr_on_peer_failed(plink *l, const Gpupool__Wire__PeerFailed *m);
/* Run a staged fetch: 1 when it ended (the lists changed). */
int gpd_pr_sub_stage_step(sub *sb);
int gpd_pr_want_key(gpd_peers *P, const char *local_name, const char *key, uid_t uid, gid_t gid,
                    const char *tenant_name_, uint32_t wait_ms);

/* peers_stage.c */
int gpd_pr_stage_open(gpd_peers *P);
void gpd_pr_stage_close(gpd_peers *P);
/* 1 when the buffer's memory must be staged (device memory, or memory the daemon cannot map). */
int gpd_pr_stage_needed(gpd_peers *P, const gpd_buffer *b);
/* A stager for the n buffers (their stream lengths lens): fetching or serving. NULL on error
 * (set). */
stager *gpd_pr_stager_new(gpd_peers *P, int fetching, gpd_buffer *const *bufs, const uint64_t *lens, uint32_t n);
/* Stop its copies (returns once no engine touches its memory) and give back its slots. */
void gpd_pr_stager_free(stager *st);
/* Fetching: take slots for the ring; 0 when none is free yet (try again later). */
uint32_t gpd_pr_stager_take(stager *st);
/* Fetching: data at [pos, pos + len) of the stream (inside UCX progress: copies only). -1 when
 * it lies outside the window. */
int gpd_pr_stager_recv(stager *st, uint64_t pos, const void *data, size_t len);
/* Fetching: start and poll the copies into device memory; st->drained moves on. */
void gpd_pr_stager_fetch_poll(stager *st);
/* Serving: poll the copies out of device memory and start the next (sent: bytes sent). */
void gpd_pr_stager_serve_poll(stager *st, uint64_t sent);
/* Serving: the message that can go from stream byte pos (at most max bytes): 1 with its bytes,
 * slot (its sends count it: gpd_pr_stage_sent when it ends) and *len; 0 when not copied yet. */
int gpd_pr_stager_next(stager *st, uint64_t pos, uint64_t max, const uint8_t **data, stage_slot **slot,
                       uint64_t *len);
/* A send from slot ended. */
void gpd_pr_stage_sent(gpd_peers *P, stage_slot *slot);
/* Run the staged transfers soon (from the loop). */
void gpd_pr_stage_kick(gpd_peers *P);

/* peers_serve.c */
void gpd_pr_on_peer_credit(plink *l, uint64_t id, uint64_t bytes);
/* Run a staged serve: 1 when it ended its link (the lists changed). */
int gpd_pr_serve_stage_step(serve *sv);
void gpd_pr_graves_free(gpd_peers *P, uint64_t now, int all);
void gpd_pr_serve_free_reading(serve *sv, int reading);
void gpd_pr_serve_free(serve *sv);
void gpd_pr_on_peer_ready(plink *l, uint64_t id, uint64_t window);
void gpd_pr_on_peer_get(plink *l, const Gpupool__Wire__PeerGet *m);
void gpd_pr_on_peer_done(plink *l, uint64_t id);
void gpd_pr_serves_retry(gpd_peers *P, const char *key, uint64_t version, uint64_t now);

#endif
