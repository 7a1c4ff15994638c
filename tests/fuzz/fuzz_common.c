/*
 * Glue shared by the fuzz targets: the chunked input format (fuzz.h), sending chunks with
 * fds, draining a socket, and counting fds.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fuzz.h"
#include "wire.h"

size_t fuzz_chunks(const uint8_t *in, size_t n, fuzz_chunk *out, size_t max) {
  size_t k = 0, pos = 0;
  while (pos < n && k < max) {
    size_t len;
    out[k].ctl = in[pos++];
    len = 0;
    if (pos < n)
      len = in[pos++];
    if (pos < n)
      len |= (size_t)in[pos++] << 8;
    if (len > n - pos)
      len = n - pos;
    out[k].data = in + pos;
    out[k].len = len;
    pos += len;
    k++;
  }
  return k;
}

uint64_t fuzz_memfd_size(uint8_t ctl) {
  static const uint64_t sizes[4] = {4096, 2ull << 20, 8ull << 20, 64ull << 20};
  return sizes[FUZZ_CTL_SIZE(ctl)];
}

static int make_memfd(uint8_t ctl) {
  int fd = memfd_create("gpupool-fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    fuzz_fail("memfd_create: %s", strerror(errno));
  if (ftruncate(fd, (off_t)fuzz_memfd_size(ctl)) != 0)
    fuzz_fail("ftruncate of a memfd: %s", strerror(errno));
  if ((ctl & FUZZ_CTL_SEALED) && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    fuzz_fail("sealing a memfd: %s", strerror(errno));
  return fd;
}

int fuzz_send_chunk(int sock, const fuzz_chunk *c, size_t *off) {
  int fds[8] = {0};
  int nfds = 0;
  ssize_t n;

  if (*off >= c->len)
    return 1;
  if (*off == 0) {
    nfds = FUZZ_CTL_NFDS(c->ctl);
    for (int i = 0; i < nfds; i++)
      fds[i] = make_memfd(c->ctl);
  }
  n = gpupool__wire_sendmsg(sock, c->data + *off, c->len - *off, fds, nfds, MSG_DONTWAIT);
  /* The receiver has its own copies now (or none, if the send failed). */
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  if (n < 0)
    return n == -EAGAIN || n == -EWOULDBLOCK ? 0 : -1;
  *off += (size_t)n;
  return *off >= c->len;
}

int fuzz_drain(int sock) {
  uint8_t buf[65536];
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(16 * sizeof(int))];
  } ctrl;
  for (;;) {
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
    struct msghdr msg;
    ssize_t n;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl.buf;
    msg.msg_controllen = sizeof ctrl.buf;
    n = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : 1;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
        for (size_t k = 0; k + sizeof(int) <= cm->cmsg_len - CMSG_LEN(0); k += sizeof(int)) {
          int fd;
          memcpy(&fd, CMSG_DATA(cm) + k, sizeof fd);
          close(fd);
        }
    if (n == 0)
      return 1;
  }
}

int fuzz_count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  int n = 0;
  if (!d)
    fuzz_fail("cannot list /proc/self/fd: %s", strerror(errno));
  while ((e = readdir(d)))
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

void fuzz_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "gpupool fuzz: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  abort();
}
