/*
 * gpupoold configuration: its defaults, the values' parsers and the table of keys. Reading a
 * file, --pool specs and the final checks that make a pool usable (slab <= 4 GiB, capacity a
 * whole number of slabs, power-of-two alignment) are config_load.c; a reload's changes are
 * config_reload.c. Every error names the file and line (or the --pool spec) and what to write.
 *
 * The keys are one table, gpd_config_keys: a row per key (section, parser, field, range,
 * default, one line of doc). The [daemon], [pool], [tenant] and [group] lines, the --pool
 * specs, the defaults, the unknown-key message and --list-config-keys all read the rows, and
 * test_conf_example holds config/gpupoold.conf to them: a new key is a new row (and its line
 * in the example file).
 *
 * File format ('#' or ';' starts a comment at the start of a line; '#' after whitespace
 * starts one anywhere, so "backend = auto   # auto | cuda | host" is the value "auto"):
 *   # comment
 *   [daemon]
 *   socket = /run/gpupool/gpupoold.sock
 *   backend = auto
 *   [pool gpu0]
 *   kind = device
 *   device = 0
 *   capacity = 16G
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "config_internal.h"
#include "errors.h"
#include "paths.h"
#include "log.h"
#include "words.h"

void gpd_config_defaults(gpd_config *c) {
  memset(c, 0, sizeof *c);
  if (gpupool__socket_path(c->socket_path, sizeof c->socket_path, 0) != 0)
    c->socket_path[0] = '\0';
  /* The rows' defaults go through the rows' own parsers; test_conf_example checks that each
   * one parses and matches config/gpupoold.conf. */
  for (size_t i = 0; i < gpd_n_config_keys; i++) {
    const gpd_config_key *k = &gpd_config_keys[i];
    if ((k->sections & GPUPOOL__CS_DAEMON) && k->def)
      (void)gpd_config_key_set(c, k, k->def);
  }
  for (int i = 0; i < GPUPOOL_MAX_POOLS; i++)
    c->pool_share[i] = -1;
}

int gpd_parse_size(const char *s, uint64_t *out) {
  char *end;
  unsigned long long v;
  uint64_t mul = 1;

  while (isspace((unsigned char)*s))
    s++;
  if (!isdigit((unsigned char)*s))
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is not a size (write e.g. 4096, 64M or 8G)", s);
  errno = 0;
  v = strtoull(s, &end, 10);
  if (errno)
    return gpupool__err(GPUPOOL_EINVAL, "size '%s' is out of range", s);
  switch (toupper((unsigned char)*end)) {
  case '\0':
    break;
  case 'K':
    mul = 1ull << 10;
    break;
  case 'M':
    mul = 1ull << 20;
    break;
  case 'G':
    mul = 1ull << 30;
    break;
  case 'T':
    mul = 1ull << 40;
    break;
  default:
    return gpupool__err(GPUPOOL_EINVAL, "size '%s' has an unknown suffix (use K, M, G or T)", s);
  }
  if (*end) {
    end++;
    if ((*end == 'i' || *end == 'I') && (end[1] == 'B' || end[1] == 'b'))
      end += 2;
    else if (*end == 'B' || *end == 'b')
      end++;
  }
  while (isspace((unsigned char)*end))
    end++;
  if (*end)
    return gpupool__err(GPUPOOL_EINVAL, "size '%s' has trailing characters", s);
  if (__builtin_mul_overflow((uint64_t)v, mul, out))
    return gpupool__err(GPUPOOL_EINVAL, "size '%s' overflows 64 bits", s);
  return 0;
}

int gpd_parse_hostport(const char *s, const char *what, struct sockaddr_storage *out) {
  char host[64];
  const char *port_s = s;
  char *end;
  unsigned long port;
  size_t hl = 0;

  memset(out, 0, sizeof *out);
  if (*s == '[') {
    const char *close = strchr(s, ']');
    if (!close || close[1] != ':')
      goto bad;
    hl = (size_t)(close - s - 1);
    if (hl >= sizeof host)
      goto bad;
    memcpy(host, s + 1, hl);
    host[hl] = '\0';
    port_s = close + 2;
  } else if (strchr(s, ':')) {
    const char *colon = strrchr(s, ':');
    hl = (size_t)(colon - s);
    if (hl >= sizeof host)
      goto bad;
    memcpy(host, s, hl);
    host[hl] = '\0';
    port_s = colon + 1;
  } else {
    strcpy(host, "127.0.0.1"); /* a bare port: loopback only */
  }
  if (!isdigit((unsigned char)*port_s))
    goto bad;
  errno = 0;
  port = strtoul(port_s, &end, 10);
  if (errno || *end || port == 0 || port > 65535)
    goto bad;
  if (*s == '[') {
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)out;
    if (inet_pton(AF_INET6, host, &a6->sin6_addr) != 1)
      goto bad;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons((uint16_t)port);
  } else {
    struct sockaddr_in *a4 = (struct sockaddr_in *)out;
    if (inet_pton(AF_INET, host, &a4->sin_addr) != 1)
      goto bad;
    a4->sin_family = AF_INET;
    a4->sin_port = htons((uint16_t)port);
  }
  return 0;
