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
 * link cannot lead outside the prefixes). That path is only meaningful in the daemon's own
 * mount namespace: a client in a user and mount namespace of its own can bind-mount any
 * directory it can read onto an allowed prefix, and the kernel then reports the prefix. So
 * with file_paths set, the fd's mount (mnt_id in /proc/self/fdinfo) must be one of the
 * daemon's own mounts (/proc/self/mountinfo), or the reported path, looked up by the daemon
 * itself, must lead to the same file (a daemon in a chroot sees only the mounts under its
 * root); a file opened through a mount made in another mount namespace (a container's,
 * `unshare -m`) passes neither and is refused. This runs on a worker thread with the other
 * calls that may touch the file's file system.
 *
 * Open file descriptions. An fd passed over a socket is the sender's open file description,
 * and fcntl acts on the description: F_SETSIG, F_SETOWN or F_SETFL by any process holding it
 * reach every other holder. The lease lives on a description too, and its break is signalled
 * to the description's owner with its F_SETSIG signal: had consumers received the daemon's
 * description, one of them could make the daemon's lease break deliver SIGKILL or SIGSTOP to
 * the daemon, or send it elsewhere and leave writers waiting for lease-break-time. So the
 * daemon reopens the publisher's fd through /proc/self/fd/N (O_RDONLY, O_NONBLOCK, O_NOCTTY,
 * O_CLOEXEC: the same inode, a new description, no new path lookup) and keeps only that one,
 * which no client ever holds; the lease and every check are on it. Each GetFile reopens it the
 * same way, so each consumer gets a description of its own and none the daemon's. A reopen
 * checks the daemon's credentials against the file: a daemon not running as root may be
 * refused one (a 0600 file of another uid). Then the daemon keeps the publisher's own
 * description, takes no lease on it (so no fcntl of a client can turn a lease against the
 * daemon) and hands that description to consumers: the size and mtime check at each get
 * still holds, and a consumer's fcntl reaches only the publisher's and other consumers' use of
 * that file, which they share by the publisher's choice.
 *
 * Never on the loop. fstat, open and close of a file a client handed in can wait on its file
 * system for as long as it likes (a FUSE server that stops answering; close sends FLUSH). All
 * of them run off the loop (fileops.c, a few per tenant at a time): the checks and the
 * daemon's reopen at PublishFile, the size check and the consumer's reopen at GetFile, and
 * every close of such an fd. The loop files the name and sends the reply when they are done.
 * A file's fd stays open while an operation uses it (refs), even if the name goes meanwhile.
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
 *
 * Slots. max_files bounds the fds the daemon keeps for published files, and
 * max_files_per_uid the share of one tenant, so one uid cannot take every slot.
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
#include "fileops.h"
#include "log.h"
#include "registry.h"
#include "registry_internal.h"

#ifndef F_SETLEASE
#define F_SETLEASE 1024
#define F_GETLEASE 1025
#endif

/* A request on worker threads. Inputs are set on the loop; work fills the results; the loop
 * reads them in done. */
struct gpd_file_op {
  gpd_fop base;
  gpd_registry *reg;
  gpd_file_done done;
  void *arg;                 /* NULL once forgotten */
  char *key;                 /* publish: the name's key */
  uint64_t tenant;           /* the requester's: whose names and file calls these are */
  uid_t uid;
  uint64_t client_id;
  gpupool__ratelimit *log_rl; /* the client's log limit; NULL once forgotten, with arg */
  char *name;                /* as the client wrote it, for messages */
  int in_fd;                 /* publish: the client's fd */
  gpd_file *f;          /* publish: the file being made; get: the file (a ref) */
  int out_fd;                /* the daemon's reopen (publish) or the consumer's (get), or -1 */
  int rc;
  char msg[GPUPOOL__ERRMSG_MAX];
};

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

/* A new open file description of the file behind fd: the same inode, no path lookup, the
 * daemon's credentials checked. -1 with errno when refused. */
