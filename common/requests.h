/*
 * The one list of request kinds: a row per case of Request's `body` oneof, read by the daemon's
 * dispatch (handler and flags), its metrics (a counter per kind, by name), its logs, and
 * gpupoolctl's messages. A new request is its proto field, one row here and its handler
 * (daemon/server/handlers_*.c); tests/unit/test_requests.c fails while a oneof case has no row.
 */
#ifndef GPUPOOL_COMMON_REQUESTS_H
#define GPUPOOL_COMMON_REQUESTS_H

#include "gpupool.pb-c.h"

/* Flags of a row. */
enum {
  /* Refused (and the connection dropped after the reply) before the connection's Hello. */
  GPUPOOL__REQ_NEEDS_HELLO = 1u << 0,
  /* Its handler may answer later (a waiter or a file call off the loop): it sets *deferred,
   * and the request is counted in the metrics when answered. */
  GPUPOOL__REQ_MAY_WAIT = 1u << 1,
  /* Operators only: root or the daemon's own uid; refused with GPUPOOL_EPERM otherwise. */
  GPUPOOL__REQ_ADMIN = 1u << 2,
};
#define GPUPOOL__REQ_CLIENT GPUPOOL__REQ_NEEDS_HELLO
#define GPUPOOL__REQ_WAITS (GPUPOOL__REQ_NEEDS_HELLO | GPUPOOL__REQ_MAY_WAIT)
#define GPUPOOL__REQ_OPERATOR (GPUPOOL__REQ_NEEDS_HELLO | GPUPOOL__REQ_ADMIN)

/* X(CASE, name, Message, flags): CASE names GPUPOOL__WIRE__REQUEST__BODY_CASE, name is the
 * oneof field's name (the metrics' type label; the daemon's handler is gpd_handle_<name>),
 * Message the proto message's name (what gpupoolctl calls it). In the proto's order. */
#define GPUPOOL__REQUEST_MAP(X)                                            \
  X(HELLO, hello, Hello, 0)                                                \
  X(ATTACH_POOL, attach_pool, AttachPool, GPUPOOL__REQ_CLIENT)             \
  X(ALLOCATE, allocate, Allocate, GPUPOOL__REQ_WAITS)                      \
  X(RELEASE, release, Release, GPUPOOL__REQ_CLIENT)                        \
  X(SHARE, share, Share, GPUPOOL__REQ_CLIENT)                              \
  X(OPEN, open, Open, GPUPOOL__REQ_WAITS)                                  \
  X(PUBLISH, publish, Publish, GPUPOOL__REQ_CLIENT)                        \
  X(GET, get, Get, GPUPOOL__REQ_WAITS)                                     \
  X(UNPUBLISH, unpublish, Unpublish, GPUPOOL__REQ_CLIENT)                  \
  X(STATS, stats, Stats, GPUPOOL__REQ_CLIENT)                              \
  X(ADMIN_CLIENTS, admin_clients, AdminClients, GPUPOOL__REQ_OPERATOR)     \
  X(ADMIN_BUFFERS, admin_buffers, AdminBuffers, GPUPOOL__REQ_OPERATOR)     \
  X(ADMIN_DROP_CLIENT, admin_drop_client, AdminDropClient, GPUPOOL__REQ_OPERATOR) \
  X(TRIM, trim, Trim, GPUPOOL__REQ_OPERATOR)                               \
  X(ALLOCATE_BUNDLE, allocate_bundle, AllocateBundle, GPUPOOL__REQ_WAITS)  \
  X(PUBLISH_BUNDLE, publish_bundle, PublishBundle, GPUPOOL__REQ_CLIENT)    \
  X(GET_BUNDLE, get_bundle, GetBundle, GPUPOOL__REQ_WAITS)                 \
  X(PUBLISH_FILE, publish_file, PublishFile, GPUPOOL__REQ_WAITS)           \
  X(GET_FILE, get_file, GetFile, GPUPOOL__REQ_WAITS)                       \
  X(ADMIN_NAMES, admin_names, AdminNames, GPUPOOL__REQ_OPERATOR)           \
  X(ADMIN_UNPUBLISH, admin_unpublish, AdminUnpublish, GPUPOOL__REQ_OPERATOR) \
  X(ADMIN_PEERS, admin_peers, AdminPeers, GPUPOOL__REQ_OPERATOR)         \
  X(IDLE, idle, Idle, GPUPOOL__REQ_CLIENT)                                 \
  X(PUBLISH_PART, publish_part, PublishPart, GPUPOOL__REQ_CLIENT)

/* A row's index: GPUPOOL__REQ_HELLO, ..., and the number of rows. */
enum {
#define GPUPOOL__REQ_ENUM(CASE, name, Message, flags) GPUPOOL__REQ_##CASE,
  GPUPOOL__REQUEST_MAP(GPUPOOL__REQ_ENUM)
#undef GPUPOOL__REQ_ENUM
  GPUPOOL__NREQUESTS
};

typedef struct {
  int body_case;       /* Gpupool__Wire__Request__BodyCase */
  const char *name;    /* "allocate", "publish_file", ... */
  const char *message; /* "Allocate", "PublishFile", ... */
  unsigned flags;      /* GPUPOOL__REQ_* */
} gpupool__request_kind;

/* The rows, indexed by GPUPOOL__REQ_*. */
extern const gpupool__request_kind gpupool__request_kinds[GPUPOOL__NREQUESTS];

/* The row index of a oneof case, or -1 for a case no row has (none set, or a newer client's). */
int gpupool__request_index(int body_case);

/* The name of a oneof case ("allocate"), or "unknown". */
const char *gpupool__request_name(int body_case);

#endif