bad:
  return gpupool__err(GPUPOOL_EINVAL,
                      "%s '%s' is not PORT, IPV4:PORT or [IPV6]:PORT (e.g. 9464 for "
                      "127.0.0.1:9464; a port between 1 and 65535; addresses as numbers, not names)",
                      what, s);
}

static int parse_u32(const char *s, uint32_t *out) {
  uint64_t v = 0;
  if (gpd_parse_size(s, &v) != 0 || v > UINT32_MAX)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is not a number between 0 and %u", s, UINT32_MAX);
  *out = (uint32_t)v;
  return 0;
}

static int parse_int(const char *s, int lo, int hi, int *out) {
  char *end;
  long v;
  errno = 0;
  v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is not a whole number between %d and %d", s, lo, hi);
  *out = (int)v;
  return 0;
}

static int parse_bool(const char *s, int *out) {
  if (!strcmp(s, "1") || !strcmp(s, "true") || !strcmp(s, "yes") || !strcmp(s, "on"))
    *out = 1;
  else if (!strcmp(s, "0") || !strcmp(s, "false") || !strcmp(s, "no") || !strcmp(s, "off"))
    *out = 0;
  else
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is not a boolean (use true or false)", s);
  return 0;
}

int gpd_config_set_backend(gpd_config *c, const char *name) {
  const gpupool__backend_desc *d = NULL;
  if (strcmp(name, "auto") && !(d = gpupool__backend_by_name(name)))
    return gpupool__err(GPUPOOL_EINVAL, "unknown backend '%s' (use auto, %s)", name,
                        gpupool__backend_names());
  c->backend = d;
  return 0;
}

/* "file_paths = /data /models": absolute directory prefixes, separated by spaces or commas
 * (empty: any path). Trailing slashes are dropped; "/" alone allows everything. */
static int parse_file_paths(gpd_config *c, const char *s) {
  char buf[GPUPOOL_MAX_FILE_PATHS * 256], *save = NULL, *tok;
  if (strlen(s) >= sizeof buf)
    return gpupool__err(GPUPOOL_EINVAL, "file_paths is too long");
  snprintf(buf, sizeof buf, "%s", s);
  c->n_file_paths = 0;
  for (tok = strtok_r(buf, " ,\t", &save); tok; tok = strtok_r(NULL, " ,\t", &save)) {
    size_t n = strlen(tok);
    if (tok[0] != '/')
      return gpupool__err(GPUPOOL_EINVAL, "file_paths entry '%s' is not an absolute path", tok);
    if (strstr(tok, "/../") || (n >= 3 && !strcmp(tok + n - 3, "/..")) || strstr(tok, "/./"))
      return gpupool__err(GPUPOOL_EINVAL, "file_paths entry '%s' must be a canonical path (no . or ..)", tok);
    while (n > 1 && tok[n - 1] == '/')
      tok[--n] = '\0';
    if (c->n_file_paths >= GPUPOOL_MAX_FILE_PATHS)
      return gpupool__err(GPUPOOL_EINVAL, "file_paths has more than %d entries", GPUPOOL_MAX_FILE_PATHS);
    if (n >= sizeof c->file_paths[0])
      return gpupool__err(GPUPOOL_EINVAL, "file_paths entry '%s' is longer than %zu bytes", tok,
                          sizeof c->file_paths[0] - 1);
    memcpy(c->file_paths[c->n_file_paths++], tok, n + 1);
  }
  return 0;
}

static int parse_id_list(const char *s, uint32_t *ids, int *n) {
  char buf[1024], *save = NULL, *tok;
  if (strlen(s) >= sizeof buf)
    return gpupool__err(GPUPOOL_EINVAL, "id list too long");
  strcpy(buf, s);
  *n = 0;
  for (tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
    uint32_t v = 0;
    if (*n >= GPUPOOL_MAX_ALLOW)
      return gpupool__err(GPUPOOL_EINVAL, "more than %d ids in a list", GPUPOOL_MAX_ALLOW);
    if (parse_u32(tok, &v) != 0)
      return GPUPOOL_EINVAL;
    ids[(*n)++] = v;
  }
  return 0;
}

