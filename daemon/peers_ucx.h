/*
 * The peers' data plane (peers_ucx.c): one UCX ucp context and worker, driven from the
 * daemon's libuv loop (the worker's event fd in a uv_poll, ucp_worker_arm, a bounded number of
 * progress calls per loop turn), registrations of memory ranges with packed rkeys for exactly
 * those ranges, endpoints to other daemons' workers, and RMA gets. peers.c is its only user.
 * Compiled only when UCX is found (GPUPOOL_HAVE_UCX).
 */
#ifndef GPUPOOL_DAEMON_PEERS_UCX_H
#define GPUPOOL_DAEMON_PEERS_UCX_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct gpd_ucx gpd_ucx;
typedef struct gpd_ucx_reg gpd_ucx_reg;
typedef struct gpd_ucx_ep gpd_ucx_ep;

/* A get finished: status 0, or a GPUPOOL_E* code (its message in gpupool__errmsg()). Called
 * from the loop after the progress calls, never from inside UCX. */
typedef void (*gpd_ucx_done)(void *arg, int status);

/* The context and worker on loop; logs the transports and how device memory would move.
 * 0 or GPUPOOL_EBACKEND with the reason. */
int gpd_ucx_open(uv_loop_t *loop, gpd_ucx **out);
/* Progress until nothing is left to do (bounded), handing out what completed: after closing
 * the endpoints at shutdown, so that their gets end before their memory goes. */
void gpd_ucx_flush(gpd_ucx *u);
/* Closes the worker and context (every registration first). Gets that never completed are
 * dropped without their callbacks. */
void gpd_ucx_close(gpd_ucx *u);
/* The worker's address (owned by u), to hand to peers. */
void gpd_ucx_address(gpd_ucx *u, const void **addr, size_t *len);
/* "ucx 1.13.1 (tcp, ...)" for logs and gpupoolctl. */
const char *gpd_ucx_describe(gpd_ucx *u);

/* Register [addr, addr + len) (host memory the daemon maps). */
int gpd_ucx_reg_new(gpd_ucx *u, void *addr, size_t len, gpd_ucx_reg **out);
/* The packed rkey of the whole registration (*buf malloc'd: the caller frees it). */
int gpd_ucx_rkey(gpd_ucx_reg *r, void **buf, size_t *len);
void gpd_ucx_reg_free(gpd_ucx_reg *r);

/* An endpoint to the worker at addr. */
int gpd_ucx_ep_new(gpd_ucx *u, const void *addr, size_t len, gpd_ucx_ep **out);
/* done is called once the endpoint is connected both ways (its wireup finished), or failed. */
int gpd_ucx_ep_flush(gpd_ucx_ep *ep, gpd_ucx_done done, void *arg);
/* Close it: gets still running on it end with an error (their callbacks still come, later,
 * from the loop); ep is freed once they have. */
void gpd_ucx_ep_close(gpd_ucx_ep *ep);

/* Read len bytes at raddr (rkey: a packed rkey of the peer's) into local (inside lreg). done
 * is called exactly once, also when the endpoint is closed first. */
int gpd_ucx_get(gpd_ucx_ep *ep, void *local, gpd_ucx_reg *lreg, uint64_t raddr, const void *rkey, size_t rkeylen,
                size_t len, gpd_ucx_done done, void *arg);

#endif
