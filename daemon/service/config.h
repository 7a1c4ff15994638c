/*
 * gpupoold configuration: the daemon section and one section per pool, read from an
 * INI-style file (see config/gpupoold.conf) and overridden by the command line.
 */
#ifndef GPUPOOL_DAEMON_CONFIG_H
#define GPUPOOL_DAEMON_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "backend.h"
#include "gpupool/gpupool.h"

#define GPUPOOL_MAX_POOLS 32
#define GPUPOOL_MAX_ALLOW 32
#define GPUPOOL_MAX_SETS 32
#define GPUPOOL_MAX_FILE_PATHS 16
#define GPUPOOL_MAX_PEERS 32

/* Users named by uid or by primary gid: a [tenant NAME] (its members are one tenant: they
 * share names and memory) or a [group NAME] (pools marked share = NAME are readable and
 * writable by every member). */
typedef struct {
  char name[48];
  uid_t uids[GPUPOOL_MAX_ALLOW];
  int n_uids;
  gid_t gids[GPUPOOL_MAX_ALLOW];
  int n_gids;
  /* export_peers: the [peer] names that may fetch this set's names ("*": every peer). */
  char export_peers[256];
  int line;
} gpd_member_set;

/* A [peer NAME] section: another gpupoold this one fetches from (and that may fetch from
 * this one: a peer authenticates as the name this daemon gives it, with the same secret). */
typedef struct {
  char name[33];          /* [A-Za-z0-9_-]{1,32} */
  char address[64];       /* ADDR:PORT as written */
  struct sockaddr_storage addr;
  char secret_file[256];  /* empty: [daemon] peer_secret_file */
  char prefix[64];        /* local names starting with it map to this peer (empty: none) */
  int line;
} gpd_peer_conf;

typedef struct {
  char socket_path[108];
  const gpupool__backend_desc *backend; /* NULL: auto (cuda with a usable GPU, else host) */
  int log_level;
  mode_t socket_mode;
  /* Limits (0 = unlimited). */
  uint32_t max_clients;
  uint64_t max_bytes_per_client;
  uint32_t max_allocs_per_client;
  uint64_t max_bytes_per_uid;
  uint32_t max_allocs_per_uid;
  uint32_t max_frame;
  uint32_t max_names;
  uint32_t max_names_per_uid;         /* names one uid has published (they outlive it) */
  uint32_t max_bundle_members;        /* members of one bundle */
  uint32_t max_members_per_uid;       /* members of the bundles one tenant has published */
  uint32_t max_pending_versions_per_uid; /* sharded versions of one tenant waiting for parts */
  uint32_t max_members;               /* members of every member table the daemon holds */
  uint32_t max_holds_per_client;
  uint32_t max_holds_per_uid;
  uint32_t max_kept_shares_per_client; /* kept shares one connection has made and not yet opened */
  uint32_t share_keep_ms;             /* how long an unopened kept share keeps its buffer */
  uint32_t open_wait_ms;              /* how long an Open waits for a share on its way */
  uint32_t max_share_batch;           /* holds one Share, tokens one Open, holds one Idle names */
  uint32_t max_clients_per_uid;       /* connections of one uid (root and the daemon's uid exempt) */
  uint32_t reserved_clients;          /* of max_clients, kept for root and the daemon's uid */
  uint32_t max_waiters_per_client;    /* allocations/gets waiting at once */
  uint32_t max_waiters_per_uid;
  uint64_t max_queued_bytes_per_client; /* unread replies, counted as the heap they hold */
  uint64_t max_queued_bytes_total;    /* all queues and input buffers of the daemon */
  /* Closed connections of one uid whose processes still hold their lease (and so pin the
   * memory they map); past it that uid gets no new buffers. */
  uint32_t max_waiting_leases_per_uid;
  uint32_t handshake_timeout_ms;
  /* Connections the kernel queues for accept on the client socket and on each metrics listener
   * (listen(2)'s backlog; the kernel caps it at net.core.somaxconn). Deep, so that a flood of
   * connections cannot leave another user's connect waiting for a place in the queue. */
  uint32_t listen_backlog;
  /* File objects (PublishFile): whether clients may publish files at all, the path prefixes
   * allowed (checked on the path the daemon resolves from the client's fd; none = any file
   * the client could open itself), the most files the daemon keeps open at once, and whether
   * it takes a read lease on each to learn of opens for writing and truncations. */
  int allow_files;
  char file_paths[GPUPOOL_MAX_FILE_PATHS][256];
  int n_file_paths;
  uint32_t max_files;
  uint32_t max_files_per_uid;      /* of those, published by one tenant (one uid cannot take all) */
  int file_leases;
  /* Allow-lists; empty = everyone who can reach the socket. */
  uid_t allow_uids[GPUPOOL_MAX_ALLOW];
  int n_allow_uids;
  gid_t allow_gids[GPUPOOL_MAX_ALLOW];
  int n_allow_gids;
  /* Metrics: Prometheus text written to this file, and/or served on this Unix socket. */
  char metrics_textfile[256];
  char metrics_socket[108];
  /* Group given to metrics_socket (name or number; empty = the daemon's group), so scrapers
   * need not be in the daemon's group, which lets them allocate. metrics_socket_gid is it resolved. */
  char metrics_socket_group[64];
  gid_t metrics_socket_gid;
  /* Opt-in TCP listener for Prometheus: "PORT" (127.0.0.1), "ADDR:PORT" or "[ADDR6]:PORT";
   * empty = none. metrics_addr is the parsed address. */
  char metrics_listen[64];
  struct sockaddr_storage metrics_addr;
  uint32_t metrics_interval_ms;
  /* Latency mode: after any client activity, keep polling without sleeping for this long
   * (costs a CPU core while traffic flows; 0 = always sleep in the kernel). */
  uint32_t busy_poll_us;
  /* Peers: where this daemon serves other gpupoolds ("ADDR:PORT"; empty: it serves none),
   * the secret they share, and the limits on what one peer may cost. */
  char peer_listen[64];
  struct sockaddr_storage peer_addr;
  char peer_secret_file[256];
  uint32_t peer_max_frame;
  uint32_t peer_max_fetches;      /* fetches one peer may have in flight from this daemon */
  uint32_t peer_fetch_timeout_ms; /* a fetch (metadata and data) that takes longer fails */
  /* Connections to peer_listen not yet authenticated: at most this many at once, this many
   * from one source address, each for at most this long; and fds kept free for what the
   * daemon must open (peer connections and UCX endpoints are refused below that). */
  uint32_t peer_max_unauthenticated;
  uint32_t peer_max_unauthenticated_per_addr;
  uint32_t peer_handshake_timeout_ms;
  uint32_t peer_fd_reserve;
  gpd_peer_conf peers[GPUPOOL_MAX_PEERS];
  int n_peers;
  gpupool__pool_config pools[GPUPOOL_MAX_POOLS];
  int n_pools;
  /* For each pool, the index in groups[] of the group it is shared with, or -1. */
  int pool_share[GPUPOOL_MAX_POOLS];
  char pool_share_name[GPUPOOL_MAX_POOLS][48];
  gpd_member_set tenants[GPUPOOL_MAX_SETS];
  int n_tenants;
  gpd_member_set groups[GPUPOOL_MAX_SETS];
  int n_groups;
  /* The file gpd_config_load read (empty: none), for messages naming its sections' lines. */
  char path[256];
  /* The line of each pool's kind, capacity, slab_size, alignment and share (0: not written
   * in the file), for messages that point at the key rather than its section. */
#define GPD_POOL_LINE_KEYS 5
  int pool_key_line[GPUPOOL_MAX_POOLS][GPD_POOL_LINE_KEYS];
} gpd_config;

