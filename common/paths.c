/* Default socket path rules, shared by the daemon, the client library and gpupoolctl. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "errors.h"
#include "paths.h"

#define SYSTEM_SOCKET "/run/gpupool/gpupoold.sock"

static int is_socket(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISSOCK(st.st_mode);
}

/* $GPUPOOL_SOCKET; else the system socket for root; else the per-user socket under
 * $XDG_RUNTIME_DIR. A client (not the daemon, which must bind its own path) falls back to
 * the system socket when there is no per-user one and the system daemon's exists, so a
 * member of the gpupool group talking to the system service needs no setting. */
int gpupool__socket_path(char *buf, size_t len, int for_client) {
  const char *env = getenv("GPUPOOL_SOCKET");
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  int n;

  if (env && *env)
    n = snprintf(buf, len, "%s", env);
  else if (geteuid() == 0 || !xdg || !*xdg)
    n = snprintf(buf, len, "%s", SYSTEM_SOCKET);
  else {
    n = snprintf(buf, len, "%s/gpupool/gpupoold.sock", xdg);
    if (for_client && n >= 0 && (size_t)n < len && !is_socket(buf) && is_socket(SYSTEM_SOCKET))
      n = snprintf(buf, len, "%s", SYSTEM_SOCKET);
  }
  if (n < 0 || (size_t)n >= len)
    return gpupool__err(GPUPOOL_EINVAL, "socket path too long (%d bytes, limit %zu)", n, len - 1);
  return 0;
}

int gpupool_default_socket_path(char *buf, size_t len) { return gpupool__socket_path(buf, len, 1); }

const char *gpupool_version_string(void) { return GPUPOOL_VERSION_STRING; }
