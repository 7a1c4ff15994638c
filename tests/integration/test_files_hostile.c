/*
 * Published files against hostile clients (host backend, a root-run daemon as in CI):
 *   fcntl     a consumer's fcntl (F_SETSIG SIGKILL / SIGSTOP, F_SETOWN) on the fd it got
 *             reaches no description of the daemon's: the daemon lives, answers, and the
 *             lease still marks the name stale; each consumer gets a description of its own.
 *   slots     one uid cannot take every file slot; root lists and removes its names.
 *   fuse      a FUSE file whose server stops answering stalls no other client: GetFile,
 *             PublishFile and the close of a stray fd wait off the loop and complete after.
 *   bindmount a bind mount made in a user and mount namespace does not pass file_paths.
 * Each needs root (uid switches, mounts); elsewhere it is skipped with the reason.
 */
#include <dirent.h>
#include <linux/fuse.h>
#include <linux/kcmp.h>
#include <poll.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <inttypes.h>
#include <sys/sysmacros.h>

#include "harness.h"
#include "raw.h"

static th_daemon D;
static char path[400];

/* What the files hold does not matter here: any seed's bytes. */
static void write_file(const char *p, size_t size, mode_t mode) { th_write_file(p, size, mode, 1); }

static void start_conf(const char *extra) {
  th_start_shared(&D, extra, TH_HOST_POOL("16M", "4M"));
  snprintf(path, sizeof path, "%s/data.bin", D.dir);
  write_file(path, 65536, 0644);
}

static int teardown(void **state) {
  (void)state;
  if (D.pid > 0)
    kill(D.pid, SIGCONT); /* a daemon a failed check left stopped still gets to exit */
  unlink(path);
  th_stop(&D);
  return 0;
}

/* ---- raw client helpers (children use them too: no assertions) ------------------------------- */

/* A connected, greeted raw client, or -1. */
static int rc_connect(void) { return ts_raw_session(D.sock, 10, "hostile-files", getpid()); }

/* Next reply and the fd it carried (-1 if none; *fd_out may be NULL). NULL on timeout. */
static gpupool__rep *rc_recv_fd(int sock, int *fd_out) {
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  if (fd_out)
    *fd_out = -1;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  if (gpupool__wire_rx_read(&rx, sock) == 1) {
    rep = gpupool__wire_unpack_reply(&rx);
    if (fd_out && rx.nfds > 0) {
      *fd_out = rx.fds[0];
      rx.fds[0] = -1;
    }
  }
  gpupool__wire_rx_reset(&rx);
  return rep;
}

/* The error code of rep (0 when it is not an error); frees rep. -999 for no reply. */
static int rc_code(gpupool__rep *rep) {
  int code;
  if (!rep)
    return -999;
  code = rep->error ? rep->error->code : 0;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return code;
}

static int rc_send_publish(int sock, uint64_t seq, const char *name, int fd) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__PublishFile pf = GPUPOOL__WIRE__PUBLISH_FILE__INIT;
  pf.name = (char *)name;
  pf.path = (char *)"";
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE;
  req.publish_file = &pf;
  return th_raw_send(sock, &req, &fd, 1);
}

static int rc_send_get(int sock, uint64_t seq, const char *name) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__GetFile gf = GPUPOOL__WIRE__GET_FILE__INIT;
  gf.name = (char *)name;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_GET_FILE;
  req.get_file = &gf;
  return th_raw_send(sock, &req, NULL, 0);
}

/* PublishFile of the file at p: the reply's error code (0 = published). */
static int rc_publish_path(int sock, const char *name, const char *p) {
  int fd = open(p, O_RDONLY | O_CLOEXEC), rc;
  if (fd < 0)
    return -998;
  rc = rc_send_publish(sock, 2, name, fd);
  close(fd);
  return rc != 0 ? rc : rc_code(rc_recv_fd(sock, NULL));
}

/* GetFile: its code, and the fd in *fd. */
static int rc_get(int sock, const char *name, int *fd) {
  *fd = -1;
  if (rc_send_get(sock, 3, name) != 0)
    return -997;
  return rc_code(rc_recv_fd(sock, fd));
}

/* A Stats on a fresh connection is answered (the receive timeout is 10 s). */
static int daemon_answers(void) {
  int fd = rc_connect(), ok;
  if (fd < 0)
    return 0;
  ok = th_raw_send_stats(fd, 9, NULL, 0) == 0 && rc_code(rc_recv_fd(fd, NULL)) == 0;
  close(fd);
  return ok;
}

