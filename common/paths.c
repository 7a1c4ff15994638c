/* Default socket path rules, shared by the daemon, the client library and gpupoolctl. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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

int gpupool_client_default_socket_path(char *buf, size_t len) { return gpupool__socket_path(buf, len, 1); }

const char *gpupool_version_string(void) { return GPUPOOL_VERSION_STRING; }

static const char *file_kind(mode_t m) {
  return S_ISREG(m) ? "regular file" : S_ISDIR(m) ? "directory" : S_ISLNK(m) ? "symbolic link"
       : S_ISFIFO(m) ? "FIFO" : S_ISCHR(m) || S_ISBLK(m) ? "device node" : "non-socket file";
}

/* Only ever a socket: a typo in a socket path must not cost the file that is there. */
int gpupool__clear_stale_socket(const char *path, const char *what) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  struct stat st;
  int fd, live;

  if (lstat(path, &st) != 0) {
    if (errno == ENOENT)
      return 0;
    return gpupool__err(GPUPOOL_ECONFIG, "%s %s: %s", what, path, strerror(errno));
  }
  if (!S_ISSOCK(st.st_mode))
    return gpupool__err(GPUPOOL_ECONFIG,
                        "%s %s exists and is a %s, not a socket; refusing to remove it: choose "
                        "another path, or remove the file yourself if it is not needed",
                        what, path, file_kind(st.st_mode));
  if (strlen(path) >= sizeof addr.sun_path)
    return gpupool__err(GPUPOOL_ECONFIG, "%s %s is longer than %zu bytes", what, path,
                        sizeof addr.sun_path - 1);
  strcpy(addr.sun_path, path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return gpupool__err(GPUPOOL_EIO, "%s: socket(): %s", what, strerror(errno));
  live = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
  close(fd);
  if (live)
    return gpupool__err(GPUPOOL_EBUSY,
                        "%s %s is served by another running process (a second gpupoold?); stop "
                        "it first or choose another path",
                        what, path);
  if (unlink(path) != 0 && errno != ENOENT)
    return gpupool__err(GPUPOOL_ECONFIG, "%s %s is stale and cannot be removed: %s", what, path,
                        strerror(errno));
  return 1;
}

void gpupool__unlink_socket(const char *path) {
  struct stat st;
  if (path[0] && lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
    (void)unlink(path);
}
