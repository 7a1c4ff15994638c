/* Default socket path rules, shared by the daemon, the client library and gpupoolctl. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "errors.h"

int gpupool_default_socket_path(char *buf, size_t len) {
  const char *env = getenv("GPUPOOL_SOCKET");
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  int n;

  if (env && *env)
    n = snprintf(buf, len, "%s", env);
  else if (geteuid() == 0 || !xdg || !*xdg)
    n = snprintf(buf, len, "/run/gpupool/gpupoold.sock");
  else
    n = snprintf(buf, len, "%s/gpupool/gpupoold.sock", xdg);
  if (n < 0 || (size_t)n >= len)
    return gpupool__err(GPUPOOL_EINVAL, "socket path too long (%d bytes, limit %zu)", n, len - 1);
  return 0;
}

const char *gpupool_version_string(void) { return GPUPOOL_VERSION_STRING; }