int gpd_config_copy_str(char *dst, size_t len, const char *s) {
  if (strlen(s) >= len)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is longer than %zu bytes", s, len - 1);
  strcpy(dst, s);
  return 0;
}

int gpd_member_of(const gpd_member_set *m, uid_t uid, gid_t gid) {
  for (int i = 0; i < m->n_uids; i++)
    if (m->uids[i] == uid)
      return 1;
  for (int i = 0; i < m->n_gids; i++)
    if (m->gids[i] == gid)
      return 1;
  return 0;
}

/* ---- the keys' own parsers (GPUPOOL__CK_FN rows) ---------------------------------------- */

static int set_backend(void *obj, const char *v) { return gpd_config_set_backend(obj, v); }

static int set_log_level(void *obj, const char *v) {
  return gpupool__log_parse_level(v, &((gpd_config *)obj)->log_level);
}

static int set_socket_mode(void *obj, const char *v) {
  char *end;
  long m = strtol(v, &end, 8);
  if (*end || end == v || m < 0 || m > 0777)
    return gpupool__err(GPUPOOL_EINVAL, "socket_mode '%s' is not an octal mode like 0660", v);
  ((gpd_config *)obj)->socket_mode = (mode_t)m;
  return 0;
}

static int set_file_paths(void *obj, const char *v) { return parse_file_paths(obj, v); }

static int set_metrics_socket_group(void *obj, const char *v) {
  gpd_config *c = obj;
  const struct group *g;
  char *end;
  unsigned long n;

  if (!*v) {
    c->metrics_socket_group[0] = '\0';
    return 0;
  }
  n = strtoul(v, &end, 10);
  if (*end == '\0' && end != v && n < (gid_t)-1) {
    c->metrics_socket_gid = (gid_t)n;
  } else {
    g = getgrnam(v);
    if (g == NULL)
      return gpupool__err(GPUPOOL_EINVAL,
                          "metrics_socket_group '%s' is no group on this system; create it "
                          "(groupadd, or a sysusers.d line) or give a gid",
                          v);
    c->metrics_socket_gid = g->gr_gid;
  }
  return gpd_config_copy_str(c->metrics_socket_group, sizeof c->metrics_socket_group, v);
}

static int set_metrics_listen(void *obj, const char *v) {
  gpd_config *c = obj;
  if (!*v) {
    c->metrics_listen[0] = '\0';
    return 0;
  }
  if (gpd_parse_hostport(v, "metrics_listen", &c->metrics_addr) != 0)
    return GPUPOOL_EINVAL;
  return gpd_config_copy_str(c->metrics_listen, sizeof c->metrics_listen, v);
}

static int set_peer_listen(void *obj, const char *v) {
  gpd_config *c = obj;
  if (!*v) {
    c->peer_listen[0] = '\0';
    return 0;
  }
  if (gpd_parse_hostport(v, "peer_listen", &c->peer_addr) != 0)
    return GPUPOOL_EINVAL;
  return gpd_config_copy_str(c->peer_listen, sizeof c->peer_listen, v);
}

static int set_peer_address(void *obj, const char *v) {
  gpd_peer_conf *p = obj;
  if (gpd_parse_hostport(v, "address", &p->addr) != 0)
    return GPUPOOL_EINVAL;
  return gpd_config_copy_str(p->address, sizeof p->address, v);
}

const gpd_peer_conf *gpd_peer_find(const gpd_config *c, const char *name) {
  for (int i = 0; i < c->n_peers; i++)
    if (!strcmp(c->peers[i].name, name))
      return &c->peers[i];
  return NULL;
}

int gpd_exports_to(const gpd_member_set *m, const char *peer) {
  char buf[sizeof m->export_peers], *save = NULL, *tok;
  snprintf(buf, sizeof buf, "%s", m->export_peers);
  for (tok = strtok_r(buf, ", \t", &save); tok; tok = strtok_r(NULL, ", \t", &save))
    if (!strcmp(tok, "*") || !strcmp(tok, peer))
      return 1;
  return 0;
}

static int set_pool_kind(void *obj, const char *v) {
  gpupool__pool_config *p = obj;
  if (!strcmp(v, "device"))
    p->kind = GPUPOOL_MEM_DEVICE;
  else if (!strcmp(v, "host"))
    p->kind = GPUPOOL_MEM_HOST;
  else if (!strcmp(v, "host-numa"))
    p->kind = GPUPOOL_MEM_HOST_NUMA;
  else
    return gpupool__err(GPUPOOL_EINVAL, "unknown pool kind '%s' (use device, host or host-numa)", v);
  return 0;
}

