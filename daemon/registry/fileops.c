/*
 * Off-loop file operations. The daemon is one thread; a file a client hands in may live on a
 * file system that answers slowly or never (a FUSE server that stops reading /dev/fuse), and
 * fstat, open and even close of such a file wait for it (close sends FLUSH). So every such
 * call runs here, on libuv's worker threads, with the result handed back to the loop.
 *
 * Fairness: each tenant may have GPUPOOL_FILEOPS_PER_TENANT operations on workers at once and
 * the daemon GPUPOOL_FILEOPS_TOTAL, so a tenant whose file system stalls ties up its own
 * slots only. Requests beyond that wait in the tenant's queue, at most
 * GPUPOOL_FILEOPS_QUEUE_PER_TENANT of them; more are refused with EBUSY. Closes always queue
 * (the fd is already ours and must go), and are taken before requests. A tenant's queue is
 * served in order; tenants waiting for a daemon-wide slot are served round-robin as slots free.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "errors.h"
#include "fileops.h"
#include "log.h"

typedef struct {
  uint64_t tenant;
  uint32_t running;
  uint32_t nqueued;  /* requests queued (closes not counted) */
  uint32_t backlog;  /* running and queued, closes included */
  gpd_fop *head, *tail;
} tq;

typedef struct {
  gpd_fop op;
  int fd;
} close_op;

static void close_work(gpd_fop *op) { close(((close_op *)op)->fd); }
static void close_done(gpd_fop *op) { free(op); }

static void pump(gpd_fileops *ops);
static void ops_free_if_idle(gpd_fileops *ops);

static void on_work(uv_work_t *req) {
  gpd_fop *op = req->data;
  op->work(op);
}

static void tq_maybe_free(gpd_fileops *ops, tq *q) {
  if (!q->running && !q->head) {
    gpupool__hmap_del(&ops->tenants, q->tenant);
    free(q);
  }
}

static void on_after_work(uv_work_t *req, int status) {
  gpd_fop *op = req->data;
  gpd_fileops *ops = op->ops;
  uint64_t tenant = op->tenant;
  tq *q = gpupool__hmap_get(&ops->tenants, tenant);
  int drained = 0;
  ops->running--;
  if (q) {
    q->running--;
    drained = q->backlog-- == GPUPOOL_FILEOPS_BACKLOG_PAUSE;
    tq_maybe_free(ops, q);
  }
  if (status == UV_ECANCELED) {
    op->cancelled = 1;
    if (op->work == close_work)
      close_work(op); /* shutting down: the fd still goes */
  }
  op->done(op);
  if (ops->stopping) {
    ops_free_if_idle(ops);
    return;
  }
  pump(ops);
  if (drained && ops->on_drain)
    ops->on_drain(ops->drain_arg, tenant);
}

static void start(gpd_fileops *ops, tq *q, gpd_fop *op) {
  op->req.data = op;
  q->running++;
  ops->running++;
  if (uv_queue_work(ops->loop, &op->req, on_work, on_after_work) != 0) {
    /* Cannot happen with a live loop; run it here rather than lose it. */
    op->work(op);
    q->running--;
    q->backlog--;
    ops->running--;
    op->done(op);
  }
}

/* Start what the slots allow: one per tenant per pass, so tenants share the free slots. */
static void pump(gpd_fileops *ops) {
  int progress = 1;
  while (progress && ops->running < GPUPOOL_FILEOPS_TOTAL && ops->queued) {
    progress = 0;
    for (size_t i = 0; i < ops->tenants.cap && ops->running < GPUPOOL_FILEOPS_TOTAL; i++) {
      tq *q;
      gpd_fop *op;
      if (!gpupool__hmap_slot_used(&ops->tenants, i))
        continue;
      q = ops->tenants.slots[i].val;
      if (!q->head || q->running >= GPUPOOL_FILEOPS_PER_TENANT)
        continue;
      op = q->head;
      q->head = op->next;
      if (!q->head)
        q->tail = NULL;
      if (op->work != close_work)
        q->nqueued--;
      ops->queued--;
      start(ops, q, op);
      progress = 1;
    }
  }
}