/* The config keys, one row each (daemon/service/config.c, gpd_config_keys): the file's parser,
 * the --pool specs, the defaults, the unknown-key message, --list-config-keys and
 * --check-config all read the rows, so a key is added by adding its row. */

/* Where a key may be written (a row's sections is a mask of these). */
enum {
  GPUPOOL__CS_DAEMON = 1 << 0, /* [daemon] (and gpd_config_set) */
  GPUPOOL__CS_POOL = 1 << 1,   /* [pool NAME] */
  GPUPOOL__CS_SPEC = 1 << 2,   /* a --pool spec */
  GPUPOOL__CS_TENANT = 1 << 3, /* [tenant NAME] */
  GPUPOOL__CS_GROUP = 1 << 4,  /* [group NAME] */
  GPUPOOL__CS_PEER = 1 << 5,   /* [peer NAME] */
};

/* How a key's value is read into its field. */
typedef enum {
  GPUPOOL__CK_U32,     /* uint32_t; a number, K/M/G/T allowed; lo..hi when either is set */
  GPUPOOL__CK_SIZE,    /* uint64_t; a size with K/M/G/T */
  GPUPOOL__CK_INT,     /* int; a plain decimal number in lo..hi */
  GPUPOOL__CK_BOOL,    /* int; yes/no, true/false, on/off, 1/0 */
  GPUPOOL__CK_STR,     /* char[size]; copied whole or refused */
  GPUPOOL__CK_IDS,     /* uint32_t[GPUPOOL_MAX_ALLOW] counted by the int at count_off */
  GPUPOOL__CK_FN,      /* the row's own set function (enums, modes, paths, addresses) */
  GPUPOOL__CK_SECTION, /* read by the section reader itself (it needs more than the section) */
} gpd_config_kind;

/* The row is meant for the command line (--pool name=): the example file has no line for it. */
#define GPUPOOL__CF_CMDLINE 1u
/* lo and hi are byte counts (messages write them as 4K, 64M). */
#define GPUPOOL__CF_BYTES 2u
/* A reload (SIGHUP) cannot change it: it shaped what was set up at start (the socket, the
 * backend, the exporters, the loop); a new value is reported and waits for a restart. */
#define GPUPOOL__CF_RESTART 4u