static int set_release_threshold(void *obj, const char *v) {
  uint64_t sz;
  if (gpd_parse_size(v, &sz) != 0)
    return GPUPOOL_EINVAL;
  ((gpupool__pool_config *)obj)->release_threshold = (int64_t)sz;
  return 0;
}

/* ---- the table ---------------------------------------------------------------------------- */

#define DAEMON .sections = GPUPOOL__CS_DAEMON
#define POOL .sections = GPUPOOL__CS_POOL | GPUPOOL__CS_SPEC
#define MEMBERS .sections = GPUPOOL__CS_TENANT | GPUPOOL__CS_GROUP
#define FIELD(type, f) .off = offsetof(type, f), .size = sizeof(((type *)0)->f)
#define D(f) FIELD(gpd_config, f)
#define P(f) FIELD(gpupool__pool_config, f)
#define M(f) FIELD(gpd_member_set, f)
#define PEER .sections = GPUPOOL__CS_PEER
#define PC(f) FIELD(gpd_peer_conf, f)
#define U32 .kind = GPUPOOL__CK_U32
#define SIZE .kind = GPUPOOL__CK_SIZE
#define BOOL .kind = GPUPOOL__CK_BOOL
#define STR .kind = GPUPOOL__CK_STR
#define FN(fn) .kind = GPUPOOL__CK_FN, .set = fn