static tq *tq_get(gpd_fileops *ops, uint64_t tenant) {
  tq *q = gpupool__hmap_get(&ops->tenants, tenant);
  if (q)
    return q;
  if (!(q = calloc(1, sizeof *q)))
    return NULL;
  q->tenant = tenant;
  if (gpupool__hmap_put(&ops->tenants, tenant, q) != 0) {
    free(q);
    return NULL;
  }
  return q;
}

static void enqueue(gpd_fileops *ops, tq *q, gpd_fop *op, int front) {
  op->next = NULL;
  if (front && q->head) {
    op->next = q->head;
    q->head = op;
  } else {
    if (q->tail)
      q->tail->next = op;
    else
      q->head = op;
    q->tail = op;
  }
  q->backlog++;
  ops->queued++;
}

gpd_fileops *gpd_fileops_new(uv_loop_t *loop) {
  gpd_fileops *ops = calloc(1, sizeof *ops);
  if (!ops)
    return NULL;
  ops->loop = loop;
  gpupool__hmap_init(&ops->tenants);
  return ops;
}

static void ops_free_if_idle(gpd_fileops *ops) {
  if (!ops->stopping || ops->running)
    return;
  for (size_t i = 0; i < ops->tenants.cap; i++)
    if (gpupool__hmap_slot_used(&ops->tenants, i))
      free(ops->tenants.slots[i].val);
  gpupool__hmap_free(&ops->tenants);
  free(ops);
}

uint32_t gpd_fileops_backlog(const gpd_fileops *ops, uint64_t tenant) {
  const tq *q = gpupool__hmap_get(&ops->tenants, tenant);
  return q ? q->backlog : 0;
}

int gpd_fileops_submit(gpd_fileops *ops, gpd_fop *op) {
  tq *q;
  op->ops = ops;
  op->cancelled = 0;
  if (!(q = tq_get(ops, op->tenant)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  if (q->nqueued >= GPUPOOL_FILEOPS_QUEUE_PER_TENANT) {
    int rc = gpupool__err(GPUPOOL_EBUSY,
                          "%u file operations of this tenant already wait behind %u that run (its files answer "
                          "slowly, e.g. a stalled FUSE server): try again once they complete",
                          (unsigned)q->nqueued, (unsigned)q->running);
    tq_maybe_free(ops, q); /* after the message: it may free q */
    return rc;
  }
  q->nqueued++;
  enqueue(ops, q, op, 0);
  pump(ops);
  return 0;
}

void gpd_fileops_close(gpd_fileops *ops, uint64_t tenant, int fd) {
  close_op *op = NULL;
  tq *q;
  if (fd < 0)
    return;
  if (ops->stopping || !(op = calloc(1, sizeof *op)) || !(q = tq_get(ops, tenant))) {
    if (!ops->stopping)
      free(op);
    /* Out of memory, or the loop is going away: close it here rather than leak it. */
    close(fd);
    return;
  }
  op->fd = fd;
  op->op.ops = ops;
  op->op.tenant = tenant;
  op->op.work = close_work;
  op->op.done = close_done;
  enqueue(ops, q, &op->op, 1);
  pump(ops);
}

void gpd_fileops_free(gpd_fileops *ops) {
  if (!ops)
    return;
  ops->stopping = 1;
  for (size_t i = 0; i < ops->tenants.cap; i++) {
    tq *q;
    if (!gpupool__hmap_slot_used(&ops->tenants, i))
      continue;
    q = ops->tenants.slots[i].val;
    while (q->head) {
      gpd_fop *op = q->head;
      q->head = op->next;
      ops->queued--;
      op->cancelled = 1;
      if (op->work == close_work)
        close_work(op);
      op->done(op);
    }
    q->tail = NULL;
    q->nqueued = 0;
  }
  ops_free_if_idle(ops);
}