static int daemon_alive(void) {
  int st;
  return waitpid(D.pid, &st, WNOHANG) == 0;
}

/* ---- fcntl on the consumer's fd ------------------------------------------------------------- */

enum { ATTACK_SIGKILL = 1, ATTACK_SIGSTOP, ATTACK_SETOWN };

static int ctl_pipe[2], ready_pipe[2];

/* As nobody: publish the file, get it, turn the consumer fd against whoever holds its
 * description, tell the parent, and once the parent opened the file for writing, see the name
 * gone stale. */
static int fcntl_child(const th_daemon *d, int attack) {
  int sock, fd, code;
  char b = 0;
  (void)d;
  close(ctl_pipe[1]);
  close(ready_pipe[0]);
  signal(SIGIO, SIG_IGN); /* F_SETOWN makes a lease break this process's SIGIO */
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK((sock = rc_connect()) >= 0, "connect");
  CHILD_CHECK((code = rc_publish_path(sock, "k", path)) == 0, "publish: %d", code);
  CHILD_CHECK((code = rc_get(sock, "k", &fd)) == 0 && fd >= 0, "get: %d", code);
  if (attack == ATTACK_SIGKILL)
    CHILD_CHECK(fcntl(fd, F_SETSIG, SIGKILL) == 0, "F_SETSIG");
  else if (attack == ATTACK_SIGSTOP)
    CHILD_CHECK(fcntl(fd, F_SETSIG, SIGSTOP) == 0, "F_SETSIG");
  else
    CHILD_CHECK(fcntl(fd, F_SETOWN, getpid()) == 0, "F_SETOWN");
  CHILD_CHECK(write(ready_pipe[1], "r", 1) == 1, "ready");
  CHILD_CHECK(read(ctl_pipe[0], &b, 1) == 1, "go");
  close(sock);
  /* The lease broke: the name is stale (a new connection: the old one may have gone with the
   * daemon on a broken build). */
  CHILD_CHECK((sock = rc_connect()) >= 0, "connect after the write-open");
  code = rc_get(sock, "k", &fd);
  CHILD_CHECK(code == GPUPOOL_ESTALE, "get after the write-open: %d (want ESTALE)", code);
  close(sock);
  return 0;
}

/* Root opens the file for writing, in a child that gives up after 10 s (the kernel holds a
 * writer up to lease-break-time, 45 s, when no one lets the lease go). 1 when it got through. */