typedef struct {
  unsigned sections;     /* GPUPOOL__CS_* */
  const char *name;
  const char *alias;     /* a short form also accepted (slab for slab_size), or NULL */
  gpd_config_kind kind;
  /* The field in gpd_config (daemon), gpupool__pool_config (pool, --pool) or
   * gpd_member_set (tenant, group) or gpd_peer_conf (peer); size 0 for GPUPOOL__CK_SECTION. */
  size_t off, size;
  size_t count_off;      /* GPUPOOL__CK_IDS: the int that counts the ids */
  uint64_t lo, hi;       /* GPUPOOL__CK_U32, GPUPOOL__CK_INT: the range accepted */
  /* The default as config/gpupoold.conf writes it, or NULL where there is none to write
   * (empty, computed at start-up, or left to the backend). */
  const char *def;
  const char *doc;       /* one line: what it does */
  int (*set)(void *obj, const char *value); /* GPUPOOL__CK_FN */
  unsigned flags;        /* GPUPOOL__CF_* */
} gpd_config_key;

extern const gpd_config_key gpd_config_keys[];
extern const size_t gpd_n_config_keys;

/* The row of key (or of its alias) among those written in section (a GPUPOOL__CS_* bit), or
 * NULL. */
const gpd_config_key *gpd_config_key_find(unsigned section, const char *key);
/* Parse value into the row's field of obj (the struct that the row's section names). 0 or
 * GPUPOOL_EINVAL with a message. */
int gpd_config_key_set(void *obj, const gpd_config_key *k, const char *value);
/* Every key, one line each: section, name = default, what it does, and "(restart only)" at
 * the end for a [daemon] key a reload cannot change (gpupoold --list-config-keys). */
void gpd_config_list_keys(FILE *f);
/* The [daemon] keys whose value differs from the default, comma-separated into buf ("" when
 * none; cut short with "..." when buf is too small). */
void gpd_config_changed_keys(const gpd_config *c, char *buf, size_t len);

/* A reload: bring live (the configuration the daemon serves with) to next (read afresh and
 * finished against the same backend) wherever that can be done while serving: the [daemon]
 * keys without GPUPOOL__CF_RESTART, and tenants and groups when every existing set keeps its
 * name and place (clients and names refer to sets by position; new sets may be added after
 * them). Everything else (rows marked GPUPOOL__CF_RESTART, pools, renamed or removed sets)
 * stays as it was. The names of what changed go, comma-separated, to applied, and of what
 * was left to kept ("" when none). */
void gpd_config_reload(gpd_config *live, const gpd_config *next, char *applied, size_t alen, char *kept,
                       size_t klen);

/* 1 when uid (or its primary gid) is a member of the set. */
int gpd_member_of(const gpd_member_set *m, uid_t uid, gid_t gid);

/* Defaults: socket path by the rules in gpupool_client_default_socket_path(), backend auto, info. */
void gpd_config_defaults(gpd_config *c);
/* Read a file into c (later keys override earlier ones). 0 or GPUPOOL_ECONFIG with a
 * message naming the file, line and the problem. The whole file is read whatever it holds:
 * the message is the first error's, with how many more there were. */
int gpd_config_load(gpd_config *c, const char *path);
/* Every error gpd_config_load and gpd_config_finish find goes to f as well, one line each
 * ("gpupoold: FILE:LINE: ..."), as it is found (--check-config); NULL: none. */
void gpd_config_report_errors(FILE *f);
/* How many errors went to that f since gpd_config_report_errors. */
int gpd_config_errors_reported(void);
/* Parse a --pool spec "name=x,kind=device|host|host-numa,device=0,numa=0,capacity=8G,
 * slab=256M,align=256,keep=1" and add it. */
int gpd_config_add_pool_spec(gpd_config *c, const char *spec);
/* Set one key of the [daemon] section (what the file's "key = value" lines do). 0 or
 * GPUPOOL_EINVAL with a message. */
int gpd_config_set(gpd_config *c, const char *key, const char *value);
/* "auto" or a backend's name (as in the file's backend = and --backend). */
int gpd_config_set_backend(gpd_config *c, const char *name);
/* Fill unset fields of pools from the backend's defaults; add the backend's default pools
 * when none is configured. Checks slab <= 4 GiB, capacity >= slab, power-of-two alignment,
 * peers, shares: every pool and section, the message the first error's (a pool's points at
 * the line of the key at fault). */
int gpd_config_finish(gpd_config *c, const gpupool__backend_desc *backend);
/* Parse "ADDR:PORT", "[ADDR6]:PORT" or a bare PORT (127.0.0.1) into *out; what names the
 * value in messages. 0 or GPUPOOL_EINVAL. */
int gpd_parse_hostport(const char *s, const char *what, struct sockaddr_storage *out);
/* The [peer] section named name, or NULL. */
const gpd_peer_conf *gpd_peer_find(const gpd_config *c, const char *name);
/* 1 when the set's export_peers lets the peer named peer fetch its names. */
int gpd_exports_to(const gpd_member_set *m, const char *peer);
/* Parse "64M", "8G", "1048576" (K/M/G/T = powers of 1024). 0 or GPUPOOL_EINVAL. */
int gpd_parse_size(const char *s, uint64_t *out);

#endif
