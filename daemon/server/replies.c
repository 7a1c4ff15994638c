/*
 * Replies that hand a client something: a hold on one buffer, a bundle, a published file.
 * They name the slab, send its export data (and fd) the first time the client sees it, and go
 * through the held-back path when the client asked for host fences.
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

#include "server_internal.h"

/* ---- replies carrying a buffer -------------------------------------------------------------- */

void gpd_srv_reply_hold(gpd_conn *c, uint64_t seq, int kind, gpd_hold *h, const gpd_rname *rn,
                             uint64_t version) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AllocateReply ar = GPUPOOL__WIRE__ALLOCATE_REPLY__INIT;
  Gpupool__Wire__GetReply gr = GPUPOOL__WIRE__GET_REPLY__INIT;
  Gpupool__Wire__OpenReply orp = GPUPOOL__WIRE__OPEN_REPLY__INIT;
  gpd_desc_storage ds;

  gpd_fill_desc(c->srv->reg, &c->cl, h, rn, &ds);
  switch (kind) {
  case WAIT_ALLOC:
    ar.buffer = &ds.desc;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ALLOCATE;
    rep.allocate = &ar;
    break;
  case WAIT_GET:
    gr.buffer = &ds.desc;
    gr.version = version;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET;
    rep.get = &gr;
    break;
  default:
    orp.buffer = &ds.desc;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_OPEN;
    rep.open = &orp;
    break;
  }
  if (kind == WAIT_ALLOC)
    gpd_send_reply(c, seq, &rep, ds.fd >= 0 ? &ds.fd : NULL, ds.fd >= 0 ? 1 : 0);
  else
    gpd_send_reply_fenced(c, seq, &rep, ds.fd >= 0 ? &ds.fd : NULL, ds.fd >= 0 ? 1 : 0, &h, 1);
}

void gpd_srv_reply_open_many(gpd_conn *c, uint64_t seq, gpd_hold **hs, uint32_t nhs) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__OpenReply orp = GPUPOOL__WIRE__OPEN_REPLY__INIT;
  gpd_desc_storage *ds = NULL;
  Gpupool__Wire__BufferDesc **more = NULL;
  int fds[GPUPOOL_WIRE_MAX_FDS], nfds = 0;
  if (!(ds = calloc(nhs, sizeof *ds)) || !(more = calloc(nhs, sizeof *more))) {
    for (uint32_t i = 0; i < nhs; i++)
      gpd_hold_discard(c->srv->reg, hs[i]);
    gpd_send_error(c, seq, GPUPOOL_ENOMEM, "out of memory in the daemon building the open's reply");
    goto out;
  }
  for (uint32_t i = 0; i < nhs; i++) {
    gpd_fill_desc(c->srv->reg, &c->cl, hs[i], NULL, &ds[i]);
    if (i > 0)
      more[i - 1] = &ds[i].desc;
    if (ds[i].fd >= 0 && nfds < GPUPOOL_WIRE_MAX_FDS)
      fds[nfds++] = ds[i].fd;
  }
  orp.buffer = &ds[0].desc;
  orp.n_more = nhs - 1;
  orp.more = more;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_OPEN;
  rep.open = &orp;
  gpd_send_reply_fenced(c, seq, &rep, nfds ? fds : NULL, nfds, hs, nhs);
out:
  free(ds);
  free(more);
}

/* A bundle reply: one BufferDesc per hold (the slab fds that go with them, in that order) and
 * the member table, left out when the client said it has it (known_layout). nm: the name it
 * was got by (a single buffer without members comes as one member named ""), or NULL for an
 * allocation. */