static int writer_gets_through(void) {
  pid_t p = fork();
  int st;
  assert_true(p >= 0);
  if (p == 0) {
    int fd;
    alarm(10);
    fd = open(path, O_WRONLY | O_CLOEXEC);
    _exit(fd >= 0 ? 0 : 1);
  }
  assert_int_equal(waitpid(p, &st, 0), p);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static void fcntl_case(int attack) {
  pid_t child;
  char b;
  assert_int_equal(pipe2(ctl_pipe, O_CLOEXEC), 0);
  assert_int_equal(pipe2(ready_pipe, O_CLOEXEC), 0);
  child = th_spawn(&D, fcntl_child, attack);
  assert_int_equal(read(ready_pipe[0], &b, 1), 1);
  assert_true(writer_gets_through());
  th_sleep_ms(100);
  if (!daemon_alive())
    fail_msg("the daemon died once its lease broke (attack %d)", attack);
  if (!daemon_answers()) {
    kill(D.pid, SIGCONT);
    fail_msg("the daemon stopped answering once its lease broke (attack %d)", attack);
  }
  assert_int_equal(write(ctl_pipe[1], "g", 1), 1);
  th_wait_ok(child, "fcntl child");
  close(ctl_pipe[0]);
  close(ctl_pipe[1]);
  close(ready_pipe[0]);
  close(ready_pipe[1]);
  /* The daemon read its own signal: the lease it held, and only it, saw the writer. */
  assert_true(daemon_alive());
}

static long kcmp_files(pid_t a, pid_t b, int fa, int fb) { return syscall(SYS_kcmp, a, b, KCMP_FILE, fa, fb); }

/* 1 when fd is (the same description as) one of the daemon's fds. */
static int daemon_holds_now(int fd) {
  char dir[64];
  DIR *d;
  struct dirent *e;
  int found = 0;
  snprintf(dir, sizeof dir, "/proc/%d/fd", (int)D.pid);
  assert_non_null(d = opendir(dir));
  while (!found && (e = readdir(d)))
    if (e->d_name[0] != '.')
      found = kcmp_files(D.pid, getpid(), atoi(e->d_name), fd) == 0;
  closedir(d);
  return found;
}

/* The copy a reply was sent from is closed just after (off the daemon's loop): give it 5 s. */
static int daemon_holds(int fd) {
  for (int i = 0; i < 500; i++) {
    if (!daemon_holds_now(fd))
      return 0;
    th_sleep_ms(10);
  }
  return 1;
}

/* Two consumers and the publisher: three descriptions, none of them the daemon's. */
static void test_descriptions(void **state) {
  int sock, pubfd, fd1, fd2;
  (void)state;
  if (!th_need_root("(a root-run daemon with leases, a client as another uid)"))
    return;
  start_conf("file_leases = yes");
  assert_true((sock = rc_connect()) >= 0);
  assert_true((pubfd = open(path, O_RDONLY | O_CLOEXEC)) >= 0);
  assert_int_equal(rc_send_publish(sock, 2, "d", pubfd), 0);
  assert_int_equal(rc_code(rc_recv_fd(sock, NULL)), 0);
  assert_int_equal(rc_get(sock, "d", &fd1), 0);
  assert_int_equal(rc_get(sock, "d", &fd2), 0);
  assert_int_equal(lseek(fd1, 1234, SEEK_SET), 1234);
  assert_int_equal(lseek(pubfd, 777, SEEK_SET), 777);
  assert_int_equal(lseek(fd2, 0, SEEK_CUR), 0);
  assert_int_equal(lseek(fd1, 0, SEEK_CUR), 1234);
  if (kcmp_files(getpid(), getpid(), fd1, fd1) == 0) {
    assert_false(daemon_holds(fd1));
    assert_false(daemon_holds(fd2));
    assert_false(daemon_holds(pubfd));
  } else {
    printf("kcmp unavailable (%s): descriptions compared through their offsets only\n", strerror(errno));
  }
  close(fd1);
  close(fd2);
  close(pubfd);
  close(sock);
}

/* One test for each attack: the attack is the test's state (FCNTL_TEST). */
static void test_fcntl(void **state) {
  if (!th_need_root("(a root-run daemon with leases, a client as another uid)"))
    return;
  start_conf("file_leases = yes");
  fcntl_case(*(const int *)*state);
}

static const int attack_sigkill = ATTACK_SIGKILL, attack_sigstop = ATTACK_SIGSTOP, attack_setown = ATTACK_SETOWN;
#define FCNTL_TEST(attack) {"test_fcntl_" #attack, test_fcntl, NULL, teardown, (void *)&attack_##attack}

/* ---- file slots ----------------------------------------------------------------------------- */

#define SLOTS_TOTAL 80 /* above max_files_per_uid's default, 64 */

/* As nobody: publish files until refused; exit status = how many were taken (0..SLOTS_TOTAL). */
static int slots_child(const th_daemon *d, int arg) {
  int sock, n = 0;
  char name[32];
  (void)d;
  (void)arg;
  if (th_become(NOBODY) != 0 || (sock = rc_connect()) < 0)
    return 255;
  for (; n < SLOTS_TOTAL + 5; n++) {
    int code;
    snprintf(name, sizeof name, "slot%d", n);
    if ((code = rc_publish_path(sock, name, path)) != 0) {
      if (code != GPUPOOL_ELIMIT)
        return 254;
      break;
    }
  }
  close(sock);
  return n;
}

static gpupool__rep *admin_names(int sock) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AdminNames an = GPUPOOL__WIRE__ADMIN_NAMES__INIT;
  req.seq = 5;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_NAMES;
  req.admin_names = &an;
  assert_int_equal(th_raw_send(sock, &req, NULL, 0), 0);
  return rc_recv_fd(sock, NULL);
}

static int admin_unpublish(int sock, const char *key) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AdminUnpublish au = GPUPOOL__WIRE__ADMIN_UNPUBLISH__INIT;
  au.key = (char *)key;
  req.seq = 6;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH;
  req.admin_unpublish = &au;
  assert_int_equal(th_raw_send(sock, &req, NULL, 0), 0);
  return rc_code(rc_recv_fd(sock, NULL));
}

