/*
 * gpupoold configuration: defaults, the INI-style file, --pool specs, and the final checks
 * that make a pool usable (slab <= 4 GiB, capacity a whole number of slabs, power-of-two
 * alignment). Every error names the file and line (or the --pool spec) and what to write.
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
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "paths.h"
#include "log.h"

void gpupool__config_defaults(gpupool__config *c) {
  memset(c, 0, sizeof *c);
  if (gpupool__socket_path(c->socket_path, sizeof c->socket_path, 0) != 0)
    c->socket_path[0] = '\0';
  c->backend = NULL;
  c->log_level = GPUPOOL_LOG_INFO;
  c->socket_mode = 0660;
  c->max_clients = 1024;
  c->max_frame = 1u << 20;
  c->max_names = 65536;
  for (int i = 0; i < GPUPOOL_MAX_POOLS; i++)
    c->pool_share[i] = -1;
  c->max_names_per_uid = 4096;
  c->max_bundle_members = 65536;
  c->max_members_per_uid = 262144;
  c->max_members = 1048576;
  c->max_holds_per_client = 65536;
  c->max_holds_per_uid = 262144;
  c->max_clients_per_uid = 256;
  c->reserved_clients = 8;
  c->max_waiters_per_client = 1024;
  c->max_waiters_per_uid = 4096;
  c->max_queued_bytes_per_client = 64ull << 20;
  c->max_queued_bytes_total = 1ull << 30;
  c->max_waiting_leases_per_uid = 64;
  c->handshake_timeout_ms = 5000;
  c->listen_backlog = 4096;
  c->allow_files = 1;
  c->max_files = 1024;
  c->max_files_per_uid = 64;
  c->file_leases = 1;
  c->metrics_interval_ms = 5000;
}

int gpupool__parse_size(const char *s, uint64_t *out) {
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

/* Parse a metrics_listen value into *out (see gpupool__config). 0 or GPUPOOL_EINVAL. */
static int parse_listen(const char *s, struct sockaddr_storage *out) {
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
                      "metrics_listen '%s' is not PORT, IPV4:PORT or [IPV6]:PORT (e.g. 9464 for "
                      "127.0.0.1:9464; a port between 1 and 65535; addresses as numbers, not names)",
                      s);
}

