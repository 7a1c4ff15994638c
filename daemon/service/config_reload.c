/*
 * A reload of the configuration: which keys differ from their defaults (for the log), and
 * applying a newly read file to the live one in place (what a reload cannot apply is kept
 * and said, see gpd_config_reload).
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
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
#include "log.h"

void gpd_config_changed_keys(const gpd_config *c, char *buf, size_t len) {
  gpd_config d;
  size_t off = 0;
  gpd_config_defaults(&d);
  buf[0] = '\0';
  for (size_t i = 0; i < gpd_n_config_keys; i++) {
    const gpd_config_key *k = &gpd_config_keys[i];
    size_t need;
    if (!(k->sections & GPUPOOL__CS_DAEMON) || !memcmp((const char *)c + k->off, (const char *)&d + k->off, k->size))
      continue;
    need = strlen(k->name) + 2;
    if (off + need + 4 >= len) {
      snprintf(buf + off, len - off, "%s...", off ? ", " : "");
      return;
    }
    off += (size_t)snprintf(buf + off, len - off, "%s%s", off ? ", " : "", k->name);
  }
}

/* Append name to a comma-separated list in buf, "..." once it is full. */
static void list_add(char *buf, size_t len, const char *name) {
  size_t off = strlen(buf);
  if (off >= 3 && !strcmp(buf + off - 3, "..."))
    return;
  if (off + strlen(name) + 6 >= len) {
    snprintf(buf + off, len - off, "%s...", off ? ", " : "");
    return;
  }
  snprintf(buf + off, len - off, "%s%s", off ? ", " : "", name);
}

/* The sets of next keep every set of live by name and position (see gpd_config_reload). */
static int sets_compatible(const gpd_member_set *live, int nlive, const gpd_member_set *next, int nnext) {
  if (nnext < nlive)
    return 0;
  for (int i = 0; i < nlive; i++)
    if (strcmp(live[i].name, next[i].name))
      return 0;
  return 1;
}

static void reload_sets(gpd_member_set *live, int *nlive, const gpd_member_set *next, int nnext, const char *what,
                        char *applied, size_t alen, char *kept, size_t klen) {
  /* Line numbers differ when only comments moved: compare the members. */
  int same = *nlive == nnext;
  for (int i = 0; same && i < nnext; i++)
    same = !strcmp(live[i].name, next[i].name) && live[i].n_uids == next[i].n_uids &&
           live[i].n_gids == next[i].n_gids &&
           !memcmp(live[i].uids, next[i].uids, sizeof live[i].uids) &&
           !memcmp(live[i].gids, next[i].gids, sizeof live[i].gids) &&
           !strcmp(live[i].export_peers, next[i].export_peers);
  if (same)
    return;
  if (!sets_compatible(live, *nlive, next, nnext)) {
    char why[96];
    snprintf(why, sizeof why, "%s (one was renamed or removed)", what);
    list_add(kept, klen, why);
    return;
  }
  memcpy(live, next, sizeof *live * GPUPOOL_MAX_SETS);
  *nlive = nnext;
  list_add(applied, alen, what);
}

/* The same pools, wherever in the file they are written. */
static int pools_same(const gpd_config *a, const gpd_config *b) {
  if (a->n_pools != b->n_pools || memcmp(a->pool_share, b->pool_share, sizeof a->pool_share))
    return 0;
  for (int i = 0; i < a->n_pools; i++) {
    gpupool__pool_config p = b->pools[i];
    p.line = a->pools[i].line;
    if (memcmp(&a->pools[i], &p, sizeof p))
      return 0;
  }
  return 1;
}

void gpd_config_reload(gpd_config *live, const gpd_config *next, char *applied, size_t alen, char *kept,
                       size_t klen) {
  applied[0] = kept[0] = '\0';
  for (size_t i = 0; i < gpd_n_config_keys; i++) {
    const gpd_config_key *k = &gpd_config_keys[i];
    char *dst = (char *)live + k->off;
    const char *src = (const char *)next + k->off;
    int same;
    if (!(k->sections & GPUPOOL__CS_DAEMON))
      continue;
    same = !memcmp(dst, src, k->size);
    if (k->kind == GPUPOOL__CK_IDS)
      same = same && !memcmp((char *)live + k->count_off, (const char *)next + k->count_off, sizeof(int));
    if (!strcmp(k->name, "file_paths"))
      same = same && live->n_file_paths == next->n_file_paths;
    if (!strcmp(k->name, "metrics_listen"))
      same = same && !memcmp(&live->metrics_addr, &next->metrics_addr, sizeof live->metrics_addr);
    if (same)
      continue;
    if (k->flags & GPUPOOL__CF_RESTART) {
      list_add(kept, klen, k->name);
      continue;
    }
    memcpy(dst, src, k->size);
    if (k->kind == GPUPOOL__CK_IDS)
      memcpy((char *)live + k->count_off, (const char *)next + k->count_off, sizeof(int));
    if (!strcmp(k->name, "file_paths"))
      live->n_file_paths = next->n_file_paths;
    list_add(applied, alen, k->name);
  }
  if (!pools_same(live, next))
    list_add(kept, klen, "pools");
  if (live->n_peers != next->n_peers)
    list_add(kept, klen, "peers");
  for (int i = 0; i < live->n_peers && i < next->n_peers; i++) {
    gpd_peer_conf p = next->peers[i];
    p.line = live->peers[i].line;
    if (memcmp(&p, &live->peers[i], sizeof p)) {
      list_add(kept, klen, "peers");
      break;
    }
  }
  reload_sets(live->tenants, &live->n_tenants, next->tenants, next->n_tenants, "tenants", applied, alen, kept, klen);
  reload_sets(live->groups, &live->n_groups, next->groups, next->n_groups, "groups", applied, alen, kept, klen);
}