static void test_file_slots(void **state) {
  gpupool__rep *rep;
  int sock, st, taken, listed = 0;
  uint64_t base;
  pid_t p;
  char cfg[64];
  (void)state;
  if (!th_need_root("to run a client as another uid"))
    return;
  snprintf(cfg, sizeof cfg, "max_files = %d", SLOTS_TOTAL);
  start_conf(cfg);
  base = th_settled_fds(&D);
  p = th_spawn(&D, slots_child, 0);
  assert_int_equal(waitpid(p, &st, 0), p);
  assert_true(WIFEXITED(st));
  taken = WEXITSTATUS(st);
  printf("uid %d took %d of %d file slots\n", NOBODY, taken, SLOTS_TOTAL);
  assert_true(taken > 0 && taken < SLOTS_TOTAL);
  /* Root still publishes. */
  assert_true((sock = rc_connect()) >= 0);
  assert_int_equal(rc_publish_path(sock, "rootfile", path), 0);
  /* Root sees nobody's file names, with their tenant and uid, and removes them. */
  assert_non_null(rep = admin_names(sock));
  assert_null(rep->error);
  assert_int_equal(rep->body_case, GPUPOOL__WIRE__REPLY__BODY_ADMIN_NAMES);
  for (size_t i = 0; i < rep->admin_names->n_names; i++) {
    Gpupool__Wire__NameInfo *ni = rep->admin_names->names[i];
    if (strcmp(ni->key, "uid:0/rootfile") == 0)
      continue;
    assert_true(strncmp(ni->key, "uid:65534/slot", 14) == 0);
    assert_int_equal(ni->uid, NOBODY);
    assert_string_equal(ni->kind, "file");
    assert_string_equal(ni->path, path);
    assert_int_equal(admin_unpublish(sock, ni->key), 0);
    listed++;
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  assert_int_equal(listed, taken);
  assert_int_equal(admin_unpublish(sock, "uid:65534/slot0"), GPUPOOL_ENOENT);
  /* Only root's own name is left, and the fds of the others are back. */
  assert_non_null(rep = admin_names(sock));
  assert_int_equal(rep->admin_names->n_names, 1);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  assert_int_equal(admin_unpublish(sock, "uid:0/rootfile"), 0);
  close(sock);
  th_expect_fds(&D, base);
  /* The slots are free again. */
  p = th_spawn(&D, slots_child, 0);
  assert_int_equal(waitpid(p, &st, 0), p);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == taken);
}

/* An operator request from nobody is refused. */
static int names_denied_child(const th_daemon *d, int arg) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__AdminUnpublish au = GPUPOOL__WIRE__ADMIN_UNPUBLISH__INIT;
  int sock, code;
  (void)d;
  (void)arg;
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK((sock = rc_connect()) >= 0, "connect");
  au.key = (char *)"uid:0/rootfile";
  req.seq = 6;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH;
  req.admin_unpublish = &au;
  CHILD_CHECK(th_raw_send(sock, &req, NULL, 0) == 0, "send");
  code = rc_code(rc_recv_fd(sock, NULL));
  CHILD_CHECK(code == GPUPOOL_EPERM, "AdminUnpublish from nobody: %d", code);
  close(sock);
  return 0;
}

static void test_admin_only(void **state) {
  int sock;
  (void)state;
  if (!th_need_root("to run a client as another uid"))
    return;
  start_conf(NULL);
  assert_true((sock = rc_connect()) >= 0);
  assert_int_equal(rc_publish_path(sock, "rootfile", path), 0);
  th_wait_ok(th_spawn(&D, names_denied_child, 0), "nobody");
  assert_int_equal(admin_unpublish(sock, "uid:0/rootfile"), 0);
  close(sock);
}

/* ---- a FUSE file whose server stops answering ----------------------------------------------- */

#define FUSE_FILE_SIZE 8192

static int fuse_ctl[2] = {-1, -1}, fuse_ack[2] = {-1, -1};
static pid_t fuse_pid;
static int fuse_mounted;
static char fuse_dir[450];

static void fuse_reply(int dev, uint64_t unique, int error, const void *data, size_t len) {
  struct fuse_out_header h = {.len = (uint32_t)(sizeof h + len), .error = error, .unique = unique};
  struct iovec iov[2] = {{&h, sizeof h}, {(void *)data, len}};
  (void)!writev(dev, iov, data && len ? 2 : 1);
}

