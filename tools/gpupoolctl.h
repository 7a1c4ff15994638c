/*
 * gpupoolctl's two halves: gpupoolctl.c (options, the command table, talking to the daemon:
 * one call path for every command) and gpupoolctl_render.c (what each command prints).
 */
#ifndef GPUPOOL_TOOLS_GPUPOOLCTL_H
#define GPUPOOL_TOOLS_GPUPOOLCTL_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/un.h>

#include "errors.h"
#include "gpupool/gpupool.h"
#include "wire.h"

#define EXIT_REFUSED 1
#define EXIT_USAGE 2
#define EXIT_UNREACHABLE 3
/* Internal: the daemon answered GPUPOOL_ENOENT to a request whose command words the message
 * itself; exits as EXIT_REFUSED. */
#define EXIT_NOT_FOUND 100
#define EXIT_CONFIG 4 /* up, answering, but not serving: what monitoring must tell from down */

typedef struct {
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  int fd;
  uint64_t seq;
  int timeout_s;
  int hello_timeout_ms; /* connect and Hello: $GPUPOOL_CONNECT_TIMEOUT_MS, else --timeout */
  int json;
  const char *cmd;
  pid_t daemon_pid;
  uid_t daemon_uid;
  gpupool__rep *hello; /* the HelloReply frame, kept for pool names and the daemon version */
} ctl;

/* With --json a failure is a JSON document too ({"error": "..."} on stdout), so a script
 * never has to parse an empty or half-written output. */
extern int json_errors;
/* Print a failure (on stderr, and as {"error": ...} with --json). */
void die_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A JSON string: quotes, backslashes and control bytes escaped, bytes that are not UTF-8
 * as U+FFFD. */
void jstr(const char *s);
const char *fmt_secs(int ms, char *buf, size_t len);
/* A pool's name from the Hello reply, or "#ID". */
const char *pool_name(const ctl *c, uint32_t id, char *buf, size_t len);
/* Send an AdminBuffers request (gpupoolctl.c); *rep is the caller's on success. */
int ctl_admin_buffers(ctl *c, gpupool__rep **rep);

/* The renderers (gpupoolctl_render.c): print a command's reply, text or --json; return the
 * exit status (0, or EXIT_REFUSED when the reply says the command did nothing). arg is the
 * command's argument (NULL when it takes none). */
typedef int ctl_render_fn(ctl *c, gpupool__rep *rep, const char *arg);
ctl_render_fn render_status, render_stats, render_clients, render_buffers, render_names,
    render_unpublish, render_peers, render_drop, render_trim;

#endif