static int parse_u32(const char *s, uint32_t *out) {
  uint64_t v = 0;
  if (gpupool__parse_size(s, &v) != 0 || v > UINT32_MAX)
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

int gpupool__config_set_backend(gpupool__config *c, const char *name) {
  const gpupool__backend_desc *d = NULL;
  if (strcmp(name, "auto") && !(d = gpupool__backend_by_name(name)))
    return gpupool__err(GPUPOOL_EINVAL, "unknown backend '%s' (use auto, %s)", name,
                        gpupool__backend_names());
  c->backend = d;
  return 0;
}

/* "file_paths = /data /models": absolute directory prefixes, separated by spaces or commas
 * (empty: any path). Trailing slashes are dropped; "/" alone allows everything. */
static int parse_file_paths(gpupool__config *c, const char *s) {
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

static int copy_str(char *dst, size_t len, const char *s) {
  if (strlen(s) >= len)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is longer than %zu bytes", s, len - 1);
  strcpy(dst, s);
  return 0;
}

static int set_pool_key(gpupool__pool_config *p, const char *k, const char *v) {
  uint64_t sz;
  if (!strcmp(k, "name"))
    return copy_str(p->name, sizeof p->name, v);
  if (!strcmp(k, "kind")) {
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
  if (!strcmp(k, "device"))
    return parse_int(v, 0, 1023, &p->device);
  if (!strcmp(k, "numa_node") || !strcmp(k, "numa"))
    return parse_int(v, 0, 1023, &p->numa_node);
  if (!strcmp(k, "capacity"))
    return gpupool__parse_size(v, &p->capacity);
  if (!strcmp(k, "slab_size") || !strcmp(k, "slab"))
    return gpupool__parse_size(v, &p->slab_size);
  if (!strcmp(k, "alignment") || !strcmp(k, "align"))
    return gpupool__parse_size(v, &p->alignment);
  if (!strcmp(k, "keep_slabs") || !strcmp(k, "keep"))
    return parse_u32(v, &p->keep_slabs);
  if (!strcmp(k, "release_threshold")) {
    if (gpupool__parse_size(v, &sz) != 0)
      return GPUPOOL_EINVAL;
    p->release_threshold = (int64_t)sz;
    return 0;
  }
  if (!strcmp(k, "reuse_follow_event_deps"))
    return parse_bool(v, &p->reuse_follow_event_deps);
  if (!strcmp(k, "reuse_allow_opportunistic"))
    return parse_bool(v, &p->reuse_allow_opportunistic);
  if (!strcmp(k, "reuse_allow_internal_deps"))
    return parse_bool(v, &p->reuse_allow_internal_deps);
  return gpupool__err(GPUPOOL_EINVAL,
                      "unknown pool key '%s' (known: kind, device, numa_node, capacity, slab_size, "
                      "alignment, keep_slabs, release_threshold, reuse_*)",
                      k);
}

int gpupool__member_of(const gpupool__member_set *m, uid_t uid, gid_t gid) {
  for (int i = 0; i < m->n_uids; i++)
    if (m->uids[i] == uid)
      return 1;
  for (int i = 0; i < m->n_gids; i++)
    if (m->gids[i] == gid)
      return 1;
  return 0;
}

static int set_member_key(gpupool__member_set *m, const char *k, const char *v) {
  if (!strcmp(k, "uids"))
    return parse_id_list(v, (uint32_t *)m->uids, &m->n_uids);
  if (!strcmp(k, "gids"))
    return parse_id_list(v, (uint32_t *)m->gids, &m->n_gids);
  return gpupool__err(GPUPOOL_EINVAL, "unknown key '%s' in [%s] (use uids = and gids =)", k, m->name);
}

/* The [tenant NAME] or [group NAME] section of that name, added when new. */
static gpupool__member_set *find_or_add_set(gpupool__member_set *sets, int *n, const char *name) {
  for (int i = 0; i < *n; i++)
    if (!strcmp(sets[i].name, name))
      return &sets[i];
  if (*n >= GPUPOOL_MAX_SETS)
    return NULL;
  memset(&sets[*n], 0, sizeof sets[*n]);
  snprintf(sets[*n].name, sizeof sets[*n].name, "%s", name);
  return &sets[(*n)++];
}

int gpupool__config_set(gpupool__config *c, const char *k, const char *v) {
  uint32_t u = 0;
  if (!strcmp(k, "socket"))
    return copy_str(c->socket_path, sizeof c->socket_path, v);
  if (!strcmp(k, "backend"))
    return gpupool__config_set_backend(c, v);
  if (!strcmp(k, "log_level"))
    return gpupool__log_parse_level(v, &c->log_level);
  if (!strcmp(k, "socket_mode")) {
    char *end;
    long m = strtol(v, &end, 8);
    if (*end || end == v || m < 0 || m > 0777)
      return gpupool__err(GPUPOOL_EINVAL, "socket_mode '%s' is not an octal mode like 0660", v);
    c->socket_mode = (mode_t)m;
    return 0;
  }
  if (!strcmp(k, "max_clients"))
    return parse_u32(v, &c->max_clients);
  if (!strcmp(k, "max_bytes_per_client"))
    return gpupool__parse_size(v, &c->max_bytes_per_client);
  if (!strcmp(k, "max_allocs_per_client"))
    return parse_u32(v, &c->max_allocs_per_client);
  if (!strcmp(k, "max_bytes_per_uid"))
    return gpupool__parse_size(v, &c->max_bytes_per_uid);
  if (!strcmp(k, "max_allocs_per_uid"))
    return parse_u32(v, &c->max_allocs_per_uid);
  if (!strcmp(k, "max_frame")) {
    if (parse_u32(v, &u) != 0)
      return GPUPOOL_EINVAL;
    if (u < 4096 || u > (64u << 20))
      return gpupool__err(GPUPOOL_EINVAL, "max_frame must be between 4K and 64M, got %s", v);
    c->max_frame = u;
    return 0;
  }
  if (!strcmp(k, "max_names"))
    return parse_u32(v, &c->max_names);
  if (!strcmp(k, "max_names_per_uid"))
    return parse_u32(v, &c->max_names_per_uid);
  if (!strcmp(k, "max_bundle_members")) {
    int rc = parse_u32(v, &c->max_bundle_members);
    if (rc == 0 && (c->max_bundle_members == 0 || c->max_bundle_members > GPUPOOL_BUNDLE_MAX_MEMBERS))
      return gpupool__err(GPUPOOL_EINVAL, "max_bundle_members must be between 1 and %d", GPUPOOL_BUNDLE_MAX_MEMBERS);
    return rc;
  }
  if (!strcmp(k, "max_members_per_uid"))
    return parse_u32(v, &c->max_members_per_uid);
  if (!strcmp(k, "max_members"))
    return parse_u32(v, &c->max_members);
  if (!strcmp(k, "max_holds_per_client"))
    return parse_u32(v, &c->max_holds_per_client);
  if (!strcmp(k, "max_holds_per_uid"))
    return parse_u32(v, &c->max_holds_per_uid);
  if (!strcmp(k, "max_clients_per_uid"))
    return parse_u32(v, &c->max_clients_per_uid);
  if (!strcmp(k, "reserved_clients"))
    return parse_u32(v, &c->reserved_clients);
  if (!strcmp(k, "max_waiters_per_client"))
    return parse_u32(v, &c->max_waiters_per_client);
  if (!strcmp(k, "max_waiters_per_uid"))
    return parse_u32(v, &c->max_waiters_per_uid);
  if (!strcmp(k, "max_queued_bytes_per_client"))
    return gpupool__parse_size(v, &c->max_queued_bytes_per_client);
  if (!strcmp(k, "max_queued_bytes_total"))
    return gpupool__parse_size(v, &c->max_queued_bytes_total);
  if (!strcmp(k, "max_waiting_leases_per_uid"))
    return parse_u32(v, &c->max_waiting_leases_per_uid);
  if (!strcmp(k, "handshake_timeout_ms"))
    return parse_u32(v, &c->handshake_timeout_ms);
  if (!strcmp(k, "listen_backlog")) {
    if (parse_u32(v, &c->listen_backlog) != 0)
      return GPUPOOL_EINVAL;
    if (c->listen_backlog < 1 || c->listen_backlog > 65535)
      return gpupool__err(GPUPOOL_EINVAL, "listen_backlog must be between 1 and 65535, got %s", v);
    return 0;
  }
  if (!strcmp(k, "allow_files"))
    return parse_bool(v, &c->allow_files);
  if (!strcmp(k, "file_leases"))
    return parse_bool(v, &c->file_leases);
  if (!strcmp(k, "max_files"))
    return parse_u32(v, &c->max_files);
  if (!strcmp(k, "max_files_per_uid"))
    return parse_u32(v, &c->max_files_per_uid);
  if (!strcmp(k, "file_paths"))
    return parse_file_paths(c, v);
  if (!strcmp(k, "allow_uids"))
    return parse_id_list(v, (uint32_t *)c->allow_uids, &c->n_allow_uids);
  if (!strcmp(k, "allow_gids"))
    return parse_id_list(v, (uint32_t *)c->allow_gids, &c->n_allow_gids);
  if (!strcmp(k, "metrics_textfile"))
    return copy_str(c->metrics_textfile, sizeof c->metrics_textfile, v);
  if (!strcmp(k, "metrics_socket"))
    return copy_str(c->metrics_socket, sizeof c->metrics_socket, v);
  if (!strcmp(k, "metrics_listen")) {
    if (!*v) {
      c->metrics_listen[0] = '\0';
      return 0;
    }
    if (parse_listen(v, &c->metrics_addr) != 0)
      return GPUPOOL_EINVAL;
    return copy_str(c->metrics_listen, sizeof c->metrics_listen, v);
  }
  if (!strcmp(k, "metrics_interval_ms"))
    return parse_u32(v, &c->metrics_interval_ms);
  if (!strcmp(k, "busy_poll_us")) {
    if (parse_u32(v, &c->busy_poll_us) != 0)
      return GPUPOOL_EINVAL;
    if (c->busy_poll_us > 1000000)
      return gpupool__err(GPUPOOL_EINVAL, "busy_poll_us %s is over 1 s; a few hundred to a few thousand us is typical", v);
    return 0;
  }
  return gpupool__err(GPUPOOL_EINVAL, "unknown key '%s' in [daemon]", k);
}

static gpupool__pool_config *find_or_add_pool(gpupool__config *c, const char *name) {
  for (int i = 0; i < c->n_pools; i++)
    if (!strcmp(c->pools[i].name, name))
      return &c->pools[i];
  if (c->n_pools >= GPUPOOL_MAX_POOLS)
    return NULL;
  gpupool__pool_config_init(&c->pools[c->n_pools]);
  snprintf(c->pools[c->n_pools].name, sizeof c->pools[0].name, "%s", name);
  return &c->pools[c->n_pools++];
}

/* Cut an inline comment: a '#' at the start or after whitespace. A '#' inside a word (a path
 * like /run/a#b) stays part of the value. */
static void cut_comment(char *s) {
  for (char *p = s; *p; p++)
    if (*p == '#' && (p == s || isspace((unsigned char)p[-1]))) {
      *p = '\0';
      return;
    }
}

static char *trim(char *s) {
  char *e;
  while (isspace((unsigned char)*s))
    s++;
  e = s + strlen(s);
  while (e > s && isspace((unsigned char)e[-1]))
    *--e = '\0';
  return s;
}

/* Opens path for reading only if it is a regular file. Opened non-blocking first so that a FIFO
 * with no writer cannot hold the daemon at start-up, and checked with fstat on the open fd (not
 * stat on the name) so the file read is the file checked; a directory would read as empty. */
static int open_regular(const char *path, FILE **out) {
  struct stat st;
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC), flags;
  FILE *f;

  if (fd < 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot open config file %s: %s", path, strerror(errno));
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "cannot stat config file %s: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "config file %s is %s, not a regular file; give the path of the file itself",
                        path,
                        S_ISDIR(st.st_mode)    ? "a directory"
                        : S_ISFIFO(st.st_mode) ? "a FIFO"
                        : S_ISSOCK(st.st_mode) ? "a socket"
                        : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                                       : "not a file");
  }
  if ((flags = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 || !(f = fdopen(fd, "r"))) {
    int e = errno;
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "cannot read config file %s: %s", path, strerror(e));
  }
  *out = f;
  return 0;
}

int gpupool__config_load(gpupool__config *c, const char *path) {
  FILE *f = NULL;
  char line[1024], msg[GPUPOOL__ERRMSG_MAX];
  int lineno = 0, in_daemon = 0, daemon_line = 0, rc = 0;
  gpupool__pool_config *pool = NULL;
  gpupool__member_set *set = NULL;

  if ((rc = open_regular(path, &f)) != 0)
    return rc;
  while (fgets(line, sizeof line, f)) {
    char *s, *eq, *k, *v;
    lineno++;
    if (!strchr(line, '\n') && !feof(f)) {
      rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: line longer than %zu bytes", path, lineno,
                        sizeof line - 2);
      goto out;
    }
    s = trim(line);
    if (*s == ';')
      continue;
    cut_comment(s);
    s = trim(s);
    if (*s == '\0')
      continue;
    if (*s == '[') {
      char *end = strchr(s, ']');
      if (!end || end[1] != '\0') {
        rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: malformed section header '%s' (write [daemon] or [pool NAME])",
                          path, lineno, s);
        goto out;
      }
      *end = '\0';
      s = trim(s + 1);
      pool = NULL;
      set = NULL;
      in_daemon = 0;
      if (!strcmp(s, "daemon")) {
        /* A second section of one name would be merged silently, its keys overriding the first's. */
        if (daemon_line) {
          rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: [daemon] repeats the section at %s:%d; keep one [daemon] section",
                            path, lineno, path, daemon_line);
          goto out;
        }
        daemon_line = lineno;
        in_daemon = 1;
      } else if ((!strncmp(s, "tenant", 6) && isspace((unsigned char)s[6])) ||
                 (!strncmp(s, "group", 5) && isspace((unsigned char)s[5]))) {
        int is_tenant = s[0] == 't';
        const char *name = trim(s + (is_tenant ? 6 : 5));
        if (!*name || strlen(name) >= sizeof set->name || strpbrk(name, "/: ")) {
          rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: [%s NAME] needs a name of 1 to %zu characters without '/', ':' or spaces",
                            path, lineno, is_tenant ? "tenant" : "group", sizeof set->name - 1);
          goto out;
        }
        set = is_tenant ? find_or_add_set(c->tenants, &c->n_tenants, name)
                        : find_or_add_set(c->groups, &c->n_groups, name);
        if (!set) {
          rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: more than %d [%s] sections", path, lineno, GPUPOOL_MAX_SETS,
                            is_tenant ? "tenant" : "group");
          goto out;
        }
        if (set->line) {
          rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: [%s %s] repeats the section at %s:%d; keep one section per name",
                            path, lineno, is_tenant ? "tenant" : "group", name, path, set->line);
          goto out;
        }
        set->line = lineno;
      } else if (!strncmp(s, "pool", 4) && (s[4] == '\0' || isspace((unsigned char)s[4]))) {
        const char *name = trim(s + 4);
        if (!*name)
          name = "default";
        if (strlen(name) >= sizeof pool->name) {
          rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: pool name '%s' is too long", path, lineno, name);
          goto out;
        }
        pool = find_or_add_pool(c, name);
        if (!pool) {
          rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: more than %d pools", path, lineno, GPUPOOL_MAX_POOLS);
          goto out;
        }
        if (pool->line) {
          rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: [pool %s] repeats the section at %s:%d; keep one section per pool",
                            path, lineno, name, path, pool->line);
          goto out;
        }
        pool->line = lineno;
      } else {
        rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: unknown section [%s] (use [daemon], [pool NAME], [tenant NAME] or [group NAME])",
                          path, lineno, s);
        goto out;
      }
      continue;
    }
    eq = strchr(s, '=');
    if (!eq) {
      rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: expected 'key = value', got '%s'", path, lineno, s);
      goto out;
    }
    *eq = '\0';
    k = trim(s);
    v = trim(eq + 1);
    if (!in_daemon && !pool && !set) {
      rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: key '%s' outside a section (put it under [daemon] or [pool NAME])",
                        path, lineno, k);
      goto out;
    }
    if (pool && !strcmp(k, "share")) {
      /* Resolved against the [group] sections by gpupool__config_finish (they may come later). */
      int idx = (int)(pool - c->pools);
      if (copy_str(c->pool_share_name[idx], sizeof c->pool_share_name[idx], v) != 0) {
        rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: group name '%s' is too long", path, lineno, v);
        goto out;
      }
      continue;
    }
    if ((in_daemon ? gpupool__config_set(c, k, v) : set ? set_member_key(set, k, v) : set_pool_key(pool, k, v)) != 0) {
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      rc = gpupool__err(GPUPOOL_ECONFIG, "%s:%d: %s", path, lineno, msg);
      goto out;
    }
  }
