/*
 * Read-only file objects: a name for a file (or a range of it) that clients map without a copy
 * of their own, all of them sharing the page cache.
 *
 * Who may publish what. The daemon never opens a path on a client's behalf: the client opens
 * the file O_RDONLY itself and passes the fd with PublishFile, so the kernel has already
 * checked the client's own credentials (uid, every supplementary group, ACLs, LSM rules) in the
 * client's own mount namespace. A daemon running as root therefore cannot be used to read a
 * file its caller could not, and no check here re-implements the kernel's. The daemon then
 * requires a regular file opened read-only (no O_PATH, no directory, no device, no FIFO) and
 * applies the operator's restrictions: allow_files, and file_paths, prefixes checked on the
 * path the kernel reports for the fd (symlinks were followed when the client opened it, so a
 * link cannot lead outside the prefixes).
 *
 * Changes after publishing. A published range must never make a consumer map past the end of
 * the file (SIGBUS on the first touch). Every get compares the file as it is now (fstat of the
 * kept fd) with what it was at publish: a file that shrank below the range, or whose size or
 * mtime changed, is refused with GPUPOOL_ESTALE. With file_leases the daemon also holds a
 * read lease: an open for writing or a truncation by anyone breaks it, the kernel tells the
 * daemon (SIGIO), and the name is marked stale at once and the lease let go (the writer is
 * held up only until the daemon's loop has seen the signal). A lease needs the daemon to own
 * the file or to have CAP_LEASE, and cannot be taken while the file is open for writing
 * anywhere; without one, the fstat check at each get is what remains. No lease can stop a
 * writer: a process that already mapped the range and whose file is then truncated by someone
 * with write access can still be killed by SIGBUS when it touches the lost pages.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "errors.h"
#include "log.h"
#include "registry.h"

#ifndef F_SETLEASE
#define F_SETLEASE 1024
#define F_GETLEASE 1025
#endif

/* The path the kernel reports for fd, or "(unknown)". */
static void fd_path(int fd, char *buf, size_t len) {
  char link[64];
  ssize_t n;
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  n = readlink(link, buf, len - 1);
  if (n <= 0) {
    snprintf(buf, len, "(unknown)");
    return;
  }
  buf[n] = '\0';
}

/* 1 when path lies under one of the configured prefixes (or none is configured). */
static int path_allowed(const gpupool__config *cfg, const char *path) {
  if (cfg->n_file_paths == 0)
    return 1;
  for (int i = 0; i < cfg->n_file_paths; i++) {
    const char *p = cfg->file_paths[i];
    size_t n = strlen(p);
    if (!strcmp(p, "/"))
      return path[0] == '/';
    if (!strncmp(path, p, n) && (path[n] == '/' || path[n] == '\0'))
      return 1;
  }
  return 0;
}

static void list_paths(const gpupool__config *cfg, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (int i = 0; i < cfg->n_file_paths && o < len; i++) {
    int w = snprintf(buf + o, len - o, "%s%s", i ? " " : "", cfg->file_paths[i]);
    if (w < 0)
      break;
    o += (size_t)w;
  }
}

static void file_lease_drop(gpupool__file *f) {
  if (f->leased) {
    (void)fcntl(f->fd, F_SETLEASE, F_UNLCK);
    f->leased = 0;
  }
}

void gpupool__file_close(gpupool__registry *reg, gpupool__file *f) {
  if (!f)
    return;
  file_lease_drop(f);
  close(f->fd);
  free(f->path);
  free(f);
  reg->nfiles--;
}

/* Checks the kept fd against what it was at publish: 0, or GPUPOOL_ESTALE with the reason. */
static int file_check(const gpupool__file *f, const char *name) {
  struct stat st;
  if (f->stale)
    return gpupool__err(GPUPOOL_ESTALE,
                        "file '%s' (%s) was opened for writing or truncated after it was published; "
                        "unpublish '%s' and publish it again once it is complete",
                        name, f->path, name);
  if (fstat(f->fd, &st) != 0)
    return gpupool__err(GPUPOOL_ESTALE, "cannot stat file '%s' (%s): %s", name, f->path, strerror(errno));
  if ((uint64_t)st.st_size < f->offset + f->length)
    return gpupool__err(GPUPOOL_ESTALE,
                        "file '%s' (%s) is now %" PRIu64 " bytes, shorter than the published range of %" PRIu64
                        " bytes at offset %" PRIu64 " (it was %" PRIu64 " bytes): mapping it would fault; "
                        "unpublish '%s' and publish it again",
                        name, f->path, (uint64_t)st.st_size, f->length, f->offset, f->size, name);
  if ((uint64_t)st.st_size != f->size || (int64_t)st.st_mtim.tv_sec != f->mtime_sec ||
      (uint32_t)st.st_mtim.tv_nsec != f->mtime_nsec)
    return gpupool__err(GPUPOOL_ESTALE,
                        "file '%s' (%s) changed since it was published (size %" PRIu64 " -> %" PRIu64
                        ", or its mtime moved): readers could see a mix of old and new bytes; unpublish '%s' "
                        "and publish it again",
                        name, f->path, f->size, (uint64_t)st.st_size, name);
  return 0;
}