/* One row per key, in the order config/gpupoold.conf documents them. */
const gpd_config_key gpd_config_keys[] = {
    {DAEMON, .name = "socket", STR, D(socket_path), .flags = GPUPOOL__CF_RESTART, .doc = "where clients connect (default: $GPUPOOL_SOCKET, else by user)"},
    {DAEMON, .name = "backend", FN(set_backend), D(backend), .def = "auto", .flags = GPUPOOL__CF_RESTART, .doc = "auto, cuda or host"},
    {DAEMON, .name = "log_level", FN(set_log_level), D(log_level), .def = "info", .doc = "error, warn, info or debug"},
    {DAEMON, .name = "socket_mode", FN(set_socket_mode), D(socket_mode), .def = "0660", .flags = GPUPOOL__CF_RESTART, .doc = "mode of the sockets the daemon binds"},
    {DAEMON, .name = "max_clients", U32, D(max_clients), .def = "1024", .doc = "connections at once (0 = unlimited)"},
    {DAEMON, .name = "max_bytes_per_client", SIZE, D(max_bytes_per_client), .def = "0", .doc = "memory one connection holds"},
    {DAEMON, .name = "max_allocs_per_client", U32, D(max_allocs_per_client), .def = "0", .doc = "buffers one connection holds"},
    {DAEMON, .name = "max_bytes_per_uid", SIZE, D(max_bytes_per_uid), .def = "0", .doc = "memory one tenant holds"},
    {DAEMON, .name = "max_allocs_per_uid", U32, D(max_allocs_per_uid), .def = "0", .doc = "buffers one tenant holds"},
    {DAEMON, .name = "max_names", U32, D(max_names), .def = "65536", .doc = "published names, all tenants together"},
    {DAEMON, .name = "max_waiting_leases_per_uid", U32, D(max_waiting_leases_per_uid), .def = "64",
     .doc = "closed connections of one uid whose lease a process still holds"},
    {DAEMON, .name = "max_names_per_uid", U32, D(max_names_per_uid), .def = "4096", .doc = "names one tenant has published"},
    {DAEMON, .name = "max_bundle_members", U32, D(max_bundle_members), .lo = 1, .hi = GPUPOOL_BUNDLE_MAX_MEMBERS,
     .def = "65536", .doc = "members of one bundle"},
    {DAEMON, .name = "max_members_per_uid", U32, D(max_members_per_uid), .def = "262144",
     .doc = "members of the bundles one tenant has published"},
    {DAEMON, .name = "max_members", U32, D(max_members), .def = "1048576", .doc = "members of every member table the daemon holds"},
    {DAEMON, .name = "max_pending_versions_per_uid", U32, D(max_pending_versions_per_uid), .lo = 1, .hi = 65536,
     .def = "64",
     .doc = "sharded versions of one tenant waiting for parts"},
    {DAEMON, .name = "max_holds_per_client", U32, D(max_holds_per_client), .def = "65536", .doc = "holds of one connection"},
    {DAEMON, .name = "max_holds_per_uid", U32, D(max_holds_per_uid), .def = "262144", .doc = "holds of one tenant"},
    {DAEMON, .name = "max_kept_shares_per_client", U32, D(max_kept_shares_per_client), .def = "65536",
     .doc = "kept shares of one connection not yet opened (each also counts as a hold of its tenant)"},
    {DAEMON, .name = "share_keep_ms", U32, D(share_keep_ms), .lo = 1, .hi = 86400000, .def = "600000",
     .flags = GPUPOOL__CF_RESTART, .doc = "how long a kept share not yet opened keeps its buffer"},
    {DAEMON, .name = "open_wait_ms", U32, D(open_wait_ms), .lo = 1, .hi = 600000, .def = "10000",
     .doc = "how long an Open waits for the share of a token whose sharer handed it on before its "
            "share was read (a share that does not wait for its reply)"},
    {DAEMON, .name = "max_share_batch", U32, D(max_share_batch), .lo = 1, .hi = 65536, .def = "1024",
     .doc = "holds one Share request shares, tokens one Open opens, holds one Idle asks about or one "
            "Release drops"},
    {DAEMON, .name = "max_clients_per_uid", U32, D(max_clients_per_uid), .def = "256",
     .doc = "connections of one uid (root and the daemon's uid exempt)"},
    {DAEMON, .name = "reserved_clients", U32, D(reserved_clients), .def = "8", .doc = "of max_clients, kept for root and the daemon's uid"},
    {DAEMON, .name = "max_waiters_per_client", U32, D(max_waiters_per_client), .def = "1024",
     .doc = "allocations and gets of one connection waiting at once"},
    {DAEMON, .name = "max_waiters_per_uid", U32, D(max_waiters_per_uid), .def = "4096", .doc = "requests of one tenant waiting at once"},
    {DAEMON, .name = "max_queued_bytes_per_client", SIZE, D(max_queued_bytes_per_client), .def = "64M",
     .doc = "unread replies of one connection, counted as the memory they hold"},
    {DAEMON, .name = "max_queued_bytes_total", SIZE, D(max_queued_bytes_total), .def = "1G",
     .doc = "all queues and input buffers of the daemon"},
    {DAEMON, .name = "allow_files", BOOL, D(allow_files), .def = "yes", .doc = "whether clients may publish files"},
    {DAEMON, .name = "file_paths", FN(set_file_paths), D(file_paths), .doc = "allowed path prefixes of published files (none: any)"},
    {DAEMON, .name = "max_files", U32, D(max_files), .def = "1024", .doc = "files the daemon keeps open at once"},
    {DAEMON, .name = "max_files_per_uid", U32, D(max_files_per_uid), .def = "64", .doc = "of those, published by one tenant"},
    {DAEMON, .name = "file_leases", BOOL, D(file_leases), .def = "yes", .doc = "take a read lease on each published file"},
    {DAEMON, .name = "max_frame", U32, D(max_frame), .lo = 4096, .hi = 64u << 20, .def = "1M", .flags = GPUPOOL__CF_BYTES,
     .doc = "largest request frame the daemon accepts"},
    {DAEMON, .name = "handshake_timeout_ms", U32, D(handshake_timeout_ms), .def = "5000", .doc = "time a client has to say Hello"},
    {DAEMON, .name = "listen_backlog", U32, D(listen_backlog), .lo = 1, .hi = 65535, .def = "4096",
     .flags = GPUPOOL__CF_RESTART, .doc = "connections the kernel queues until accepted"},
    {DAEMON, .name = "allow_uids", .kind = GPUPOOL__CK_IDS, D(allow_uids), .count_off = offsetof(gpd_config, n_allow_uids),
     .doc = "uids let in beyond the socket's permissions (none: everyone)"},
    {DAEMON, .name = "allow_gids", .kind = GPUPOOL__CK_IDS, D(allow_gids), .count_off = offsetof(gpd_config, n_allow_gids),
     .doc = "gids let in beyond the socket's permissions (none: everyone)"},
    {DAEMON, .name = "metrics_socket", STR, D(metrics_socket), .flags = GPUPOOL__CF_RESTART, .doc = "Unix socket serving Prometheus metrics"},
    {DAEMON, .name = "metrics_socket_group", FN(set_metrics_socket_group), D(metrics_socket_group),
     .flags = GPUPOOL__CF_RESTART, .doc = "group owning metrics_socket (name or gid; none: the daemon's)"},
    {DAEMON, .name = "metrics_textfile", STR, D(metrics_textfile), .flags = GPUPOOL__CF_RESTART, .doc = "file the metrics are written to"},
    {DAEMON, .name = "metrics_interval_ms", U32, D(metrics_interval_ms), .def = "5000", .flags = GPUPOOL__CF_RESTART, .doc = "how often metrics_textfile is rewritten"},
    {DAEMON, .name = "metrics_listen", FN(set_metrics_listen), D(metrics_listen), .flags = GPUPOOL__CF_RESTART, .doc = "TCP PORT, IPV4:PORT or [IPV6]:PORT for Prometheus"},
    {DAEMON, .name = "busy_poll_us", U32, D(busy_poll_us), .hi = 1000000, .def = "0",
     .flags = GPUPOOL__CF_RESTART, .doc = "poll this long after client traffic instead of sleeping; a few hundred to a few thousand us is typical"},
    {DAEMON, .name = "peer_listen", FN(set_peer_listen), D(peer_listen), .flags = GPUPOOL__CF_RESTART,
     .doc = "ADDR:PORT where other gpupoolds fetch from this one (none: serves no peer)"},
    {DAEMON, .name = "peer_secret_file", STR, D(peer_secret_file), .flags = GPUPOOL__CF_RESTART,
     .doc = "secret the peers share (at least 16 bytes; mode 0600)"},
    {DAEMON, .name = "peer_max_frame", U32, D(peer_max_frame), .lo = 4096, .hi = 64u << 20, .def = "16M",
     .flags = GPUPOOL__CF_BYTES | GPUPOOL__CF_RESTART, .doc = "largest frame one peer may send (a bundle's member table)"},
    {DAEMON, .name = "peer_max_fetches", U32, D(peer_max_fetches), .lo = 1, .hi = 65536, .def = "64",
     .doc = "fetches one peer may have in flight from this daemon"},
    {DAEMON, .name = "peer_fetch_timeout_ms", U32, D(peer_fetch_timeout_ms), .lo = 100, .hi = 3600000, .def = "60000",
     .doc = "a fetch from a peer that takes longer fails"},
    {DAEMON, .name = "peer_max_unauthenticated", U32, D(peer_max_unauthenticated), .lo = 1, .hi = 4096, .def = "64",
     .doc = "connections to peer_listen not yet authenticated, at once"},
    {DAEMON, .name = "peer_max_unauthenticated_per_addr", U32, D(peer_max_unauthenticated_per_addr), .lo = 1,
     .hi = 4096, .def = "8", .doc = "of those, from one source address"},
    {DAEMON, .name = "peer_handshake_timeout_ms", U32, D(peer_handshake_timeout_ms), .lo = 100, .hi = 600000,
     .def = "5000", .doc = "a peer connection not authenticated by then is closed"},
    {DAEMON, .name = "peer_fd_reserve", U32, D(peer_fd_reserve), .lo = 8, .hi = 1u << 20, .def = "64",
     .doc = "fds kept free: peer connections and UCX endpoints are refused below that"},

    {POOL, .name = "name", STR, P(name), .flags = GPUPOOL__CF_CMDLINE, .doc = "the pool's name (in a file, [pool NAME] gives it)"},
    {POOL, .name = "kind", FN(set_pool_kind), P(kind), .doc = "device, host or host-numa (default: the backend's)"},
    {POOL, .name = "device", .kind = GPUPOOL__CK_INT, P(device), .lo = 0, .hi = 1023,
     .doc = "GPU ordinal (host backend: the GPU a memfd pool stands for, simulated)"},
    {POOL, .name = "numa_node", .alias = "numa", .kind = GPUPOOL__CK_INT, P(numa_node), .lo = 0, .hi = 1023,
     .doc = "NUMA node of host-numa memory"},
    {POOL, .name = "capacity", SIZE, P(capacity), .doc = "most bytes the pool keeps in slabs"},
    {POOL, .name = "slab_size", .alias = "slab", SIZE, P(slab_size), .doc = "regular slab size (at most 4G)"},
    {POOL, .name = "alignment", .alias = "align", SIZE, P(alignment), .doc = "default buffer alignment (a power of two)"},
    {POOL, .name = "keep_slabs", .alias = "keep", U32, P(keep_slabs), .def = "1", .doc = "empty slabs kept mapped for reuse"},
    {POOL, .name = "release_threshold", FN(set_release_threshold), P(release_threshold), .doc = "CUDA pool attribute"},
    {POOL, .name = "reuse_follow_event_deps", BOOL, P(reuse_follow_event_deps), .doc = "CUDA pool attribute"},
    {POOL, .name = "reuse_allow_opportunistic", BOOL, P(reuse_allow_opportunistic), .doc = "CUDA pool attribute"},
    {POOL, .name = "reuse_allow_internal_deps", BOOL, P(reuse_allow_internal_deps), .doc = "CUDA pool attribute"},
    {POOL, .name = "survive", BOOL, P(survive), .def = "no",
     .doc = "slabs outlive the daemon (cuda: one exported allocation per slab; host memory always does)"},
    {POOL, .name = "keep_dedicated", U32, P(keep_dedicated), .def = "0",
     .doc = "empty dedicated slabs kept mapped for the next allocation of their tenant and size"},
    {.sections = GPUPOOL__CS_POOL, .name = "share", .kind = GPUPOOL__CK_SECTION, .doc = "the [group NAME] the pool is shared with"},

    {MEMBERS, .name = "uids", .kind = GPUPOOL__CK_IDS, M(uids), .count_off = offsetof(gpd_member_set, n_uids),
     .doc = "member uids"},
    {MEMBERS, .name = "gids", .kind = GPUPOOL__CK_IDS, M(gids), .count_off = offsetof(gpd_member_set, n_gids),
     .doc = "member primary gids"},
    {MEMBERS, .name = "export_peers", STR, M(export_peers),
     .doc = "[peer] names that may fetch this set's names (* = every peer; none: no peer)"},

    {PEER, .name = "address", FN(set_peer_address), PC(address), .doc = "ADDR:PORT of the peer's peer_listen"},
    {PEER, .name = "secret_file", STR, PC(secret_file), .doc = "the secret shared with it (default: peer_secret_file)"},
    {PEER, .name = "prefix", STR, PC(prefix), .doc = "local names starting with it map to the peer (the rest is the remote name)"},
};
const size_t gpd_n_config_keys = sizeof gpd_config_keys / sizeof gpd_config_keys[0];