void gpd_srv_reply_bundle(gpd_conn *c, uint64_t seq, int kind, gpd_hold **hs, uint32_t nhs,
                               const gpd_layout *layout, const gpd_name *nm, uint64_t known_layout) {
  const gpd_member *members = layout ? layout->members : NULL;
  uint32_t nmembers = layout ? layout->n : 0;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AllocateBundleReply ar = GPUPOOL__WIRE__ALLOCATE_BUNDLE_REPLY__INIT;
  Gpupool__Wire__GetBundleReply gr = GPUPOOL__WIRE__GET_BUNDLE_REPLY__INIT;
  Gpupool__Wire__Bundle b = GPUPOOL__WIRE__BUNDLE__INIT;
  gpd_member single;
  gpd_desc_storage *ds = NULL;
  Gpupool__Wire__BufferDesc **descs = NULL;
  Gpupool__Wire__BundleMember *wm = NULL, **wmp = NULL;
  Gpupool__Wire__TensorMeta *tm = NULL;
  int fds[GPUPOOL_WIRE_MAX_FDS], nfds = 0;

  if (layout && known_layout == layout->id)
    nmembers = 0; /* the client has this table */
  else if (!members) {
    /* A buffer gpd_published on its own: one member covering it, with the name's description. */
    memset(&single, 0, sizeof single);
    single.name = (char *)"";
    single.size = hs[0]->buf->asked;
    single.meta = nm && nm->has_meta ? (gpupool_tensor_meta *)&nm->meta : NULL;
    members = &single;
    nmembers = 1;
  }
  if (!(ds = calloc(nhs, sizeof *ds)) || !(descs = calloc(nhs, sizeof *descs)) ||
      !(wm = calloc(nmembers + 1, sizeof *wm)) || !(wmp = calloc(nmembers + 1, sizeof *wmp)) ||
      !(tm = calloc(nmembers + 1, sizeof *tm))) {
    /* The holds go with the connection; the client learns why. */
    for (uint32_t i = 0; i < nhs; i++)
      gpd_hold_discard(c->srv->reg, hs[i]);
    gpd_send_error(c, seq, GPUPOOL_ENOMEM, "out of memory in the daemon building the bundle's reply");
    goto out;
  }
  for (uint32_t i = 0; i < nhs; i++) {
    gpd_fill_desc(c->srv->reg, &c->cl, hs[i], NULL, &ds[i]);
    descs[i] = &ds[i].desc;
    if (ds[i].fd >= 0 && nfds < GPUPOOL_WIRE_MAX_FDS)
      fds[nfds++] = ds[i].fd;
  }
  for (uint32_t i = 0; i < nmembers; i++) {
    gpupool__wire__bundle_member__init(&wm[i]);
    wm[i].name = members[i].name;
    wm[i].buffer = members[i].buffer;
    wm[i].offset = members[i].offset;
    wm[i].size = members[i].size;
    if (members[i].meta) {
      gpupool__wire_meta_to(members[i].meta, &tm[i]);
      wm[i].tensor = &tm[i];
    }
    wmp[i] = &wm[i];
  }
  b.n_buffers = nhs;
  b.buffers = descs;
  b.n_members = nmembers;
  b.members = wmp;
  b.version = nm ? nm->version : 0;
  b.layout_id = layout ? layout->id : 0;
  if (kind == WAIT_ABUNDLE) {
    ar.bundle = &b;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ALLOCATE_BUNDLE;
    rep.allocate_bundle = &ar;
  } else {
    gr.bundle = &b;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET_BUNDLE;
    rep.get_bundle = &gr;
  }
  if (kind == WAIT_ABUNDLE)
    gpd_send_reply(c, seq, &rep, nfds ? fds : NULL, nfds);
  else
    gpd_send_reply_fenced(c, seq, &rep, nfds ? fds : NULL, nfds, hs, nhs);
out:
  free(ds);
  free(descs);
  free(wm);
  free(wmp);
  free(tm);
}

/* A file name's description, and its fd in the same frame. kind: the reply body case. */
void gpd_srv_reply_file(gpd_conn *c, uint64_t seq, const gpd_file *f, const gpd_rname *rn, int kind, int fd) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__PublishFileReply pr = GPUPOOL__WIRE__PUBLISH_FILE_REPLY__INIT;
  Gpupool__Wire__GetFileReply gr = GPUPOOL__WIRE__GET_FILE_REPLY__INIT;
  Gpupool__Wire__FileInfo fi = GPUPOOL__WIRE__FILE_INFO__INIT;
  fi.name = (char *)rn->name;
  fi.offset = f->offset;
  fi.length = f->length;
  fi.size = f->size;
  fi.dev = f->dev;
  fi.ino = f->ino;
  fi.mtime_sec = f->mtime_sec;
  fi.mtime_nsec = f->mtime_nsec;
  fi.path = f->path;
  if (kind == GPUPOOL__WIRE__REPLY__BODY_GET_FILE) {
    gr.file = &fi;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET_FILE;
    rep.get_file = &gr;
    gpd_send_reply(c, seq, &rep, &fd, 1);
  } else {
    pr.file = &fi;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE;
    rep.publish_file = &pr;
    gpd_send_reply(c, seq, &rep, NULL, 0);
  }
}