static void fuse_fill_attr(struct fuse_attr *a, uint64_t ino) {
  memset(a, 0, sizeof *a);
  a->ino = ino;
  a->blksize = 4096;
  a->mtime = 1000000;
  if (ino == FUSE_ROOT_ID) {
    a->mode = S_IFDIR | 0755;
    a->nlink = 2;
  } else {
    a->mode = S_IFREG | 0644;
    a->nlink = 1;
    a->size = FUSE_FILE_SIZE;
    a->blocks = FUSE_FILE_SIZE / 512;
  }
}

/* One file, file.bin, in the root; attributes never cached (every fstat asks). A byte on the
 * control pipe switches: 's' stops answering, 'r' resumes; each is acknowledged. It starts
 * stopped: the device reads as an error until it is mounted. */
static void fuse_serve(int dev) {
  static char buf[(1 << 17) + 4096];
  static char data[FUSE_FILE_SIZE];
  int stalled = 1;
  memset(data, 'f', sizeof data);
  for (;;) {
    struct pollfd p[2] = {{fuse_ctl[0], POLLIN, 0}, {dev, POLLIN, 0}};
    struct fuse_in_header *in = (struct fuse_in_header *)buf;
    void *arg = in + 1;
    ssize_t n;
    if (poll(p, stalled ? 1 : 2, -1) < 0)
      continue;
    if (p[0].revents) {
      char c;
      if (read(fuse_ctl[0], &c, 1) != 1)
        _exit(0);
      stalled = c == 's';
      (void)!write(fuse_ack[1], &c, 1);
      continue;
    }
    if (!(p[1].revents & POLLIN)) {
      if (p[1].revents)
        _exit(0);
      continue;
    }
    if ((n = read(dev, buf, sizeof buf)) < (ssize_t)sizeof *in) {
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == ENOENT))
        continue;
      _exit(0); /* ENODEV: unmounted */
    }
    switch (in->opcode) {
    case FUSE_INIT: {
      const struct fuse_init_in *ii = arg;
      struct fuse_init_out o;
      memset(&o, 0, sizeof o);
      o.major = FUSE_KERNEL_VERSION;
      o.minor = ii->minor < FUSE_KERNEL_MINOR_VERSION ? ii->minor : FUSE_KERNEL_MINOR_VERSION;
      o.max_readahead = ii->max_readahead;
      o.max_write = 65536;
      o.max_background = 16;
      o.congestion_threshold = 12;
      o.time_gran = 1;
      fuse_reply(dev, in->unique, 0, &o, sizeof o);
      break;
    }
    case FUSE_LOOKUP: {
      struct fuse_entry_out e;
      if (in->nodeid != FUSE_ROOT_ID || strcmp((const char *)arg, "file.bin") != 0) {
        fuse_reply(dev, in->unique, -ENOENT, NULL, 0);
        break;
      }
      memset(&e, 0, sizeof e);
      e.nodeid = 2;
      e.generation = 1;
      fuse_fill_attr(&e.attr, 2);
      fuse_reply(dev, in->unique, 0, &e, sizeof e);
      break;
    }
    case FUSE_GETATTR: {
      struct fuse_attr_out o;
      memset(&o, 0, sizeof o);
      fuse_fill_attr(&o.attr, in->nodeid);
      fuse_reply(dev, in->unique, 0, &o, sizeof o);
      break;
    }
    case FUSE_OPEN: {
      struct fuse_open_out o;
      memset(&o, 0, sizeof o);
      o.fh = 1;
      fuse_reply(dev, in->unique, 0, &o, sizeof o);
      break;
    }
    case FUSE_READ: {
      const struct fuse_read_in *r = arg;
      size_t len = r->offset >= FUSE_FILE_SIZE ? 0 : FUSE_FILE_SIZE - (size_t)r->offset;
      if (len > r->size)
        len = r->size;
      fuse_reply(dev, in->unique, 0, len ? data + r->offset : NULL, len);
      break;
    }
    case FUSE_FLUSH:
    case FUSE_RELEASE:
      fuse_reply(dev, in->unique, 0, NULL, 0);
      break;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
      break; /* no answer expected */
    default:
      fuse_reply(dev, in->unique, -ENOSYS, NULL, 0);
    }
  }
}

