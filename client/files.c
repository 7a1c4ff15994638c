/*
 * libgpupool-client, files.c: Read-only published files: publishing a file by path, getting one
 * (checked and mapped), the file accessors. See internal.h for how the client is put together.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <pwd.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

struct gpupool_file {
  const gpupool__cbackend_ops *be; /* what registered it (NULL when not registered) */
  void *map;                       /* the mapping: page-aligned, map_len bytes */
  size_t map_len;
  const uint8_t *ptr;              /* the range's first byte inside it */
  const uint8_t *dev;              /* its device address, or NULL */
  gpupool_file_info info;
};

static void file_info_from(const Gpupool__Wire__FileInfo *fi, gpupool_file_info *out) {
  memset(out, 0, sizeof *out);
  out->offset = fi->offset;
  out->length = fi->length;
  out->size = fi->size;
  out->dev = fi->dev;
  out->ino = fi->ino;
  out->mtime_sec = fi->mtime_sec;
  out->mtime_nsec = fi->mtime_nsec;
}

int gpupool_file_publish(gpupool_client *c, const char *name, const char *path, uint64_t offset, uint64_t length,
                         gpupool_file_info *info) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__PublishFile pf = GPUPOOL__WIRE__PUBLISH_FILE__INIT;
  gpupool__rep *rep;
  struct stat st;
  char *wpath;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc, fd, fl;

  if (!c || !name || !path)
    return gpupool__err(GPUPOOL_EINVAL, "publish_file: client, name and path must not be NULL");
  gpupool__err_clear();
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  if (length && offset + length < offset)
    return gpupool__err(GPUPOOL_EINVAL, "offset %" PRIu64 " + length %" PRIu64 " overflows a 64-bit byte count",
                        offset, length);
  /* The caller's own open, with its own credentials: what proves to the daemon that it may
   * read the file. O_NONBLOCK so that a FIFO does not hang the open; O_NOCTTY for a tty. */
  fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    int e = errno;
    return gpupool__err(e == ENOENT || e == ENOTDIR ? GPUPOOL_ENOENT
                        : e == EACCES || e == EPERM  ? GPUPOOL_EPERM
                                                     : GPUPOOL_EINVAL,
                        "cannot open '%s' for reading: %s", path, strerror(e));
  }
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return gpupool__err(GPUPOOL_EINVAL, "'%s' is %s: only regular files can be published", path,
                        S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
  }
  if ((fl = fcntl(fd, F_GETFL)) >= 0)
    (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  /* The path goes along for the daemon's messages only, and every string on the wire must be
   * UTF-8: a file name that is not (Linux allows any bytes) is sent with '?' for those bytes. */
  if (!(wpath = strdup(path))) {
    close(fd);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  gpupool__utf8_scrub(wpath);
  pf.name = (char *)name;
  pf.path = wpath;
  pf.offset = offset;
  pf.length = length;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE;
  req.publish_file = &pf;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__call_retry(c, &req, &rep, fd, &err);
  if (rc == 0) {
    if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE || !rep->publish_file ||
        !rep->publish_file->file) {
      rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered PublishFile with something else");
    } else {
      if (info)
        file_info_from(rep->publish_file->file, info);
      gpupool__note_published(c, name);
    }
    gpupool__wire__reply__free_unpacked(rep, NULL);
  }
  pthread_mutex_unlock(&c->mu);
  free(wpath);
  close(fd); /* the daemon has its own copy */
  return gpupool__error_report(&err, rc);
}

/* Checks the fd against the description and maps the range. Takes fd. */
static int file_map(int fd, const Gpupool__Wire__FileInfo *fi, const char *name, gpupool_file *f) {
  struct stat st;
  long page = sysconf(_SC_PAGESIZE);
  uint64_t start, delta;
  int rc = 0;

  if (page <= 0)
    page = 4096;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the fd the daemon sent for '%s' is not a regular file", name);
    goto out;
  }
  if (fi->length == 0 || fi->offset + fi->length < fi->offset) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon described '%s' with an invalid range", name);
    goto out;
  }
  if ((uint64_t)st.st_dev != fi->dev || (uint64_t)st.st_ino != fi->ino) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the fd the daemon sent for '%s' is not the file it describes", name);
    goto out;
  }
  /* The daemon checked this too; the file may have changed since. Never map past the end. */
  if ((uint64_t)st.st_size < fi->offset + fi->length) {
    rc = gpupool__err(GPUPOOL_ESTALE,
                      "file '%s' is now %" PRIu64 " bytes, shorter than the published range of %" PRIu64
                      " bytes at offset %" PRIu64 " (it was %" PRIu64 " bytes when published)",
                      name, (uint64_t)st.st_size, fi->length, fi->offset, fi->size);
    goto out;
  }
  if ((uint64_t)st.st_size != fi->size || (int64_t)st.st_mtim.tv_sec != fi->mtime_sec ||
      (uint32_t)st.st_mtim.tv_nsec != fi->mtime_nsec) {
    rc = gpupool__err(GPUPOOL_ESTALE, "file '%s' changed since it was published (size %" PRIu64 " -> %" PRIu64
                      ", or its mtime moved)", name, fi->size, (uint64_t)st.st_size);
    goto out;
  }
  start = fi->offset & ~(uint64_t)(page - 1);
  delta = fi->offset - start;
  if (fi->length + delta > SIZE_MAX) {
    rc = gpupool__err(GPUPOOL_ETOOBIG, "file '%s': a range of %" PRIu64 " bytes does not fit this address space",
                      name, fi->length);
    goto out;
  }
  f->map_len = (size_t)(fi->length + delta);
  f->map = mmap(NULL, f->map_len, PROT_READ, MAP_SHARED, fd, (off_t)start);
  if (f->map == MAP_FAILED) {
    f->map = NULL;
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot map %zu bytes of file '%s': %s (check RLIMIT_AS / vm.max_map_count)",
                      f->map_len, name, strerror(errno));
    goto out;
  }
  f->ptr = (const uint8_t *)f->map + delta;
