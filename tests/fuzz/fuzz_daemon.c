/*
 * Fuzz target: the daemon's receive path (framing, protobuf unpack, dispatch, the registry
 * behind it, unexpected fds) through the real server code.
 *
 * For every input: a fresh libuv loop, a fresh registry with two host pools, and the real
 * server listening on an abstract Unix socket; one client socket connects, the server
 * accepts it (SO_PEERCRED and all), and the input's chunks (fuzz.h) are written as that
 * client's stream, the loop running between chunks while replies are drained. Then the
 * client hangs up and everything is torn down: server, registry, loop. The server's end of
 * the connection gets the smallest send buffer the kernel allows, and a chunk with ctl bit 6
 * (0x40) is followed by no read of the replies: together they fill the server's reply queue.
 * What a connection
 * leaves behind shows up as a LeakSanitizer report, a handle that keeps the loop from
 * closing, or an fd count that grew; the last two abort here.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "fuzz.h"
#include "fuzz_pools.h"
#include "registry.h"
#include "server.h"

static gpd_config cfg;
static gpupool__backend *be;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  static const char *const pools[] = {"name=a,kind=host,capacity=16M,slab=2M,keep=1",
                                      "name=b,kind=host,capacity=8M,slab=4M,align=4096,keep=0",
                                      NULL};
  gpd_config_defaults(&cfg);
  /* Small pools and limits, so that inputs reach "full", dedicated slabs, retirement and
   * every limit within a few requests. */
  cfg.handshake_timeout_ms = 0;
  cfg.max_allocs_per_client = 16;
  cfg.max_bytes_per_uid = 48ull << 20;
  cfg.max_names = 8;
  fuzz_host_pools(&cfg, pools, &be);
  /* libuv opens a few process-wide fds with its first loop; count fds after that. */
  {
    uv_loop_t warm;
    uv_loop_init(&warm);
    uv_loop_close(&warm);
  }
  return 0;
}

static void describe_handle(uv_handle_t *h, void *arg) {
  (void)arg;
  fprintf(stderr, "gpupool fuzz: handle left open: %s (active %d)\n", uv_handle_type_name(h->type),
          uv_is_active(h));
}

#define CTL_NO_READ 0x40

/* Run what is ready on the loop and take what the server wrote. Returns 1 once the client
 * socket saw the end of the stream. */
static int pump(uv_loop_t *loop, int cli) {
  uv_run(loop, UV_RUN_NOWAIT);
  return fuzz_drain(cli);
}

/* The lowest free fd: the one the server's accept4 will return (this thread opens nothing
 * in between). */
static int next_fd(void) {
  int fd = fcntl(0, F_DUPFD_CLOEXEC, 0);
  if (fd < 0)
    fuzz_fail("F_DUPFD: %s", strerror(errno));
  close(fd);
  return fd;
}

static int listen_abstract(struct sockaddr_un *addr, socklen_t *alen) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    fuzz_fail("socket: %s", strerror(errno));
  /* An address of just the family: the kernel picks a unique abstract name. */
  addr->sun_family = AF_UNIX;
  if (bind(fd, (struct sockaddr *)addr, sizeof(sa_family_t)) != 0 || listen(fd, 4) != 0)
    fuzz_fail("bind/listen: %s", strerror(errno));
  *alen = sizeof *addr;
  if (getsockname(fd, (struct sockaddr *)addr, alen) != 0)
    fuzz_fail("getsockname: %s", strerror(errno));
  return fd;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static fuzz_chunk chunks[FUZZ_MAX_CHUNKS];
  size_t nchunks = fuzz_chunks(data, size, chunks, FUZZ_MAX_CHUNKS);
  int fds_before = fuzz_count_fds(), lfd, cli, conn_fd, eof = 0, rounds;
  struct sockaddr_un addr;
  socklen_t alen;
  uv_loop_t loop;
  gpd_registry reg;
  gpd_server *srv;

  if (uv_loop_init(&loop) != 0)
    fuzz_fail("uv_loop_init failed");
  if (gpd_registry_init(&reg, &loop, &cfg, be) != 0)
    fuzz_fail("registry: %s", gpupool__errmsg());
  lfd = listen_abstract(&addr, &alen);
  if (gpd_server_start(&srv, &loop, &cfg, &reg, lfd) != 0)
    fuzz_fail("server: %s", gpupool__errmsg());
  cli = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (cli < 0 || connect(cli, (struct sockaddr *)&addr, alen) != 0)
    fuzz_fail("connect: %s", strerror(errno));
  conn_fd = next_fd();
  for (rounds = 0; gpd_server_clients(srv) == 0; rounds++) {
    if (rounds > 1000)
      fuzz_fail("the server did not accept the connection");
    uv_run(&loop, UV_RUN_NOWAIT);
  }
  {
    int small = 1; /* the kernel raises it to its minimum, a few KiB */
    struct stat st;
    if (fstat(conn_fd, &st) != 0 || !S_ISSOCK(st.st_mode))
      fuzz_fail("fd %d is not the server's end of the connection", conn_fd);
    if (setsockopt(conn_fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof small) != 0)
      fuzz_fail("SO_SNDBUF: %s", strerror(errno));
  }

  for (size_t i = 0; i < nchunks && !eof; i++) {
    size_t off = 0;
    int rc;
    for (rounds = 0; (rc = fuzz_send_chunk(cli, &chunks[i], &off)) == 0; rounds++) {
      /* Socket full: let the server read (and answer) before writing more. */
      if (rounds > 10000)
        fuzz_fail("the server stopped reading without closing the connection");
      eof = pump(&loop, cli);
      if (eof)
        break;
    }
    if (rc < 0)
      break; /* the server hung up: the rest of the input is never read */
    if (chunks[i].ctl & CTL_NO_READ)
      uv_run(&loop, UV_RUN_NOWAIT);
    else
      eof = pump(&loop, cli);
  }

  /* Hang up and let the server see it; it must close the connection on its own. */
  shutdown(cli, SHUT_WR);
  for (rounds = 0; gpd_server_clients(srv) > 0; rounds++) {
    if (rounds > 10000)
      fuzz_fail("the server kept a connection after its client hung up");
    pump(&loop, cli);
  }
  close(cli);

  gpd_server_stop(srv);
  gpd_registry_close(&reg);
  /* Closing may wait for file calls on worker threads (every fd a client sent is closed off
   * the loop): give them up to 10 s of wall time, not a number of rounds, so a loaded machine
   * does not read as a leaked handle; a handle that never closes still fails. */
  for (uint64_t end = uv_hrtime() + 10000000000ull; uv_loop_alive(&loop) && uv_hrtime() < end;) {
    uv_run(&loop, UV_RUN_NOWAIT);
    if (uv_loop_alive(&loop))
      usleep(1000);
  }
  if (uv_loop_close(&loop) != 0) {
    uv_walk(&loop, describe_handle, NULL);
    fuzz_fail("the loop still has handles after the server and registry were closed");
  }
  if (fuzz_count_fds() != fds_before)
    fuzz_fail("%d fds open after the input, %d before", fuzz_count_fds(), fds_before);
  return 0;
}