/* Mount the server on fuse_dir: 1, or 0 with the reason in why. */
static int fuse_start(char *why, size_t len) {
  char opts[128];
  int dev = open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (dev < 0) {
    snprintf(why, len, "cannot open /dev/fuse: %s", strerror(errno));
    return 0;
  }
  assert_int_equal(pipe2(fuse_ctl, O_CLOEXEC), 0);
  assert_int_equal(pipe2(fuse_ack, O_CLOEXEC), 0);
  fuse_pid = fork();
  assert_true(fuse_pid >= 0);
  if (fuse_pid == 0) {
    close(fuse_ctl[1]);
    close(fuse_ack[0]);
    fuse_serve(dev);
    _exit(0);
  }
  snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", dev);
  if (mount("gpupool-test", fuse_dir, "fuse", MS_NOSUID | MS_NODEV, opts) != 0) {
    snprintf(why, len, "cannot mount a FUSE file system: %s", strerror(errno));
    close(dev);
    return 0;
  }
  fuse_mounted = 1;
  close(dev);
  return 1;
}

static void fuse_switch(char c);

static void fuse_switch(char c) {
  char ack = 0;
  assert_int_equal(write(fuse_ctl[1], &c, 1), 1);
  assert_int_equal(read(fuse_ack[0], &ack, 1), 1);
  assert_int_equal(ack, c);
}

/* The server goes first: its end closing aborts the connection, so nothing (the daemon
 * included) stays blocked on the file system; then the lazy unmount. */
static void fuse_stop(void) {
  if (fuse_pid > 0) {
    kill(fuse_pid, SIGKILL);
    waitpid(fuse_pid, NULL, 0);
    fuse_pid = 0;
  }
  if (fuse_mounted) {
    umount2(fuse_dir, MNT_DETACH);
    fuse_mounted = 0;
  }
  for (int i = 0; i < 2; i++) {
    if (fuse_ctl[i] >= 0)
      close(fuse_ctl[i]);
    if (fuse_ack[i] >= 0)
      close(fuse_ack[i]);
    fuse_ctl[i] = fuse_ack[i] = -1;
  }
  if (fuse_dir[0])
    rmdir(fuse_dir);
  fuse_dir[0] = '\0';
}

static int teardown_fuse(void **state) {
  fuse_stop();
  return teardown(state);
}

static int has_reply(int sock) {
  struct pollfd p = {sock, POLLIN, 0};
  return poll(&p, 1, 0) == 1;
}

#define STRAY_FLOOD 150

static char flood_path[500];

/* As nobody: open the FUSE file while it answers, then (told to, once it stalled) send
 * STRAY_FLOOD requests each with an fd of it, and once it answers again read every reply. */
static int flood_child(const th_daemon *d, int arg) {
  int sock, fd, code;
  char b;
  (void)d;
  (void)arg;
  close(ctl_pipe[1]);
  close(ready_pipe[0]);
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK((sock = rc_connect()) >= 0, "connect");
  CHILD_CHECK((fd = open(flood_path, O_RDONLY | O_CLOEXEC)) >= 0, "open %s: %s", flood_path, strerror(errno));
  CHILD_CHECK(write(ready_pipe[1], "o", 1) == 1, "ready");
  CHILD_CHECK(read(ctl_pipe[0], &b, 1) == 1, "go");
  for (int i = 0; i < STRAY_FLOOD; i++)
    CHILD_CHECK(th_raw_send_stats(sock, 100 + (uint64_t)i, &fd, 1) == 0, "send %d", i);
  CHILD_CHECK(write(ready_pipe[1], "s", 1) == 1, "sent");
  for (int i = 0; i < STRAY_FLOOD; i++) {
    code = rc_code(rc_recv_fd(sock, NULL));
    CHILD_CHECK(code == GPUPOOL_EFD, "reply %d: %d (want EFD)", i, code);
  }
  close(fd);
  close(sock);
  return 0;
}