out:
  close(fd); /* the mapping keeps the file */
  return rc;
}

int gpupool_file_get(gpupool_client *c, const char *name, int timeout_ms, unsigned flags, gpupool_file **out) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__GetFile gf = GPUPOOL__WIRE__GET_FILE__INIT;
  gpupool__rep *rep = NULL;
  gpupool_file *f = NULL;
  const Gpupool__Wire__FileInfo *fi;
  uint64_t start = gpupool__mono_ns() / 1000000;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc, fd = -1;

  if (!c || !name || !out)
    return gpupool__err(GPUPOOL_EINVAL, "get_file: client, name and out must not be NULL");
  gpupool__err_clear();
  *out = NULL;
  if ((rc = gpupool__wire_check_name(name)) != 0)
    return rc;
  gf.name = (char *)name;
  gf.timeout_ms = gpupool__wire_timeout(timeout_ms);
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET_FILE;
  req.get_file = &gf;
  pthread_mutex_lock(&c->mu);
  /* As gpupool_buffer_get: a wait cut short by a daemon restart goes on with the next daemon. */
  for (rc = gpupool__ensure_connected(c, &err); rc == 0;) {
    uint64_t spent;
    int last = gf.timeout_ms == 0;
    rc = gpupool__call(c, &req, &rep, &fd, &err);
    if ((rc != GPUPOOL_ECLOSED && rc != GPUPOOL_EIO) || !c->broken || c->reconnect_ms <= 0 || last)
      break;
    err.code = 0; /* the lost connection's failure is not this get's: it asks again */
    if ((rc = gpupool__ensure_connected(c, &err)) != 0)
      break;
    spent = gpupool__mono_ns() / 1000000 - start;
    if (timeout_ms >= 0)
      gf.timeout_ms = spent >= (uint64_t)timeout_ms ? 0 : (uint32_t)((uint64_t)timeout_ms - spent);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc != 0)
    return gpupool__error_report(&err, rc);
  if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_GET_FILE || !rep->get_file || !(fi = rep->get_file->file) ||
      fd < 0) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon answered GetFile for '%s' without the file or its fd", name);
    goto fail;
  }
  if (!(f = calloc(1, sizeof *f))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    goto fail;
  }
  rc = file_map(fd, fi, name, f);
  fd = -1;
  if (rc != 0)
    goto fail;
  file_info_from(fi, &f->info);
  if (!(flags & GPUPOOL_FILE_HOST_ONLY) && c->be && c->be->file_register) {
    void *dev = NULL;
    if ((rc = c->be->file_register(f->map, f->map_len, &dev)) != 0)
      goto fail;
    f->be = c->be;
    f->dev = (const uint8_t *)dev + (f->ptr - (const uint8_t *)f->map);
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  *out = f;
  return 0;
fail:
  if (fd >= 0)
    close(fd);
  if (f && f->map)
    munmap(f->map, f->map_len);
  free(f);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return rc;
}

const void *gpupool_file_ptr(const gpupool_file *f) { return f ? f->ptr : NULL; }
const void *gpupool_file_device_ptr(const gpupool_file *f) { return f ? f->dev : NULL; }
size_t gpupool_file_size(const gpupool_file *f) { return f ? (size_t)f->info.length : 0; }

int gpupool_file_info_get(const gpupool_file *f, gpupool_file_info *out) {
  if (!f || !out)
    return gpupool__err(GPUPOOL_EINVAL, "file_info: file and out must not be NULL");
  *out = f->info;
  return 0;
}

void gpupool_file_release(gpupool_file *f) {
  if (!f)
    return;
  if (f->be && f->be->file_unregister)
    f->be->file_unregister(f->map);
  munmap(f->map, f->map_len);
  free(f);
}