static int fd_reopen(int fd) {
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  return open(link, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
}

/* The mount fd lies on (mnt_id in /proc/self/fdinfo), or -1. */
static long fd_mnt_id(int fd) {
  char p[64], line[256];
  long id = -1;
  FILE *in;
  snprintf(p, sizeof p, "/proc/self/fdinfo/%d", fd);
  if (!(in = fopen(p, "re")))
    return -1;
  while (fgets(line, sizeof line, in))
    if (!strncmp(line, "mnt_id:", 7)) {
      id = strtol(line + 7, NULL, 10);
      break;
    }
  fclose(in);
  return id;
}

/* 1 when mount id is a mount of the daemon's own mount namespace. */
static int mount_is_ours(long id) {
  char line[4096];
  int found = 0;
  FILE *in = fopen("/proc/self/mountinfo", "re");
  if (!in)
    return 0;
  while (!found && fgets(line, sizeof line, in)) {
    size_t n = strlen(line);
    found = strtol(line, NULL, 10) == id;
    while (n && line[n - 1] != '\n' && fgets(line, sizeof line, in)) /* the rest of a long line */
      n = strlen(line);
  }
  fclose(in);
  return found;
}

/* 1 when path lies under one of the configured prefixes (or none is configured). */
static int path_allowed(const gpd_config *cfg, const char *path) {
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

static void list_paths(const gpd_config *cfg, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (int i = 0; i < cfg->n_file_paths && o < len; i++) {
    int w = snprintf(buf + o, len - o, "%s%s", i ? " " : "", cfg->file_paths[i]);
    if (w < 0)
      break;
    o += (size_t)w;
  }
}

static void file_lease_drop(gpd_file *f) {
  if (f->leased) {
    (void)fcntl(f->fd, F_SETLEASE, F_UNLCK);
    f->leased = 0;
  }
}

static void fd_close(gpd_registry *reg, uint64_t tenant, int fd) {
  if (reg->fops)
    gpd_fileops_close(reg->fops, tenant, fd);
  else if (fd >= 0)
    close(fd);
}

static void file_unref(gpd_registry *reg, gpd_file *f) {
  if (--f->refs > 0)
    return;
  fd_close(reg, f->tenant, f->fd);
  free(f->path);
  free(f);
}

void gpd_file_close(gpd_registry *reg, gpd_file *f) {
  gpd_uid_usage *u;
  if (!f)
    return;
  file_lease_drop(f);
  reg->nfiles--;
  if ((u = gpd_uid_usage_get(reg, f->tenant, 0))) {
    u->files--;
    gpd_uid_usage_put(reg, u);
  }
  file_unref(reg, f);
}

/* Checks the kept fd against what it was at publish (worker thread): 0, or GPUPOOL_ESTALE
 * with the reason. */
static int file_check(const gpd_file *f, const char *name) {
  struct stat st;
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

static int stale_error(const gpd_file *f, const char *name) {
  return gpupool__err(GPUPOOL_ESTALE,
                      "file '%s' (%s) was opened for writing or truncated after it was published; "
                      "unpublish '%s' and publish it again once it is complete",
                      name, f->path, name);
}

/* Validates fd and the range; fills f (worker thread). The fd stays the caller's. */
static int file_inspect(const gpd_config *cfg, int fd, uint64_t offset, uint64_t length, gpd_file *f) {
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
                        "get this file)", path);
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
  if (cfg->n_file_paths > 0) {
    long mnt = fd_mnt_id(fd);
    struct stat at;
    /* The path must be where the file is in the daemon's own view: its mount is one of the
     * daemon's, or (a daemon in a chroot lists only the mounts under its root) the path
     * names this very file when the daemon looks it up itself (on a worker thread: it may
     * touch a slow file system). A mount made in another namespace passes neither. */
    if (!(mnt >= 0 && mount_is_ours(mnt)) &&
        !(stat(path, &at) == 0 && at.st_dev == st.st_dev && at.st_ino == st.st_ino))
      return gpupool__err(GPUPOOL_EPERM, "%s was opened through a mount (id %ld) that is not in the daemon's mount "
                          "namespace (the client runs in a mount namespace of its own, e.g. a container or "
                          "unshare -m), so the path does not show where the file really is and file_paths "
                          "cannot be checked; publish it from the daemon's mount namespace",
                          path, mnt);
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

/* Ask the kernel to tell us (SIGIO) when someone opens the file for writing or truncates it.
 * Never on a description a client holds (see the top of this file). */
static void file_lease(gpd_registry *reg, gpd_file *f) {
  if (!reg->cfg->file_leases || !reg->lease_signal || f->shared)
    return;
  if (fcntl(f->fd, F_SETLEASE, F_RDLCK) == 0) {
    f->leased = 1;
    return;
  }
  /* EACCES: not the owner and no CAP_LEASE; EAGAIN: open for writing somewhere; EINVAL: the
   * file system has no leases. The check at each get still holds. */
  GPUPOOL__DEBUG("no read lease on %s (%s): changes to it are caught at get time only", f->path, strerror(errno));
}

static void op_free(gpd_file_op *op) {
  free(op->key);
  free(op->name);
  free(op);
}

/* What every file operation of client c starts with. */
static void op_init(gpd_file_op *op, gpd_registry *reg, const gpd_client *c,
                    void (*work)(gpd_fop *), void (*fdone)(gpd_fop *), gpd_file_done done, void *arg) {
  op->base.tenant = c->tenant;
  op->base.work = work;
  op->base.done = fdone;
  op->reg = reg;
  op->done = done;
  op->arg = arg;
  op->tenant = c->tenant;
  op->uid = c->uid;
  op->client_id = c->id;
  op->out_fd = -1;
}

/* Runs op on a worker thread, or here and now when the daemon has no file workers (reg->fops
 * unset). On an error op was not started and is the caller's to free. */
static int op_run(gpd_registry *reg, gpd_file_op *op, gpd_file_op **out) {
  int rc;
  if (!reg->fops) {
    op->base.work(&op->base);
    *out = op;
    op->base.done(&op->base);
    return 0;
  }
  if ((rc = gpd_fileops_submit(reg->fops, &op->base)) != 0)
    return rc;
  *out = op;
  return 0;
}

/* Worker thread: the checks, then the daemon's own description (the client's fd is closed
 * here when the reopen worked: that close may wait on the file system too). */
static void publish_work(gpd_fop *base) {
  gpd_file_op *op = (gpd_file_op *)base;
  gpd_file *f = op->f;
  struct stat st;
  int fd;
  gpupool__err_clear();
  if ((op->rc = file_inspect(op->reg->cfg, op->in_fd, f->offset, f->length, f)) != 0)
    goto out;
  fd = fd_reopen(op->in_fd);
  if (fd >= 0 && (fstat(fd, &st) != 0 || (uint64_t)st.st_dev != f->dev || (uint64_t)st.st_ino != f->ino)) {
    close(fd);
    fd = -1;
    errno = EXDEV;
  }
  if (fd < 0) {
    snprintf(op->msg, sizeof op->msg, "%s", strerror(errno));
    return; /* the publisher's description is kept (shared) */
  }
  close(op->in_fd);
  op->in_fd = -1;
  op->out_fd = fd;
  return;
out:
  snprintf(op->msg, sizeof op->msg, "%s", gpupool__errmsg());
}

static void publish_done(gpd_fop *base) {
  gpd_file_op *op = (gpd_file_op *)base;
  gpd_registry *reg = op->reg;
  gpd_file *f = op->f;
  gpd_name *n = NULL;
  gpd_uid_usage *u = NULL;
  int rc = op->rc;

  if (base->cancelled)
    rc = gpupool__err(GPUPOOL_ECLOSED, "the daemon is shutting down");
  else if (rc != 0)
    rc = gpupool__err(rc, "%s", op->msg);
  /* Checked again: the name or a slot may have been taken while the file was looked at. */
  else if (gpupool__smap_get(&reg->names, op->key))
    rc = gpupool__err(GPUPOOL_EEXIST, "name '%s' is already published; unpublish it first or pick another name",
                      op->name);
  else if ((rc = gpd_quota_file(reg, op->tenant)) != 0)
    ;
  else if (!(n = calloc(1, sizeof *n)) || !(u = gpd_uid_usage_get(reg, op->tenant, 1)) ||
           !(n->name = strdup(op->key)) || gpupool__smap_put(&reg->names, op->key, n) != 0)
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (rc != 0) {
    if (u)
      gpd_uid_usage_put(reg, u);
    if (n)
      free(n->name);
    free(n);
    fd_close(reg, op->tenant, op->in_fd);
    fd_close(reg, op->tenant, op->out_fd);
    free(f->path);
    free(f);
    if (op->arg)
      op->done(op->arg, rc, NULL, -1);
    op_free(op);
    return;
  }
  if (op->out_fd >= 0) {
    f->fd = op->out_fd;
  } else {
    f->fd = op->in_fd;
    f->shared = 1;
    GPUPOOL__DEBUG("cannot reopen %s (%s): consumers get the publisher's open file description and the daemon "
                   "takes no lease on it", f->path, op->msg);
  }
  f->refs = 1;
  f->tenant = op->tenant;
  n->file = f;
  n->version = 1; /* a file is not versioned: publishing its name again is refused */
  n->uid = op->uid;
  n->tenant = op->tenant;
  n->read_only = 1;
  n->created_ns = gpd_now_ns();
  u->names++;
  u->files++;
  reg->nnames++;
  reg->nfiles++;
  file_lease(reg, f);
  GPUPOOL__PEER_INFO(op->log_rl, op->client_id,
                     "client %" PRIu64 " (uid %u) published file %s (%" PRIu64 " bytes at offset %" PRIu64
                     " of %" PRIu64 ") as '%s'%s",
                     op->client_id, (unsigned)op->uid, f->path, f->length, f->offset, f->size, op->name,
                     f->leased ? ", with a read lease" : "");
  if (op->arg)
    op->done(op->arg, 0, f, -1);
  op_free(op);
}

int gpd_publish_file(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int fd, uint64_t offset,
                          uint64_t length, gpd_file_done done, void *arg, gpd_file_op **out) {
  const char *name = rn->name, *key = rn->key;
  gpd_file_op *op = NULL;
  int rc;

  if (!reg->cfg->allow_files) {
    rc = gpupool__err(GPUPOOL_EPERM, "this daemon does not let clients publish files (allow_files = no in its "
                      "config)");
    goto fail;
  }
  if ((rc = gpd_rname_ok(rn)) != 0)
    goto fail;
  /* What can be refused at once is, before the file is looked at. */
  if (gpupool__smap_get(&reg->names, key)) {
    rc = gpupool__err(GPUPOOL_EEXIST, "name '%s' is already published; unpublish it first or pick another name",
                      name);
    goto fail;
  }
  if ((rc = gpd_quota_file(reg, c->tenant)) != 0)
    goto fail;
  if (!(op = calloc(1, sizeof *op)) || !(op->f = calloc(1, sizeof *op->f)) || !(op->key = strdup(key)) ||
      !(op->name = strdup(name))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    goto fail;
  }
  op_init(op, reg, c, publish_work, publish_done, done, arg);
  op->log_rl = &c->log_rl;
  op->in_fd = fd;
  op->f->fd = -1;
  op->f->offset = offset;
  op->f->length = length;
  if ((rc = op_run(reg, op, out)) != 0)
    goto fail;
  return 0;
fail:
  if (op) {
    free(op->f);
    op_free(op);
  }
  fd_close(reg, c->tenant, fd);
  return rc;
}

/* Worker thread: the file as it is now, and a description of its own for the consumer. */
static void get_work(gpd_fop *base) {
  gpd_file_op *op = (gpd_file_op *)base;
  gpd_file *f = op->f;
  gpupool__err_clear();
  if ((op->rc = file_check(f, op->name)) != 0) {
    snprintf(op->msg, sizeof op->msg, "%s", gpupool__errmsg());
    return;
  }
  if (f->shared)
    return; /* the consumer gets the publisher's description (see the top of this file) */
  if ((op->out_fd = fd_reopen(f->fd)) < 0) {
    op->rc = GPUPOOL_EFD;
    snprintf(op->msg, sizeof op->msg, "cannot open file '%s' (%s) for this client: %s", op->name, f->path,
             strerror(errno));
  }
}

static void get_done(gpd_fop *base) {
  gpd_file_op *op = (gpd_file_op *)base;
  gpd_registry *reg = op->reg;
  gpd_file *f = op->f;
  int rc = op->rc;
  if (base->cancelled)
    rc = gpupool__err(GPUPOOL_ECLOSED, "the daemon is shutting down");
  else if (rc != 0)
    rc = gpupool__err(rc, "%s", op->msg);
  else if (f->stale) /* the lease broke while the file was looked at */
    rc = stale_error(f, op->name);
  if (op->arg)
    op->done(op->arg, rc, f, rc != 0 ? -1 : f->shared ? f->fd : op->out_fd);
  fd_close(reg, op->tenant, op->out_fd);
  file_unref(reg, f);
  op_free(op);
}

int gpd_get_file(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, gpd_file_done done,
                      void *arg, gpd_file_op **out) {
  gpd_name *n;
  gpd_file_op *op;
  const char *name = rn->name;
  int rc = gpd_find_name(reg, c, rn, &n);
  if (rc != 0)
    return rc;
  if (!n->file)
    return gpupool__err(GPUPOOL_EINVAL, "'%s' names a buffer, not a file: get it with gpupool_buffer_get", name);
  if (n->file->stale)
    return stale_error(n->file, name);
  if (!(op = calloc(1, sizeof *op)) || !(op->name = strdup(name))) {
    free(op);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  op_init(op, reg, c, get_work, get_done, done, arg);
  op->in_fd = -1;
  op->f = n->file;
  n->file->refs++;
  if ((rc = op_run(reg, op, out)) != 0) {
    n->file->refs--;
    op_free(op);
    return rc;
  }
  return 0;
}

void gpd_file_op_forget(gpd_file_op *op) {
  if (op) {
    op->arg = NULL;
    op->log_rl = NULL;
  }
}

void gpd_files_lease_check(gpd_registry *reg) {
  if (!reg->nfiles)
    return;
  for (size_t i = 0; i < reg->names.cap; i++) {
    gpd_name *n;
    gpd_file *f;
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

void gpd_files_unlease(gpd_registry *reg) {
  reg->lease_signal = 0;
  for (size_t i = 0; i < reg->names.cap; i++) {
    gpd_name *n;
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    n = reg->names.slots[i].val;
    if (n->file)
      file_lease_drop(n->file);
  }
}