static void test_fuse_stall(void **state) {
  char why[160], fpath[500];
  int a, b, c, e, g, fd2, fd3, gfd = -1;
  pid_t flooder;
  char ack;
  uint64_t base;
  (void)state;
  if (!th_need_root("to mount a FUSE file system"))
    return;
  start_conf(NULL);
  snprintf(fuse_dir, sizeof fuse_dir, "%s/fuse", D.dir);
  assert_int_equal(mkdir(fuse_dir, 0755), 0);
  if (!fuse_start(why, sizeof why)) {
    printf("skipped: %s\n", why);
    return;
  }
  fuse_switch('r');
  base = th_settled_fds(&D);
  snprintf(fpath, sizeof fpath, "%s/file.bin", fuse_dir);
  /* While the server answers, the file publishes like any other. */
  assert_true((a = rc_connect()) >= 0);
  assert_int_equal(rc_publish_path(a, "fz", fpath), 0);
  assert_true((fd2 = open(fpath, O_RDONLY | O_CLOEXEC)) >= 0);
  assert_true((fd3 = open(fpath, O_RDONLY | O_CLOEXEC)) >= 0);
  assert_true((b = rc_connect()) >= 0);
  assert_true((c = rc_connect()) >= 0);
  assert_true((e = rc_connect()) >= 0);
  assert_true((g = rc_connect()) >= 0);
  assert_int_equal(pipe2(ctl_pipe, O_CLOEXEC), 0);
  assert_int_equal(pipe2(ready_pipe, O_CLOEXEC), 0);
  snprintf(flood_path, sizeof flood_path, "%s", fpath);
  flooder = th_spawn(&D, flood_child, 0);
  assert_int_equal(read(ready_pipe[0], &ack, 1), 1); /* it opened the file */

  fuse_switch('s');
  th_sleep_ms(50); /* past the attributes' (zero) validity, so an fstat asks the server */
  assert_int_equal(rc_send_get(b, 3, "fz"), 0);          /* fstat and reopen: wait */
  assert_int_equal(rc_send_publish(c, 2, "fz2", fd2), 0); /* fstat: waits */
  assert_int_equal(th_raw_send_stats(e, 4, &fd3, 1), 0); /* refused; its fd's close waits */
  assert_int_equal(rc_send_get(g, 3, "fz"), 0);          /* and then its client goes away */
  close(g);
  /* Everyone else is served meanwhile. */
  assert_true(daemon_answers());
  assert_int_equal(rc_code(rc_recv_fd(e, NULL)), GPUPOOL_EFD);
  assert_true(daemon_alive());
  assert_false(has_reply(b));
  assert_false(has_reply(c));
  /* A flood of stray fds of the stalled file: each waits to be closed, so the daemon stops
   * reading the client that sends them (about 64 of its tenant's file calls) rather than hold
   * all of them; it still answers everyone else. */
  assert_int_equal(write(ctl_pipe[1], "f", 1), 1);
  assert_int_equal(read(ready_pipe[0], &ack, 1), 1); /* it sent them all */
  assert_true(daemon_answers());
  {
    uint64_t during = th_settled_fds(&D);
    printf("daemon fds: %" PRIu64 " before, %" PRIu64 " with %d stray fds sent\n", base, during, STRAY_FLOOD);
    assert_true(during < base + 64 + 24);
  }

  fuse_switch('r');
  assert_int_equal(rc_code(rc_recv_fd(b, &gfd)), 0);
  assert_true(gfd >= 0);
  assert_int_equal(rc_code(rc_recv_fd(c, NULL)), 0);
  th_wait_ok(flooder, "stray fd flood"); /* every one of its requests answered */
  close(ctl_pipe[0]);
  close(ctl_pipe[1]);
  close(ready_pipe[0]);
  close(ready_pipe[1]);
  {
    struct stat st;
    assert_int_equal(fstat(gfd, &st), 0);
    assert_int_equal(st.st_size, FUSE_FILE_SIZE);
  }
  close(gfd);
  close(fd2);
  close(fd3);
  assert_int_equal(admin_unpublish(a, "uid:0/fz"), 0);
  assert_int_equal(admin_unpublish(a, "uid:0/fz2"), 0);
  close(a);
  close(b);
  close(c);
  close(e);
  assert_true(daemon_answers());
  /* Nothing of the requests kept an fd, the abandoned one included. */
  th_expect_fds(&D, base);
}

/* ---- a bind mount in a user namespace ------------------------------------------------------- */

static int write_proc(const char *p, const char *text) {
  int fd = open(p, O_WRONLY | O_CLOEXEC);
  int ok = fd >= 0 && write(fd, text, strlen(text)) == (ssize_t)strlen(text);
  if (fd >= 0)
    close(fd);
  return ok ? 0 : -1;
}