#undef DAEMON
#undef POOL
#undef MEMBERS
#undef FIELD
#undef D
#undef P
#undef M
#undef PEER
#undef PC
#undef U32
#undef SIZE
#undef BOOL
#undef STR
#undef FN

/* ---- reading the table -------------------------------------------------------------------- */

const gpd_config_key *gpd_config_key_find(unsigned section, const char *key) {
  for (size_t i = 0; i < gpd_n_config_keys; i++) {
    const gpd_config_key *k = &gpd_config_keys[i];
    if ((k->sections & section) && (!strcmp(k->name, key) || (k->alias && !strcmp(k->alias, key))))
      return k;
  }
  return NULL;
}

/* 4096 as "4K", 1048576 as "1M": how the file writes byte counts. */
static void fmt_bytes(char *buf, size_t len, uint64_t v) {
  static const char *const units[] = {"", "K", "M", "G", "T"};
  size_t u = 0;
  while (u + 1 < sizeof units / sizeof units[0] && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    u++;
  }
  snprintf(buf, len, "%llu%s", (unsigned long long)v, units[u]);
}

int gpd_config_key_set(void *obj, const gpd_config_key *k, const char *v) {
  char *field = (char *)obj + k->off;
  uint32_t u = 0;
  int i = 0;

  switch (k->kind) {
  case GPUPOOL__CK_U32:
    if (parse_u32(v, &u) != 0)
      return GPUPOOL_EINVAL;
    if ((k->lo || k->hi) && (u < k->lo || u > k->hi)) {
      char lo[32], hi[32];
      if (k->flags & GPUPOOL__CF_BYTES) {
        fmt_bytes(lo, sizeof lo, k->lo);
        fmt_bytes(hi, sizeof hi, k->hi);
      } else {
        snprintf(lo, sizeof lo, "%llu", (unsigned long long)k->lo);
        snprintf(hi, sizeof hi, "%llu", (unsigned long long)k->hi);
      }
      return gpupool__err(GPUPOOL_EINVAL, "%s must be between %s and %s, got %s (%s)", k->name, lo, hi, v, k->doc);
    }
    memcpy(field, &u, sizeof u);
    return 0;
  case GPUPOOL__CK_SIZE:
    return gpd_parse_size(v, (uint64_t *)(void *)field);
  case GPUPOOL__CK_INT:
    if (parse_int(v, (int)k->lo, (int)k->hi, &i) != 0)
      return GPUPOOL_EINVAL;
    memcpy(field, &i, sizeof i);
    return 0;
  case GPUPOOL__CK_BOOL:
    if (parse_bool(v, &i) != 0)
      return GPUPOOL_EINVAL;
    memcpy(field, &i, sizeof i);
    return 0;
  case GPUPOOL__CK_STR:
    return gpd_config_copy_str(field, k->size, v);
  case GPUPOOL__CK_IDS:
    return parse_id_list(v, (uint32_t *)(void *)field, (int *)(void *)((char *)obj + k->count_off));
  case GPUPOOL__CK_FN:
    return k->set(obj, v);
  case GPUPOOL__CK_SECTION:
    break;
  }
  return gpupool__err(GPUPOOL_EINVAL, "key '%s' is read by its section, not here", k->name);
}

