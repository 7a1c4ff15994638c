/*
 * Off-loop operations on files clients handed in (fileops.c): the system calls that may wait
 * on the file's file system (fstat, open, close) run on libuv's worker threads, never on the
 * loop, and at most a few per tenant at a time.
 */
#ifndef GPUPOOL_FILEOPS_H
#define GPUPOOL_FILEOPS_H

#include <stdint.h>
#include <uv.h>

#include "hmap.h"

/* File operations one tenant may have on worker threads at once, and in the whole daemon (libuv's
 * pool has 4 threads by default): one tenant whose file system stalls holds at most
 * PER_TENANT of them, so others' operations still run. */
#define GPUPOOL_FILEOPS_PER_TENANT 2
#define GPUPOOL_FILEOPS_TOTAL 4
/* Requests of one tenant queued behind those (closes are never refused: they only wait). */
#define GPUPOOL_FILEOPS_QUEUE_PER_TENANT 32
/* A tenant with this many operations, closes included, running or queued: the server stops
 * reading its connections until they drain (each queued close holds an fd it sent). */
#define GPUPOOL_FILEOPS_BACKLOG_PAUSE 64

typedef struct gpd_fop gpd_fop;

/* One operation. Embed it first in a struct of the caller's with the operation's inputs and
 * results. work runs on a worker thread and touches only the op; done runs on the loop once
 * work ran (or, at shutdown, instead of it: then cancelled is set) and frees the op. */
struct gpd_fop {
  uv_work_t req;
  struct gpd_fileops *ops;
  uint64_t tenant;
  void (*work)(gpd_fop *op);
  void (*done)(gpd_fop *op);
  int cancelled;
  gpd_fop *next; /* in its tenant's queue */
};

typedef struct gpd_fileops {
  uv_loop_t *loop;
  gpupool__hmap tenants; /* tenant -> its queue and count */
  uint32_t running;      /* on worker threads, all tenants */
  uint64_t queued;       /* waiting for a slot, all tenants */
  int stopping;
  /* Called on the loop when a tenant's backlog fell below GPUPOOL_FILEOPS_BACKLOG_PAUSE. */
  void (*on_drain)(void *arg, uint64_t tenant);
  void *drain_arg;
} gpd_fileops;

/* NULL when out of memory. */
gpd_fileops *gpd_fileops_new(uv_loop_t *loop);
/* Run op off the loop (now, or once its tenant and the daemon have a slot). 0, or
 * GPUPOOL_EBUSY with a message when the tenant already has too many waiting; op is then still
 * the caller's. */
int gpd_fileops_submit(gpd_fileops *ops, gpd_fop *op);
/* Close fd off the loop (a close on a FUSE file waits for the server's answer to FLUSH). Never
 * fails; fd < 0 is ignored. */
void gpd_fileops_close(gpd_fileops *ops, uint64_t tenant, int fd);
/* Operations of tenant running or queued, closes included. */
uint32_t gpd_fileops_backlog(const gpd_fileops *ops, uint64_t tenant);
/* Cancel what has not started (done is called with cancelled set) and free ops once what runs
 * has finished (the loop waits for it). Closes after this happen at once, on the loop. */
void gpd_fileops_free(gpd_fileops *ops);

#endif
