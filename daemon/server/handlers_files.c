/*
 * PublishFile and GetFile: their system calls run off the loop (fileops.c, files.c); the
 * request waits in the connection's fwaits list until they are done, and is forgotten if the
 * connection goes first.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "list.h"
#include "server_internal.h"

void gpd_fwait_unlink(fwait *fw) {
  gpd_conn *c = fw->conn;
  GPUPOOL__LIST_UNLINK(c->fwaits, fw, prev, next);
}

static fwait *fwait_new(gpd_conn *c, uint64_t seq, int kind, const gpd_rname *rn, int count) {
  fwait *fw = calloc(1, sizeof *fw);
  if (!fw || !(fw->name = strdup(rn->name))) {
    free(fw);
    gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    return NULL;
  }
  fw->rn = *rn;
  fw->rn.name = fw->name;
  fw->conn = c;
  fw->seq = seq;
  fw->kind = kind;
  fw->count = count;
  fw->started_ns = gpd_now_ns();
  fw->next = c->fwaits;
  if (c->fwaits)
    c->fwaits->prev = fw;
  c->fwaits = fw;
  return fw;
}

void gpd_fwait_free(fwait *fw) {
  free(fw->name);
  free(fw);
}

/* files.c is done with a PublishFile or GetFile of c's: answer it. */
static void file_done(void *arg, int rc, const gpd_file *f, int fd) {
  fwait *fw = arg;
  gpd_conn *c = fw->conn;
  gpd_fwait_unlink(fw);
  if (rc != 0)
    gpd_send_error(c, fw->seq, rc, gpupool__errmsg());
  else
    gpd_srv_reply_file(c, fw->seq, f, &fw->rn, fw->kind, fd);
  if (rc == 0 && fw->kind == GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE && !c->closing)
    gpd_published(c, &fw->rn, 1); /* a file is not versioned */
  if (fw->count && c->srv->metrics)
    gpd_metrics_request(c->srv->metrics,
                             fw->kind == GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE ? GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE
                                                                               : GPUPOOL__WIRE__REQUEST__BODY_GET_FILE,
                             rc, gpd_now_ns() - fw->started_ns);
  gpd_fwait_free(fw);
}

/* A GetFile of name for c, answered when files.c has looked at the file: 0, or the error now. */
int gpd_file_get_start(gpd_conn *c, uint64_t seq, const gpd_rname *rn, int count) {
  fwait *fw = fwait_new(c, seq, GPUPOOL__WIRE__REPLY__BODY_GET_FILE, rn, count);
  int rc;
  if (!fw)
    return GPUPOOL_ENOMEM;
  if ((rc = gpd_get_file(c->srv->reg, &c->cl, &fw->rn, file_done, fw, &fw->op)) != 0) {
    gpd_fwait_unlink(fw);
    gpd_fwait_free(fw);
  }
  return rc;
}

int gpd_handle_publish_file(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__PublishFile *m = req->publish_file;
  fwait *fw;
  gpd_rname rn;
  int fd = c->frame_fd, rc;
  c->frame_fd = -1;
  if (fd < 0)
    return gpupool__err(GPUPOOL_EFD, "PublishFile carries no fd: the client opens the file O_RDONLY and sends the "
                        "fd with the request (gpupool_file_publish does)");
  gpd_name_key(c->srv->reg, &c->cl, m->name, &rn); /* an error is told where the name is used */
  if (!(fw = fwait_new(c, seq, GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE, &rn, 1))) {
    gpd_conn_close_fd(c, fd);
    return GPUPOOL_ENOMEM;
  }
  if ((rc = gpd_publish_file(c->srv->reg, &c->cl, &fw->rn, fd, m->offset, m->length, file_done, fw,
                                  &fw->op)) != 0) {
    gpd_fwait_unlink(fw); /* fd closed there */
    gpd_fwait_free(fw);
    return rc;
  }
  *deferred = 1;
  return 0;
}

int gpd_handle_get_file(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  uint64_t seq = req->seq;
  const Gpupool__Wire__GetFile *m = req->get_file;
  gpd_rname rn;
  int rc;
  gpd_name_key(c->srv->reg, &c->cl, m->name, &rn); /* an error is told where the name is used */
  rc = gpd_file_get_start(c, seq, &rn, 1);
  if (rc == GPUPOOL_ENOENT && m->timeout_ms > 0) {
    if ((rc = gpd_waiter_add(c, seq, WAIT_GET_FILE, m->timeout_ms, NULL, 0, 0, &rn, 1, 0, NULL)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc == 0)
    *deferred = 1;
  return rc;
}