/* The refusal of key, unknown in section ("unknown NOUN 'key'IN"): the nearest known key
 * when it is near enough to be a typo, and the section's keys (nearest first and cut short
 * when they would not fit in a message). */
static int unknown_key(unsigned section, const char *key, const char *noun, const char *in) {
  const gpd_config_key *rows[128];
  const char *best = NULL;
  size_t dist[128], n = 0, best_d = SIZE_MAX, off = 0, all = 0, shown = 0;
  char known[260] = "", hint[96] = "";
  int sorted = 0;

  for (size_t i = 0; i < gpd_n_config_keys && n < 128; i++) {
    const gpd_config_key *k = &gpd_config_keys[i];
    const char *near = k->name;
    size_t d;
    if (!(k->sections & section))
      continue;
    d = gpupool__edit_distance(key, k->name);
    if (k->alias && gpupool__edit_distance(key, k->alias) < d) {
      d = gpupool__edit_distance(key, k->alias);
      near = k->alias; /* slabb: slab, the spelling it was nearest to */
    }
    rows[n] = k;
    dist[n++] = d;
    all += strlen(k->name) + 2;
    if (d < best_d) {
      best_d = d;
      best = near;
    }
  }
  /* Near enough to be a typo: one edit in a short key, a few in a long one. */
  if (best && best_d <= 1 + strlen(best) / 5)
    snprintf(hint, sizeof hint, "; did you mean '%s'?", best);
  /* Too many to list: the nearest first, so a cut list still shows the likely ones. */
  if (all >= sizeof known) {
    sorted = 1;
    for (size_t i = 1; i < n; i++)
      for (size_t j = i; j > 0 && dist[j] < dist[j - 1]; j--) {
        const gpd_config_key *t = rows[j];
        size_t td = dist[j];
        rows[j] = rows[j - 1], dist[j] = dist[j - 1];
        rows[j - 1] = t, dist[j - 1] = td;
      }
  }
  for (; shown < n; shown++) {
    size_t need = strlen(rows[shown]->name) + 2;
    if (off + need + 40 >= sizeof known)
      break;
    off += (size_t)snprintf(known + off, sizeof known - off, "%s%s", shown ? ", " : "", rows[shown]->name);
  }
  if (shown < n)
    snprintf(known + off, sizeof known - off, ", %zu more: gpupoold --list-config-keys", n - shown);
  return gpupool__err(GPUPOOL_EINVAL, "unknown %s '%s'%s%s (known%s: %s)", noun, key, in, hint,
                      sorted ? ", nearest first" : "", known);
}