/* As nobody, in a user and mount namespace of its own: bind-mount the daemon's directory (not
 * under file_paths) onto a directory under file_paths, and publish a file through it. Exit
 * 77 when the kernel allows no such namespace here. */
static int bindmount_child(const th_daemon *d, int arg) {
  char allowed_mnt[500], through[560];
  int sock, code;
  (void)arg;
  snprintf(allowed_mnt, sizeof allowed_mnt, "%s/allowed/mnt", d->dir);
  snprintf(through, sizeof through, "%s/data.bin", allowed_mnt);
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  /* Dumpable again after the uid switch, or /proc/self stays root's and the maps cannot be
   * written. */
  CHILD_CHECK(prctl(PR_SET_DUMPABLE, 1) == 0, "PR_SET_DUMPABLE");
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) {
    printf("skipped: unshare(CLONE_NEWUSER | CLONE_NEWNS) as uid %d: %s\n", NOBODY, strerror(errno));
    return 77;
  }
  CHILD_CHECK(write_proc("/proc/self/setgroups", "deny") == 0, "setgroups");
  CHILD_CHECK(write_proc("/proc/self/uid_map", "0 65534 1") == 0, "uid_map");
  CHILD_CHECK(write_proc("/proc/self/gid_map", "0 65534 1") == 0, "gid_map");
  (void)mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
  if (mount(d->dir, allowed_mnt, NULL, MS_BIND, NULL) != 0) {
    printf("skipped: bind mount in a user namespace: %s\n", strerror(errno));
    return 77;
  }
  CHILD_CHECK((sock = rc_connect()) >= 0, "connect");
  code = rc_publish_path(sock, "through", through);
  CHILD_CHECK(code == GPUPOOL_EPERM, "publish through the bind mount: %d (want EPERM)", code);
  close(sock);
  return 0;
}

/* The same file, under the prefix for real, from the daemon's own mount namespace: fine. */
static int allowed_child(const th_daemon *d, int arg) {
  char p[500];
  int sock, code;
  (void)arg;
  snprintf(p, sizeof p, "%s/allowed/real.bin", d->dir);
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  CHILD_CHECK((sock = rc_connect()) >= 0, "connect");
  code = rc_publish_path(sock, "real", p);
  CHILD_CHECK(code == 0, "publish under file_paths: %d", code);
  close(sock);
  return 0;
}

static void test_bindmount(void **state) {
  char conf[700], allowed[450], mnt[460], real[470];
  int st;
  pid_t p;
  (void)state;
  if (!th_need_root("to run a client as another uid"))
    return;
  th_prepare_shared(&D);
  snprintf(allowed, sizeof allowed, "%s/allowed", D.dir);
  snprintf(mnt, sizeof mnt, "%s/mnt", allowed);
  snprintf(real, sizeof real, "%s/real.bin", allowed);
  assert_int_equal(mkdir(allowed, 0755), 0);
  assert_int_equal(mkdir(mnt, 0755), 0);
  snprintf(conf, sizeof conf,
           "[daemon]\nsocket_mode = 0666\nfile_paths = %s\n[pool default]\nkind = host\ncapacity = 16M\n"
           "slab_size = 4M\n",
           allowed);
  th_write_conf(&D, conf);
  th_start(&D, 1, NULL);
  snprintf(path, sizeof path, "%s/data.bin", D.dir);
  write_file(path, 65536, 0644);
  write_file(real, 4096, 0644);
  th_wait_ok(th_spawn(&D, allowed_child, 0), "publish under file_paths");
  p = th_spawn(&D, bindmount_child, 0);
  assert_int_equal(waitpid(p, &st, 0), p);
  unlink(real);
  rmdir(mnt);
  rmdir(allowed);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 77)
    return;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    fail_msg("the publish through a bind mount was not refused (status 0x%x)", st);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_descriptions, teardown),
      FCNTL_TEST(sigkill),
      FCNTL_TEST(sigstop),
      FCNTL_TEST(setown),
      cmocka_unit_test_teardown(test_file_slots, teardown),
      cmocka_unit_test_teardown(test_admin_only, teardown),
      cmocka_unit_test_teardown(test_fuse_stall, teardown_fuse),
      cmocka_unit_test_teardown(test_bindmount, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