out:
  fclose(f);
  return rc;
}

int gpupool__config_add_pool_spec(gpupool__config *c, const char *spec) {
  char buf[512], *save = NULL, *tok, msg[GPUPOOL__ERRMSG_MAX];
  gpupool__pool_config p;

  if (strlen(spec) >= sizeof buf)
    return gpupool__err(GPUPOOL_ECONFIG, "--pool spec too long");
  if (c->n_pools >= GPUPOOL_MAX_POOLS)
    return gpupool__err(GPUPOOL_ECONFIG, "more than %d pools", GPUPOOL_MAX_POOLS);
  strcpy(buf, spec);
  gpupool__pool_config_init(&p);
  for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(tok, '=');
    if (!eq)
      return gpupool__err(GPUPOOL_ECONFIG, "--pool '%s': '%s' is not key=value", spec, tok);
    *eq = '\0';
    if (set_pool_key(&p, trim(tok), trim(eq + 1)) != 0) {
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      return gpupool__err(GPUPOOL_ECONFIG, "--pool '%s': %s", spec, msg);
    }
  }
  if (!p.name[0])
    snprintf(p.name, sizeof p.name, "pool%d", c->n_pools);
  for (int i = 0; i < c->n_pools; i++)
    if (!strcmp(c->pools[i].name, p.name)) {
      c->pools[i] = p; /* the command line overrides the file */
      return 0;
    }
  c->pools[c->n_pools++] = p;
  return 0;
}

int gpupool__config_finish(gpupool__config *c, const gpupool__backend_desc *backend) {
  int rc;
  for (int i = 0; i < GPUPOOL_MAX_POOLS; i++) {
    c->pool_share[i] = -1;
    if (i >= c->n_pools || !c->pool_share_name[i][0])
      continue;
    for (int g = 0; g < c->n_groups; g++)
      if (!strcmp(c->groups[g].name, c->pool_share_name[i]))
        c->pool_share[i] = g;
    if (c->pool_share[i] < 0)
      return gpupool__err(GPUPOOL_ECONFIG, "pool '%s' is shared with group '%s', which has no [group %s] section",
                          c->pools[i].name, c->pool_share_name[i], c->pool_share_name[i]);
  }
  if (c->n_pools == 0 && (rc = backend->default_pools(c->pools, GPUPOOL_MAX_POOLS, &c->n_pools)) != 0)
    return rc;
  for (int i = 0; i < c->n_pools; i++)
    if ((rc = gpupool__backend_pool_finish(backend, &c->pools[i])) != 0)
      return rc;
  return 0;
}