/* ---- the sections' setters ---------------------------------------------------------------- */

/* Key k of section into obj; refused as "unknown NOUN 'k'IN" when the section has no such
 * key (or only its section reader takes it, as share). */
int gpd_config_set_key(void *obj, unsigned section, const char *k, const char *v, const char *noun,
                       const char *in) {
  const gpd_config_key *row = gpd_config_key_find(section, k);
  if (row && row->kind != GPUPOOL__CK_SECTION)
    return gpd_config_key_set(obj, row, v);
  return unknown_key(section, k, noun, in);
}

int gpd_config_set(gpd_config *c, const char *k, const char *v) {
  return gpd_config_set_key(c, GPUPOOL__CS_DAEMON, k, v, "key", " in [daemon]");
}

static const char *section_name(unsigned sections) {
  return sections & GPUPOOL__CS_DAEMON ? "daemon"
         : sections & GPUPOOL__CS_POOL ? "pool"
         : sections & GPUPOOL__CS_SPEC ? "--pool"
         : sections & GPUPOOL__CS_TENANT ? (sections & GPUPOOL__CS_GROUP ? "tenant/group" : "tenant")
         : sections & GPUPOOL__CS_PEER   ? "peer"
                                          : "group";
}

void gpd_config_list_keys(FILE *f) {
  for (size_t i = 0; i < gpd_n_config_keys; i++) {
    const gpd_config_key *k = &gpd_config_keys[i];
    fprintf(f, "[%s] %s = %s  # %s%s%s%s%s\n", section_name(k->sections), k->name, k->def ? k->def : "", k->doc,
            k->alias ? "; also written " : "", k->alias ? k->alias : "",
            (k->sections & GPUPOOL__CS_SPEC) && (k->sections & GPUPOOL__CS_POOL) ? "; also in --pool" : "",
            (k->sections & GPUPOOL__CS_DAEMON) && (k->flags & GPUPOOL__CF_RESTART) ? " (restart only)" : "");
  }
}
