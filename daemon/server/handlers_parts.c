/*
 * The request of sharded versions: PublishPart, one part of a version that is published when
 * its last part is in (parts.c keeps the parts; this answers and wakes the getters).
 */
#include <inttypes.h>

#include "server_internal.h"

int gpd_handle_publish_part(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  const Gpupool__Wire__PublishPart *m = req->publish_part;
  Gpupool__Wire__PublishPartReply pr = GPUPOOL__WIRE__PUBLISH_PART_REPLY__INIT;
  gpd_part_result res;
  gpd_rname rn;
  int rc;
  (void)deferred;
  gpd_name_key(c->srv->reg, &c->cl, m->name, &rn); /* an error is told where the name is used */
  rc = gpd_publish_part(c->srv->reg, &c->cl, &rn, m->version, m->part, m->parts, m->hold_ids, m->n_hold_ids,
                        m->members, m->n_members, m->layout_id, &res);
  if (rc != 0)
    return rc;
  if (res.complete)
    gpd_published(c, &rn, res.version);
  pr.version = res.version;
  pr.parts_in = res.parts_in;
  pr.complete = res.complete;
  GPUPOOL__SEND_BODY(c, req->seq, PUBLISH_PART, publish_part, &pr);
  GPUPOOL__DEBUG("client %" PRIu64 " published part %u of %u of '%s' version %" PRIu64 "%s", c->cl.id, m->part,
                 m->parts, m->name, res.version, res.complete ? ": complete, published" : "");
  return 0;
}