/* Validates fd and the range; fills f. The fd stays the caller's. */
static int file_inspect(const gpupool__config *cfg, int fd, uint64_t offset, uint64_t length, gpupool__file *f) {
  struct stat st;
  char path[1024], allowed[GPUPOOL_MAX_FILE_PATHS * 257];
  int fl = fcntl(fd, F_GETFL);

  fd_path(fd, path, sizeof path);
  if (fl < 0 || fstat(fd, &st) != 0)
    return gpupool__err(GPUPOOL_EFD, "the fd sent with PublishFile is not usable: %s", strerror(errno));
#ifdef O_PATH
  if (fl & O_PATH)
    return gpupool__err(GPUPOOL_EFD, "the fd of %s was opened with O_PATH: open the file O_RDONLY", path);
#endif
  if ((fl & O_ACCMODE) != O_RDONLY)
    return gpupool__err(GPUPOOL_EFD, "the fd of %s is open for writing: publish an fd opened O_RDONLY (readers "
                        "get this fd)", path);
  if (S_ISDIR(st.st_mode))
    return gpupool__err(GPUPOOL_EINVAL, "%s is a directory: only regular files can be published", path);
  if (!S_ISREG(st.st_mode))
    return gpupool__err(GPUPOOL_EINVAL, "%s is not a regular file (a device, FIFO or socket): only regular files "
                        "can be published", path);
  if (st.st_nlink == 0)
    return gpupool__err(GPUPOOL_EINVAL, "%s was deleted: publish a file that still has a name", path);
  if (!path_allowed(cfg, path)) {
    list_paths(cfg, allowed, sizeof allowed);
    return gpupool__err(GPUPOOL_EPERM, "%s is outside the paths this daemon lets clients publish (file_paths = %s "
                        "in its config)", path, allowed);
  }
  if (offset > (uint64_t)st.st_size)
    return gpupool__err(GPUPOOL_EINVAL, "offset %" PRIu64 " lies past the end of %s (%" PRIu64 " bytes)", offset,
                        path, (uint64_t)st.st_size);
  if (length == 0)
    length = (uint64_t)st.st_size - offset;
  else if (offset + length < offset)
    return gpupool__err(GPUPOOL_EINVAL, "offset %" PRIu64 " + length %" PRIu64 " overflows a 64-bit byte count",
                        offset, length);
  if (offset + length > (uint64_t)st.st_size)
    return gpupool__err(GPUPOOL_EINVAL,
                        "range of %" PRIu64 " bytes at offset %" PRIu64 " ends at byte %" PRIu64
                        ", past the end of %s (%" PRIu64 " bytes)",
                        length, offset, offset + length, path, (uint64_t)st.st_size);
  if (length == 0)
    return gpupool__err(GPUPOOL_EINVAL, "the range at offset %" PRIu64 " of %s (%" PRIu64 " bytes) is empty: "
                        "nothing to publish", offset, path, (uint64_t)st.st_size);
  f->offset = offset;
  f->length = length;
  f->size = (uint64_t)st.st_size;
  f->dev = (uint64_t)st.st_dev;
  f->ino = (uint64_t)st.st_ino;
  f->mtime_sec = (int64_t)st.st_mtim.tv_sec;
  f->mtime_nsec = (uint32_t)st.st_mtim.tv_nsec;
  if (!(f->path = strdup(path)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  return 0;
}

static int name_limits(gpupool__registry *reg, gpupool__client *c) {
  const gpupool__config *cfg = reg->cfg;
  int rc = gpupool__new_name_fits(reg, c->tenant);
  if (rc != 0)
    return rc;
  if (cfg->max_files && reg->nfiles >= cfg->max_files)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "the daemon already keeps %" PRIu64 " files open for published names, the limit "
                        "(max_files) is %u; unpublish files no longer needed",
                        reg->nfiles, cfg->max_files);
  return 0;
}

/* Ask the kernel to tell us (SIGIO) when someone opens the file for writing or truncates it. */
static void file_lease(gpupool__registry *reg, gpupool__file *f) {
  if (!reg->cfg->file_leases || !reg->lease_signal)
    return;
  if (fcntl(f->fd, F_SETLEASE, F_RDLCK) == 0) {
    f->leased = 1;
    return;
  }
  /* EACCES: not the owner and no CAP_LEASE; EAGAIN: open for writing somewhere; EINVAL: the
   * file system has no leases. The check at each get still holds. */
  GPUPOOL__DEBUG("no read lease on %s (%s): changes to it are caught at get time only", f->path, strerror(errno));
}

int gpupool__publish_file(gpupool__registry *reg, gpupool__client *c, const char *name, int fd, uint64_t offset,
                          uint64_t length, const gpupool__name **out) {
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  uint64_t owner;
  gpupool__file *f = NULL;
  gpupool__name *n = NULL;
  gpupool__uid_usage *u;
  int rc;

  if (!reg->cfg->allow_files) {
    rc = gpupool__err(GPUPOOL_EPERM, "this daemon does not let clients publish files (allow_files = no in its "
                      "config)");
    goto fail;
  }
  if ((rc = gpupool__name_key(reg, c, name, key, sizeof key, &owner)) != 0)
    goto fail;
  if (gpupool__smap_get(&reg->names, key)) {
    rc = gpupool__err(GPUPOOL_EEXIST, "name '%s' is already published; unpublish it first or pick another name",
                      name);
    goto fail;
  }
  if ((rc = name_limits(reg, c)) != 0)
    goto fail;
  if (!(f = calloc(1, sizeof *f)) || !(n = calloc(1, sizeof *n))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  if ((rc = file_inspect(reg->cfg, fd, offset, length, f)) != 0)
    goto fail;
  /* Needed to count this name: made now, before anything is filed. */
  if (!(u = gpupool__uid_usage_get(reg, c->tenant, 1)) || !(n->name = strdup(key))) {
    if (u)
      gpupool__uid_usage_put(reg, u);
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  if (gpupool__smap_put(&reg->names, key, n) != 0) {
    gpupool__uid_usage_put(reg, u);
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  f->fd = fd;
  n->file = f;
  n->version = 1; /* a file is not versioned: publishing its name again is refused */
  n->uid = c->uid;
  n->tenant = c->tenant;
  n->read_only = 1;
  n->created_ns = gpupool__now_ns();
  u->names++;
  reg->nnames++;
  reg->nfiles++;
  file_lease(reg, f);
  GPUPOOL__PEER_INFO(&c->log_rl, c->id,
                     "client %" PRIu64 " (uid %u) published file %s (%" PRIu64 " bytes at offset %" PRIu64 " of %" PRIu64
                     ") as '%s'%s",
                c->id, (unsigned)c->uid, f->path, f->length, f->offset, f->size, name,
                f->leased ? ", with a read lease" : "");
  *out = n;
  return 0;
fail:
  if (n)
    free(n->name);
  free(n);
  if (f)
    free(f->path);
  free(f);
  close(fd);
  return rc;
}

int gpupool__get_file(gpupool__registry *reg, gpupool__client *c, const char *name, const gpupool__name **out) {
  gpupool__name *n;
  int rc = gpupool__find_name(reg, c, name, &n);
  if (rc != 0)
    return rc;
  if (!n->file)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' names a buffer, not a file: get it with gpupool_get", name);
  if ((rc = file_check(n->file, name)) != 0)
    return rc;
  *out = n;
  return 0;
}

void gpupool__files_lease_check(gpupool__registry *reg) {
  if (!reg->nfiles)
    return;
  for (size_t i = 0; i < reg->names.cap; i++) {
    gpupool__name *n;
    gpupool__file *f;
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    n = reg->names.slots[i].val;
    if (!(f = n->file) || !f->leased)
      continue;
    /* A lease being broken reads as F_UNLCK (the type it is going to), as does one the kernel
     * already took away. */
    if (fcntl(f->fd, F_GETLEASE) != F_UNLCK)
      continue;
    f->stale = 1;
    file_lease_drop(f);
    GPUPOOL__PEER_WARN(NULL, 0, "file %s (name '%s') was opened for writing or truncated by another process: the name is stale "
                  "and gets of it are refused; processes that mapped it before keep their mappings (and fault on "
                  "pages a truncation removed)",
                  f->path, n->name);
  }
}

void gpupool__files_unlease(gpupool__registry *reg) {
  reg->lease_signal = 0;
  for (size_t i = 0; i < reg->names.cap; i++) {
    gpupool__name *n;
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    n = reg->names.slots[i].val;
    if (n->file)
      file_lease_drop(n->file);
  }
}
